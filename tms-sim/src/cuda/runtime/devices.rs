//! Devices: selection, properties and attributes (an H100 SXM's, with the simulated capacity),
//! peer access, versions and the driver entry-point table.

use super::{
    INVALID_DEVICE, INVALID_VALUE, PEER_ACCESS_ALREADY_ENABLED, PEER_ACCESS_NOT_ENABLED, RUNTIME_VERSION, SUCCESS,
    call, put, rt,
};
use crate::core::sim::sim;
use crate::cuda::{DRIVER_INIT, RT_DEVICE};
use libc::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::Mutex;

pub const MAX_THREADS_PER_SM: c_int = 2048;

/// `cudaDevAttr*` / `CU_DEVICE_ATTRIBUTE_*` values of an H100 SXM (the two enums share numbers;
/// driver_types.h of CUDA 13.2). Attributes not listed read as 0 ("not supported").
pub fn attribute(attr: c_int) -> Option<c_int> {
    Some(match attr {
        1 => 1024,                // max threads per block
        2 | 3 => 1024,            // max block dim x, y
        4 => 64,                  // max block dim z
        5 => i32::MAX,            // max grid dim x
        6 | 7 => 65535,           // max grid dim y, z
        8 => 49152,               // shared memory per block
        9 => 65536,               // constant memory
        10 => 32,                 // warp size
        12 => 65536,              // registers per block
        13 => 1_980_000,          // clock rate, kHz
        16 => 132,                // multiprocessors
        19 => 1,                  // can map host memory
        31 => 1,                  // concurrent kernels
        32 => 1,                  // ECC enabled
        36 => 2_619_000,          // memory clock rate, kHz
        37 => 5120,               // memory bus width, bits
        38 => 50 << 20,           // L2 cache
        39 => MAX_THREADS_PER_SM, // threads per multiprocessor
        40 => 3,                  // async engines
        41 => 1,                  // unified addressing
        75 => 9,                  // compute capability major
        76 => 0,                  // compute capability minor
        78 => 1,                  // stream priorities supported
        81 => 233_472,            // shared memory per multiprocessor
        82 => 65536,              // registers per multiprocessor
        83 => 1,                  // managed memory
        95 => 1,                  // cooperative launch
        97 => 232_448,            // opt-in shared memory per block
        99 => 1,                  // host register supported
        102 => 1,                 // virtual memory management supported
        106 => 32,                // blocks per multiprocessor
        108 => 32 << 20,          // max persisting L2
        109 => 134_213_632,       // max access-policy window
        110 => 1,                 // GPUDirect RDMA with VMM
        111 => 1024,              // reserved shared memory per block
        115 => 1,                 // memory pools supported
        116 => 1,                 // GPUDirect RDMA supported
        120 => 1,                 // cluster launch
        126 => 4,                 // memory sync domains
        134 => -1,                // host NUMA id: none
        0..=160 => 0,
        _ => return None,
    })
}

