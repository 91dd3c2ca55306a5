//! HCCL's communicator creation and destruction (CANN's hccl.h): each call goes to the real
//! library first, unchanged, and the communicator it made or ends is then recorded or forgotten
//! (comms.rs) so that `tms-ctl status` and `list` show what its buffers cost. HCCL has no call
//! that releases a live communicator's buffers, so these are only measured, never paused.
//!
//! As for NCCL, a lookup of these names on libhccl.so's own handle (vllm-ascend's and verl's
//! ctypes communicators) gets the hook's function (exports/dlsym.rs), and libhccl.so is never
//! needed to build or load the hook.
#![allow(non_snake_case)] // the vendor ABI names these functions

use crate::comms;
use crate::forward::{ASCENDCL, Target};
use libc::{c_char, c_int, c_void};
use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};

const HCCL: &[&CStr] = &[c"libhccl.so"];
const SUCCESS: c_int = 0;
/// HCCL_E_INTERNAL: the answer when no loaded library provides the function.
const E_INTERNAL: c_int = 4;

pub(crate) static INIT_ROOT_INFO: Target = Target::new(c"HcclCommInitRootInfo", HCCL);
pub(crate) static INIT_ROOT_INFO_CONFIG: Target = Target::new(c"HcclCommInitRootInfoConfig", HCCL);
pub(crate) static INIT_CLUSTER_INFO: Target = Target::new(c"HcclCommInitClusterInfo", HCCL);
pub(crate) static INIT_ALL: Target = Target::new(c"HcclCommInitAll", HCCL);
pub(crate) static DESTROY: Target = Target::new(c"HcclCommDestroy", HCCL);
static GET_DEVICE: Target = Target::new(c"aclrtGetDevice", ASCENDCL);

/// HCCL_BUFFSIZE's default, in MB.
const DEFAULT_BUFFSIZE_MB: u64 = 200;
use tms_vendor::hccl::{BUFFSIZE_NOT_SET, CONFIG_MAGIC, CommConfigHead as ConfigHead};

/// The interposed name `name`, as (its forwarding target, the hook's function), for lookups on a
/// library's own handle (exports/dlsym.rs).
pub(crate) fn interposed(name: &[u8]) -> Option<(&'static Target, usize)> {
    let own = |f: *const ()| f as usize;
    Some(match name {
        b"HcclCommInitRootInfo" => (&INIT_ROOT_INFO, own(HcclCommInitRootInfo as *const ())),
        b"HcclCommInitRootInfoConfig" => (&INIT_ROOT_INFO_CONFIG, own(HcclCommInitRootInfoConfig as *const ())),
        b"HcclCommInitClusterInfo" => (&INIT_CLUSTER_INFO, own(HcclCommInitClusterInfo as *const ())),
        b"HcclCommInitAll" => (&INIT_ALL, own(HcclCommInitAll as *const ())),
        b"HcclCommDestroy" => (&DESTROY, own(HcclCommDestroy as *const ())),
        _ => return None,
    })
}

fn real(t: &Target, own: usize) -> Option<usize> {
    let f = t.resolve(own);
    if f.is_none() {
        tracing::warn!("tms: {} called but no HCCL library providing it is loaded", t.name.to_string_lossy());
    }
    f
}

/// The calling thread's Ascend device (HCCL builds a communicator on it).
fn current_device() -> Option<i32> {
    let f = GET_DEVICE.resolve(0)?;
    let mut d: i32 = -1;
    // SAFETY: ACL's aclrtGetDevice(int32_t*).
    let rc = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*mut i32) -> c_int>(f)(&mut d) };
    (rc == 0 && d >= 0).then_some(d)
}

/// Bytes of a communicator's buffers as HCCL sizes them: 2 x (the config's hcclBufferSize when
/// set, else HCCL_BUFFSIZE, else 200) MB, one buffer to send and one to receive.
fn buffer_bytes(config: *const ConfigHead) -> u64 {
    let from_config = if config.is_null() {
        None
    } else {
        // SAFETY: a config HCCL accepted (the real call succeeded), which starts with this head.
        let c = unsafe { &*config };
        (c.magic == CONFIG_MAGIC
            && c.size >= std::mem::size_of::<ConfigHead>()
            && c.buffer_size_mb != BUFFSIZE_NOT_SET
            && c.buffer_size_mb != 0)
            .then_some(u64::from(c.buffer_size_mb))
    };
    let mb = from_config
        .or_else(|| std::env::var("HCCL_BUFFSIZE").ok().and_then(|v| v.trim().parse::<u64>().ok()).filter(|m| *m >= 1))
        .unwrap_or(DEFAULT_BUFFSIZE_MB);
    2 * mb * (1 << 20)
}

