//! The state machine, written once for every vendor: allocate in a region, free, pause, resume.
//!
//! Locking: `registry` is held only to read or change entries, never across a driver call.
//! An entry being worked on is marked `Busy`; a thread that needs it waits on `settled`.
//! `operations` serializes whole pause/resume operations (in-process calls and control-socket
//! requests alike) with each other, not with the application's allocations and frees.

use crate::backup::{self, CopyJob, Direction};
use crate::config::config;
use crate::device::{DevResult, Device, DeviceError, Stream, Vendor};
use crate::disk;
use crate::region::{self, TagId};
use crate::registry::{Allocation, HostBuf, Piece, Registry, State};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A driver call failed; carries the vendor's code.
    Driver(DeviceError),
    /// Not enough free device memory (the vendor's out-of-memory code, what was needed, what was
    /// free at the time).
    OutOfMemory { code: i32, needed: u64, free: u64 },
    /// No driver of that vendor could be loaded.
    NoDriver(Vendor),
    /// Bad argument from the caller.
    Invalid(&'static str),
    /// A disk backup file could not be read (the allocation stays paused with its file).
    Disk(String),
}

impl Error {
    /// The code the vendor API would return for this failure.
    pub fn vendor_code(&self, invalid: i32) -> i32 {
        match self {
            Error::Driver(e) => e.code,
            Error::OutOfMemory { code, .. } => *code,
            Error::NoDriver(_) | Error::Invalid(_) | Error::Disk(_) => invalid,
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Driver(e) => write!(f, "driver call failed: {e}"),
            Error::OutOfMemory { needed, free, .. } => {
                write!(f, "out of device memory: {needed} bytes needed (any margin included), {free} free")
            }
            Error::NoDriver(v) => write!(f, "no {} driver could be loaded", v.name()),
            Error::Invalid(what) => write!(f, "invalid argument: {what}"),
            Error::Disk(what) => write!(f, "disk backup unreadable: {what}"),
        }
    }
}

/// What a pause or resume did; mirrors `tms_report` in include/tms.h.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub allocations_done: u64,
    pub bytes_done: u64,
    pub allocations_skipped: u64,
    pub bytes_skipped: u64,
    pub allocations_failed: u64,
    pub bytes_failed: u64,
    /// Bytes copied to or from host backups.
    pub backup_bytes: u64,
    pub elapsed_ns: u64,
    pub device_free_before: u64,
    pub device_free_after: u64,
    pub device_total: u64,
    /// Time of the backup/restore pipeline: the copies, with the releases (pause) or creates
    /// (resume) overlapped into them (included in `elapsed_ns`).
    pub backup_ns: u64,
    /// The first failure, if any (the operation still did what it could).
    pub error: Option<Error>,
}

/// Per-tag view for `tms_status` and the control plane.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TagStatus {
    pub tag: TagId,
    pub allocations_active: u64,
    pub allocations_paused: u64,
    pub bytes_active: u64,
    pub bytes_paused: u64,
    pub backup_bytes: u64,
}

struct DriverSlot {
    device: OnceLock<Arc<dyn Device>>,
    warned: AtomicBool,
    vendor: Vendor,
}

impl DriverSlot {
    const fn new(vendor: Vendor) -> DriverSlot {
        DriverSlot { device: OnceLock::new(), warned: AtomicBool::new(false), vendor }
    }

