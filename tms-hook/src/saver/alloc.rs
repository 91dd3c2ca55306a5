//! Region allocations backed by releasable physical memory, and their frees.

use super::pieces::{free_host_buf, map_piece, release_piece, unmap_piece};
use super::{Error, Saver, lock};
use crate::config::config;
use crate::device::{Device, MemKind, Vendor};
use crate::disk;
use crate::region::{self, Flags};
use crate::registry::{Allocation, Piece, State};
use std::sync::atomic::Ordering;

pub(super) fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// `round_up` for sizes callers choose: None where the rounded size does not fit in an address.
pub(super) fn checked_round_up(n: usize, to: usize) -> Option<usize> {
    n.div_ceil(to).checked_mul(to)
}

impl Saver {
    pub(super) fn granularity(&self, dev: &dyn Device, device: i32, kind: MemKind) -> Result<usize, Error> {
        let key = (dev.vendor(), device, kind);
        if let Some(g) = lock(&self.granularity).get(&key) {
            return Ok(*g);
        }
        let g = dev.granularity(device, kind).map_err(Error::Driver)?;
        lock(&self.granularity).insert(key, g);
        Ok(g)
    }

    /// Allocates `size` bytes backed by releasable physical memory, under the tag and backup
    /// flags of the calling thread's region (`flags`), of physical memory `kind`. `Ok(None)`: no
    /// driver, the caller should pass the call through.
    pub fn malloc(&self, vendor: Vendor, size: usize, kind: MemKind, flags: Flags) -> Result<Option<u64>, Error> {
        let Some(dev) = self.device(vendor) else { return Ok(None) };
        let device = dev.current_device().map_err(Error::Driver)?;
        // The calling thread may have no current context yet (the runtime makes one only in the
        // call we intercepted): the driver calls below need one. A thread that had none keeps the
        // device's primary context current afterwards, as the runtime call would have left it.
        let previous = dev.bind_thread(device).map_err(Error::Driver)?;
        if vendor == Vendor::Cuda {
            crate::registrations::graph_registration_off();
        }
        let result = self.malloc_on(dev.as_ref(), (vendor, device, kind), size, flags);
        dev.restore_thread(previous);
        result.map(Some)
    }

    fn malloc_on(
        &self,
        dev: &dyn Device,
        (vendor, device, kind): (Vendor, i32, MemKind),
        size: usize,
        flags: Flags,
    ) -> Result<u64, Error> {
        let granularity = self.granularity(dev, device, kind)?;
        // The copy streams every resume (and a backed-up pause) uses, made with the device's first
        // region allocation: the driver takes device memory for them, and taken later it would
        // show as a pause freeing less than it released.
        self.ensure_streams(dev, device);
        // cudaMalloc(SIZE_MAX) is a plain out-of-memory on the hardware, never a wrapped size.
        let Some(rounded) = checked_round_up(size.max(1), granularity) else {
            let free = dev.mem_info().map(|(free, _)| free).unwrap_or(0);
            return Err(Error::OutOfMemory { code: dev.oom_code(), needed: u64::MAX, free });
        };
        self.check_margin(dev, device, rounded)?;
        // Disk backup is staged through pinned memory like CPU backup (see disk.rs).
        let disk = flags.disk;
        let backup_enabled = flags.backup || disk;
        // Pieces pay off only where a copy runs to overlap with; without a backup, one handle
        // keeps the number of driver calls (and their fixed costs) at a minimum.
        let piece_len = match config().physical_chunk {
            chunk if backup_enabled && chunk > 0 => round_up(chunk, granularity).min(rounded),
            _ => rounded,
        };
        let addr = dev.reserve(rounded).map_err(Error::Driver)?;
        let mut entry = Allocation {
            size,
            rounded,
            piece_len,
            device,
            vendor,
            mem_kind: kind,
            tag: flags.tag,
            backup_enabled,
            pageable_backup: dev.copies_pageable_memory() && flags.pageable && !disk,
            state: State::Active,
            pieces: vec![Piece::default(); rounded.div_ceil(piece_len)],
            backup: None,
            backup_valid: false,
            backup_retained: false,
            backup_sums: None,
            disk,
            disk_file: None,
            doomed: false,
            dead: Vec::new(),
            live: None,
        };
        for i in 0..entry.pieces.len() {
            if let Err(e) = map_piece(dev, device, addr, &mut entry, i) {
                for j in 0..i {
                    let _ = unmap_piece(dev, addr, &mut entry, j);
                    let _ = release_piece(dev, &mut entry, j);
                }
                let _ = dev.free_reservation(addr, rounded);
                return Err(Error::Driver(e));
            }
        }
        region::retain(entry.tag);
        lock(&self.registry).map.insert(addr, entry);
        self.tracked.fetch_add(1, Ordering::AcqRel);
        tracing::debug!("tms: {} bytes at {addr:#x} (tag {})", rounded, region::tag_name(flags.tag));
        Ok(addr)
    }

