//! Every name the CUDA front end exports, declared once: the runtime's (`cuda*`, `__cuda*`) with
//! their version nodes, then the driver's, NVML's and NCCL's, which take cudart.map's own node.
//!
//! Most runtime names are exported twice, as `NAME@libcudart.so.12` and `NAME@@libcudart.so.13`, so that
//! binaries linked against either runtime major bind to it (their references are versioned, and
//! the loader refuses a library that lacks the node). Where the majors differ, each gets its own:
//! CUDA 12's `_v2`/`_v3` names exist only under its node, and a plain name whose arguments
//! changed in CUDA 13 has one function per node. Names in `not_supported` answer
//! `cudaErrorNotSupported` (801), set the thread's last error and say so once in the log: a
//! program that needs them fails loudly instead of computing with data that was never written.
//!
//! The table [`SURFACE`] is what docs/simulator.md's runtime table and the surface test are made
//! from: a PyTorch upgrade that imports a new name fails that test with the name.

use super::runtime::{self, devices, graphs, ipc, launch, memory, streams};
use super::{driver, nccl, nvml};

/// How the simulator answers a runtime entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// Implemented with the vendor's documented semantics.
    Implemented,
    /// Returns cudaErrorNotSupported (801) and logs once.
    NotSupported,
}

/// The runtime majors under which a name is exported with one meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Majors {
    /// `NAME@libcudart.so.12` and `NAME@@libcudart.so.13`, the same function.
    Both,
    /// `NAME@@libcudart.so.12` only: CUDA 12's own names (`_v2`, `_v3`), which CUDA 13 dropped.
    Cuda12,
    /// The CUDA 12 meaning of a name whose arguments changed in CUDA 13.
    Cuda12Legacy,
    /// The CUDA 13 meaning of such a name.
    Cuda13,
}

impl Majors {
    /// The version nodes the name is exported under, as `objdump -T` prints them.
    pub fn nodes(self) -> &'static [&'static str] {
        match self {
            Majors::Both => &["(libcudart.so.12)", " libcudart.so.13 "],
            Majors::Cuda12 => &[" libcudart.so.12 "],
            Majors::Cuda12Legacy => &["(libcudart.so.12)"],
            Majors::Cuda13 => &[" libcudart.so.13 "],
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Majors::Both => "12, 13",
            Majors::Cuda12 | Majors::Cuda12Legacy => "12",
            Majors::Cuda13 => "13",
        }
    }
}

/// Defines one trampoline, `$sym`, exported as `$name` at version `$ver` ("@node" or "@@node",
/// the default). A trampoline is a tail jump, so the callee sees the caller's arguments and
/// return address untouched.
macro_rules! export_at {
    ($sym:literal, $name:ident, $imp:path, $ver:literal) => {
        #[cfg(target_arch = "x86_64")]
        std::arch::global_asm!(
            ".pushsection .text",
            concat!(".globl ", $sym, stringify!($name)),
            concat!(".type ", $sym, stringify!($name), ", @function"),
            ".p2align 4",
            concat!($sym, stringify!($name), ":"),
            "jmp {f}",
            concat!(".symver ", $sym, stringify!($name), ", ", stringify!($name), $ver),
            ".popsection",
            f = sym $imp,
        );
        #[cfg(target_arch = "aarch64")]
        std::arch::global_asm!(
            ".pushsection .text",
            concat!(".globl ", $sym, stringify!($name)),
            concat!(".type ", $sym, stringify!($name), ", %function"),
            ".p2align 4",
            concat!($sym, stringify!($name), ":"),
            "b {f}",
            concat!(".symver ", $sym, stringify!($name), ", ", stringify!($name), $ver),
            ".popsection",
            f = sym $imp,
        );
    };
}

