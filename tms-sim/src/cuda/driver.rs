//! The CUDA driver ABI (`libcuda.so.1`), including the virtual-memory management calls.

use crate::core::config::GRANULARITY;
use crate::core::context;
use crate::core::fault;
use crate::core::memory::MemError;
use crate::core::sim::{CopyDirection, PointerKind, guard, sim};
use crate::core::streams::StreamId;
use crate::cuda::{CUDA_CTX_TOKENS, DRIVER_INIT};
use libc::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::atomic::Ordering;

pub const SUCCESS: i32 = 0;
pub const INVALID_VALUE: i32 = 1;
pub const OUT_OF_MEMORY: i32 = 2;
pub const NOT_INITIALIZED: i32 = 3;
pub const INVALID_DEVICE: i32 = 101;
pub const INVALID_CONTEXT: i32 = 201;
pub const INVALID_HANDLE: i32 = 400;
pub const ILLEGAL_ADDRESS: i32 = 700;
pub const NOT_SUPPORTED: i32 = 801;
pub const UNKNOWN: i32 = 999;

// The structs and their constants, declared once for every part of tms (tms-vendor).
pub use tms_vendor::cuda::{
    ACCESS_FLAGS_PROT_NONE, ACCESS_FLAGS_PROT_READ, ACCESS_FLAGS_PROT_READWRITE, ALLOCATION_TYPE_PINNED,
    AccessDesc as CuMemAccessDesc, AllocationProp as CuMemAllocationProp, LOCATION_TYPE_DEVICE,
};

pub fn code_of(e: MemError) -> i32 {
    match e {
        MemError::Invalid => INVALID_VALUE,
        MemError::OutOfMemory | MemError::Host => OUT_OF_MEMORY,
        MemError::IllegalAddress => ILLEGAL_ADDRESS,
    }
}

fn result(r: Result<(), MemError>) -> i32 {
    r.map_or_else(code_of, |()| SUCCESS)
}

/// Runs a driver call: not before cuInit; panics become CUDA_ERROR_UNKNOWN; faults injected.
fn call(name: &str, body: impl FnOnce() -> i32) -> i32 {
    guard(UNKNOWN, || {
        if !DRIVER_INIT.load(Ordering::Acquire) {
            return NOT_INITIALIZED;
        }
        // A context that met an illegal address is dead: every call fails with that code.
        if let Some(fault) = crate::cuda::current_cuda_fault() {
            return code_of(fault);
        }
        fault::check(name, OUT_OF_MEMORY).unwrap_or_else(body)
    })
}

/// The device of the calling thread's current context, for calls that need one.
fn current() -> Result<usize, i32> {
    context::current().ok_or(INVALID_CONTEXT)
}

/// Writes `value` through `out` if it is non-null.
fn put<T>(out: *mut T, value: T) -> i32 {
    if out.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: checked non-null; the caller provides a writable location.
    unsafe { out.write(value) };
    SUCCESS
}

pub unsafe extern "C" fn cu_init(flags: c_uint) -> i32 {
    guard(UNKNOWN, || {
        if flags != 0 {
            return INVALID_VALUE;
        }
        if crate::cuda::cuda_hidden() {
            return crate::cuda::NO_DEVICE;
        }
        fault::check("cuInit", NOT_INITIALIZED).unwrap_or_else(|| {
            sim();
            DRIVER_INIT.store(true, Ordering::Release);
            SUCCESS
        })
    })
}

pub unsafe extern "C" fn cu_driver_get_version(v: *mut c_int) -> i32 {
    put(v, crate::cuda::CUDA_VERSION)
}

pub unsafe extern "C" fn cu_device_get(dev: *mut c_int, ordinal: c_int) -> i32 {
    call("cuDeviceGet", || match sim().valid_device(ordinal as i64) {
        Some(d) => put(dev, d as c_int),
        None => INVALID_DEVICE,
    })
}

