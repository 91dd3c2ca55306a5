//! Each vendor's driver, loaded on first need.

use crate::device::{Device, Vendor};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

type Loader = fn(Vendor) -> Result<Arc<dyn Device>, String>;

/// How long a failed load is believed. Torch mode asks for CUDA first on every allocation; on an
/// Ascend machine that would otherwise be one failed dlopen("libcuda.so.1") per allocation.
const RETRY_AFTER: Duration = Duration::from_secs(10);

/// One slot per vendor, in `Vendor::ALL`'s order.
pub(super) struct Drivers(Vec<DriverSlot>);

impl Drivers {
    pub(super) fn new() -> Drivers {
        Drivers(Vendor::ALL.into_iter().map(DriverSlot::new).collect())
    }

    fn slot(&self, vendor: Vendor) -> &DriverSlot {
        self.0.iter().find(|s| s.vendor == vendor).expect("a slot for every vendor")
    }

    /// `vendor`'s driver, loaded on first need.
    pub(super) fn get(&self, vendor: Vendor) -> Option<Arc<dyn Device>> {
        self.slot(vendor).get()
    }

    /// `vendor`'s driver if it is loaded already, without trying to load it.
    pub(super) fn loaded(&self, vendor: Vendor) -> Option<Arc<dyn Device>> {
        self.slot(vendor).device.get().cloned()
    }
}

struct DriverSlot {
    device: OnceLock<Arc<dyn Device>>,
    warned: AtomicBool,
    vendor: Vendor,
    load: Loader,
    /// Nanoseconds after `epoch()` before which a failed load is not tried again (0: try).
    retry_at: AtomicU64,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

impl DriverSlot {
    fn new(vendor: Vendor) -> DriverSlot {
        DriverSlot::with_loader(vendor, Vendor::load)
    }

    const fn with_loader(vendor: Vendor, load: Loader) -> DriverSlot {
        DriverSlot {
            device: OnceLock::new(),
            warned: AtomicBool::new(false),
            vendor,
            load,
            retry_at: AtomicU64::new(0),
        }
    }

    /// The driver, loaded on first need. A failure is reported once and believed for a while
    /// (the runtime may still appear later, so it is not believed forever).
    fn get(&self) -> Option<Arc<dyn Device>> {
        if let Some(d) = self.device.get() {
            return Some(d.clone());
        }
        let retry_at = self.retry_at.load(Ordering::Relaxed);
        if retry_at != 0 && now_ns() < retry_at {
            return None;
        }
        match (self.load)(self.vendor) {
            Ok(d) => Some(self.device.get_or_init(|| d).clone()),
            Err(e) => {
                self.retry_at.store((now_ns() + RETRY_AFTER.as_nanos() as u64).max(1), Ordering::Relaxed);
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "tms: {} driver unavailable ({e}); allocations pass through untracked and cannot be paused",
                        self.vendor.name()
                    );
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    static ATTEMPTS: AtomicUsize = AtomicUsize::new(0);

    fn missing(_: Vendor) -> Result<Arc<dyn Device>, String> {
        ATTEMPTS.fetch_add(1, Ordering::Relaxed);
        Err("libcuda.so.1: cannot open shared object file".into())
    }

    #[test]
    fn a_missing_driver_is_not_looked_for_on_every_allocation() {
        let slot = DriverSlot::with_loader(Vendor::Cuda, missing);
        for _ in 0..10_000 {
            assert!(slot.get().is_none());
        }
        assert_eq!(ATTEMPTS.load(Ordering::Relaxed), 1);
        // Once the window has passed it is looked for again.
        slot.retry_at.store(1, Ordering::Relaxed);
        assert!(slot.get().is_none());
        assert_eq!(ATTEMPTS.load(Ordering::Relaxed), 2);
    }
}
