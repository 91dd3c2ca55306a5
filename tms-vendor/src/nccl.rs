//! NCCL's structs (nccl.h).

use std::ffi::c_int;
use std::mem::{offset_of, size_of};

/// NCCL_UNIQUE_ID_BYTES.
pub const UNIQUE_ID_BYTES: usize = 128;
/// NCCL_API_MAGIC, which NCCL_CONFIG_INITIALIZER puts in ncclConfig_t.magic.
pub const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// NCCL_SUSPEND_MEM, the one flag of ncclCommSuspend.
pub const SUSPEND_MEM: c_int = 0x01;

/// ncclUniqueId: `{char internal[NCCL_UNIQUE_ID_BYTES];}`, passed by value. Bytes (`u8`) here
/// whatever the sign of `char` on the target: nothing reads them as characters.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniqueId {
    pub internal: [u8; UNIQUE_ID_BYTES],
}

/// The leading fields every ncclConfig_t layout (NCCL 2.14 on) shares: `{size_t size; unsigned
/// int magic; unsigned int version; int blocking; ...}`, set by NCCL_CONFIG_INITIALIZER.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConfigHead {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
}

const _: () = assert!(size_of::<UniqueId>() == 128);
const _: () = assert!(offset_of!(ConfigHead, magic) == 8);
const _: () = assert!(offset_of!(ConfigHead, version) == 12);
const _: () = assert!(offset_of!(ConfigHead, blocking) == 16);
