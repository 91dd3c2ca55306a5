//! The simulated node: device capacity and usage shared by every process that names the same node,
//! kept in a small memory-mapped state file with atomic counters.
//!
//! Each attached process owns a slot that mirrors what it has charged, so that the usage of a
//! process that died without freeing (crash, SIGKILL) can be handed back: a slot whose pid is gone,
//! or whose pid now belongs to a process with another start time, is reclaimed.

use crate::core::config::{Config, MAX_DEVICES, warn};
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

const MAGIC: u64 = 0x746d_732d_7369_6d31; // "tms-sim1"
/// 2: 64 devices a node (1 held 16); in the state file's name too (config::state_file_for).
pub const LAYOUT_VERSION: u32 = 2;
pub const MAX_SLOTS: usize = 256;
/// A slot being reclaimed by another process.
const RECLAIMING: u32 = u32::MAX;

#[repr(C)]
pub struct Slot {
    pid: AtomicU32,
    _pad: u32,
    start_time: AtomicU64,
    used: [AtomicU64; MAX_DEVICES],
}

#[repr(C)]
pub struct NodeState {
    magic: AtomicU64,
    version: AtomicU32,
    devices: AtomicU32,
    capacity: AtomicU64,
    used: [AtomicU64; MAX_DEVICES],
    /// Per device, per direction (0: host to device, 1: device to host): the monotonic time in ns
    /// until which that direction of the emulated bus is busy.
    pub bus_busy_until: [[AtomicU64; 2]; MAX_DEVICES],
    slots: [Slot; MAX_SLOTS],
}

pub struct Node {
    state: &'static NodeState,
    slot: usize,
    pub path: Option<PathBuf>,
}

impl Node {
    /// Attaches this process to the node named in `cfg`, creating or re-initializing it when no
    /// live process uses it. Falls back to a private node when the state file is unusable.
    pub fn attach(cfg: &Config) -> Node {
        let path = cfg.state_file();
        match attach_file(&path, cfg) {
            Ok(node) => node,
            Err(e) => {
                warn(&format!(
                    "cannot use node state file {} ({e}); this process gets a private node. \
                     Set TMS_SIM_DIR to a writable folder to share devices across processes.",
                    path.display()
                ));
                let state = map_anonymous();
                init_state(state, cfg);
                let slot = claim_slot(state).unwrap_or(0);
                Node { state, slot, path: None }
            }
        }
    }

    pub fn devices(&self) -> u32 {
        self.state.devices.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> u64 {
        self.state.capacity.load(Ordering::Relaxed)
    }

    pub fn used(&self, dev: usize) -> u64 {
        self.state.used[dev].load(Ordering::Acquire)
    }

    /// Device usage as a free-memory query reports it: a device frees a process's memory when it
    /// dies, so the usage of dead processes is reclaimed first.
    pub fn used_now(&self, dev: usize) -> u64 {
        // Cheap first: one kill(pid, 0) per attached process; the full check (start times read
        // from /proc) runs only when one of them is gone.
        if any_gone(self.state) {
            reclaim_dead(self.state);
        }
        self.used(dev)
    }

    pub fn process_used(&self, dev: usize) -> u64 {
        self.state.slots[self.slot].used[dev].load(Ordering::Relaxed)
    }

    /// Live processes using device `dev`, with their usage (what NVML lists as running processes).
    pub fn processes_on(&self, dev: usize) -> Vec<(u32, u64)> {
        reclaim_dead(self.state);
        self.state
            .slots
            .iter()
            .filter_map(|slot| {
                let pid = slot.pid.load(Ordering::Acquire);
                let used = slot.used[dev].load(Ordering::Acquire);
                (pid != 0 && pid != RECLAIMING && used > 0).then_some((pid, used))
            })
            .collect()
    }

    pub fn state(&self) -> &'static NodeState {
        self.state
    }

