//! The Ascend front end: ACL (`libascendcl.so`, with its IPC calls) and HCCL (`libhccl.so`), each
//! turning the core's errors into its own codes. This module holds the state they share: the
//! thread's device and context, and the process's contexts. Faults are reported per call here,
//! never sticky, and the default stream has no legacy rule, so the core's current context
//! (`core::context`) is never set by this front end.

mod exports;

pub mod acl;
pub mod acl_ipc;
pub mod hccl;

use crate::core::config::MAX_DEVICES;
use std::cell::Cell;
use std::sync::atomic::AtomicBool;

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
    crate::core::context::open(&ACL_ACTIVE, dev, crate::core::config::ACL_CONTEXT_BYTES)
}
