//! The Ascend runtime (`libascendcl.so`), loaded at run time with a hand-written FFI declared from
//! the public acl_rt.h facts (shared/reference/ascend.md). Nothing of CANN is needed to build.

use super::{DevResult, Device, DeviceError, MemKind, PhysHandle, Stream, UNCHANGED, Vendor, symbol};
use libc::{c_int, c_void};
use std::collections::HashMap;
use std::sync::Mutex;

const RT_MEMORY_ALLOCATION: i32 = 207_001;
const RT_PARAM_INVALID: i32 = 107_000;
const HBM_MEM: c_int = 1;
// aclrtMemAttr values (CANN aclrtMemAttr): physical memory of each kind a malloc policy asks for.
pub use tms_vendor::acl::HBM_MEM_HUGE;
pub const HBM_MEM_NORMAL: MemKind = 5;
pub const HBM_MEM_P2P_HUGE: MemKind = 8;
pub const HBM_MEM_P2P_NORMAL: MemKind = 9;
pub const HBM_MEM_HUGE1G: MemKind = 10;
pub const HBM_MEM_P2P_HUGE1G: MemKind = 11;

/// The physical memory an `aclrtMalloc` policy asks for, and what to try when that kind is
/// exhausted (CANN aclrtMemMallocPolicy): `*_FIRST` takes huge pages, normal ones when huge ones
/// run out (and, without P2P, normal pages for 1 MiB or less); `*_ONLY` takes that kind or fails;
/// `_P2P` variants are memory for device-to-device copies; `HUGE1G` has 1 GiB pages. The
/// bandwidth bits (`ACL_MEM_TYPE_LOW/HIGH_BAND_WIDTH`) are ignored, as CANN documents it ignores
/// them. None: a policy tms cannot reproduce with physical memory (`ACL_MEM_ACCESS_USER_SPACE_
/// READONLY`, unknown values); such allocations pass through untracked.
pub fn memory_for_policy(policy: c_int, size: usize) -> Option<(MemKind, Option<MemKind>)> {
    const BANDWIDTH_BITS: c_int = 0x0100 | 0x1000;
    const SMALL: usize = 1 << 20;
    match policy & !BANDWIDTH_BITS {
        0 if size <= SMALL => Some((HBM_MEM_NORMAL, None)),
        0 => Some((HBM_MEM_HUGE, Some(HBM_MEM_NORMAL))),
        1 => Some((HBM_MEM_HUGE, None)),
        2 => Some((HBM_MEM_NORMAL, None)),
        3 => Some((HBM_MEM_P2P_HUGE, Some(HBM_MEM_P2P_NORMAL))),
        4 => Some((HBM_MEM_P2P_HUGE, None)),
        5 => Some((HBM_MEM_P2P_NORMAL, None)),
        6 => Some((HBM_MEM_HUGE1G, None)),
        7 => Some((HBM_MEM_P2P_HUGE1G, None)),
        _ => None,
    }
}
const MEMCPY_HOST_TO_DEVICE: c_int = 1;
const MEMCPY_DEVICE_TO_HOST: c_int = 2;

use tms_vendor::acl::PhysicalMemProp;

fn prop(dev: i32, kind: MemKind) -> PhysicalMemProp {
    PhysicalMemProp::pinned_on(dev as u32, kind)
}

type Ptr = *mut c_void;

