//! The state machine, written once for every vendor: allocate in a region, free, pause, resume.
//!
//! Locking: `registry` is held only to read or change entries, never across a driver call.
//! An entry being worked on is marked `Busy`; a thread that needs it waits on `settled`. The
//! `Claimed` guard that marks it settles it on every path, a panic included.
//! `operations` serializes whole pause/resume operations (in-process calls and control-socket
//! requests alike) with each other, not with the application's allocations and frees.
//!
//! One idea per file: `alloc` (region allocations and frees), `pause` and `resume` (the two
//! operations), `pipeline` (their copies to and from host backups over the copy streams), `pool`
//! (which host buffers resumed allocations keep), `verify` (restores checked against the pause's
//! checksums), `live` (which bytes a pause copies: the application's dead marks), `inspect`
//! (status, devices, backup pointers),
//! `pieces` (physical pieces and host buffers), `drivers` (each vendor's driver, loaded once),
//! `error` (what callers get back).

mod alloc;
mod drivers;
mod error;
mod inspect;
pub(crate) mod live;
mod pause;
mod pieces;
mod pipeline;
mod pool;
mod resume;
mod verify;

pub use error::{Error, Report, TagStatus};

use crate::config::config;
use crate::device::{Device, MemKind, Stream, Vendor};
use crate::region::TagId;
use crate::registry::{Allocation, Registry, State};
use drivers::Drivers;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

pub struct Saver {
    registry: Mutex<Registry>,
    settled: Condvar,
    operations: Mutex<()>,
    /// Number of tracked allocations, read without a lock so frees of untracked pointers stay
    /// cheap in processes that never allocate in a region.
    tracked: AtomicUsize,
    margin: AtomicU64,
    retain_backup: AtomicBool,
    verify_restore: AtomicBool,
    drivers: Drivers,
    granularity: Mutex<HashMap<(Vendor, i32, MemKind), usize>>,
    streams: Mutex<HashMap<(Vendor, i32), Vec<Stream>>>,
    /// The tag asked for and the report of the last pause that took any allocation (status).
    last_pause: Mutex<Option<(Option<String>, Report)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One allocation taken out for work, with everything needed outside the lock.
struct Job {
    addr: u64,
    a: Allocation,
    ok: bool,
    /// Not `ok`, yet left paused (a pause that failed part-way and could not be undone parks
    /// the allocation with its contents safe): counted failed, with the error, but paused.
    parked: bool,
    /// Left as it is, untouched (an NCCL registration over it could not be taken down): counted
    /// failed, with the error.
    held: bool,
}

/// Entries taken out for work (marked Busy). Settled by `finish` (or `disarm`); dropped
/// unsettled, by a panic part-way, they go back in the state their pieces are in: otherwise every
/// later free, pause or resume of them would wait for them for ever.
struct Claimed<'s> {
    saver: &'s Saver,
    jobs: Vec<Job>,
}

impl std::ops::Deref for Claimed<'_> {
    type Target = Vec<Job>;
    fn deref(&self) -> &Vec<Job> {
        &self.jobs
    }
}

impl std::ops::DerefMut for Claimed<'_> {
    fn deref_mut(&mut self) -> &mut Vec<Job> {
        &mut self.jobs
    }
}

impl Claimed<'_> {
    /// The entries, no longer settled by this guard: the caller settles them.
    fn disarm(mut self) -> Vec<Job> {
        std::mem::take(&mut self.jobs)
    }
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        if self.jobs.is_empty() {
            return;
        }
        let mut reg = lock(&self.saver.registry);
        for job in self.jobs.drain(..) {
            let mut a = job.a;
            // Whatever the work got to, the pieces say what the application can use.
            a.state = if a.all_mapped() { State::Active } else { State::Paused };
            if a.state == State::Active {
                a.doomed = false;
            }
            tracing::warn!("tms: allocation at {:#x} put back after an interrupted operation", job.addr);
            reg.map.insert(job.addr, a);
        }
        drop(reg);
        self.saver.settled.notify_all();
    }
}

impl Default for Saver {
    fn default() -> Self {
        Saver::new()
    }
}

