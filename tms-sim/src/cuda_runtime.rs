//! The CUDA runtime ABI (`libcudart.so.12`). Every entry point here is exported under its CUDA
//! name with the `libcudart.so.12` version node (see `cudart_export!` in lib.rs).

use crate::fault;
use crate::memory::MemError;
use crate::sim::{CUDA_CTX, CopyKind, DRIVER_INIT, LAST_ERROR, RT_DEVICE, guard, sim};
use libc::{c_char, c_int, c_uint, c_void};

pub const SUCCESS: i32 = 0;
pub const INVALID_VALUE: i32 = 1;
pub const MEMORY_ALLOCATION: i32 = 2;
pub const INVALID_DEVICE: i32 = 101;
pub const INVALID_RESOURCE_HANDLE: i32 = 400;
pub const ILLEGAL_ADDRESS: i32 = 700;
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
/// current on first use by a thread. Returns the thread's device.
fn enter() -> usize {
    DRIVER_INIT.store(true, std::sync::atomic::Ordering::Release);
    CUDA_CTX.with(|c| {
        if c.get() == 0 {
            c.set(RT_DEVICE.with(|d| d.get()) + 1);
        }
        c.get() - 1
    })
}

/// Runs a runtime call: panics become cudaErrorUnknown, failures are recorded for
/// cudaGetLastError, and injected faults are honoured.
fn call(name: &str, body: impl FnOnce() -> i32) -> i32 {
    rt(guard(UNKNOWN, || fault::check(name, MEMORY_ALLOCATION).unwrap_or_else(body)))
}

fn result(r: Result<(), MemError>) -> i32 {
    r.map_or_else(code_of, |()| SUCCESS)
}

