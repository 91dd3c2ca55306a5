//! The CUDA driver's virtual-memory structs (cuda.h; CUDA Driver API reference, "Virtual Memory
//! Management": cuMemCreate, cuMemSetAccess, cuMemGetAllocationGranularity) and the runtime's IPC
//! handle (driver_types.h; CUDA Runtime API reference, "Device Management": cudaIpcGetMemHandle).

use std::ffi::{c_int, c_uint, c_void};
use std::mem::{offset_of, size_of};

/// CU_MEM_ALLOCATION_TYPE_PINNED: the one allocation type cuMemCreate takes.
pub const ALLOCATION_TYPE_PINNED: c_int = 1;
/// CU_MEM_LOCATION_TYPE_DEVICE.
pub const LOCATION_TYPE_DEVICE: c_int = 1;
/// CUmemAccess_flags.
pub const ACCESS_FLAGS_PROT_NONE: c_int = 0;
pub const ACCESS_FLAGS_PROT_READ: c_int = 1;
pub const ACCESS_FLAGS_PROT_READWRITE: c_int = 3;

/// cudaMemcpyKind (driver_types.h; CUDA Runtime API, "Memory Management").
pub const MEMCPY_HOST_TO_HOST: c_int = 0;
pub const MEMCPY_HOST_TO_DEVICE: c_int = 1;
pub const MEMCPY_DEVICE_TO_HOST: c_int = 2;
pub const MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
/// The pointers say which side is which (unified virtual addressing).
pub const MEMCPY_DEFAULT: c_int = 4;

/// Stream creation flags (cudaStreamDefault, cudaStreamNonBlocking; CU_STREAM_DEFAULT and
/// CU_STREAM_NON_BLOCKING have the same values).
pub const STREAM_DEFAULT: c_uint = 0;
pub const STREAM_NON_BLOCKING: c_uint = 1;
/// The reserved stream handles `cudaStreamLegacy`/`CU_STREAM_LEGACY` and
/// `cudaStreamPerThread`/`CU_STREAM_PER_THREAD` (driver_types.h, cuda.h).
pub const STREAM_LEGACY: usize = 1;
pub const STREAM_PER_THREAD: usize = 2;

/// CUmemLocation: `{CUmemLocationType type; int id;}`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemLocation {
    pub kind: c_int,
    pub id: c_int,
}

impl MemLocation {
    pub fn device(id: c_int) -> MemLocation {
        MemLocation { kind: LOCATION_TYPE_DEVICE, id }
    }
}

/// CUmemAllocationProp's `allocFlags`: `{unsigned char compressionType; unsigned char
/// gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4];}`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// CUmemAllocationProp: `{CUmemAllocationType type; CUmemAllocationHandleType
/// requestedHandleTypes; CUmemLocation location; void *win32HandleMetaData; allocFlags}`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AllocationProp {
    pub kind: c_int,
    pub requested_handle_types: c_int,
    pub location: MemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: AllocFlags,
}

impl AllocationProp {
    /// Pinned memory on device `id`, no shareable handle, no flags.
    pub fn pinned_on(id: c_int) -> AllocationProp {
        AllocationProp {
            kind: ALLOCATION_TYPE_PINNED,
            requested_handle_types: 0,
            location: MemLocation::device(id),
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: AllocFlags::default(),
        }
    }
}

/// CUmemAccessDesc: `{CUmemLocation location; CUmemAccess_flags flags;}`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccessDesc {
    pub location: MemLocation,
    pub flags: c_int,
}

/// CUDA_IPC_HANDLE_SIZE.
pub const IPC_HANDLE_SIZE: usize = 64;
/// cudaIpcMemLazyEnablePeerAccess, the one flag of cudaIpcOpenMemHandle.
pub const IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// cudaIpcMemHandle_t and cudaIpcEventHandle_t: `{char reserved[CUDA_IPC_HANDLE_SIZE];}`, passed
/// by value. Bytes (`u8`) whatever the sign of `char`: only the runtime that made one reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcHandle {
    pub reserved: [u8; IPC_HANDLE_SIZE],
}

const _: () = assert!(size_of::<MemLocation>() == 8);
const _: () = assert!(size_of::<AllocFlags>() == 8);
const _: () = assert!(offset_of!(AllocFlags, gpu_direct_rdma_capable) == 1);
const _: () = assert!(offset_of!(AllocFlags, usage) == 2);
const _: () = assert!(size_of::<AllocationProp>() == 32);
const _: () = assert!(offset_of!(AllocationProp, location) == 8);
const _: () = assert!(offset_of!(AllocationProp, win32_handle_meta_data) == 16);
const _: () = assert!(offset_of!(AllocationProp, alloc_flags) == 24);
const _: () = assert!(size_of::<AccessDesc>() == 12);
const _: () = assert!(offset_of!(AccessDesc, flags) == 8);
const _: () = assert!(size_of::<IpcHandle>() == 64);
const _: () = assert!(offset_of!(IpcHandle, reserved) == 0);

/// The name and meaning of a CUDA driver or runtime error code (the two share these numbers:
/// CUDA Driver API reference, "CUresult"; CUDA Runtime API reference, "cudaError"), for messages
/// that would otherwise show a bare number.
pub fn error(code: c_int) -> Option<(&'static str, &'static str)> {
    Some(match code {
        1 => ("CUDA_ERROR_INVALID_VALUE", "an argument was out of range"),
        2 => ("CUDA_ERROR_OUT_OF_MEMORY", "the device is out of memory"),
        3 => ("CUDA_ERROR_NOT_INITIALIZED", "the driver was not initialized"),
        4 => ("CUDA_ERROR_DEINITIALIZED", "the driver is shutting down"),
        101 => ("CUDA_ERROR_INVALID_DEVICE", "no such device"),
        201 => ("CUDA_ERROR_INVALID_CONTEXT", "no valid context on this thread"),
        400 => ("CUDA_ERROR_INVALID_HANDLE", "an invalid handle (a stream, event or memory handle)"),
        700 => (
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            "a copy or kernel touched memory that is not mapped (memory paused under it, freed, or out of \
             bounds); on a GPU the context is dead from then on: restart the process",
        ),
        719 => ("CUDA_ERROR_LAUNCH_FAILED", "a kernel failed; the context is dead: restart the process"),
        800 => ("CUDA_ERROR_NOT_PERMITTED", "the operation is not permitted"),
        801 => ("CUDA_ERROR_NOT_SUPPORTED", "the operation is not supported here"),
        999 => ("CUDA_ERROR_UNKNOWN", "an unknown error"),
        _ => return None,
    })
}
