//! `aclrtMalloc`, `aclrtMallocAlign32` and `aclrtFree` (Ascend runtime ABI).
#![allow(non_snake_case)] // the vendor ABI names these functions

use super::guarded;
use crate::device::Vendor;
use crate::forward::{ACL_FREE, ACL_MALLOC, ACL_MALLOC_ALIGN32, Target};
use crate::{existing_saver, region};
use libc::{c_int, c_void};

const ERROR_INVALID_PARAM: c_int = 100_000;
const ERROR_UNINITIALIZE: c_int = 100_001;
const ERROR_INTERNAL: c_int = 507_899;

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize, c_int) -> c_int;
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
            if !region::in_region() || size == 0 {
                return real_malloc(target, own, ptr, size, policy);
            }
            if ptr.is_null() {
                return ERROR_INVALID_PARAM;
            }
            match crate::region_malloc(Vendor::Acl, size) {
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
