//! Measurements, each run in a child process (hooked or not, as the scenario needs) that prints
//! one JSON object on stdout.

use crate::runtime::{
    AccessDesc, AllocationProp, Driver, Report, Runtime, Tms, check, device_access, device_prop, load_cuda,
};
use serde_json::{Value, json};
use std::ffi::CString;
use std::time::Instant;

const MIB: usize = 1 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

struct Ctx {
    rt: Runtime,
    tms: Option<Tms>,
}

impl Ctx {
    fn new() -> Result<Ctx, String> {
        load_cuda()?;
        let rt = Runtime::load()?;
        // SAFETY: plain runtime call.
        check("cudaSetDevice", unsafe { (rt.set_device)(0) })?;
        Ok(Ctx { rt, tms: Tms::load().ok() })
    }

    fn tms(&self) -> Result<&Tms, String> {
        self.tms.as_ref().ok_or_else(|| "this scenario needs libtms_hook.so preloaded".to_string())
    }

    fn region(&self, tag: &str, backup: bool) -> Result<(), String> {
        let t = self.tms()?;
        let tag = CString::new(tag).expect("no NUL");
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
        check("cudaMalloc", unsafe { (self.rt.malloc)(&mut p, n) })?;
        Ok(p as usize)
    }

    fn free(&self, p: usize) -> Result<(), String> {
        // SAFETY: a pointer from cudaMalloc.
        check("cudaFree", unsafe { (self.rt.free)(p as *mut _) })
    }

    fn op(&self, pause: bool, tag: &str) -> Result<Report, String> {
        let t = self.tms()?;
        let tag = CString::new(tag).expect("no NUL");
        let mut r = Report::default();
        // SAFETY: tms API with a valid report.
        let rc = unsafe { if pause { (t.pause)(tag.as_ptr(), &mut r) } else { (t.resume)(tag.as_ptr(), &mut r) } };
        check(if pause { "tms_pause_report" } else { "tms_resume_report" }, rc)?;
        Ok(r)
    }
}

/// ns per cudaFree(NULL) and per cudaMalloc(4 KiB)+cudaFree pair, outside any region.
pub fn passthrough(iters: usize) -> Result<Value, String> {
    let c = Ctx::new()?;
    c.no_region();
    for _ in 0..1000 {
        // SAFETY: cudaFree(NULL) is a no-op.
        unsafe { (c.rt.free)(std::ptr::null_mut()) };
    }
    let t = Instant::now();
    for _ in 0..iters {
        // SAFETY: as above.
        unsafe { (c.rt.free)(std::ptr::null_mut()) };
    }
    let free_null_ns = t.elapsed().as_nanos() as f64 / iters as f64;
    let pairs = (iters / 20).max(100);
    let t = Instant::now();
    for _ in 0..pairs {
        let p = c.malloc(4096)?;
        c.free(p)?;
    }
    let pair_ns = t.elapsed().as_nanos() as f64 / pairs as f64;
    Ok(json!({ "hooked": c.tms.is_some(), "free_null_ns": free_null_ns, "malloc_free_pair_ns": pair_ns }))
}

/// The virtual-memory sequence a region allocation performs, done by hand through the driver.
///
/// # Safety
/// `d` is a loaded driver after cuInit.
unsafe fn bare_alloc(d: &Driver, size: usize, p: &AllocationProp, a: &AccessDesc) -> Result<(u64, u64), String> {
    let (mut va, mut h) = (0u64, 0u64);
    // SAFETY: driver calls with valid arguments.
    unsafe {
        check("cuMemCreate", (d.create)(&mut h, size, p, 0))?;
        check("cuMemAddressReserve", (d.reserve)(&mut va, size, 0, 0, 0))?;
        check("cuMemMap", (d.map)(va, size, 0, h, 0))?;
        check("cuMemSetAccess", (d.set_access)(va, size, a, 1))?;
    }
    Ok((va, h))
}

/// Undoes `bare_alloc`.
///
/// # Safety
/// `(va, h)` came from `bare_alloc` with the same size.
unsafe fn bare_free(d: &Driver, size: usize, va: u64, h: u64) -> Result<(), String> {
    // SAFETY: undoing a mapping made by bare_alloc.
    unsafe {
        check("cuMemUnmap", (d.unmap)(va, size))?;
        check("cuMemRelease", (d.release)(h))?;
        check("cuMemAddressFree", (d.address_free)(va, size))
    }
}

