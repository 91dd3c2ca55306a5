//! A minimal NVML (`libnvidia-ml.so.1`): what PyTorch (`torch.cuda.device_memory_used`, the
//! caching allocator's OOM report, expandable segments' fabric query, peer-access checks) and the
//! `nvidia-ml-py` package call. Memory figures are the node's: every process of the simulated
//! node, as `nvidia-smi` shows a whole GPU. Signatures and struct layouts follow nvml.h of CUDA
//! 13.2 (NVML_API_VERSION 13).

use crate::core::sim::{guard, sim};
use crate::cuda::CUDA_VERSION as RUNTIME_VERSION;
use libc::{c_char, c_int, c_uint, c_void};

pub const SUCCESS: i32 = 0;
pub const INVALID_ARGUMENT: i32 = 2;
pub const NOT_SUPPORTED: i32 = 3;
pub const NOT_FOUND: i32 = 6;
pub const INSUFFICIENT_SIZE: i32 = 7;
pub const UNKNOWN: i32 = 999;

/// Device handles are addresses inside this array, one byte per device.
static DEVICE_TOKENS: [u8; crate::core::config::MAX_DEVICES] = [0; crate::core::config::MAX_DEVICES];

fn handle_of(dev: usize) -> *mut c_void {
    &DEVICE_TOKENS[dev] as *const u8 as *mut c_void
}

fn device_of(handle: *mut c_void) -> Option<usize> {
    let base = DEVICE_TOKENS.as_ptr() as usize;
    let p = handle as usize;
    (p >= base && p < base + DEVICE_TOKENS.len()).then(|| p - base).filter(|d| *d < sim().devices())
}

fn call(body: impl FnOnce() -> i32) -> i32 {
    guard(UNKNOWN, body)
}

fn put<T>(out: *mut T, value: T) -> i32 {
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; the caller provides a writable location.
    unsafe { out.write(value) };
    SUCCESS
}

fn put_str(out: *mut c_char, len: c_uint, text: &str) -> i32 {
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    if text.len() >= len as usize {
        return INSUFFICIENT_SIZE;
    }
    // SAFETY: `text.len() + 1 <= len` bytes go into the caller's buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), out.cast(), text.len());
        *out.add(text.len()) = 0;
    }
    SUCCESS
}

/// The PCI bus id the CUDA runtime reports for `dev` (cudaDeviceGetPCIBusId).
pub fn pci_bus_id(dev: usize) -> String {
    format!("00000000:{:02X}:00.0", dev + 0x18)
}

pub unsafe extern "C" fn nvml_init() -> i32 {
    call(|| {
        sim();
        SUCCESS
    })
}

pub unsafe extern "C" fn nvml_init_with_flags(_flags: c_uint) -> i32 {
    // SAFETY: no arguments.
    unsafe { nvml_init() }
}

pub unsafe extern "C" fn nvml_shutdown() -> i32 {
    SUCCESS
}

pub unsafe extern "C" fn nvml_error_string(code: c_int) -> *const c_char {
    match code {
        SUCCESS => c"Success",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported (by tms-sim)",
        NOT_FOUND => c"Not Found",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        _ => c"Unknown Error",
    }
    .as_ptr()
}

pub unsafe extern "C" fn nvml_system_get_cuda_driver_version(version: *mut c_int) -> i32 {
    call(|| put(version, RUNTIME_VERSION))
}

pub unsafe extern "C" fn nvml_device_get_count(count: *mut c_uint) -> i32 {
    call(|| put(count, sim().devices() as c_uint))
}

pub unsafe extern "C" fn nvml_device_get_handle_by_index(index: c_uint, handle: *mut *mut c_void) -> i32 {
    call(|| match sim().valid_device(index as i64) {
        Some(d) => put(handle, handle_of(d)),
        None => INVALID_ARGUMENT,
    })
}

pub unsafe extern "C" fn nvml_device_get_handle_by_pci_bus_id(bus_id: *const c_char, handle: *mut *mut c_void) -> i32 {
    call(|| {
        if bus_id.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let wanted = unsafe { std::ffi::CStr::from_ptr(bus_id) }.to_string_lossy().to_ascii_uppercase();
        // Both the 8-digit ("00000000:18:00.0") and 4-digit ("0000:18:00.0") domain forms.
        let matches = |d: usize| {
            let full = pci_bus_id(d);
            wanted == full || wanted == full[4..]
        };
        match (0..sim().devices()).find(|d| matches(*d)) {
            Some(d) => put(handle, handle_of(d)),
            None => NOT_FOUND,
        }
    })
}

pub unsafe extern "C" fn nvml_device_get_index(handle: *mut c_void, index: *mut c_uint) -> i32 {
    call(|| match device_of(handle) {
        Some(d) => put(index, d as c_uint),
        None => INVALID_ARGUMENT,
    })
}

pub unsafe extern "C" fn nvml_device_get_name(handle: *mut c_void, name: *mut c_char, len: c_uint) -> i32 {
    call(|| match device_of(handle) {
        Some(d) => put_str(name, len, &format!("NVIDIA H100 80GB HBM3 (tms-sim {d})")),
        None => INVALID_ARGUMENT,
    })
}

pub unsafe extern "C" fn nvml_device_get_uuid(handle: *mut c_void, uuid: *mut c_char, len: c_uint) -> i32 {
    call(|| match device_of(handle) {
        Some(d) => put_str(uuid, len, &format!("GPU-746d732d-7369-6d2d-6465-7669636500{d:02x}")),
        None => INVALID_ARGUMENT,
    })
}

