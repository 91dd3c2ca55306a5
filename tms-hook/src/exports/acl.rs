//! `aclrtMalloc`, `aclrtMallocAlign32` and `aclrtFree` (Ascend runtime ABI).
#![allow(non_snake_case)] // the vendor ABI names these functions

use super::guarded;
use crate::device::{Vendor, acl};
use crate::forward::{ACL_FREE, ACL_MALLOC, ACL_MALLOC_ALIGN32, Target};
use crate::saver::Error;
use crate::{existing_saver, region};
use libc::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

const ERROR_INVALID_PARAM: c_int = 100_000;
const ERROR_UNINITIALIZE: c_int = 100_001;
const ERROR_INTERNAL: c_int = 507_899;

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize, c_int) -> c_int;

/// A region allocation of the physical memory `policy` asks for (huge pages first falling back
/// to normal ones where the policy says so). None: a policy tms cannot reproduce; the caller
/// passes the call through (untracked, never paused), and it is said once.
pub(super) fn region_malloc(size: usize, policy: c_int, flags: region::Flags) -> Option<super::RegionResult> {
    let Some((kind, fallback)) = acl::memory_for_policy(policy, size) else {
        static SAID: AtomicBool = AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "tms: aclrtMalloc policy {policy:#x} cannot be reproduced with physical memory; such allocations stay resident (not paused)"
            );
        }
        return None;
    };
    let first = crate::region_malloc(Vendor::Acl, size, kind, flags);
    Some(match (first, fallback) {
        (Err(e), Some(normal)) if out_of_memory(&e) => crate::region_malloc(Vendor::Acl, size, normal, flags),
        (result, _) => result,
    })
}

/// Torch mode on Ascend: the runtime reached without our own symbol in between (torch mode is
/// dlopened, so nothing is interposed). torch_npu's caching allocator asks for huge pages first
/// (policy 0).
pub(crate) static TORCH: super::TorchAllocator = super::TorchAllocator {
    vendor: Vendor::Acl,
    runtime_malloc: |size| {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: the runtime's aclrtMalloc.
        let rc = ACL_MALLOC.resolve(0).map(|f| unsafe { std::mem::transmute::<usize, MallocFn>(f)(&mut p, size, 0) });
        if rc == Some(0) { p } else { std::ptr::null_mut() }
    },
    runtime_free: |ptr| {
        if let Some(f) = ACL_FREE.resolve(0) {
            // SAFETY: the runtime's aclrtFree.
            unsafe { std::mem::transmute::<usize, FreeFn>(f)(ptr) };
        }
    },
    region_malloc: |size, flags| region_malloc(size, 0, flags),
};

fn out_of_memory(e: &Error) -> bool {
    const RT_MEMORY_ALLOCATION: c_int = 207_001;
    match e {
        Error::OutOfMemory { .. } => true,
        Error::Driver(d) => d.code == RT_MEMORY_ALLOCATION,
        _ => false,
    }
}
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;

fn real_malloc(target: &Target, own: usize, ptr: *mut *mut c_void, size: usize, policy: c_int) -> c_int {
    match target.resolve(own) {
        // SAFETY: the runtime's allocator of this signature.
        Some(f) => unsafe { std::mem::transmute::<usize, MallocFn>(f)(ptr, size, policy) },
        None => {
            tracing::warn!("tms: {:?} called but no Ascend runtime is loaded", target.name);
            ERROR_UNINITIALIZE
        }
    }
}

fn malloc(target: &'static Target, own: usize, ptr: *mut *mut c_void, size: usize, policy: c_int) -> c_int {
    guarded(
        || real_malloc(target, own, ptr, size, policy),
        || {
            crate::control::on_hooked_call();
            let flags = match region::flags() {
                Some(flags) if size != 0 => flags,
                _ => return real_malloc(target, own, ptr, size, policy),
            };
            if ptr.is_null() {
                return ERROR_INVALID_PARAM;
            }
            let Some(result) = region_malloc(size, policy, flags) else {
                return real_malloc(target, own, ptr, size, policy);
            };
            match result {
                Ok(Some(addr)) => {
                    // SAFETY: checked non-null.
                    unsafe { *ptr = addr as *mut c_void };
                    0
                }
                Ok(None) => real_malloc(target, own, ptr, size, policy),
                Err(e) => {
                    tracing::debug!("tms: {:?}({size}) in region: {e}", target.name);
                    e.vendor_code(ERROR_INVALID_PARAM)
                }
            }
        },
        || ERROR_INTERNAL,
    )
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn aclrtMalloc(ptr: *mut *mut c_void, size: usize, policy: c_int) -> c_int {
    malloc(&ACL_MALLOC, aclrtMalloc as *const () as usize, ptr, size, policy)
}

/// What torch_npu's caching allocator calls (through `dlsym(handle, …)`, see exports/dlsym.rs).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn aclrtMallocAlign32(ptr: *mut *mut c_void, size: usize, policy: c_int) -> c_int {
    malloc(&ACL_MALLOC_ALIGN32, aclrtMallocAlign32 as *const () as usize, ptr, size, policy)
}

fn real_free(ptr: *mut c_void) -> c_int {
    match ACL_FREE.resolve(aclrtFree as *const () as usize) {
        // SAFETY: the runtime's aclrtFree.
        Some(f) => unsafe { std::mem::transmute::<usize, FreeFn>(f)(ptr) },
        None => ERROR_UNINITIALIZE,
    }
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn aclrtFree(ptr: *mut c_void) -> c_int {
    guarded(
        || real_free(ptr),
        || match existing_saver().and_then(|s| s.free(ptr as u64)) {
            None => real_free(ptr),
            Some(Ok(())) => 0,
            Some(Err(e)) => e.vendor_code(ERROR_INVALID_PARAM),
        },
        || ERROR_INTERNAL,
    )
}
