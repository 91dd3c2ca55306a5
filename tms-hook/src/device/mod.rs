//! One trait for a vendor's virtual-memory and copy primitives. The saver, registry and backup
//! know nothing else of CUDA or ACL: a third vendor is one new file here and one in exports/.

pub mod acl;
pub mod cuda;

use std::fmt;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Vendor {
    Cuda,
    Acl,
}

impl Vendor {
    /// Every vendor, in the order a caller that can use any of them tries them (torch mode asks
    /// for CUDA first).
    pub const ALL: [Vendor; 2] = [Vendor::Cuda, Vendor::Acl];

    pub fn name(self) -> &'static str {
        match self {
            Vendor::Cuda => "cuda",
            Vendor::Acl => "acl",
        }
    }

    /// Loads this vendor's driver (the saver calls it once, on first need).
    pub fn load(self) -> Result<Arc<dyn Device>, String> {
        match self {
            Vendor::Cuda => cuda::Cuda::load().map(|d| Arc::new(d) as Arc<dyn Device>),
            Vendor::Acl => acl::Acl::load().map(|d| Arc::new(d) as Arc<dyn Device>),
        }
    }
}

/// A failed driver call: which one and the vendor's code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceError {
    pub op: &'static str,
    pub code: i32,
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} returned {}{}", self.op, self.code, tms_vendor::explain(self.op, self.code))
    }
}

pub type DevResult<T> = Result<T, DeviceError>;

/// Opaque handles as the vendor gives them (CUDA: a 64-bit handle; ACL: a pointer).
pub type PhysHandle = u64;
/// A vendor's kind of physical memory: Ascend's `aclrtMemAttr` (huge or normal pages, P2P,
/// 1 GiB pages), chosen from the allocation's malloc policy; CUDA has one kind (`DEFAULT_KIND`).
pub type MemKind = i32;
pub const DEFAULT_KIND: MemKind = 0;
pub type Stream = usize;

/// `bind_thread`'s answer when the thread already had the device: nothing to restore.
pub const UNCHANGED: usize = usize::MAX;

pub trait Device: Send + Sync {
    fn vendor(&self) -> Vendor;
    /// The vendor's "out of memory" code (what allocation calls return when the device is full).
    fn oom_code(&self) -> i32;
    /// The vendor's "invalid value" code.
    fn invalid_code(&self) -> i32;
    fn is_oom(&self, code: i32) -> bool {
        code == self.oom_code()
    }
    /// Whether asynchronous copies may use pageable host memory (the "mmap" backup backend).
    /// Where they may not, backups are pinned whatever the backend asked for.
    fn copies_pageable_memory(&self) -> bool {
        false
    }
    /// The device the calling thread works on.
    fn current_device(&self) -> DevResult<i32>;
    /// Makes `dev` current on the calling thread (a control thread has no context of its own).
    /// Returns what to hand to `restore_thread` to put the thread back as it was.
    fn bind_thread(&self, dev: i32) -> DevResult<usize>;
    /// Devices this process already has a context on, found without creating one (a context
    /// costs hundreds of MiB of the device's memory). Empty where the vendor cannot tell.
    fn active_devices(&self) -> Vec<i32> {
        Vec::new()
    }
    fn restore_thread(&self, previous: usize);
    fn granularity(&self, dev: i32, kind: MemKind) -> DevResult<usize>;
    fn reserve(&self, size: usize) -> DevResult<u64>;
    fn free_reservation(&self, addr: u64, size: usize) -> DevResult<()>;
    fn create(&self, dev: i32, size: usize, kind: MemKind) -> DevResult<PhysHandle>;
    fn release(&self, handle: PhysHandle) -> DevResult<()>;
    fn map(&self, addr: u64, size: usize, handle: PhysHandle) -> DevResult<()>;
    fn set_access(&self, dev: i32, addr: u64, size: usize) -> DevResult<()>;
    fn unmap(&self, addr: u64, size: usize) -> DevResult<()>;
    /// Waits for all work on the calling thread's device.
    fn synchronize(&self) -> DevResult<()>;
    /// Waits for the work a pause must not cut short: what the application queued where a
    /// synchronous copy would wait for it. Never for streams that do not synchronize with the
    /// default stream (communication streams may be blocked on a peer that waits for this
    /// process). Vendors without that distinction wait for the whole device.
    fn wait_for_queued_work(&self) -> DevResult<()> {
        self.synchronize()
    }
    /// (free, total) of the calling thread's device.
    fn mem_info(&self) -> DevResult<(u64, u64)>;
    fn host_alloc(&self, size: usize) -> DevResult<*mut u8>;
    fn host_free(&self, ptr: *mut u8);
    fn stream_create(&self) -> DevResult<Stream>;
    fn stream_synchronize(&self, stream: Stream) -> DevResult<()>;
    fn copy_to_host_async(&self, dst: *mut u8, src: u64, len: usize, stream: Stream) -> DevResult<()>;
    fn copy_to_device_async(&self, dst: u64, src: *const u8, len: usize, stream: Stream) -> DevResult<()>;
}

/// Resolves `name` in `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the function's true signature.
pub(crate) unsafe fn symbol<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
    // SAFETY: the caller guarantees the signature.
    unsafe { lib.get::<T>(name.as_bytes()).map(|s| *s).map_err(|e| format!("{name}: {e}")) }
}
