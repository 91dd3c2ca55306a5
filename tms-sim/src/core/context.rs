//! Contexts as the core sees them, whatever their API: the memory one takes on its device, the
//! opaque handles a front end gives out for them, and the calling thread's current one.
//!
//! Of a front end's thread state the core needs one fact: the device of the context current on
//! the calling thread, for an API whose contexts follow the legacy default stream's rules. Work
//! on that stream then waits for the blocking streams of that device, and a device fault met
//! while such a context is current kills it (sticky). The CUDA front end sets it as cuCtxSetCurrent,
//! cudaSetDevice and the runtime's implicit initialization dictate; ACL's contexts have neither
//! rule (its faults are reported per call), so the Ascend front end never sets it and instead
//! says, with `note_per_call_faults`, that such an API is in use.

use crate::core::sim::sim;
use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    static CURRENT: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Set once a call of an API whose device faults are reported per call has run in this process.
static PER_CALL_FAULTS: AtomicBool = AtomicBool::new(false);

/// The device of the context current on the calling thread (see the module's comment).
pub fn current() -> Option<usize> {
    CURRENT.with(|c| c.get())
}

pub fn make_current(device: Option<usize>) {
    CURRENT.with(|c| c.set(device));
}

/// A call of an API whose faults are reported per call, never sticky, is running in this process.
pub fn note_per_call_faults() {
    PER_CALL_FAULTS.store(true, Ordering::Relaxed);
}

/// Whether a device fault the calling thread meets now is sticky: it has a context current, or
/// no API with per-call faults is in use. A stream's worker has no context of its own, so its
/// faults cannot be told apart by API once both are in use; they are then not sticky.
pub fn faults_sticky() -> bool {
    current().is_some() || !PER_CALL_FAULTS.load(Ordering::Relaxed)
}

/// Creates this process's context on `dev` unless `active` says it has one. A context takes
/// device memory (`TMS_SIM_CONTEXT_MEMORY`, else the API's default), so creating one on a full
/// device fails (false), as on a GPU; the memory returns when the process exits.
pub fn open(active: &[AtomicBool], dev: usize, default_bytes: u64) -> bool {
    let Some(flag) = active.get(dev) else { return false };
    if flag.load(Ordering::Acquire) {
        return true;
    }
    static OPENING: Mutex<()> = Mutex::new(());
    let _one_at_a_time = OPENING.lock().unwrap_or_else(|e| e.into_inner());
    if flag.load(Ordering::Acquire) {
        return true;
    }
    let s = sim();
    if dev >= s.devices() || !s.node.charge(dev, s.cfg.context_bytes.unwrap_or(default_bytes)) {
        return false;
    }
    flag.store(true, Ordering::Release);
    true
}

/// The opaque handle of `dev`'s context: an address inside `tokens`, one byte per device.
pub fn handle(tokens: &'static [u8], dev: usize) -> *mut libc::c_void {
    &tokens[dev] as *const u8 as *mut libc::c_void
}

/// The device whose context `ctx` is, if it is a handle `handle` gave out for `tokens`.
pub fn device_of(tokens: &'static [u8], ctx: *mut libc::c_void) -> Option<usize> {
    let base = tokens.as_ptr() as usize;
    let p = ctx as usize;
    (p >= base && p < base + tokens.len()).then(|| p - base)
}