macro_rules! runtime_surface {
    (
        implemented { $($name:ident => $imp:path,)* }
        cuda12_only { $($name12:ident => $imp12:path,)* }
        changed_in_13 { $($changed:ident => ($legacy:path, $legacy_support:ident, $current:path),)* }
        not_supported { $($missing:ident,)* }
    ) => {
        $(
            export_at!("tms_cudart12_", $name, $imp, "@libcudart.so.12");
            export_at!("tms_cudart13_", $name, $imp, "@@libcudart.so.13");
        )*
        $( export_at!("tms_cudart12_", $name12, $imp12, "@@libcudart.so.12"); )*
        $(
            export_at!("tms_cudart12_", $changed, $legacy, "@libcudart.so.12");
            export_at!("tms_cudart13_", $changed, $current, "@@libcudart.so.13");
        )*

        /// One entry point per name that answers "not supported".
        #[allow(non_snake_case)]
        mod not_supported_entries {
            $(
                pub unsafe extern "C" fn $missing() -> i32 {
                    super::runtime::not_supported(stringify!($missing))
                }
            )*
        }
        $(
            export_at!("tms_cudart12_", $missing, not_supported_entries::$missing, "@libcudart.so.12");
            export_at!("tms_cudart13_", $missing, not_supported_entries::$missing, "@@libcudart.so.13");
        )*

        /// Every exported runtime name, how it is answered and under which runtime majors.
        pub const SURFACE: &[(&str, Support, Majors)] = &[
            $((stringify!($name), Support::Implemented, Majors::Both),)*
            $((stringify!($name12), Support::Implemented, Majors::Cuda12),)*
            $((stringify!($changed), Support::$legacy_support, Majors::Cuda12Legacy),)*
            $((stringify!($changed), Support::Implemented, Majors::Cuda13),)*
            $((stringify!($missing), Support::NotSupported, Majors::Both),)*
        ];
    };
}

