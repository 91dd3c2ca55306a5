//! NCCL's communicator creation and destruction (nccl.h of NCCL 2.30): each call goes to the
//! real library first, unchanged, and the communicator it made or ends is then recorded or
//! forgotten (comms.rs) so that the reserved tag `nccl` can suspend and resume it. Its buffer
//! registrations (`ncclCommRegister`/`ncclCommDeregister`) are recorded too, so that a pause of
//! the memory under one deregisters it and the resume registers it again (registrations.rs).
//!
//! These are reached only by a process that calls NCCL, and NCCL is never needed to build or load
//! the hook. Unlike the allocation hooks they do not mark the thread as inside the hook: NCCL's
//! own device allocations during init go on to the allocation hooks exactly as without them.
#![allow(non_snake_case)] // the vendor ABI names these functions

use crate::comms;
use crate::forward::Target;
use crate::registrations;
use libc::{c_int, c_void};
use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};

pub(crate) const NCCL: &[&CStr] = &[c"libnccl.so.2", c"libnccl.so"];
const SUCCESS: c_int = 0;
const INTERNAL_ERROR: c_int = 3;
const IN_PROGRESS: c_int = 7;

pub(crate) static INIT_RANK: Target = Target::new(c"ncclCommInitRank", NCCL);
pub(crate) static INIT_RANK_CONFIG: Target = Target::new(c"ncclCommInitRankConfig", NCCL);
pub(crate) static INIT_RANK_SCALABLE: Target = Target::new(c"ncclCommInitRankScalable", NCCL);
pub(crate) static INIT_ALL: Target = Target::new(c"ncclCommInitAll", NCCL);
pub(crate) static SPLIT: Target = Target::new(c"ncclCommSplit", NCCL);
pub(crate) static SHRINK: Target = Target::new(c"ncclCommShrink", NCCL);
pub(crate) static DESTROY: Target = Target::new(c"ncclCommDestroy", NCCL);
pub(crate) static ABORT: Target = Target::new(c"ncclCommAbort", NCCL);
pub(crate) static REGISTER: Target = Target::new(c"ncclCommRegister", NCCL);
pub(crate) static DEREGISTER: Target = Target::new(c"ncclCommDeregister", NCCL);

use tms_vendor::nccl::UniqueId as NcclUniqueId;

/// The interposed name `name`, as (its forwarding target, the hook's function): a lookup of it on
/// a library's own handle (vLLM's and verl's ctypes communicators load libnccl.so.2 with CDLL
/// and look names up on that handle, which never sees preloaded definitions) gets the hook's
/// function, so the communicators it makes are tracked too (exports/dlsym.rs).
pub(crate) fn interposed(name: &[u8]) -> Option<(&'static Target, usize)> {
    let own = |f: *const ()| f as usize;
    Some(match name {
        b"ncclCommInitRank" => (&INIT_RANK, own(ncclCommInitRank as *const ())),
        b"ncclCommInitRankConfig" => (&INIT_RANK_CONFIG, own(ncclCommInitRankConfig as *const ())),
        b"ncclCommInitRankScalable" => (&INIT_RANK_SCALABLE, own(ncclCommInitRankScalable as *const ())),
        b"ncclCommInitAll" => (&INIT_ALL, own(ncclCommInitAll as *const ())),
        b"ncclCommSplit" => (&SPLIT, own(ncclCommSplit as *const ())),
        b"ncclCommShrink" => (&SHRINK, own(ncclCommShrink as *const ())),
        b"ncclCommDestroy" => (&DESTROY, own(ncclCommDestroy as *const ())),
        b"ncclCommAbort" => (&ABORT, own(ncclCommAbort as *const ())),
        b"ncclCommRegister" => (&REGISTER, own(ncclCommRegister as *const ())),
        b"ncclCommDeregister" => (&DEREGISTER, own(ncclCommDeregister as *const ())),
        _ => return None,
    })
}

