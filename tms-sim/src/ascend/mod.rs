//! The Ascend front end: ACL (`libascendcl.so`, with its IPC calls) and HCCL (`libhccl.so`), each
//! turning the core's errors into its own codes.

mod exports;

pub mod acl;
pub mod acl_ipc;
pub mod hccl;