impl Saver {
    pub fn new() -> Saver {
        let cfg = config();
        Saver {
            registry: Mutex::new(Registry::default()),
            settled: Condvar::new(),
            operations: Mutex::new(()),
            tracked: AtomicUsize::new(0),
            margin: AtomicU64::new(cfg.margin),
            retain_backup: AtomicBool::new(cfg.retain_backup),
            verify_restore: AtomicBool::new(cfg.verify_restore),
            drivers: Drivers::new(),
            granularity: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            last_pause: Mutex::new(None),
        }
    }

    pub fn device(&self, vendor: Vendor) -> Option<Arc<dyn Device>> {
        self.drivers.get(vendor)
    }

    /// A driver already loaded, without trying to load one.
    fn loaded(&self, vendor: Vendor) -> Option<Arc<dyn Device>> {
        self.drivers.loaded(vendor)
    }

    pub fn set_margin(&self, bytes: u64) {
        self.margin.store(bytes, Ordering::Relaxed);
    }

    pub fn margin(&self) -> u64 {
        self.margin.load(Ordering::Relaxed)
    }

    pub fn set_retain_backup(&self, retain: bool) {
        self.retain_backup.store(retain, Ordering::Relaxed);
    }

    pub fn retain_backup(&self) -> bool {
        self.retain_backup.load(Ordering::Relaxed)
    }

    /// Pauses made while this is on take checksums of their backups, and the next resume checks
    /// the restored bytes against them (`verify`).
    pub fn set_verify_restore(&self, on: bool) {
        self.verify_restore.store(on, Ordering::Relaxed);
    }

    pub fn verify_restore(&self) -> bool {
        self.verify_restore.load(Ordering::Relaxed)
    }

    pub fn tracked(&self) -> usize {
        self.tracked.load(Ordering::Acquire)
    }

