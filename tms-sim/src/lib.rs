//! tms-sim: an emulated CUDA runtime, CUDA driver and Ascend runtime on host memory.
//!
//! Built as `libtms_sim.so` and reached under the names real programs load (`libcudart.so.12`,
//! `libcudart.so.13`, `libcuda.so.1`, `libascendcl.so`, see `tms-sim env`). Its soname is
//! `libcudart.so.13`: PyTorch's libraries find their runtime through an RPATH that beats
//! `LD_LIBRARY_PATH`, and only an already-loaded object of that soname (preloaded) stands in. Device usage is shared by every process
//! that names the same node (`TMS_SIM_NODE`), so colocated processes see each other in
//! `cudaMemGetInfo` and run out of memory together. See the README for the environment.

/// Exports `$imp` under the C name `$name` as a one-instruction trampoline (the driver, NVML,
/// NCCL, ACL and HCCL names in each front end's `exports.rs`; the runtime's, which carry version
/// nodes, in `cuda/exports.rs`). It is defined in
/// assembly rather than as a `no_mangle` item so that our version script (cudart.map) decides its
/// version node: rustc's own version script lists every `no_mangle` export exactly, and an exact
/// match there would win. (A `.set` alias would be cheaper but is dropped when the target lands in
/// another codegen unit.)
macro_rules! export {
    ($($name:ident => $imp:path;)*) => {$(
        #[cfg(target_arch = "x86_64")]
        std::arch::global_asm!(
            ".pushsection .text",
            concat!(".globl ", stringify!($name)),
            concat!(".type ", stringify!($name), ", @function"),
            ".p2align 4",
            concat!(stringify!($name), ":"),
            "jmp {f}",
            concat!(".size ", stringify!($name), ", . - ", stringify!($name)),
            ".popsection",
            f = sym $imp,
        );
        #[cfg(target_arch = "aarch64")]
        std::arch::global_asm!(
            ".pushsection .text",
            concat!(".globl ", stringify!($name)),
            concat!(".type ", stringify!($name), ", %function"),
            ".p2align 4",
            concat!(stringify!($name), ":"),
            "b {f}",
            concat!(".size ", stringify!($name), ", . - ", stringify!($name)),
            ".popsection",
            f = sym $imp,
        );
    )*};
}

pub mod ascend;
pub mod core;
pub mod cuda;

pub mod introspect {
    //! What tests read back: device usage, host memory really held, live objects.

    use crate::core::config::STATS_DEVICES;
    use crate::core::sim::{guard, sim};
    use std::sync::atomic::Ordering;

    /// Mirrors `struct tms_sim_stats` in include/tms_sim.h.
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub struct SimStats {
        pub device_count: u32,
        pub _pad: u32,
        pub capacity: u64,
        /// Bytes used on each device by all processes of the node (the first STATS_DEVICES).
        pub device_used: [u64; STATS_DEVICES],
        /// Bytes used on each device by this process (the first STATS_DEVICES).
        pub process_used: [u64; STATS_DEVICES],
        /// Host bytes physically held by this process's simulated device memory.
        pub host_resident_bytes: u64,
        pub live_handles: u64,
        pub live_mappings: u64,
        pub reservations: u64,
        pub plain_allocations: u64,
        pub pinned_host_bytes: u64,
    }

    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn tms_sim_stats(out: *mut SimStats) -> i32 {
        guard(1, || {
            if out.is_null() {
                return 1;
            }
            let s = sim();
            let counts = s.mem.read().unwrap_or_else(|e| e.into_inner()).counts();
            let mut st = SimStats {
                device_count: s.devices() as u32,
                _pad: 0,
                capacity: s.node.capacity(),
                device_used: [0; STATS_DEVICES],
                process_used: [0; STATS_DEVICES],
                host_resident_bytes: counts.resident,
                live_handles: counts.handles,
                live_mappings: counts.mappings,
                reservations: counts.reservations,
                plain_allocations: counts.plain,
                pinned_host_bytes: s.pinned_bytes.load(Ordering::Relaxed),
            };
            for d in 0..s.devices().min(STATS_DEVICES) {
                st.device_used[d] = s.node.used(d);
                st.process_used[d] = s.node.process_used(d);
            }
            // SAFETY: checked non-null.
            unsafe { out.write(st) };
            0
        })
    }

