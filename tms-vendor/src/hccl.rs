//! HCCL's structs (CANN, hccl_types.h).

use std::mem::{offset_of, size_of};

/// HCCL_ROOT_INFO_BYTES.
pub const ROOT_INFO_BYTES: usize = 4108;
/// HCCL_COMM_CONFIG_MAGIC_WORD, written by HcclCommConfigInit.
pub const CONFIG_MAGIC: u32 = 0xf0f0_f0f0;
/// HCCL_COMM_BUFFSIZE_CONFIG_NOT_SET.
pub const BUFFSIZE_NOT_SET: u32 = 0xffff_ffff;

/// HcclRootInfo: `{char internal[HCCL_ROOT_INFO_BYTES];}`, passed by pointer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootInfo {
    pub internal: [u8; ROOT_INFO_BYTES],
}

/// The head every HcclCommConfig version starts with (`size`, `magicWord`, `version`, a reserved
/// 8 bytes) and its first field, `hcclBufferSize` (MB).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommConfigHead {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub reserved: u64,
    pub buffer_size_mb: u32,
}

const _: () = assert!(size_of::<RootInfo>() == 4108);
const _: () = assert!(offset_of!(CommConfigHead, magic) == 8);
const _: () = assert!(offset_of!(CommConfigHead, reserved) == 16);
const _: () = assert!(offset_of!(CommConfigHead, buffer_size_mb) == 24);