/// `struct cudaDeviceProp` of CUDA 13 (driver_types.h of CUDA 13.2, 1008 bytes on x86-64 and
/// aarch64). The runtime writes the whole struct, so the layout is checked field by field below.
#[repr(C)]
pub struct DeviceProp {
    pub name: [c_char; 256],
    pub uuid: [u8; 16],
    pub luid: [c_char; 8],
    pub luid_device_node_mask: c_uint,
    pub total_global_mem: usize,
    pub shared_mem_per_block: usize,
    pub regs_per_block: c_int,
    pub warp_size: c_int,
    pub mem_pitch: usize,
    pub max_threads_per_block: c_int,
    pub max_threads_dim: [c_int; 3],
    pub max_grid_size: [c_int; 3],
    pub total_const_mem: usize,
    pub major: c_int,
    pub minor: c_int,
    pub texture_alignment: usize,
    pub texture_pitch_alignment: usize,
    pub multi_processor_count: c_int,
    pub integrated: c_int,
    pub can_map_host_memory: c_int,
    pub max_texture: [c_int; 25],
    pub max_surface: [c_int; 14],
    pub surface_alignment: usize,
    pub concurrent_kernels: c_int,
    pub ecc_enabled: c_int,
    pub pci_bus_id: c_int,
    pub pci_device_id: c_int,
    pub pci_domain_id: c_int,
    pub tcc_driver: c_int,
    pub async_engine_count: c_int,
    pub unified_addressing: c_int,
    pub memory_bus_width: c_int,
    pub l2_cache_size: c_int,
    pub persisting_l2_cache_max_size: c_int,
    pub max_threads_per_multi_processor: c_int,
    pub stream_priorities_supported: c_int,
    pub global_l1_cache_supported: c_int,
    pub local_l1_cache_supported: c_int,
    pub shared_mem_per_multiprocessor: usize,
    pub regs_per_multiprocessor: c_int,
    pub managed_memory: c_int,
    pub is_multi_gpu_board: c_int,
    pub multi_gpu_board_group_id: c_int,
    pub host_native_atomic_supported: c_int,
    pub pageable_memory_access: c_int,
    pub concurrent_managed_access: c_int,
    pub compute_preemption_supported: c_int,
    pub can_use_host_pointer_for_registered_mem: c_int,
    pub cooperative_launch: c_int,
    pub shared_mem_per_block_optin: usize,
    pub pageable_memory_access_uses_host_page_tables: c_int,
    pub direct_managed_mem_access_from_host: c_int,
    pub max_blocks_per_multi_processor: c_int,
    pub access_policy_max_window_size: c_int,
    pub reserved_shared_mem_per_block: usize,
    pub host_register_supported: c_int,
    pub sparse_cuda_array_supported: c_int,
    pub host_register_read_only_supported: c_int,
    pub timeline_semaphore_interop_supported: c_int,
    pub memory_pools_supported: c_int,
    pub gpu_direct_rdma_supported: c_int,
    pub gpu_direct_rdma_flush_writes_options: c_uint,
    pub gpu_direct_rdma_writes_ordering: c_int,
    pub memory_pool_supported_handle_types: c_uint,
    pub deferred_mapping_cuda_array_supported: c_int,
    pub ipc_event_supported: c_int,
    pub cluster_launch: c_int,
    pub unified_function_pointers: c_int,
    pub device_numa_config: c_int,
    pub device_numa_id: c_int,
    pub mps_enabled: c_int,
    pub host_numa_id: c_int,
    pub gpu_pci_device_id: c_uint,
    pub gpu_pci_subsystem_id: c_uint,
    pub host_numa_multinode_ipc_supported: c_int,
    pub reserved: [c_int; 56],
}

// Offsets PyTorch reads, as observed from the CUDA 13.2 header (reference/torch-on-sim.md).
const _: () = assert!(std::mem::size_of::<DeviceProp>() == 1008);
const _: () = assert!(std::mem::offset_of!(DeviceProp, uuid) == 256);
const _: () = assert!(std::mem::offset_of!(DeviceProp, total_global_mem) == 288);
const _: () = assert!(std::mem::offset_of!(DeviceProp, major) == 360);
const _: () = assert!(std::mem::offset_of!(DeviceProp, multi_processor_count) == 384);