/// `nvmlMemory_t` (v1): used includes everything allocated on the device.
#[repr(C)]
pub struct Memory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct MemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}
const _: () = assert!(std::mem::size_of::<Memory>() == 24);
const _: () = assert!(std::mem::size_of::<MemoryV2>() == 40);
const MEMORY_V2: c_uint = 0x0200_0028;

pub unsafe extern "C" fn nvml_device_get_memory_info(handle: *mut c_void, memory: *mut Memory) -> i32 {
    call(|| match device_of(handle) {
        Some(d) => {
            let (free, total) = sim().mem_info(d);
            put(memory, Memory { total, free, used: total - free })
        }
        None => INVALID_ARGUMENT,
    })
}

pub unsafe extern "C" fn nvml_device_get_memory_info_v2(handle: *mut c_void, memory: *mut MemoryV2) -> i32 {
    call(|| {
        let Some(d) = device_of(handle) else { return INVALID_ARGUMENT };
        if memory.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: checked non-null; the caller sets the version first.
        if unsafe { (*memory).version } != MEMORY_V2 {
            return 25; // NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        }
        let (free, total) = sim().mem_info(d);
        put(memory, MemoryV2 { version: MEMORY_V2, total, reserved: 0, free, used: total - free })
    })
}

/// `nvmlProcessInfo_v1_t` (what the unversioned entry point fills).
#[repr(C)]
pub struct ProcessInfoV1 {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
}

/// `nvmlProcessInfo_t` (v2/v3 entry points).
#[repr(C)]
pub struct ProcessInfo {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}
const _: () = assert!(std::mem::size_of::<ProcessInfoV1>() == 16);
const _: () = assert!(std::mem::size_of::<ProcessInfo>() == 24);

fn running_processes<T>(handle: *mut c_void, count: *mut c_uint, infos: *mut T, make: impl Fn(u32, u64) -> T) -> i32 {
    let Some(d) = device_of(handle) else { return INVALID_ARGUMENT };
    if count.is_null() {
        return INVALID_ARGUMENT;
    }
    let list = sim().node.processes_on(d);
    // SAFETY: checked non-null.
    let room = unsafe { *count } as usize;
    put(count, list.len() as c_uint);
    if list.len() > room || (infos.is_null() && !list.is_empty()) {
        return INSUFFICIENT_SIZE;
    }
    for (i, (pid, used)) in list.into_iter().enumerate() {
        // SAFETY: `room` entries were provided and i < list.len() <= room.
        unsafe { infos.add(i).write(make(pid, used)) };
    }
    SUCCESS
}

pub unsafe extern "C" fn nvml_device_get_compute_running_processes_v1(
    handle: *mut c_void,
    count: *mut c_uint,
    infos: *mut ProcessInfoV1,
) -> i32 {
    call(|| running_processes(handle, count, infos, |pid, used_gpu_memory| ProcessInfoV1 { pid, used_gpu_memory }))
}

pub unsafe extern "C" fn nvml_device_get_compute_running_processes(
    handle: *mut c_void,
    count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> i32 {
    call(|| {
        running_processes(handle, count, infos, |pid, used_gpu_memory| ProcessInfo {
            pid,
            used_gpu_memory,
            gpu_instance_id: u32::MAX,
            compute_instance_id: u32::MAX,
        })
    })
}

/// `nvmlUtilization_t`: nothing runs on the simulated device.
#[repr(C)]
pub struct Utilization {
    pub gpu: c_uint,
    pub memory: c_uint,
}

pub unsafe extern "C" fn nvml_device_get_utilization_rates(handle: *mut c_void, rates: *mut Utilization) -> i32 {
    call(|| match device_of(handle) {
        Some(_) => put(rates, Utilization { gpu: 0, memory: 0 }),
        None => INVALID_ARGUMENT,
    })
}

/// `nvmlGpuFabricInfo_v3_t`: the simulated devices sit on no NVLink fabric.
#[repr(C)]
pub struct FabricInfoV3 {
    pub version: c_uint,
    pub cluster_uuid: [u8; 16],
    pub status: c_int,
    pub clique_id: c_uint,
    pub state: u8,
    pub health_mask: c_uint,
    pub health_summary: u8,
}
const _: () = assert!(std::mem::size_of::<FabricInfoV3>() == 40);
const _: () = assert!(std::mem::offset_of!(FabricInfoV3, state) == 28);
const FABRIC_INFO_V3: c_uint = 0x0300_0028;

/// As on a GPU outside an NVLink fabric: success, with the fabric state "not supported" (0).
pub unsafe extern "C" fn nvml_device_get_gpu_fabric_info_v(handle: *mut c_void, info: *mut FabricInfoV3) -> i32 {
    call(|| {
        if device_of(handle).is_none() || info.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: checked non-null; the caller sets the version first.
        if unsafe { (*info).version } != FABRIC_INFO_V3 {
            return 25; // NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        }
        put(
            info,
            FabricInfoV3 {
                version: FABRIC_INFO_V3,
                cluster_uuid: [0; 16],
                status: SUCCESS,
                clique_id: 0,
                state: 0,
                health_mask: 0,
                health_summary: 0,
            },
        )
    })
}

/// NVLink, fabric and peer-to-peer queries: the simulated devices have no NVLink or fabric.
pub unsafe extern "C" fn nvml_not_supported() -> i32 {
    NOT_SUPPORTED
}
