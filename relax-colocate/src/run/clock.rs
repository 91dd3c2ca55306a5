//! The runner's clock, in modelled seconds (docs/async.md, "A faster clock").
//!
//! With compute.model every request and switch stage lasts its modelled device time, so a job
//! whose steps take minutes on the device takes minutes here. compute.time_scale = k runs that
//! clock k times faster: a paced wait sleeps its modelled time over k, and every time the runner
//! measures is the wall time times k. Each process (the driver and every worker) sets the same k
//! once, before it times anything; the liveness deadlines (fleet/, wire.rs) keep the wall clock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// k, as f64 bits (1.0: the wall clock).
static SCALE: AtomicU64 = AtomicU64::new(0x3FF0_0000_0000_0000);

/// Sets k for this process; anything not finite and above 0 leaves the wall clock.
pub(crate) fn set_scale(k: f64) {
    let k = if k.is_finite() && k > 0.0 { k } else { 1.0 };
    SCALE.store(k.to_bits(), Ordering::Relaxed);
}

/// Modelled seconds per wall-clock second.
pub(crate) fn scale() -> f64 {
    f64::from_bits(SCALE.load(Ordering::Relaxed))
}

fn to_modelled(wall: Duration) -> Duration {
    wall.mul_f64(scale())
}

fn to_wall(modelled: Duration) -> Duration {
    modelled.div_f64(scale())
}

/// Waits `modelled` seconds of the modelled clock.
pub(crate) fn sleep(modelled: Duration) {
    std::thread::sleep(to_wall(modelled));
}

/// A point on the modelled clock: `std::time::Instant`'s surface, its durations modelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Instant(std::time::Instant);

impl Instant {
    pub(crate) fn now() -> Instant {
        Instant(std::time::Instant::now())
    }

    pub(crate) fn elapsed(&self) -> Duration {
        to_modelled(self.0.elapsed())
    }

    pub(crate) fn duration_since(&self, earlier: Instant) -> Duration {
        to_modelled(self.0.saturating_duration_since(earlier.0))
    }

    /// The same point on the wall clock, for a wait that polls it.
    pub(crate) fn wall(&self) -> std::time::Instant {
        self.0
    }
}

impl std::ops::Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, modelled: Duration) -> Instant {
        Instant(self.0 + to_wall(modelled))
    }
}

impl std::ops::Sub<Instant> for Instant {
    type Output = Duration;
    fn sub(self, earlier: Instant) -> Duration {
        self.duration_since(earlier)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process-wide k is left alone here (other tests in this binary time things); the
    /// conversions are checked at the wall clock's k, and a run at k > 1 in tests/tests/run.rs.
    #[test]
    fn the_wall_clock_is_the_default_and_its_conversions_are_the_identity() {
        assert_eq!(scale(), 1.0);
        let d = Duration::from_millis(1234);
        assert_eq!((to_modelled(d), to_wall(d)), (d, d));
        let t0 = Instant::now();
        let later = t0 + Duration::from_millis(50);
        assert_eq!(later - t0, Duration::from_millis(50));
        assert_eq!(t0.duration_since(later), Duration::ZERO, "earlier minus later saturates");
        assert_eq!(later.wall() - t0.wall(), Duration::from_millis(50));
        sleep(Duration::from_millis(20));
        assert!(t0.elapsed() >= Duration::from_millis(20));
    }
}