struct Api {
    set_device: unsafe extern "C" fn(i32) -> c_int,
    get_device: unsafe extern "C" fn(*mut i32) -> c_int,
    get_current_context: unsafe extern "C" fn(*mut Ptr) -> c_int,
    set_current_context: unsafe extern "C" fn(Ptr) -> c_int,
    synchronize_device: unsafe extern "C" fn() -> c_int,
    get_mem_info: unsafe extern "C" fn(c_int, *mut usize, *mut usize) -> c_int,
    reserve: unsafe extern "C" fn(*mut Ptr, usize, usize, Ptr, u64) -> c_int,
    release_address: unsafe extern "C" fn(Ptr) -> c_int,
    malloc_physical: unsafe extern "C" fn(*mut Ptr, usize, *const PhysicalMemProp, u64) -> c_int,
    free_physical: unsafe extern "C" fn(Ptr) -> c_int,
    map: unsafe extern "C" fn(Ptr, usize, usize, Ptr, u64) -> c_int,
    unmap: unsafe extern "C" fn(Ptr) -> c_int,
    granularity: unsafe extern "C" fn(*mut PhysicalMemProp, c_int, *mut usize) -> c_int,
    malloc_host: unsafe extern "C" fn(*mut Ptr, usize) -> c_int,
    free_host: unsafe extern "C" fn(Ptr) -> c_int,
    create_stream: unsafe extern "C" fn(*mut Ptr) -> c_int,
    synchronize_stream: unsafe extern "C" fn(Ptr) -> c_int,
    memcpy_async: unsafe extern "C" fn(Ptr, usize, *const c_void, usize, c_int, Ptr) -> c_int,
}

pub struct Acl {
    api: Api,
    /// The application's context per device, seen on its allocating threads; a control thread
    /// adopts it instead of creating a device context of its own.
    contexts: Mutex<HashMap<i32, usize>>,
    _lib: libloading::Library,
}

// SAFETY: the ACL runtime is thread-safe; the struct holds function pointers, the library and a
// mutex-protected map of context handles.
unsafe impl Send for Acl {}
// SAFETY: as above.
unsafe impl Sync for Acl {}

fn check(op: &'static str, code: c_int) -> DevResult<()> {
    if code == 0 { Ok(()) } else { Err(DeviceError { op, code }) }
}

impl Acl {
    pub fn load() -> Result<Acl, String> {
        // SAFETY: loading the vendor runtime; its initializers are the vendor's.
        let lib = unsafe { libloading::Library::new("libascendcl.so") }.map_err(|e| e.to_string())?;
        // SAFETY: each signature matches acl_rt.h as restated in shared/reference/ascend.md.
        let api = unsafe {
            Api {
                set_device: symbol(&lib, "aclrtSetDevice")?,
                get_device: symbol(&lib, "aclrtGetDevice")?,
                get_current_context: symbol(&lib, "aclrtGetCurrentContext")?,
                set_current_context: symbol(&lib, "aclrtSetCurrentContext")?,
                synchronize_device: symbol(&lib, "aclrtSynchronizeDevice")?,
                get_mem_info: symbol(&lib, "aclrtGetMemInfo")?,
                reserve: symbol(&lib, "aclrtReserveMemAddress")?,
                release_address: symbol(&lib, "aclrtReleaseMemAddress")?,
                malloc_physical: symbol(&lib, "aclrtMallocPhysical")?,
                free_physical: symbol(&lib, "aclrtFreePhysical")?,
                map: symbol(&lib, "aclrtMapMem")?,
                unmap: symbol(&lib, "aclrtUnmapMem")?,
                granularity: symbol(&lib, "aclrtMemGetAllocationGranularity")?,
                malloc_host: symbol(&lib, "aclrtMallocHost")?,
                free_host: symbol(&lib, "aclrtFreeHost")?,
                create_stream: symbol(&lib, "aclrtCreateStream")?,
                synchronize_stream: symbol(&lib, "aclrtSynchronizeStream")?,
                memcpy_async: symbol(&lib, "aclrtMemcpyAsync")?,
            }
        };
        Ok(Acl { api, contexts: Mutex::new(HashMap::new()), _lib: lib })
    }

    fn thread_device(&self) -> Option<i32> {
        let mut dev = -1;
        // SAFETY: writes one int.
        (unsafe { (self.api.get_device)(&mut dev) } == 0).then_some(dev)
    }
}

impl Device for Acl {
    fn vendor(&self) -> Vendor {
        Vendor::Acl
    }

    fn oom_code(&self) -> i32 {
        RT_MEMORY_ALLOCATION
    }

    fn invalid_code(&self) -> i32 {
        RT_PARAM_INVALID
    }