pub unsafe extern "C" fn cuda_malloc(ptr: *mut *mut c_void, size: usize) -> i32 {
    call("cudaMalloc", || {
        if ptr.is_null() {
            return INVALID_VALUE;
        }
        let dev = enter();
        if size == 0 {
            // SAFETY: checked non-null; the caller passes a writable pointer.
            unsafe { *ptr = std::ptr::null_mut() };
            return SUCCESS;
        }
        match sim().plain_alloc(dev, size) {
            Ok(p) => {
                // SAFETY: as above.
                unsafe { *ptr = p as *mut c_void };
                SUCCESS
            }
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn cuda_free(ptr: *mut c_void) -> i32 {
    call("cudaFree", || {
        enter();
        if ptr.is_null() {
            // cudaFree(NULL) is how programs initialize the context.
            return SUCCESS;
        }
        result(sim().plain_free(ptr as usize))
    })
}

pub unsafe extern "C" fn cuda_malloc_async(ptr: *mut *mut c_void, size: usize, _stream: *mut c_void) -> i32 {
    // SAFETY: same contract as cudaMalloc.
    unsafe { cuda_malloc(ptr, size) }
}

pub unsafe extern "C" fn cuda_free_async(ptr: *mut c_void, _stream: *mut c_void) -> i32 {
    // SAFETY: same contract as cudaFree.
    unsafe { cuda_free(ptr) }
}

pub unsafe extern "C" fn cuda_malloc_host(ptr: *mut *mut c_void, size: usize) -> i32 {
    call("cudaMallocHost", || {
        if ptr.is_null() {
            return INVALID_VALUE;
        }
        enter();
        match sim().host_alloc(size) {
            Ok(p) => {
                // SAFETY: checked non-null.
                unsafe { *ptr = p as *mut c_void };
                SUCCESS
            }
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn cuda_host_alloc(ptr: *mut *mut c_void, size: usize, _flags: c_uint) -> i32 {
    // SAFETY: same contract as cudaMallocHost.
    unsafe { cuda_malloc_host(ptr, size) }
}

pub unsafe extern "C" fn cuda_free_host(ptr: *mut c_void) -> i32 {
    call("cudaFreeHost", || {
        enter();
        if ptr.is_null() {
            return SUCCESS;
        }
        result(sim().host_free(ptr as usize))
    })
}

pub unsafe extern "C" fn cuda_memcpy(dst: *mut c_void, src: *const c_void, count: usize, kind: c_int) -> i32 {
    call("cudaMemcpy", || {
        enter();
        let Some(kind) = CopyKind::from_code(kind) else { return INVALID_VALUE };
        sim().copy(dst as usize, src as usize, count, kind, 0, code_of).err().unwrap_or(SUCCESS)
    })
}

pub unsafe extern "C" fn cuda_memcpy_async(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
    stream: *mut c_void,
) -> i32 {
    call("cudaMemcpyAsync", || {
        enter();
        let Some(kind) = CopyKind::from_code(kind) else { return INVALID_VALUE };
        sim().copy(dst as usize, src as usize, count, kind, stream as usize, code_of).err().unwrap_or(SUCCESS)
    })
}

pub unsafe extern "C" fn cuda_memset(dst: *mut c_void, value: c_int, count: usize) -> i32 {
    call("cudaMemset", || {
        enter();
        result(sim().memset(dst as usize, value as u8, count))
    })
}

pub unsafe extern "C" fn cuda_memset_async(dst: *mut c_void, value: c_int, count: usize, _stream: *mut c_void) -> i32 {
    // SAFETY: same contract as cudaMemset; the simulator runs it synchronously.
    unsafe { cuda_memset(dst, value, count) }
}

pub unsafe extern "C" fn cuda_mem_get_info(free: *mut usize, total: *mut usize) -> i32 {
    call("cudaMemGetInfo", || {
        if free.is_null() || total.is_null() {
            return INVALID_VALUE;
        }
        let dev = enter();
        let (f, t) = sim().mem_info(dev);
        // SAFETY: checked non-null.
        unsafe {
            *free = f as usize;
            *total = t as usize;
        }
        SUCCESS
    })
}

pub unsafe extern "C" fn cuda_get_device(dev: *mut c_int) -> i32 {
    call("cudaGetDevice", || {
        if dev.is_null() {
            return INVALID_VALUE;
        }
        let d = enter();
        // SAFETY: checked non-null.
        unsafe { *dev = d as c_int };
        SUCCESS
    })
}

pub unsafe extern "C" fn cuda_set_device(dev: c_int) -> i32 {
    call("cudaSetDevice", || {
        let Some(d) = sim().valid_device(dev as i64) else { return INVALID_DEVICE };
        DRIVER_INIT.store(true, std::sync::atomic::Ordering::Release);
        RT_DEVICE.with(|c| c.set(d));
        CUDA_CTX.with(|c| c.set(d + 1));
        SUCCESS
    })
}

pub unsafe extern "C" fn cuda_get_device_count(count: *mut c_int) -> i32 {
    call("cudaGetDeviceCount", || {
        if count.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: checked non-null.
        unsafe { *count = sim().devices() as c_int };
        SUCCESS
    })
}

pub unsafe extern "C" fn cuda_device_synchronize() -> i32 {
    call("cudaDeviceSynchronize", || {
        let dev = enter();
        sim().synchronize(Some(dev))
    })
}

pub unsafe extern "C" fn cuda_device_reset() -> i32 {
    call("cudaDeviceReset", || {
        let dev = enter();
        sim().synchronize(Some(dev))
    })
}

pub unsafe extern "C" fn cuda_stream_create(stream: *mut *mut c_void) -> i32 {
    call("cudaStreamCreate", || {
        if stream.is_null() {
            return INVALID_VALUE;
        }
        let dev = enter();
        match sim().streams.create(dev) {
            Some(h) => {
                // SAFETY: checked non-null.
                unsafe { *stream = h as *mut c_void };
                SUCCESS
            }
            None => MEMORY_ALLOCATION,
        }
    })
}

pub unsafe extern "C" fn cuda_stream_create_with_flags(stream: *mut *mut c_void, _flags: c_uint) -> i32 {
    // SAFETY: same contract as cudaStreamCreate.
    unsafe { cuda_stream_create(stream) }
}

pub unsafe extern "C" fn cuda_stream_synchronize(stream: *mut c_void) -> i32 {
    call("cudaStreamSynchronize", || {
        enter();
        sim().streams.synchronize(stream as usize).unwrap_or(INVALID_RESOURCE_HANDLE)
    })
}

pub unsafe extern "C" fn cuda_stream_destroy(stream: *mut c_void) -> i32 {
    call("cudaStreamDestroy", || {
        enter();
        if sim().streams.destroy(stream as usize) { SUCCESS } else { INVALID_RESOURCE_HANDLE }
    })
}

pub unsafe extern "C" fn cuda_get_last_error() -> i32 {
    LAST_ERROR.with(|e| e.replace(SUCCESS))
}

pub unsafe extern "C" fn cuda_peek_at_last_error() -> i32 {
    LAST_ERROR.with(|e| e.get())
}

pub unsafe extern "C" fn cuda_runtime_get_version(v: *mut c_int) -> i32 {
    if v.is_null() {
        return rt(INVALID_VALUE);
    }
    // SAFETY: checked non-null.
    unsafe { *v = 12040 };
    SUCCESS
}

pub unsafe extern "C" fn cuda_driver_get_version(v: *mut c_int) -> i32 {
    // SAFETY: same contract.
    unsafe { cuda_runtime_get_version(v) }
}

const ERRORS: &[(i32, &std::ffi::CStr, &std::ffi::CStr)] = &[
    (0, c"cudaSuccess", c"no error"),
    (1, c"cudaErrorInvalidValue", c"invalid argument"),
    (2, c"cudaErrorMemoryAllocation", c"out of memory"),
    (3, c"cudaErrorInitializationError", c"initialization error"),
    (4, c"cudaErrorCudartUnloading", c"driver shutting down"),
    (101, c"cudaErrorInvalidDevice", c"invalid device ordinal"),
    (400, c"cudaErrorInvalidResourceHandle", c"invalid resource handle"),
    (700, c"cudaErrorIllegalAddress", c"an illegal memory access was encountered"),
    (801, c"cudaErrorNotSupported", c"operation not supported"),
    (999, c"cudaErrorUnknown", c"unknown error"),
];

pub unsafe extern "C" fn cuda_get_error_string(code: i32) -> *const c_char {
    ERRORS.iter().find(|e| e.0 == code).map_or(c"unrecognized error code".as_ptr(), |e| e.2.as_ptr())
}

pub unsafe extern "C" fn cuda_get_error_name(code: i32) -> *const c_char {
    ERRORS.iter().find(|e| e.0 == code).map_or(c"unrecognized error code".as_ptr(), |e| e.1.as_ptr())
}
