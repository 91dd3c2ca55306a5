//! The copy pipeline: an operation's pieces go to or come from their host backups in batches of
//! about one chunk over the saver's copy streams (backup.rs's window), while the calling thread
//! releases (pause) or creates and maps (resume) the physical memory of the other batches.

use super::pieces::{ensure_backup_buffer, map_piece, piece_copies, release_piece, unmap_piece};
use super::{Error, Job, Report, Saver};
use crate::backup::{self, CopyJob, Direction, Window};
use crate::config::config;
use crate::device::{DevResult, Device, Stream};
use std::ops::Range;

/// Consecutive runs of `count` units of about one chunk of copies each; `unit` gives a unit's
/// (job, piece). A piece counts the live bytes it copies, so pieces with little or nothing live
/// share a batch.
fn batches(jobs: &[Job], count: usize, unit: impl Fn(usize) -> (usize, usize)) -> Vec<Range<usize>> {
    backup::batches(count, config().backup_chunk, |u| {
        let (i, p) = unit(u);
        super::live::bytes(&jobs[i].a.piece_live(p))
    })
}

/// Copies every piece of the jobs `saving` to its host backup, pinning buffers as it goes, and
/// releases each piece once its copy is done. Returns which jobs failed, indexed like `jobs`.
pub(super) fn save(
    dev: &dyn Device,
    streams: &[Stream],
    jobs: &mut [Job],
    saving: &[usize],
    report: &mut Report,
) -> Vec<bool> {
    let units: Vec<(usize, usize)> =
        saving.iter().flat_map(|&i| (0..jobs[i].a.pieces.len()).map(move |p| (i, p))).collect();
    let mut failed = vec![false; jobs.len()];
    let mut window = Window::new(dev, streams, config().backup_chunk);
    for batch in batches(jobs, units.len(), |u| units[u]) {
        let live = with_buffers(dev, jobs, &units, batch, &mut failed, report);
        if live.is_empty() {
            continue;
        }
        let copies: Vec<CopyJob> = live.iter().flat_map(|&u| piece_copies(&jobs[units[u].0], units[u].1)).collect();
        window
            .send(live, &copies, Direction::ToHost, |done| retire_saved(dev, jobs, &units, &mut failed, done, report));
    }
    window.drain(|done| retire_saved(dev, jobs, &units, &mut failed, done, report));
    failed
}

/// The units of `batch` whose allocation has its host buffer (pinned now if needed). Without a
/// buffer nothing of an allocation may be released: it fails.
fn with_buffers(
    dev: &dyn Device,
    jobs: &mut [Job],
    units: &[(usize, usize)],
    batch: Range<usize>,
    failed: &mut [bool],
    report: &mut Report,
) -> Vec<usize> {
    let mut live = Vec::new();
    for u in batch {
        let i = units[u].0;
        if failed[i] {
            continue;
        }
        // Pinning a buffer overlaps with the copies already in flight.
        if let Err(e) = ensure_backup_buffer(dev, &mut jobs[i].a) {
            Saver::note(report, Error::Driver(e));
            failed[i] = true;
            continue;
        }
        live.push(u);
    }
    live
}

/// A batch of backup copies finished: release the pieces whose contents are now on the host,
/// or mark their allocations failed.
fn retire_saved(
    dev: &dyn Device,
    jobs: &mut [Job],
    units: &[(usize, usize)],
    failed: &mut [bool],
    (done, result): backup::Finished,
    report: &mut Report,
) {
    if fail_batch(result, done.iter().map(|&u| units[u].0), failed, report) {
        return;
    }
    for u in done {
        let (i, p) = units[u];
        if failed[i] {
            continue;
        }
        let j = &mut jobs[i];
        if let Err(e) = unmap_piece(dev, j.addr, &mut j.a, p) {
            Saver::note(report, Error::Driver(e));
            failed[i] = true;
            continue;
        }
        if let Err(e) = release_piece(dev, &mut j.a, p) {
            // Unmapped but still held, contents and all: resume maps the same handle back.
            Saver::note(report, Error::Driver(e));
        }
    }
}