    /// Ascend's asynchronous copies need page-locked host memory.
    fn copies_pageable_memory(&self) -> bool {
        false
    }

    fn current_device(&self) -> DevResult<i32> {
        let dev = self.thread_device().ok_or(DeviceError { op: "aclrtGetDevice", code: 107_002 })?;
        let mut ctx: Ptr = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        if unsafe { (self.api.get_current_context)(&mut ctx) } == 0 && !ctx.is_null() {
            self.contexts.lock().unwrap_or_else(|e| e.into_inner()).entry(dev).or_insert(ctx as usize);
        }
        Ok(dev)
    }

    fn bind_thread(&self, dev: i32) -> DevResult<usize> {
        if self.thread_device() == Some(dev) {
            return Ok(UNCHANGED);
        }
        let mut previous: Ptr = std::ptr::null_mut();
        // SAFETY: writes one pointer (left null when the thread has no context).
        unsafe { (self.api.get_current_context)(&mut previous) };
        let known = self.contexts.lock().unwrap_or_else(|e| e.into_inner()).get(&dev).copied();
        match known {
            // SAFETY: a context the application's thread had current.
            Some(ctx) => check("aclrtSetCurrentContext", unsafe { (self.api.set_current_context)(ctx as Ptr) }),
            // SAFETY: plain device selection.
            None => check("aclrtSetDevice", unsafe { (self.api.set_device)(dev) }),
        }?;
        Ok(previous as usize)
    }

    fn restore_thread(&self, previous: usize) {
        if previous != UNCHANGED && previous != 0 {
            // SAFETY: the context that was current before bind_thread.
            unsafe { (self.api.set_current_context)(previous as Ptr) };
        }
    }

    fn granularity(&self, dev: i32, kind: MemKind) -> DevResult<usize> {
        let mut p = prop(dev, kind);
        let mut g = 0usize;
        // SAFETY: valid prop and out pointer; option 0 = minimum.
        check("aclrtMemGetAllocationGranularity", unsafe { (self.api.granularity)(&mut p, 0, &mut g) })?;
        Ok(g.max(1))
    }

    fn reserve(&self, size: usize) -> DevResult<u64> {
        let mut p: Ptr = std::ptr::null_mut();
        // SAFETY: alignment and flags must be 0; writes one pointer.
        check("aclrtReserveMemAddress", unsafe { (self.api.reserve)(&mut p, size, 0, std::ptr::null_mut(), 0) })?;
        Ok(p as u64)
    }

    fn free_reservation(&self, addr: u64, _size: usize) -> DevResult<()> {
        // SAFETY: a reservation we made.
        check("aclrtReleaseMemAddress", unsafe { (self.api.release_address)(addr as Ptr) })
    }

    fn create(&self, dev: i32, size: usize, kind: MemKind) -> DevResult<PhysHandle> {
        let p = prop(dev, kind);
        let mut h: Ptr = std::ptr::null_mut();
        // SAFETY: valid prop; writes one handle.
        check("aclrtMallocPhysical", unsafe { (self.api.malloc_physical)(&mut h, size, &p, 0) })?;
        Ok(h as u64)
    }

    fn release(&self, handle: PhysHandle) -> DevResult<()> {
        // SAFETY: a handle we created, unmapped first by the saver.
        check("aclrtFreePhysical", unsafe { (self.api.free_physical)(handle as Ptr) })
    }

    fn map(&self, addr: u64, size: usize, handle: PhysHandle) -> DevResult<()> {
        // SAFETY: size equals the handle's; offset and flags 0.
        check("aclrtMapMem", unsafe { (self.api.map)(addr as Ptr, size, 0, handle as Ptr, 0) })
    }

    fn set_access(&self, _dev: i32, _addr: u64, _size: usize) -> DevResult<()> {
        // aclrtMapMem maps with read/write access; aclrtMemSetAccess is only for no-access maps.
        Ok(())
    }

    fn unmap(&self, addr: u64, _size: usize) -> DevResult<()> {
        // SAFETY: our mapping (ACL unmaps by address).
        check("aclrtUnmapMem", unsafe { (self.api.unmap)(addr as Ptr) })
    }

