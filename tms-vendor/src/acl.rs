//! The Ascend runtime's virtual-memory structs (CANN runtime API reference, acl_rt.h:
//! aclrtMallocPhysical, aclrtMemSetAccess).

use std::ffi::c_int;
use std::mem::{offset_of, size_of};

/// ACL_MEM_HANDLE_TYPE_NONE.
pub const MEM_HANDLE_TYPE_NONE: c_int = 0;
/// ACL_MEM_ALLOCATION_TYPE_PINNED.
pub const MEM_ALLOCATION_TYPE_PINNED: c_int = 0;
/// ACL_MEM_LOCATION_TYPE_DEVICE.
pub const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// ACL_HBM_MEM_HUGE, the aclrtMemAttr of huge-page device memory.
pub const HBM_MEM_HUGE: c_int = 4;

/// aclrtMemcpyKind (acl_rt.h; CANN runtime API, aclrtMemcpy).
pub const MEMCPY_HOST_TO_HOST: c_int = 0;
pub const MEMCPY_HOST_TO_DEVICE: c_int = 1;
pub const MEMCPY_DEVICE_TO_HOST: c_int = 2;
pub const MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
/// The runtime tells the direction from the addresses.
pub const MEMCPY_DEFAULT: c_int = 4;

/// aclrtMemLocation: `{uint32_t id; aclrtMemLocationType type;}` (id first, unlike CUDA's).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemLocation {
    pub id: u32,
    pub kind: c_int,
}

/// aclrtPhysicalMemProp: `{aclrtMemHandleType handleType; aclrtMemAllocationType
/// allocationType; aclrtMemAttr memAttr; aclrtMemLocation location; uint64_t reserve;}`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhysicalMemProp {
    pub handle_type: c_int,
    pub allocation_type: c_int,
    pub mem_attr: c_int,
    pub location: MemLocation,
    pub reserve: u64,
}

impl PhysicalMemProp {
    /// Pinned memory of attribute `mem_attr` (an aclrtMemAttr) on device `id`.
    pub fn pinned_on(id: u32, mem_attr: c_int) -> PhysicalMemProp {
        PhysicalMemProp {
            handle_type: MEM_HANDLE_TYPE_NONE,
            allocation_type: MEM_ALLOCATION_TYPE_PINNED,
            mem_attr,
            location: MemLocation { id, kind: MEM_LOCATION_TYPE_DEVICE },
            reserve: 0,
        }
    }
}

/// aclrtMemAccessDesc: `{aclrtMemAccessFlags flags; aclrtMemLocation location; uint8_t
/// rsv[12];}`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemAccessDesc {
    pub flags: c_int,
    pub location: MemLocation,
    pub rsv: [u8; 12],
}

const _: () = assert!(size_of::<MemLocation>() == 8);
const _: () = assert!(size_of::<PhysicalMemProp>() == 32);
const _: () = assert!(offset_of!(PhysicalMemProp, mem_attr) == 8);
const _: () = assert!(offset_of!(PhysicalMemProp, location) == 12);
const _: () = assert!(offset_of!(PhysicalMemProp, reserve) == 24);
const _: () = assert!(size_of::<MemAccessDesc>() == 24);
const _: () = assert!(offset_of!(MemAccessDesc, location) == 4);

/// The name and meaning of an Ascend runtime error code (CANN, acl_base.h and the runtime API
/// reference's error codes), for messages that would otherwise show a bare number.
pub fn error(code: c_int) -> Option<(&'static str, &'static str)> {
    Some(match code {
        100_000 => ("ACL_ERROR_INVALID_PARAM", "an argument was invalid"),
        107_000 => ("ACL_ERROR_RT_PARAM_INVALID", "an argument was invalid (or memory was not mapped)"),
        107_001 => ("ACL_ERROR_RT_INVALID_DEVICEID", "no such device"),
        107_002 => ("ACL_ERROR_RT_CONTEXT_NULL", "no context on this thread (aclrtSetDevice first)"),
        200_000 => ("ACL_ERROR_BAD_ALLOC", "host memory allocation failed"),
        207_000 => ("ACL_ERROR_RT_FEATURE_NOT_SUPPORT", "the operation is not supported here"),
        207_001 => ("ACL_ERROR_RT_MEMORY_ALLOCATION", "the device is out of memory"),
        207_002 => ("ACL_ERROR_RT_MEMORY_FREE", "freeing device memory failed"),
        507_899 => ("ACL_ERROR_RT_INTERNAL_ERROR", "an internal runtime error"),
        _ => return None,
    })
}
