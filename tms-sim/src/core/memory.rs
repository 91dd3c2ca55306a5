//! Device memory emulated on host memory, with the virtual-memory semantics the hook rests on.
//!
//! - Physical memory is a range of one pooled memfd per process (one file descriptor however many
//!   handles are alive); releasing it punches a hole, so the host really gets the pages back.
//! - Device memory is not host memory: every device address range (a reservation, a plain
//!   allocation, an IPC import) is a `PROT_NONE` mapping the process cannot touch, so a stray host
//!   dereference faults as it would on a GPU. Its bytes live in a *mirror*: a second range of the
//!   same length where the memfd is mapped read/write, which only the simulator's copies (and
//!   `tms_sim_host_view`, for the CPU compute layer) use. Mirror address = device address - start
//!   + mirror start, so memory that is contiguous on the device is contiguous in the mirror.
//! - Mapping a handle into a reservation maps its memfd range into the reservation's mirror;
//!   unmapping puts `PROT_NONE` back there, so the address range stays reserved and can be mapped
//!   again at the same address.
//! - Access is granted separately (`set_access`), as on a GPU: a copy into mapped memory without
//!   access is an illegal address.

use crate::core::config::GRANULARITY;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The host's page size, read once: mappings of the device pool start at multiples of it, so
/// every pool range and plain allocation is a whole number of pages. Kunpeng (aarch64) kernels
/// often run 64 KiB pages, where a 4 KiB-aligned file offset makes `mmap` fail with EINVAL
/// (mmap(2): "offset must be a multiple of the page size as returned by sysconf(_SC_PAGE_SIZE)").
pub fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if n > 0 && (n as usize).is_power_of_two() { n as usize } else { 4096 }
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemError {
    /// Bad argument: unknown pointer or handle, wrong size, overlapping or partial ranges.
    Invalid,
    /// The device is full.
    OutOfMemory,
    /// The address lies in a reservation but is not mapped with access (a device fault).
    IllegalAddress,
    /// A host resource ran out (mmap failed).
    Host,
}

pub type MemResult<T> = Result<T, MemError>;

struct Pool {
    fd: libc::c_int,
    file_len: u64,
    bump: u64,
    /// Free ranges by offset (for coalescing) and by (length, offset) (for best fit).
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

impl Pool {
    fn new() -> MemResult<Pool> {
        // SAFETY: memfd_create with a static NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"tms-sim-device".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(MemError::Host);
        }
        Ok(Pool { fd, file_len: 0, bump: 0, by_offset: BTreeMap::new(), by_size: BTreeSet::new() })
    }

    fn alloc(&mut self, len: u64) -> MemResult<u64> {
        if let Some(&(flen, off)) = self.by_size.range((len, 0)..).next() {
            self.by_size.remove(&(flen, off));
            self.by_offset.remove(&off);
            if flen > len {
                self.insert_free(off + len, flen - len);
            }
            return Ok(off);
        }
        let off = self.bump;
        let end = off.checked_add(len).ok_or(MemError::Host)?;
        if end > self.file_len {
            // Grow in large steps: the file is sparse, so length costs nothing until touched.
            let new_len = end.max(self.file_len.saturating_mul(2)).max(1 << 30);
            // SAFETY: ftruncate on our own memfd.
            if unsafe { libc::ftruncate(self.fd, new_len as libc::off_t) } != 0 {
                return Err(MemError::Host);
            }
            self.file_len = new_len;
        }
        self.bump = end;
        Ok(off)
    }

    fn free(&mut self, off: u64, len: u64) {
        punch(self.fd, off, len);
        self.recycle(off, len);
    }

    /// Puts a range whose pages were already given back onto the free lists.
    fn recycle(&mut self, off: u64, len: u64) {
        let (mut off, mut len) = (off, len);
        if let Some((&poff, &plen)) = self.by_offset.range(..off).next_back()
            && poff + plen == off
        {
            self.by_offset.remove(&poff);
            self.by_size.remove(&(plen, poff));
            off = poff;
            len += plen;
        }
        if let Some(&nlen) = self.by_offset.get(&(off + len)) {
            self.by_offset.remove(&(off + len));
            self.by_size.remove(&(nlen, off + len));
            len += nlen;
        }
        if off + len == self.bump {
            self.bump = off;
        } else {
            self.insert_free(off, len);
        }
    }

