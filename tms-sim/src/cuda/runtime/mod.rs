//! The CUDA runtime ABI (`libcudart.so.12` and `libcudart.so.13`), by family: memory and copies,
//! devices, streams and events, module registration and launches. `cuda/exports.rs` declares every
//! exported name once; this module holds what every family shares: error codes, the thread's
//! last error, the implicit context, and the "not supported" answer.

/// The implicit context of a runtime call (see `enter`): the thread's device, or the call returns
/// cudaErrorMemoryAllocation when the context cannot be created because the device is full.
macro_rules! enter {
    () => {
        match $crate::cuda::runtime::enter() {
            Ok(dev) => dev,
            Err(code) => return code,
        }
    };
}

pub mod devices;
pub mod graphs;
pub mod ipc;
pub mod launch;
pub mod memory;
pub mod streams;

use crate::core::context;
use crate::core::fault;
use crate::core::memory::MemError;
use crate::core::sim::guard;
use crate::cuda::{DRIVER_INIT, LAST_ERROR, RT_DEVICE};
use libc::c_char;

/// The runtime version presented (the driver and NVML present the same).
pub const RUNTIME_VERSION: i32 = crate::cuda::CUDA_VERSION;

pub const SUCCESS: i32 = 0;
pub const INVALID_VALUE: i32 = 1;
pub const MEMORY_ALLOCATION: i32 = 2;
pub const INVALID_DEVICE: i32 = 101;
pub const INVALID_DEVICE_FUNCTION: i32 = 98;
pub const NO_KERNEL_IMAGE: i32 = 209;
pub const INVALID_RESOURCE_HANDLE: i32 = 400;
pub const SYMBOL_NOT_FOUND: i32 = 500;
pub const NOT_READY: i32 = 600;
pub const ILLEGAL_ADDRESS: i32 = 700;
pub const PEER_ACCESS_ALREADY_ENABLED: i32 = 704;
pub const PEER_ACCESS_NOT_ENABLED: i32 = 705;
pub const HOST_MEMORY_ALREADY_REGISTERED: i32 = 712;
pub const HOST_MEMORY_NOT_REGISTERED: i32 = 713;
pub const NOT_SUPPORTED: i32 = 801;
pub const UNKNOWN: i32 = 999;

pub fn code_of(e: MemError) -> i32 {
    match e {
        MemError::Invalid => INVALID_VALUE,
        MemError::OutOfMemory | MemError::Host => MEMORY_ALLOCATION,
        MemError::IllegalAddress => ILLEGAL_ADDRESS,
    }
}

/// Records `code` as the thread's last error (as the runtime does) and returns it.
fn rt(code: i32) -> i32 {
    if code != SUCCESS {
        LAST_ERROR.with(|e| e.set(code));
    }
    code
}

/// Common prologue: the runtime initializes the driver and makes its device's primary context
/// current on first use by a thread, creating it if the process has none (which takes device
/// memory, and fails with cudaErrorMemoryAllocation on a full device). Returns the thread's device.
fn enter() -> Result<usize, i32> {
    DRIVER_INIT.store(true, std::sync::atomic::Ordering::Release);
    if let Some(current) = context::current() {
        return Ok(current);
    }
    let dev = RT_DEVICE.with(|d| d.get());
    if !crate::cuda::open_cuda_context(dev) {
        return Err(MEMORY_ALLOCATION);
    }
    context::make_current(Some(dev));
    Ok(dev)
}

/// Runs a runtime call: panics become cudaErrorUnknown, failures are recorded for
/// cudaGetLastError, and injected faults are honoured.
fn call(name: &str, body: impl FnOnce() -> i32) -> i32 {
    rt(guard(UNKNOWN, || {
        // A context that met an illegal address is dead: every call that uses it fails with that
        // code (queries of devices and versions, which need no context, still answer).
        if let Some(fault) = crate::cuda::current_cuda_fault()
            && !NEEDS_NO_CONTEXT.contains(&name)
        {
            return code_of(fault);
        }
        fault::check(name, MEMORY_ALLOCATION).unwrap_or_else(body)
    }))
}

