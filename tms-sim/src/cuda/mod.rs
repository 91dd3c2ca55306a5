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
