//! Pause: synchronize, copy to the host backup where enabled, unmap, release.

use super::pieces::{free_host_buf, map_piece, piece_copies, release_piece, unmap_piece};
use super::{Error, Job, Report, Saver, live, lock, pipeline};
use crate::backup;
use crate::device::{Device, Stream};
use crate::disk;
use crate::region;
use crate::registry::State;
use std::time::Instant;

impl Saver {
    /// Pauses every active allocation of `tag` (all tags when None): synchronize, copy to the
    /// host backup where enabled, unmap, release. Already paused ones are skipped.
    pub fn pause(&self, tag: Option<&str>) -> Report {
        let _op = lock(&self.operations);
        let start = Instant::now();
        let name = tag;
        let tag = tag.map(region::lookup);
        let (mut jobs, mut report) = self.begin(tag, State::Active);
        jobs.iter_mut().for_each(Self::consume_marks);
        Self::take_down_registrations(&mut jobs, &mut report);
        for ((vendor, device), idx) in Self::groups(&mut jobs) {
            let Some(dev) = self.loaded(vendor) else { continue };
            let previous = match dev.bind_thread(device) {
                Ok(p) => p,
                Err(e) => {
                    Self::note(&mut report, Error::Driver(e));
                    continue;
                }
            };
            self.pause_group(dev.as_ref(), device, &mut jobs, &idx, &mut report);
            dev.restore_thread(previous);
        }
        if let Some((free, _)) = self.device_memory(&jobs) {
            report.device_free_after = free;
        }
        self.spill_to_disk(&mut jobs);
        self.finish(jobs, &mut report, State::Paused, State::Active);
        if name == Some(crate::comms::TAG) {
            let no_allocations = report.allocations_done + report.allocations_skipped + report.allocations_failed == 0;
            crate::comms::pause(self, &mut report, no_allocations);
        }
        report.elapsed_ns = start.elapsed().as_nanos() as u64;
        tracing::info!("tms: pause {}: {}", super::error::tag_label(name), report.summary("paused"));
        if report.allocations_done + report.allocations_failed > 0 {
            *lock(&self.last_pause) = Some((name.map(String::from), report.clone()));
        }
        report
    }

    /// NCCL registrations over the memory about to be released are deregistered first (the
    /// resume makes them again); an allocation under one NCCL keeps is held back, untouched.
    fn take_down_registrations(jobs: &mut [Job], report: &mut Report) {
        let ranges: Vec<(u64, u64)> = jobs.iter().map(|j| (j.addr, j.a.rounded as u64)).collect();
        for ((addr, _), why) in crate::registrations::suspend(&ranges) {
            if let Some(j) = jobs.iter_mut().find(|j| j.addr == addr && !j.held) {
                j.held = true;
                Self::note(report, Error::Registration(why));
            }
        }
    }

    /// The tag asked for and the report of the last pause that took any allocation.
    pub fn last_pause(&self) -> Option<(Option<String>, Report)> {
        lock(&self.last_pause).clone()
    }

    pub(super) fn pause_group(
        &self,
        dev: &dyn Device,
        device: i32,
        jobs: &mut [Job],
        idx: &[usize],
        report: &mut Report,
    ) {
        // Kernels still running on the memory would fault once it is unmapped. Only what a
        // synchronous copy would wait for: a device-wide synchronize would also wait for
        // communication streams, which may be blocked on a peer waiting for this very pause.
        if let Err(e) = dev.wait_for_queued_work() {
            Self::note(report, Error::Driver(e));
            return;
        }
        let mut saving: Vec<usize> = Vec::new();
        for &i in idx {
            let j = &mut jobs[i];
            if !j.a.backup_enabled {
                j.ok = Self::pause_without_backup(dev, device, j, report);
                continue;
            }
            saving.push(i);
        }
        if saving.is_empty() {
            return;
        }
        let Some(streams) = self.streams_for(dev, device).map_err(|e| Self::note(report, e)).ok() else { return };
        let started = Instant::now();
        let failed = pipeline::save(dev, &streams, jobs, &saving, report);
        for &i in &saving {
            if failed[i] {
                self.roll_back_pause(dev, device, streams[0], &mut jobs[i], report);
            } else {
                self.take_checksums(&mut jobs[i]);
                jobs[i].a.backup_valid = true;
                jobs[i].ok = true;
                let copied = live::bytes(&jobs[i].a.backup_ranges());
                report.backup_bytes += copied as u64;
                report.backup_bytes_skipped += (jobs[i].a.size - copied) as u64;
            }
        }
        report.backup_ns += started.elapsed().as_nanos() as u64;
    }