/// Runtime calls that still answer after a sticky fault.
const NEEDS_NO_CONTEXT: &[&str] = &[
    "cudaGetDevice",
    "cudaGetDeviceCount",
    "cudaGetDeviceProperties",
    "cudaDeviceGetAttribute",
    "cudaDeviceGetPCIBusId",
    "cudaPointerGetAttributes",
];

fn result(r: Result<(), MemError>) -> i32 {
    r.map_or_else(code_of, |()| SUCCESS)
}

/// Writes `value` through `out`, or answers cudaErrorInvalidValue for a null pointer.
fn put<T>(out: *mut T, value: T) -> i32 {
    if out.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: checked non-null; the caller provides a writable location.
    unsafe { out.write(value) };
    SUCCESS
}

/// The answer of every entry point the simulator does not implement: cudaErrorNotSupported,
/// recorded as the last error (so frameworks that check it raise), and one log line per name.
pub(crate) fn not_supported(name: &str) -> i32 {
    crate::core::config::warn_not_supported(name, "cudaErrorNotSupported");
    rt(NOT_SUPPORTED)
}

/// The last error, cleared, unless the context holds a sticky fault, which stays.
pub unsafe extern "C" fn cuda_get_last_error() -> i32 {
    let last = LAST_ERROR.with(|e| e.replace(SUCCESS));
    crate::cuda::current_cuda_fault().map_or(last, code_of)
}

pub unsafe extern "C" fn cuda_peek_at_last_error() -> i32 {
    crate::cuda::current_cuda_fault().map_or_else(|| LAST_ERROR.with(|e| e.get()), code_of)
}

const ERRORS: &[(i32, &std::ffi::CStr, &std::ffi::CStr)] = &[
    (0, c"cudaSuccess", c"no error"),
    (1, c"cudaErrorInvalidValue", c"invalid argument"),
    (2, c"cudaErrorMemoryAllocation", c"out of memory"),
    (3, c"cudaErrorInitializationError", c"initialization error"),
    (4, c"cudaErrorCudartUnloading", c"driver shutting down"),
    (98, c"cudaErrorInvalidDeviceFunction", c"invalid device function"),
    (101, c"cudaErrorInvalidDevice", c"invalid device ordinal"),
    (
        209,
        c"cudaErrorNoKernelImageForDevice",
        c"no kernel image is available for execution on the device (tms-sim runs no kernels: \
          enable the simulator's CPU compute layer, see docs/simulator.md)",
    ),
    (400, c"cudaErrorInvalidResourceHandle", c"invalid resource handle"),
    (500, c"cudaErrorSymbolNotFound", c"named symbol not found"),
    (600, c"cudaErrorNotReady", c"device not ready"),
    (700, c"cudaErrorIllegalAddress", c"an illegal memory access was encountered"),
    (704, c"cudaErrorPeerAccessAlreadyEnabled", c"peer access is already enabled"),
    (705, c"cudaErrorPeerAccessNotEnabled", c"peer access has not been enabled"),
    (712, c"cudaErrorHostMemoryAlreadyRegistered", c"part or all of the requested memory range is already mapped"),
    (713, c"cudaErrorHostMemoryNotRegistered", c"pointer does not correspond to a registered memory region"),
    (719, c"cudaErrorLaunchFailure", c"unspecified launch failure"),
    (900, c"cudaErrorStreamCaptureUnsupported", c"operation not permitted when stream is capturing"),
    (901, c"cudaErrorStreamCaptureInvalidated", c"operation failed due to a previous error during capture"),
    (801, c"cudaErrorNotSupported", c"operation not supported (by tms-sim: see docs/simulator.md)"),
    (999, c"cudaErrorUnknown", c"unknown error"),
];

pub unsafe extern "C" fn cuda_get_error_string(code: i32) -> *const c_char {
    ERRORS.iter().find(|e| e.0 == code).map_or(c"unrecognized error code".as_ptr(), |e| e.2.as_ptr())
}

pub unsafe extern "C" fn cuda_get_error_name(code: i32) -> *const c_char {
    ERRORS.iter().find(|e| e.0 == code).map_or(c"unrecognized error code".as_ptr(), |e| e.1.as_ptr())
}
