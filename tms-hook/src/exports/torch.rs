//! Torch mode: PyTorch's `CUDAPluggableAllocator` and torch_npu's `NPUPluggableAllocator` call
//! these instead of the runtime's allocator. Same region, tag and backup semantics as the preload
//! path, on whichever vendor's driver is present. Loaded this way (dlopen, not preloaded), the
//! library's other exports interpose nothing.

use super::guarded;
use crate::device::Vendor;
use crate::forward::{ACL_FREE, ACL_MALLOC, CUDA_FREE, CUDA_MALLOC};
use crate::{region, saver};
use libc::{c_int, c_void, ssize_t};

/// CUDA when its driver loads, else Ascend.
fn vendor() -> Option<Vendor> {
    let s = saver();
    if s.device(Vendor::Cuda).is_some() {
        Some(Vendor::Cuda)
    } else if s.device(Vendor::Acl).is_some() {
        Some(Vendor::Acl)
    } else {
        None
    }
}

fn runtime_malloc(vendor: Vendor, size: usize) -> *mut c_void {
    let mut p: *mut c_void = std::ptr::null_mut();
    let rc = match vendor {
        Vendor::Cuda => CUDA_MALLOC.resolve(0).map(|f| {
            // SAFETY: the runtime's cudaMalloc.
            unsafe {
                std::mem::transmute::<usize, unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int>(f)(&mut p, size)
            }
        }),
        Vendor::Acl => ACL_MALLOC.resolve(0).map(|f| {
            // SAFETY: the runtime's aclrtMalloc; policy 0 = huge pages first, as torch_npu.
            unsafe {
                std::mem::transmute::<usize, unsafe extern "C" fn(*mut *mut c_void, usize, c_int) -> c_int>(f)(
                    &mut p, size, 0,
                )
            }
        }),
    };
    if rc == Some(0) { p } else { std::ptr::null_mut() }
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_torch_malloc(size: ssize_t, _device: c_int, _stream: *mut c_void) -> *mut c_void {
    guarded(
        std::ptr::null_mut,
        || {
            let Some(v) = vendor() else { return std::ptr::null_mut() };
            if size <= 0 {
                return std::ptr::null_mut();
            }
            if !region::in_region() {
                return runtime_malloc(v, size as usize);
            }
            let result = match v {
                Vendor::Cuda => crate::region_malloc(v, size as usize, crate::device::DEFAULT_KIND),
                // torch_npu's caching allocator asks for huge pages first (policy 0).
                Vendor::Acl => match super::acl::region_malloc(size as usize, 0) {
                    Some(r) => r,
                    None => return runtime_malloc(v, size as usize),
                },
            };
            match result {
                Ok(Some(addr)) => addr as *mut c_void,
                Ok(None) => runtime_malloc(v, size as usize),
                Err(e) => {
                    tracing::debug!("tms: tms_torch_malloc({size}): {e}");
                    std::ptr::null_mut()
                }
            }
        },
        std::ptr::null_mut,
    )
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_torch_free(ptr: *mut c_void, _size: ssize_t, _device: c_int, _stream: *mut c_void) {
    guarded(
        || (),
        || {
            if ptr.is_null() {
                return;
            }
            if saver().free(ptr as u64).is_some() {
                return;
            }
            let target = match vendor() {
                Some(Vendor::Cuda) => &CUDA_FREE,
                Some(Vendor::Acl) => &ACL_FREE,
                None => return,
            };
            if let Some(f) = target.resolve(0) {
                // SAFETY: the runtime's free of that vendor.
                unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_void) -> c_int>(f)(ptr) };
            }
        },
        || (),
    )
}