    fn insert_free(&mut self, off: u64, len: u64) {
        self.by_offset.insert(off, len);
        self.by_size.insert((len, off));
    }

    /// Bytes of host memory the pool really holds (allocated blocks of the memfd).
    fn resident_bytes(&self) -> u64 {
        // SAFETY: fstat on our own fd into a zeroed struct.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(self.fd, &mut st) != 0 {
                return 0;
            }
            st.st_blocks as u64 * 512
        }
    }
}

/// Returns the pages of a memfd range to the host.
fn punch(fd: libc::c_int, off: u64, len: u64) {
    // SAFETY: punching a hole in our own memfd.
    unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            len as libc::off_t,
        );
    }
}

/// Drops the process's page-table entries for the mirror bytes `[view, view + len)`, so that
/// device memory stops counting in the process's resident set (VmRSS), as it would on a GPU: the
/// bytes stay in the device pool's memfd (machine-wide Shmem), and the next access faults the
/// pages back in. `view` must lie in a mirror: every mirror page is either a shared mapping of a
/// device pool, where MADV_DONTNEED only unmaps, or reserved `PROT_NONE`, where it does nothing.
/// Never pass private memory: there it would zero the bytes.
pub fn forget_mirror_pages(view: usize, len: usize) {
    if len == 0 {
        return;
    }
    // Mirrors start and end on page boundaries, so widening to whole pages stays inside one.
    let page = page_size();
    let start = view & !(page - 1);
    let end = round_up(view + len, page);
    // SAFETY: advice on a mirror range (see above); it changes no byte of device memory.
    unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
}

/// Host page work that the simulator does outside its memory lock, so that copies on other
/// streams go on meanwhile (a device does not stall its copy engines to create or free memory).
#[derive(Debug, Clone, Copy)]
pub enum PageWork {
    /// Allocate the pages of a new handle (TMS_SIM_COMMIT).
    Commit { fd: libc::c_int, offset: u64, len: u64 },
    /// Build the page tables of a range just made accessible (TMS_SIM_COMMIT).
    Populate { addr: usize, len: usize },
}

impl PageWork {
    pub fn run(self) {
        match self {
            // SAFETY: allocating blocks of a memfd range owned by a handle nobody else knows yet.
            PageWork::Commit { fd, offset, len } => unsafe {
                libc::fallocate(fd, 0, offset as libc::off_t, len as libc::off_t);
            },
            PageWork::Populate { addr, len } => {
                // MADV_POPULATE_WRITE (Linux 5.14+; older kernels just skip it). If the range was
                // unmapped meanwhile, the advice fails harmlessly.
                const MADV_POPULATE_WRITE: libc::c_int = 23;
                // SAFETY: advice only; no memory is touched through Rust.
                unsafe { libc::madvise(addr as *mut libc::c_void, len, MADV_POPULATE_WRITE) };
            }
        }
    }
}

#[derive(Debug)]
pub struct Physical {
    pub device: usize,
    offset: u64,
    pub len: usize,
    /// Mappings of this handle that are still in place.
    mapped: u32,
    /// The owner released the handle; the memory goes when the last mapping does.
    released: bool,
    /// What the creating call asked for beyond the size: CUDA's `gpuDirectRDMACapable` flag,
    /// Ascend's `aclrtMemAttr`.
    pub prop: i32,
}

#[derive(Debug, Clone, Copy)]
struct Mapping {
    len: usize,
    handle: u64,
    prot: libc::c_int,
}

#[derive(Debug, Default)]
struct Reservation {
    len: usize,
    /// Where the reservation's mapped bytes are reachable by the simulator.
    mirror: usize,
    mappings: BTreeMap<usize, Mapping>,
}

#[derive(Debug, Clone, Copy)]
struct Plain {
    len: usize,
    /// The size asked for (what the device was charged for, see `Sim::charge_plain`).
    requested: usize,
    device: usize,
    offset: u64,
    mirror: usize,
}

#[derive(Debug, Clone, Copy)]
struct Imported {
    len: usize,
    device: usize,
    mirror: usize,
}

/// Device memory as a copy sees it: the device it belongs to and where its bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBytes {
    pub device: usize,
    pub mirror: usize,
}

