//! The optional timing model: a copy bandwidth shared by every copy in one direction of one device
//! (across processes, like a PCIe link), and a cost for pinning host memory.

use crate::node::NodeState;
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

/// Runs `copy` as a transfer of `bytes` on the emulated bus: the transfer is booked after every
/// transfer already booked in that direction, and the call returns when its slot ends.
pub fn on_bus<R>(state: &NodeState, rate: f64, dev: usize, dir: usize, bytes: usize, copy: impl FnOnce() -> R) -> R {
    if rate <= 0.0 || bytes == 0 {
        return copy();
    }
    let duration = (bytes as f64 / rate * 1e9) as u64;
    let slot = &state.bus_busy_until[dev][dir];
    let mut end = 0;
    let _ = slot.fetch_update(Ordering::AcqRel, Ordering::Acquire, |busy| {
        end = busy.max(now_ns()) + duration;
        Some(end)
    });
    let result = copy();
    sleep_until(end);
    result
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