/// The real function's address; None (with a warning) when no loaded library has it.
fn real(t: &Target, own: usize) -> Option<usize> {
    let f = t.resolve(own);
    if f.is_none() {
        tracing::warn!("tms: {} called but no NCCL library providing it is loaded", t.name.to_string_lossy());
    }
    f
}

/// Records what a creation call made, if it made something; never unwinds into C.
fn record(rc: c_int, out: *mut *mut c_void, count: usize) {
    if (rc != SUCCESS && rc != IN_PROGRESS) || out.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        for i in 0..count {
            // SAFETY: the real call succeeded and filled `count` handles at `out`.
            comms::created(unsafe { *out.add(i) });
        }
    }));
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
) -> c_int {
    type F = unsafe extern "C" fn(*mut *mut c_void, c_int, NcclUniqueId, c_int) -> c_int;
    let Some(f) = real(&INIT_RANK, ncclCommInitRank as *const () as usize) else { return INTERNAL_ERROR };
    // SAFETY: NCCL's function, with the caller's arguments.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(comm, nranks, id, rank) };
    record(rc, comm, 1);
    rc
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
    config: *mut c_void,
) -> c_int {
    type F = unsafe extern "C" fn(*mut *mut c_void, c_int, NcclUniqueId, c_int, *mut c_void) -> c_int;
    let Some(f) = real(&INIT_RANK_CONFIG, ncclCommInitRankConfig as *const () as usize) else {
        return INTERNAL_ERROR;
    };
    // SAFETY: NCCL's function, with the caller's arguments.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(comm, nranks, id, rank, config) };
    record(rc, comm, 1);
    rc
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    comm: *mut *mut c_void,
    nranks: c_int,
    rank: c_int,
    n_ids: c_int,
    ids: *mut NcclUniqueId,
    config: *mut c_void,
) -> c_int {
    type F = unsafe extern "C" fn(*mut *mut c_void, c_int, c_int, c_int, *mut NcclUniqueId, *mut c_void) -> c_int;
    let Some(f) = real(&INIT_RANK_SCALABLE, ncclCommInitRankScalable as *const () as usize) else {
        return INTERNAL_ERROR;
    };
    // SAFETY: NCCL's function, with the caller's arguments.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(comm, nranks, rank, n_ids, ids, config) };
    record(rc, comm, 1);
    rc
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommInitAll(comms: *mut *mut c_void, ndev: c_int, devlist: *const c_int) -> c_int {
    type F = unsafe extern "C" fn(*mut *mut c_void, c_int, *const c_int) -> c_int;
    let Some(f) = real(&INIT_ALL, ncclCommInitAll as *const () as usize) else { return INTERNAL_ERROR };
    // SAFETY: NCCL's function, with the caller's arguments.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(comms, ndev, devlist) };
    if rc == SUCCESS {
        record(rc, comms, usize::try_from(ndev).unwrap_or(0));
    }
    rc
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommSplit(
    comm: *mut c_void,
    color: c_int,
    key: c_int,
    newcomm: *mut *mut c_void,
    config: *mut c_void,
) -> c_int {
    type F = unsafe extern "C" fn(*mut c_void, c_int, c_int, *mut *mut c_void, *mut c_void) -> c_int;
    let Some(f) = real(&SPLIT, ncclCommSplit as *const () as usize) else { return INTERNAL_ERROR };
    // SAFETY: NCCL's function, with the caller's arguments.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(comm, color, key, newcomm, config) };
    // A rank with NCCL_SPLIT_NOCOLOR gets NULL, which is not recorded.
    record(rc, newcomm, 1);
    rc
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommShrink(
    comm: *mut c_void,
    exclude: *mut c_int,
    exclude_count: c_int,
    newcomm: *mut *mut c_void,
    config: *mut c_void,
    flags: c_int,
) -> c_int {
    type F = unsafe extern "C" fn(*mut c_void, *mut c_int, c_int, *mut *mut c_void, *mut c_void, c_int) -> c_int;
    let Some(f) = real(&SHRINK, ncclCommShrink as *const () as usize) else { return INTERNAL_ERROR };
    // SAFETY: NCCL's function, with the caller's arguments.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(comm, exclude, exclude_count, newcomm, config, flags) };
    record(rc, newcomm, 1);
    rc
}

/// Waits for a pause or resume of the communicators in progress, forgets this one, then destroys
/// it: NCCL never sees a suspend of a communicator being destroyed.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut c_void) -> c_int {
    type F = unsafe extern "C" fn(*mut c_void) -> c_int;
    let Some(f) = real(&DESTROY, ncclCommDestroy as *const () as usize) else { return INTERNAL_ERROR };
    let guard = catch_unwind(AssertUnwindSafe(|| comms::destroying(comm))).ok();
    let _ = catch_unwind(AssertUnwindSafe(|| registrations::forget_comm(comm)));
    // SAFETY: NCCL's function, with the caller's argument.
    let rc = unsafe { std::mem::transmute::<usize, F>(f)(comm) };
    drop(guard);
    rc
}

/// Forgets the communicator and ends it at once, without waiting for a pause or resume in
/// progress: abort is how an application stops work that is stuck, maybe the very work a suspend
/// waits for.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut c_void) -> c_int {
    type F = unsafe extern "C" fn(*mut c_void) -> c_int;
    let Some(f) = real(&ABORT, ncclCommAbort as *const () as usize) else { return INTERNAL_ERROR };
    // Forgotten first: once NCCL has freed it, a new communicator may get the same address.
    let _ = catch_unwind(AssertUnwindSafe(|| comms::forget(comm)));
    let _ = catch_unwind(AssertUnwindSafe(|| registrations::forget_comm(comm)));
    // SAFETY: NCCL's function, with the caller's argument.
    unsafe { std::mem::transmute::<usize, F>(f)(comm) }
}

type RegisterFn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut *mut c_void) -> c_int;
type DeregisterFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;

