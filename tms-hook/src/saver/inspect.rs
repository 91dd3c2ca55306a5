//! What the process holds: per-tag status, devices and their free memory, backup pointers.

use super::pieces::free_host_buf;
use super::{Job, Saver, TagStatus, lock};
use crate::device::{Device, Vendor};
use crate::region::TagId;
use crate::registry::State;
use std::collections::BTreeMap;

impl Saver {
    /// Free device memory on the device of the first job (or the calling thread's device).
    pub(super) fn device_memory(&self, jobs: &[Job]) -> Option<(u64, u64)> {
        let vendor = jobs.first().map(|j| j.a.vendor);
        let dev = match vendor {
            Some(v) => self.loaded(v)?,
            None => Vendor::ALL.into_iter().find_map(|v| self.loaded(v))?,
        };
        let device = match jobs.first() {
            Some(j) => j.a.device,
            None => self.any_device(dev.as_ref())?,
        };
        let previous = dev.bind_thread(device).ok()?;
        let info = dev.mem_info().ok();
        dev.restore_thread(previous);
        info
    }

    /// A device this process uses with `dev`'s vendor: one of a tracked allocation, else one it
    /// already has a context on. None rather than a guess: binding a device the process does
    /// not use would create a context there (hundreds of MiB on someone else's GPU).
    pub(super) fn any_device(&self, dev: &dyn Device) -> Option<i32> {
        let vendor = dev.vendor();
        let tracked = lock(&self.registry).map.values().find(|a| a.vendor == vendor).map(|a| a.device);
        tracked.or_else(|| dev.active_devices().first().copied())
    }

    /// (vendor, device, free, total) for every device with tracked memory, or (for a vendor with
    /// none) every device the process already has a context on, measured from the calling thread
    /// without creating a context anywhere.
    pub fn devices(&self) -> Vec<(Vendor, i32, u64, u64)> {
        let mut wanted: Vec<(Vendor, i32)> = lock(&self.registry).map.values().map(|a| (a.vendor, a.device)).collect();
        for v in Vendor::ALL {
            if let Some(dev) = self.loaded(v)
                && !wanted.iter().any(|w| w.0 == v)
            {
                wanted.extend(dev.active_devices().into_iter().map(|d| (v, d)));
            }
        }
        wanted.sort();
        wanted.dedup();
        let mut out = Vec::new();
        for (v, d) in wanted {
            let Some(dev) = self.loaded(v) else { continue };
            let Ok(previous) = dev.bind_thread(d) else { continue };
            if let Ok((free, total)) = dev.mem_info() {
                out.push((v, d, free, total));
            }
            dev.restore_thread(previous);
        }
        out
    }

    /// Per-tag counts and bytes.
    pub fn status(&self) -> Vec<TagStatus> {
        let reg = lock(&self.registry);
        let mut by_tag: BTreeMap<TagId, TagStatus> = BTreeMap::new();
        for a in reg.map.values().filter(|a| !a.doomed) {
            let s = by_tag.entry(a.tag).or_insert_with(|| TagStatus { tag: a.tag, ..Default::default() });
            match a.state {
                State::Paused => {
                    s.allocations_paused += 1;
                    s.bytes_paused += a.rounded as u64;
                }
                State::Active | State::Busy => {
                    s.allocations_active += 1;
                    s.bytes_active += a.rounded as u64;
                }
            }
            if let Some(b) = a.backup {
                s.backup_bytes += b.len as u64;
            }
        }
        by_tag.into_values().collect()
    }

    /// The region allocation holding `ptr`, as (its address, the bytes asked for, its tag), for
    /// the messages of calls that must not reach region memory.
    pub fn region_allocation_at(&self, ptr: u64) -> Option<(u64, usize, String)> {
        let reg = lock(&self.registry);
        let (start, a) = reg.containing(ptr)?;
        Some((start, a.size, crate::region::tag_name(a.tag)))
    }

    /// The host address holding the backup of `[ptr, ptr+size)`, if that range lies in one
    /// allocation that has a backup buffer.
    pub fn backup_pointer(&self, ptr: u64, size: u64) -> Option<usize> {
        let reg = lock(&self.registry);
        let (start, a) = reg.containing(ptr)?;
        // A resumed allocation's buffer is a pooled one unless it was resumed with retention on:
        // handing it out would give callers the last pause's snapshot as if it were current.
        if a.state != State::Paused && !a.backup_retained {
            return None;
        }
        let b = a.backup?;
        let offset = ptr - start;
        (offset + size <= b.len as u64).then_some(b.ptr + offset as usize)
    }

    /// Frees retained backup buffers of active allocations (paused ones still need theirs).
    /// Returns the bytes freed.
    pub fn release_backups(&self) -> u64 {
        let mut freed = Vec::new();
        {
            let mut reg = lock(&self.registry);
            for a in reg.map.values_mut() {
                if a.state == State::Active
                    && !a.backup_valid
                    && let Some(b) = a.backup.take()
                {
                    freed.push((a.vendor, b));
                }
            }
        }
        let mut bytes = 0;
        for (vendor, b) in freed {
            if let Some(dev) = self.loaded(vendor) {
                free_host_buf(dev.as_ref(), b);
                bytes += b.len as u64;
            }
        }
        bytes
    }
}
