//! The process-wide simulator: one instance, created on the first API call, shared by the CUDA
//! runtime, CUDA driver and ACL front ends (which differ only in names, codes and argument forms).
//! It holds no front end's state: each keeps its own (the thread's device, its last error, its
//! contexts), and tells the core only what `context` asks.

use crate::core::config::{Config, warn};
use crate::core::fault;
use crate::core::memory::{Freed, MemError, MemResult, Memory, page_size, round_up};
use crate::core::node::Node;
use crate::core::streams::{StreamId, Streams};
use crate::core::timing::{self, TO_DEVICE, TO_HOST};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, RwLock};

pub struct Sim {
    pub cfg: Config,
    pub node: Node,
    pub mem: RwLock<Memory>,
    /// Held (shared) by every copy while it moves bytes, and exclusively by whatever takes
    /// memory away (unmap, plain free, revoking access). Creating and mapping memory does not
    /// need it, so a thread preparing memory never waits for copies on the streams.
    copying: RwLock<()>,
    pub streams: Streams,
    pub graphs: crate::core::graphs::Graphs,
    /// Page-locked host ranges by start: allocated by the simulator or registered by the caller.
    host: Mutex<BTreeMap<usize, HostRange>>,
    pub pinned_bytes: AtomicU64,
    /// Bytes of this process's small plain allocations per device (see `charge_plain`).
    small_bytes: Mutex<[usize; crate::core::config::MAX_DEVICES]>,
}

pub struct HostRange {
    len: usize,
    /// Registered by the caller (cudaHostRegister): not ours to unmap.
    registered: bool,
    flags: u32,
}

/// A validated copy: where its destination and source bytes are (device memory in its mirror),
/// and the bus it travels on, as (device, direction).
struct CopyPlan {
    dst: usize,
    src: usize,
    dst_on_device: bool,
    src_on_device: bool,
    bus: Option<(usize, usize)>,
}

/// An address as the runtime classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointerKind {
    /// Inside device memory (a plain allocation or a reserved range) of this device.
    Device(usize),
    PinnedHost,
    Unregistered,
}

static SIM: OnceLock<Sim> = OnceLock::new();

/// A device fault (an illegal address met by a copy, memset or kernel on a CUDA device) is sticky:
/// the context is dead and every later CUDA call of the process on that device fails with the
/// same fault, as on a GPU. The core records only that the device faulted; each front end
/// answers with its own code (the CUDA runtime's and driver's 700).
static STICKY: [AtomicBool; crate::core::config::MAX_DEVICES] =
    [const { AtomicBool::new(false) }; crate::core::config::MAX_DEVICES];

/// The sticky fault of `dev`'s context, if it has one.
pub fn sticky_fault(dev: usize) -> Option<MemError> {
    STICKY.get(dev)?.load(Ordering::Acquire).then_some(MemError::IllegalAddress)
}

fn record_fault(dev: usize) {
    if let Some(slot) = STICKY.get(dev) {
        slot.store(true, Ordering::Release);
    }
}

/// Why another process's exported device memory could not be mapped here.
pub enum ImportFailure {
    /// Its pool descriptor cannot be opened: the exporter is gone (or the handle lies).
    Unreachable,
    /// The mapping itself failed.
    Map,
}

/// Maps `len` bytes at `offset` of the device pool that process `pid` holds open as `fd`, as
/// memory of `device`: the IPC import both vendors' handles come down to.
pub fn import_exported(pid: u32, fd: i32, offset: u64, len: usize, device: usize) -> Result<usize, ImportFailure> {
    let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).expect("no NUL in a path");
    // SAFETY: opening a path; the descriptor is closed below once mapped.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(ImportFailure::Unreachable);
    }
    let mapped = sim().mem.write().unwrap_or_else(|e| e.into_inner()).ipc_import(fd, offset, len, device);
    // SAFETY: our own descriptor; the mapping keeps the memory reachable.
    unsafe { libc::close(fd) };
    mapped.map_err(|_| ImportFailure::Map)
}

