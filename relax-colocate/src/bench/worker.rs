//! Measurements, each run in a child process (hooked or not, as the scenario needs) that prints
//! one JSON object on stdout. Every scenario goes through one vendor API, CUDA or ACL, chosen by
//! the parent; the hook intercepts the same calls a framework makes (cudaMalloc/cudaFree, or
//! aclrtMalloc/aclrtFree), and the bare virtual-memory sequences are that vendor's own.

use crate::runtime::{
    AccessDesc, Acl, AclBench, AclPhysicalMemProp, AllocationProp, CommonTms, Driver, Report, Runtime, Tms,
    acl_huge_prop, check, device_access, device_prop,
};
use crate::vendor::{self, ApiKind, Opened};
use serde_json::{Value, json};
use std::ffi::CString;
use std::time::Instant;

const MIB: usize = 1 << 20;
/// ACL_MEM_MALLOC_HUGE_FIRST: the policy torch_npu's caching allocator passes.
const ACL_HUGE_FIRST: i32 = 0;
const ACL_MEMCPY_HOST_TO_DEVICE: i32 = 1;
const ACL_MEMCPY_DEVICE_TO_HOST: i32 = 2;

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

enum Rt {
    Cuda(Runtime),
    Acl(Acl, AclBench),
}

struct Ctx {
    rt: Rt,
    tms: Option<Tms>,
}

impl Ctx {
    fn new(api: ApiKind) -> Result<Ctx, String> {
        let rt = match vendor::open(api, 0)? {
            Opened::Cuda(rt) => Rt::Cuda(rt),
            Opened::Acl(acl) => Rt::Acl(acl, AclBench::load()?),
        };
        Ok(Ctx { rt, tms: Tms::load().ok() })
    }

    fn tms(&self) -> Result<&Tms, String> {
        self.tms.as_ref().ok_or_else(|| "this scenario needs libtms_hook.so preloaded".to_string())
    }

    fn region(&self, tag: &str, backup: bool) -> Result<(), String> {
        let t = self.tms()?;
        let tag = CString::new(tag).map_err(|_| "a tag has no NUL".to_string())?;
        // SAFETY: tms API calls with valid arguments.
        unsafe {
            (t.set_tag)(tag.as_ptr());
            (t.set_region)(true);
            (t.set_backup)(backup);
        }
        Ok(())
    }

    fn no_region(&self) {
        if let Some(t) = &self.tms {
            // SAFETY: as above.
            unsafe { (t.set_region)(false) };
        }
    }

    fn malloc(&self, n: usize) -> Result<usize, String> {
        let mut p = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        match &self.rt {
            Rt::Cuda(rt) => check("cudaMalloc", unsafe { (rt.malloc)(&mut p, n) })?,
            Rt::Acl(acl, _) => check("aclrtMalloc", unsafe { (acl.malloc)(&mut p, n, ACL_HUGE_FIRST) })?,
        }
        Ok(p as usize)
    }

    fn free(&self, p: usize) -> Result<(), String> {
        // SAFETY: a pointer from malloc above.
        match &self.rt {
            Rt::Cuda(rt) => check("cudaFree", unsafe { (rt.free)(p as *mut _) }),
            Rt::Acl(acl, _) => check("aclrtFree", unsafe { (acl.free)(p as *mut _) }),
        }
    }

    fn memset(&self, p: usize, n: usize) -> Result<(), String> {
        // SAFETY: a mapped allocation of `n` bytes.
        match &self.rt {
            Rt::Cuda(rt) => check("cudaMemset", unsafe { (rt.memset)(p as *mut _, 0x5a, n) }),
            Rt::Acl(_, b) => check("aclrtMemset", unsafe { (b.memset)(p as *mut _, n, 0x5a, n) }),
        }
    }

    fn op(&self, pause: bool, tag: &str) -> Result<Report, String> {
        let t = self.tms()?;
        let tag = CString::new(tag).map_err(|_| "a tag has no NUL".to_string())?;
        let mut r = Report::default();
        // SAFETY: tms API with a valid report.
        let rc = unsafe { if pause { (t.pause)(tag.as_ptr(), &mut r) } else { (t.resume)(tag.as_ptr(), &mut r) } };
        check(if pause { "tms_pause_report" } else { "tms_resume_report" }, rc)?;
        Ok(r)
    }

