//! The state machine, written once for every vendor: allocate in a region, free, pause, resume.
//!
//! Locking: `registry` is held only to read or change entries, never across a driver call.
//! An entry being worked on is marked `Busy`; a thread that needs it waits on `settled`.
//! `operations` serializes whole pause/resume operations (in-process calls and control-socket
//! requests alike) with each other, not with the application's allocations and frees.

use crate::backup::{self, CopyJob, Direction};
use crate::config::config;
use crate::device::{Device, DeviceError, PhysHandle, Stream, Vendor};
use crate::region::{self, TagId};
use crate::registry::{Allocation, HostBuf, Registry, State};
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
}

impl Error {
    /// The code the vendor API would return for this failure.
    pub fn vendor_code(&self, invalid: i32) -> i32 {
        match self {
            Error::Driver(e) => e.code,
            Error::OutOfMemory { code, .. } => *code,
            Error::NoDriver(_) | Error::Invalid(_) => invalid,
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Driver(e) => write!(f, "driver call failed: {e}"),
            Error::OutOfMemory { needed, free, .. } => {
                write!(f, "out of device memory: {needed} bytes needed (margin included), {free} free")
            }
            Error::NoDriver(v) => write!(f, "no {} driver could be loaded", v.name()),
            Error::Invalid(what) => write!(f, "invalid argument: {what}"),
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
    /// Time spent in backup/restore transfers (included in `elapsed_ns`).
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
        let rounded = round_up(size.max(1), self.granularity(dev.as_ref(), device)?);
        let margin = self.margin();
        if margin > 0 {
            let (free, _) = dev.mem_info().map_err(Error::Driver)?;
            let needed = rounded as u64 + margin;
            if free < needed {
                return Err(Error::OutOfMemory { code: dev.oom_code(), needed, free });
            }
        }
        let handle = dev.create(device, rounded).map_err(Error::Driver)?;
        let undo_create = |e: DeviceError| {
            let _ = dev.release(handle);
            Error::Driver(e)
        };
        let addr = dev.reserve(rounded).map_err(undo_create)?;
        let undo_reserve = |e: DeviceError| {
            let _ = dev.free_reservation(addr, rounded);
            let _ = dev.release(handle);
            Error::Driver(e)
        };
        dev.map(addr, rounded, handle).map_err(undo_reserve)?;
        if let Err(e) = dev.set_access(device, addr, rounded) {
            let _ = dev.unmap(addr, rounded);
            return Err(undo_reserve(e));
        }
        let entry = Allocation {
            size,
            rounded,
            device,
            vendor,
            tag: region::current_tag(),
            backup_enabled: region::backup_enabled(),
            state: State::Active,
            handle: Some(handle),
            backup: None,
            backup_valid: false,
            doomed: false,
        };
        lock(&self.registry).map.insert(addr, entry);
        self.tracked.fetch_add(1, Ordering::AcqRel);
        crate::control::ensure_started();
        tracing::debug!("tms: {} bytes at {addr:#x} (tag {})", rounded, region::tag_name(region::current_tag()));
        Ok(Some(addr))
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
            if let Some(h) = a.handle {
                if a.state == State::Active {
                    let previous = dev.bind_thread(a.device).map_err(Error::Driver)?;
                    let synced = dev.synchronize();
                    dev.restore_thread(previous);
                    synced.map_err(Error::Driver)?;
                    dev.unmap(addr, a.rounded).map_err(Error::Driver)?;
                    a.state = State::Paused;
                }
                dev.release(h).map_err(Error::Driver)?;
                a.handle = None;
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
            dev.host_free(b.ptr as *mut u8);
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

    /// Runs backup or restore copies on this device's streams, timing them into the report.
    fn transfer(
        &self,
        dev: &dyn Device,
        device: i32,
        jobs: &[CopyJob],
        dir: Direction,
        report: &mut Report,
    ) -> Result<(), Error> {
        let started = Instant::now();
        let result = self
            .streams_for(dev, device)
            .and_then(|s| backup::transfer(dev, &s, jobs, dir, config().backup_chunk).map_err(Error::Driver));
        report.backup_ns += started.elapsed().as_nanos() as u64;
        result
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
        let mut eligible: Vec<usize> = Vec::new();
        let mut copies = Vec::new();
        for &i in idx {
            let j = &mut jobs[i];
            if !j.a.backup_enabled {
                eligible.push(i);
                continue;
            }
            if j.a.backup.is_none_or(|b| b.len < j.a.size) {
                if let Some(old) = j.a.backup.take() {
                    dev.host_free(old.ptr as *mut u8);
                }
                match dev.host_alloc(j.a.size.max(1)) {
                    Ok(p) => j.a.backup = Some(HostBuf { ptr: p as usize, len: j.a.size.max(1) }),
                    Err(e) => {
                        Self::note(report, Error::Driver(e));
                        continue;
                    }
                }
            }
            let b = j.a.backup.expect("just ensured");
            copies.push(CopyJob { device_addr: j.addr, host: b.ptr as *mut u8, len: j.a.size });
            eligible.push(i);
        }
        if !copies.is_empty() {
            match self.transfer(dev, device, &copies, Direction::ToHost, report) {
                Ok(()) => report.backup_bytes += copies.iter().map(|c| c.len as u64).sum::<u64>(),
                Err(e) => {
                    // Without a complete backup nothing that needs one may be released.
                    Self::note(report, e);
                    eligible.retain(|&i| !jobs[i].a.backup_enabled);
                }
            }
        }
        for i in eligible {
            let j = &mut jobs[i];
            let h: PhysHandle = j.a.handle.expect("active allocations hold a handle");
            if let Err(e) = dev.unmap(j.addr, j.a.rounded) {
                Self::note(report, Error::Driver(e));
                continue;
            }
            j.a.backup_valid = j.a.backup_enabled;
            if let Err(e) = dev.release(h) {
                // Unmapped but still held: it counts as paused (the address is not usable) and
                // resume maps the same handle back.
                Self::note(report, Error::Driver(e));
            } else {
                j.a.handle = None;
            }
            j.ok = true;
        }
    }

    /// Resumes every paused allocation of `tag` (all when None) at its address, restoring the
    /// backup where there is one. Refuses up front, touching nothing, when the device lacks the
    /// memory plus the margin; an allocation that cannot be resumed stays paused, backup intact.
    pub fn resume(&self, tag: Option<&str>) -> Report {
        let _op = lock(&self.operations);
        let start = Instant::now();
        let tag = tag.map(region::intern);
        let (mut jobs, mut report) = self.begin(tag, State::Paused);
        let margin = self.margin();
        for ((vendor, device), idx) in Self::groups(&mut jobs) {
            let Some(dev) = self.loaded(vendor) else { continue };
            let previous = match dev.bind_thread(device) {
                Ok(p) => p,
                Err(e) => {
                    Self::note(&mut report, Error::Driver(e));
                    continue;
                }
            };
            let needed: u64 =
                idx.iter().filter(|&&i| jobs[i].a.handle.is_none()).map(|&i| jobs[i].a.rounded as u64).sum();
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
        let retain = self.retain_backup();
        for j in jobs.iter_mut().filter(|j| j.ok) {
            j.a.backup_valid = false;
            if !retain
                && let Some(b) = j.a.backup.take()
                && let Some(dev) = self.loaded(j.a.vendor)
            {
                dev.host_free(b.ptr as *mut u8);
            }
        }
        self.finish(jobs, &mut report, State::Active, State::Paused);
        report.elapsed_ns = start.elapsed().as_nanos() as u64;
        tracing::info!("tms: resume {:?}: {:?}", tag.map(region::tag_name), report);
        report
    }

    fn resume_group(&self, dev: &dyn Device, device: i32, jobs: &mut [Job], idx: &[usize], report: &mut Report) {
        let mut mapped: Vec<usize> = Vec::new();
        let mut out_of_memory = false;
        for &i in idx {
            let j = &mut jobs[i];
            let h = match j.a.handle {
                Some(h) => h,
                None if out_of_memory => continue,
                None => match dev.create(device, j.a.rounded) {
                    Ok(h) => h,
                    Err(e) => {
                        let err = if dev.is_oom(e.code) {
                            out_of_memory = true;
                            let free = dev.mem_info().map(|m| m.0).unwrap_or(0);
                            Error::OutOfMemory { code: e.code, needed: j.a.rounded as u64, free }
                        } else {
                            Error::Driver(e)
                        };
                        Self::note(report, err);
                        continue;
                    }
                },
            };
            j.a.handle = Some(h);
            if let Err(e) = dev.map(j.addr, j.a.rounded, h) {
                Self::note(report, Error::Driver(e));
                if dev.release(h).is_ok() {
                    j.a.handle = None;
                }
                continue;
            }
            if let Err(e) = dev.set_access(device, j.addr, j.a.rounded) {
                Self::note(report, Error::Driver(e));
                let _ = dev.unmap(j.addr, j.a.rounded);
                if dev.release(h).is_ok() {
                    j.a.handle = None;
                }
                continue;
            }
            mapped.push(i);
        }
        let restores: Vec<CopyJob> = mapped
            .iter()
            .filter(|&&i| jobs[i].a.backup_valid)
            .map(|&i| {
                let b = jobs[i].a.backup.expect("valid backup exists");
                CopyJob { device_addr: jobs[i].addr, host: b.ptr as *mut u8, len: jobs[i].a.size }
            })
            .collect();
        let mut restore_failed = false;
        if !restores.is_empty() {
            match self.transfer(dev, device, &restores, Direction::ToDevice, report) {
                Ok(()) => report.backup_bytes += restores.iter().map(|c| c.len as u64).sum::<u64>(),
                Err(e) => {
                    Self::note(report, e);
                    restore_failed = true;
                }
            }
        }
        for i in mapped {
            let j = &mut jobs[i];
            if restore_failed && j.a.backup_valid {
                // Contents did not come back: put the allocation back to paused, backup intact.
                let h = j.a.handle.expect("mapped");
                let _ = dev.unmap(j.addr, j.a.rounded);
                if dev.release(h).is_ok() {
                    j.a.handle = None;
                }
                continue;
            }
            j.ok = true;
        }
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
                dev.host_free(b.ptr as *mut u8);
                bytes += b.len as u64;
            }
        }
        bytes
    }
}
