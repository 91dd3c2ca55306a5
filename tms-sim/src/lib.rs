//! tms-sim: an emulated CUDA runtime, CUDA driver and Ascend runtime on host memory.
//!
//! Built as `libtms_sim.so` and reached under the names real programs load (`libcudart.so.12`,
//! `libcudart.so.13`, `libcuda.so.1`, `libascendcl.so`, see `tms-sim env`). Its soname is
//! `libcudart.so.13`: PyTorch's libraries find their runtime through an RPATH that beats
//! `LD_LIBRARY_PATH`, and only an already-loaded object of that soname (preloaded) stands in. Device usage is shared by every process
//! that names the same node (`TMS_SIM_NODE`), so colocated processes see each other in
//! `cudaMemGetInfo` and run out of memory together. See the README for the environment.

pub mod ascend;
pub mod core;
pub mod cuda;

use ascend::{acl, acl_ipc, hccl};
use cuda::{driver as cuda_driver, nccl, nvml};

/// Exports `$imp` under the C name `$name` as a one-instruction trampoline (driver, ACL: the
/// runtime's names are declared in `cuda_runtime/surface.rs`). It is defined in
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

/// Driver entry points PyTorch looks up (its NVRTC loader, the expandable-segments allocator)
/// that the simulator does not implement: CUDA_ERROR_NOT_SUPPORTED and one log line each.
#[allow(non_snake_case)]
mod driver_not_supported {
    pub unsafe extern "C" fn cuFuncGetAttribute() -> i32 {
        crate::cuda::driver::not_supported("cuFuncGetAttribute")
    }
    pub unsafe extern "C" fn cuFuncSetAttribute() -> i32 {
        crate::cuda::driver::not_supported("cuFuncSetAttribute")
    }
    pub unsafe extern "C" fn cuFuncSetCacheConfig() -> i32 {
        crate::cuda::driver::not_supported("cuFuncSetCacheConfig")
    }
    pub unsafe extern "C" fn cuLaunchCooperativeKernel() -> i32 {
        crate::cuda::driver::not_supported("cuLaunchCooperativeKernel")
    }
    pub unsafe extern "C" fn cuLaunchKernel() -> i32 {
        crate::cuda::driver::not_supported("cuLaunchKernel")
    }
    pub unsafe extern "C" fn cuLinkAddData_v2() -> i32 {
        crate::cuda::driver::not_supported("cuLinkAddData_v2")
    }
    pub unsafe extern "C" fn cuLinkComplete() -> i32 {
        crate::cuda::driver::not_supported("cuLinkComplete")
    }
    pub unsafe extern "C" fn cuLinkCreate_v2() -> i32 {
        crate::cuda::driver::not_supported("cuLinkCreate_v2")
    }
    pub unsafe extern "C" fn cuLinkDestroy() -> i32 {
        crate::cuda::driver::not_supported("cuLinkDestroy")
    }
    pub unsafe extern "C" fn cuModuleGetFunction() -> i32 {
        crate::cuda::driver::not_supported("cuModuleGetFunction")
    }
    pub unsafe extern "C" fn cuModuleLoad() -> i32 {
        crate::cuda::driver::not_supported("cuModuleLoad")
    }
    pub unsafe extern "C" fn cuModuleLoadData() -> i32 {
        crate::cuda::driver::not_supported("cuModuleLoadData")
    }
    pub unsafe extern "C" fn cuModuleLoadDataEx() -> i32 {
        crate::cuda::driver::not_supported("cuModuleLoadDataEx")
    }
    pub unsafe extern "C" fn cuModuleUnload() -> i32 {
        crate::cuda::driver::not_supported("cuModuleUnload")
    }
    pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor() -> i32 {
        crate::cuda::driver::not_supported("cuOccupancyMaxActiveBlocksPerMultiprocessor")
    }
    pub unsafe extern "C" fn cuTensorMapEncodeTiled() -> i32 {
        crate::cuda::driver::not_supported("cuTensorMapEncodeTiled")
    }
    pub unsafe extern "C" fn cuMemGetAddressRange_v2() -> i32 {
        crate::cuda::driver::not_supported("cuMemGetAddressRange_v2")
    }
    pub unsafe extern "C" fn cuMemExportToShareableHandle() -> i32 {
        crate::cuda::driver::not_supported("cuMemExportToShareableHandle")
    }
    pub unsafe extern "C" fn cuMemImportFromShareableHandle() -> i32 {
        crate::cuda::driver::not_supported("cuMemImportFromShareableHandle")
    }
    pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle() -> i32 {
        crate::cuda::driver::not_supported("cuMemGetAllocationPropertiesFromHandle")
    }
    pub unsafe extern "C" fn cuMemRetainAllocationHandle() -> i32 {
        crate::cuda::driver::not_supported("cuMemRetainAllocationHandle")
    }
    pub unsafe extern "C" fn cuMemsetD32Async() -> i32 {
        crate::cuda::driver::not_supported("cuMemsetD32Async")
    }
    pub unsafe extern "C" fn cuStreamWriteValue32_v2() -> i32 {
        crate::cuda::driver::not_supported("cuStreamWriteValue32_v2")
    }
}

