//! The CUDA runtime surface: every `cuda*` / `__cuda*` name the simulator exports, declared once.
//!
//! Most names are exported twice, as `NAME@libcudart.so.12` and `NAME@@libcudart.so.13`, so that
//! binaries linked against either runtime major bind to it (their references are versioned, and
//! the loader refuses a library that lacks the node). Where the majors differ, each gets its own:
//! CUDA 12's `_v2`/`_v3` names exist only under its node, and a plain name whose arguments
//! changed in CUDA 13 has one function per node. Names in `not_supported` answer
//! `cudaErrorNotSupported` (801), set the thread's last error and say so once in the log: a
//! program that needs them fails loudly instead of computing with data that was never written.
//!
//! The table [`SURFACE`] is what docs/simulator.md's runtime table and the surface test are made
//! from: a PyTorch upgrade that imports a new name fails that test with the name.

use super::{devices, graphs, ipc, launch, memory, streams};

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
                    super::super::not_supported(stringify!($missing))
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
        cudaGetLastError => super::cuda_get_last_error,
        cudaPeekAtLastError => super::cuda_peek_at_last_error,
        cudaGetErrorString => super::cuda_get_error_string,
        cudaGetErrorName => super::cuda_get_error_name,
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
