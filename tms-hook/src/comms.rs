//! NCCL communicators: recorded when the application creates them, suspended and resumed under
//! the reserved tag `nccl`.
//!
//! NCCL allocates its communicators' buffers itself, outside any region, so no allocation of ours
//! holds them. NCCL 2.29.7+ can give them back: `ncclCommSuspend(comm, NCCL_SUSPEND_MEM)` waits
//! for the communicator's queued work and releases its dynamic device memory, `ncclCommResume`
//! takes it again, and `ncclCommMemStats` says how much (0: suspendable bytes, 1: suspended,
//! 2: persistent bytes, 3: total). The exports in exports/nccl.rs forward every communicator
//! creation and destruction to the real library and tell this module; nothing else happens
//! until `tms_pause("nccl")` (or `tms-ctl pause --tag nccl`) asks for it. Pausing every tag
//! (no tag named) leaves communicators alone: a framework that pauses everything and then
//! syncs weights over NCCL keeps working.
//!
//! HCCL (Ascend) communicators are recorded too (exports/hccl.rs), each with the bytes of its
//! buffers (2 x HCCL_BUFFSIZE MB, or the config's size), for status to show what they cost: HCCL
//! has no call that releases a live communicator's buffers, so pausing tag `nccl` in a process
//! that has them says so (an error of that tag only) and leaves them.
//!
//! Locking: `COMMS` (the handles) is held only to read or change the table, never across a call
//! into NCCL. `OPS` serializes pause, resume, status and `ncclCommDestroy`, so a communicator is
//! never destroyed while it is being suspended or resumed. `ncclCommAbort` does not wait for
//! `OPS`: it is how an application ends work that is stuck, possibly the very work a suspend waits for.

use crate::device::{Device, DeviceError, Vendor};
use crate::forward::Target;
use crate::saver::{Error, Report, Saver};
use libc::{c_char, c_int, c_void};
use std::collections::BTreeMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use tms_vendor::nccl::SUSPEND_MEM;

/// The reserved tag that names the process's NCCL communicators.
pub const TAG: &str = "nccl";

const NCCL: &[&CStr] = &[c"libnccl.so.2", c"libnccl.so"];
static SUSPEND: Target = Target::new(c"ncclCommSuspend", NCCL);
static RESUME: Target = Target::new(c"ncclCommResume", NCCL);
static MEM_STATS: Target = Target::new(c"ncclCommMemStats", NCCL);
static CU_DEVICE: Target = Target::new(c"ncclCommCuDevice", NCCL);
static LAST_ERROR: Target = Target::new(c"ncclGetLastError", NCCL);

const STAT_SUSPENDABLE: c_int = 0;
const STAT_SUSPENDED: c_int = 1;
const STAT_PERSISTENT: c_int = 2;

#[derive(Debug, Clone, Copy, Default)]
struct Comm {
    /// The CUDA device, once NCCL has said (a non-blocking init may still be running).
    device: Option<i32>,
    /// Suspended by tms (a communicator the application suspended itself is left to it).
    suspended_by_tms: bool,
}

static COMMS: Mutex<BTreeMap<usize, Comm>> = Mutex::new(BTreeMap::new());
/// HCCL communicators: handle -> (device, bytes of its buffers).
static HCCL: Mutex<BTreeMap<usize, (Option<i32>, u64)>> = Mutex::new(BTreeMap::new());
static OPS: Mutex<()> = Mutex::new(());
/// Whether this process ever created a communicator (the tag is known from then on).
static EVER: AtomicBool = AtomicBool::new(false);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records a communicator the application created (called after the real call succeeded or
/// returned ncclInProgress).
pub fn created(handle: *mut c_void) {
    if handle.is_null() {
        return;
    }
    EVER.store(true, Ordering::Release);
    lock(&COMMS).insert(handle as usize, Comm::default());
    // Like a region allocation, a communicator is memory tms-ctl can act on (or show).
    crate::control::ensure_started();
}

/// Forgets a communicator the application is destroying; returns the guard that keeps pause and
/// resume away until the real destroy has run.
pub fn destroying(handle: *mut c_void) -> MutexGuard<'static, ()> {
    let ops = lock(&OPS);
    forget(handle);
    ops
}

