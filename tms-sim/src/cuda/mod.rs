//! The CUDA front end: the runtime (`libcudart.so.12`, `libcudart.so.13`), the driver
//! (`libcuda.so.1`), NVML (`libnvidia-ml.so.1`) and NCCL (`libnccl.so.2`), each turning the
//! core's errors into its own codes. This module holds the state they share: the thread's
//! runtime device and last error, the driver's initialization and the primary contexts. The
//! thread's current context is the core's `context::current`, which this front end alone sets.

pub mod driver;
pub mod exports;
pub mod nccl;
pub mod nvml;
pub mod runtime;

use crate::core::config::MAX_DEVICES;
use crate::core::memory::MemError;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set by cuInit and by any runtime call (the runtime initializes the driver implicitly).
pub static DRIVER_INIT: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The runtime's device for this thread (cudaSetDevice).
    pub static RT_DEVICE: Cell<usize> = const { Cell::new(0) };
    /// cudaGetLastError's value.
    pub static LAST_ERROR: Cell<i32> = const { Cell::new(0) };
}

/// Opaque context handles are addresses inside this array, one byte per device.
pub static CUDA_CTX_TOKENS: [u8; MAX_DEVICES] = [0; MAX_DEVICES];

/// Whether each device's primary context exists in this process (`cuDevicePrimaryCtxGetState`).
static PRIMARY_ACTIVE: [AtomicBool; MAX_DEVICES] = [const { AtomicBool::new(false) }; MAX_DEVICES];

/// Creates the process's primary CUDA context on `dev` if needed; false: the device is full.
pub fn open_cuda_context(dev: usize) -> bool {
    crate::core::context::open(&PRIMARY_ACTIVE, dev, crate::core::config::CUDA_CONTEXT_BYTES)
}

/// Device memory the driver takes for a process's first created streams on a device: 2 MiB on
/// an NVIDIA H200 with driver 580.159.04, where four `cuStreamCreate` calls lowered
/// `cuMemGetInfo`'s free figure by 2 MiB and events and pinned host memory by nothing (measured
/// with the hardware kit, docs/hardware.md, 2026-11-27). CUDA documents no figure. Held until the
/// process exits, as the context's memory is.
pub const STREAM_POOL_BYTES: u64 = 2 << 20;
static STREAM_POOL: [AtomicBool; MAX_DEVICES] = [const { AtomicBool::new(false) }; MAX_DEVICES];

/// Charges `dev` for the stream pool on the process's first created stream there; false: the
/// device is full (the create then fails with the API's out-of-memory code).
pub fn charge_stream_pool(dev: usize) -> bool {
    let Some(flag) = STREAM_POOL.get(dev) else { return false };
    if flag.load(Ordering::Acquire) {
        return true;
    }
    static CHARGING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = CHARGING.lock().unwrap_or_else(|e| e.into_inner());
    if flag.load(Ordering::Acquire) {
        return true;
    }
    if !crate::core::sim::sim().node.charge(dev, STREAM_POOL_BYTES) {
        return false;
    }
    flag.store(true, Ordering::Release);
    true
}

pub fn primary_active(dev: usize) -> bool {
    PRIMARY_ACTIVE.get(dev).is_some_and(|f| f.load(Ordering::Relaxed))
}

/// The device the calling thread's CUDA calls work on: its current context's, else the
/// runtime's (cudaSetDevice's).
pub fn current_device() -> usize {
    crate::core::context::current().unwrap_or_else(|| RT_DEVICE.with(|d| d.get()))
}

/// The sticky fault of the calling thread's CUDA device, if any.
pub fn current_cuda_fault() -> Option<MemError> {
    crate::core::sim::sticky_fault(current_device())
}