    /// The vendor's bare virtual-memory calls, for the sequences a region allocation performs.
    fn bare(&self) -> Result<Bare<'_>, String> {
        match &self.rt {
            Rt::Cuda(_) => {
                let d = Driver::load()?;
                // SAFETY: plain driver call.
                check("cuInit", unsafe { (d.init)(0) })?;
                Ok(Bare::Cuda { d, prop: device_prop(), access: device_access() })
            }
            Rt::Acl(_, b) => {
                let mut prop = acl_huge_prop();
                let mut granularity = 0usize;
                // SAFETY: a valid property and out pointer; option 0 = ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM.
                check("aclrtMemGetAllocationGranularity", unsafe { (b.granularity)(&mut prop, 0, &mut granularity) })?;
                Ok(Bare::Acl { b, prop, granularity: granularity.max(1) })
            }
        }
    }
}

/// One vendor's virtual-memory sequence: create physical memory, reserve an address range, map
/// it (and grant access, which CUDA needs and ACL's map does itself); undone in reverse.
enum Bare<'a> {
    Cuda { d: Driver, prop: AllocationProp, access: AccessDesc },
    Acl { b: &'a AclBench, prop: AclPhysicalMemProp, granularity: usize },
}

impl Bare<'_> {
    /// The size the driver accepts for `size` bytes (ACL: a multiple of the granularity, as
    /// aclrtMallocPhysical requires; the hook rounds the same way).
    fn size(&self, size: usize) -> usize {
        match self {
            Bare::Cuda { .. } => size,
            Bare::Acl { granularity, .. } => size.next_multiple_of(*granularity),
        }
    }

    fn sequence(&self) -> &'static str {
        match self {
            Bare::Cuda { .. } => "reserve+create+map+access / undo",
            Bare::Acl { .. } => "reserve+malloc_physical+map / undo",
        }
    }

    fn alloc(&self, size: usize) -> Result<(u64, u64), String> {
        // SAFETY: driver calls with valid arguments and out pointers.
        unsafe {
            match self {
                Bare::Cuda { d, prop, access } => {
                    let (mut va, mut h) = (0u64, 0u64);
                    check("cuMemCreate", (d.create)(&mut h, size, prop, 0))?;
                    check("cuMemAddressReserve", (d.reserve)(&mut va, size, 0, 0, 0))?;
                    check("cuMemMap", (d.map)(va, size, 0, h, 0))?;
                    check("cuMemSetAccess", (d.set_access)(va, size, access, 1))?;
                    Ok((va, h))
                }
                Bare::Acl { b, prop, .. } => {
                    let (mut va, mut h) = (std::ptr::null_mut(), std::ptr::null_mut());
                    // CANN: flags 0 on physical memory; alignment and flags 0 on the reservation
                    // (pass 0 with huge-page memory, as vLLM-Ascend does); offset and flags 0 on
                    // the map, whose size is the physical allocation's.
                    check("aclrtMallocPhysical", (b.malloc_physical)(&mut h, size, prop, 0))?;
                    check("aclrtReserveMemAddress", (b.reserve)(&mut va, size, 0, std::ptr::null_mut(), 0))?;
                    check("aclrtMapMem", (b.map)(va, size, 0, h, 0))?;
                    Ok((va as u64, h as u64))
                }
            }
        }
    }

    /// Unmaps and frees the physical memory: what a pause without backup does per allocation.
    fn unmap_release(&self, size: usize, va: u64, h: u64) -> Result<(), String> {
        // SAFETY: undoing a mapping made by `alloc` (unmapped before the physical memory is
        // freed: CANN does not free memory that is still mapped).
        unsafe {
            match self {
                Bare::Cuda { d, .. } => {
                    check("cuMemUnmap", (d.unmap)(va, size))?;
                    check("cuMemRelease", (d.release)(h))
                }
                Bare::Acl { b, .. } => {
                    check("aclrtUnmapMem", (b.unmap)(va as *mut _))?;
                    check("aclrtFreePhysical", (b.free_physical)(h as *mut _))
                }
            }
        }
    }

    fn free_address(&self, size: usize, va: u64) -> Result<(), String> {
        // SAFETY: a reservation made by `alloc`, unmapped.
        unsafe {
            match self {
                Bare::Cuda { d, .. } => check("cuMemAddressFree", (d.address_free)(va, size)),
                Bare::Acl { b, .. } => check("aclrtReleaseMemAddress", (b.release_address)(va as *mut _)),
            }
        }
    }

    fn free(&self, size: usize, va: u64, h: u64) -> Result<(), String> {
        self.unmap_release(size, va, h)?;
        self.free_address(size, va)
    }
}