/// Forgets a communicator (aborted or destroyed).
pub fn forget(handle: *mut c_void) {
    if let Some(c) = lock(&COMMS).remove(&(handle as usize))
        && c.suspended_by_tms
    {
        tracing::info!("tms: NCCL communicator {:#x} ended while suspended; forgotten", handle as usize);
    }
}

/// Records an HCCL communicator the application created.
pub fn hccl_created(handle: *mut c_void, device: Option<i32>, buffer_bytes: u64) {
    if handle.is_null() {
        return;
    }
    EVER.store(true, Ordering::Release);
    lock(&HCCL).insert(handle as usize, (device, buffer_bytes));
    crate::control::ensure_started();
}

/// Forgets an HCCL communicator the application is destroying.
pub fn hccl_forget(handle: *mut c_void) {
    lock(&HCCL).remove(&(handle as usize));
}

/// Whether `tag` names the communicators of this process (it created one at some point).
pub fn is_known_tag(tag: &str) -> bool {
    tag == TAG && EVER.load(Ordering::Acquire)
}

fn resolve(t: &Target) -> Option<usize> {
    t.resolve(0)
}

fn stat(comm: usize, which: c_int) -> Result<u64, DeviceError> {
    type F = unsafe extern "C" fn(*mut c_void, c_int, *mut u64) -> c_int;
    // Missing from NCCL before 2.29.7 (PyTorch 2.11's wheels bring 2.28.9): say so, not just a code.
    let f = resolve(&MEM_STATS).ok_or(DeviceError {
        op: "ncclCommMemStats (not in the NCCL this process loaded: suspending communicators needs NCCL 2.29.7 or later)",
        code: 5,
    })?;
    let mut out = 0u64;
    // SAFETY: NCCL's ncclCommMemStats on a communicator the application created and has not destroyed.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(comm as *mut c_void, which, &mut out) };
    if rc == 0 { Ok(out) } else { Err(DeviceError { op: "ncclCommMemStats", code: rc }) }
}

fn call_comm(t: &Target, op: &'static str, comm: usize, flags: Option<c_int>) -> Result<(), DeviceError> {
    let f = resolve(t).ok_or(DeviceError { op, code: 5 })?;
    // SAFETY: NCCL's ncclCommSuspend(comm, flags) / ncclCommResume(comm) on a live communicator.
    let rc = unsafe {
        match flags {
            Some(flags) => std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_void, c_int) -> c_int>(f)(
                comm as *mut c_void,
                flags,
            ),
            None => std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_void) -> c_int>(f)(comm as *mut c_void),
        }
    };
    if rc == 0 {
        Ok(())
    } else {
        tracing::warn!("tms: {op} on NCCL communicator {comm:#x} returned {rc}: {}", last_error(comm));
        Err(DeviceError { op, code: rc })
    }
}

fn last_error(comm: usize) -> String {
    type F = unsafe extern "C" fn(*mut c_void) -> *const c_char;
    let Some(f) = resolve(&LAST_ERROR) else { return String::new() };
    // SAFETY: ncclGetLastError returns NULL or a NUL-terminated string owned by NCCL.
    let p = unsafe { std::mem::transmute::<usize, F>(f)(comm as *mut c_void) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: checked non-null; NCCL's string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn device_of(comm: usize) -> Option<i32> {
    type F = unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int;
    let f = resolve(&CU_DEVICE)?;
    let mut d: c_int = -1;
    // SAFETY: NCCL's ncclCommCuDevice on a live communicator.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(comm as *mut c_void, &mut d) };
    (rc == 0 && d >= 0).then_some(d)
}

/// One communicator's figures for status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommStatus {
    /// "nccl" or "hccl".
    pub library: &'static str,
    pub handle: usize,
    pub device: Option<i32>,
    pub suspendable_bytes: u64,
    pub persistent_bytes: u64,
    pub suspended: bool,
    pub suspended_by_tms: bool,
}