fn properties(dev: usize) -> DeviceProp {
    let a = |n| attribute(n).unwrap_or(0);
    // SAFETY: DeviceProp is plain integers and arrays of them: all-zero is a valid value.
    let mut p: DeviceProp = unsafe { std::mem::zeroed() };
    let name = format!("NVIDIA H100 80GB HBM3 (tms-sim {dev})");
    for (d, s) in p.name.iter_mut().zip(name.bytes().take(255)) {
        *d = s as c_char;
    }
    // A stable, distinct UUID per simulated device.
    p.uuid = *b"tms-sim-device\0\0";
    p.uuid[15] = dev as u8;
    p.total_global_mem = sim().node.capacity() as usize;
    p.shared_mem_per_block = a(8) as usize;
    p.regs_per_block = a(12);
    p.warp_size = a(10);
    p.mem_pitch = i32::MAX as usize;
    p.max_threads_per_block = a(1);
    p.max_threads_dim = [a(2), a(3), a(4)];
    p.max_grid_size = [a(5), a(6), a(7)];
    p.total_const_mem = a(9) as usize;
    p.major = a(75);
    p.minor = a(76);
    p.texture_alignment = 512;
    p.texture_pitch_alignment = 32;
    p.multi_processor_count = a(16);
    p.can_map_host_memory = a(19);
    p.surface_alignment = 512;
    p.concurrent_kernels = a(31);
    p.ecc_enabled = a(32);
    p.pci_bus_id = dev as c_int + 0x18;
    p.async_engine_count = a(40);
    p.unified_addressing = a(41);
    p.memory_bus_width = a(37);
    p.l2_cache_size = a(38);
    p.persisting_l2_cache_max_size = a(108);
    p.max_threads_per_multi_processor = a(39);
    p.stream_priorities_supported = a(78);
    p.global_l1_cache_supported = 1;
    p.local_l1_cache_supported = 1;
    p.shared_mem_per_multiprocessor = a(81) as usize;
    p.regs_per_multiprocessor = a(82);
    p.managed_memory = a(83);
    p.compute_preemption_supported = 1;
    p.cooperative_launch = a(95);
    p.shared_mem_per_block_optin = a(97) as usize;
    p.max_blocks_per_multi_processor = a(106);
    p.access_policy_max_window_size = a(109);
    p.reserved_shared_mem_per_block = a(111) as usize;
    p.host_register_supported = a(99);
    p.memory_pools_supported = a(115);
    p.gpu_direct_rdma_supported = a(116);
    p.cluster_launch = a(120);
    p.host_numa_id = -1;
    p.gpu_pci_device_id = 0x2330_10de;
    p
}

/// `struct cudaDeviceProp` of CUDA 12 (driver_types.h of CUDA 12.8, 1032 bytes), which
/// `cudaGetDeviceProperties_v2@libcudart.so.12` fills: the CUDA 12 headers turn every
/// `cudaGetDeviceProperties` call into that name. CUDA 13 dropped the fields marked below, so
/// the two layouts part at `clockRate`; writing the CUDA 13 struct for a CUDA 12 caller put
/// `multiProcessorCount` where it reads `deviceOverlap`.
#[repr(C)]
pub struct DeviceProp12 {
    pub name: [c_char; 256],
    pub uuid: [u8; 16],
    pub luid: [c_char; 8],
    pub luid_device_node_mask: c_uint,
    pub total_global_mem: usize,
    pub shared_mem_per_block: usize,
    pub regs_per_block: c_int,
    pub warp_size: c_int,
    pub mem_pitch: usize,
    pub max_threads_per_block: c_int,
    pub max_threads_dim: [c_int; 3],
    pub max_grid_size: [c_int; 3],
    pub clock_rate: c_int, // not in CUDA 13
    pub total_const_mem: usize,
    pub major: c_int,
    pub minor: c_int,
    pub texture_alignment: usize,
    pub texture_pitch_alignment: usize,
    pub device_overlap: c_int, // not in CUDA 13
    pub multi_processor_count: c_int,
    pub kernel_exec_timeout_enabled: c_int, // not in CUDA 13
    pub integrated: c_int,
    pub can_map_host_memory: c_int,
    pub compute_mode: c_int, // not in CUDA 13
    pub max_texture_1d: c_int,
    pub max_texture_1d_mipmap: c_int,
    pub max_texture_1d_linear: c_int, // not in CUDA 13
    pub max_texture: [c_int; 23],
    pub max_surface: [c_int; 14],
    pub surface_alignment: usize,
    pub concurrent_kernels: c_int,
    pub ecc_enabled: c_int,
    pub pci_bus_id: c_int,
    pub pci_device_id: c_int,
    pub pci_domain_id: c_int,
    pub tcc_driver: c_int,
    pub async_engine_count: c_int,
    pub unified_addressing: c_int,
    pub memory_clock_rate: c_int, // not in CUDA 13
    pub memory_bus_width: c_int,
    pub l2_cache_size: c_int,
    pub persisting_l2_cache_max_size: c_int,
    pub max_threads_per_multi_processor: c_int,
    pub stream_priorities_supported: c_int,
    pub global_l1_cache_supported: c_int,
    pub local_l1_cache_supported: c_int,
    pub shared_mem_per_multiprocessor: usize,
    pub regs_per_multiprocessor: c_int,
    pub managed_memory: c_int,
    pub is_multi_gpu_board: c_int,
    pub multi_gpu_board_group_id: c_int,
    pub host_native_atomic_supported: c_int,
    pub single_to_double_precision_perf_ratio: c_int, // not in CUDA 13
    pub pageable_memory_access: c_int,
    pub concurrent_managed_access: c_int,
    pub compute_preemption_supported: c_int,
    pub can_use_host_pointer_for_registered_mem: c_int,
    pub cooperative_launch: c_int,
    pub cooperative_multi_device_launch: c_int, // not in CUDA 13
    pub shared_mem_per_block_optin: usize,
    pub pageable_memory_access_uses_host_page_tables: c_int,
    pub direct_managed_mem_access_from_host: c_int,
    pub max_blocks_per_multi_processor: c_int,
    pub access_policy_max_window_size: c_int,
    pub reserved_shared_mem_per_block: usize,
    pub host_register_supported: c_int,
    pub sparse_cuda_array_supported: c_int,
    pub host_register_read_only_supported: c_int,
    pub timeline_semaphore_interop_supported: c_int,
    pub memory_pools_supported: c_int,
    pub gpu_direct_rdma_supported: c_int,
    pub gpu_direct_rdma_flush_writes_options: c_uint,
    pub gpu_direct_rdma_writes_ordering: c_int,
    pub memory_pool_supported_handle_types: c_uint,
    pub deferred_mapping_cuda_array_supported: c_int,
    pub ipc_event_supported: c_int,
    pub cluster_launch: c_int,
    pub unified_function_pointers: c_int,
    pub reserved: [c_int; 63],
}

