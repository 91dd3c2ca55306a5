//! Memory and copies: device and page-locked host allocation, host registration, pointer
//! attributes, 1D/2D/peer copies, memsets and free-memory queries.

use super::{
    HOST_MEMORY_ALREADY_REGISTERED, HOST_MEMORY_NOT_REGISTERED, INVALID_RESOURCE_HANDLE, INVALID_VALUE, SUCCESS, call,
    code_of, put, result,
};
use crate::core::sim::{PointerKind, sim};
use crate::core::streams::StreamId;
use crate::cuda::{copy_direction, stream_id};
use libc::{c_int, c_uint, c_void};

pub unsafe extern "C" fn cuda_malloc(ptr: *mut *mut c_void, size: usize) -> i32 {
    call("cudaMalloc", || {
        if ptr.is_null() {
            return INVALID_VALUE;
        }
        let dev = enter!();
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
        enter!();
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
    // SAFETY: same contract as cudaHostAlloc with default flags.
    unsafe { cuda_host_alloc(ptr, size, 0) }
}

pub unsafe extern "C" fn cuda_host_alloc(ptr: *mut *mut c_void, size: usize, flags: c_uint) -> i32 {
    call("cudaHostAlloc", || {
        if ptr.is_null() {
            return INVALID_VALUE;
        }
        enter!();
        match sim().host_alloc(size, flags) {
            Ok(p) => {
                // SAFETY: checked non-null.
                unsafe { *ptr = p as *mut c_void };
                SUCCESS
            }
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn cuda_free_host(ptr: *mut c_void) -> i32 {
    call("cudaFreeHost", || {
        enter!();
        if ptr.is_null() {
            return SUCCESS;
        }
        result(sim().host_free(ptr as usize))
    })
}

pub unsafe extern "C" fn cuda_memcpy(dst: *mut c_void, src: *const c_void, count: usize, kind: c_int) -> i32 {
    call("cudaMemcpy", || {
        enter!();
        let Some(kind) = copy_direction(kind) else { return INVALID_VALUE };
        let copied = sim().copy(dst as usize, src as usize, count, kind, StreamId::LEGACY, code_of);
        sim().finish_copy("cudaMemcpy", copied, dst as usize, count, StreamId::LEGACY)
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
        enter!();
        let Some(kind) = copy_direction(kind) else { return INVALID_VALUE };
        let copied = sim().copy_async(
            dst as usize,
            src as usize,
            count,
            kind,
            stream_id(stream as usize),
            crate::cuda::current_device(),
            code_of,
        );
        sim().finish_copy("cudaMemcpyAsync", copied, dst as usize, count, stream_id(stream as usize))
    })
}

/// Runs in the caller after the default stream's queued work. CUDA lets a memset of device
/// memory return early ("API synchronization behavior"); returning after it is the reading no
/// caller can be hurt by.
pub unsafe extern "C" fn cuda_memset(dst: *mut c_void, value: c_int, count: usize) -> i32 {
    call("cudaMemset", || {
        enter!();
        sim().streams.settle_for(StreamId::LEGACY);
        result(sim().memset(dst as usize, value as u8, count))
    })
}

pub unsafe extern "C" fn cuda_memset_async(dst: *mut c_void, value: c_int, count: usize, stream: *mut c_void) -> i32 {
    call("cudaMemsetAsync", || {
        enter!();
        let (dst, value, stream) = (dst as usize, value as u8, stream_id(stream as usize));
        if stream.is_default() {
            return sim()
                .memset_on_default(dst, value, count, stream, crate::cuda::current_device(), code_of)
                .err()
                .unwrap_or(SUCCESS);
        }
        if sim().graphs.record(stream, || crate::core::graphs::Node::Memset { dst, value, n: count }) {
            return SUCCESS;
        }
        let job = Box::new(move || sim().memset(dst, value, count).map_or_else(code_of, |()| SUCCESS));
        sim().streams.submit(stream, job).unwrap_or(INVALID_RESOURCE_HANDLE)
    })
}

pub unsafe extern "C" fn cuda_mem_get_info(free: *mut usize, total: *mut usize) -> i32 {
    call("cudaMemGetInfo", || {
        if free.is_null() || total.is_null() {
            return INVALID_VALUE;
        }
        let dev = enter!();
        let (f, t) = sim().mem_info(dev);
        // SAFETY: checked non-null.
        unsafe {
            *free = f as usize;
            *total = t as usize;
        }
        SUCCESS
    })
}

pub unsafe extern "C" fn cuda_host_register(ptr: *mut c_void, size: usize, flags: c_uint) -> i32 {
    call("cudaHostRegister", || {
        enter!();
        match sim().host_register(ptr as usize, size, flags) {
            Ok(true) => SUCCESS,
            Ok(false) => HOST_MEMORY_ALREADY_REGISTERED,
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn cuda_host_unregister(ptr: *mut c_void) -> i32 {
    call("cudaHostUnregister", || {
        enter!();
        if sim().host_unregister(ptr as usize) { SUCCESS } else { HOST_MEMORY_NOT_REGISTERED }
    })
}

pub unsafe extern "C" fn cuda_host_get_flags(flags: *mut c_uint, ptr: *mut c_void) -> i32 {
    call("cudaHostGetFlags", || {
        enter!();
        match sim().host_lookup(ptr as usize) {
            Some((_, f)) => put(flags, f),
            None => INVALID_VALUE,
        }
    })
}

/// Unified addressing: a page-locked host pointer is its own device pointer.
pub unsafe extern "C" fn cuda_host_get_device_pointer(
    dev_ptr: *mut *mut c_void,
    host: *mut c_void,
    flags: c_uint,
) -> i32 {
    call("cudaHostGetDevicePointer", || {
        enter!();
        if flags != 0 || sim().host_lookup(host as usize).is_none() {
            return INVALID_VALUE;
        }
        put(dev_ptr, host)
    })
}

/// `struct cudaPointerAttributes` (CUDA 11 and later).
#[repr(C)]
pub struct PointerAttributes {
    /// cudaMemoryType: 0 unregistered, 1 host, 2 device, 3 managed.
    pub kind: c_int,
    pub device: c_int,
    pub device_pointer: *mut c_void,
    pub host_pointer: *mut c_void,
}
const _: () = assert!(std::mem::size_of::<PointerAttributes>() == 24);

pub unsafe extern "C" fn cuda_pointer_get_attributes(attrs: *mut PointerAttributes, ptr: *const c_void) -> i32 {
    call("cudaPointerGetAttributes", || {
        let current = enter!() as c_int;
        let p = ptr as *mut c_void;
        let value = match sim().classify(ptr as usize) {
            PointerKind::Device(d) => {
                PointerAttributes { kind: 2, device: d as c_int, device_pointer: p, host_pointer: std::ptr::null_mut() }
            }
            PointerKind::PinnedHost => {
                PointerAttributes { kind: 1, device: current, device_pointer: p, host_pointer: p }
            }
            // Since CUDA 11 an unregistered host pointer is a success with type "unregistered".
            PointerKind::Unregistered => PointerAttributes {
                kind: 0,
                device: -2,
                device_pointer: std::ptr::null_mut(),
                host_pointer: std::ptr::null_mut(),
            },
        };
        put(attrs, value)
    })
}

pub unsafe extern "C" fn cuda_memcpy_peer(
    dst: *mut c_void,
    _dst_dev: c_int,
    src: *const c_void,
    _src_dev: c_int,
    count: usize,
) -> i32 {
    // SAFETY: same contract as cudaMemcpy; unified addressing names both devices' memory.
    unsafe { cuda_memcpy(dst, src, count, 3) }
}

pub unsafe extern "C" fn cuda_memcpy_peer_async(
    dst: *mut c_void,
    _dst_dev: c_int,
    src: *const c_void,
    _src_dev: c_int,
    count: usize,
    stream: *mut c_void,
) -> i32 {
    // SAFETY: same contract as cudaMemcpyAsync.
    unsafe { cuda_memcpy_async(dst, src, count, 3, stream) }
}

/// A pitched copy is `height` row copies; every row is validated like a 1D copy.
fn copy_2d(
    name: &str,
    dst: usize,
    dpitch: usize,
    src: usize,
    spitch: usize,
    width: usize,
    height: usize,
    kind: c_int,
    stream: usize,
    is_async: bool,
) -> i32 {
    call(name, || {
        enter!();
        let Some(kind) = copy_direction(kind) else { return INVALID_VALUE };
        if width > dpitch || width > spitch {
            return INVALID_VALUE;
        }
        for row in 0..height {
            let (d, s) = (dst + row * dpitch, src + row * spitch);
            let copied = if is_async {
                sim().copy_async(d, s, width, kind, stream_id(stream), crate::cuda::current_device(), code_of)
            } else {
                sim().copy(d, s, width, kind, StreamId::LEGACY, code_of)
            };
            if let Err(code) = copied {
                return code;
            }
        }
        SUCCESS
    })
}

pub unsafe extern "C" fn cuda_memcpy_2d(
    dst: *mut c_void,
    dpitch: usize,
    src: *const c_void,
    spitch: usize,
    width: usize,
    height: usize,
    kind: c_int,
) -> i32 {
    copy_2d("cudaMemcpy2D", dst as usize, dpitch, src as usize, spitch, width, height, kind, 0, false)
}

pub unsafe extern "C" fn cuda_memcpy_2d_async(
    dst: *mut c_void,
    dpitch: usize,
    src: *const c_void,
    spitch: usize,
    width: usize,
    height: usize,
    kind: c_int,
    stream: *mut c_void,
) -> i32 {
    copy_2d("cudaMemcpy2DAsync", dst as usize, dpitch, src as usize, spitch, width, height, kind, stream as usize, true)
}
