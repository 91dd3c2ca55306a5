//! Resume: recreate physical memory at the same addresses and restore the backups.

use super::pieces::{ensure_backup_buffer, missing_bytes, release_piece, unmap_piece};
use super::pipeline::{self, Restored};
use super::{Claimed, Error, Job, Report, Saver, lock};
use crate::config::config;
use crate::device::Device;
use crate::disk;
use crate::region;
use crate::registry::State;
use std::time::Instant;

impl Saver {
    /// Resumes every paused allocation of `tag` (all when None) at its address, restoring the
    /// backup where there is one. Refuses up front, touching nothing, when the device lacks the
    /// memory (plus the margin with `TMS_RESUME_KEEPS_MARGIN`); an allocation that cannot be
    /// resumed stays paused, backup intact, and the failure is logged as a warning.
    pub fn resume(&self, tag: Option<&str>) -> Report {
        let _op = lock(&self.operations);
        let start = Instant::now();
        let name = tag;
        let tag = tag.map(region::lookup);
        let (jobs, mut report) = self.begin(tag, State::Paused);
        let (mut jobs, unreadable) = self.load_from_disk(jobs, &mut report);
        self.resume_groups(&mut jobs, &mut report);
        self.restore_registrations(&jobs, &mut report);
        if let Some((free, _)) = self.device_memory(&jobs) {
            report.device_free_after = free;
        }
        // While the backups are still there to compare with.
        self.verify_restored(&mut jobs, &mut report);
        let retain = self.retain_backup();
        for j in jobs.iter_mut().filter(|j| j.ok) {
            j.a.backup_valid = false;
            j.a.backup_retained = retain && !j.a.disk;
            if let Some(path) = j.a.disk_file.take() {
                disk::remove(&path);
            }
        }
        self.keep_or_free_buffers(&mut jobs, retain);
        self.finish(jobs, &mut report, State::Active, State::Paused);
        self.finish(unreadable, &mut report, State::Active, State::Paused);
        if name == Some(crate::comms::TAG) {
            let no_allocations = report.allocations_done + report.allocations_skipped + report.allocations_failed == 0;
            crate::comms::resume(self, &mut report, no_allocations);
        }
        report.elapsed_ns = start.elapsed().as_nanos() as u64;
        match &report.error {
            // Logged where it was found, naming the allocation; nothing stayed paused for it.
            Some(Error::Corrupt { .. }) => {}
            // A job that wakes with memory still unmapped crashes on its next kernel: say so even
            // when the caller ignores the return code (torch_memory_saver's Python does).
            Some(e) => tracing::warn!(
                "tms: resume {} left {} allocation(s), {} bytes, paused: {e}; their contents are \
                 kept, free device memory and resume again",
                super::error::tag_label(name),
                report.allocations_failed,
                report.bytes_failed
            ),
            None => tracing::info!("tms: resume {}: {}", super::error::tag_label(name), report.summary("resumed")),
        }
        report
    }

    /// NCCL registrations a pause took down are made again where all their memory is mapped:
    /// by this resume, or already active.
    fn restore_registrations(&self, jobs: &[Job], report: &mut Report) {
        let resumed: std::collections::BTreeMap<u64, bool> = jobs.iter().map(|j| (j.addr, j.ok)).collect();
        // The registry's lock is taken per question, never held while NCCL registers (it may
        // allocate, which takes it).
        let mapped = |addr: u64, len: u64| {
            let reg = lock(&self.registry);
            let end = addr.saturating_add(len);
            // Allocations never overlap: from the one that may hold `addr`, in address order.
            let first = reg.map.range(..=addr).next_back().map_or(addr, |(&a, _)| a);
            let mut covered = addr;
            for (&a, alloc) in reg.map.range(first..end) {
                let a_end = a + alloc.rounded as u64;
                if a_end <= covered {
                    continue;
                }
                let active = resumed.get(&a).copied().unwrap_or(alloc.state == State::Active);
                if a > covered || !active {
                    return false;
                }
                covered = a_end;
            }
            covered >= end
        };
        for why in crate::registrations::restore(mapped) {
            Self::note(report, Error::Registration(why));
        }
    }