/// The communicators tms knows, with what NCCL says of their memory (a communicator whose
/// statistics cannot be read shows zeros); HCCL's with their buffers as persistent bytes.
pub fn status() -> Vec<CommStatus> {
    if !EVER.load(Ordering::Acquire) {
        return Vec::new();
    }
    let _ops = lock(&OPS);
    let comms: Vec<(usize, Comm)> = lock(&COMMS).iter().map(|(h, c)| (*h, *c)).collect();
    let hccl: Vec<CommStatus> = lock(&HCCL)
        .iter()
        .map(|(h, (device, bytes))| CommStatus {
            library: "hccl",
            handle: *h,
            device: *device,
            suspendable_bytes: 0,
            persistent_bytes: *bytes,
            suspended: false,
            suspended_by_tms: false,
        })
        .collect();
    comms
        .into_iter()
        .map(|(handle, c)| CommStatus {
            library: TAG,
            handle,
            device: c.device.or_else(|| device_of(handle)),
            suspendable_bytes: stat(handle, STAT_SUSPENDABLE).unwrap_or(0),
            persistent_bytes: stat(handle, STAT_PERSISTENT).unwrap_or(0),
            suspended: stat(handle, STAT_SUSPENDED).unwrap_or(0) != 0,
            suspended_by_tms: c.suspended_by_tms,
        })
        .chain(hccl)
        .collect()
}

/// Communicators to work on, each with its device (looked up once and kept).
fn snapshot() -> Vec<(usize, Comm)> {
    let comms: Vec<(usize, Comm)> = lock(&COMMS).iter().map(|(h, c)| (*h, *c)).collect();
    let mut out = Vec::with_capacity(comms.len());
    for (h, mut c) in comms {
        if c.device.is_none() {
            c.device = device_of(h);
            if let Some(entry) = lock(&COMMS).get_mut(&h) {
                entry.device = c.device;
            }
        }
        out.push((h, c));
    }
    out
}

fn mark(handle: usize, suspended: bool) {
    if let Some(c) = lock(&COMMS).get_mut(&handle) {
        c.suspended_by_tms = suspended;
    }
}

/// Free memory of `device` from this thread, the thread's binding put back.
fn free_on(dev: &dyn Device, device: i32) -> Option<(u64, u64)> {
    let previous = dev.bind_thread(device).ok()?;
    let info = dev.mem_info().ok();
    dev.restore_thread(previous);
    info
}

fn by_device(comms: Vec<(usize, Comm)>) -> BTreeMap<i32, Vec<(usize, Comm)>> {
    let mut out: BTreeMap<i32, Vec<(usize, Comm)>> = BTreeMap::new();
    for (h, c) in comms {
        out.entry(c.device.unwrap_or(-1)).or_default().push((h, c));
    }
    out
}

fn note(report: &mut Report, e: Error) {
    tracing::warn!("tms: {e}");
    report.error.get_or_insert(e);
}

