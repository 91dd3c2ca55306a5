//! The CUDA driver (`libcuda.so.1`), loaded at run time. Nothing of CUDA is needed to build.

use super::{DevResult, Device, DeviceError, MemKind, PhysHandle, Stream, UNCHANGED, Vendor, symbol};
use libc::{c_int, c_uint, c_ulonglong, c_void};
use std::collections::HashMap;
use std::sync::Mutex;

const OUT_OF_MEMORY: i32 = 2;
const INVALID_VALUE: i32 = 1;

use tms_vendor::cuda::{ACCESS_FLAGS_PROT_READWRITE, AccessDesc, AllocationProp, MemLocation};

type Ctx = *mut c_void;

struct Api {
    init: unsafe extern "C" fn(c_uint) -> c_int,
    primary_ctx_retain: unsafe extern "C" fn(*mut Ctx, c_int) -> c_int,
    primary_ctx_get_state: unsafe extern "C" fn(c_int, *mut c_uint, *mut c_int) -> c_int,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> c_int,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int,
    ctx_get_current: unsafe extern "C" fn(*mut Ctx) -> c_int,
    ctx_set_current: unsafe extern "C" fn(Ctx) -> c_int,
    ctx_get_device: unsafe extern "C" fn(*mut c_int) -> c_int,
    ctx_synchronize: unsafe extern "C" fn() -> c_int,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> c_int,
    address_reserve: unsafe extern "C" fn(*mut c_ulonglong, usize, usize, c_ulonglong, c_ulonglong) -> c_int,
    address_free: unsafe extern "C" fn(c_ulonglong, usize) -> c_int,
    create: unsafe extern "C" fn(*mut c_ulonglong, usize, *const AllocationProp, c_ulonglong) -> c_int,
    release: unsafe extern "C" fn(c_ulonglong) -> c_int,
    map: unsafe extern "C" fn(c_ulonglong, usize, usize, c_ulonglong, c_ulonglong) -> c_int,
    unmap: unsafe extern "C" fn(c_ulonglong, usize) -> c_int,
    set_access: unsafe extern "C" fn(c_ulonglong, usize, *const AccessDesc, usize) -> c_int,
    granularity: unsafe extern "C" fn(*mut usize, *const AllocationProp, c_int) -> c_int,
    host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> c_int,
    free_host: unsafe extern "C" fn(*mut c_void) -> c_int,
    stream_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int,
    stream_synchronize: unsafe extern "C" fn(*mut c_void) -> c_int,
    event_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int,
    event_record: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int,
    event_synchronize: unsafe extern "C" fn(*mut c_void) -> c_int,
    event_destroy: unsafe extern "C" fn(*mut c_void) -> c_int,
    dtoh_async: unsafe extern "C" fn(*mut c_void, c_ulonglong, usize, *mut c_void) -> c_int,
    htod_async: unsafe extern "C" fn(c_ulonglong, *const c_void, usize, *mut c_void) -> c_int,
}

pub struct Cuda {
    api: Api,
    _lib: libloading::Library,
    /// Per device: whether it supports GPUDirect RDMA on virtual-memory allocations.
    rdma: Mutex<HashMap<i32, bool>>,
}

/// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED.
const ATTRIBUTE_GPU_DIRECT_RDMA_WITH_VMM: c_int = 110;

// SAFETY: the driver API is thread-safe; the struct holds only function pointers and the library.
unsafe impl Send for Cuda {}
// SAFETY: as above.
unsafe impl Sync for Cuda {}

fn check(op: &'static str, code: c_int) -> DevResult<()> {
    if code == 0 { Ok(()) } else { Err(DeviceError { op, code }) }
}

fn prop(dev: i32) -> AllocationProp {
    AllocationProp::pinned_on(dev)
}