// Offsets measured with gcc from the CUDA 12.8 header (nvidia-cuda-runtime-cu12 12.8).
const _: () = assert!(std::mem::size_of::<DeviceProp12>() == 1032);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, total_global_mem) == 288);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, clock_rate) == 348);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, major) == 360);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, multi_processor_count) == 388);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, max_texture_1d) == 408);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, surface_alignment) == 568);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, pci_bus_id) == 584);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, memory_clock_rate) == 608);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, l2_cache_size) == 616);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, shared_mem_per_multiprocessor) == 640);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, single_to_double_precision_perf_ratio) == 668);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, cooperative_multi_device_launch) == 692);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, shared_mem_per_block_optin) == 696);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, reserved_shared_mem_per_block) == 720);
const _: () = assert!(std::mem::offset_of!(DeviceProp12, unified_function_pointers) == 776);

/// The same device in the CUDA 12 layout: every field both layouts have, plus those CUDA 13 dropped.
fn properties12(dev: usize) -> DeviceProp12 {
    let p = properties(dev);
    let a = |n| attribute(n).unwrap_or(0);
    // SAFETY: DeviceProp12 is plain integers and arrays of them: all-zero is a valid value.
    let mut q: DeviceProp12 = unsafe { std::mem::zeroed() };
    q.name = p.name;
    q.uuid = p.uuid;
    q.luid = p.luid;
    q.luid_device_node_mask = p.luid_device_node_mask;
    q.total_global_mem = p.total_global_mem;
    q.shared_mem_per_block = p.shared_mem_per_block;
    q.regs_per_block = p.regs_per_block;
    q.warp_size = p.warp_size;
    q.mem_pitch = p.mem_pitch;
    q.max_threads_per_block = p.max_threads_per_block;
    q.max_threads_dim = p.max_threads_dim;
    q.max_grid_size = p.max_grid_size;
    q.clock_rate = a(13);
    q.total_const_mem = p.total_const_mem;
    q.major = p.major;
    q.minor = p.minor;
    q.texture_alignment = p.texture_alignment;
    q.texture_pitch_alignment = p.texture_pitch_alignment;
    q.device_overlap = 1;
    q.multi_processor_count = p.multi_processor_count;
    q.kernel_exec_timeout_enabled = a(17);
    q.integrated = p.integrated;
    q.can_map_host_memory = p.can_map_host_memory;
    q.compute_mode = a(20);
    q.surface_alignment = p.surface_alignment;
    q.concurrent_kernels = p.concurrent_kernels;
    q.ecc_enabled = p.ecc_enabled;
    q.pci_bus_id = p.pci_bus_id;
    q.pci_device_id = p.pci_device_id;
    q.pci_domain_id = p.pci_domain_id;
    q.tcc_driver = p.tcc_driver;
    q.async_engine_count = p.async_engine_count;
    q.unified_addressing = p.unified_addressing;
    q.memory_clock_rate = a(36);
    q.memory_bus_width = p.memory_bus_width;
    q.l2_cache_size = p.l2_cache_size;
    q.persisting_l2_cache_max_size = p.persisting_l2_cache_max_size;
    q.max_threads_per_multi_processor = p.max_threads_per_multi_processor;
    q.stream_priorities_supported = p.stream_priorities_supported;
    q.global_l1_cache_supported = p.global_l1_cache_supported;
    q.local_l1_cache_supported = p.local_l1_cache_supported;
    q.shared_mem_per_multiprocessor = p.shared_mem_per_multiprocessor;
    q.regs_per_multiprocessor = p.regs_per_multiprocessor;
    q.managed_memory = p.managed_memory;
    q.compute_preemption_supported = p.compute_preemption_supported;
    q.cooperative_launch = p.cooperative_launch;
    q.shared_mem_per_block_optin = p.shared_mem_per_block_optin;
    q.max_blocks_per_multi_processor = p.max_blocks_per_multi_processor;
    q.access_policy_max_window_size = p.access_policy_max_window_size;
    q.reserved_shared_mem_per_block = p.reserved_shared_mem_per_block;
    q.host_register_supported = p.host_register_supported;
    q.memory_pools_supported = p.memory_pools_supported;
    q.gpu_direct_rdma_supported = p.gpu_direct_rdma_supported;
    q.cluster_launch = p.cluster_launch;
    q
}

