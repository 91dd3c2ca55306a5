//! `cudaMalloc` and `cudaFree` (CUDA runtime ABI), and two runtime functions forwarded as they
//! are (see `cudaHostGetFlags`).
#![allow(non_snake_case)] // the vendor ABI names these functions

use super::guarded;
use crate::device::Vendor;
use crate::forward::{CUDA_FREE, CUDA_GET_LAST_ERROR, CUDA_HOST_GET_FLAGS, CUDA_MALLOC};
use crate::{existing_saver, region};
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

/// Torch mode on CUDA: the runtime reached without our own symbol in between (torch mode is
/// dlopened, so nothing is interposed).
pub(crate) static TORCH: super::TorchAllocator = super::TorchAllocator {
    vendor: Vendor::Cuda,
    runtime_malloc: |size| {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: the runtime's cudaMalloc.
        let rc = CUDA_MALLOC.resolve(0).map(|f| unsafe { std::mem::transmute::<usize, MallocFn>(f)(&mut p, size) });
        if rc == Some(0) { p } else { std::ptr::null_mut() }
    },
    runtime_free: |ptr| {
        if let Some(f) = CUDA_FREE.resolve(0) {
            // SAFETY: the runtime's cudaFree.
            unsafe { std::mem::transmute::<usize, FreeFn>(f)(ptr) };
        }
    },
    region_malloc: |size, flags| Some(crate::region_malloc(Vendor::Cuda, size, crate::device::DEFAULT_KIND, flags)),
};

/// Inside a region: releasable memory under the thread's tag. Outside: the real `cudaMalloc`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMalloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    guarded(
        || real_malloc(ptr, size),
        || {
            crate::control::on_hooked_call();
            let flags = match region::flags() {
                Some(flags) if size != 0 => flags,
                _ => return real_malloc(ptr, size),
            };
            if ptr.is_null() {
                return ERROR_INVALID_VALUE;
            }
            match crate::region_malloc(Vendor::Cuda, size, crate::device::DEFAULT_KIND, flags) {
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

/// torch_memory_saver's libraries link the CUDA runtime, so callers look runtime functions up
/// through their handle (its test suite does `CDLL(lib).cudaHostGetFlags` and `cudaGetLastError`
/// to see whether a backup buffer is still pinned). This library loads the runtime at run time
/// instead, so it exports those two as plain forwarders; in a preloaded hook they pass every call
/// straight to the runtime.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaHostGetFlags(flags: *mut libc::c_uint, host: *mut c_void) -> c_int {
    type HostGetFlagsFn = unsafe extern "C" fn(*mut libc::c_uint, *mut c_void) -> c_int;
    match CUDA_HOST_GET_FLAGS.resolve(cudaHostGetFlags as *const () as usize) {
        // SAFETY: the runtime's cudaHostGetFlags, with the caller's arguments.
        Some(f) => unsafe { std::mem::transmute::<usize, HostGetFlagsFn>(f)(flags, host) },
        None => ERROR_INITIALIZATION,
    }
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaGetLastError() -> c_int {
    type GetLastErrorFn = unsafe extern "C" fn() -> c_int;
    match CUDA_GET_LAST_ERROR.resolve(cudaGetLastError as *const () as usize) {
        // SAFETY: the runtime's cudaGetLastError.
        Some(f) => unsafe { std::mem::transmute::<usize, GetLastErrorFn>(f)() },
        None => ERROR_INITIALIZATION,
    }
}