    /// Resumes the jobs one (vendor, device) group at a time; a group whose device lacks the
    /// memory is refused as a whole, touching nothing.
    fn resume_groups(&self, jobs: &mut [Job], report: &mut Report) {
        let margin = if config().resume_keeps_margin { self.margin() } else { 0 };
        for ((vendor, device), idx) in Self::groups(jobs) {
            let Some(dev) = self.loaded(vendor) else { continue };
            let previous = match dev.bind_thread(device) {
                Ok(p) => p,
                Err(e) => {
                    Self::note(report, Error::Driver(e));
                    continue;
                }
            };
            let needed: u64 = idx.iter().map(|&i| &jobs[i].a).map(|a| missing_bytes(a) as u64).sum();
            match dev.mem_info() {
                Ok((free, _)) if needed > 0 && free < needed.saturating_add(margin) => {
                    let needed = needed.saturating_add(margin);
                    Self::note(report, Error::OutOfMemory { code: dev.oom_code(), needed, free });
                }
                Err(e) => Self::note(report, Error::Driver(e)),
                Ok(_) => self.resume_group(dev.as_ref(), device, jobs, &idx, report),
            }
            dev.restore_thread(previous);
        }
    }

    /// Reads disk-backed contents back into staging buffers before a resume. Returns the jobs to
    /// resume and those whose file could not be read (they stay paused with their file).
    pub(super) fn load_from_disk<'s>(
        &'s self,
        mut jobs: Claimed<'s>,
        report: &mut Report,
    ) -> (Claimed<'s>, Claimed<'s>) {
        // Decided in place, the entries staying in their guard until they are split.
        let mut unreadable = vec![false; jobs.len()];
        for (j, bad) in jobs.iter_mut().zip(unreadable.iter_mut()) {
            let Some(path) = j.a.disk_file.clone() else { continue };
            let Some(dev) = self.loaded(j.a.vendor) else {
                *bad = true;
                continue;
            };
            let loaded = ensure_backup_buffer(dev.as_ref(), &mut j.a).map_err(Error::Driver).and_then(|()| {
                let b = j.a.backup.expect("ensured above");
                disk::read(&path, b.ptr, j.a.size).map_err(|e| Error::Disk(format!("{}: {e}", path.display())))
            });
            if let Err(e) = loaded {
                Self::note(report, e);
                *bad = true;
            }
        }
        let all = std::mem::take(&mut jobs.jobs);
        let mut ready = Claimed { saver: self, jobs: Vec::with_capacity(all.len()) };
        let mut left = Claimed { saver: self, jobs: Vec::new() };
        for (j, bad) in all.into_iter().zip(unreadable) {
            if bad { left.push(j) } else { ready.push(j) }
        }
        (ready, left)
    }

    pub(super) fn resume_group(
        &self,
        dev: &dyn Device,
        device: i32,
        jobs: &mut [Job],
        idx: &[usize],
        report: &mut Report,
    ) {
        let Some(streams) = self.streams_for(dev, device).map_err(|e| Self::note(report, e)).ok() else { return };
        let started = Instant::now();
        let Restored { units, failed, copied } = pipeline::restore(dev, device, &streams, jobs, idx, report);
        for &(i, p, created) in &units {
            if !failed[i] {
                continue;
            }
            // Back to paused as it was: the backup is intact, kept memory keeps its contents.
            let j = &mut jobs[i];
            if let Err(e) = unmap_piece(dev, j.addr, &mut j.a, p) {
                Self::note(report, Error::Driver(e));
            } else if created && let Err(e) = release_piece(dev, &mut j.a, p) {
                Self::note(report, Error::Driver(e));
            }
        }
        for &(i, p, created) in &units {
            if !failed[i] && created && jobs[i].a.backup_valid {
                let copied = super::live::bytes(&jobs[i].a.piece_live(p));
                report.backup_bytes += copied as u64;
                report.backup_bytes_skipped += (jobs[i].a.piece_data_len(p) - copied) as u64;
            }
        }
        for &i in idx {
            jobs[i].ok = !failed[i];
        }
        if copied {
            report.backup_ns += started.elapsed().as_nanos() as u64;
        }
    }
}