    /// Whether `[ptr, ptr + len)` is device memory mapped with read and write access: 1 yes, 0 no
    /// (paused, freed or partly unmapped), -1 not device memory. Never faults (see tms_sim.h).
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn tms_sim_range_accessible(ptr: *const libc::c_void, len: usize) -> i32 {
        guard(-1, || {
            let mem = sim().mem.read().unwrap_or_else(|e| e.into_inner());
            if mem.device_of(ptr as usize).is_none() {
                return -1;
            }
            match mem.device_range(ptr as usize, len, true) {
                Ok(Some(_)) => 1,
                _ => 0,
            }
        })
    }

    /// Where the host reaches the bytes of a device range (see tms_sim.h), or NULL.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn tms_sim_host_view(ptr: *const libc::c_void, len: usize) -> *mut libc::c_void {
        // The CPU layer computes a default-stream kernel now: after what is queued there. A
        // kernel it queued runs on a stream's worker, in the stream's order already (and a wait
        // for the queues from there could wait for itself).
        let view = std::panic::catch_unwind(|| {
            if crate::core::streams::on_worker() {
                crate::core::streams::VIEWS.enter();
            } else {
                sim().streams.settle_default();
            }
            sim().host_view(ptr as usize, len)
        })
        .ok()
        .flatten();
        view.map_or(std::ptr::null_mut(), |p| p as *mut libc::c_void)
    }

    /// A host function reports that the work it runs for failed (see tms_sim.h): 0, or 1 when
    /// the caller is not a host function running on a stream.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn tms_sim_host_func_error(code: libc::c_int) -> i32 {
        guard(1, || if crate::core::streams::fail_current_job(code) { 0 } else { 1 })
    }

    /// The CPU layer queues Python kernels on this process's streams (see tms_sim.h): waits
    /// release the GIL from now on. Returns 0.
    #[unsafe(no_mangle)]
    pub extern "C" fn tms_sim_python_on_streams() -> i32 {
        crate::core::gil::python_runs_on_streams();
        0
    }

    /// The end of a host view's use (see tms_sim.h): 0, or 1 when the range is not device memory
    /// mapped with access.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn tms_sim_host_view_end(ptr: *const libc::c_void, len: usize) -> i32 {
        guard(1, || if sim().host_view_end(ptr as usize, len) { 0 } else { 1 })
    }

    /// The creation property of the physical memory mapped at `ptr` (see tms_sim.h), or -1.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn tms_sim_mem_attr(ptr: *const libc::c_void) -> i32 {
        guard(-1, || sim().prop_at(ptr as usize).unwrap_or(-1))
    }

    /// A simulated kernel (see include/tms_sim.h): `usec` of work on `stream`, then a fill of the
    /// range, checked when it runs.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn tms_sim_launch_kernel(
        stream: *mut libc::c_void,
        dst: *mut libc::c_void,
        bytes: usize,
        value: libc::c_int,
        usec: libc::c_uint,
    ) -> i32 {
        guard(1, || {
            let s = sim();
            let (stream, dst) = (crate::cuda::stream_id(stream as usize), dst as usize);
            if !s.streams.exists(stream) || dst == 0 {
                return 1;
            }
            if !matches!(s.classify(dst), crate::core::sim::PointerKind::Device(_)) {
                return 1;
            }
            let job = Box::new(move || {
                std::thread::sleep(std::time::Duration::from_micros(usec as u64));
                match sim().kernel_fill(dst, value as u8, bytes) {
                    Ok(()) => 0,
                    Err(e) => crate::cuda::runtime::code_of(e),
                }
            });
            // On the default stream too it is queued, as a kernel does not block the host.
            s.streams.submit_async(stream, crate::cuda::current_device(), job).unwrap_or(1)
        })
    }

    /// Replaces the fault-injection rules (same syntax as TMS_SIM_FAIL; "" clears them) and
    /// restarts call counting. Returns 0, or 1 for a malformed spec (rules left unchanged).
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn tms_sim_set_faults(spec: *const libc::c_char) -> i32 {
        guard(1, || {
            let text = if spec.is_null() {
                String::new()
            } else {
                // SAFETY: the caller passes a NUL-terminated string.
                unsafe { std::ffi::CStr::from_ptr(spec) }.to_string_lossy().into_owned()
            };
            match crate::core::fault::parse(&text) {
                Ok(rules) => {
                    crate::core::fault::install(rules);
                    0
                }
                Err(e) => {
                    crate::core::config::warn(&e);
                    1
                }
            }
        })
    }
}