/// NCCL's own `ncclCommRegister`, for the saver's registering again after a resume.
pub(crate) fn real_register(comm: *mut c_void, buff: *mut c_void, size: usize, handle: *mut *mut c_void) -> c_int {
    let Some(f) = real(&REGISTER, ncclCommRegister as *const () as usize) else { return INTERNAL_ERROR };
    // SAFETY: NCCL's function; `comm` is one the application registered with, `handle` ours.
    unsafe { std::mem::transmute::<usize, RegisterFn>(f)(comm, buff, size, handle) }
}

/// NCCL's own `ncclCommDeregister`, for the saver's deregistering before a pause.
pub(crate) fn real_deregister(comm: *mut c_void, handle: *mut c_void) -> c_int {
    let Some(f) = real(&DEREGISTER, ncclCommDeregister as *const () as usize) else { return INTERNAL_ERROR };
    // SAFETY: NCCL's function, with a handle it gave for `comm`.
    unsafe { std::mem::transmute::<usize, DeregisterFn>(f)(comm, handle) }
}

/// Registers as NCCL does, and records the registration (registrations.rs).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommRegister(
    comm: *mut c_void,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> c_int {
    let rc = real_register(comm, buff, size, handle);
    if rc == SUCCESS && !handle.is_null() {
        // SAFETY: NCCL succeeded and wrote the handle there.
        let h = unsafe { *handle };
        let _ = catch_unwind(AssertUnwindSafe(|| registrations::registered(comm, buff as u64, size as u64, h)));
    }
    rc
}

/// Deregisters the handle the application was given: NCCL's handle for it now, or nothing when a
/// pause has deregistered it already.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommDeregister(comm: *mut c_void, handle: *mut c_void) -> c_int {
    let current = catch_unwind(AssertUnwindSafe(|| registrations::deregistering(comm, handle))).unwrap_or(Some(handle));
    match current {
        Some(h) => real_deregister(comm, h),
        None => SUCCESS,
    }
}