pub unsafe extern "C" fn cu_device_get_count(count: *mut c_int) -> i32 {
    call("cuDeviceGetCount", || {
        if crate::cuda::cuda_hidden() {
            return put(count, 0);
        }
        put(count, sim().devices() as c_int)
    })
}

pub unsafe extern "C" fn cu_device_get_attribute(value: *mut c_int, attr: c_int, dev: c_int) -> i32 {
    call("cuDeviceGetAttribute", || {
        if sim().valid_device(dev as i64).is_none() {
            return INVALID_DEVICE;
        }
        let Some(v) = crate::cuda::runtime::devices::attribute(attr) else { return INVALID_VALUE };
        put(value, v)
    })
}

pub unsafe extern "C" fn cu_device_get_name(name: *mut c_char, len: c_int, dev: c_int) -> i32 {
    call("cuDeviceGetName", || {
        if name.is_null() || len <= 0 {
            return INVALID_VALUE;
        }
        if sim().valid_device(dev as i64).is_none() {
            return INVALID_DEVICE;
        }
        let text = format!("tms-sim device {dev}");
        let n = text.len().min(len as usize - 1);
        // SAFETY: writes at most len bytes into the caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), name.cast(), n);
            *name.add(n) = 0;
        }
        SUCCESS
    })
}

pub unsafe extern "C" fn cu_device_total_mem(bytes: *mut usize, dev: c_int) -> i32 {
    call("cuDeviceTotalMem_v2", || match sim().valid_device(dev as i64) {
        Some(_) => put(bytes, sim().node.capacity() as usize),
        None => INVALID_DEVICE,
    })
}

pub unsafe extern "C" fn cu_device_primary_ctx_retain(ctx: *mut *mut c_void, dev: c_int) -> i32 {
    call("cuDevicePrimaryCtxRetain", || match sim().valid_device(dev as i64) {
        Some(d) if crate::cuda::open_cuda_context(d) => put(ctx, context::handle(&CUDA_CTX_TOKENS, d)),
        Some(_) => OUT_OF_MEMORY,
        None => INVALID_DEVICE,
    })
}

/// Flags (none are kept) and whether the device's primary context exists: retained through the
/// driver, or created by the runtime's first call on that device.
pub unsafe extern "C" fn cu_device_primary_ctx_get_state(dev: c_int, flags: *mut c_uint, active: *mut c_int) -> i32 {
    call("cuDevicePrimaryCtxGetState", || match sim().valid_device(dev as i64) {
        Some(d) => {
            if flags.is_null() || active.is_null() {
                return INVALID_VALUE;
            }
            put(flags, 0);
            put(active, c_int::from(crate::cuda::primary_active(d)))
        }
        None => INVALID_DEVICE,
    })
}

/// The answer of every driver entry point the simulator does not implement:
/// CUDA_ERROR_NOT_SUPPORTED, and one log line per name.
pub(crate) fn not_supported(name: &str) -> i32 {
    crate::core::config::warn_not_supported(name, "CUDA_ERROR_NOT_SUPPORTED");
    NOT_SUPPORTED
}

pub unsafe extern "C" fn cu_device_primary_ctx_release(dev: c_int) -> i32 {
    call("cuDevicePrimaryCtxRelease", || match sim().valid_device(dev as i64) {
        Some(_) => SUCCESS,
        None => INVALID_DEVICE,
    })
}

pub unsafe extern "C" fn cu_ctx_get_current(ctx: *mut *mut c_void) -> i32 {
    call("cuCtxGetCurrent", || {
        let value = context::current().map_or(std::ptr::null_mut(), |d| context::handle(&CUDA_CTX_TOKENS, d));
        put(ctx, value)
    })
}

pub unsafe extern "C" fn cu_ctx_set_current(ctx: *mut c_void) -> i32 {
    call("cuCtxSetCurrent", || {
        if ctx.is_null() {
            context::make_current(None);
            return SUCCESS;
        }
        match context::device_of(&CUDA_CTX_TOKENS, ctx) {
            Some(d) if d < sim().devices() => {
                context::make_current(Some(d));
                SUCCESS
            }
            _ => INVALID_CONTEXT,
        }
    })
}

