//! Torch mode: PyTorch's `CUDAPluggableAllocator` and torch_npu's `NPUPluggableAllocator` call
//! these instead of the runtime's allocator. Same region, tag and backup semantics as the preload
//! path, on whichever vendor's driver is present. Loaded this way (dlopen, not preloaded), the
//! library's other exports interpose nothing.

use super::{TORCH_ALLOCATORS, TorchAllocator, guarded};
use crate::{region, saver};
use libc::{c_int, c_void, ssize_t};

/// The first vendor (in `Vendor::ALL`'s order) whose driver loads.
fn allocator() -> Option<&'static TorchAllocator> {
    let s = saver();
    TORCH_ALLOCATORS.into_iter().find(|t| s.device(t.vendor).is_some())
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_torch_malloc(size: ssize_t, _device: c_int, _stream: *mut c_void) -> *mut c_void {
    guarded(
        std::ptr::null_mut,
        || {
            let Some(t) = allocator() else { return std::ptr::null_mut() };
            if size <= 0 {
                return std::ptr::null_mut();
            }
            let Some(flags) = region::flags() else { return (t.runtime_malloc)(size as usize) };
            match (t.region_malloc)(size as usize, flags) {
                Some(Ok(Some(addr))) => addr as *mut c_void,
                None | Some(Ok(None)) => (t.runtime_malloc)(size as usize),
                Some(Err(e)) => {
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
            if let Some(t) = allocator() {
                (t.runtime_free)(ptr);
            }
        },
        || (),
    )
}
