//! The simulator's core: device memory and its mirror, streams and events, captured graphs, the
//! node's shared accounting, the timing model and fault injection. It knows no vendor: it reports
//! `MemError`s and plain facts (a device has faulted), and each front end (CUDA runtime, driver,
//! NVML, ACL, NCCL, HCCL) turns them into its own ABI's codes.

pub mod collectives;
pub mod config;
pub mod context;
pub mod fault;
pub mod gil;
pub mod graphs;
pub mod memory;
pub mod node;
pub mod sim;
pub mod streams;
pub mod timing;