runtime_surface! {
    implemented {
        // memory and copies
        cudaMalloc => memory::cuda_malloc,
        cudaFree => memory::cuda_free,
        cudaMallocAsync => memory::cuda_malloc_async,
        cudaFreeAsync => memory::cuda_free_async,
        cudaMallocHost => memory::cuda_malloc_host,
        cudaHostAlloc => memory::cuda_host_alloc,
        cudaFreeHost => memory::cuda_free_host,
        cudaHostRegister => memory::cuda_host_register,
        cudaHostUnregister => memory::cuda_host_unregister,
        cudaHostGetFlags => memory::cuda_host_get_flags,
        cudaHostGetDevicePointer => memory::cuda_host_get_device_pointer,
        cudaPointerGetAttributes => memory::cuda_pointer_get_attributes,
        cudaMemcpy => memory::cuda_memcpy,
        cudaMemcpyAsync => memory::cuda_memcpy_async,
        cudaMemcpyPeer => memory::cuda_memcpy_peer,
        cudaMemcpyPeerAsync => memory::cuda_memcpy_peer_async,
        cudaMemcpy2D => memory::cuda_memcpy_2d,
        cudaMemcpy2DAsync => memory::cuda_memcpy_2d_async,
        cudaMemset => memory::cuda_memset,
        cudaMemsetAsync => memory::cuda_memset_async,
        cudaMemGetInfo => memory::cuda_mem_get_info,
        // devices
        cudaGetDevice => devices::cuda_get_device,
        cudaSetDevice => devices::cuda_set_device,
        cudaGetDeviceCount => devices::cuda_get_device_count,
        cudaDeviceGetAttribute => devices::cuda_device_get_attribute,
        cudaDeviceGetPCIBusId => devices::cuda_device_get_pci_bus_id,
        cudaDeviceGetStreamPriorityRange => devices::cuda_device_get_stream_priority_range,
        cudaDeviceCanAccessPeer => devices::cuda_device_can_access_peer,
        cudaDeviceEnablePeerAccess => devices::cuda_device_enable_peer_access,
        cudaDeviceDisablePeerAccess => devices::cuda_device_disable_peer_access,
        cudaDeviceSynchronize => devices::cuda_device_synchronize,
        cudaDeviceReset => devices::cuda_device_reset,
        cudaRuntimeGetVersion => devices::cuda_runtime_get_version,
        cudaDriverGetVersion => devices::cuda_driver_get_version,
        cudaGetDriverEntryPointByVersion => devices::cuda_get_driver_entry_point_by_version,
        cudaGetDriverEntryPoint => devices::cuda_get_driver_entry_point,
        cudaProfilerStart => devices::cuda_profiler_start,
        cudaProfilerStop => devices::cuda_profiler_stop,
        // errors
        cudaGetLastError => runtime::cuda_get_last_error,
        cudaPeekAtLastError => runtime::cuda_peek_at_last_error,
        cudaGetErrorString => runtime::cuda_get_error_string,
        cudaGetErrorName => runtime::cuda_get_error_name,
        // streams, events, capture state
        cudaStreamCreate => streams::cuda_stream_create,
        cudaStreamCreateWithFlags => streams::cuda_stream_create_with_flags,
        cudaStreamCreateWithPriority => streams::cuda_stream_create_with_priority,
        cudaStreamGetPriority => streams::cuda_stream_get_priority,
        cudaStreamGetFlags => streams::cuda_stream_get_flags,
        cudaStreamSynchronize => streams::cuda_stream_synchronize,
        cudaStreamQuery => streams::cuda_stream_query,
        cudaStreamDestroy => streams::cuda_stream_destroy,
        cudaStreamWaitEvent => streams::cuda_stream_wait_event,
        cudaStreamAddCallback => streams::cuda_stream_add_callback,
        cudaLaunchHostFunc => streams::cuda_launch_host_func,
        cudaStreamIsCapturing => streams::cuda_stream_is_capturing,
        cudaThreadExchangeStreamCaptureMode => streams::cuda_thread_exchange_stream_capture_mode,
        cudaEventCreate => streams::cuda_event_create,
        cudaEventCreateWithFlags => streams::cuda_event_create_with_flags,
        cudaEventRecord => streams::cuda_event_record,
        cudaEventRecordWithFlags => streams::cuda_event_record_with_flags,
        cudaEventQuery => streams::cuda_event_query,
        cudaEventSynchronize => streams::cuda_event_synchronize,
        cudaEventElapsedTime => streams::cuda_event_elapsed_time,
        cudaEventDestroy => streams::cuda_event_destroy,
        // CUDA graphs by stream capture
        cudaStreamBeginCapture => graphs::cuda_stream_begin_capture,
        cudaStreamEndCapture => graphs::cuda_stream_end_capture,
        cudaGraphInstantiate => graphs::cuda_graph_instantiate,
        cudaGraphInstantiateWithFlags => graphs::cuda_graph_instantiate_with_flags,
        cudaGraphLaunch => graphs::cuda_graph_launch,
        cudaGraphExecDestroy => graphs::cuda_graph_exec_destroy,
        cudaGraphDestroy => graphs::cuda_graph_destroy,
        cudaGraphGetNodes => graphs::cuda_graph_get_nodes,
        cudaUserObjectCreate => graphs::cuda_user_object_create,
        cudaUserObjectRelease => graphs::cuda_user_object_release,
        cudaGraphRetainUserObject => graphs::cuda_graph_retain_user_object,
        // CUDA IPC between processes of one simulated node
        cudaIpcGetMemHandle => ipc::cuda_ipc_get_mem_handle,
        cudaIpcOpenMemHandle => ipc::cuda_ipc_open_mem_handle,
        cudaIpcCloseMemHandle => ipc::cuda_ipc_close_mem_handle,
        cudaIpcGetEventHandle => ipc::cuda_ipc_get_event_handle,
        cudaIpcOpenEventHandle => ipc::cuda_ipc_open_event_handle,
        // module registration (every CUDA binary does this at load) and launches
        __cudaRegisterFatBinary => launch::register_fat_binary,
        __cudaRegisterFatBinaryEnd => launch::register_fat_binary_end,
        __cudaInitModule => launch::init_module,
        __cudaUnregisterFatBinary => launch::unregister_fat_binary,
        __cudaRegisterFunction => launch::register_function,
        __cudaRegisterVar => launch::register_var,
        __cudaPushCallConfiguration => launch::push_call_configuration,
        __cudaPopCallConfiguration => launch::pop_call_configuration,
        __cudaGetKernel => launch::get_kernel,
        cudaLaunchKernel => launch::cuda_launch_kernel,
        cudaLaunchKernelExC => launch::cuda_launch_kernel_ex_c,
        cudaLaunchCooperativeKernel => launch::cuda_launch_cooperative_kernel,
        __cudaLaunchKernel => launch::cuda_launch_kernel,
        cudaFuncGetAttributes => launch::cuda_func_get_attributes,
        cudaFuncSetAttribute => launch::cuda_func_set_attribute,
        cudaOccupancyMaxActiveBlocksPerMultiprocessor => launch::cuda_occupancy_max_active_blocks,
        cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags => launch::cuda_occupancy_max_active_blocks_with_flags,
    }
    cuda12_only {
        // The CUDA 12 headers rename these calls (`#define cudaGetDeviceProperties
        // cudaGetDeviceProperties_v2`, `cudaStreamGetCaptureInfo` to `_v2`); CUDA 13 has no `_v2`/`_v3`.
        cudaGetDeviceProperties_v2 => devices::cuda_get_device_properties_v2,
        cudaStreamGetCaptureInfo_v2 => streams::cuda_stream_get_capture_info_v2,
        cudaStreamGetCaptureInfo_v3 => streams::cuda_stream_get_capture_info,
    }
    changed_in_13 {
        // libcudart.so.12 keeps the CUDA 11 forms under the plain names for old binaries:
        // cudaStreamGetCaptureInfo(stream, status, id); the CUDA 11 cudaDeviceProp is not
        // modelled, so that legacy call answers 801. CUDA 13 reuses the plain names for the new forms.
        cudaGetDeviceProperties => (devices::cuda_get_device_properties_legacy, NotSupported, devices::cuda_get_device_properties),
        cudaStreamGetCaptureInfo => (streams::cuda_stream_get_capture_info_legacy, Implemented, streams::cuda_stream_get_capture_info),
    }
    not_supported {
        cudaGraphAddEmptyNode,
        cudaGraphDebugDotPrint,
        cudaGraphNodeGetType,
        cudaGetSymbolAddress,
        cudaMemcpyToSymbol,
        cudaKernelSetAttributeForDevice,
        cudaMallocManaged,
        cudaDeviceGetDefaultMemPool,
        cudaMemPoolGetAttribute,
        cudaMemPoolSetAttribute,
        cudaMemPoolSetAccess,
        cudaMemPoolTrimTo,
        cudaDeviceGetGraphMemAttribute,
        cudaDeviceSetGraphMemAttribute,
        cudaStreamBeginCaptureToGraph,
        cudaStreamUpdateCaptureDependencies,
        cudaGraphAddNode,
        cudaGraphConditionalHandleCreate,
        cudaGraphNodeGetDependencies,
        cudaLibraryLoadData,
        cudaLibraryLoadFromFile,
        cudaLibraryUnload,
        cudaLibraryGetKernel,
        cudaLibraryGetKernelCount,
        cudaLibraryGetGlobal,
        cudaLibraryGetManaged,
        cudaLibraryGetUnifiedFunction,
    }
}

