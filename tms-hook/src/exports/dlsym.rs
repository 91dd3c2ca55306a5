//! The `dlsym` interposer.
//!
//! torch_npu reaches `aclrtMallocAlign32` with `dlsym(handle_of_libascendcl, name)`, a lookup that
//! never sees preloaded definitions. So `dlsym` itself is interposed: a lookup on a specific handle
//! of one of the five intercepted names returns the hook's function (and the real address it
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
            _ => return 0,
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