/// `cudaGetDeviceProperties@libcudart.so.12` is the CUDA 11 entry point, kept for binaries built
/// against CUDA 11 headers; its struct is not modelled, so it answers "not supported" rather than
/// write a layout the caller did not allocate.
pub unsafe extern "C" fn cuda_get_device_properties_legacy(_prop: *mut c_void, _dev: c_int) -> i32 {
    super::not_supported("cudaGetDeviceProperties@libcudart.so.12 (the CUDA 11 layout)")
}

pub unsafe extern "C" fn cuda_get_device_properties_v2(prop: *mut DeviceProp12, dev: c_int) -> i32 {
    call("cudaGetDeviceProperties_v2", || match sim().valid_device(dev as i64) {
        Some(d) => put(prop, properties12(d)),
        None => INVALID_DEVICE,
    })
}

/// The thread's device. Unlike most runtime calls it needs no context, and makes none current
/// (CUDA Runtime API, "Initialization": the primary context is created by the first call that
/// needs one); code that goes on to driver calls on this thread must make one current itself.
pub unsafe extern "C" fn cuda_get_device(dev: *mut c_int) -> i32 {
    call("cudaGetDevice", || {
        DRIVER_INIT.store(true, std::sync::atomic::Ordering::Release);
        put(dev, RT_DEVICE.with(|d| d.get()) as c_int)
    })
}