/// Driver entry points PyTorch looks up (its NVRTC loader, the expandable-segments allocator)
/// that the simulator does not implement: CUDA_ERROR_NOT_SUPPORTED and one log line each.
#[allow(non_snake_case)]
mod driver_not_supported {
    use super::driver;

    pub unsafe extern "C" fn cuFuncGetAttribute() -> i32 {
        driver::not_supported("cuFuncGetAttribute")
    }
    pub unsafe extern "C" fn cuFuncSetAttribute() -> i32 {
        driver::not_supported("cuFuncSetAttribute")
    }
    pub unsafe extern "C" fn cuFuncSetCacheConfig() -> i32 {
        driver::not_supported("cuFuncSetCacheConfig")
    }
    pub unsafe extern "C" fn cuLaunchCooperativeKernel() -> i32 {
        driver::not_supported("cuLaunchCooperativeKernel")
    }
    pub unsafe extern "C" fn cuLaunchKernel() -> i32 {
        driver::not_supported("cuLaunchKernel")
    }
    pub unsafe extern "C" fn cuLinkAddData_v2() -> i32 {
        driver::not_supported("cuLinkAddData_v2")
    }
    pub unsafe extern "C" fn cuLinkComplete() -> i32 {
        driver::not_supported("cuLinkComplete")
    }
    pub unsafe extern "C" fn cuLinkCreate_v2() -> i32 {
        driver::not_supported("cuLinkCreate_v2")
    }
    pub unsafe extern "C" fn cuLinkDestroy() -> i32 {
        driver::not_supported("cuLinkDestroy")
    }
    pub unsafe extern "C" fn cuModuleGetFunction() -> i32 {
        driver::not_supported("cuModuleGetFunction")
    }
    pub unsafe extern "C" fn cuModuleLoad() -> i32 {
        driver::not_supported("cuModuleLoad")
    }
    pub unsafe extern "C" fn cuModuleLoadData() -> i32 {
        driver::not_supported("cuModuleLoadData")
    }
    pub unsafe extern "C" fn cuModuleLoadDataEx() -> i32 {
        driver::not_supported("cuModuleLoadDataEx")
    }
    pub unsafe extern "C" fn cuModuleUnload() -> i32 {
        driver::not_supported("cuModuleUnload")
    }
    pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor() -> i32 {
        driver::not_supported("cuOccupancyMaxActiveBlocksPerMultiprocessor")
    }
    pub unsafe extern "C" fn cuTensorMapEncodeTiled() -> i32 {
        driver::not_supported("cuTensorMapEncodeTiled")
    }
    pub unsafe extern "C" fn cuMemGetAddressRange_v2() -> i32 {
        driver::not_supported("cuMemGetAddressRange_v2")
    }
    pub unsafe extern "C" fn cuMemExportToShareableHandle() -> i32 {
        driver::not_supported("cuMemExportToShareableHandle")
    }
    pub unsafe extern "C" fn cuMemImportFromShareableHandle() -> i32 {
        driver::not_supported("cuMemImportFromShareableHandle")
    }
    pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle() -> i32 {
        driver::not_supported("cuMemGetAllocationPropertiesFromHandle")
    }
    pub unsafe extern "C" fn cuMemRetainAllocationHandle() -> i32 {
        driver::not_supported("cuMemRetainAllocationHandle")
    }
    pub unsafe extern "C" fn cuMemsetD32Async() -> i32 {
        driver::not_supported("cuMemsetD32Async")
    }
    pub unsafe extern "C" fn cuStreamWriteValue32_v2() -> i32 {
        driver::not_supported("cuStreamWriteValue32_v2")
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
                super::nccl::not_supported(stringify!($name))
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
    // CUDA driver (libcuda.so.1)
    cuInit => driver::cu_init;
    cuDriverGetVersion => driver::cu_driver_get_version;
    cuDeviceGet => driver::cu_device_get;
    cuDeviceGetCount => driver::cu_device_get_count;
    cuDeviceGetAttribute => driver::cu_device_get_attribute;
    cuDeviceGetName => driver::cu_device_get_name;
    cuDeviceTotalMem_v2 => driver::cu_device_total_mem;
    cuDevicePrimaryCtxRetain => driver::cu_device_primary_ctx_retain;
    cuDevicePrimaryCtxRelease => driver::cu_device_primary_ctx_release;
    cuDevicePrimaryCtxGetState => driver::cu_device_primary_ctx_get_state;
    cuDevicePrimaryCtxRelease_v2 => driver::cu_device_primary_ctx_release;
    cuCtxGetCurrent => driver::cu_ctx_get_current;
    cuCtxSetCurrent => driver::cu_ctx_set_current;
    cuCtxGetDevice => driver::cu_ctx_get_device;
    cuCtxSynchronize => driver::cu_ctx_synchronize;
    cuGetErrorString => driver::cu_get_error_string;
    cuGetErrorName => driver::cu_get_error_name;
    cuMemGetInfo_v2 => driver::cu_mem_get_info;
    cuMemAlloc_v2 => driver::cu_mem_alloc;
    cuMemFree_v2 => driver::cu_mem_free;
    cuMemcpyDtoH_v2 => driver::cu_memcpy_dtoh;
    cuMemcpyHtoD_v2 => driver::cu_memcpy_htod;
    cuMemcpyDtoHAsync_v2 => driver::cu_memcpy_dtoh_async;
    cuMemcpyHtoDAsync_v2 => driver::cu_memcpy_htod_async;
    cuMemsetD8_v2 => driver::cu_memset_d8;
    cuMemHostAlloc => driver::cu_mem_host_alloc;
    cuMemAllocHost_v2 => driver::cu_mem_alloc_host;
    cuMemFreeHost => driver::cu_mem_free_host;
    cuStreamCreate => driver::cu_stream_create;
    cuStreamSynchronize => driver::cu_stream_synchronize;
    cuStreamDestroy_v2 => driver::cu_stream_destroy;
    cuEventCreate => driver::cu_event_create;
    cuEventRecord => driver::cu_event_record;
    cuEventSynchronize => driver::cu_event_synchronize;
    cuEventDestroy_v2 => driver::cu_event_destroy;
    cuMemGetAllocationGranularity => driver::cu_mem_get_allocation_granularity;
    cuMemAddressReserve => driver::cu_mem_address_reserve;
    cuMemAddressFree => driver::cu_mem_address_free;
    cuMemCreate => driver::cu_mem_create;
    cuMemRelease => driver::cu_mem_release;
    cuMemMap => driver::cu_mem_map;
    cuMemUnmap => driver::cu_mem_unmap;
    cuMemSetAccess => driver::cu_mem_set_access;
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
    cuPointerGetAttribute => driver::cu_pointer_get_attribute;
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
}