pub unsafe extern "C" fn cu_ctx_get_device(dev: *mut c_int) -> i32 {
    call("cuCtxGetDevice", || match current() {
        Ok(d) => put(dev, d as c_int),
        Err(e) => e,
    })
}

pub unsafe extern "C" fn cu_ctx_synchronize() -> i32 {
    call("cuCtxSynchronize", || match current() {
        Ok(d) => sim().synchronize(Some(d)),
        Err(e) => e,
    })
}

const ERRORS: &[(i32, &std::ffi::CStr, &std::ffi::CStr)] = &[
    (0, c"CUDA_SUCCESS", c"no error"),
    (1, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (4, c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
    (101, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (201, c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
    (400, c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
    (700, c"CUDA_ERROR_ILLEGAL_ADDRESS", c"an illegal memory access was encountered"),
    (800, c"CUDA_ERROR_NOT_PERMITTED", c"operation not permitted"),
    (801, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

pub unsafe extern "C" fn cu_get_error_string(code: c_int, out: *mut *const c_char) -> i32 {
    match ERRORS.iter().find(|e| e.0 == code) {
        Some(e) => put(out, e.2.as_ptr()),
        None => {
            put(out, std::ptr::null());
            INVALID_VALUE
        }
    }
}

pub unsafe extern "C" fn cu_get_error_name(code: c_int, out: *mut *const c_char) -> i32 {
    match ERRORS.iter().find(|e| e.0 == code) {
        Some(e) => put(out, e.1.as_ptr()),
        None => {
            put(out, std::ptr::null());
            INVALID_VALUE
        }
    }
}

pub unsafe extern "C" fn cu_mem_get_info(free: *mut usize, total: *mut usize) -> i32 {
    call("cuMemGetInfo_v2", || {
        let dev = match current() {
            Ok(d) => d,
            Err(e) => return e,
        };
        if free.is_null() || total.is_null() {
            return INVALID_VALUE;
        }
        let (f, t) = sim().mem_info(dev);
        put(free, f as usize);
        put(total, t as usize)
    })
}

pub unsafe extern "C" fn cu_mem_alloc(ptr: *mut c_ulonglong, size: usize) -> i32 {
    call("cuMemAlloc_v2", || {
        let dev = match current() {
            Ok(d) => d,
            Err(e) => return e,
        };
        if ptr.is_null() || size == 0 {
            return INVALID_VALUE;
        }
        match sim().plain_alloc(dev, size) {
            Ok(p) => put(ptr, p as c_ulonglong),
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn cu_mem_free(ptr: c_ulonglong) -> i32 {
    call("cuMemFree_v2", || match current() {
        Ok(_) => result(sim().plain_free(ptr as usize)),
        Err(e) => e,
    })
}

/// A synchronous copy (`stream` None) or an asynchronous one on `stream`.
fn copy(name: &str, dst: usize, src: usize, n: usize, kind: CopyDirection, stream: Option<usize>) -> i32 {
    call(name, || match current() {
        Ok(_) => {
            let copied = match stream {
                Some(s) => sim().copy_async(
                    dst,
                    src,
                    n,
                    kind,
                    crate::cuda::stream_id(s),
                    crate::cuda::current_device(),
                    code_of,
                ),
                None => sim().copy(dst, src, n, kind, StreamId::LEGACY, code_of),
            };
            sim().finish_copy(name, copied, dst, n, stream.map_or(StreamId::LEGACY, crate::cuda::stream_id))
        }
        Err(e) => e,
    })
}

pub unsafe extern "C" fn cu_memcpy_dtoh(dst: *mut c_void, src: c_ulonglong, n: usize) -> i32 {
    copy("cuMemcpyDtoH_v2", dst as usize, src as usize, n, CopyDirection::DeviceToHost, None)
}

pub unsafe extern "C" fn cu_memcpy_htod(dst: c_ulonglong, src: *const c_void, n: usize) -> i32 {
    copy("cuMemcpyHtoD_v2", dst as usize, src as usize, n, CopyDirection::HostToDevice, None)
}

pub unsafe extern "C" fn cu_memcpy_dtoh_async(
    dst: *mut c_void,
    src: c_ulonglong,
    n: usize,
    stream: *mut c_void,
) -> i32 {
    copy("cuMemcpyDtoHAsync_v2", dst as usize, src as usize, n, CopyDirection::DeviceToHost, Some(stream as usize))
}

pub unsafe extern "C" fn cu_memcpy_htod_async(
    dst: c_ulonglong,
    src: *const c_void,
    n: usize,
    stream: *mut c_void,
) -> i32 {
    copy("cuMemcpyHtoDAsync_v2", dst as usize, src as usize, n, CopyDirection::HostToDevice, Some(stream as usize))
}

pub unsafe extern "C" fn cu_memset_d8(dst: c_ulonglong, value: u8, n: usize) -> i32 {
    call("cuMemsetD8_v2", || match current() {
        Ok(_) => {
            sim().streams.settle_for(StreamId::LEGACY);
            result(sim().memset(dst as usize, value, n))
        }
        Err(e) => e,
    })
}

pub unsafe extern "C" fn cu_mem_host_alloc(ptr: *mut *mut c_void, size: usize, _flags: c_uint) -> i32 {
    call("cuMemHostAlloc", || {
        if ptr.is_null() || size == 0 {
            return INVALID_VALUE;
        }
        match sim().host_alloc(size, 0) {
            Ok(p) => put(ptr, p as *mut c_void),
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn cu_mem_alloc_host(ptr: *mut *mut c_void, size: usize) -> i32 {
    // SAFETY: same contract as cuMemHostAlloc.
    unsafe { cu_mem_host_alloc(ptr, size, 0) }
}

pub unsafe extern "C" fn cu_mem_free_host(ptr: *mut c_void) -> i32 {
    call("cuMemFreeHost", || result(sim().host_free(ptr as usize)))
}

/// CU_STREAM_NON_BLOCKING, the one flag besides the default.
const STREAM_NON_BLOCKING: c_uint = tms_vendor::cuda::STREAM_NON_BLOCKING;

pub unsafe extern "C" fn cu_stream_create(stream: *mut *mut c_void, flags: c_uint) -> i32 {
    call("cuStreamCreate", || {
        let dev = match current() {
            Ok(d) => d,
            Err(e) => return e,
        };
        if stream.is_null() || flags & !STREAM_NON_BLOCKING != 0 {
            return INVALID_VALUE;
        }
        if !crate::cuda::charge_stream_pool(dev) {
            return OUT_OF_MEMORY;
        }
        // A non-blocking stream neither waits for the legacy stream nor is waited for by it.
        match sim().streams.create_with(dev, crate::cuda::stream_kind(flags), 0) {
            Some(h) => put(stream, h as *mut c_void),
            None => OUT_OF_MEMORY,
        }
    })
}

pub unsafe extern "C" fn cu_stream_synchronize(stream: *mut c_void) -> i32 {
    call("cuStreamSynchronize", || {
        sim().streams.synchronize(crate::cuda::stream_id(stream as usize)).unwrap_or(INVALID_HANDLE)
    })
}

/// CU_EVENT_DEFAULT, BLOCKING_SYNC, DISABLE_TIMING, INTERPROCESS.
const EVENT_FLAGS: c_uint = 0x1 | 0x2 | 0x4;

pub unsafe extern "C" fn cu_event_create(event: *mut *mut c_void, flags: c_uint) -> i32 {
    call("cuEventCreate", || {
        if event.is_null() || flags & !EVENT_FLAGS != 0 {
            return INVALID_VALUE;
        }
        if let Err(e) = current() {
            return e;
        }
        put(event, sim().streams.event_create(flags) as *mut c_void)
    })
}

pub unsafe extern "C" fn cu_event_record(event: *mut c_void, stream: *mut c_void) -> i32 {
    call("cuEventRecord", || {
        if let Err(e) = current() {
            return e;
        }
        let Some(ev) = sim().streams.event(event as usize) else { return INVALID_HANDLE };
        sim()
            .streams
            .event_record(&ev, crate::cuda::stream_id(stream as usize), crate::cuda::current_device())
            .map_or(INVALID_HANDLE, |()| SUCCESS)
    })
}

pub unsafe extern "C" fn cu_event_synchronize(event: *mut c_void) -> i32 {
    call("cuEventSynchronize", || match sim().streams.event(event as usize) {
        Some(ev) => {
            ev.synchronize();
            SUCCESS
        }
        None => INVALID_HANDLE,
    })
}

pub unsafe extern "C" fn cu_event_destroy(event: *mut c_void) -> i32 {
    call("cuEventDestroy_v2", || if sim().streams.event_destroy(event as usize) { SUCCESS } else { INVALID_HANDLE })
}

pub unsafe extern "C" fn cu_stream_destroy(stream: *mut c_void) -> i32 {
    call("cuStreamDestroy_v2", || if sim().streams.destroy(stream as usize) { SUCCESS } else { INVALID_HANDLE })
}

// ---- virtual memory management -------------------------------------------------------------

/// Validates an allocation property; returns its device.
fn prop_device(prop: *const CuMemAllocationProp) -> Result<usize, i32> {
    if prop.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: checked non-null; the caller passes a CUmemAllocationProp.
    let p = unsafe { prop.read_unaligned() };
    if p.kind != ALLOCATION_TYPE_PINNED || p.location.kind != LOCATION_TYPE_DEVICE {
        return Err(INVALID_VALUE);
    }
    sim().valid_device(p.location.id as i64).ok_or(INVALID_DEVICE)
}

pub unsafe extern "C" fn cu_mem_get_allocation_granularity(
    g: *mut usize,
    prop: *const CuMemAllocationProp,
    option: c_int,
) -> i32 {
    call("cuMemGetAllocationGranularity", || {
        if let Err(e) = prop_device(prop) {
            return e;
        }
        if !(0..=1).contains(&option) {
            return INVALID_VALUE;
        }
        put(g, GRANULARITY)
    })
}

pub unsafe extern "C" fn cu_mem_address_reserve(
    ptr: *mut c_ulonglong,
    size: usize,
    alignment: usize,
    addr: c_ulonglong,
    flags: c_ulonglong,
) -> i32 {
    call("cuMemAddressReserve", || {
        if ptr.is_null() || flags != 0 {
            return INVALID_VALUE;
        }
        match sim().reserve(size, alignment, addr as usize) {
            Ok(p) => put(ptr, p as c_ulonglong),
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn cu_mem_address_free(ptr: c_ulonglong, size: usize) -> i32 {
    call("cuMemAddressFree", || result(sim().free_reservation(ptr as usize, Some(size))))
}

pub unsafe extern "C" fn cu_mem_create(
    handle: *mut c_ulonglong,
    size: usize,
    prop: *const CuMemAllocationProp,
    flags: c_ulonglong,
) -> i32 {
    call("cuMemCreate", || {
        if handle.is_null() || flags != 0 {
            return INVALID_VALUE;
        }
        let dev = match prop_device(prop) {
            Ok(d) => d,
            Err(e) => return e,
        };
        // SAFETY: prop_device checked it is non-null.
        let rdma = unsafe { prop.read_unaligned() }.alloc_flags.gpu_direct_rdma_capable;
        if rdma > 1 {
            return INVALID_VALUE;
        }
        match sim().create(dev, size, c_int::from(rdma)) {
            Ok(h) => put(handle, h),
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn cu_mem_release(handle: c_ulonglong) -> i32 {
    call("cuMemRelease", || result(sim().release(handle, false)))
}

/// CU_POINTER_ATTRIBUTE_MEMORY_TYPE, _DEVICE_ORDINAL, _IS_GPU_DIRECT_RDMA_CAPABLE: the ones
/// answered here (NCCL asks the last one before registering a user buffer).
const POINTER_MEMORY_TYPE: c_int = 2;
const POINTER_DEVICE_ORDINAL: c_int = 9;
const POINTER_IS_GPU_DIRECT_RDMA_CAPABLE: c_int = 15;

pub unsafe extern "C" fn cu_pointer_get_attribute(data: *mut c_void, attribute: c_int, ptr: c_ulonglong) -> i32 {
    call("cuPointerGetAttribute", || {
        if data.is_null() {
            return INVALID_VALUE;
        }
        let p = ptr as usize;
        match (sim().classify(p), attribute) {
            (PointerKind::Device(_), POINTER_MEMORY_TYPE) => put(data.cast::<c_uint>(), 2),
            (PointerKind::PinnedHost, POINTER_MEMORY_TYPE) => put(data.cast::<c_uint>(), 1),
            (PointerKind::Device(d), POINTER_DEVICE_ORDINAL) => put(data.cast::<c_int>(), d as c_int),
            (PointerKind::Device(_), POINTER_IS_GPU_DIRECT_RDMA_CAPABLE) => {
                // cudaMalloc memory is capable; virtual-memory allocations only when created so.
                let capable = match sim().prop_at(p) {
                    Some(rdma) => rdma == 1,
                    None if sim().in_plain(p) => true,
                    None => return INVALID_VALUE,
                };
                put(data.cast::<c_uint>(), c_uint::from(capable))
            }
            (PointerKind::Device(_) | PointerKind::PinnedHost, _) => {
                not_supported("cuPointerGetAttribute (this attribute)")
            }
            (PointerKind::Unregistered, _) => INVALID_VALUE,
        }
    })
}

pub unsafe extern "C" fn cu_mem_map(
    ptr: c_ulonglong,
    size: usize,
    offset: usize,
    handle: c_ulonglong,
    flags: c_ulonglong,
) -> i32 {
    call("cuMemMap", || {
        if flags != 0 {
            return INVALID_VALUE;
        }
        result(sim().map(ptr as usize, size, offset, handle, false))
    })
}

pub unsafe extern "C" fn cu_mem_unmap(ptr: c_ulonglong, size: usize) -> i32 {
    call("cuMemUnmap", || {
        if size == 0 {
            return INVALID_VALUE;
        }
        result(sim().unmap(ptr as usize, Some(size)))
    })
}

pub unsafe extern "C" fn cu_mem_set_access(
    ptr: c_ulonglong,
    size: usize,
    desc: *const CuMemAccessDesc,
    count: usize,
) -> i32 {
    call("cuMemSetAccess", || {
        if desc.is_null() || count == 0 {
            return INVALID_VALUE;
        }
        // SAFETY: the caller passes `count` descriptors; C callers may not align them.
        let descs: Vec<_> = (0..count).map(|i| unsafe { desc.add(i).read_unaligned() }).collect();
        let mut prot = libc::PROT_NONE;
        for d in descs {
            if d.location.kind != LOCATION_TYPE_DEVICE || sim().valid_device(d.location.id as i64).is_none() {
                return INVALID_DEVICE;
            }
            prot |= match d.flags {
                ACCESS_FLAGS_PROT_NONE => libc::PROT_NONE,
                ACCESS_FLAGS_PROT_READ => libc::PROT_READ,
                ACCESS_FLAGS_PROT_READWRITE => libc::PROT_READ | libc::PROT_WRITE,
                _ => return INVALID_VALUE,
            };
        }
        result(sim().set_access(ptr as usize, size, prot))
    })
}