pub unsafe extern "C" fn cuda_set_device(dev: c_int) -> i32 {
    call("cudaSetDevice", || {
        let Some(d) = sim().valid_device(dev as i64) else { return INVALID_DEVICE };
        DRIVER_INIT.store(true, std::sync::atomic::Ordering::Release);
        // cudaSetDevice creates the device's primary context (CUDA 12 and later); when that
        // fails the thread keeps its device.
        if !crate::cuda::open_cuda_context(d) {
            return super::MEMORY_ALLOCATION;
        }
        RT_DEVICE.with(|c| c.set(d));
        crate::core::context::make_current(Some(d));
        SUCCESS
    })
}

pub unsafe extern "C" fn cuda_get_device_count(count: *mut c_int) -> i32 {
    call("cudaGetDeviceCount", || {
        if crate::cuda::cuda_hidden() {
            put(count, 0);
            return crate::cuda::NO_DEVICE;
        }
        put(count, sim().devices() as c_int)
    })
}

pub unsafe extern "C" fn cuda_get_device_properties(prop: *mut DeviceProp, dev: c_int) -> i32 {
    call("cudaGetDeviceProperties", || match sim().valid_device(dev as i64) {
        Some(d) => put(prop, properties(d)),
        None => INVALID_DEVICE,
    })
}

pub unsafe extern "C" fn cuda_device_get_attribute(value: *mut c_int, attr: c_int, dev: c_int) -> i32 {
    call("cudaDeviceGetAttribute", || {
        if sim().valid_device(dev as i64).is_none() {
            return INVALID_DEVICE;
        }
        match attribute(attr) {
            Some(v) => put(value, v),
            None => INVALID_VALUE,
        }
    })
}

pub unsafe extern "C" fn cuda_device_get_pci_bus_id(out: *mut c_char, len: c_int, dev: c_int) -> i32 {
    call("cudaDeviceGetPCIBusId", || {
        if out.is_null() || len <= 0 {
            return INVALID_VALUE;
        }
        let Some(d) = sim().valid_device(dev as i64) else { return INVALID_DEVICE };
        let text = crate::cuda::nvml::pci_bus_id(d);
        let n = text.len().min(len as usize - 1);
        // SAFETY: writes at most `len` bytes into the caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), out.cast(), n);
            *out.add(n) = 0;
        }
        SUCCESS
    })
}

pub unsafe extern "C" fn cuda_device_get_stream_priority_range(least: *mut c_int, greatest: *mut c_int) -> i32 {
    call("cudaDeviceGetStreamPriorityRange", || {
        enter!();
        // Either output may be NULL.
        if !least.is_null() {
            put(least, super::streams::LEAST_PRIORITY);
        }
        if !greatest.is_null() {
            put(greatest, super::streams::GREATEST_PRIORITY);
        }
        SUCCESS
    })
}

/// Peer access enabled from the thread's current device to each other device.
static PEER_ENABLED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

pub unsafe extern "C" fn cuda_device_can_access_peer(can: *mut c_int, dev: c_int, peer: c_int) -> i32 {
    call("cudaDeviceCanAccessPeer", || {
        match (sim().valid_device(dev as i64), sim().valid_device(peer as i64)) {
            // All simulated devices of a node share one host: every pair can reach each other.
            (Some(a), Some(b)) => put(can, c_int::from(a != b)),
            _ => INVALID_DEVICE,
        }
    })
}

pub unsafe extern "C" fn cuda_device_enable_peer_access(peer: c_int, flags: c_uint) -> i32 {
    call("cudaDeviceEnablePeerAccess", || {
        let dev = enter!();
        let Some(peer) = sim().valid_device(peer as i64) else { return INVALID_DEVICE };
        if flags != 0 || peer == dev {
            return INVALID_VALUE;
        }
        let mut enabled = PEER_ENABLED.lock().unwrap_or_else(|e| e.into_inner());
        if enabled.contains(&(dev, peer)) {
            return PEER_ACCESS_ALREADY_ENABLED;
        }
        enabled.push((dev, peer));
        SUCCESS
    })
}

