//! libtms_hook.so: pause and resume tagged device memory of CUDA and Ascend processes.
//!
//! Loaded with `LD_PRELOAD`, it intercepts `cudaMalloc`/`cudaFree` and
//! `aclrtMalloc`/`aclrtMallocAlign32`/`aclrtFree` (also when reached through `dlsym(handle, …)`,
//! torch_npu's way). Allocations made inside a tagged region are backed by the driver's
//! virtual-memory API so their physical memory can be released and re-created at the same
//! address. It exports torch_memory_saver's C ABI and its own (`include/tms.h`).
//!
//! The library does nothing until a hooked call or an API call reaches it: no constructors, no
//! threads, no files in processes that never use a device.

pub mod backup;
pub mod comms;
pub mod config;
pub mod control;
pub mod device;
pub mod disk;
pub mod exports;
pub mod forward;
pub mod host_memory;
pub mod log;
pub mod region;
pub mod registrations;
pub mod registry;
pub mod saver;

use saver::Saver;
use std::sync::Once;
use std::sync::atomic::{AtomicPtr, Ordering};

/// The process's saver. Held behind a pointer rather than a `OnceLock` so that a forked child can
/// start afresh: a lock held by another thread at `fork()` would be held forever in the child, and
/// the parent's device memory is not the child's to manage.
static SAVER: AtomicPtr<Saver> = AtomicPtr::new(std::ptr::null_mut());

extern "C" fn forget_saver_in_child() {
    // The parent's saver is leaked on purpose: its locks may be held by threads that do not exist here.
    SAVER.store(std::ptr::null_mut(), Ordering::Release);
}

/// The saver, created on first use.
pub fn saver() -> &'static Saver {
    if let Some(s) = existing_saver() {
        return s;
    }
    static AT_FORK: Once = Once::new();
    AT_FORK.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(forget_saver_in_child)) };
    });
    log::init();
    let fresh = Box::into_raw(Box::new(Saver::new()));
    match SAVER.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: published once and never freed.
        Ok(_) => unsafe { &*fresh },
        Err(existing) => {
            // SAFETY: `fresh` was never published.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: published pointers are never freed.
            unsafe { &*existing }
        }
    }
}

/// A region allocation through the saver (see `Saver::malloc`). The first one also starts the
/// control socket: the saver knows nothing of the control plane, which drives it.
pub fn region_malloc(
    vendor: device::Vendor,
    size: usize,
    kind: device::MemKind,
    flags: region::Flags,
) -> Result<Option<u64>, saver::Error> {
    let result = saver().malloc(vendor, size, kind, flags);
    if let Ok(Some(_)) = result {
        control::ensure_started();
    }
    result
}

/// The saver if this process has one already (frees of untracked memory need no saver).
pub fn existing_saver() -> Option<&'static Saver> {
    let p = SAVER.load(Ordering::Acquire);
    // SAFETY: published pointers are never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}
