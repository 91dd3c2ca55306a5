//! The Ascend runtime ABI (`libascendcl.so`, acl/acl_rt.h), including the virtual-memory calls.
//!
//! As on a real 910B, calls that work on "the current device" fail with
//! ACL_ERROR_RT_CONTEXT_NULL on a thread that never set a device or context: a control thread in
//! the hook must set one first.

use crate::ascend::{ACL_CTX_TOKENS, ACL_DEVICE, open_acl_context};
use crate::core::config::GRANULARITY;
use crate::core::context;
use crate::core::fault;
use crate::core::memory::MemError;
use crate::core::sim::{guard, sim};
use libc::{c_char, c_int, c_void};

pub const SUCCESS: i32 = 0;
pub const INVALID_PARAM: i32 = 100_000;
pub const RT_PARAM_INVALID: i32 = 107_000;
pub const RT_INVALID_DEVICEID: i32 = 107_001;
pub const RT_CONTEXT_NULL: i32 = 107_002;
pub const RT_STREAM_CONTEXT: i32 = 107_003;
pub const RT_FEATURE_NOT_SUPPORT: i32 = 207_000;
pub const RT_MEMORY_ALLOCATION: i32 = 207_001;
pub const RT_MEMORY_FREE: i32 = 207_002;
pub const RT_INTERNAL_ERROR: i32 = 507_899;

pub const ACCESS_READWRITE: c_int = 3;
// The structs and their constants, declared once for every part of tms (tms-vendor).
pub use tms_vendor::acl::{
    HBM_MEM_HUGE, MEM_ALLOCATION_TYPE_PINNED, MEM_LOCATION_TYPE_DEVICE, MemAccessDesc as AclMemAccessDesc,
    MemLocation as AclMemLocation, PhysicalMemProp as AclPhysicalMemProp,
};

pub fn code_of(e: MemError) -> i32 {
    match e {
        MemError::Invalid | MemError::IllegalAddress => RT_PARAM_INVALID,
        MemError::OutOfMemory | MemError::Host => RT_MEMORY_ALLOCATION,
    }
}

fn result(r: Result<(), MemError>) -> i32 {
    r.map_or_else(code_of, |()| SUCCESS)
}

pub(crate) fn call(name: &str, body: impl FnOnce() -> i32) -> i32 {
    context::note_per_call_faults();
    guard(RT_INTERNAL_ERROR, || fault::check(name, RT_MEMORY_ALLOCATION).unwrap_or_else(body))
}

fn current() -> Result<usize, i32> {
    match ACL_DEVICE.with(|c| c.get()) {
        0 => Err(RT_CONTEXT_NULL),
        n => Ok(n - 1),
    }
}

pub(crate) fn put<T>(out: *mut T, value: T) -> i32 {
    if out.is_null() {
        return INVALID_PARAM;
    }
    // SAFETY: checked non-null; the caller provides a writable location.
    unsafe { out.write(value) };
    SUCCESS
}

pub unsafe extern "C" fn acl_init(_config_path: *const c_char) -> i32 {
    call("aclInit", || {
        sim();
        SUCCESS
    })
}

pub unsafe extern "C" fn acl_finalize() -> i32 {
    call("aclFinalize", || SUCCESS)
}

pub unsafe extern "C" fn aclrt_set_device(dev: i32) -> i32 {
    call("aclrtSetDevice", || match sim().valid_device(dev as i64) {
        Some(d) if open_acl_context(d) => {
            ACL_DEVICE.with(|c| c.set(d + 1));
            SUCCESS
        }
        Some(_) => RT_MEMORY_ALLOCATION,
        None => RT_INVALID_DEVICEID,
    })
}

pub unsafe extern "C" fn aclrt_get_device(dev: *mut i32) -> i32 {
    call("aclrtGetDevice", || match current() {
        Ok(d) => put(dev, d as i32),
        Err(e) => e,
    })
}

pub unsafe extern "C" fn aclrt_reset_device(dev: i32) -> i32 {
    call("aclrtResetDevice", || match sim().valid_device(dev as i64) {
        Some(d) => {
            sim().synchronize(Some(d));
            ACL_DEVICE.with(|c| {
                if c.get() == d + 1 {
                    c.set(0)
                }
            });
            SUCCESS
        }
        None => RT_INVALID_DEVICEID,
    })
}

pub unsafe extern "C" fn aclrt_get_device_count(count: *mut u32) -> i32 {
    call("aclrtGetDeviceCount", || put(count, sim().devices() as u32))
}

