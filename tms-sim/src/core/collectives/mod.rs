//! Collective communication between simulated devices, shared by the NCCL and HCCL front ends.
//!
//! A communicator's ranks are processes (or threads) that joined with one unique id
//! (`transport.rs`). Each operation is queued on the caller's stream and runs when the stream
//! reaches it, asynchronously to the host; the data really moves between the ranks' simulated
//! device memory, and a transfer takes at least the time the modelled link needs (`comm.rs`).
//! This module knows no vendor: it reports `CollError`s, which each front end maps to its codes.

pub mod comm;
pub mod reduce;
pub mod transport;

pub use comm::{Comm, CommConfig, Op};
pub use transport::UniqueId;

use crate::core::memory::MemError;

/// Element types the front ends can name (each maps its own numbering onto these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    I8,
    U8,
    I16,
    U16,
    I32,
    U32,
    I64,
    U64,
    F16,
    F32,
    F64,
    BF16,
    F8E4M3,
    F8E5M2,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// Whether reductions are modelled for the type (8-bit floats are moved, not reduced).
    pub fn reducible(self) -> bool {
        !matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::F32 | DType::F64 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2)
    }

    fn code(self) -> u64 {
        self as u64
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RedOp {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
    /// Each contribution multiplied by the scalar, then summed (ncclRedOpCreatePreMulSum).
    PreMulSum(f64),
}

impl RedOp {
    fn code(self) -> u64 {
        match self {
            RedOp::Sum => 0,
            RedOp::Prod => 1,
            RedOp::Max => 2,
            RedOp::Min => 3,
            RedOp::Avg => 4,
            RedOp::PreMulSum(s) => 5 ^ s.to_bits().rotate_left(8),
        }
    }
}

/// Why a collective call or a communicator failed, as the core sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum CollError {
    /// A bad argument of this call (null buffer, root or peer out of range, count too large).
    InvalidArgument(String),
    /// A call that is valid alone but not here: ranks that disagree on an operation, an id
    /// refused by the root, a communicator already destroyed.
    InvalidUsage(String),
    /// A peer is gone: its connection closed (it exited, was killed or aborted).
    Remote(String),
    /// Ranks did not come together within the connect timeout.
    Timeout(String),
    /// The communicator was aborted locally.
    Aborted,
    /// The operation touched device memory it could not (unmapped, freed): a device fault.
    Device(MemError),
    /// The device has no room for the communicator's buffers.
    OutOfMemory(String),
    /// A host resource failed (sockets, threads).
    System(String),
    Internal(String),
}

impl std::fmt::Display for CollError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CollError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            CollError::InvalidUsage(m) => write!(f, "invalid usage: {m}"),
            CollError::Remote(m) => write!(f, "remote error: {m}"),
            CollError::Timeout(m) => write!(f, "timeout: {m}"),
            CollError::Aborted => write!(f, "the communicator was aborted"),
            CollError::Device(e) => {
                write!(f, "device fault during a collective ({e:?}): its buffer is not accessible device memory")
            }
            CollError::OutOfMemory(m) => write!(f, "out of device memory: {m}"),
            CollError::System(m) => write!(f, "system error: {m}"),
            CollError::Internal(m) => write!(f, "internal error: {m}"),
        }
    }
}