    /// Takes `bytes` of device `dev`, or returns false when the device is full. Retries once
    /// after reclaiming the usage of dead processes.
    pub fn charge(&self, dev: usize, bytes: u64) -> bool {
        for attempt in 0..2 {
            let cap = self.capacity();
            let ok = self.state.used[dev]
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_add(bytes).filter(|n| *n <= cap))
                .is_ok();
            if ok {
                self.state.slots[self.slot].used[dev].fetch_add(bytes, Ordering::AcqRel);
                return true;
            }
            if attempt == 0 && reclaim_dead(self.state) == 0 {
                break;
            }
        }
        false
    }

    pub fn uncharge(&self, dev: usize, bytes: u64) {
        saturating_sub(&self.state.slots[self.slot].used[dev], bytes);
        saturating_sub(&self.state.used[dev], bytes);
    }
}

fn saturating_sub(a: &AtomicU64, n: u64) {
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| Some(u.saturating_sub(n)));
}

fn attach_file(path: &Path, cfg: &Config) -> std::io::Result<Node> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
    let fd = file.as_raw_fd();
    let size = std::mem::size_of::<NodeState>();
    // SAFETY: plain syscalls on a file descriptor we own.
    unsafe {
        if libc::flock(fd, libc::LOCK_EX) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let result = (|| {
            if (file.metadata()?.len() as usize) < size && libc::ftruncate(fd, size as libc::off_t) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let p = libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            if p == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            let state: &'static NodeState = &*(p as *const NodeState);
            let valid =
                state.magic.load(Ordering::Acquire) == MAGIC && state.version.load(Ordering::Acquire) == LAYOUT_VERSION;
            if valid {
                reclaim_dead(state);
            }
            if !valid || live_slots(state) == 0 {
                init_state(state, cfg);
            }
            let slot = claim_slot(state).ok_or_else(|| {
                std::io::Error::other(format!("all {MAX_SLOTS} process slots of the node are in use"))
            })?;
            Ok(Node { state, slot, path: Some(path.to_path_buf()) })
        })();
        libc::flock(fd, libc::LOCK_UN);
        result
    }
}

/// Opens an existing node read-only for inspection (the `tms-sim status` command).
pub fn inspect(path: &Path) -> std::io::Result<NodeReport> {
    let file = std::fs::File::open(path)?;
    let size = std::mem::size_of::<NodeState>();
    if (file.metadata()?.len() as usize) < size {
        return Err(std::io::Error::other("not a tms-sim state file (too short)"));
    }
    // SAFETY: a read-only shared mapping of a file of at least `size` bytes.
    let state: &NodeState = unsafe {
        let p = libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0);
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        &*(p as *const NodeState)
    };
    if state.magic.load(Ordering::Acquire) != MAGIC {
        return Err(std::io::Error::other("not a tms-sim state file (bad magic)"));
    }
    let devices = state.devices.load(Ordering::Relaxed) as usize;
    let mut processes = Vec::new();
    for slot in &state.slots {
        let pid = slot.pid.load(Ordering::Acquire);
        if pid == 0 || pid == RECLAIMING {
            continue;
        }
        processes.push(ProcessReport {
            pid,
            alive: is_alive(pid, slot.start_time.load(Ordering::Relaxed)),
            used: (0..devices).map(|d| slot.used[d].load(Ordering::Relaxed)).collect(),
        });
    }
    // A device frees a dead process's memory at once; the node file catches up only when the
    // next process attaches or allocates, so what the dead still hold is shown apart, not as used.
    let held_by_dead = |d: usize| processes.iter().filter(|p| !p.alive).map(|p| p.used[d]).sum::<u64>();
    let recorded: Vec<u64> = (0..devices).map(|d| state.used[d].load(Ordering::Relaxed)).collect();
    let report = NodeReport {
        path: path.display().to_string(),
        devices: devices as u32,
        capacity: state.capacity.load(Ordering::Relaxed),
        used: recorded.iter().enumerate().map(|(d, u)| u.saturating_sub(held_by_dead(d))).collect(),
        held_by_exited: (0..devices).map(held_by_dead).collect(),
        processes,
    };
    // SAFETY: unmapping the mapping made above; `state` is not used afterwards.
    unsafe { libc::munmap(state as *const NodeState as *mut libc::c_void, size) };
    Ok(report)
}

#[derive(Debug, serde::Serialize)]
pub struct NodeReport {
    pub path: String,
    pub devices: u32,
    pub capacity: u64,
    /// Per device, what live processes use.
    pub used: Vec<u64>,
    /// Per device, what exited processes still have recorded: free on a device, and handed back
    /// in the node file when the next process attaches or allocates.
    pub held_by_exited: Vec<u64>,
    pub processes: Vec<ProcessReport>,
}

