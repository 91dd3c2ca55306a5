//! The Ascend front end: ACL (`libascendcl.so`, with its IPC calls) and HCCL (`libhccl.so`), each
//! turning the core's errors into its own codes. This module holds the state they share: the
//! thread's device and context, and the process's contexts. Faults are reported per call here,
//! never sticky, and the default stream has no legacy rule, so the core's current context
//! (`core::context`) is never set by this front end.

mod exports;

pub mod acl;
pub mod acl_events;
pub mod acl_ipc;
pub mod cann;
pub mod hccl;

use crate::core::config::MAX_DEVICES;
use crate::core::sim::CopyDirection;
use crate::core::streams::{DefaultStream, StreamId};
use std::cell::Cell;
use std::sync::atomic::AtomicBool;
use tms_vendor::acl as v;

/// What an Ascend process's device context takes: about 200 MB seen on a 910B2 after
/// aclrtSetDevice (hw-native-sys/simpler#2422; no vendor figure).
pub const CONTEXT_BYTES: u64 = 200 << 20;

/// The core's stream for an `aclrtStream`: null is the device's default stream. 1 and 2 name no
/// ACL stream; the simulator has always taken them as default streams too (they are CUDA's
/// reserved handles), and a program passing one keeps that behaviour.
pub fn stream_id(handle: usize) -> StreamId {
    match handle {
        0 | 1 => StreamId::Default(DefaultStream::Legacy),
        2 => StreamId::Default(DefaultStream::PerThread),
        h => StreamId::Created(h),
    }
}

/// An `aclrtMemcpyKind`; None for a value CANN refuses.
pub fn copy_direction(kind: i32) -> Option<CopyDirection> {
    Some(match kind {
        v::MEMCPY_HOST_TO_HOST => CopyDirection::HostToHost,
        v::MEMCPY_HOST_TO_DEVICE => CopyDirection::HostToDevice,
        v::MEMCPY_DEVICE_TO_HOST => CopyDirection::DeviceToHost,
        v::MEMCPY_DEVICE_TO_DEVICE => CopyDirection::DeviceToDevice,
        v::MEMCPY_DEFAULT => CopyDirection::Inferred,
        _ => return None,
    })
}

thread_local! {
    /// ACL device/context of this thread: 0 for none, else device + 1.
    pub static ACL_DEVICE: Cell<usize> = const { Cell::new(0) };
}

/// Opaque context handles are addresses inside this array, one byte per device.
pub static ACL_CTX_TOKENS: [u8; MAX_DEVICES] = [0; MAX_DEVICES];

/// Whether this process has an Ascend context on each device.
static ACL_ACTIVE: [AtomicBool; MAX_DEVICES] = [const { AtomicBool::new(false) }; MAX_DEVICES];

/// Creates the process's Ascend context on `dev` if needed; false: the device is full.
pub fn open_acl_context(dev: usize) -> bool {
    crate::core::context::open(&ACL_ACTIVE, dev, CONTEXT_BYTES)
}