/// Per call through the vendor's allocator outside any region, where the hook only forwards.
/// CUDA: cudaFree(NULL), a no-op, and a cudaMalloc(4 KiB)+cudaFree pair. ACL has no such no-op
/// (aclrtFree(NULL) is an error CANN logs on every call), so only the aclrtMalloc(4 KiB)+aclrtFree
/// pair is timed, as the fastest of ten batches to keep scheduler noise out of the difference.
pub fn passthrough(api: ApiKind, iters: usize) -> Result<Value, String> {
    let c = Ctx::new(api)?;
    c.no_region();
    let pairs = (iters / 20).max(100);
    match &c.rt {
        Rt::Cuda(rt) => {
            for _ in 0..1000 {
                // SAFETY: cudaFree(NULL) is a no-op.
                unsafe { (rt.free)(std::ptr::null_mut()) };
            }
            let t = Instant::now();
            for _ in 0..iters {
                // SAFETY: as above.
                unsafe { (rt.free)(std::ptr::null_mut()) };
            }
            let free_null_ns = t.elapsed().as_nanos() as f64 / iters as f64;
            let t = Instant::now();
            for _ in 0..pairs {
                let p = c.malloc(4096)?;
                c.free(p)?;
            }
            let pair_ns = t.elapsed().as_nanos() as f64 / pairs as f64;
            Ok(json!({ "hooked": c.tms.is_some(), "free_null_ns": free_null_ns, "malloc_free_pair_ns": pair_ns }))
        }
        Rt::Acl(..) => {
            for _ in 0..100 {
                let p = c.malloc(4096)?;
                c.free(p)?;
            }
            let batch = pairs.div_ceil(10);
            let mut best = f64::INFINITY;
            for _ in 0..10 {
                let t = Instant::now();
                for _ in 0..batch {
                    let p = c.malloc(4096)?;
                    c.free(p)?;
                }
                best = best.min(t.elapsed().as_nanos() as f64 / batch as f64);
            }
            Ok(json!({ "hooked": c.tms.is_some(), "malloc_free_pair_ns": best }))
        }
    }
}

/// Region malloc/free pairs through the hook vs the same virtual-memory sequence by hand.
pub fn region(api: ApiKind, iters: usize, size: usize) -> Result<Value, String> {
    let c = Ctx::new(api)?;
    let bare = c.bare()?;
    let vm_size = bare.size(size);
    let t = Instant::now();
    for _ in 0..iters {
        let (va, h) = bare.alloc(vm_size)?;
        bare.free(vm_size, va, h)?;
    }
    let bare_ns = t.elapsed().as_nanos() as f64 / iters as f64;
    c.region("bench-region", false)?;
    let t = Instant::now();
    for _ in 0..iters {
        let q = c.malloc(size)?;
        c.free(q)?;
    }
    let hooked_ns = t.elapsed().as_nanos() as f64 / iters as f64;
    c.no_region();
    // The driver's own unmap+release for one allocation, for the per-allocation pause target.
    let mut unmap_release = Vec::new();
    for _ in 0..iters.min(200) {
        let (va, h) = bare.alloc(vm_size)?;
        let t = Instant::now();
        bare.unmap_release(vm_size, va, h)?;
        unmap_release.push(t.elapsed().as_nanos() as f64);
        bare.free_address(vm_size, va)?;
    }
    Ok(json!({
        "size": size, "sequence": bare.sequence(), "bare_ns": bare_ns, "hooked_ns": hooked_ns,
        "unmap_release_ns": median(unmap_release),
    }))
}