/// A batch whose copies failed fails every allocation it carried. Returns whether it failed.
fn fail_batch(
    result: DevResult<()>,
    jobs_in_batch: impl Iterator<Item = usize>,
    failed: &mut [bool],
    report: &mut Report,
) -> bool {
    let Err(e) = result else { return false };
    Saver::note(report, Error::Driver(e));
    for i in jobs_in_batch {
        failed[i] = true;
    }
    true
}

/// What `restore` did.
pub(super) struct Restored {
    /// (job, piece, memory created here) for every piece that was unmapped.
    pub(super) units: Vec<(usize, usize, bool)>,
    /// Indexed like the jobs.
    pub(super) failed: Vec<bool>,
    /// Whether any backup was copied in.
    pub(super) copied: bool,
}

/// Maps the unmapped pieces of the jobs `idx` back at their addresses, creating memory for those
/// that gave theirs up, and copies their backups in where the backup is valid.
pub(super) fn restore(
    dev: &dyn Device,
    device: i32,
    streams: &[Stream],
    jobs: &mut [Job],
    idx: &[usize],
    report: &mut Report,
) -> Restored {
    let units = idx
        .iter()
        .flat_map(|&i| (0..jobs[i].a.pieces.len()).map(move |p| (i, p, false)))
        .filter(|&(i, p, _)| !jobs[i].a.pieces[p].mapped)
        .collect();
    let mut r = Restored { units, failed: vec![false; jobs.len()], copied: false };
    let mut out_of_memory = false;
    let mut window = Window::new(dev, streams, config().backup_chunk);
    for batch in batches(jobs, r.units.len(), |u| (r.units[u].0, r.units[u].1)) {
        let mut live = Vec::new();
        let mut copies = Vec::new();
        for u in batch {
            let (i, p, _) = r.units[u];
            let j = &mut jobs[i];
            // Once the device is full, a piece that needs new memory is not tried.
            if r.failed[i] || (out_of_memory && j.a.pieces[p].handle.is_none()) {
                r.failed[i] = true;
                continue;
            }
            let Some(created) = map_back(dev, device, j, p, &mut out_of_memory, report) else {
                r.failed[i] = true;
                continue;
            };
            r.units[u].2 = created;
            // A piece that kept its memory kept its contents; one with nothing live has no copy.
            if created && j.a.backup_valid {
                let before = copies.len();
                copies.extend(piece_copies(j, p));
                if copies.len() > before {
                    live.push(u);
                }
            }
        }
        if copies.is_empty() {
            continue;
        }
        r.copied = true;
        let (units, failed) = (&r.units, &mut r.failed);
        window.send(live, &copies, Direction::ToDevice, |(done, result)| {
            fail_batch(result, done.iter().map(|&u| units[u].0), failed, report);
        });
    }
    let (units, failed) = (&r.units, &mut r.failed);
    window.drain(|(done, result)| {
        fail_batch(result, done.iter().map(|&u| units[u].0), failed, report);
    });
    drop(window);
    r
}

/// Maps piece `p` of a job back. Returns whether memory was created, or None after noting the
/// failure (an out-of-memory one sets `out_of_memory`).
fn map_back(
    dev: &dyn Device,
    device: i32,
    j: &mut Job,
    p: usize,
    out_of_memory: &mut bool,
    report: &mut Report,
) -> Option<bool> {
    match map_piece(dev, device, j.addr, &mut j.a, p) {
        Ok(created) => Some(created),
        Err(e) => {
            let err = if dev.is_oom(e.code) {
                *out_of_memory = true;
                let free = dev.mem_info().map(|m| m.0).unwrap_or(0);
                Error::OutOfMemory { code: e.code, needed: j.a.rounded as u64, free }
            } else {
                Error::Driver(e)
            };
            Saver::note(report, err);
            None
        }
    }
}