    fn synchronize(&self) -> DevResult<()> {
        // SAFETY: no arguments.
        check("aclrtSynchronizeDevice", unsafe { (self.api.synchronize_device)() })
    }

    fn mem_info(&self) -> DevResult<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two sizes.
        check("aclrtGetMemInfo", unsafe { (self.api.get_mem_info)(HBM_MEM, &mut free, &mut total) })?;
        Ok((free as u64, total as u64))
    }

    fn host_alloc(&self, size: usize) -> DevResult<*mut u8> {
        let mut p: Ptr = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        check("aclrtMallocHost", unsafe { (self.api.malloc_host)(&mut p, size) })?;
        Ok(p.cast())
    }

    fn host_free(&self, ptr: *mut u8) {
        // SAFETY: memory from aclrtMallocHost.
        unsafe { (self.api.free_host)(ptr.cast()) };
    }

    fn stream_create(&self) -> DevResult<Stream> {
        let mut s: Ptr = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check("aclrtCreateStream", unsafe { (self.api.create_stream)(&mut s) })?;
        Ok(s as Stream)
    }

    fn stream_synchronize(&self, stream: Stream) -> DevResult<()> {
        // SAFETY: a stream we created.
        check("aclrtSynchronizeStream", unsafe { (self.api.synchronize_stream)(stream as Ptr) })
    }

    fn copy_to_host_async(&self, dst: *mut u8, src: u64, len: usize, stream: Stream) -> DevResult<()> {
        // SAFETY: destination of at least `len` bytes, mapped source.
        check("aclrtMemcpyAsync", unsafe {
            (self.api.memcpy_async)(dst.cast(), len, src as *const c_void, len, MEMCPY_DEVICE_TO_HOST, stream as Ptr)
        })
    }

    fn copy_to_device_async(&self, dst: u64, src: *const u8, len: usize, stream: Stream) -> DevResult<()> {
        // SAFETY: mapped destination, source of at least `len` bytes.
        check("aclrtMemcpyAsync", unsafe {
            (self.api.memcpy_async)(dst as Ptr, len, src.cast(), len, MEMCPY_HOST_TO_DEVICE, stream as Ptr)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malloc_policies_choose_the_physical_memory_cann_documents() {
        const MIB: usize = 1 << 20;
        assert_eq!(memory_for_policy(0, MIB), Some((HBM_MEM_NORMAL, None)), "huge first, 1 MiB or less");
        assert_eq!(memory_for_policy(0, 4 * MIB), Some((HBM_MEM_HUGE, Some(HBM_MEM_NORMAL))));
        assert_eq!(memory_for_policy(1, MIB), Some((HBM_MEM_HUGE, None)));
        assert_eq!(memory_for_policy(2, 4 * MIB), Some((HBM_MEM_NORMAL, None)));
        assert_eq!(memory_for_policy(3, MIB), Some((HBM_MEM_P2P_HUGE, Some(HBM_MEM_P2P_NORMAL))));
        assert_eq!(memory_for_policy(4, MIB), Some((HBM_MEM_P2P_HUGE, None)));
        assert_eq!(memory_for_policy(5, MIB), Some((HBM_MEM_P2P_NORMAL, None)));
        assert_eq!(memory_for_policy(6, MIB), Some((HBM_MEM_HUGE1G, None)));
        assert_eq!(memory_for_policy(7, MIB), Some((HBM_MEM_P2P_HUGE1G, None)));
        // Bandwidth bits change nothing; read-only and unknown policies are not reproduced.
        assert_eq!(memory_for_policy(0x1000 | 1, MIB), Some((HBM_MEM_HUGE, None)));
        assert_eq!(memory_for_policy(0x0100 | 2, MIB), Some((HBM_MEM_NORMAL, None)));
        assert_eq!(memory_for_policy(0x10_0000, 4 * MIB), None);
        assert_eq!(memory_for_policy(8, 4 * MIB), None);
    }
}