/// Raw pinned copy bandwidth (bytes/s) host->device and device->host for `bytes`: what the hook's
/// backup does at best. ACL copies as the hook does, aclrtMemcpyAsync on a stream then waiting
/// for it; CUDA with a plain cudaMemcpy.
fn raw_copy(c: &Ctx, bytes: usize, reps: usize) -> Result<(f64, f64), String> {
    c.no_region();
    let dev = c.malloc(bytes)?;
    let mut host = std::ptr::null_mut();
    let (mut up, mut down) = (Vec::new(), Vec::new());
    // SAFETY: runtime calls on buffers of `bytes` bytes; the stream is ours.
    unsafe {
        match &c.rt {
            Rt::Cuda(rt) => {
                check("cudaMallocHost", (rt.malloc_host)(&mut host, bytes))?;
                std::ptr::write_bytes(host as *mut u8, 7, bytes);
                for _ in 0..reps {
                    let t = Instant::now();
                    check("cudaMemcpy", (rt.memcpy)(dev as *mut _, host, bytes, 1))?;
                    up.push(bytes as f64 / t.elapsed().as_secs_f64());
                    let t = Instant::now();
                    check("cudaMemcpy", (rt.memcpy)(host, dev as *const _, bytes, 2))?;
                    down.push(bytes as f64 / t.elapsed().as_secs_f64());
                }
                check("cudaFreeHost", (rt.free_host)(host))?;
            }
            Rt::Acl(_, b) => {
                check("aclrtMallocHost", (b.malloc_host)(&mut host, bytes))?;
                std::ptr::write_bytes(host as *mut u8, 7, bytes);
                let mut stream = std::ptr::null_mut();
                check("aclrtCreateStream", (b.create_stream)(&mut stream))?;
                for _ in 0..reps {
                    let t = Instant::now();
                    check(
                        "aclrtMemcpyAsync",
                        (b.memcpy_async)(dev as *mut _, bytes, host, bytes, ACL_MEMCPY_HOST_TO_DEVICE, stream),
                    )?;
                    check("aclrtSynchronizeStream", (b.synchronize_stream)(stream))?;
                    up.push(bytes as f64 / t.elapsed().as_secs_f64());
                    let t = Instant::now();
                    check(
                        "aclrtMemcpyAsync",
                        (b.memcpy_async)(host, bytes, dev as *const _, bytes, ACL_MEMCPY_DEVICE_TO_HOST, stream),
                    )?;
                    check("aclrtSynchronizeStream", (b.synchronize_stream)(stream))?;
                    down.push(bytes as f64 / t.elapsed().as_secs_f64());
                }
                check("aclrtDestroyStream", (b.destroy_stream)(stream))?;
                check("aclrtFreeHost", (b.free_host)(host))?;
            }
        }
    }
    c.free(dev)?;
    Ok((median(up), median(down)))
}

/// Pause and resume of one allocation per size, with and without backup, next to the raw pinned
/// copy bandwidth of the same size measured in the same process.
pub fn bytes_scan(api: ApiKind, sizes: &[usize], reps: usize) -> Result<Value, String> {
    let c = Ctx::new(api)?;
    let mut rows = Vec::new();
    for &size in sizes {
        let (raw_h2d, raw_d2h) = raw_copy(&c, size, reps)?;
        for backup in [false, true] {
            let tag = format!("bytes-{size}-{backup}");
            c.region(&tag, backup)?;
            let p = c.malloc(size)?;
            c.no_region();
            c.memset(p, size)?;
            // The first pause also allocates the pinned buffers (kept for later pauses): reported
            // apart from the steady state.
            let first_pause_ns = c.op(true, &tag)?.elapsed_ns as f64;
            c.op(false, &tag)?;
            let (mut pause, mut resume) = (Vec::new(), Vec::new());
            for _ in 0..reps {
                pause.push(c.op(true, &tag)?.elapsed_ns as f64);
                resume.push(c.op(false, &tag)?.elapsed_ns as f64);
            }
            c.free(p)?;
            let (pause_ns, resume_ns) = (median(pause), median(resume));
            rows.push(json!({
                "bytes": size, "backup": backup, "pause_ns": pause_ns, "resume_ns": resume_ns,
                "first_pause_ns": first_pause_ns,
                "pause_bytes_per_s": size as f64 / (pause_ns / 1e9),
                "resume_bytes_per_s": size as f64 / (resume_ns / 1e9),
                "raw_d2h_bytes_per_s": raw_d2h, "raw_h2d_bytes_per_s": raw_h2d,
            }));
        }
    }
    Ok(json!({ "rows": rows }))
}