/// Suspends every communicator not suspended yet: NCCL waits for its queued work, then gives its
/// buffers back. Counts go to `report` (a communicator is one "allocation", its suspendable bytes
/// its size); the device's free memory is checked to have risen by at least those bytes.
pub fn pause(saver: &Saver, report: &mut Report, set_free: bool) {
    if !EVER.load(Ordering::Acquire) {
        return;
    }
    let _ops = lock(&OPS);
    let hccl: Vec<u64> = lock(&HCCL).values().map(|(_, bytes)| *bytes).collect();
    if !hccl.is_empty() {
        report.allocations_failed += hccl.len() as u64;
        report.bytes_failed += hccl.iter().sum::<u64>();
        note(
            report,
            Error::Invalid(
                "HCCL communicators cannot be suspended: HCCL has no call that releases a live \
                 communicator's buffers (2 x HCCL_BUFFSIZE MB each); set HCCL_BUFFSIZE lower or destroy \
                 the communicator to get them back",
            ),
        );
    }
    let dev = saver.device(Vendor::Cuda);
    let mut first = set_free;
    for (device, comms) in by_device(snapshot()) {
        let before = dev.as_deref().filter(|_| device >= 0).and_then(|d| free_on(d, device));
        let mut freed = 0u64;
        for (h, _) in comms {
            let suspendable = match stat(h, STAT_SUSPENDABLE) {
                Ok(b) => b,
                Err(e) => {
                    report.allocations_failed += 1;
                    note(report, Error::Driver(e));
                    continue;
                }
            };
            if stat(h, STAT_SUSPENDED).unwrap_or(0) != 0 {
                report.allocations_skipped += 1;
                report.bytes_skipped += suspendable;
                continue;
            }
            match call_comm(&SUSPEND, "ncclCommSuspend", h, Some(SUSPEND_MEM)) {
                Ok(()) => {
                    mark(h, true);
                    report.allocations_done += 1;
                    report.bytes_done += suspendable;
                    freed += suspendable;
                }
                Err(e) => {
                    report.allocations_failed += 1;
                    report.bytes_failed += suspendable;
                    note(report, Error::Driver(e));
                }
            }
        }
        let after = dev.as_deref().filter(|_| device >= 0).and_then(|d| free_on(d, device));
        if let (Some((b, total)), Some((a, _))) = (before, after) {
            if a.saturating_sub(b) < freed {
                tracing::warn!(
                    "tms: NCCL communicators on device {device} reported {freed} suspendable bytes, but free \
                     memory rose by {} only",
                    a.saturating_sub(b)
                );
            }
            if first {
                (report.device_free_before, report.device_free_after, report.device_total) = (b, a, total);
                first = false;
            }
        }
    }
}

/// Resumes the communicators tms suspended. A device whose free memory cannot hold their
/// buffers is refused up front, its communicators staying suspended.
pub fn resume(saver: &Saver, report: &mut Report, set_free: bool) {
    if !EVER.load(Ordering::Acquire) {
        return;
    }
    let _ops = lock(&OPS);
    let dev = saver.device(Vendor::Cuda);
    let mut first = set_free;
    for (device, comms) in by_device(snapshot()) {
        let before = dev.as_deref().filter(|_| device >= 0).and_then(|d| free_on(d, device));
        let mut work = Vec::new();
        for (h, c) in comms {
            let suspendable = stat(h, STAT_SUSPENDABLE).unwrap_or(0);
            let suspended = stat(h, STAT_SUSPENDED).unwrap_or(0) != 0;
            if !suspended || !c.suspended_by_tms {
                if !suspended && c.suspended_by_tms {
                    mark(h, false);
                }
                report.allocations_skipped += 1;
                report.bytes_skipped += suspendable;
                continue;
            }
            work.push((h, suspendable));
        }
        let needed: u64 = work.iter().map(|w| w.1).sum();
        if let (Some((free, _)), Some(d)) = (before, dev.as_deref())
            && needed > free
        {
            report.allocations_failed += work.len() as u64;
            report.bytes_failed += needed;
            note(report, Error::OutOfMemory { code: d.oom_code(), needed, free });
            continue;
        }
        for (h, suspendable) in work {
            match call_comm(&RESUME, "ncclCommResume", h, None) {
                Ok(()) => {
                    mark(h, false);
                    report.allocations_done += 1;
                    report.bytes_done += suspendable;
                }
                Err(e) => {
                    report.allocations_failed += 1;
                    report.bytes_failed += suspendable;
                    note(report, Error::Driver(e));
                }
            }
        }
        let after = dev.as_deref().filter(|_| device >= 0).and_then(|d| free_on(d, device));
        if first && let (Some((b, total)), Some((a, _))) = (before, after) {
            (report.device_free_before, report.device_free_after, report.device_total) = (b, a, total);
            first = false;
        }
    }
}