/// Region malloc/free pairs through the hook vs the same virtual-memory sequence by hand.
pub fn region(iters: usize, size: usize) -> Result<Value, String> {
    let c = Ctx::new()?;
    let d = Driver::load()?;
    // SAFETY: driver calls with valid arguments throughout.
    unsafe {
        check("cuInit", (d.init)(0))?;
        let (p, a) = (device_prop(), device_access());
        let t = Instant::now();
        for _ in 0..iters {
            let (va, h) = bare_alloc(&d, size, &p, &a)?;
            bare_free(&d, size, va, h)?;
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
            let (va, h) = bare_alloc(&d, size, &p, &a)?;
            let t = Instant::now();
            check("cuMemUnmap", (d.unmap)(va, size))?;
            check("cuMemRelease", (d.release)(h))?;
            unmap_release.push(t.elapsed().as_nanos() as f64);
            check("cuMemAddressFree", (d.address_free)(va, size))?;
        }
        Ok(json!({
            "size": size, "bare_ns": bare_ns, "hooked_ns": hooked_ns,
            "unmap_release_ns": median(unmap_release),
        }))
    }
}

/// Raw pinned copy bandwidth (bytes/s) host->device and device->host for `bytes`.
fn raw_copy(c: &Ctx, bytes: usize, reps: usize) -> Result<(f64, f64), String> {
    c.no_region();
    let dev = c.malloc(bytes)?;
    let mut host = std::ptr::null_mut();
    // SAFETY: runtime calls on buffers of `bytes` bytes.
    unsafe {
        check("cudaMallocHost", (c.rt.malloc_host)(&mut host, bytes))?;
        std::ptr::write_bytes(host as *mut u8, 7, bytes);
        let (mut up, mut down) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let t = Instant::now();
            check("cudaMemcpy", (c.rt.memcpy)(dev as *mut _, host, bytes, 1))?;
            up.push(bytes as f64 / t.elapsed().as_secs_f64());
            let t = Instant::now();
            check("cudaMemcpy", (c.rt.memcpy)(host, dev as *const _, bytes, 2))?;
            down.push(bytes as f64 / t.elapsed().as_secs_f64());
        }
        check("cudaFreeHost", (c.rt.free_host)(host))?;
        c.free(dev)?;
        Ok((median(up), median(down)))
    }
}

/// Pause and resume of one allocation per size, with and without backup, next to the raw pinned
/// copy bandwidth of the same size measured in the same process.
pub fn bytes_scan(sizes: &[usize], reps: usize) -> Result<Value, String> {
    let c = Ctx::new()?;
    let mut rows = Vec::new();
    for &size in sizes {
        let (raw_h2d, raw_d2h) = raw_copy(&c, size, reps)?;
        for backup in [false, true] {
            let tag = format!("bytes-{size}-{backup}");
            c.region(&tag, backup)?;
            let p = c.malloc(size)?;
            c.no_region();
            // SAFETY: a mapped allocation of `size` bytes.
            check("cudaMemset", unsafe { (c.rt.memset)(p as *mut _, 0x5a, size) })?;
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

/// Pause/resume of `n` allocations of mixed sizes (2, 4 and 6 MiB, like a caching allocator's
/// segments), without backup, per count.
pub fn count_scan(counts: &[usize], reps: usize) -> Result<Value, String> {
    let c = Ctx::new()?;
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

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
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
pub fn memory(tracked: usize, cycles: usize) -> Result<Value, String> {
    let c = Ctx::new()?;
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
    let d = Driver::load()?;
    let (prop, acc) = (device_prop(), device_access());
    let heap2 = heap_in_use();
    let mut bare = Vec::with_capacity(tracked);
    // SAFETY: driver calls with valid arguments.
    unsafe {
        check("cuInit", (d.init)(0))?;
        for _ in 0..tracked {
            bare.push(bare_alloc(&d, 2 * MIB, &prop, &acc)?);
        }
    }
    let heap3 = heap_in_use();
    let driver_per_allocation = (heap3.saturating_sub(heap2)) as f64 / tracked as f64;
    // SAFETY: undoing the mappings made above.
    unsafe {
        for (va, h) in bare {
            bare_free(&d, 2 * MIB, va, h)?;
        }
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