impl Cuda {
    /// The property of region memory on `dev`: RDMA capable where the device supports it, as
    /// cudaMalloc memory is, so NCCL user-buffer registration and KV-transfer engines accept it.
    fn prop_for_memory(&self, dev: i32) -> AllocationProp {
        let mut p = prop(dev);
        let supported = *self.rdma.lock().unwrap_or_else(|e| e.into_inner()).entry(dev).or_insert_with(|| {
            let mut v: c_int = 0;
            // SAFETY: writes one int.
            unsafe { (self.api.device_get_attribute)(&mut v, ATTRIBUTE_GPU_DIRECT_RDMA_WITH_VMM, dev) == 0 && v != 0 }
        });
        p.alloc_flags.gpu_direct_rdma_capable = u8::from(supported);
        p
    }
}

impl Cuda {
    /// Loads the driver; Err when it is not installed (the hook then passes everything through).
    pub fn load() -> Result<Cuda, String> {
        // SAFETY: loading the vendor driver; its initializers are the vendor's.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|e| e.to_string())?;
        // SAFETY: each signature matches the CUDA driver API (shared/reference/cuda.md).
        let api = unsafe {
            Api {
                init: symbol(&lib, "cuInit")?,
                primary_ctx_retain: symbol(&lib, "cuDevicePrimaryCtxRetain")?,
                primary_ctx_get_state: symbol(&lib, "cuDevicePrimaryCtxGetState")?,
                device_get_count: symbol(&lib, "cuDeviceGetCount")?,
                device_get_attribute: symbol(&lib, "cuDeviceGetAttribute")?,
                ctx_get_current: symbol(&lib, "cuCtxGetCurrent")?,
                ctx_set_current: symbol(&lib, "cuCtxSetCurrent")?,
                ctx_get_device: symbol(&lib, "cuCtxGetDevice")?,
                ctx_synchronize: symbol(&lib, "cuCtxSynchronize")?,
                mem_get_info: symbol(&lib, "cuMemGetInfo_v2")?,
                address_reserve: symbol(&lib, "cuMemAddressReserve")?,
                address_free: symbol(&lib, "cuMemAddressFree")?,
                create: symbol(&lib, "cuMemCreate")?,
                release: symbol(&lib, "cuMemRelease")?,
                map: symbol(&lib, "cuMemMap")?,
                unmap: symbol(&lib, "cuMemUnmap")?,
                set_access: symbol(&lib, "cuMemSetAccess")?,
                granularity: symbol(&lib, "cuMemGetAllocationGranularity")?,
                host_alloc: symbol(&lib, "cuMemHostAlloc")?,
                free_host: symbol(&lib, "cuMemFreeHost")?,
                stream_create: symbol(&lib, "cuStreamCreate")?,
                stream_synchronize: symbol(&lib, "cuStreamSynchronize")?,
                event_create: symbol(&lib, "cuEventCreate")?,
                event_record: symbol(&lib, "cuEventRecord")?,
                event_synchronize: symbol(&lib, "cuEventSynchronize")?,
                event_destroy: symbol(&lib, "cuEventDestroy_v2")?,
                dtoh_async: symbol(&lib, "cuMemcpyDtoHAsync_v2")?,
                htod_async: symbol(&lib, "cuMemcpyHtoDAsync_v2")?,
            }
        };
        // SAFETY: cuInit(0) is always a valid call.
        let rc = unsafe { (api.init)(0) };
        if rc != 0 {
            return Err(format!("cuInit returned {rc}"));
        }
        Ok(Cuda { api, _lib: lib, rdma: Mutex::new(HashMap::new()) })
    }

    fn current_context(&self) -> Ctx {
        let mut ctx: Ctx = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        unsafe { (self.api.ctx_get_current)(&mut ctx) };
        ctx
    }
}

impl Device for Cuda {
    fn vendor(&self) -> Vendor {
        Vendor::Cuda
    }

    fn oom_code(&self) -> i32 {
        OUT_OF_MEMORY
    }

    fn invalid_code(&self) -> i32 {
        INVALID_VALUE
    }

    fn copies_pageable_memory(&self) -> bool {
        true
    }