/// Declares NCCL entry points the simulator does not implement, once: each answers
/// ncclInvalidUsage with one warning (`nccl::not_supported`), is exported under its name, and is
/// listed in `NCCL_NOT_SUPPORTED`.
macro_rules! nccl_not_supported {
    ($($name:ident),* $(,)?) => {
        #[allow(non_snake_case)]
        mod nccl_not_supported {
            $(pub unsafe extern "C" fn $name() -> i32 {
                crate::cuda::nccl::not_supported(stringify!($name))
            })*
        }
        export! { $($name => nccl_not_supported::$name;)* }
        /// The `libnccl.so.2` names PyTorch's libtorch_cuda.so imports that the simulator answers
        /// with ncclInvalidUsage.
        pub const NCCL_NOT_SUPPORTED: &[&str] = &[$(stringify!($name)),*];
    };
}

nccl_not_supported!(
    ncclCommGetUniqueId,
    ncclCommGrow,
    ncclCommRevoke,
    ncclCommShrink,
    ncclCommWindowDeregister,
    ncclCommWindowRegister,
    ncclDevCommCreate,
    ncclDevCommDestroy,
    ncclGetLsaMultimemDevicePointer,
    ncclGetPeerDevicePointer,
    ncclGroupSimulateEnd,
    ncclPutSignal,
    ncclSignal,
    ncclWaitSignal,
    ncclWinGetUserPtr,
);