/// Pause and resume of one allocation per size through the C ABI that torch_memory_saver's
/// library and libtms_hook.so share (whichever is preloaded): the same calls, timed by the wall
/// clock around each, so the two libraries are compared on equal terms. With backup, the contents
/// are checked after the last resume.
pub fn side_by_side(sizes: &[usize], reps: usize) -> Result<Value, String> {
    let rt = vendor::open_cuda(0)?;
    let t = CommonTms::load().map_err(|e| format!("{e} (is a memory-saver library preloaded?)"))?;
    let mut rows = Vec::new();
    for &size in sizes {
        for backup in [false, true] {
            let tag = CString::new(format!("side-{size}-{backup}")).expect("no NUL");
            let mut p = std::ptr::null_mut();
            // SAFETY: the shared ABI's region calls, then the runtime on an allocation of `size`.
            unsafe {
                (t.set_tag)(tag.as_ptr());
                (t.set_backup)(backup);
                (t.set_region)(true);
                let rc = (rt.malloc)(&mut p, size);
                (t.set_region)(false);
                check("cudaMalloc", rc)?;
                check("cudaMemset", (rt.memset)(p, 0x5a, size))?;
                // A first cycle outside the timing: both libraries set things up on first use.
                check("tms_pause", (t.pause)(tag.as_ptr()))?;
                check("tms_resume", (t.resume)(tag.as_ptr()))?;
            }
            let (mut pause, mut resume) = (Vec::new(), Vec::new());
            for _ in 0..reps {
                let start = Instant::now();
                // SAFETY: as above.
                check("tms_pause", unsafe { (t.pause)(tag.as_ptr()) })?;
                pause.push(start.elapsed().as_nanos() as f64);
                let start = Instant::now();
                // SAFETY: as above.
                check("tms_resume", unsafe { (t.resume)(tag.as_ptr()) })?;
                resume.push(start.elapsed().as_nanos() as f64);
            }
            let intact = if backup {
                let mut host = vec![0u8; size];
                // SAFETY: a device allocation of `size` bytes into a host buffer of the same size.
                check("cudaMemcpy", unsafe { (rt.memcpy)(host.as_mut_ptr().cast(), p, size, 2) })?;
                Some(host.iter().all(|&b| b == 0x5a))
            } else {
                None
            };
            // SAFETY: the allocation made above.
            check("cudaFree", unsafe { (rt.free)(p) })?;
            let (pause_ns, resume_ns) = (median(pause), median(resume));
            rows.push(json!({
                "bytes": size, "backup": backup, "pause_ns": pause_ns, "resume_ns": resume_ns,
                "contents_intact": intact,
            }));
        }
    }
    Ok(json!({ "rows": rows }))
}

/// Pause/resume of `n` allocations of mixed sizes (2, 4 and 6 MiB, like a caching allocator's
/// segments), without backup, per count.
pub fn count_scan(api: ApiKind, counts: &[usize], reps: usize) -> Result<Value, String> {
    let c = Ctx::new(api)?;
    let mut rows = Vec::new();
    for &n in counts {
        let tag = format!("count-{n}");
        c.region(&tag, false)?;
        let mut ptrs = Vec::with_capacity(n);
        let mut total = 0usize;
        for i in 0..n {
            let size = [2, 4, 6][i % 3] * MIB;
            ptrs.push(c.malloc(size)?);
            total += size;
        }
        c.no_region();
        let (mut pause, mut resume) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            pause.push(c.op(true, &tag)?.elapsed_ns as f64);
            resume.push(c.op(false, &tag)?.elapsed_ns as f64);
        }
        for p in ptrs {
            c.free(p)?;
        }
        let (pause_ns, resume_ns) = (median(pause), median(resume));
        rows.push(json!({
            "allocations": n, "bytes": total, "pause_ns": pause_ns, "resume_ns": resume_ns,
            "pause_ns_per_allocation": pause_ns / n as f64, "resume_ns_per_allocation": resume_ns / n as f64,
        }));
    }
    Ok(json!({ "rows": rows }))
}