pub unsafe extern "C" fn aclrt_create_context(ctx: *mut *mut c_void, dev: i32) -> i32 {
    call("aclrtCreateContext", || match sim().valid_device(dev as i64) {
        Some(d) if open_acl_context(d) => {
            // Creating a context makes it current, as the real runtime does.
            ACL_DEVICE.with(|c| c.set(d + 1));
            put(ctx, context::handle(&ACL_CTX_TOKENS, d))
        }
        Some(_) => RT_MEMORY_ALLOCATION,
        None => RT_INVALID_DEVICEID,
    })
}

pub unsafe extern "C" fn aclrt_destroy_context(ctx: *mut c_void) -> i32 {
    call("aclrtDestroyContext", || match context::device_of(&ACL_CTX_TOKENS, ctx) {
        Some(_) => SUCCESS,
        None => RT_PARAM_INVALID,
    })
}

pub unsafe extern "C" fn aclrt_get_current_context(ctx: *mut *mut c_void) -> i32 {
    call("aclrtGetCurrentContext", || match current() {
        Ok(d) => put(ctx, context::handle(&ACL_CTX_TOKENS, d)),
        Err(e) => e,
    })
}

pub unsafe extern "C" fn aclrt_set_current_context(ctx: *mut c_void) -> i32 {
    call("aclrtSetCurrentContext", || match context::device_of(&ACL_CTX_TOKENS, ctx) {
        Some(d) if d < sim().devices() => {
            ACL_DEVICE.with(|c| c.set(d + 1));
            SUCCESS
        }
        _ => RT_PARAM_INVALID,
    })
}

pub unsafe extern "C" fn aclrt_synchronize_device() -> i32 {
    call("aclrtSynchronizeDevice", || match current() {
        Ok(d) => sim().synchronize(Some(d)),
        Err(e) => e,
    })
}

pub unsafe extern "C" fn aclrt_synchronize_device_with_timeout(timeout_ms: i32) -> i32 {
    call("aclrtSynchronizeDeviceWithTimeout", || {
        if timeout_ms < -1 {
            return INVALID_PARAM;
        }
        match current() {
            Ok(d) => sim().synchronize(Some(d)),
            Err(e) => e,
        }
    })
}

pub unsafe extern "C" fn aclrt_create_stream(stream: *mut *mut c_void) -> i32 {
    call("aclrtCreateStream", || match current() {
        Ok(d) => match sim().streams.create(d) {
            Some(h) => put(stream, h as *mut c_void),
            None => RT_MEMORY_ALLOCATION,
        },
        Err(e) => e,
    })
}

pub unsafe extern "C" fn aclrt_synchronize_stream(stream: *mut c_void) -> i32 {
    call("aclrtSynchronizeStream", || {
        sim().streams.synchronize(crate::ascend::stream_id(stream as usize)).unwrap_or(RT_PARAM_INVALID)
    })
}

pub unsafe extern "C" fn aclrt_destroy_stream(stream: *mut c_void) -> i32 {
    call("aclrtDestroyStream", || if sim().streams.destroy(stream as usize) { SUCCESS } else { RT_PARAM_INVALID })
}

/// A documented aclrtMemMallocPolicy: HUGE_FIRST (0) .. HUGE1G_ONLY_P2P (7), optionally with the
/// LOW/HIGH_BAND_WIDTH (0x100, 0x1000) and USER_SPACE_READONLY (0x100000) bits.
fn valid_policy(policy: c_int) -> bool {
    const FLAGS: c_int = 0x0100 | 0x1000 | 0x10_0000;
    (0..=7).contains(&(policy & !FLAGS))
}