pub struct Memory {
    pool: Pool,
    /// The host page size every plain allocation is rounded to (`page_size()`), so that each
    /// pool range starts where a mapping of the memfd may start.
    page: usize,
    /// Commit pages at create (TMS_SIM_COMMIT).
    pub commit: bool,
    next_handle: u64,
    handles: HashMap<u64, Physical>,
    reservations: BTreeMap<usize, Reservation>,
    plain: BTreeMap<usize, Plain>,
    /// Other processes' plain allocations opened here through CUDA IPC, by device address.
    imported: BTreeMap<usize, Imported>,
    /// Pool offsets of plain allocations handed to other processes (`retain_for_importers`).
    exported: std::collections::HashSet<u64>,
}

/// What a freed or released range gives back to the device. Its memfd range is out of every
/// list until `Sim::give_back` has punched it and handed it to `Memory::recycle`.
pub struct Freed {
    pub device: usize,
    pub bytes: u64,
    pub offset: u64,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct MemCounts {
    pub handles: u64,
    pub mappings: u64,
    pub reservations: u64,
    pub plain: u64,
    pub resident: u64,
}

/// A fresh read/write shared view of `len` bytes at `offset` of a device pool (ours, or another
/// process's opened for IPC), at an address the kernel picks.
fn map_view(fd: libc::c_int, offset: u64, len: usize) -> Option<usize> {
    // SAFETY: a new mapping at no fixed address; it replaces nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            offset as libc::off_t,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as usize)
}

/// A fresh `PROT_NONE` range of `len` bytes (an address range nothing can touch), at `hint` if
/// the kernel agrees.
fn inaccessible_range(len: usize, hint: usize) -> Option<usize> {
    // SAFETY: a new anonymous mapping; with no MAP_FIXED the hint replaces nothing.
    let p = unsafe {
        libc::mmap(
            hint as *mut libc::c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as usize)
}

/// Unmaps a range this module mapped.
fn unmap_range(addr: usize, len: usize) {
    // SAFETY: callers pass only ranges they own and no longer reference.
    unsafe { libc::munmap(addr as *mut libc::c_void, len) };
}

/// Device addresses of a mirrored range: a `PROT_NONE` range of the same length as the mirror.
fn device_range_for(mirror: usize, len: usize) -> Option<usize> {
    let addr = inaccessible_range(len, 0);
    if addr.is_none() {
        unmap_range(mirror, len);
    }
    addr
}

pub fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

impl Memory {
    pub fn new() -> MemResult<Memory> {
        Memory::with_page(page_size())
    }

    fn with_page(page: usize) -> MemResult<Memory> {
        Ok(Memory {
            pool: Pool::new()?,
            page,
            commit: false,
            next_handle: 0x7e57_0000_0001,
            handles: HashMap::new(),
            reservations: BTreeMap::new(),
            plain: BTreeMap::new(),
            imported: BTreeMap::new(),
            exported: std::collections::HashSet::new(),
        })
    }

    pub fn counts(&self) -> MemCounts {
        MemCounts {
            handles: self.handles.len() as u64,
            mappings: self.reservations.values().map(|r| r.mappings.len() as u64).sum(),
            reservations: self.reservations.len() as u64,
            plain: self.plain.len() as u64,
            resident: self.pool.resident_bytes(),
        }
    }

    // ---- physical handles -------------------------------------------------------------------

    /// Creates physical memory; the caller has already charged the device, and runs the page
    /// work (if any) once it has let go of the lock.
    pub fn create(&mut self, device: usize, len: usize, prop: i32) -> MemResult<(u64, Option<PageWork>)> {
        if len == 0 || !len.is_multiple_of(GRANULARITY) {
            return Err(MemError::Invalid);
        }
        let offset = self.pool.alloc(len as u64)?;
        let h = self.next_handle;
        self.next_handle += 1;
        self.handles.insert(h, Physical { device, offset, len, mapped: 0, released: false, prop });
        let work = self.commit.then_some(PageWork::Commit { fd: self.pool.fd, offset, len: len as u64 });
        Ok((h, work))
    }

    /// Releases a handle. `refuse_if_mapped` gives Ascend's rule (free fails while mapped);
    /// otherwise CUDA's (the memory goes once the last mapping does).
    pub fn release(&mut self, h: u64, refuse_if_mapped: bool) -> MemResult<Option<Freed>> {
        let p = self.handles.get_mut(&h).ok_or(MemError::Invalid)?;
        if p.released {
            return Err(MemError::Invalid);
        }
        if p.mapped > 0 {
            if refuse_if_mapped {
                return Err(MemError::Invalid);
            }
            p.released = true;
            return Ok(None);
        }
        Ok(Some(self.destroy_handle(h)))
    }

    fn destroy_handle(&mut self, h: u64) -> Freed {
        let p = self.handles.remove(&h).expect("handle present");
        Freed { device: p.device, bytes: p.len as u64, offset: p.offset }
    }

    /// Gives a freed range's pages back to the host; needs no lock (the range belongs to nobody).
    pub fn punch_freed(fd: libc::c_int, f: &Freed) {
        punch(fd, f.offset, f.bytes);
    }

    pub fn pool_fd(&self) -> libc::c_int {
        self.pool.fd
    }

    /// Makes a punched range available to new allocations.
    pub fn recycle(&mut self, f: &Freed) {
        self.pool.recycle(f.offset, f.bytes);
    }

    pub fn handle_len(&self, h: u64) -> Option<usize> {
        self.handles.get(&h).filter(|p| !p.released).map(|p| p.len)
    }

    // ---- reservations -----------------------------------------------------------------------

    pub fn reserve(&mut self, len: usize, align: usize, hint: usize) -> MemResult<usize> {
        if len == 0 || !len.is_multiple_of(GRANULARITY) {
            return Err(MemError::Invalid);
        }
        let align = align.max(GRANULARITY);
        if !align.is_power_of_two() {
            return Err(MemError::Invalid);
        }
        let total = len.checked_add(align).ok_or(MemError::Invalid)?;
        // The reservation first, so that the mirror never takes the caller's hinted address.
        let base = inaccessible_range(total, hint).ok_or(MemError::Host)?;
        let Some(mirror) = inaccessible_range(len, 0) else {
            unmap_range(base, total);
            return Err(MemError::Host);
        };
        let start = round_up(base, align);
        // SAFETY: trimming the unaligned head and the tail of our own mapping.
        unsafe {
            if start > base {
                libc::munmap(base as *mut libc::c_void, start - base);
            }
            let tail = base + total - (start + len);
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        self.reservations.insert(start, Reservation { len, mirror, mappings: BTreeMap::new() });
        Ok(start)
    }

    /// Frees a reservation, which must have no mapping left.
    pub fn free_reservation(&mut self, addr: usize, len: Option<usize>) -> MemResult<()> {
        let r = self.reservations.get(&addr).ok_or(MemError::Invalid)?;
        if len.is_some_and(|l| l != r.len) || !r.mappings.is_empty() {
            return Err(MemError::Invalid);
        }
        let r = self.reservations.remove(&addr).expect("present");
        unmap_range(addr, r.len);
        unmap_range(r.mirror, r.len);
        Ok(())
    }

    fn reservation_containing(&self, addr: usize, len: usize) -> Option<usize> {
        let (&start, r) = self.reservations.range(..=addr).next_back()?;
        (addr.checked_add(len)? <= start + r.len).then_some(start)
    }

    /// Maps a whole handle at `addr`, inside a reservation, without access.
    pub fn map(&mut self, addr: usize, len: usize, offset: usize, h: u64, exact_len: bool) -> MemResult<()> {
        if offset != 0 || len == 0 || !len.is_multiple_of(GRANULARITY) || !addr.is_multiple_of(GRANULARITY) {
            return Err(MemError::Invalid);
        }
        let hlen = self.handle_len(h).ok_or(MemError::Invalid)?;
        if len > hlen || (exact_len && len != hlen) {
            return Err(MemError::Invalid);
        }
        let rstart = self.reservation_containing(addr, len).ok_or(MemError::Invalid)?;
        let r = &self.reservations[&rstart];
        let overlaps_prev = r.mappings.range(..addr).next_back().is_some_and(|(&a, m)| a + m.len > addr);
        let overlaps_next = r.mappings.range(addr..addr + len).next().is_some();
        if overlaps_prev || overlaps_next {
            return Err(MemError::Invalid);
        }
        let p = &self.handles[&h];
        let mirror = r.mirror + (addr - rstart);
        // SAFETY: the range lies inside our reservation's mirror and overlaps no mapping, so
        // MAP_FIXED replaces only PROT_NONE reserved pages.
        let got = unsafe {
            libc::mmap(
                mirror as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.pool.fd,
                p.offset as libc::off_t,
            )
        };
        if got == libc::MAP_FAILED {
            return Err(MemError::Host);
        }
        self.handles.get_mut(&h).expect("present").mapped += 1;
        self.reservations
            .get_mut(&rstart)
            .expect("present")
            .mappings
            .insert(addr, Mapping { len, handle: h, prot: libc::PROT_NONE });
        Ok(())
    }

    /// Unmaps whole mappings covering exactly `[addr, addr+len)` (`len` None: the one mapping
    /// starting at `addr`, Ascend's form). Returns memory freed by handles already released.
    pub fn unmap(&mut self, addr: usize, len: Option<usize>) -> MemResult<Vec<Freed>> {
        let probe = len.unwrap_or(1);
        let rstart = self.reservation_containing(addr, probe).ok_or(MemError::Invalid)?;
        let r = self.reservations.get(&rstart).expect("present");
        let first = r.mappings.get(&addr).ok_or(MemError::Invalid)?;
        let want = len.unwrap_or(first.len);
        // Collect consecutive mappings that cover the range exactly.
        let mut covered = 0usize;
        let mut victims = Vec::new();
        while covered < want {
            let m = r.mappings.get(&(addr + covered)).ok_or(MemError::Invalid)?;
            victims.push((addr + covered, *m));
            covered += m.len;
        }
        if covered != want {
            return Err(MemError::Invalid);
        }
        let mirror_base = r.mirror;
        let mut freed = Vec::new();
        for (a, m) in victims {
            // SAFETY: turning our own mapping in the mirror back into reserved PROT_NONE pages.
            let got = unsafe {
                libc::mmap(
                    (mirror_base + (a - rstart)) as *mut libc::c_void,
                    m.len,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if got == libc::MAP_FAILED {
                return Err(MemError::Host);
            }
            self.reservations.get_mut(&rstart).expect("present").mappings.remove(&a);
            let p = self.handles.get_mut(&m.handle).expect("mapped handle exists");
            p.mapped -= 1;
            if p.mapped == 0 && p.released {
                freed.push(self.destroy_handle(m.handle));
            }
        }
        Ok(freed)
    }

    /// Sets protection on mapped memory; the range must be fully mapped. Returns page work to run
    /// outside the lock.
    pub fn set_access(&mut self, addr: usize, len: usize, prot: libc::c_int) -> MemResult<Option<PageWork>> {
        // Access is granted per granule: an unaligned range is a bad argument, as cuMemSetAccess
        // and aclrtMemSetAccess document for ranges that are not whole mappings.
        if len == 0 || !addr.is_multiple_of(GRANULARITY) || !len.is_multiple_of(GRANULARITY) {
            return Err(MemError::Invalid);
        }
        let rstart = self.reservation_containing(addr, len).ok_or(MemError::Invalid)?;
        let r = self.reservations.get_mut(&rstart).expect("present");
        let (&mstart, _) = r.mappings.range(..=addr).next_back().ok_or(MemError::Invalid)?;
        let mut cursor = mstart;
        let mut touched = Vec::new();
        while cursor < addr + len {
            let m = r.mappings.get(&cursor).ok_or(MemError::Invalid)?;
            touched.push(cursor);
            cursor += m.len;
        }
        for a in touched {
            r.mappings.get_mut(&a).expect("present").prot = prot;
        }
        // Establish the page tables now, as a device's map does; otherwise the first copy into
        // the range would pay the host's page faults.
        let mirror = r.mirror + (addr - rstart);
        Ok((self.commit && prot != libc::PROT_NONE).then_some(PageWork::Populate { addr: mirror, len }))
    }

    // ---- plain allocations ------------------------------------------------------------------

    /// A plain allocation of `requested` bytes (at least one whole host page).
    pub fn plain_alloc(&mut self, device: usize, requested: usize) -> MemResult<usize> {
        let len = round_up(requested.max(1), self.page);
        let offset = self.pool.alloc(len as u64)?;
        if self.commit {
            PageWork::Commit { fd: self.pool.fd, offset, len: len as u64 }.run();
        }
        let Some(mirror) = map_view(self.pool.fd, offset, len) else {
            self.pool.free(offset, len as u64);
            return Err(MemError::Host);
        };
        let Some(addr) = device_range_for(mirror, len) else {
            self.pool.free(offset, len as u64);
            return Err(MemError::Host);
        };
        self.plain.insert(addr, Plain { len, requested, device, offset, mirror });
        Ok(addr)
    }

    /// Frees a plain allocation; returns its host range, the size it was asked with, and whether
    /// the range must stay as it is (`retain_for_importers`): then it is neither emptied nor
    /// handed out again.
    pub fn plain_free(&mut self, addr: usize) -> MemResult<(Freed, usize, bool)> {
        let p = self.plain.remove(&addr).ok_or(MemError::Invalid)?;
        unmap_range(addr, p.len);
        unmap_range(p.mirror, p.len);
        let retained = self.exported.remove(&p.offset);
        Ok((Freed { device: p.device, bytes: p.len as u64, offset: p.offset }, p.requested, retained))
    }

    /// Another process may map the pool range at `offset` (a CUDA IPC handle was made for it).
    /// An importer keeps the pages it opened until it closes its handle, whatever the exporter
    /// does meanwhile; the simulator cannot see other processes' closes, so once freed such a
    /// range keeps its bytes and is never reused for the rest of this process.
    pub fn retain_for_importers(&mut self, offset: u64) {
        self.exported.insert(offset);
    }

    // ---- CUDA IPC -----------------------------------------------------------------------------

    /// The plain allocation holding `addr`, as (start, len, device, pool offset) for an IPC
    /// handle. Memory made with the virtual-memory calls (reserved ranges) has none, as on a GPU.
    pub fn ipc_export(&self, addr: usize) -> MemResult<(usize, usize, usize, u64)> {
        let (&start, p) = self.plain.range(..=addr).next_back().ok_or(MemError::Invalid)?;
        if addr >= start + p.len {
            return Err(MemError::Invalid);
        }
        Ok((start, p.len, p.device, p.offset))
    }

    pub fn pool_fd_for_ipc(&self) -> libc::c_int {
        self.pool.fd
    }

    /// Maps `len` bytes at `offset` of another process's device pool (an fd opened from
    /// /proc/PID/fd), as device memory of `device`.
    pub fn ipc_import(&mut self, fd: libc::c_int, offset: u64, len: usize, device: usize) -> MemResult<usize> {
        let mirror = map_view(fd, offset, len).ok_or(MemError::Host)?;
        let addr = device_range_for(mirror, len).ok_or(MemError::Host)?;
        self.imported.insert(addr, Imported { len, device, mirror });
        Ok(addr)
    }

    pub fn ipc_close(&mut self, addr: usize) -> MemResult<()> {
        let i = self.imported.remove(&addr).ok_or(MemError::Invalid)?;
        unmap_range(addr, i.len);
        unmap_range(i.mirror, i.len);
        Ok(())
    }

    // ---- address classification -------------------------------------------------------------

    /// The device whose address space holds `addr` (a plain allocation, or a reservation: then
    /// the device of its mapping there, else of any of its mappings, else device 0), or None for
    /// host memory.
    pub fn device_of(&self, addr: usize) -> Option<usize> {
        if let Some((&start, p)) = self.plain.range(..=addr).next_back()
            && addr < start + p.len
        {
            return Some(p.device);
        }
        if let Some((&start, i)) = self.imported.range(..=addr).next_back()
            && addr < start + i.len
        {
            return Some(i.device);
        }
        let (&rstart, r) = self.reservations.range(..=addr).next_back()?;
        if addr >= rstart + r.len {
            return None;
        }
        let here = r.mappings.range(..=addr).next_back().filter(|(s, m)| addr < **s + m.len).map(|(_, m)| m);
        let any = here.or_else(|| r.mappings.values().next());
        Some(any.and_then(|m| self.handles.get(&m.handle)).map_or(0, |h| h.device))
    }

    /// The physical memory behind `[addr, addr+len)`, as (address, identity) for each piece: a
    /// virtual-memory mapping names its handle (never reused), a plain allocation its place in
    /// the pool (with the top bit set, apart from handles). Unmapped parts have no piece. What a
    /// registration pins: the same address naming other physical memory later is another buffer.
    pub fn physical_pieces(&self, addr: usize, len: usize) -> Vec<(usize, u64)> {
        let end = addr.saturating_add(len.max(1));
        if let Some((&start, p)) = self.plain.range(..=addr).next_back()
            && addr < start + p.len
        {
            return vec![(start, (1 << 63) | p.offset)];
        }
        let Some((&rstart, r)) = self.reservations.range(..=addr).next_back() else { return Vec::new() };
        if addr >= rstart + r.len {
            return Vec::new();
        }
        let first = r.mappings.range(..=addr).next_back().map_or(addr, |(s, _)| *s);
        r.mappings.range(first..end).filter(|(s, m)| **s + m.len > addr).map(|(s, m)| (*s, m.handle)).collect()
    }

    /// Whether `addr` lies in a plain (cudaMalloc/aclrtMalloc) allocation.
    pub fn in_plain(&self, addr: usize) -> bool {
        self.plain.range(..=addr).next_back().is_some_and(|(&start, p)| addr < start + p.len)
    }

    /// The creation property (`Physical::prop`) of the physical memory mapped at `addr`, if
    /// `addr` lies in a mapping of a reservation.
    pub fn prop_at(&self, addr: usize) -> Option<i32> {
        let (&rstart, r) = self.reservations.range(..=addr).next_back()?;
        if addr >= rstart + r.len {
            return None;
        }
        let (_, m) = r.mappings.range(..=addr).next_back().filter(|(s, m)| addr < **s + m.len)?;
        self.handles.get(&m.handle).map(|p| p.prop)
    }

    /// Whether `[addr, addr+len)` is device memory the device may read (and write, if asked),
    /// and where its bytes are. `Ok(None)`: not device memory at all (host memory).
    pub fn device_range(&self, addr: usize, len: usize, write: bool) -> MemResult<Option<DeviceBytes>> {
        let len = len.max(1);
        // A length that wraps the address space is a bad argument, whatever the address.
        let end = addr.checked_add(len).ok_or(MemError::Invalid)?;
        if let Some((&start, p)) = self.plain.range(..=addr).next_back()
            && addr < start + p.len
        {
            return if end <= start + p.len {
                Ok(Some(DeviceBytes { device: p.device, mirror: p.mirror + (addr - start) }))
            } else {
                Err(MemError::Invalid)
            };
        }
        if let Some((&start, i)) = self.imported.range(..=addr).next_back()
            && addr < start + i.len
        {
            return if end <= start + i.len {
                Ok(Some(DeviceBytes { device: i.device, mirror: i.mirror + (addr - start) }))
            } else {
                Err(MemError::Invalid)
            };
        }
        let Some((&rstart, r)) = self.reservations.range(..=addr).next_back() else {
            return Ok(None);
        };
        if addr >= rstart + r.len {
            return Ok(None);
        }
        if end > rstart + r.len {
            return Err(MemError::Invalid);
        }
        let need = if write { libc::PROT_WRITE } else { libc::PROT_READ };
        let mut cursor = addr;
        let mut device = None;
        while cursor < end {
            let (&mstart, m) = r.mappings.range(..=cursor).next_back().ok_or(MemError::IllegalAddress)?;
            if cursor >= mstart + m.len || m.prot & need == 0 {
                return Err(MemError::IllegalAddress);
            }
            device.get_or_insert(self.handles[&m.handle].device);
            cursor = mstart + m.len;
        }
        Ok(device.map(|device| DeviceBytes { device, mirror: r.mirror + (addr - rstart) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With 64 KiB pages (Kunpeng kernels), every plain allocation's range of the device pool
    /// must start on a 64 KiB boundary, or mapping it fails; the arithmetic follows the page size
    /// it is given, whatever this machine's is (64 KiB multiples map on 4 KiB kernels too).
    #[test]
    fn plain_allocations_start_on_page_boundaries_of_the_page_size_given() {
        for page in [4096, 16384, 65536] {
            let mut mem = Memory::with_page(page).unwrap();
            let mut live = Vec::new();
            for requested in [1, 256, 4097, page - 1, page + 1, 3 * page] {
                let addr = mem.plain_alloc(0, requested).unwrap();
                let p = &mem.plain[&addr];
                assert_eq!(p.offset % page as u64, 0, "page {page}, {requested} bytes: offset {}", p.offset);
                assert_eq!(p.len, round_up(requested, page));
                assert_eq!(p.requested, requested);
                live.push(addr);
            }
            // Freed ranges are reused at page boundaries too.
            mem.plain_free(live[1]).unwrap();
            let again = mem.plain_alloc(0, 100).unwrap();
            assert_eq!(mem.plain[&again].offset % page as u64, 0);
        }
    }
}