    /// The driver, loaded on first need. A failure is not remembered (the runtime may appear
    /// later) but is reported only once.
    fn get(&self) -> Option<Arc<dyn Device>> {
        if let Some(d) = self.device.get() {
            return Some(d.clone());
        }
        let loaded: Result<Arc<dyn Device>, String> = match self.vendor {
            Vendor::Cuda => crate::device::cuda::Cuda::load().map(|d| Arc::new(d) as Arc<dyn Device>),
            Vendor::Acl => crate::device::acl::Acl::load().map(|d| Arc::new(d) as Arc<dyn Device>),
        };
        match loaded {
            Ok(d) => Some(self.device.get_or_init(|| d).clone()),
            Err(e) => {
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

pub struct Saver {
    registry: Mutex<Registry>,
    settled: Condvar,
    operations: Mutex<()>,
    /// Number of tracked allocations, read without a lock so frees of untracked pointers stay
    /// cheap in processes that never allocate in a region.
    tracked: AtomicUsize,
    margin: AtomicU64,
    retain_backup: AtomicBool,
    cuda: DriverSlot,
    acl: DriverSlot,
    granularity: Mutex<HashMap<(Vendor, i32), usize>>,
    streams: Mutex<HashMap<(Vendor, i32), Vec<Stream>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// `round_up` for sizes callers choose: None where the rounded size does not fit in an address.
fn checked_round_up(n: usize, to: usize) -> Option<usize> {
    n.div_ceil(to).checked_mul(to)
}

/// One allocation taken out for work, with everything needed outside the lock.
struct Job {
    addr: u64,
    a: Allocation,
    ok: bool,
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
            cuda: DriverSlot::new(Vendor::Cuda),
            acl: DriverSlot::new(Vendor::Acl),
            granularity: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
        }
    }

    pub fn device(&self, vendor: Vendor) -> Option<Arc<dyn Device>> {
        match vendor {
            Vendor::Cuda => self.cuda.get(),
            Vendor::Acl => self.acl.get(),
        }
    }

    /// A driver already loaded, without trying to load one.
    fn loaded(&self, vendor: Vendor) -> Option<Arc<dyn Device>> {
        match vendor {
            Vendor::Cuda => self.cuda.device.get().cloned(),
            Vendor::Acl => self.acl.device.get().cloned(),
        }
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

    pub fn tracked(&self) -> usize {
        self.tracked.load(Ordering::Acquire)
    }

    fn granularity(&self, dev: &dyn Device, device: i32) -> Result<usize, Error> {
        let key = (dev.vendor(), device);
        if let Some(g) = lock(&self.granularity).get(&key) {
            return Ok(*g);
        }
        let g = dev.granularity(device).map_err(Error::Driver)?;
        lock(&self.granularity).insert(key, g);
        Ok(g)
    }

    /// Allocates `size` bytes backed by releasable physical memory, under the calling thread's
    /// tag and backup flag. `Ok(None)`: no driver, the caller should pass the call through.
    pub fn malloc(&self, vendor: Vendor, size: usize) -> Result<Option<u64>, Error> {
        let Some(dev) = self.device(vendor) else { return Ok(None) };
        let device = dev.current_device().map_err(Error::Driver)?;
        // The calling thread may have no current context yet (the runtime makes one only in the
        // call we intercepted): the driver calls below need one. A thread that had none keeps the
        // device's primary context current afterwards, as the runtime call would have left it.
        let previous = dev.bind_thread(device).map_err(Error::Driver)?;
        let result = self.malloc_on(dev.as_ref(), vendor, device, size);
        dev.restore_thread(previous);
        result.map(Some)
    }

    fn malloc_on(&self, dev: &dyn Device, vendor: Vendor, device: i32, size: usize) -> Result<u64, Error> {
        let granularity = self.granularity(dev, device)?;
        // cudaMalloc(SIZE_MAX) is a plain out-of-memory on the hardware, never a wrapped size.
        let Some(rounded) = checked_round_up(size.max(1), granularity) else {
            let free = dev.mem_info().map(|(free, _)| free).unwrap_or(0);
            return Err(Error::OutOfMemory { code: dev.oom_code(), needed: u64::MAX, free });
        };
        let margin = self.margin();
        if margin > 0 {
            let (free, _) = dev.mem_info().map_err(Error::Driver)?;
            let needed = rounded as u64 + margin;
            if free < needed {
                return Err(Error::OutOfMemory { code: dev.oom_code(), needed, free });
            }
        }
        // Disk backup is staged through pinned memory like CPU backup (see disk.rs).
        let disk = region::disk_backup_enabled();
        let backup_enabled = region::backup_enabled() || disk;
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
            tag: region::current_tag(),
            backup_enabled,
            // Ascend's asynchronous copies need page-locked host memory.
            pageable_backup: vendor == Vendor::Cuda && region::pageable_backup() && !disk,
            state: State::Active,
            pieces: vec![Piece::default(); rounded.div_ceil(piece_len)],
            backup: None,
            backup_valid: false,
            backup_retained: false,
            disk,
            disk_file: None,
            doomed: false,
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
        lock(&self.registry).map.insert(addr, entry);
        self.tracked.fetch_add(1, Ordering::AcqRel);
        crate::control::ensure_started();
        tracing::debug!("tms: {} bytes at {addr:#x} (tag {})", rounded, region::tag_name(region::current_tag()));
        Ok(addr)
    }

    /// Waits until the entry at `addr` is not Busy, then marks it Busy and returns a copy.
    /// None: not tracked.
    fn claim(&self, addr: u64) -> Option<Allocation> {
        let mut reg = lock(&self.registry);
        loop {
            let a = reg.map.get_mut(&addr)?;
            if a.state != State::Busy {
                let copy = a.clone();
                a.state = State::Busy;
                return Some(copy);
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

    /// Frees a tracked allocation. None: not ours (the caller forwards to the real free).
    pub fn free(&self, addr: u64) -> Option<Result<(), Error>> {
        if self.tracked() == 0 {
            return None;
        }
        let mut a = self.claim(addr)?;
        let Some(dev) = self.loaded(a.vendor) else {
            // Cannot happen: a tracked allocation was made through a loaded driver.
            self.settle(addr, Some(a));
            return Some(Err(Error::NoDriver(Vendor::Cuda)));
        };
        a.doomed = true;
        let released = (|| {
            if a.pieces.iter().any(|p| p.mapped) {
                let previous = dev.bind_thread(a.device).map_err(Error::Driver)?;
                let synced = dev.synchronize();
                dev.restore_thread(previous);
                synced.map_err(Error::Driver)?;
            }
            for i in 0..a.pieces.len() {
                unmap_piece(dev.as_ref(), addr, &mut a, i).map_err(Error::Driver)?;
                // Part of it is gone: the application can no longer use it as a whole.
                a.state = State::Paused;
            }
            for i in 0..a.pieces.len() {
                release_piece(dev.as_ref(), &mut a, i).map_err(Error::Driver)?;
            }
            Ok(())
        })();
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

    /// Takes every entry of `tag` (all tags when None) in state `want` for work (marks them Busy);
    /// counts the entries of the tag already in the other state as skipped.
    fn select(&self, tag: Option<TagId>, want: State, report: &mut Report) -> Vec<Job> {
        let mut reg = lock(&self.registry);
        loop {
            let busy = reg.map.values().any(|a| a.state == State::Busy && tag.is_none_or(|t| t == a.tag));
            if !busy {
                break;
            }
            reg = self.settled.wait(reg).unwrap_or_else(|e| e.into_inner());
        }
        let mut jobs = Vec::new();
        for (&addr, a) in reg.map.iter_mut() {
            if a.doomed || tag.is_some_and(|t| t != a.tag) {
                continue;
            }
            if a.state == want {
                jobs.push(Job { addr, a: a.clone(), ok: false });
                a.state = State::Busy;
            } else {
                report.allocations_skipped += 1;
                report.bytes_skipped += a.rounded as u64;
            }
        }
        jobs
    }

    fn finish(&self, jobs: Vec<Job>, report: &mut Report, done_state: State, undone_state: State) {
        let mut reg = lock(&self.registry);
        for mut job in jobs {
            if job.ok {
                job.a.state = done_state;
                report.allocations_done += 1;
                report.bytes_done += job.a.rounded as u64;
            } else {
                job.a.state = undone_state;
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

    /// Free device memory on the device of the first job (or the calling thread's device).
    fn device_memory(&self, jobs: &[Job]) -> Option<(u64, u64)> {
        let vendor = jobs.first().map(|j| j.a.vendor);
        let dev = match vendor {
            Some(v) => self.loaded(v)?,
            None => self.loaded(Vendor::Cuda).or_else(|| self.loaded(Vendor::Acl))?,
        };
        let device = jobs.first().map(|j| j.a.device).unwrap_or_else(|| self.any_device(dev.vendor()));
        let previous = dev.bind_thread(device).ok()?;
        let info = dev.mem_info().ok();
        dev.restore_thread(previous);
        info
    }

    /// Takes the allocations an operation works on and opens its report with the device's free
    /// memory before it.
    fn begin(&self, tag: Option<TagId>, want: State) -> (Vec<Job>, Report) {
        let mut report = Report::default();
        let jobs = self.select(tag, want, &mut report);
        if let Some((free, total)) = self.device_memory(&jobs) {
            report.device_free_before = free;
            report.device_total = total;
        }
        (jobs, report)
    }

    fn groups(jobs: &mut [Job]) -> BTreeMap<(Vendor, i32), Vec<usize>> {
        let mut groups: BTreeMap<(Vendor, i32), Vec<usize>> = BTreeMap::new();
        for (i, j) in jobs.iter().enumerate() {
            groups.entry((j.a.vendor, j.a.device)).or_default().push(i);
        }
        groups
    }

    /// Pauses every active allocation of `tag` (all tags when None): synchronize, copy to the
    /// host backup where enabled, unmap, release. Already paused ones are skipped.
    pub fn pause(&self, tag: Option<&str>) -> Report {
        let _op = lock(&self.operations);
        let start = Instant::now();
        let tag = tag.map(region::intern);
        let (mut jobs, mut report) = self.begin(tag, State::Active);
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
        report.elapsed_ns = start.elapsed().as_nanos() as u64;
        tracing::info!("tms: pause {:?}: {:?}", tag.map(region::tag_name), report);
        report
    }

    fn pause_group(&self, dev: &dyn Device, device: i32, jobs: &mut [Job], idx: &[usize], report: &mut Report) {
        // Kernels still running on the memory would fault once it is unmapped.
        if let Err(e) = dev.synchronize() {
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
        let units: Vec<(usize, usize)> =
            saving.iter().flat_map(|&i| (0..jobs[i].a.pieces.len()).map(move |p| (i, p))).collect();
        let mut failed = vec![false; jobs.len()];
        {
            let mut window = backup::Window::new(dev, &streams, config().backup_chunk);
            for batch in backup::batches(units.len(), config().backup_chunk, |u| {
                let (i, p) = units[u];
                jobs[i].a.piece_range(p).1
            }) {
                let mut live = Vec::new();
                for u in batch {
                    let i = units[u].0;
                    if failed[i] {
                        continue;
                    }
                    // Pinning a buffer overlaps with the copies already in flight.
                    if let Err(e) = ensure_backup_buffer(dev, &mut jobs[i].a) {
                        // Without a backup buffer nothing of it may be released.
                        Self::note(report, Error::Driver(e));
                        failed[i] = true;
                        continue;
                    }
                    live.push(u);
                }
                if live.is_empty() {
                    continue;
                }
                let copies: Vec<CopyJob> =
                    live.iter().filter_map(|&u| piece_copy(&jobs[units[u].0], units[u].1)).collect();
                window.send(live, &copies, Direction::ToHost, |done| {
                    Self::retire_saved(dev, jobs, &units, &mut failed, done, report)
                });
            }
            window.drain(|done| Self::retire_saved(dev, jobs, &units, &mut failed, done, report));
        }
        for &i in &saving {
            if failed[i] {
                self.roll_back_pause(dev, device, streams[0], &mut jobs[i], report);
            } else {
                jobs[i].a.backup_valid = true;
                jobs[i].ok = true;
                report.backup_bytes += jobs[i].a.size as u64;
            }
        }
        report.backup_ns += started.elapsed().as_nanos() as u64;
    }

    /// Gives up an allocation's memory and contents. All pieces are unmapped before any is
    /// released, so a failure part-way maps them back with their contents intact.
    fn pause_without_backup(dev: &dyn Device, device: i32, j: &mut Job, report: &mut Report) -> bool {
        for p in 0..j.a.pieces.len() {
            if let Err(e) = unmap_piece(dev, j.addr, &mut j.a, p) {
                Self::note(report, Error::Driver(e));
                for q in 0..p {
                    if let Err(e) = map_piece(dev, device, j.addr, &mut j.a, q) {
                        Self::note(report, Error::Driver(e));
                    }
                }
                // Still mapped as a whole: active. Otherwise every piece keeps its handle, so
                // it counts as paused and resume maps the same memory back.
                return !j.a.all_mapped() && Self::park(dev, j, report);
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
    fn park(dev: &dyn Device, j: &mut Job, report: &mut Report) -> bool {
        for p in 0..j.a.pieces.len() {
            if let Err(e) = unmap_piece(dev, j.addr, &mut j.a, p) {
                Self::note(report, Error::Driver(e));
            }
        }
        !j.a.pieces.iter().any(|p| p.mapped)
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
        if Self::fail_batch(result, done.iter().map(|&u| units[u].0), failed, report) {
            return;
        }
        for u in done {
            let (i, p) = units[u];
            if failed[i] {
                continue;
            }
            let j = &mut jobs[i];
            if let Err(e) = unmap_piece(dev, j.addr, &mut j.a, p) {
                Self::note(report, Error::Driver(e));
                failed[i] = true;
                continue;
            }
            if let Err(e) = release_piece(dev, &mut j.a, p) {
                // Unmapped but still held, contents and all: resume maps the same handle back.
                Self::note(report, Error::Driver(e));
            }
        }
    }

    /// A backup copy of this allocation failed after some of its pieces were already released:
    /// bring them back from the backup so the allocation stays active and intact. If even that
    /// fails, park it paused instead, with nothing lost: released pieces are in the backup and
    /// the others keep their memory.
    fn roll_back_pause(&self, dev: &dyn Device, device: i32, stream: Stream, j: &mut Job, report: &mut Report) {
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
                    if let Some(c) = piece_copy(j, p)
                        && let Err(e) = dev
                            .copy_to_device_async(c.device_addr, c.host, c.len, stream)
                            .and_then(|()| dev.stream_synchronize(stream))
                    {
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
        j.ok = true;
    }

    /// Resumes every paused allocation of `tag` (all when None) at its address, restoring the
    /// backup where there is one. Refuses up front, touching nothing, when the device lacks the
    /// memory (plus the margin with `TMS_RESUME_KEEPS_MARGIN`); an allocation that cannot be
    /// resumed stays paused, backup intact, and the failure is logged as a warning.
    pub fn resume(&self, tag: Option<&str>) -> Report {
        let _op = lock(&self.operations);
        let start = Instant::now();
        let tag = tag.map(region::intern);
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
                Ok((free, _)) if needed > 0 && free < needed + margin => {
                    Self::note(&mut report, Error::OutOfMemory { code: dev.oom_code(), needed: needed + margin, free });
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
        for j in jobs.iter_mut().filter(|j| j.ok) {
            j.a.backup_valid = false;
            j.a.backup_retained = retain && !j.a.disk;
            if let Some(path) = j.a.disk_file.take() {
                disk::remove(&path);
            }
            // A disk-backed allocation's staging buffer goes: its contents live on disk, not here.
            // A pageable backup goes too unless retained: the "mmap" backend is chosen to give
            // host memory back.
            if (!keep || j.a.disk || (j.a.pageable_backup && !j.a.backup_retained))
                && let Some(b) = j.a.backup.take()
                && let Some(dev) = self.loaded(j.a.vendor)
            {
                free_host_buf(dev.as_ref(), b);
            }
        }
        self.finish(jobs, &mut report, State::Active, State::Paused);
        self.finish(unreadable, &mut report, State::Active, State::Paused);
        report.elapsed_ns = start.elapsed().as_nanos() as u64;
        match &report.error {
            // A job that wakes with memory still unmapped crashes on its next kernel: say so even
            // when the caller ignores the return code (torch_memory_saver's Python does).
            Some(e) => tracing::warn!(
                "tms: resume {:?} left {} allocation(s), {} bytes, paused: {e}; their contents are \
                 kept, free device memory and resume again",
                tag.map(region::tag_name),
                report.allocations_failed,
                report.bytes_failed
            ),
            None => tracing::info!("tms: resume {:?}: {:?}", tag.map(region::tag_name), report),
        }
        report
    }

    /// Moves paused disk-backed contents from their staging buffers to files. A write that fails
    /// keeps the contents in host memory (nothing is lost) and says so.
    fn spill_to_disk(&self, jobs: &mut [Job]) {
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

    /// Reads disk-backed contents back into staging buffers before a resume. Returns the jobs to
    /// resume and those whose file could not be read (they stay paused with their file).
    fn load_from_disk(&self, jobs: Vec<Job>, report: &mut Report) -> (Vec<Job>, Vec<Job>) {
        let (mut ready, mut unreadable) = (Vec::with_capacity(jobs.len()), Vec::new());
        for mut j in jobs {
            let Some(path) = j.a.disk_file.clone() else {
                ready.push(j);
                continue;
            };
            let Some(dev) = self.loaded(j.a.vendor) else {
                unreadable.push(j);
                continue;
            };
            let loaded = ensure_backup_buffer(dev.as_ref(), &mut j.a).map_err(Error::Driver).and_then(|()| {
                let b = j.a.backup.expect("ensured above");
                disk::read(&path, b.ptr, j.a.size).map_err(|e| Error::Disk(format!("{}: {e}", path.display())))
            });
            match loaded {
                Ok(()) => ready.push(j),
                Err(e) => {
                    Self::note(report, e);
                    unreadable.push(j);
                }
            }
        }
        (ready, unreadable)
    }

    fn resume_group(&self, dev: &dyn Device, device: i32, jobs: &mut [Job], idx: &[usize], report: &mut Report) {
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
    fn fail_batch(
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

    /// A device this process uses with `vendor` (of a tracked allocation, else 0).
    fn any_device(&self, vendor: Vendor) -> i32 {
        lock(&self.registry).map.values().find(|a| a.vendor == vendor).map_or(0, |a| a.device)
    }

    /// (vendor, device, free, total) for every device with tracked memory (device 0 of each
    /// loaded driver when there is none), measured from the calling thread.
    pub fn devices(&self) -> Vec<(Vendor, i32, u64, u64)> {
        let mut wanted: Vec<(Vendor, i32)> = lock(&self.registry).map.values().map(|a| (a.vendor, a.device)).collect();
        for v in [Vendor::Cuda, Vendor::Acl] {
            if self.loaded(v).is_some() && !wanted.iter().any(|w| w.0 == v) {
                wanted.push((v, 0));
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

/// Gives the allocation a host buffer of its backend big enough for its contents (kept from an
/// earlier pause when it is).
fn ensure_backup_buffer(dev: &dyn Device, a: &mut Allocation) -> Result<(), DeviceError> {
    let pageable = a.pageable_backup;
    if a.backup.is_none_or(|b| b.len < a.size || b.pageable != pageable) {
        if let Some(old) = a.backup.take() {
            free_host_buf(dev, old);
        }
        let len = a.size.max(1);
        let ptr = if pageable {
            map_pageable(len).ok_or(DeviceError { op: "mmap", code: dev.oom_code() })?
        } else {
            dev.host_alloc(len)?
        };
        a.backup = Some(HostBuf { ptr: ptr as usize, len, pageable });
    }
    Ok(())
}

/// Anonymous pageable memory for the "mmap" backend: the kernel may reclaim or swap it, and
/// `munmap` returns it to the system at once.
fn map_pageable(len: usize) -> Option<*mut u8> {
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p.cast())
}

fn free_host_buf(dev: &dyn Device, b: HostBuf) {
    if b.pageable {
        // SAFETY: a mapping of exactly this length made by map_pageable and no longer used.
        unsafe { libc::munmap(b.ptr as *mut libc::c_void, b.len) };
    } else {
        dev.host_free(b.ptr as *mut u8);
    }
}

/// Bytes of physical memory a paused allocation needs to be resumed (pieces that kept their
/// memory need none).
fn missing_bytes(a: &Allocation) -> usize {
    (0..a.pieces.len()).filter(|&p| a.pieces[p].handle.is_none()).map(|p| a.piece_range(p).1).sum()
}

/// The copy that saves or restores the data in piece `p` of a job (None: no data there).
fn piece_copy(j: &Job, p: usize) -> Option<CopyJob> {
    let len = j.a.piece_data_len(p);
    let b = j.a.backup?;
    (len > 0).then(|| {
        let offset = j.a.piece_range(p).0;
        // SAFETY: the backup holds `size` bytes and offset + len <= size.
        let host = unsafe { (b.ptr as *mut u8).add(offset) };
        CopyJob { device_addr: j.addr + offset as u64, host, len }
    })
}

/// Maps piece `i` of `a` at its place, creating physical memory unless the piece kept its handle.
/// Returns whether memory was created. On failure the piece is left unmapped, and memory created
/// here is released again.
fn map_piece(dev: &dyn Device, device: i32, addr: u64, a: &mut Allocation, i: usize) -> Result<bool, DeviceError> {
    if a.pieces[i].mapped {
        return Ok(false);
    }
    let (offset, len) = a.piece_range(i);
    let at = addr + offset as u64;
    let (handle, created) = match a.pieces[i].handle {
        Some(h) => (h, false),
        None => (dev.create(device, len)?, true),
    };
    let undo = |e: DeviceError| {
        if created {
            let _ = dev.release(handle);
        }
        e
    };
    dev.map(at, len, handle).map_err(undo)?;
    if let Err(e) = dev.set_access(device, at, len) {
        let _ = dev.unmap(at, len);
        return Err(undo(e));
    }
    a.pieces[i] = Piece { handle: Some(handle), mapped: true };
    Ok(created)
}

/// Unmaps piece `i` if it is mapped; its handle (and contents) stay.
fn unmap_piece(dev: &dyn Device, addr: u64, a: &mut Allocation, i: usize) -> Result<(), DeviceError> {
    if a.pieces[i].mapped {
        let (offset, len) = a.piece_range(i);
        dev.unmap(addr + offset as u64, len)?;
        a.pieces[i].mapped = false;
    }
    Ok(())
}

/// Releases the memory of an unmapped piece, if it still holds some.
fn release_piece(dev: &dyn Device, a: &mut Allocation, i: usize) -> Result<(), DeviceError> {
    if !a.pieces[i].mapped
        && let Some(h) = a.pieces[i].handle
    {
        dev.release(h)?;
        a.pieces[i].handle = None;
    }
    Ok(())
}