pub unsafe extern "C" fn cuda_device_disable_peer_access(peer: c_int) -> i32 {
    call("cudaDeviceDisablePeerAccess", || {
        let dev = enter!();
        let Some(peer) = sim().valid_device(peer as i64) else { return INVALID_DEVICE };
        let mut enabled = PEER_ENABLED.lock().unwrap_or_else(|e| e.into_inner());
        match enabled.iter().position(|p| *p == (dev, peer)) {
            Some(i) => {
                enabled.remove(i);
                SUCCESS
            }
            None => PEER_ACCESS_NOT_ENABLED,
        }
    })
}

pub unsafe extern "C" fn cuda_device_synchronize() -> i32 {
    call("cudaDeviceSynchronize", || {
        let dev = enter!();
        sim().synchronize(Some(dev))
    })
}

pub unsafe extern "C" fn cuda_device_reset() -> i32 {
    call("cudaDeviceReset", || {
        let dev = enter!();
        sim().synchronize(Some(dev))
    })
}

pub unsafe extern "C" fn cuda_runtime_get_version(v: *mut c_int) -> i32 {
    rt(put(v, RUNTIME_VERSION))
}

pub unsafe extern "C" fn cuda_driver_get_version(v: *mut c_int) -> i32 {
    rt(put(v, RUNTIME_VERSION))
}

pub unsafe extern "C" fn cuda_profiler_start() -> i32 {
    SUCCESS
}

pub unsafe extern "C" fn cuda_profiler_stop() -> i32 {
    SUCCESS
}

/// Finds a driver function of this library by its base name, as `cuGetProcAddress` does: the
/// versioned export (`_v2`) wins over the plain one. Only driver names (`cu` + capital).
pub fn driver_entry(symbol: &str) -> Option<*mut c_void> {
    let bytes = symbol.as_bytes();
    if bytes.len() < 3 || !symbol.starts_with("cu") || !bytes[2].is_ascii_uppercase() {
        return None;
    }
    let handle = own_handle()?;
    [format!("{symbol}_v2"), symbol.to_string()].iter().find_map(|name| {
        let c = std::ffi::CString::new(name.as_str()).ok()?;
        // SAFETY: a lookup in our own, loaded library.
        let f = unsafe { libc::dlsym(handle as *mut c_void, c.as_ptr()) };
        (!f.is_null()).then_some(f)
    })
}

/// A handle to this very library (whatever name it was loaded under).
fn own_handle() -> Option<usize> {
    static HANDLE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *HANDLE.get_or_init(|| {
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: dladdr on one of our own functions fills `info` with our file name.
        if unsafe { libc::dladdr(driver_entry as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: the file is loaded (we run from it); NOLOAD only returns its handle.
        let h = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        (!h.is_null()).then_some(h as usize)
    })
}

pub unsafe extern "C" fn cuda_get_driver_entry_point_by_version(
    symbol: *const c_char,
    func: *mut *mut c_void,
    version: c_uint,
    _flags: c_ulonglong,
    status: *mut c_int,
) -> i32 {
    call("cudaGetDriverEntryPointByVersion", || {
        if symbol.is_null() || func.is_null() {
            return INVALID_VALUE;
        }
        if version as i32 > RUNTIME_VERSION {
            return INVALID_VALUE;
        }
        // SAFETY: the caller passes a NUL-terminated name.
        let name = unsafe { std::ffi::CStr::from_ptr(symbol) }.to_string_lossy();
        let found = driver_entry(&name);
        // A missing symbol is a success with a NULL pointer and a "not found" status.
        put(func, found.unwrap_or(std::ptr::null_mut()));
        if !status.is_null() {
            put(status, if found.is_some() { 0 } else { 1 });
        }
        SUCCESS
    })
}

pub unsafe extern "C" fn cuda_get_driver_entry_point(
    symbol: *const c_char,
    func: *mut *mut c_void,
    flags: c_ulonglong,
    status: *mut c_int,
) -> i32 {
    // SAFETY: same contract, at the presented version.
    unsafe { cuda_get_driver_entry_point_by_version(symbol, func, RUNTIME_VERSION as c_uint, flags, status) }
}
