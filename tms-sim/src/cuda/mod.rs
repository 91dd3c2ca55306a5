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
use crate::core::sim::CopyDirection;
use crate::core::streams::{DefaultStream, StreamId, StreamKind};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use tms_vendor::cuda as v;

/// The CUDA version the simulated stack presents (runtime, driver and NVML alike): 13.2, the
/// runtime PyTorch's current wheels are built for.
pub const CUDA_VERSION: i32 = 13020;

/// Device memory a process's CUDA context takes on its device: 300 MiB, as PyTorch maintainers
/// report for a context with lazy module loading, the default since CUDA 12.2 (300-400 MB,
/// pytorch/pytorch#107667; 274 MiB measured in pytorch/pytorch#86509).
pub const CONTEXT_BYTES: u64 = 300 << 20;

/// The core's stream for a CUDA stream handle. 0 is the legacy default stream in programs built
/// with the default (legacy) behaviour, as is `cudaStreamLegacy`/`CU_STREAM_LEGACY`;
/// `cudaStreamPerThread`/`CU_STREAM_PER_THREAD` is the per-thread one.
pub fn stream_id(handle: usize) -> StreamId {
    match handle {
        0 | v::STREAM_LEGACY => StreamId::Default(DefaultStream::Legacy),
        v::STREAM_PER_THREAD => StreamId::Default(DefaultStream::PerThread),
        h => StreamId::Created(h),
    }
}

/// `cudaStreamNonBlocking`/`CU_STREAM_NON_BLOCKING` in a stream's flags.
pub fn stream_kind(flags: u32) -> StreamKind {
    if flags & v::STREAM_NON_BLOCKING != 0 { StreamKind::NonBlocking } else { StreamKind::Blocking }
}

/// The flags `cudaStreamGetFlags` reports for a stream of `kind`.
pub fn stream_flags(kind: StreamKind) -> u32 {
    match kind {
        StreamKind::Blocking => v::STREAM_DEFAULT,
        StreamKind::NonBlocking => v::STREAM_NON_BLOCKING,
    }
}

/// A `cudaMemcpyKind`; None for a value the runtime refuses.
pub fn copy_direction(kind: i32) -> Option<CopyDirection> {
    Some(match kind {
        v::MEMCPY_HOST_TO_HOST => CopyDirection::HostToHost,
        v::MEMCPY_HOST_TO_DEVICE => CopyDirection::HostToDevice,
        v::MEMCPY_DEVICE_TO_HOST => CopyDirection::DeviceToHost,
        v::MEMCPY_DEVICE_TO_DEVICE => CopyDirection::DeviceToDevice,
        v::MEMCPY_DEFAULT => CopyDirection::Inferred,
        _ => return None,
    })
}

/// Set by cuInit and by any runtime call (the runtime initializes the driver implicitly).
/// `TMS_SIM_CUDA=0`: the node's devices are Ascend NPUs only, and CUDA sees none, as on a 910B
/// host where a CUDA build of PyTorch finds no NVIDIA driver. torch_npu refuses to load beside a
/// CUDA device ("Two accelerators cannot be used at the same time").
pub fn cuda_hidden() -> bool {
    static HIDDEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HIDDEN.get_or_init(|| std::env::var("TMS_SIM_CUDA").is_ok_and(|v| v.trim() == "0"))
}

/// cudaErrorNoDevice and CUDA_ERROR_NO_DEVICE, what both APIs report with no device.
pub const NO_DEVICE: i32 = 100;

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
    crate::core::context::open(&PRIMARY_ACTIVE, dev, CONTEXT_BYTES)
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
