//! Every exported symbol, and nothing else: guard → call the core → map to an error code.
//! No export panics across the boundary, blocks forever, or exits the process.

pub mod acl;
pub mod api;
pub mod compat;
pub mod cuda;
pub mod dlsym;
pub mod hccl;
pub mod ipc;
pub mod nccl;
pub mod torch;

use crate::device::Vendor;
use crate::region;
use crate::saver::Error;
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// A region allocation's outcome: an address, `None` where no driver is loaded (the caller
/// passes the call through), or the error.
pub(crate) type RegionResult = Result<Option<u64>, Error>;

/// What torch mode (torch.rs) needs of a vendor's runtime, each vendor's file defining its own.
pub(crate) struct TorchAllocator {
    pub vendor: Vendor,
    /// The runtime's own allocation, as its framework's caching allocator makes it (null: failed).
    pub runtime_malloc: fn(usize) -> *mut libc::c_void,
    pub runtime_free: fn(*mut libc::c_void),
    /// A region allocation of the memory that framework asks for. None: tms cannot reproduce it,
    /// the runtime's own allocation serves instead.
    pub region_malloc: fn(usize, region::Flags) -> Option<RegionResult>,
}

/// Every vendor's, in the order of `Vendor::ALL`.
pub(crate) const TORCH_ALLOCATORS: [&TorchAllocator; 2] = [&cuda::TORCH, &acl::TORCH];

thread_local! {
    /// Set while this thread is inside the hook: a hooked call made by the driver or by our own
    /// code is forwarded untouched instead of re-entering (a re-entered lazy init would deadlock).
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Runs `body` as the hook; runs `nested` instead when re-entered on this thread; `on_panic`
/// gives the answer if `body` panics (the panic never crosses into C).
pub(crate) fn guarded<R>(nested: impl FnOnce() -> R, body: impl FnOnce() -> R, on_panic: impl FnOnce() -> R) -> R {
    if IN_HOOK.with(|c| c.replace(true)) {
        return nested();
    }
    let result = catch_unwind(AssertUnwindSafe(body));
    IN_HOOK.with(|c| c.set(false));
    result.unwrap_or_else(|_| on_panic())
}

/// For API calls that never forward: a panic becomes `on_panic`, re-entry runs the body too (the
/// API does not call back into itself).
pub(crate) fn api<R>(body: impl FnOnce() -> R, on_panic: R) -> R {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(on_panic)
}

/// Reads an optional C string (NULL and "" both mean "none").
///
/// # Safety
/// `p` is NULL or NUL-terminated.
pub(crate) unsafe fn opt_str(p: *const libc::c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller promises a NUL-terminated string.
    let s = unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned();
    (!s.is_empty()).then_some(s)
}

#[cfg(test)]
mod tests {
    #[test]
    fn torch_mode_tries_the_vendors_in_their_declared_order() {
        // Torch mode takes the first allocator whose driver loads: CUDA before Ascend, as before.
        assert_eq!(super::TORCH_ALLOCATORS.map(|t| t.vendor), crate::device::Vendor::ALL);
    }
}
