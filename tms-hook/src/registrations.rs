//! NCCL buffer registrations of region memory, kept valid across pause and resume.
//!
//! `ncclCommRegister` lets NCCL use a buffer in place (its peers import its physical pages), and
//! NCCL keeps the pages it registered: after a pause releases them and a resume maps new ones at
//! the same address, a collective through the old registration would use pages that are gone (a
//! hang on a device; torch_memory_saver issue 88 describes it for graph registrations). PyTorch
//! registers its caching allocator's segments this way. So a pause first deregisters every
//! registration over the memory it releases, and the resume registers it again once all of its
//! range is mapped. The application keeps the handle it was given: a later `ncclCommDeregister`
//! of it deregisters whatever NCCL handle stands for it now. `TMS_NCCL_REREGISTER=0` turns this
//! off (the registrations then go stale, as without the hook).

use crate::exports::nccl;
use libc::c_void;
use std::sync::{Mutex, MutexGuard};

/// One registration the application made: NCCL's current handle for it, or None while a pause
/// has it deregistered.
struct Registration {
    comm: usize,
    addr: u64,
    len: u64,
    /// The handle the application was given (NCCL's first one).
    app: usize,
    current: Option<usize>,
}

static REGISTRATIONS: Mutex<Vec<Registration>> = Mutex::new(Vec::new());

fn registrations() -> MutexGuard<'static, Vec<Registration>> {
    REGISTRATIONS.lock().unwrap_or_else(|e| e.into_inner())
}

fn enabled() -> bool {
    std::env::var("TMS_NCCL_REREGISTER").map_or(true, |v| v.trim() != "0")
}

fn overlaps(r: &Registration, (addr, len): (u64, u64)) -> bool {
    r.addr < addr.saturating_add(len) && addr < r.addr.saturating_add(r.len)
}

/// A process that makes region memory turns NCCL's graph registration off, once, before its
/// first region allocation: a collective captured in a CUDA graph gets its buffers registered
/// (NCCL_GRAPH_REGISTER, on by default), the graph keeps that registration for its lifetime, and
/// nothing outside NCCL can take it down and make it again; after a pause and resume of the
/// graph's pool its replay would go through pages that are gone (torch_memory_saver issue 88;
/// SGLang turns it off when its graph pool is pausable). NCCL reads the variable at its first
/// captured collective, after the regions are made in every framework we serve.
/// `TMS_NCCL_REREGISTER=0` leaves it as it is.
pub(crate) fn graph_registration_off() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if !enabled() {
            return;
        }
        let was = std::env::var("NCCL_GRAPH_REGISTER").ok();
        if was.as_deref().is_some_and(|v| v.trim() == "0") {
            return;
        }
        // SAFETY: setenv, once, from the first region allocation; NCCL reads it later.
        unsafe { std::env::set_var("NCCL_GRAPH_REGISTER", "0") };
        let why = "it makes region memory, and a collective captured in a CUDA graph keeps NCCL's registration \
                   of pages a pause releases (TMS_NCCL_REREGISTER=0 keeps NCCL's setting)";
        // Overriding the user's own setting is worth a warning; filling in NCCL's default is not.
        match was {
            Some(v) => tracing::warn!("tms: NCCL_GRAPH_REGISTER=0 set for this process (was {v}): {why}"),
            None => tracing::info!("tms: NCCL_GRAPH_REGISTER=0 set for this process: {why}"),
        }
    });
}

/// A registration NCCL made for the application.
pub(crate) fn registered(comm: *mut c_void, addr: u64, len: u64, handle: *mut c_void) {
    let mut regs = registrations();
    regs.push(Registration { comm: comm as usize, addr, len, app: handle as usize, current: Some(handle as usize) });
}

/// The application deregisters `handle`: forgotten here. Returns the NCCL handle to deregister
/// now (None: a pause has deregistered it already, nothing is left for NCCL to do); an unknown
/// handle is NCCL's to judge, and goes through as it is.
pub(crate) fn deregistering(comm: *mut c_void, handle: *mut c_void) -> Option<*mut c_void> {
    let mut regs = registrations();
    let at = regs.iter().position(|r| r.comm == comm as usize && r.app == handle as usize);
    match at {
        Some(i) => regs.remove(i).current.map(|h| h as *mut c_void),
        None => Some(handle),
    }
}

/// A communicator is destroyed: its registrations go with it.
pub(crate) fn forget_comm(comm: *mut c_void) {
    registrations().retain(|r| r.comm != comm as usize);
}