    /// Gives up an allocation's memory and contents. All pieces are unmapped before any is
    /// released, so a failure part-way maps them back with their contents intact.
    pub(super) fn pause_without_backup(dev: &dyn Device, device: i32, j: &mut Job, report: &mut Report) -> bool {
        for p in 0..j.a.pieces.len() {
            if let Err(e) = unmap_piece(dev, j.addr, &mut j.a, p) {
                Self::note(report, Error::Driver(e));
                for q in 0..p {
                    if let Err(e) = map_piece(dev, device, j.addr, &mut j.a, q) {
                        Self::note(report, Error::Driver(e));
                    }
                }
                // Still mapped as a whole: active. Otherwise every piece keeps its handle, so
                // it stays paused and resume maps the same memory back; either way the pause
                // of this allocation failed and is counted so, next to its error.
                j.parked = !j.a.all_mapped() && Self::park(dev, j, report);
                return false;
            }
        }
        for p in 0..j.a.pieces.len() {
            if let Err(e) = release_piece(dev, &mut j.a, p) {
                // Unmapped but still held: resume maps the same handle back.
                Self::note(report, Error::Driver(e));
            }
        }
        true
    }

    /// Unmaps every piece still mapped, keeping its handle (and so its contents). True when the
    /// allocation ended up fully unmapped, i.e. paused.
    pub(super) fn park(dev: &dyn Device, j: &mut Job, report: &mut Report) -> bool {
        for p in 0..j.a.pieces.len() {
            if let Err(e) = unmap_piece(dev, j.addr, &mut j.a, p) {
                Self::note(report, Error::Driver(e));
            }
        }
        !j.a.pieces.iter().any(|p| p.mapped)
    }

    /// A backup copy of this allocation failed after some of its pieces were already released:
    /// bring them back from the backup so the allocation stays active and intact. If even that
    /// fails, park it paused instead, with nothing lost: released pieces are in the backup and
    /// the others keep their memory.
    pub(super) fn roll_back_pause(
        &self,
        dev: &dyn Device,
        device: i32,
        stream: Stream,
        j: &mut Job,
        report: &mut Report,
    ) {
        let mut recreated = vec![false; j.a.pieces.len()];
        let mut problem = None;
        for (p, again) in recreated.iter_mut().enumerate() {
            if j.a.pieces[p].mapped {
                continue;
            }
            match map_piece(dev, device, j.addr, &mut j.a, p) {
                Ok(false) => {}
                Ok(true) => {
                    *again = true;
                    let copied = piece_copies(j, p)
                        .iter()
                        .try_for_each(|c| dev.copy_to_device_async(c.device_addr, c.host, c.len, stream))
                        .and_then(|()| dev.stream_synchronize(stream));
                    if let Err(e) = copied {
                        // The copy may still be running: it must end before the piece is
                        // unmapped below, and its error must not stay on the stream for the next
                        // resume to fail on.
                        backup::drain_after_error(dev, stream);
                        problem = Some(e);
                        break;
                    }
                }
                Err(e) => {
                    problem = Some(e);
                    break;
                }
            }
        }
        let Some(e) = problem else { return };
        Self::note(report, Error::Driver(e));
        if !Self::park(dev, j, report) {
            return;
        }
        for (p, again) in recreated.into_iter().enumerate() {
            // Its contents are in the backup, not (reliably) in the new memory.
            if again && let Err(e) = release_piece(dev, &mut j.a, p) {
                Self::note(report, Error::Driver(e));
            }
        }
        j.a.backup_valid = true;
        j.parked = true;
    }

    /// Moves paused disk-backed contents from their staging buffers to files. A write that fails
    /// keeps the contents in host memory (nothing is lost) and says so.
    pub(super) fn spill_to_disk(&self, jobs: &mut [Job]) {
        for j in jobs.iter_mut().filter(|j| j.ok && j.a.disk && j.a.backup_valid) {
            let Some(b) = j.a.backup else { continue };
            let Some(dev) = self.loaded(j.a.vendor) else { continue };
            let path = disk::file_for(j.addr);
            match disk::write(&path, b.ptr, j.a.size) {
                Ok(()) => {
                    free_host_buf(dev.as_ref(), b);
                    j.a.backup = None;
                    j.a.disk_file = Some(path);
                }
                Err(e) => {
                    disk::remove(&path);
                    tracing::warn!(
                        "tms: cannot write the disk backup {} ({e}); the contents stay in host memory",
                        path.display()
                    );
                }
            }
        }
    }
}