    /// Refuses an allocation of `rounded` bytes that would leave less than the margin free.
    fn check_margin(&self, dev: &dyn Device, device: i32, rounded: usize) -> Result<(), Error> {
        let margin = self.margin();
        if margin == 0 {
            return Ok(());
        }
        let (free, _) = dev.mem_info().map_err(Error::Driver)?;
        // A margin near u64::MAX refuses everything; it must never wrap into a small number.
        let needed = (rounded as u64).saturating_add(margin);
        if free >= needed {
            return Ok(());
        }
        // The caller sees only an out-of-memory next to free memory: say why here.
        tracing::warn!(
            "tms: refused a region allocation of {} on device {device}: {} free, and the margin \
             (TMS_MEMORY_MARGIN_BYTES / tms-ctl set --margin) keeps {} free",
            tms_proto::size::format_size(rounded as u64),
            tms_proto::size::format_size(free),
            tms_proto::size::format_size(margin)
        );
        Err(Error::OutOfMemory { code: dev.oom_code(), needed, free })
    }

    /// Frees a tracked allocation. None: not ours (the caller forwards to the real free).
    pub fn free(&self, addr: u64) -> Option<Result<(), Error>> {
        if self.tracked() == 0 {
            return None;
        }
        let mut claimed = self.claim(addr)?;
        let vendor = claimed[0].a.vendor;
        let Some(dev) = self.loaded(vendor) else {
            // Cannot happen: a tracked allocation was made through a loaded driver.
            let a = claimed.disarm().pop().expect("one entry").a;
            self.settle(addr, Some(a));
            return Some(Err(Error::NoDriver(vendor)));
        };
        let released = {
            let a = &mut claimed[0].a;
            a.doomed = true;
            (|| {
                if a.pieces.iter().any(|p| p.mapped) {
                    let previous = dev.bind_thread(a.device).map_err(Error::Driver)?;
                    let synced = dev.synchronize();
                    dev.restore_thread(previous);
                    synced.map_err(Error::Driver)?;
                }
                for i in 0..a.pieces.len() {
                    unmap_piece(dev.as_ref(), addr, &mut *a, i).map_err(Error::Driver)?;
                    // Part of it is gone: the application can no longer use it as a whole.
                    a.state = State::Paused;
                }
                for i in 0..a.pieces.len() {
                    release_piece(dev.as_ref(), &mut *a, i).map_err(Error::Driver)?;
                }
                Ok(())
            })()
        };
        let mut a = claimed.disarm().pop().expect("one entry").a;
        if let Err(e) = released {
            return Some(Err(self.free_failed(addr, a, e)));
        }
        // The entry goes before the address range does: once the driver has the range back,
        // another thread's allocation may get the same address and register it.
        self.settle(addr, None);
        if let Err(e) = dev.free_reservation(addr, a.rounded) {
            // The range is still reserved, so nobody else can have registered it meanwhile.
            lock(&self.registry).map.insert(addr, Allocation { state: State::Busy, ..a.clone() });
            self.tracked.fetch_add(1, Ordering::AcqRel);
            return Some(Err(self.free_failed(addr, a, Error::Driver(e))));
        }
        if let Some(b) = a.backup.take() {
            free_host_buf(dev.as_ref(), b);
        }
        if let Some(path) = a.disk_file.take() {
            disk::remove(&path);
        }
        region::release(a.tag);
        Some(Ok(()))
    }

    /// Puts back an entry whose free failed half-way, so that freeing it again finishes the job.
    fn free_failed(&self, addr: u64, mut a: Allocation, e: Error) -> Error {
        tracing::warn!("tms: free of {addr:#x} failed ({e}); freeing it again retries");
        // Still mapped and usable: the application may keep using it.
        if a.state == State::Active {
            a.doomed = false;
        }
        self.settle(addr, Some(a));
        e
    }
}