#[derive(Debug, serde::Serialize)]
pub struct ProcessReport {
    pub pid: u32,
    pub alive: bool,
    pub used: Vec<u64>,
}

fn map_anonymous() -> &'static NodeState {
    let size = std::mem::size_of::<NodeState>();
    // SAFETY: a fresh zeroed anonymous mapping, never unmapped.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert!(p != libc::MAP_FAILED, "cannot map {size} bytes for the simulator state");
        &*(p as *const NodeState)
    }
}

fn init_state(state: &NodeState, cfg: &Config) {
    state.devices.store(cfg.devices, Ordering::Relaxed);
    state.capacity.store(cfg.memory, Ordering::Relaxed);
    for d in 0..MAX_DEVICES {
        state.used[d].store(0, Ordering::Relaxed);
        for dir in &state.bus_busy_until[d] {
            dir.store(0, Ordering::Relaxed);
        }
    }
    for slot in &state.slots {
        slot.pid.store(0, Ordering::Relaxed);
        slot.start_time.store(0, Ordering::Relaxed);
        for u in &slot.used {
            u.store(0, Ordering::Relaxed);
        }
    }
    state.version.store(LAYOUT_VERSION, Ordering::Release);
    state.magic.store(MAGIC, Ordering::Release);
}

fn live_slots(state: &NodeState) -> usize {
    state.slots.iter().filter(|s| s.pid.load(Ordering::Acquire) != 0).count()
}

fn claim_slot(state: &NodeState) -> Option<usize> {
    let pid = std::process::id();
    let start = process_start_time(pid).unwrap_or(0);
    for (i, slot) in state.slots.iter().enumerate() {
        if slot.pid.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            slot.start_time.store(start, Ordering::Release);
            for u in &slot.used {
                u.store(0, Ordering::Relaxed);
            }
            return Some(i);
        }
    }
    None
}

/// Hands back the usage of processes that are gone; returns how many slots were reclaimed.
fn reclaim_dead(state: &NodeState) -> usize {
    let me = std::process::id();
    let mut reclaimed = 0;
    for slot in &state.slots {
        let pid = slot.pid.load(Ordering::Acquire);
        if pid == 0 || pid == RECLAIMING || pid == me {
            continue;
        }
        if is_alive(pid, slot.start_time.load(Ordering::Acquire)) {
            continue;
        }
        if slot.pid.compare_exchange(pid, RECLAIMING, Ordering::AcqRel, Ordering::Acquire).is_err() {
            continue;
        }
        for (d, u) in slot.used.iter().enumerate() {
            let n = u.swap(0, Ordering::AcqRel);
            saturating_sub(&state.used[d], n);
        }
        // A free slot's start time is 0 ("unknown"): the next owner publishes its pid before its
        // start time, and a process that reads the new pid in between must not pair it with the
        // dead owner's start time and reclaim a live process's slot.
        slot.start_time.store(0, Ordering::Release);
        slot.pid.store(0, Ordering::Release);
        reclaimed += 1;
    }
    reclaimed
}

/// Whether some attached process no longer exists (a pid reused by another process is left to
/// the full check of `reclaim_dead`, which runs on attach and before refusing an allocation).
fn any_gone(state: &NodeState) -> bool {
    let me = std::process::id();
    state.slots.iter().any(|slot| {
        let pid = slot.pid.load(Ordering::Acquire);
        if pid == 0 || pid == RECLAIMING || pid == me {
            return false;
        }
        // SAFETY: signal 0 only checks for existence.
        let missing = unsafe { libc::kill(pid as libc::pid_t, 0) } != 0;
        missing && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    })
}

fn is_alive(pid: u32, start_time: u64) -> bool {
    // SAFETY: signal 0 only checks for existence.
    let exists = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0
        || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    if !exists {
        return false;
    }
    match process_start_time(pid) {
        Some(t) if start_time != 0 => t == start_time,
        _ => true,
    }
}

/// Start time in clock ticks since boot; with the pid it names a process uniquely (read as the
/// control sockets read it, so that processes under qemu-user agree with the others).
pub fn process_start_time(pid: u32) -> Option<u64> {
    tms_proto::process_start_time(pid)
}