    fn current_device(&self) -> DevResult<i32> {
        if !self.current_context().is_null() {
            let mut dev = 0;
            // SAFETY: writes one int.
            check("cuCtxGetDevice", unsafe { (self.api.ctx_get_device)(&mut dev) })?;
            return Ok(dev);
        }
        // No context yet on this thread: the runtime's device is the one cudaMalloc would use.
        if let Some(f) = crate::forward::CUDA_GET_DEVICE.resolve(0) {
            let mut dev = 0;
            // SAFETY: the runtime's cudaGetDevice(int*).
            let f: unsafe extern "C" fn(*mut c_int) -> c_int = unsafe { std::mem::transmute(f) };
            if unsafe { f(&mut dev) } == 0 {
                return Ok(dev);
            }
        }
        Ok(0)
    }

    fn bind_thread(&self, dev: i32) -> DevResult<usize> {
        let ctx = self.current_context();
        if !ctx.is_null() {
            let mut cur = -1;
            // SAFETY: writes one int.
            if unsafe { (self.api.ctx_get_device)(&mut cur) } == 0 && cur == dev {
                return Ok(UNCHANGED);
            }
        }
        let mut primary: Ctx = std::ptr::null_mut();
        // SAFETY: writes one pointer; the primary context is retained for the life of the process.
        check("cuDevicePrimaryCtxRetain", unsafe { (self.api.primary_ctx_retain)(&mut primary, dev) })?;
        // SAFETY: a context the driver just gave us.
        check("cuCtxSetCurrent", unsafe { (self.api.ctx_set_current)(primary) })?;
        Ok(ctx as usize)
    }

    fn active_devices(&self) -> Vec<i32> {
        let mut count: c_int = 0;
        // SAFETY: writes one int.
        if unsafe { (self.api.device_get_count)(&mut count) } != 0 {
            return Vec::new();
        }
        (0..count)
            .filter(|&d| {
                let (mut flags, mut active): (c_uint, c_int) = (0, 0);
                // SAFETY: writes two ints; asking creates nothing.
                unsafe { (self.api.primary_ctx_get_state)(d, &mut flags, &mut active) == 0 && active != 0 }
            })
            .collect()
    }

    fn restore_thread(&self, previous: usize) {
        if previous != UNCHANGED && previous != 0 {
            // SAFETY: the context that was current before bind_thread.
            unsafe { (self.api.ctx_set_current)(previous as Ctx) };
        }
    }

    fn granularity(&self, dev: i32, _kind: MemKind) -> DevResult<usize> {
        let mut g = 0usize;
        let p = prop(dev);
        // SAFETY: valid prop and out pointer. Option 0 = minimum granularity.
        check("cuMemGetAllocationGranularity", unsafe { (self.api.granularity)(&mut g, &p, 0) })?;
        Ok(g.max(1))
    }

    fn reserve(&self, size: usize) -> DevResult<u64> {
        let mut addr: c_ulonglong = 0;
        // SAFETY: writes one address.
        check("cuMemAddressReserve", unsafe { (self.api.address_reserve)(&mut addr, size, 0, 0, 0) })?;
        Ok(addr)
    }

    fn free_reservation(&self, addr: u64, size: usize) -> DevResult<()> {
        // SAFETY: a reservation we made.
        check("cuMemAddressFree", unsafe { (self.api.address_free)(addr, size) })
    }

    fn create(&self, dev: i32, size: usize, _kind: MemKind) -> DevResult<PhysHandle> {
        let mut h: c_ulonglong = 0;
        let p = self.prop_for_memory(dev);
        // SAFETY: valid prop and out pointer.
        check("cuMemCreate", unsafe { (self.api.create)(&mut h, size, &p, 0) })?;
        Ok(h)
    }

    fn release(&self, handle: PhysHandle) -> DevResult<()> {
        // SAFETY: a handle we created.
        check("cuMemRelease", unsafe { (self.api.release)(handle) })
    }