fn malloc(name: &str, ptr: *mut *mut c_void, size: usize, policy: c_int, padding: usize) -> i32 {
    call(name, || {
        let dev = match current() {
            Ok(d) => d,
            Err(e) => return e,
        };
        if ptr.is_null() || size == 0 || !valid_policy(policy) {
            return INVALID_PARAM;
        }
        // CANN rounds the size up to 32 bytes, and aclrtMalloc adds 32 more (aclrtMallocAlign32
        // does not).
        let Some(size) = size.checked_next_multiple_of(32).and_then(|n| n.checked_add(padding)) else {
            return RT_MEMORY_ALLOCATION;
        };
        match sim().plain_alloc(dev, size) {
            Ok(p) => put(ptr, p as *mut c_void),
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn aclrt_malloc(ptr: *mut *mut c_void, size: usize, policy: c_int) -> i32 {
    malloc("aclrtMalloc", ptr, size, policy, 32)
}

pub unsafe extern "C" fn aclrt_malloc_align32(ptr: *mut *mut c_void, size: usize, policy: c_int) -> i32 {
    malloc("aclrtMallocAlign32", ptr, size, policy, 0)
}

pub unsafe extern "C" fn aclrt_free(ptr: *mut c_void) -> i32 {
    call("aclrtFree", || {
        if ptr.is_null() {
            return INVALID_PARAM;
        }
        result(sim().plain_free(ptr as usize))
    })
}

pub unsafe extern "C" fn aclrt_malloc_host(ptr: *mut *mut c_void, size: usize) -> i32 {
    call("aclrtMallocHost", || {
        if ptr.is_null() || size == 0 {
            return INVALID_PARAM;
        }
        match sim().host_alloc(size, 0) {
            Ok(p) => put(ptr, p as *mut c_void),
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn aclrt_free_host(ptr: *mut c_void) -> i32 {
    call("aclrtFreeHost", || {
        if ptr.is_null() {
            return INVALID_PARAM;
        }
        result(sim().host_free(ptr as usize))
    })
}

fn memcpy(
    name: &str,
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: c_int,
    stream: usize,
) -> i32 {
    call(name, || {
        if count > dest_max {
            return INVALID_PARAM;
        }
        let Some(kind) = crate::ascend::copy_direction(kind) else { return INVALID_PARAM };
        let stream = crate::ascend::stream_id(stream);
        let copied = sim().copy(dst as usize, src as usize, count, kind, stream, code_of);
        sim().finish_copy(name, copied, dst as usize, count, stream)
    })
}

pub unsafe extern "C" fn aclrt_memcpy(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: c_int,
) -> i32 {
    memcpy("aclrtMemcpy", dst, dest_max, src, count, kind, 0)
}

pub unsafe extern "C" fn aclrt_memcpy_async(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: c_int,
    stream: *mut c_void,
) -> i32 {
    memcpy("aclrtMemcpyAsync", dst, dest_max, src, count, kind, stream as usize)
}

pub unsafe extern "C" fn aclrt_memset(dst: *mut c_void, max_count: usize, value: i32, count: usize) -> i32 {
    call("aclrtMemset", || {
        if count > max_count {
            return INVALID_PARAM;
        }
        result(sim().memset(dst as usize, value as u8, count))
    })
}

pub unsafe extern "C" fn aclrt_get_mem_info(attr: c_int, free: *mut usize, total: *mut usize) -> i32 {
    call("aclrtGetMemInfo", || {
        let dev = match current() {
            Ok(d) => d,
            Err(e) => return e,
        };
        if !(0..=9).contains(&attr) || free.is_null() || total.is_null() {
            return INVALID_PARAM;
        }
        // The emulated device is a 910B: its memory is HBM. DDR attributes (DDR_MEM 0, DDR_MEM_HUGE
        // 2, DDR_MEM_NORMAL 3, DDR_MEM_P2P_* 6 and 7) report 0 free of 0, as CANN documents for an
        // attribute that does not match the hardware (aclrtGetMemInfo reference); the HBM ones
        // report the device's pool.
        if matches!(attr, 0 | 2 | 3 | 6 | 7) {
            put(free, 0);
            return put(total, 0);
        }
        let (f, t) = sim().mem_info(dev);
        put(free, f as usize);
        put(total, t as usize)
    })
}

// ---- virtual memory management -------------------------------------------------------------

/// aclrtMemAttr: DDR_MEM (0) .. HBM_MEM_P2P_HUGE1G (11), then MEM_NORMAL (12) .. MEM_P2P_HUGE1G (17).
const MEM_ATTR_LAST: c_int = 17;

/// The 1 GiB-page attributes (HBM_MEM_HUGE1G, HBM_MEM_P2P_HUGE1G, MEM_HUGE1G, MEM_P2P_HUGE1G).
fn huge_1g(attr: c_int) -> bool {
    matches!(attr, 10 | 11 | 14 | 17)
}

fn attr_granularity(attr: c_int) -> usize {
    if huge_1g(attr) { 1 << 30 } else { GRANULARITY }
}

fn prop_device(prop: *const AclPhysicalMemProp) -> Result<usize, i32> {
    if prop.is_null() {
        return Err(INVALID_PARAM);
    }
    // SAFETY: checked non-null; the caller passes an aclrtPhysicalMemProp.
    let p = unsafe { prop.read_unaligned() };
    if p.location.kind != MEM_LOCATION_TYPE_DEVICE
        || p.allocation_type != MEM_ALLOCATION_TYPE_PINNED
        || !(0..=MEM_ATTR_LAST).contains(&p.mem_attr)
    {
        return Err(INVALID_PARAM);
    }
    sim().valid_device(p.location.id as i64).ok_or(RT_INVALID_DEVICEID)
}

pub unsafe extern "C" fn aclrt_mem_get_allocation_granularity(
    prop: *mut AclPhysicalMemProp,
    option: c_int,
    g: *mut usize,
) -> i32 {
    call("aclrtMemGetAllocationGranularity", || {
        if let Err(e) = prop_device(prop) {
            return e;
        }
        if !(0..=1).contains(&option) {
            return INVALID_PARAM;
        }
        // SAFETY: prop_device checked it is non-null.
        put(g, attr_granularity(unsafe { prop.read_unaligned() }.mem_attr))
    })
}

pub unsafe extern "C" fn aclrt_reserve_mem_address(
    ptr: *mut *mut c_void,
    size: usize,
    alignment: usize,
    expect: *mut c_void,
    flags: u64,
) -> i32 {
    call("aclrtReserveMemAddress", || {
        if ptr.is_null() || alignment != 0 || flags > 1 {
            return INVALID_PARAM;
        }
        match sim().reserve(size, 0, expect as usize) {
            Ok(p) => put(ptr, p as *mut c_void),
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn aclrt_release_mem_address(ptr: *mut c_void) -> i32 {
    call("aclrtReleaseMemAddress", || result(sim().free_reservation(ptr as usize, None)))
}

pub unsafe extern "C" fn aclrt_malloc_physical(
    handle: *mut *mut c_void,
    size: usize,
    prop: *const AclPhysicalMemProp,
    flags: u64,
) -> i32 {
    call("aclrtMallocPhysical", || {
        if handle.is_null() || flags != 0 {
            return INVALID_PARAM;
        }
        let dev = match prop_device(prop) {
            Ok(d) => d,
            Err(e) => return e,
        };
        // SAFETY: prop_device checked it is non-null.
        let attr = unsafe { prop.read_unaligned() }.mem_attr;
        if !size.is_multiple_of(attr_granularity(attr)) {
            return code_of(MemError::Invalid);
        }
        match sim().create(dev, size, attr) {
            Ok(h) => put(handle, h as usize as *mut c_void),
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn aclrt_free_physical(handle: *mut c_void) -> i32 {
    call("aclrtFreePhysical", || result(sim().release(handle as usize as u64, true)))
}

pub unsafe extern "C" fn aclrt_map_mem(
    ptr: *mut c_void,
    size: usize,
    offset: usize,
    handle: *mut c_void,
    flags: u64,
) -> i32 {
    call("aclrtMapMem", || {
        if flags != 0 {
            return INVALID_PARAM;
        }
        let s = sim();
        // Ascend maps with access granted: aclrtMemSetAccess is only for no-access maps.
        let r = s
            .map(ptr as usize, size, offset, handle as usize as u64, true)
            .and_then(|()| s.set_access(ptr as usize, size, libc::PROT_READ | libc::PROT_WRITE));
        result(r)
    })
}

pub unsafe extern "C" fn aclrt_unmap_mem(ptr: *mut c_void) -> i32 {
    call("aclrtUnmapMem", || result(sim().unmap(ptr as usize, None)))
}

pub unsafe extern "C" fn aclrt_mem_set_access(
    ptr: *mut c_void,
    size: usize,
    desc: *mut AclMemAccessDesc,
    count: usize,
) -> i32 {
    call("aclrtMemSetAccess", || {
        if desc.is_null() || count == 0 {
            return INVALID_PARAM;
        }
        // SAFETY: the caller passes `count` descriptors; C callers may not align them.
        let descs: Vec<_> = (0..count).map(|i| unsafe { desc.add(i).read_unaligned() }).collect();
        let mut prot = libc::PROT_NONE;
        for d in descs {
            if d.location.kind != MEM_LOCATION_TYPE_DEVICE || sim().valid_device(d.location.id as i64).is_none() {
                return INVALID_PARAM;
            }
            prot |= match d.flags {
                0 => libc::PROT_NONE,
                1 => libc::PROT_READ,
                ACCESS_READWRITE => libc::PROT_READ | libc::PROT_WRITE,
                _ => return INVALID_PARAM,
            };
        }
        result(sim().set_access(ptr as usize, size, prot))
    })
}

pub unsafe extern "C" fn acl_get_recent_err_msg() -> *const c_char {
    c"tms-sim: see the returned error code".as_ptr()
}