pub fn sim() -> &'static Sim {
    SIM.get_or_init(|| {
        let cfg = Config::from_env();
        match fault::parse(&cfg.fail) {
            Ok(rules) => fault::install(rules),
            Err(e) => warn(&format!("TMS_SIM_FAIL ignored: {e}")),
        }
        let node = Node::attach(&cfg);
        let mut mem = Memory::new().expect("memfd_create failed: the simulator needs Linux memfd support");
        mem.commit = cfg.commit;
        Sim {
            cfg,
            node,
            mem: RwLock::new(mem),
            copying: RwLock::new(()),
            streams: Streams::default(),
            graphs: crate::core::graphs::Graphs::default(),
            host: Mutex::new(BTreeMap::new()),
            pinned_bytes: AtomicU64::new(0),
            small_bytes: Mutex::new([0; crate::core::config::MAX_DEVICES]),
        }
    })
}

/// Runs an exported function's body, turning a panic into `on_panic` instead of unwinding into C.
pub fn guard(on_panic: i32, body: impl FnOnce() -> i32) -> i32 {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(on_panic)
}

/// Which sides of a copy the caller says are device memory; `Inferred` lets the pointers tell
/// (unified addressing). A copy whose pointers contradict its direction is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    HostToHost,
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
    Inferred,
}

impl Sim {
    pub fn devices(&self) -> usize {
        self.node.devices() as usize
    }

