//! The `dlsym` interposer.
//!
//! torch_npu reaches `aclrtMallocAlign32` with `dlsym(handle_of_libascendcl, name)`, a lookup that
//! never sees preloaded definitions (and ctypes NCCL communicators reach `ncclCommInitRank` the
//! same way). So `dlsym` itself is interposed: a lookup on a specific handle of one of the
//! intercepted names (the five allocation calls, NCCL's and HCCL's communicator creation and
//! destruction)
//! returns the hook's function (and the real address it
//! found is kept as the forwarding target). Every other lookup must behave exactly as glibc's,
//! and glibc resolves `RTLD_NEXT` and `RTLD_DEFAULT` relative to the caller's return address, so
//! the entry point is a naked trampoline: it asks `decide` (a normal function) and then either
//! returns the hook's address or jumps to the real `dlsym` with the original arguments and return
//! address untouched.

use crate::forward::{self, Target};
use libc::{c_char, c_void};
use std::ffi::CStr;

/// Returns the hook's address for an intercepted (handle, name) lookup, else 0 (forward).
/// Also makes sure `forward::REAL_DLSYM` is resolved before the trampoline reads it.
extern "C" fn decide(handle: *mut c_void, name: *const c_char) -> usize {
    std::panic::catch_unwind(|| {
        forward::real_dlsym_addr();
        if handle.is_null() || handle == libc::RTLD_NEXT || name.is_null() {
            return 0;
        }
        // SAFETY: dlsym's contract: a NUL-terminated name.
        let n = unsafe { CStr::from_ptr(name) };
        let (target, own): (&Target, usize) = match n.to_bytes() {
            b"cudaMalloc" => (&forward::CUDA_MALLOC, super::cuda::cudaMalloc as *const () as usize),
            b"cudaFree" => (&forward::CUDA_FREE, super::cuda::cudaFree as *const () as usize),
            b"aclrtMalloc" => (&forward::ACL_MALLOC, super::acl::aclrtMalloc as *const () as usize),
            b"aclrtMallocAlign32" => {
                (&forward::ACL_MALLOC_ALIGN32, super::acl::aclrtMallocAlign32 as *const () as usize)
            }
            b"aclrtFree" => (&forward::ACL_FREE, super::acl::aclrtFree as *const () as usize),
            other => match super::nccl::interposed(other)
                .or_else(|| super::hccl::interposed(other))
                .or_else(|| super::ipc::interposed(other))
            {
                Some(found) => found,
                None => return vendor_through_own_handle(handle, n),
            },
        };
        // Only answer for handles that really provide the function; for others the real dlsym
        // reports the failure (and sets dlerror) itself.
        let real = forward::real_dlsym(handle, n) as usize;
        if real == 0 {
            return 0;
        }
        target.offer(real, own);
        own
    })
    .unwrap_or(0)
}

/// torch_memory_saver's libraries link the vendor runtime, so a lookup on their handle of a
/// vendor name they do not define (its tests do `CDLL(lib).cudaHostGetFlags`) finds the runtime's
/// through their dependencies. The hook loads the runtime at run time instead; for a lookup on its
/// own handle that glibc cannot answer, it answers from the vendor library already loaded (never
/// loading one). Other lookups are untouched.
fn vendor_through_own_handle(handle: *mut c_void, name: &CStr) -> usize {
    let bytes = name.to_bytes();
    let sonames = if bytes.starts_with(b"cuda") {
        forward::CUDART
    } else if bytes.starts_with(b"acl") {
        forward::ASCENDCL
    } else {
        return 0;
    };
    if own_handle() != Some(handle as usize) || !forward::real_dlsym(handle, name).is_null() {
        return 0;
    }
    sonames
        .iter()
        .find_map(|soname| {
            // SAFETY: RTLD_NOLOAD only returns a handle to an already loaded library.
            let h = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
            if h.is_null() {
                return None;
            }
            let p = forward::real_dlsym(h, name) as usize;
            // SAFETY: drops the reference RTLD_NOLOAD took; the library stays loaded.
            unsafe { libc::dlclose(h) };
            (p != 0).then_some(p)
        })
        .unwrap_or(0)
}

/// The handle `dlopen` gives for this library, under whatever name it was loaded.
fn own_handle() -> Option<usize> {
    static OWN: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *OWN.get_or_init(|| {
        // SAFETY: a zeroed Dl_info is a valid out-parameter.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: dladdr on one of our own functions names our file.
        if unsafe { libc::dladdr(decide as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: we are loaded; NOLOAD only returns our handle (its reference is kept: we stay).
        let h = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        (!h.is_null()).then_some(h as usize)
    })
}

#[cfg(target_arch = "x86_64")]
#[cfg_attr(not(test), unsafe(no_mangle))]
#[unsafe(naked)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        // Entry: rsp is 8 mod 16. Save the two arguments; the extra 8 bytes realign for the call.
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {decide}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jnz 2f",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 2f",
        // Tail jump: the real dlsym returns straight to our caller and sees its return address.
        "jmp rax",
        "2:",
        "ret",
        decide = sym decide,
        real = sym forward::REAL_DLSYM,
    )
}

#[cfg(target_arch = "aarch64")]
#[cfg_attr(not(test), unsafe(no_mangle))]
#[unsafe(naked)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "bl {decide}",
        "mov x16, x0",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "cbnz x16, 1f",
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "cbz x16, 2f",
        // Tail branch with x30 (the caller's return address) restored.
        "br x16",
        "1:",
        "mov x0, x16",
        "ret",
        "2:",
        "mov x0, #0",
        "ret",
        decide = sym decide,
        real = sym forward::REAL_DLSYM,
    )
}
