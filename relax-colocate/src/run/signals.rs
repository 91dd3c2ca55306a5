//! SIGINT and SIGTERM: the handler only records which signal came; every wait on a worker polls
//! it, so the run stops, stops its workers and keeps its partial results.

use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

/// The signal that asked the run to stop (SIGINT or SIGTERM), 0 while none has.
static INTERRUPTED_BY: AtomicI32 = AtomicI32::new(0);
/// How many came: a second one while workers are being stopped means "now".
static SIGNALS: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    INTERRUPTED_BY.store(signal, Ordering::SeqCst);
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// SIGINT and SIGTERM received so far.
pub(super) fn signal_count() -> u32 {
    SIGNALS.load(Ordering::SeqCst)
}

/// Whether a signal asked the run to stop, as the words the failure reports.
pub(super) fn interruption() -> Option<String> {
    match INTERRUPTED_BY.load(Ordering::SeqCst) {
        0 => None,
        libc::SIGINT => Some("interrupted (Ctrl-C, SIGINT)".into()),
        libc::SIGTERM => Some("interrupted (SIGTERM)".into()),
        other => Some(format!("interrupted (signal {other})")),
    }
}

/// Routes SIGINT and SIGTERM to the handler for the rest of the process's life.
pub(super) fn install() {
    // SAFETY: installing an async-signal-safe handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}