    pub fn valid_device(&self, dev: i64) -> Option<usize> {
        (dev >= 0 && (dev as usize) < self.devices()).then_some(dev as usize)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Memory> {
        self.mem.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Memory> {
        self.mem.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns freed memory to the host (outside the lock, so copies go on meanwhile), then to
    /// the pool and the device's free count.
    fn give_back(&self, freed: impl IntoIterator<Item = Freed>) {
        for f in freed {
            self.give_back_host(&f);
            self.node.uncharge(f.device, f.bytes);
        }
    }

    fn give_back_host(&self, f: &Freed) {
        let fd = self.read().pool_fd();
        Memory::punch_freed(fd, f);
        self.write().recycle(f);
    }

    /// Charges `dev` for a plain allocation of `size` bytes as a GPU's driver does: large ones
    /// take whole 2 MiB granules; small ones (512-byte aligned) are packed into shared granules,
    /// so the device pays a granule when the first small allocation needs it.
    fn charge_plain(&self, dev: usize, size: usize) -> MemResult<()> {
        use crate::core::config::{GRANULARITY, SMALL_ALLOCATION_ALIGN, SMALL_ALLOCATION_LIMIT};
        if size >= SMALL_ALLOCATION_LIMIT {
            let cost = size.checked_next_multiple_of(GRANULARITY).ok_or(MemError::OutOfMemory)?;
            return if self.node.charge(dev, cost as u64) { Ok(()) } else { Err(MemError::OutOfMemory) };
        }
        let mut small = self.small_bytes.lock().unwrap_or_else(|e| e.into_inner());
        let before = round_up(small[dev], GRANULARITY);
        let after_bytes = small[dev] + round_up(size, SMALL_ALLOCATION_ALIGN);
        let cost = (round_up(after_bytes, GRANULARITY) - before) as u64;
        if cost > 0 && !self.node.charge(dev, cost) {
            return Err(MemError::OutOfMemory);
        }
        small[dev] = after_bytes;
        Ok(())
    }

    fn uncharge_plain(&self, dev: usize, size: usize) {
        use crate::core::config::{GRANULARITY, SMALL_ALLOCATION_ALIGN, SMALL_ALLOCATION_LIMIT};
        if size >= SMALL_ALLOCATION_LIMIT {
            self.node.uncharge(dev, round_up(size, GRANULARITY) as u64);
            return;
        }
        let mut small = self.small_bytes.lock().unwrap_or_else(|e| e.into_inner());
        let before = round_up(small[dev], GRANULARITY);
        small[dev] = small[dev].saturating_sub(round_up(size, SMALL_ALLOCATION_ALIGN));
        self.node.uncharge(dev, (before - round_up(small[dev], GRANULARITY)) as u64);
    }

    pub fn mem_info(&self, dev: usize) -> (u64, u64) {
        let cap = self.node.capacity();
        (cap.saturating_sub(self.node.used_now(dev)), cap)
    }

    pub fn plain_alloc(&self, dev: usize, size: usize) -> MemResult<usize> {
        let size = size.max(1);
        self.charge_plain(dev, size)?;
        self.write().plain_alloc(dev, size).inspect_err(|_| self.uncharge_plain(dev, size))
    }

    pub fn plain_free(&self, addr: usize) -> MemResult<()> {
        // Freeing waits for queued work, as the real runtimes do.
        self.streams.synchronize_all(None);
        let _no_view = crate::core::streams::VIEWS.close();
        let _no_copy = self.copying.write().unwrap_or_else(|e| e.into_inner());
        let (freed, requested, retained) = self.write().plain_free(addr)?;
        if !retained {
            self.give_back_host(&freed);
        }
        self.uncharge_plain(freed.device, requested);
        Ok(())
    }

    /// Physical memory of `len` bytes on `dev`; `prop` is kept with it (`Physical::prop`).
    pub fn create(&self, dev: usize, len: usize, prop: i32) -> MemResult<u64> {
        if len == 0 || !len.is_multiple_of(crate::core::config::GRANULARITY) {
            return Err(MemError::Invalid);
        }
        if !self.node.charge(dev, len as u64) {
            return Err(MemError::OutOfMemory);
        }
        let (h, work) = self.write().create(dev, len, prop).inspect_err(|_| self.node.uncharge(dev, len as u64))?;
        if let Some(w) = work {
            w.run();
        }
        Ok(h)
    }

    pub fn release(&self, h: u64, refuse_if_mapped: bool) -> MemResult<()> {
        let freed = self.write().release(h, refuse_if_mapped)?;
        self.give_back(freed);
        Ok(())
    }

    /// Closes an IPC import; like every call that takes memory away, it waits for the copy piece
    /// under way.
    pub fn ipc_close(&self, addr: usize) -> MemResult<()> {
        let _no_view = crate::core::streams::VIEWS.close();
        let _no_copy = self.copying.write().unwrap_or_else(|e| e.into_inner());
        self.write().ipc_close(addr)
    }

    pub fn reserve(&self, len: usize, align: usize, hint: usize) -> MemResult<usize> {
        self.write().reserve(len, align, hint)
    }

    pub fn free_reservation(&self, addr: usize, len: Option<usize>) -> MemResult<()> {
        self.write().free_reservation(addr, len)
    }

    pub fn map(&self, addr: usize, len: usize, offset: usize, h: u64, exact: bool) -> MemResult<()> {
        self.write().map(addr, len, offset, h, exact)
    }

    pub fn unmap(&self, addr: usize, len: Option<usize>) -> MemResult<()> {
        let _no_view = crate::core::streams::VIEWS.close();
        let no_copy = self.copying.write().unwrap_or_else(|e| e.into_inner());
        let freed = self.write().unmap(addr, len)?;
        drop(no_copy);
        self.give_back(freed);
        Ok(())
    }

    pub fn set_access(&self, addr: usize, len: usize, prot: libc::c_int) -> MemResult<()> {
        let revoking = prot != libc::PROT_READ | libc::PROT_WRITE;
        let _no_view = revoking.then(|| crate::core::streams::VIEWS.close());
        let no_copy = revoking.then(|| self.copying.write().unwrap_or_else(|e| e.into_inner()));
        let work = self.write().set_access(addr, len, prot)?;
        drop(no_copy);
        if let Some(w) = work {
            w.run();
        }
        Ok(())
    }

    /// Validates a copy and returns where its bytes are and the bus it travels on.
    fn plan_copy(&self, mem: &Memory, dst: usize, src: usize, n: usize, kind: CopyDirection) -> MemResult<CopyPlan> {
        if dst == 0 || src == 0 {
            return Err(MemError::Invalid);
        }
        let d = mem.device_range(dst, n, true)?;
        let s = mem.device_range(src, n, false)?;
        let ok = match kind {
            CopyDirection::HostToHost => d.is_none() && s.is_none(),
            CopyDirection::HostToDevice => d.is_some() && s.is_none(),
            CopyDirection::DeviceToHost => d.is_none() && s.is_some(),
            CopyDirection::DeviceToDevice => d.is_some() && s.is_some(),
            CopyDirection::Inferred => true,
        };
        if !ok {
            return Err(MemError::Invalid);
        }
        Ok(CopyPlan {
            dst: d.map_or(dst, |b| b.mirror),
            src: s.map_or(src, |b| b.mirror),
            dst_on_device: d.is_some(),
            src_on_device: s.is_some(),
            bus: match (d, s) {
                (Some(b), None) => Some((b.device, TO_DEVICE)),
                (None, Some(b)) => Some((b.device, TO_HOST)),
                _ => None,
            },
        })
    }

    pub fn copy_now(&self, dst: usize, src: usize, n: usize, kind: CopyDirection) -> MemResult<()> {
        self.copy_unchecked(dst, src, n, kind).inspect_err(|e| self.on_fault(*e, &[dst, src]))
    }

    /// A device that meets an illegal address while moving bytes kills its context (sticky),
    /// where the API's faults are sticky at all (`context::faults_sticky`).
    fn on_fault(&self, e: MemError, addrs: &[usize]) {
        if e != MemError::IllegalAddress || !crate::core::context::faults_sticky() {
            return;
        }
        let mem = self.read();
        for &a in addrs {
            if let Some(dev) = mem.device_of(a) {
                record_fault(dev);
            }
        }
    }

    fn copy_unchecked(&self, dst: usize, src: usize, n: usize, kind: CopyDirection) -> MemResult<()> {
        if n == 0 {
            return Ok(());
        }
        let bus = self.plan_copy(&self.read(), dst, src, n, kind)?.bus;
        // Each piece re-checks its ranges while holding off anything that takes memory away: a
        // copy never touches memory unmapped after it was queued, and memory unmapped while it
        // is under way faults the rest of it (700), as on a device.
        let piece = |offset: usize, len: usize| {
            let _copying = self.copying.read().unwrap_or_else(|e| e.into_inner());
            let plan = self.plan_copy(&self.read(), dst + offset, src + offset, len, kind)?;
            // SAFETY: both ranges were validated: device bytes are in their mirror, mapped and
            // with access; host ranges are the caller's responsibility as with the real runtime.
            unsafe { std::ptr::copy(plan.src as *const u8, plan.dst as *mut u8, len) };
            if plan.dst_on_device {
                self.leave_view(plan.dst, len);
            }
            if plan.src_on_device {
                self.leave_view(plan.src, len);
            }
            Ok(())
        };
        match bus {
            Some((dev, dir)) => timing::on_bus(self.node.state(), self.cfg.copy_bytes_per_sec, dev, dir, n, piece),
            None => piece(0, n),
        }
    }

    /// The physical memory behind a device range (`Memory::physical_pieces`).
    pub fn physical_pieces(&self, addr: usize, len: usize) -> Vec<(usize, u64)> {
        self.read().physical_pieces(addr, len)
    }

    /// A copy run in the caller (the default stream: the synchronous APIs, and asynchronous ones that
    /// `copy_async` does not queue), or queued on a created stream. Errors found before queuing
    /// are returned at once; errors while running are reported by the stream's next synchronize.
    pub fn copy(
        &'static self,
        dst: usize,
        src: usize,
        n: usize,
        kind: CopyDirection,
        stream: StreamId,
        async_code: fn(MemError) -> i32,
    ) -> Result<(), i32> {
        if stream.is_default() {
            self.streams.settle_for(stream);
            return self.copy_now(dst, src, n, kind).map_err(async_code);
        }
        if !self.streams.exists(stream) {
            return Err(async_code(MemError::Invalid));
        }
        self.plan_copy(&self.read(), dst, src, n, kind).map_err(async_code)?;
        if self.graphs.record(stream, || crate::core::graphs::Node::Copy { dst, src, n, kind }) {
            return Ok(());
        }
        let job = self.copy_job(dst, src, n, kind, async_code);
        match self.streams.submit(stream, job) {
            Ok(code) => {
                if code == 0 {
                    Ok(())
                } else {
                    Err(code)
                }
            }
            Err(_) => Err(async_code(MemError::Invalid)),
        }
    }

    /// What a copy function `name` returns for the copy it queued or made (`copied`): the API's
    /// code, and when a `corrupt` fault rule hits this call, one byte of its destination flipped
    /// once the bytes have landed (after the copy on its stream), as a bad restore would leave it.
    pub fn finish_copy(
        &'static self,
        name: &str,
        copied: Result<(), i32>,
        dst: usize,
        n: usize,
        stream: StreamId,
    ) -> i32 {
        if let Err(code) = copied {
            return code;
        }
        if n == 0 || !crate::core::fault::corrupts(name) {
            return 0;
        }
        let at = dst + n / 2;
        let flip = move || {
            let mut byte = [0u8; 1];
            if self.copy_now(byte.as_mut_ptr() as usize, at, 1, CopyDirection::Inferred).is_ok() {
                byte[0] ^= 0x5a;
                let _ = self.copy_now(at, byte.as_ptr() as usize, 1, CopyDirection::Inferred);
            }
            0
        };
        if stream.is_default() {
            // The copy itself may be queued on the legacy stream: flip after it has landed.
            self.streams.settle_for(stream);
            flip();
        } else {
            let _ = self.streams.submit(stream, Box::new(flip));
        }
        0
    }

    /// The copy as a stream's job: its error becomes the API's code, reported by the stream.
    fn copy_job(
        &'static self,
        dst: usize,
        src: usize,
        n: usize,
        kind: CopyDirection,
        async_code: fn(MemError) -> i32,
    ) -> crate::core::streams::Job {
        Box::new(move || match self.copy_now(dst, src, n, kind) {
            Ok(()) => 0,
            Err(e) => async_code(e),
        })
    }

    /// An asynchronous copy (`cudaMemcpyAsync`, `cuMemcpy*Async`). On the legacy default stream
    /// it is queued there, returning before its bytes land, when it involves no pageable host
    /// memory: device to device, or between device and page-locked host memory. The others keep
    /// what CUDA documents for them ("API synchronization behavior"): from pageable memory the
    /// call returns once the source may be reused, to pageable memory once the copy completed,
    /// host to host fully synchronously; the simulator runs them in the caller after the
    /// stream's queued work, which satisfies all three. `device`: whose default stream `stream`
    /// names when it is the default stream (the thread's device, as its API defines it).
    pub fn copy_async(
        &'static self,
        dst: usize,
        src: usize,
        n: usize,
        kind: CopyDirection,
        stream: StreamId,
        device: usize,
        async_code: fn(MemError) -> i32,
    ) -> Result<(), i32> {
        if !stream.is_default() || !self.queues_on_device(dst, src, n, kind) {
            return self.copy(dst, src, n, kind, stream, async_code);
        }
        let job = self.copy_job(dst, src, n, kind, async_code);
        self.streams.submit_async(stream, device, job).map(|_| ()).map_err(|_| async_code(MemError::Invalid))
    }

    /// Whether a valid copy touches only device and page-locked host memory, with at least one
    /// side on a device (what a copy engine runs without the host). An invalid one is not: the
    /// synchronous path reports its error at once, as before.
    fn queues_on_device(&self, dst: usize, src: usize, n: usize, kind: CopyDirection) -> bool {
        if n == 0 {
            return false;
        }
        let Ok(plan) = self.plan_copy(&self.read(), dst, src, n, kind) else { return false };
        match (plan.dst_on_device, plan.src_on_device) {
            (true, true) => true,
            (true, false) => self.page_locked(src, n),
            (false, true) => self.page_locked(dst, n),
            (false, false) => false,
        }
    }

    /// Whether `[p, p + n)` lies in one page-locked range (allocated or registered).
    fn page_locked(&self, p: usize, n: usize) -> bool {
        let ranges = self.host_ranges();
        ranges
            .range(..=p)
            .next_back()
            .is_some_and(|(&start, r)| p.checked_add(n).is_some_and(|end| end <= start + r.len))
    }

    /// An asynchronous memset (`cudaMemsetAsync`) on the legacy default stream: queued there, as
    /// on a GPU, on `device`'s queue. A pointer that is not device memory is refused at once (1); a
    /// range unmapped by the time it runs faults then (700 at the next synchronize, sticky).
    pub fn memset_on_default(
        &'static self,
        dst: usize,
        value: u8,
        n: usize,
        stream: StreamId,
        device: usize,
        async_code: fn(MemError) -> i32,
    ) -> Result<(), i32> {
        if dst == 0 || self.read().device_of(dst).is_none() {
            return Err(async_code(MemError::Invalid));
        }
        let job = Box::new(move || match self.memset(dst, value, n) {
            Ok(()) => 0,
            Err(e) => async_code(e),
        });
        self.streams.submit_async(stream, device, job).map(|_| ()).map_err(|_| async_code(MemError::Invalid))
    }

    /// A kernel reading device memory (a collective's send buffer): the range must be device
    /// memory mapped with access when it runs; otherwise it faults as a kernel does (sticky on
    /// the CUDA side).
    pub fn kernel_read(&self, src: usize, out: &mut [u8]) -> MemResult<()> {
        self.kernel_access(src, out.len(), false, |view| {
            // SAFETY: the view covers `out.len()` validated bytes of the mirror.
            unsafe { std::ptr::copy_nonoverlapping(view as *const u8, out.as_mut_ptr(), out.len()) }
        })
    }

    /// A kernel writing device memory (a collective's receive buffer); see `kernel_read`.
    pub fn kernel_write(&self, dst: usize, data: &[u8]) -> MemResult<()> {
        self.kernel_access(dst, data.len(), true, |view| {
            // SAFETY: the view covers `data.len()` validated bytes of the mirror, mapped writable.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), view as *mut u8, data.len()) }
        })
    }

    fn kernel_access(&self, addr: usize, len: usize, write: bool, f: impl FnOnce(usize)) -> MemResult<()> {
        if len == 0 {
            return Ok(());
        }
        let _copying = self.copying.read().unwrap_or_else(|e| e.into_inner());
        let found = self.read().device_range(addr, len, write);
        match found {
            Ok(Some(b)) => {
                f(b.mirror);
                self.leave_view(b.mirror, len);
                Ok(())
            }
            // Host memory a device kernel cannot reach.
            Ok(None) => Err(MemError::IllegalAddress),
            Err(e) => {
                drop(_copying);
                self.on_fault(e, &[addr]);
                Err(e)
            }
        }
    }

    /// A simulated kernel's write: like a copy, it holds off whatever takes memory away while it
    /// writes, and the range must be mapped with write access when it runs.
    pub fn kernel_fill(&self, dst: usize, value: u8, n: usize) -> MemResult<()> {
        let _running = self.copying.read().unwrap_or_else(|e| e.into_inner());
        self.memset(dst, value, n)
    }

    pub fn memset(&self, dst: usize, value: u8, n: usize) -> MemResult<()> {
        self.memset_unchecked(dst, value, n).inspect_err(|e| self.on_fault(*e, &[dst]))
    }

    fn memset_unchecked(&self, dst: usize, value: u8, n: usize) -> MemResult<()> {
        if dst == 0 {
            return Err(MemError::Invalid);
        }
        if n == 0 {
            return Ok(());
        }
        let mem = self.read();
        let Some(bytes) = mem.device_range(dst, n, true)? else {
            return Err(MemError::Invalid);
        };
        // SAFETY: validated as device memory mapped with write access; its bytes are in the mirror.
        unsafe { std::ptr::write_bytes(bytes.mirror as *mut u8, value, n) };
        self.leave_view(bytes.mirror, n);
        Ok(())
    }

    /// After the simulator (or the CPU layer) has touched device bytes through their mirror: the
    /// pages leave the process's resident set unless `TMS_SIM_DEVICE_IN_RSS` keeps them.
    fn leave_view(&self, view: usize, len: usize) {
        if !self.cfg.device_in_rss {
            crate::core::memory::forget_mirror_pages(view, len);
        }
    }

    pub fn host_alloc(&self, size: usize, flags: u32) -> MemResult<usize> {
        let len = round_up(size.max(1), page_size());
        // SAFETY: a fresh anonymous mapping, populated up front the way pinning faults pages in.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MemError::OutOfMemory);
        }
        timing::pin_cost(self.cfg.pin_bytes_per_sec, len);
        self.host_ranges().insert(p as usize, HostRange { len, registered: false, flags });
        self.pinned_bytes.fetch_add(len as u64, Ordering::Relaxed);
        Ok(p as usize)
    }

    fn host_ranges(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, HostRange>> {
        self.host.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Frees page-locked memory the simulator allocated (not a registered range).
    pub fn host_free(&self, p: usize) -> MemResult<()> {
        // Freeing page-locked memory waits for the device's queued work, as the real runtime
        // does: a copy still reading the buffer completes first.
        self.streams.drain_all();
        let mut ranges = self.host_ranges();
        let len = match ranges.get(&p) {
            Some(r) if !r.registered => r.len,
            _ => return Err(MemError::Invalid),
        };
        ranges.remove(&p);
        drop(ranges);
        // SAFETY: unmapping a host allocation we made.
        unsafe { libc::munmap(p as *mut libc::c_void, len) };
        self.pinned_bytes.fetch_sub(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Page-locks a caller's range (cudaHostRegister). `Ok(false)`: it overlaps a range that is
    /// already page-locked.
    pub fn host_register(&self, p: usize, len: usize, flags: u32) -> MemResult<bool> {
        if p == 0 || len == 0 {
            return Err(MemError::Invalid);
        }
        if self.read().device_range(p, len, false)?.is_some() {
            return Err(MemError::Invalid);
        }
        let mut ranges = self.host_ranges();
        let overlaps = ranges.range(..p + len).next_back().is_some_and(|(&start, r)| start + r.len > p);
        if overlaps {
            return Ok(false);
        }
        ranges.insert(p, HostRange { len, registered: true, flags });
        Ok(true)
    }

    /// Undoes `host_register`; false if `p` does not start a registered range.
    pub fn host_unregister(&self, p: usize) -> bool {
        let mut ranges = self.host_ranges();
        if ranges.get(&p).is_some_and(|r| r.registered) {
            ranges.remove(&p);
            true
        } else {
            false
        }
    }

    /// The page-locked range holding `p`, as (start, flags).
    pub fn host_lookup(&self, p: usize) -> Option<(usize, u32)> {
        let ranges = self.host_ranges();
        let (&start, r) = ranges.range(..=p).next_back()?;
        (p < start + r.len).then_some((start, r.flags))
    }

    pub fn in_plain(&self, addr: usize) -> bool {
        self.read().in_plain(addr)
    }

    /// Where the bytes of device range `[addr, addr+len)` can be read and written by the host,
    /// if it is device memory mapped with read and write access (see `tms_sim_host_view`).
    pub fn host_view(&self, addr: usize, len: usize) -> Option<usize> {
        // Write access implies read access on both front ends (read/write is the only other grant).
        self.read().device_range(addr, len, true).ok().flatten().map(|b| b.mirror)
    }

    /// The end of a host view's use (`tms_sim_host_view_end`): the bytes of device range
    /// `[addr, addr+len)` leave the process's resident set. False if the range is not device
    /// memory mapped with access (nothing to do).
    pub fn host_view_end(&self, addr: usize, len: usize) -> bool {
        let mem = self.read();
        match mem.device_range(addr, len, false) {
            Ok(Some(b)) => {
                self.leave_view(b.mirror, len);
                true
            }
            _ => false,
        }
    }

    /// The creation property of the physical memory mapped at `addr` (virtual-memory
    /// allocations only).
    pub fn prop_at(&self, addr: usize) -> Option<i32> {
        self.read().prop_at(addr)
    }

    /// What an address is, as `cudaPointerGetAttributes` reports it.
    pub fn classify(&self, p: usize) -> PointerKind {
        if let Some(device) = self.read().device_of(p) {
            return PointerKind::Device(device);
        }
        match self.host_lookup(p) {
            Some(_) => PointerKind::PinnedHost,
            None => PointerKind::Unregistered,
        }
    }

    pub fn synchronize(&self, device: Option<usize>) -> i32 {
        self.streams.synchronize_all(device)
    }
}
