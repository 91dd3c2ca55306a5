//! The optional timing model: a copy bandwidth shared by every copy in one direction of one device
//! (across processes, like a PCIe link), and a cost for pinning host memory.

use crate::core::node::NodeState;
use std::sync::atomic::Ordering;
use std::time::Duration;

pub const TO_DEVICE: usize = 0;
pub const TO_HOST: usize = 1;

pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: CLOCK_MONOTONIC is system-wide, so timestamps compare across processes.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Bytes moved per step of a modelled transfer: each step lands when the modelled clock has
/// passed its end, so a reader that skips the synchronize sees the transfer still under way.
pub const PIECE: usize = 1 << 20;

/// Waits shorter than this are skipped: a host sleep costs more than that, and a small copy
/// landing a few microseconds early is not what a missing synchronize looks like.
const MIN_WAIT_NS: u64 = 50_000;

/// Runs a transfer of `bytes` on the emulated bus in pieces: the transfer is booked after every
/// transfer already booked in that direction, and `copy(offset, len)` moves each piece when the
/// modelled time of everything up to its end has passed, as a device's copy engine delivers
/// bytes over the transfer's time rather than at its start. Stops at the first error.
pub fn on_bus<E>(
    state: &NodeState,
    rate: f64,
    dev: usize,
    dir: usize,
    bytes: usize,
    mut copy: impl FnMut(usize, usize) -> Result<(), E>,
) -> Result<(), E> {
    if rate <= 0.0 || bytes == 0 {
        return copy(0, bytes);
    }
    let duration = (bytes as f64 / rate * 1e9) as u64;
    let slot = &state.bus_busy_until[dev][dir];
    let mut start = 0;
    let _ = slot.fetch_update(Ordering::AcqRel, Ordering::Acquire, |busy| {
        start = busy.max(now_ns());
        Some(start + duration)
    });
    let mut offset = 0;
    while offset < bytes {
        let len = PIECE.min(bytes - offset);
        let lands = start + ((offset + len) as f64 / rate * 1e9) as u64;
        if lands > now_ns() + MIN_WAIT_NS {
            sleep_until(lands);
        }
        copy(offset, len)?;
        offset += len;
    }
    Ok(())
}

pub fn sleep_until(deadline_ns: u64) {
    let now = now_ns();
    if deadline_ns > now {
        std::thread::sleep(Duration::from_nanos(deadline_ns - now));
    }
}

/// The time pinning `bytes` of host memory takes at `rate` bytes per second.
pub fn pin_cost(rate: f64, bytes: usize) {
    if rate > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(bytes as f64 / rate));
    }
}
