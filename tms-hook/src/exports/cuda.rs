//! `cudaMalloc` and `cudaFree` (CUDA runtime ABI).
#![allow(non_snake_case)] // the vendor ABI names these functions

use super::guarded;
use crate::device::Vendor;
use crate::forward::{CUDA_FREE, CUDA_MALLOC};
use crate::{existing_saver, region, saver};
use libc::{c_int, c_void};

const ERROR_INVALID_VALUE: c_int = 1;
const ERROR_INITIALIZATION: c_int = 3;
const ERROR_UNKNOWN: c_int = 999;

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;

fn real_malloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    match CUDA_MALLOC.resolve(cudaMalloc as *const () as usize) {
        // SAFETY: the runtime's cudaMalloc.
        Some(f) => unsafe { std::mem::transmute::<usize, MallocFn>(f)(ptr, size) },
        None => {
            tracing::warn!("tms: cudaMalloc called but no CUDA runtime is loaded");
            ERROR_INITIALIZATION
        }
    }
}

fn real_free(ptr: *mut c_void) -> c_int {
    match CUDA_FREE.resolve(cudaFree as *const () as usize) {
        // SAFETY: the runtime's cudaFree.
        Some(f) => unsafe { std::mem::transmute::<usize, FreeFn>(f)(ptr) },
        None => ERROR_INITIALIZATION,
    }
}

/// Inside a region: releasable memory under the thread's tag. Outside: the real `cudaMalloc`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMalloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    guarded(
        || real_malloc(ptr, size),
        || {
            crate::control::on_hooked_call();
            if !region::in_region() || size == 0 {
                return real_malloc(ptr, size);
            }
            if ptr.is_null() {
                return ERROR_INVALID_VALUE;
            }
            match saver().malloc(Vendor::Cuda, size) {
                Ok(Some(addr)) => {
                    // SAFETY: checked non-null; the caller passes a writable pointer.
                    unsafe { *ptr = addr as *mut c_void };
                    0
                }
                Ok(None) => real_malloc(ptr, size),
                Err(e) => {
                    tracing::debug!("tms: cudaMalloc({size}) in region: {e}");
                    e.vendor_code(ERROR_INVALID_VALUE)
                }
            }
        },
        || ERROR_UNKNOWN,
    )
}

/// Tracked pointers are unmapped, released and their range freed; everything else goes to the
/// real `cudaFree` (including `cudaFree(NULL)`, the context-initialization idiom).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> c_int {
    guarded(
        || real_free(ptr),
        || {
            if ptr.is_null() {
                return real_free(ptr);
            }
            match existing_saver().and_then(|s| s.free(ptr as u64)) {
                None => real_free(ptr),
                Some(Ok(())) => 0,
                Some(Err(e)) => e.vendor_code(ERROR_INVALID_VALUE),
            }
        },
        || ERROR_UNKNOWN,
    )
}
