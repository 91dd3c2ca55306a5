//! Resume: recreate physical memory at the same addresses and restore the backups.

use super::pieces::{
    ensure_backup_buffer, free_host_buf, map_piece, missing_bytes, piece_copy, release_piece, unmap_piece,
};
use super::{Claimed, Error, Job, Report, Saver, lock};
use crate::backup::{self, Direction};
use crate::config::config;
use crate::device::{DevResult, Device};
use crate::disk;
use crate::host_memory;
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
        let margin = if config().resume_keeps_margin { self.margin() } else { 0 };
        for ((vendor, device), idx) in Self::groups(&mut jobs) {
            let Some(dev) = self.loaded(vendor) else { continue };
            let previous = match dev.bind_thread(device) {
                Ok(p) => p,
                Err(e) => {
                    Self::note(&mut report, Error::Driver(e));
                    continue;
                }
            };
            let needed: u64 = idx.iter().map(|&i| &jobs[i].a).map(|a| missing_bytes(a) as u64).sum();
            match dev.mem_info() {
                Ok((free, _)) if needed > 0 && free < needed.saturating_add(margin) => {
                    let needed = needed.saturating_add(margin);
                    Self::note(&mut report, Error::OutOfMemory { code: dev.oom_code(), needed, free });
                }
                Err(e) => Self::note(&mut report, Error::Driver(e)),
                Ok(_) => self.resume_group(dev.as_ref(), device, &mut jobs, &idx, &mut report),
            }
            dev.restore_thread(previous);
        }
        if let Some((free, _)) = self.device_memory(&jobs) {
            report.device_free_after = free;
        }
        // The buffers stay for the next pause if retained (their snapshot is still handed out) or
        // pooled (they are not).
        let retain = self.retain_backup();
        let keep = retain || config().keep_pinned;
        // Pooled buffers hold host memory while their allocations are active: at most
        // TMS_PINNED_POOL_MAX_MB of them stay, and only while the host keeps its reserve
        // available; the rest are freed (and pinned again next pause).
        let pooled_here = |j: &Job| !retain && !j.a.disk && !j.a.pageable_backup && j.a.backup.is_some();
        let candidates: u64 =
            jobs.iter().filter(|j| j.ok && pooled_here(j)).filter_map(|j| j.a.backup).map(|b| b.len as u64).sum();
        let mut pool_room = None;
        if keep && candidates > 0 {
            let host = host_memory::pool_room(candidates, config().pinned_pool_host_reserve_percent);
            let capped = config().pinned_pool_max.map(|max| max.saturating_sub(self.pooled_bytes()));
            pool_room = Some(capped.map_or(host, |c| c.min(host)));
        }
        for j in jobs.iter_mut().filter(|j| j.ok) {
            j.a.backup_valid = false;
            j.a.backup_retained = retain && !j.a.disk;
            if let Some(path) = j.a.disk_file.take() {
                disk::remove(&path);
            }
            let fits = match (&mut pool_room, j.a.backup) {
                (Some(room), Some(b)) if pooled_here(j) => {
                    let ok = b.len as u64 <= *room;
                    if ok {
                        *room -= b.len as u64;
                    }
                    ok
                }
                _ => true,
            };
            // A disk-backed allocation's staging buffer goes: its contents live on disk, not here.
            // A pageable backup goes too unless retained: the "mmap" backend is chosen to give
            // host memory back.
            if (!keep || !fits || j.a.disk || (j.a.pageable_backup && !j.a.backup_retained))
                && let Some(b) = j.a.backup.take()
                && let Some(dev) = self.loaded(j.a.vendor)
            {
                free_host_buf(dev.as_ref(), b);
            }
        }
        self.finish(jobs, &mut report, State::Active, State::Paused);
        self.finish(unreadable, &mut report, State::Active, State::Paused);
        if name == Some(crate::comms::TAG) {
            let no_allocations = report.allocations_done + report.allocations_skipped + report.allocations_failed == 0;
            crate::comms::resume(self, &mut report, no_allocations);
        }
        report.elapsed_ns = start.elapsed().as_nanos() as u64;
        match &report.error {
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
        // (job, piece, created here)
        let mut units: Vec<(usize, usize, bool)> = idx
            .iter()
            .flat_map(|&i| (0..jobs[i].a.pieces.len()).map(move |p| (i, p, false)))
            .filter(|&(i, p, _)| !jobs[i].a.pieces[p].mapped)
            .collect();
        let mut failed = vec![false; jobs.len()];
        let mut out_of_memory = false;
        let mut restoring = false;
        {
            let mut window = backup::Window::new(dev, &streams, config().backup_chunk);
            for batch in backup::batches(units.len(), config().backup_chunk, |u| {
                let (i, p, _) = units[u];
                jobs[i].a.piece_range(p).1
            }) {
                let mut live = Vec::new();
                let mut copies = Vec::new();
                for u in batch {
                    let (i, p, _) = units[u];
                    let j = &mut jobs[i];
                    if failed[i] {
                        continue;
                    }
                    if out_of_memory && j.a.pieces[p].handle.is_none() {
                        failed[i] = true;
                        continue;
                    }
                    match map_piece(dev, device, j.addr, &mut j.a, p) {
                        Ok(created) => {
                            units[u].2 = created;
                            // A piece that kept its memory kept its contents.
                            if created
                                && j.a.backup_valid
                                && let Some(c) = piece_copy(j, p)
                            {
                                copies.push(c);
                                live.push(u);
                            }
                        }
                        Err(e) => {
                            failed[i] = true;
                            let err = if dev.is_oom(e.code) {
                                out_of_memory = true;
                                let free = dev.mem_info().map(|m| m.0).unwrap_or(0);
                                Error::OutOfMemory { code: e.code, needed: j.a.rounded as u64, free }
                            } else {
                                Error::Driver(e)
                            };
                            Self::note(report, err);
                        }
                    }
                }
                if copies.is_empty() {
                    continue;
                }
                restoring = true;
                window.send(live, &copies, Direction::ToDevice, |(done, result)| {
                    Self::fail_batch(result, done.iter().map(|&u| units[u].0), &mut failed, report);
                });
            }
            window.drain(|(done, result)| {
                Self::fail_batch(result, done.iter().map(|&u| units[u].0), &mut failed, report);
            });
        }
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
                report.backup_bytes += jobs[i].a.piece_data_len(p) as u64;
            }
        }
        for &i in idx {
            jobs[i].ok = !failed[i];
        }
        if restoring {
            report.backup_ns += started.elapsed().as_nanos() as u64;
        }
    }

    /// A batch whose copies failed fails every allocation it carried. Returns whether it failed.
    pub(super) fn fail_batch(
        result: DevResult<()>,
        jobs_in_batch: impl Iterator<Item = usize>,
        failed: &mut [bool],
        report: &mut Report,
    ) -> bool {
        let Err(e) = result else { return false };
        Self::note(report, Error::Driver(e));
        for i in jobs_in_batch {
            failed[i] = true;
        }
        true
    }
}