    /// Waits until the entry at `addr` is not Busy, then marks it Busy and returns a copy (the
    /// one job of the guard). None: not tracked.
    fn claim(&self, addr: u64) -> Option<Claimed<'_>> {
        let mut reg = lock(&self.registry);
        loop {
            let a = reg.map.get_mut(&addr)?;
            if a.state != State::Busy {
                let job = Job { addr, a: a.clone(), ok: false, parked: false, held: false };
                a.state = State::Busy;
                return Some(Claimed { saver: self, jobs: vec![job] });
            }
            reg = self.settled.wait(reg).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn settle(&self, addr: u64, a: Option<Allocation>) {
        let mut reg = lock(&self.registry);
        match a {
            Some(a) => {
                reg.map.insert(addr, a);
            }
            None => {
                if reg.map.remove(&addr).is_some() {
                    self.tracked.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        drop(reg);
        self.settled.notify_all();
    }

    fn streams_for(&self, dev: &dyn Device, device: i32) -> Result<Vec<Stream>, Error> {
        let key = (dev.vendor(), device);
        let mut map = lock(&self.streams);
        if let Some(s) = map.get(&key) {
            return Ok(s.clone());
        }
        let mut created = Vec::new();
        for _ in 0..config().backup_streams {
            created.push(dev.stream_create().map_err(Error::Driver)?);
        }
        map.insert(key, created.clone());
        Ok(created)
    }

    /// Makes the device's copy streams if it has none yet, without copying the list (region
    /// allocations call it every time). A failure is left to the operation that needs them.
    pub(super) fn ensure_streams(&self, dev: &dyn Device, device: i32) {
        if !lock(&self.streams).contains_key(&(dev.vendor(), device)) {
            let _ = self.streams_for(dev, device);
        }
    }

    /// Creates the copy streams an operation will use before its free-memory figure is read, where
    /// the first region allocation could not: the driver takes device memory for streams (2 MiB
    /// for four on an H200, driver 580), the hook's own once-only cost, not a change the pause or
    /// resume made. A resume always copies on them; a pause only with a backup.
    fn prepare_streams(&self, jobs: &[Job], want: State) {
        let resuming = want == State::Paused;
        let mut devices: std::collections::BTreeSet<(Vendor, i32)> =
            jobs.iter().filter(|j| resuming || j.a.backup_enabled).map(|j| (j.a.vendor, j.a.device)).collect();
        // Usually made at the first allocation already: then no thread is bound for nothing.
        devices.retain(|key| !lock(&self.streams).contains_key(key));
        for (vendor, device) in devices {
            let Some(dev) = self.loaded(vendor) else { continue };
            let Ok(previous) = dev.bind_thread(device) else { continue };
            self.ensure_streams(dev.as_ref(), device);
            dev.restore_thread(previous);
        }
    }

    /// Takes every entry of `tag` (all tags when None) in state `want` for work (marks them Busy);
    /// counts the entries of the tag already in the other state as skipped.
    fn select(&self, tag: Option<TagId>, want: State, report: &mut Report) -> Claimed<'_> {
        let mut reg = lock(&self.registry);
        loop {
            let busy = reg.map.values().any(|a| a.state == State::Busy && tag.is_none_or(|t| t == a.tag));
            if !busy {
                break;
            }
            reg = self.settled.wait(reg).unwrap_or_else(|e| e.into_inner());
        }
        let mut jobs = Claimed { saver: self, jobs: Vec::new() };
        for (&addr, a) in reg.map.iter_mut() {
            if a.doomed || tag.is_some_and(|t| t != a.tag) {
                continue;
            }
            if a.state == want {
                jobs.push(Job { addr, a: a.clone(), ok: false, parked: false, held: false });
                a.state = State::Busy;
            } else {
                report.allocations_skipped += 1;
                report.bytes_skipped += a.rounded as u64;
            }
        }
        jobs
    }

    fn finish(&self, jobs: Claimed<'_>, report: &mut Report, done_state: State, undone_state: State) {
        let jobs = jobs.disarm();
        let mut reg = lock(&self.registry);
        for mut job in jobs {
            if job.ok {
                job.a.state = done_state;
                report.allocations_done += 1;
                report.bytes_done += job.a.rounded as u64;
            } else {
                job.a.state = if job.parked { done_state } else { undone_state };
                report.allocations_failed += 1;
                report.bytes_failed += job.a.rounded as u64;
            }
            reg.map.insert(job.addr, job.a);
        }
        drop(reg);
        self.settled.notify_all();
    }

    fn note(report: &mut Report, e: Error) {
        tracing::warn!("tms: {e}");
        report.error.get_or_insert(e);
    }

    /// Takes the allocations an operation works on and opens its report with the device's free
    /// memory before it.
    fn begin(&self, tag: Option<TagId>, want: State) -> (Claimed<'_>, Report) {
        let mut report = Report::default();
        let jobs = self.select(tag, want, &mut report);
        self.prepare_streams(&jobs, want);
        if let Some((free, total)) = self.device_memory(&jobs) {
            report.device_free_before = free;
            report.device_total = total;
        }
        (jobs, report)
    }

    fn groups(jobs: &mut [Job]) -> BTreeMap<(Vendor, i32), Vec<usize>> {
        let mut groups: BTreeMap<(Vendor, i32), Vec<usize>> = BTreeMap::new();
        for (i, j) in jobs.iter().enumerate().filter(|(_, j)| !j.held) {
            groups.entry((j.a.vendor, j.a.device)).or_default().push(i);
        }
        groups
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_allocation(saver: &Saver, addr: u64, vendor: Vendor) {
        let a = Allocation {
            size: 1 << 20,
            rounded: 2 << 20,
            piece_len: 2 << 20,
            device: 0,
            vendor,
            mem_kind: crate::device::DEFAULT_KIND,
            tag: crate::region::intern("guarded"),
            backup_enabled: false,
            pageable_backup: false,
            state: State::Active,
            pieces: vec![crate::registry::Piece { handle: None, mapped: true }],
            backup: None,
            backup_valid: false,
            backup_retained: false,
            backup_sums: None,
            disk: false,
            disk_file: None,
            doomed: false,
            dead: Vec::new(),
            live: None,
        };
        lock(&saver.registry).map.insert(addr, a);
        saver.tracked.fetch_add(1, Ordering::AcqRel);
    }

    /// Runs `f` on another thread and fails the test instead of hanging if it does not return.
    fn within_5s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(5)).expect("waited for a Busy entry that nobody settles")
    }

    #[test]
    fn a_panic_between_claim_and_settle_leaves_no_entry_busy() {
        // An entry marked Busy was settled only on the normal path: a panic in between made
        // every later free, pause or resume of it wait for ever.
        let saver: &'static Saver = Box::leak(Box::new(Saver::new()));
        fake_allocation(saver, 0x1000, Vendor::Cuda);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let (_jobs, _report) = saver.begin(None, State::Active);
            panic!("in the middle of a pause");
        }));
        assert!(panicked.is_err());
        let report = within_5s(move || saver.pause(None));
        assert_eq!(report.allocations_failed, 1, "{report:?}"); // no driver loaded here
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _claimed = saver.claim(0x1000);
            panic!("in the middle of a free");
        }));
        assert!(panicked.is_err());
        assert!(within_5s(move || saver.free(0x1000)).is_some());
        assert_eq!(lock(&saver.registry).map[&0x1000].state, State::Active);
    }

    #[test]
    fn dead_marks_are_all_or_nothing_and_consumed_by_the_pause() {
        let saver = Saver::new();
        fake_allocation(&saver, 0x10_0000, Vendor::Cuda); // 1 MiB asked for, 2 MiB mapped
        let marks = |s: &Saver| lock(&s.registry).map[&0x10_0000].dead.clone();
        let invalid = Err(Error::Invalid("a range is not inside one region allocation"));
        // Past the requested size (inside the rounding), before the allocation, far away: each
        // refuses the whole call, the good range beside it included.
        for bad in [(0x10_0000 + (1 << 20) - 8, 16), (0x0f_0000, 16), (0x9000_0000, 1), (0x10_0000, u64::MAX)] {
            assert_eq!(saver.mark_dead(&[(0x10_0000, 4096), bad]), invalid, "{bad:x?}");
            assert!(marks(&saver).is_empty());
        }
        assert_eq!(saver.mark_dead(&[(0x10_0000 + 8192, 4096), (0x10_0000, 4096), (0x10_0000 + 4096, 4096)]), Ok(()));
        assert_eq!(saver.mark_dead(&[(0x10_0000, 0)]), Ok(()));
        assert_eq!(marks(&saver), vec![0..12288]);
        // The pause takes them (its driver is missing here, so it fails, but they are gone).
        saver.pause(None);
        assert!(marks(&saver).is_empty());
        // A paused allocation's marks would outlive its blocks: accepted, ignored.
        lock(&saver.registry).map.get_mut(&0x10_0000).unwrap().state = State::Paused;
        assert_eq!(saver.mark_dead(&[(0x10_0000, 4096)]), Ok(()));
        assert!(marks(&saver).is_empty());
    }

    #[test]
    fn a_free_without_its_driver_names_the_allocations_own_vendor() {
        // The branch reported CUDA whatever the allocation's vendor.
        let saver = Saver::new();
        fake_allocation(&saver, 0x2000, Vendor::Acl);
        assert_eq!(saver.free(0x2000), Some(Err(Error::NoDriver(Vendor::Acl))));
        // Still tracked and usable: freeing it again retries.
        assert_eq!(lock(&saver.registry).map[&0x2000].state, State::Active);
    }

    #[test]
    fn pausing_tags_nobody_allocated_under_does_not_grow_the_tag_table() {
        // 100,000 unique tags sent over the control socket cost 24 MB that was never given back.
        // The table is process-wide and other tests intern their own tags meanwhile, so the
        // check is that none of these names was added, not the table's size.
        let saver = Saver::new();
        for i in 0..2000 {
            let tag = format!("never-used-{i}");
            assert_eq!(saver.pause(Some(&tag)).allocations_done, 0);
            assert_eq!(saver.resume(Some(&tag)).allocations_done, 0);
            assert_eq!(crate::region::lookup(&tag), crate::region::NO_SUCH_TAG, "{tag} was interned");
        }
    }
}