export! {
    // NCCL (libnccl.so.2)
    ncclGetVersion => nccl::get_version;
    ncclGetErrorString => nccl::get_error_string;
    ncclGetLastError => nccl::get_last_error;
    ncclGetUniqueId => nccl::get_unique_id;
    ncclCommInitRank => nccl::comm_init_rank;
    ncclCommInitRankConfig => nccl::comm_init_rank_config;
    ncclCommInitRankScalable => nccl::comm_init_rank_scalable;
    ncclCommInitAll => nccl::comm_init_all;
    ncclCommSplit => nccl::comm_split;
    ncclCommFinalize => nccl::comm_finalize;
    ncclCommDestroy => nccl::comm_destroy;
    ncclCommAbort => nccl::comm_abort;
    ncclCommGetAsyncError => nccl::comm_get_async_error;
    ncclCommCount => nccl::comm_count;
    ncclCommCuDevice => nccl::comm_cu_device;
    ncclCommUserRank => nccl::comm_user_rank;
    ncclBroadcast => nccl::broadcast;
    ncclBcast => nccl::bcast;
    ncclAllReduce => nccl::all_reduce;
    ncclReduce => nccl::reduce;
    ncclAllGather => nccl::all_gather;
    ncclReduceScatter => nccl::reduce_scatter;
    ncclAlltoAll => nccl::all_to_all;
    ncclGather => nccl::gather;
    ncclSend => nccl::send;
    ncclRecv => nccl::recv;
    ncclGroupStart => nccl::group_start;
    ncclGroupEnd => nccl::group_end;
    ncclRedOpCreatePreMulSum => nccl::red_op_create_pre_mul_sum;
    ncclRedOpDestroy => nccl::red_op_destroy;
    ncclCommRegister => nccl::comm_register;
    ncclCommDeregister => nccl::comm_deregister;
    ncclMemAlloc => nccl::mem_alloc;
    ncclMemFree => nccl::mem_free;
    ncclCommMemStats => nccl::comm_mem_stats;
    ncclCommResume => nccl::comm_resume;
    ncclCommSuspend => nccl::comm_suspend;
    // HCCL (libhccl.so)
    HcclGetErrorString => hccl::get_error_string;
    HcclGetRootInfo => hccl::get_root_info;
    HcclCommInitRootInfo => hccl::comm_init_root_info;
    HcclCommInitRootInfoConfig => hccl::comm_init_root_info_config;
    HcclCommInitClusterInfo => hccl::comm_init_cluster_info;
    HcclCommInitAll => hccl::comm_init_all;
    HcclBatchSendRecv => hccl::batch_send_recv;
    HcclAlltoAll => hccl::all_to_all;
    HcclCommDestroy => hccl::comm_destroy;
    HcclGetRankSize => hccl::get_rank_size;
    HcclGetRankId => hccl::get_rank_id;
    HcclGetCommAsyncError => hccl::get_comm_async_error;
    HcclBroadcast => hccl::broadcast;
    HcclAllReduce => hccl::all_reduce;
    HcclReduce => hccl::reduce;
    HcclAllGather => hccl::all_gather;
    HcclReduceScatter => hccl::reduce_scatter;
    HcclSend => hccl::send;
    HcclRecv => hccl::recv;
    HcclBarrier => hccl::barrier;
    // CUDA driver
    cuInit => cuda_driver::cu_init;
    cuDriverGetVersion => cuda_driver::cu_driver_get_version;
    cuDeviceGet => cuda_driver::cu_device_get;
    cuDeviceGetCount => cuda_driver::cu_device_get_count;
    cuDeviceGetAttribute => cuda_driver::cu_device_get_attribute;
    cuDeviceGetName => cuda_driver::cu_device_get_name;
    cuDeviceTotalMem_v2 => cuda_driver::cu_device_total_mem;
    cuDevicePrimaryCtxRetain => cuda_driver::cu_device_primary_ctx_retain;
    cuDevicePrimaryCtxRelease => cuda_driver::cu_device_primary_ctx_release;
    cuDevicePrimaryCtxGetState => cuda_driver::cu_device_primary_ctx_get_state;
    cuDevicePrimaryCtxRelease_v2 => cuda_driver::cu_device_primary_ctx_release;
    cuCtxGetCurrent => cuda_driver::cu_ctx_get_current;
    cuCtxSetCurrent => cuda_driver::cu_ctx_set_current;
    cuCtxGetDevice => cuda_driver::cu_ctx_get_device;
    cuCtxSynchronize => cuda_driver::cu_ctx_synchronize;
    cuGetErrorString => cuda_driver::cu_get_error_string;
    cuGetErrorName => cuda_driver::cu_get_error_name;
    cuMemGetInfo_v2 => cuda_driver::cu_mem_get_info;
    cuMemAlloc_v2 => cuda_driver::cu_mem_alloc;
    cuMemFree_v2 => cuda_driver::cu_mem_free;
    cuMemcpyDtoH_v2 => cuda_driver::cu_memcpy_dtoh;
    cuMemcpyHtoD_v2 => cuda_driver::cu_memcpy_htod;
    cuMemcpyDtoHAsync_v2 => cuda_driver::cu_memcpy_dtoh_async;
    cuMemcpyHtoDAsync_v2 => cuda_driver::cu_memcpy_htod_async;
    cuMemsetD8_v2 => cuda_driver::cu_memset_d8;
    cuMemHostAlloc => cuda_driver::cu_mem_host_alloc;
    cuMemAllocHost_v2 => cuda_driver::cu_mem_alloc_host;
    cuMemFreeHost => cuda_driver::cu_mem_free_host;
    cuStreamCreate => cuda_driver::cu_stream_create;
    cuStreamSynchronize => cuda_driver::cu_stream_synchronize;
    cuStreamDestroy_v2 => cuda_driver::cu_stream_destroy;
    cuEventCreate => cuda_driver::cu_event_create;
    cuEventRecord => cuda_driver::cu_event_record;
    cuEventSynchronize => cuda_driver::cu_event_synchronize;
    cuEventDestroy_v2 => cuda_driver::cu_event_destroy;
    cuMemGetAllocationGranularity => cuda_driver::cu_mem_get_allocation_granularity;
    cuMemAddressReserve => cuda_driver::cu_mem_address_reserve;
    cuMemAddressFree => cuda_driver::cu_mem_address_free;
    cuMemCreate => cuda_driver::cu_mem_create;
    cuMemRelease => cuda_driver::cu_mem_release;
    cuMemMap => cuda_driver::cu_mem_map;
    cuMemUnmap => cuda_driver::cu_mem_unmap;
    cuMemSetAccess => cuda_driver::cu_mem_set_access;
    cuFuncGetAttribute => driver_not_supported::cuFuncGetAttribute;
    cuFuncSetAttribute => driver_not_supported::cuFuncSetAttribute;
    cuFuncSetCacheConfig => driver_not_supported::cuFuncSetCacheConfig;
    cuLaunchCooperativeKernel => driver_not_supported::cuLaunchCooperativeKernel;
    cuLaunchKernel => driver_not_supported::cuLaunchKernel;
    cuLinkAddData_v2 => driver_not_supported::cuLinkAddData_v2;
    cuLinkComplete => driver_not_supported::cuLinkComplete;
    cuLinkCreate_v2 => driver_not_supported::cuLinkCreate_v2;
    cuLinkDestroy => driver_not_supported::cuLinkDestroy;
    cuModuleGetFunction => driver_not_supported::cuModuleGetFunction;
    cuModuleLoad => driver_not_supported::cuModuleLoad;
    cuModuleLoadData => driver_not_supported::cuModuleLoadData;
    cuModuleLoadDataEx => driver_not_supported::cuModuleLoadDataEx;
    cuModuleUnload => driver_not_supported::cuModuleUnload;
    cuOccupancyMaxActiveBlocksPerMultiprocessor => driver_not_supported::cuOccupancyMaxActiveBlocksPerMultiprocessor;
    cuPointerGetAttribute => cuda_driver::cu_pointer_get_attribute;
    cuTensorMapEncodeTiled => driver_not_supported::cuTensorMapEncodeTiled;
    cuMemGetAddressRange_v2 => driver_not_supported::cuMemGetAddressRange_v2;
    cuMemExportToShareableHandle => driver_not_supported::cuMemExportToShareableHandle;
    cuMemImportFromShareableHandle => driver_not_supported::cuMemImportFromShareableHandle;
    cuMemGetAllocationPropertiesFromHandle => driver_not_supported::cuMemGetAllocationPropertiesFromHandle;
    cuMemRetainAllocationHandle => driver_not_supported::cuMemRetainAllocationHandle;
    cuMemsetD32Async => driver_not_supported::cuMemsetD32Async;
    cuStreamWriteValue32_v2 => driver_not_supported::cuStreamWriteValue32_v2;
    // NVML (libnvidia-ml.so.1)
    nvmlInit => nvml::nvml_init;
    nvmlInit_v2 => nvml::nvml_init;
    nvmlInitWithFlags => nvml::nvml_init_with_flags;
    nvmlShutdown => nvml::nvml_shutdown;
    nvmlErrorString => nvml::nvml_error_string;
    nvmlSystemGetCudaDriverVersion => nvml::nvml_system_get_cuda_driver_version;
    nvmlSystemGetCudaDriverVersion_v2 => nvml::nvml_system_get_cuda_driver_version;
    nvmlDeviceGetCount => nvml::nvml_device_get_count;
    nvmlDeviceGetCount_v2 => nvml::nvml_device_get_count;
    nvmlDeviceGetHandleByIndex => nvml::nvml_device_get_handle_by_index;
    nvmlDeviceGetHandleByIndex_v2 => nvml::nvml_device_get_handle_by_index;
    nvmlDeviceGetHandleByPciBusId => nvml::nvml_device_get_handle_by_pci_bus_id;
    nvmlDeviceGetHandleByPciBusId_v2 => nvml::nvml_device_get_handle_by_pci_bus_id;
    nvmlDeviceGetIndex => nvml::nvml_device_get_index;
    nvmlDeviceGetName => nvml::nvml_device_get_name;
    nvmlDeviceGetUUID => nvml::nvml_device_get_uuid;
    nvmlDeviceGetMemoryInfo => nvml::nvml_device_get_memory_info;
    nvmlDeviceGetMemoryInfo_v2 => nvml::nvml_device_get_memory_info_v2;
    nvmlDeviceGetComputeRunningProcesses => nvml::nvml_device_get_compute_running_processes_v1;
    nvmlDeviceGetComputeRunningProcesses_v2 => nvml::nvml_device_get_compute_running_processes;
    nvmlDeviceGetComputeRunningProcesses_v3 => nvml::nvml_device_get_compute_running_processes;
    nvmlDeviceGetUtilizationRates => nvml::nvml_device_get_utilization_rates;
    nvmlDeviceGetNvLinkRemoteDeviceType => nvml::nvml_not_supported;
    nvmlDeviceGetNvLinkRemotePciInfo_v2 => nvml::nvml_not_supported;
    nvmlDeviceGetGpuFabricInfo => nvml::nvml_not_supported;
    nvmlDeviceGetGpuFabricInfoV => nvml::nvml_device_get_gpu_fabric_info_v;
    nvmlDeviceGetP2PStatus => nvml::nvml_not_supported;
    // Ascend ACL
    aclInit => acl::acl_init;
    aclFinalize => acl::acl_finalize;
    aclGetRecentErrMsg => acl::acl_get_recent_err_msg;
    aclrtSetDevice => acl::aclrt_set_device;
    aclrtGetDevice => acl::aclrt_get_device;
    aclrtResetDevice => acl::aclrt_reset_device;
    aclrtGetDeviceCount => acl::aclrt_get_device_count;
    aclrtCreateContext => acl::aclrt_create_context;
    aclrtDestroyContext => acl::aclrt_destroy_context;
    aclrtGetCurrentContext => acl::aclrt_get_current_context;
    aclrtSetCurrentContext => acl::aclrt_set_current_context;
    aclrtSynchronizeDevice => acl::aclrt_synchronize_device;
    aclrtSynchronizeDeviceWithTimeout => acl::aclrt_synchronize_device_with_timeout;
    aclrtCreateStream => acl::aclrt_create_stream;
    aclrtSynchronizeStream => acl::aclrt_synchronize_stream;
    aclrtDestroyStream => acl::aclrt_destroy_stream;
    aclrtMalloc => acl::aclrt_malloc;
    aclrtMallocAlign32 => acl::aclrt_malloc_align32;
    aclrtFree => acl::aclrt_free;
    aclrtMallocHost => acl::aclrt_malloc_host;
    aclrtFreeHost => acl::aclrt_free_host;
    aclrtMemcpy => acl::aclrt_memcpy;
    aclrtMemcpyAsync => acl::aclrt_memcpy_async;
    aclrtMemset => acl::aclrt_memset;
    aclrtGetMemInfo => acl::aclrt_get_mem_info;
    aclrtMemGetAllocationGranularity => acl::aclrt_mem_get_allocation_granularity;
    aclrtReserveMemAddress => acl::aclrt_reserve_mem_address;
    aclrtReleaseMemAddress => acl::aclrt_release_mem_address;
    aclrtMallocPhysical => acl::aclrt_malloc_physical;
    aclrtFreePhysical => acl::aclrt_free_physical;
    aclrtMapMem => acl::aclrt_map_mem;
    aclrtUnmapMem => acl::aclrt_unmap_mem;
    aclrtMemSetAccess => acl::aclrt_mem_set_access;
    aclrtDeviceGetBareTgid => acl_ipc::aclrt_device_get_bare_tgid;
    aclrtIpcMemGetExportKey => acl_ipc::aclrt_ipc_mem_get_export_key;
    aclrtIpcMemSetImportPid => acl_ipc::aclrt_ipc_mem_set_import_pid;
    aclrtIpcMemImportByKey => acl_ipc::aclrt_ipc_mem_import_by_key;
    aclrtIpcMemClose => acl_ipc::aclrt_ipc_mem_close;
}

pub mod introspect {
    //! What tests read back: device usage, host memory really held, live objects.

    use crate::core::config::MAX_DEVICES;
    use crate::core::sim::{guard, sim};
    use std::sync::atomic::Ordering;

    /// Mirrors `struct tms_sim_stats` in include/tms_sim.h.
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub struct SimStats {
        pub device_count: u32,
        pub _pad: u32,
        pub capacity: u64,
        /// Bytes used on each device by all processes of the node.
        pub device_used: [u64; MAX_DEVICES],
        /// Bytes used on each device by this process.
        pub process_used: [u64; MAX_DEVICES],
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
                device_used: [0; MAX_DEVICES],
                process_used: [0; MAX_DEVICES],
                host_resident_bytes: counts.resident,
                live_handles: counts.handles,
                live_mappings: counts.mappings,
                reservations: counts.reservations,
                plain_allocations: counts.plain,
                pinned_host_bytes: s.pinned_bytes.load(Ordering::Relaxed),
            };
            for d in 0..s.devices() {
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
            let (stream, dst) = (stream as usize, dst as usize);
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
            s.streams.submit_async(stream, None, job).unwrap_or(1)
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