/// Records `count` communicators HCCL made at `out`, never unwinding into C.
fn record(rc: c_int, out: *mut *mut c_void, count: usize, device: impl Fn(usize) -> Option<i32>, bytes: u64) {
    if rc != SUCCESS || out.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        for i in 0..count {
            // SAFETY: the real call succeeded and filled `count` handles at `out`.
            comms::hccl_created(unsafe { *out.add(i) }, device(i), bytes);
        }
    }));
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn HcclCommInitRootInfo(
    nranks: u32,
    root_info: *const c_void,
    rank: u32,
    comm: *mut *mut c_void,
) -> c_int {
    type F = unsafe extern "C" fn(u32, *const c_void, u32, *mut *mut c_void) -> c_int;
    let Some(f) = real(&INIT_ROOT_INFO, HcclCommInitRootInfo as *const () as usize) else { return E_INTERNAL };
    // SAFETY: HCCL's function, with the caller's arguments.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(nranks, root_info, rank, comm) };
    record(rc, comm, 1, |_| current_device(), buffer_bytes(std::ptr::null()));
    rc
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn HcclCommInitRootInfoConfig(
    nranks: u32,
    root_info: *const c_void,
    rank: u32,
    config: *const c_void,
    comm: *mut *mut c_void,
) -> c_int {
    type F = unsafe extern "C" fn(u32, *const c_void, u32, *const c_void, *mut *mut c_void) -> c_int;
    let Some(f) = real(&INIT_ROOT_INFO_CONFIG, HcclCommInitRootInfoConfig as *const () as usize) else {
        return E_INTERNAL;
    };
    // SAFETY: HCCL's function, with the caller's arguments.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(nranks, root_info, rank, config, comm) };
    record(rc, comm, 1, |_| current_device(), buffer_bytes(config.cast()));
    rc
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn HcclCommInitClusterInfo(
    cluster_info: *const c_char,
    rank: u32,
    comm: *mut *mut c_void,
) -> c_int {
    type F = unsafe extern "C" fn(*const c_char, u32, *mut *mut c_void) -> c_int;
    let Some(f) = real(&INIT_CLUSTER_INFO, HcclCommInitClusterInfo as *const () as usize) else {
        return E_INTERNAL;
    };
    // SAFETY: HCCL's function, with the caller's arguments.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(cluster_info, rank, comm) };
    record(rc, comm, 1, |_| current_device(), buffer_bytes(std::ptr::null()));
    rc
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn HcclCommInitAll(ndev: u32, devices: *const i32, comms: *mut *mut c_void) -> c_int {
    type F = unsafe extern "C" fn(u32, *const i32, *mut *mut c_void) -> c_int;
    let Some(f) = real(&INIT_ALL, HcclCommInitAll as *const () as usize) else { return E_INTERNAL };
    // SAFETY: HCCL's function, with the caller's arguments.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(ndev, devices, comms) };
    // SAFETY (in the closure): the call succeeded, so `devices` holds `ndev` ids.
    let device = |i: usize| (!devices.is_null()).then(|| unsafe { *devices.add(i) });
    record(rc, comms, ndev as usize, device, buffer_bytes(std::ptr::null()));
    rc
}

/// Forgotten first: once HCCL has freed it, a new communicator may get the same address.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn HcclCommDestroy(comm: *mut c_void) -> c_int {
    type F = unsafe extern "C" fn(*mut c_void) -> c_int;
    let Some(f) = real(&DESTROY, HcclCommDestroy as *const () as usize) else { return E_INTERNAL };
    let _ = catch_unwind(AssertUnwindSafe(|| comms::hccl_forget(comm)));
    // SAFETY: HCCL's function, with the caller's argument.
    unsafe { std::mem::transmute::<usize, F>(f)(comm) }
}