/// The process's resident anonymous bytes (heap, thread stacks, pinned buffers: where a leak
/// shows), exactly: smaps_rollup walks the page tables. VmRSS in /proc/self/status is not exact
/// (proc(5): kept per CPU and summed lazily for scalability; on this VM's kernel it moved by 200
/// to 400 KiB between two reads with nothing allocated between), and file-backed pages (the
/// binary's own) leave under other processes' memory pressure: either would drown the growth
/// this figure is for.
fn rss_bytes() -> u64 {
    let read = |path: &str, key: &str| {
        std::fs::read_to_string(path).ok().and_then(|s| {
            s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
    };
    read("/proc/self/smaps_rollup", "Anonymous:").or_else(|| read("/proc/self/status", "RssAnon:")).unwrap_or(0) * 1024
}

#[repr(C)]
struct MallInfo2 {
    arena: usize,
    ordblks: usize,
    smblks: usize,
    hblks: usize,
    hblkhd: usize,
    usmblks: usize,
    fsmblks: usize,
    uordblks: usize,
    fordblks: usize,
    keepcost: usize,
}

/// Heap bytes in use. `mallinfo2` appeared in glibc 2.33; it is looked up at run time so that the
/// binary still loads on the older glibc of the machines the hardware kit runs on (the figure is
/// then 0, and the memory table says so by its zeros).
fn heap_in_use() -> usize {
    type MallInfo2Fn = unsafe extern "C" fn() -> MallInfo2;
    // SAFETY: a lookup by name in the already loaded C library.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"mallinfo2".as_ptr()) };
    if f.is_null() {
        return 0;
    }
    // SAFETY: glibc's mallinfo2, of this signature, with no preconditions.
    let m = unsafe { std::mem::transmute::<*mut libc::c_void, MallInfo2Fn>(f)() };
    m.uordblks + m.hblkhd
}

/// Host memory: heap bytes per tracked allocation (hook + simulator bookkeeping), and RSS growth
/// across `cycles` pause/resume cycles with backup.
pub fn memory(api: ApiKind, tracked: usize, cycles: usize) -> Result<Value, String> {
    let c = Ctx::new(api)?;
    c.region("mem-registry", false)?;
    let warm = c.malloc(2 * MIB)?;
    c.free(warm)?;
    let heap0 = heap_in_use();
    let mut ptrs = Vec::with_capacity(tracked);
    for _ in 0..tracked {
        ptrs.push(c.malloc(2 * MIB)?);
    }
    let heap1 = heap_in_use();
    let per_allocation = (heap1.saturating_sub(heap0)) as f64 / tracked as f64;
    for p in ptrs {
        c.free(p)?;
    }
    // The same allocations made by hand through the driver: the simulator's (or driver's) own
    // bookkeeping, to subtract from the figure above.
    c.no_region();
    let bare = c.bare()?;
    let size = bare.size(2 * MIB);
    let heap2 = heap_in_use();
    let mut made = Vec::with_capacity(tracked);
    for _ in 0..tracked {
        made.push(bare.alloc(size)?);
    }
    let heap3 = heap_in_use();
    let driver_per_allocation = (heap3.saturating_sub(heap2)) as f64 / tracked as f64;
    for (va, h) in made {
        bare.free(size, va, h)?;
    }
    c.region("mem-cycles", true)?;
    let mut ptrs = Vec::new();
    for _ in 0..32 {
        ptrs.push(c.malloc(2 * MIB)?);
    }
    c.no_region();
    for _ in 0..20 {
        c.op(true, "mem-cycles")?;
        c.op(false, "mem-cycles")?;
    }
    let rss0 = rss_bytes();
    for _ in 0..cycles {
        c.op(true, "mem-cycles")?;
        c.op(false, "mem-cycles")?;
    }
    let rss1 = rss_bytes();
    for p in ptrs {
        c.free(p)?;
    }
    Ok(json!({
        "tracked": tracked, "heap_bytes_per_allocation": per_allocation,
        "driver_heap_bytes_per_allocation": driver_per_allocation,
        "hook_heap_bytes_per_allocation": per_allocation - driver_per_allocation,
        "cycles": cycles, "rss_before": rss0, "rss_after": rss1,
        "rss_growth": rss1 as i64 - rss0 as i64,
    }))
}