/// What the registration over `addr` is, for errors.
fn describe(r: &Registration) -> String {
    format!("NCCL registration {:#x} of {:#x} ({} bytes, communicator {:#x})", r.app, r.addr, r.len, r.comm)
}

/// The registrations matching `pick`, as (communicator, application handle, address, bytes,
/// NCCL's current handle): NCCL is called with none of this file's lock held.
fn picked(pick: impl Fn(&Registration) -> bool) -> Vec<(usize, usize, u64, u64, Option<usize>)> {
    registrations().iter().filter(|r| pick(r)).map(|r| (r.comm, r.app, r.addr, r.len, r.current)).collect()
}

/// Sets the current NCCL handle of the application's registration `(comm, app)`, if it is still
/// there (the application may have deregistered it meanwhile).
fn set_current(comm: usize, app: usize, current: Option<usize>) {
    if let Some(r) = registrations().iter_mut().find(|r| r.comm == comm && r.app == app) {
        r.current = current;
    }
}

/// Before a pause releases `ranges` (address, bytes): every registration over them is
/// deregistered. Returns the ranges whose registrations NCCL would not deregister, each with what
/// to say: those must not be released.
pub(crate) fn suspend(ranges: &[(u64, u64)]) -> Vec<((u64, u64), String)> {
    if !enabled() {
        return Vec::new();
    }
    let mut refused = Vec::new();
    let over = |r: &Registration| r.current.is_some() && ranges.iter().any(|&x| overlaps(r, x));
    for (comm, app, addr, len, current) in picked(over) {
        let handle = current.expect("picked registered ones") as *mut c_void;
        match nccl::real_deregister(comm as *mut c_void, handle) {
            0 => set_current(comm, app, None),
            rc => {
                let r = Registration { comm, addr, len, app, current };
                let why = format!(
                    "{} could not be deregistered before the pause (NCCL returned {rc}): its pages must stay, so \
                     the allocation under it is not paused; keep buffers NCCL registers outside a region, or set \
                     NCCL_LOCAL_REGISTER=0",
                    describe(&r)
                );
                refused.extend(ranges.iter().filter(|&&x| overlaps(&r, x)).map(|&x| (x, why.clone())));
            }
        }
    }
    refused
}

/// After a resume: every registration a pause deregistered whose whole range `mapped` says is
/// mapped again is registered again. Returns what could not be, one message each.
pub(crate) fn restore(mapped: impl Fn(u64, u64) -> bool) -> Vec<String> {
    let mut failed = Vec::new();
    for (comm, app, addr, len, _) in picked(|r| r.current.is_none()) {
        if !mapped(addr, len) {
            continue;
        }
        let mut handle: *mut c_void = std::ptr::null_mut();
        match nccl::real_register(comm as *mut c_void, addr as *mut c_void, len as usize, &mut handle) {
            0 => set_current(comm, app, Some(handle as usize)),
            rc => failed.push(format!(
                "{} could not be made again after the resume (NCCL returned {rc}): NCCL no longer uses the buffer \
                 in place, and collectives on it go through NCCL's own buffers",
                describe(&Registration { comm, addr, len, app, current: None })
            )),
        }
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_overlaps_the_ranges_it_shares_a_byte_with() {
        let r = Registration { comm: 1, addr: 0x1000, len: 0x1000, app: 7, current: Some(7) };
        assert!(overlaps(&r, (0x1fff, 1)) && overlaps(&r, (0, 0x1001)) && overlaps(&r, (0x800, 0x4000)));
        assert!(!overlaps(&r, (0x2000, 0x1000)) && !overlaps(&r, (0, 0x1000)));
    }

    #[test]
    fn a_handle_deregistered_by_a_pause_is_forgotten_without_nccl() {
        let (comm, handle) = (0xc0 as *mut c_void, 0x70 as *mut c_void);
        registered(comm, 0x10_0000, 4096, handle);
        registrations().iter_mut().filter(|r| r.app == 0x70).for_each(|r| r.current = None);
        assert_eq!(deregistering(comm, handle), None, "NCCL has nothing left to deregister");
        assert_eq!(deregistering(comm, handle), Some(handle), "an unknown handle goes to NCCL as it is");
        registered(comm, 0x20_0000, 4096, handle);
        forget_comm(comm);
        assert!(registrations().iter().all(|r| r.comm != 0xc0));
    }
}
