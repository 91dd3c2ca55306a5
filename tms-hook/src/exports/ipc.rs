//! Exports of region memory to other processes or peers, refused by the hook with a message.
//!
//! Another process that opens region memory (a CUDA IPC handle, an Ascend IPC key) or a peer that
//! maps it through an NCCL window holds on to the physical pages it was given: after a pause
//! releases them and the resume maps new ones at the same address, the importer would go on
//! reading the old pages, silently stale. Region memory is made with the virtual-memory calls
//! and requests no shareable handle type, which devices already refuse to export this way (CUDA
//! Runtime API, cudaIpcGetMemHandle; CANN, aclrtIpcMemGetExportKey: only aclrtMalloc memory), but
//! the refusal arrives as a bare "invalid argument" from deep inside a framework. So the hook
//! refuses these calls itself, with the same code, whatever the driver would do, and says which
//! tag's memory it was and what to do instead. Memory outside every region goes through untouched.
//!
//! These are interposed only in preload mode (torch mode is loaded after the runtime, which then
//! refuses on its own, without the message). Shareable handles (`cuMemExportToShareableHandle`,
//! `aclrtMemExportToShareableHandle`) need a physical handle, which only the hook holds, made with
//! no handle type to export to.
#![allow(non_snake_case)] // the vendor ABI names these functions

use crate::existing_saver;
use crate::forward::{ASCENDCL, CUDART, Target};
use libc::{c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// cudaErrorInvalidValue: what the runtime answers for memory it cannot export.
const CUDA_INVALID_VALUE: c_int = 1;
const CUDA_INITIALIZATION: c_int = 3;
/// ACL_ERROR_RT_PARAM_INVALID: the runtime's answer for memory without an export key.
const ACL_RT_PARAM_INVALID: c_int = 107_000;
const ACL_UNINITIALIZE: c_int = 100_001;
/// ncclInvalidUsage.
const NCCL_INVALID_USAGE: c_int = 5;
const NCCL_INTERNAL_ERROR: c_int = 3;

pub(crate) static CUDA_IPC_GET_MEM_HANDLE: Target = Target::new(c"cudaIpcGetMemHandle", CUDART);
pub(crate) static ACL_IPC_GET_EXPORT_KEY: Target = Target::new(c"aclrtIpcMemGetExportKey", ASCENDCL);
pub(crate) static NCCL_WINDOW_REGISTER: Target = Target::new(c"ncclCommWindowRegister", super::nccl::NCCL);

/// The interposed name `name`, as (its forwarding target, the hook's function), for lookups on a
/// library's own handle (exports/dlsym.rs).
pub(crate) fn interposed(name: &[u8]) -> Option<(&'static Target, usize)> {
    let own = |f: *const ()| f as usize;
    Some(match name {
        b"cudaIpcGetMemHandle" => (&CUDA_IPC_GET_MEM_HANDLE, own(cudaIpcGetMemHandle as *const ())),
        b"aclrtIpcMemGetExportKey" => (&ACL_IPC_GET_EXPORT_KEY, own(aclrtIpcMemGetExportKey as *const ())),
        b"ncclCommWindowRegister" => (&NCCL_WINDOW_REGISTER, own(ncclCommWindowRegister as *const ())),
        _ => return None,
    })
}

/// Says why `call` on `ptr` is refused, if `ptr` is region memory; never unwinds.
fn refused(call: &str, ptr: *const c_void, what_breaks: &str, instead: &str) -> bool {
    catch_unwind(AssertUnwindSafe(|| {
        let Some((start, size, tag)) = existing_saver().and_then(|s| s.region_allocation_at(ptr as u64)) else {
            return false;
        };
        tracing::error!(
            "tms: {call}({ptr:p}) refused: the address is region memory of tag '{tag}' (the allocation of {size} \
             bytes at {start:#x}), which a pause releases; {what_breaks}. {instead}"
        );
        true
    }))
    .unwrap_or(false)
}

const IPC_BREAKS: &str = "another process that opened it would keep reading the released pages after the resume";
const IPC_INSTEAD: &str = "Allocate what another process opens outside every region (outside `region()`, or \
                           under `disable()`), as the weight-transfer buffers of colocated frameworks are.";

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaIpcGetMemHandle(handle: *mut c_void, ptr: *mut c_void) -> c_int {
    type F = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
    if refused("cudaIpcGetMemHandle", ptr, IPC_BREAKS, IPC_INSTEAD) {
        return CUDA_INVALID_VALUE;
    }
    match CUDA_IPC_GET_MEM_HANDLE.resolve(cudaIpcGetMemHandle as *const () as usize) {
        // SAFETY: the runtime's function, with the caller's arguments.
        Some(f) => unsafe { std::mem::transmute::<usize, F>(f)(handle, ptr) },
        None => CUDA_INITIALIZATION,
    }
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn aclrtIpcMemGetExportKey(
    dev_ptr: *mut c_void,
    size: usize,
    key: *mut c_char,
    len: usize,
    flags: u64,
) -> c_int {
    type F = unsafe extern "C" fn(*mut c_void, usize, *mut c_char, usize, u64) -> c_int;
    if refused("aclrtIpcMemGetExportKey", dev_ptr, IPC_BREAKS, IPC_INSTEAD) {
        return ACL_RT_PARAM_INVALID;
    }
    match ACL_IPC_GET_EXPORT_KEY.resolve(aclrtIpcMemGetExportKey as *const () as usize) {
        // SAFETY: the runtime's function, with the caller's arguments.
        Some(f) => unsafe { std::mem::transmute::<usize, F>(f)(dev_ptr, size, key, len, flags) },
        None => ACL_UNINITIALIZE,
    }
}

/// A window is registered by every rank together and maps each rank's pages into its peers; NCCL
/// has no way to take one down and make it again outside a collective call of all ranks, so a
/// window over region memory would outlive the pages a pause releases.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: *mut c_void,
    buff: *mut c_void,
    size: usize,
    win: *mut *mut c_void,
    win_flags: c_int,
) -> c_int {
    type F = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut *mut c_void, c_int) -> c_int;
    if refused(
        "ncclCommWindowRegister",
        buff,
        "the peers that map a window keep the released pages after the resume",
        "Register windows on memory outside every region (ncclMemAlloc, or an allocation outside `region()`).",
    ) {
        return NCCL_INVALID_USAGE;
    }
    match NCCL_WINDOW_REGISTER.resolve(ncclCommWindowRegister as *const () as usize) {
        // SAFETY: NCCL's function, with the caller's arguments.
        Some(f) => unsafe { std::mem::transmute::<usize, F>(f)(comm, buff, size, win, win_flags) },
        None => {
            tracing::warn!("tms: ncclCommWindowRegister called but no NCCL library providing it is loaded");
            NCCL_INTERNAL_ERROR
        }
    }
}