    fn map(&self, addr: u64, size: usize, handle: PhysHandle) -> DevResult<()> {
        // SAFETY: our reservation and handle.
        check("cuMemMap", unsafe { (self.api.map)(addr, size, 0, handle, 0) })
    }

    fn set_access(&self, dev: i32, addr: u64, size: usize) -> DevResult<()> {
        let desc = AccessDesc { location: MemLocation::device(dev), flags: ACCESS_FLAGS_PROT_READWRITE };
        // SAFETY: one descriptor for our mapping.
        check("cuMemSetAccess", unsafe { (self.api.set_access)(addr, size, &desc, 1) })
    }

    fn unmap(&self, addr: u64, size: usize) -> DevResult<()> {
        // SAFETY: our mapping.
        check("cuMemUnmap", unsafe { (self.api.unmap)(addr, size) })
    }

    fn synchronize(&self) -> DevResult<()> {
        // SAFETY: no arguments.
        check("cuCtxSynchronize", unsafe { (self.api.ctx_synchronize)() })
    }

    /// An event recorded on the legacy default stream completes once everything queued before
    /// it there and on every blocking stream has run: what upstream's synchronous cudaMemcpy
    /// waits for, and nothing on non-blocking streams (NCCL's, PyTorch's side streams).
    fn wait_for_queued_work(&self) -> DevResult<()> {
        const EVENT_DISABLE_TIMING: c_uint = 0x2;
        const STREAM_LEGACY: usize = 0x1;
        let mut event: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check("cuEventCreate", unsafe { (self.api.event_create)(&mut event, EVENT_DISABLE_TIMING) })?;
        // SAFETY: our event; CU_STREAM_LEGACY is a valid stream handle in every context.
        let recorded = check("cuEventRecord", unsafe { (self.api.event_record)(event, STREAM_LEGACY as *mut c_void) })
            // SAFETY: the event just recorded.
            .and_then(|()| check("cuEventSynchronize", unsafe { (self.api.event_synchronize)(event) }));
        // SAFETY: our event, no longer waited on.
        unsafe { (self.api.event_destroy)(event) };
        recorded
    }

    fn mem_info(&self) -> DevResult<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two sizes.
        check("cuMemGetInfo", unsafe { (self.api.mem_get_info)(&mut free, &mut total) })?;
        Ok((free as u64, total as u64))
    }

    fn host_alloc(&self, size: usize) -> DevResult<*mut u8> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer. PORTABLE: usable from every context.
        check("cuMemHostAlloc", unsafe { (self.api.host_alloc)(&mut p, size, 1) })?;
        Ok(p.cast())
    }

    fn host_free(&self, ptr: *mut u8) {
        // SAFETY: memory from cuMemHostAlloc.
        unsafe { (self.api.free_host)(ptr.cast()) };
    }

    fn stream_create(&self) -> DevResult<Stream> {
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one handle. Flag 1: non-blocking with respect to the legacy stream.
        check("cuStreamCreate", unsafe { (self.api.stream_create)(&mut s, 1) })?;
        Ok(s as Stream)
    }

    fn stream_synchronize(&self, stream: Stream) -> DevResult<()> {
        // SAFETY: a stream we created.
        check("cuStreamSynchronize", unsafe { (self.api.stream_synchronize)(stream as *mut c_void) })
    }

    fn copy_to_host_async(&self, dst: *mut u8, src: u64, len: usize, stream: Stream) -> DevResult<()> {
        // SAFETY: pinned destination of at least `len` bytes, mapped source.
        check("cuMemcpyDtoHAsync", unsafe { (self.api.dtoh_async)(dst.cast(), src, len, stream as *mut c_void) })
    }

    fn copy_to_device_async(&self, dst: u64, src: *const u8, len: usize, stream: Stream) -> DevResult<()> {
        // SAFETY: mapped destination, pinned source of at least `len` bytes.
        check("cuMemcpyHtoDAsync", unsafe { (self.api.htod_async)(dst, src.cast(), len, stream as *mut c_void) })
    }
}
