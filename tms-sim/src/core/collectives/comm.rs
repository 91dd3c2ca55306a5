//! A communicator: its ranks' connections, the operations queued on streams, its buffers' device
//! memory, and its error state.
//!
//! - Every operation is numbered when the host issues it (collectives in one sequence, sends and
//!   receives per peer, as NCCL matches them), so ranks agree on which messages belong together
//!   whatever their streams' timing. A collective starts with every rank telling every other
//!   what it called (operation, count, type, reduction, root): ranks that disagree fail the
//!   operation with a message naming both calls, instead of mixing data.
//! - Data moves in chunks of `CHUNK`; a reduction combines the ranks' chunks in rank order
//!   (`reduce.rs` documents the arithmetic).
//! - Link time: an operation books the rank's link for the bytes the ring algorithm would put
//!   on it (nccl-tests' bus-bandwidth factors: broadcast and reduce S, all-reduce 2(n-1)/n S,
//!   all-gather, reduce-scatter, all-to-all and gather (n-1) times one rank's share, send S) at
//!   `TMS_SIM_LINK_GBPS` (the inter-node rate when any peer is on another simulated node), and
//!   each chunk lands no earlier than its share of that time. The host's own speed is the floor.
//! - Errors: the first failure of an operation becomes the communicator's asynchronous error
//!   (what ncclCommGetAsyncError reports); later operations fail at once. A device fault (a
//!   buffer unmapped by a pause) is also returned to the stream, where the front end makes it
//!   the runtime's sticky error, as a faulting kernel does.
//! - Registration: a buffer registered with the communicator (`register`, ncclCommRegister) or
//!   by a graph's capture (NCCL registers captured collectives' buffers unless
//!   `NCCL_GRAPH_REGISTER=0`) pins the physical memory mapped there at that moment. A device's
//!   NCCL goes on using those pages whatever is mapped at the address later, so an operation on
//!   a registered range whose physical memory changed since (unmapped, released, another
//!   allocation mapped at the same address) is never run on the new memory: it waits
//!   `TMS_SIM_NCCL_STALE_TIMEOUT` seconds (10) and fails on every rank with ncclSystemError,
//!   naming the registration.

use super::reduce;
use super::transport::{Mesh, UniqueId};
use super::{CollError, DType, RedOp};
use crate::core::memory::MemError;
use crate::core::sim::sim;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Bytes moved per message.
pub const CHUNK: usize = 4 << 20;

/// The header a rank sends instead of its call when it cannot take part (a stale registration),
/// so that the others fail too instead of waiting for data that will never come.
const STALE: u64 = u64::MAX;

/// Physical memory a registration pinned: what made it, the range, and each piece's identity
/// then (`Memory::physical_pieces`).
#[derive(Debug, Clone)]
pub struct Pins {
    what: String,
    addr: usize,
    len: usize,
    pieces: Vec<(usize, u64)>,
}

impl Pins {
    pub fn take(what: String, addr: usize, len: usize) -> Pins {
        let pieces = if len == 0 { Vec::new() } else { sim().physical_pieces(addr, len) };
        Pins { what, addr, len, pieces }
    }

    fn overlaps(&self, addr: usize, len: usize) -> bool {
        addr < self.addr.saturating_add(self.len) && self.addr < addr.saturating_add(len)
    }

    /// Why this registration no longer describes the memory at its address, if it does not.
    fn stale(&self) -> Option<String> {
        self.pieces.iter().find_map(|&(at, id)| {
            let now = sim().physical_pieces(at, 1).first().map(|p| p.1);
            (now != Some(id)).then(|| {
                let since = match now {
                    None => "is unmapped now".to_string(),
                    Some(other) => format!("maps physical allocation {other:#x} now"),
                };
                format!(
                    "{} of {:#x} ({} bytes) pinned physical allocation {id:#x} at {at:#x}, which {since}: \
                     NCCL would go on using the pinned pages, never the memory mapped there since; \
                     deregister and register again after remapping (or capture the graph again)",
                    self.what, self.addr, self.len
                )
            })
        })
    }
}

/// How long a rank whose registration went stale waits before failing: on a device its
/// kernels would wait for peers writing to pages it no longer reads.
fn stale_timeout() -> Duration {
    let secs = std::env::var("TMS_SIM_NCCL_STALE_TIMEOUT").ok().and_then(|v| v.parse::<f64>().ok());
    Duration::from_secs_f64(secs.filter(|s| s.is_finite() && *s >= 0.0).unwrap_or(10.0))
}

const P2P: u64 = 1 << 63;
/// Host-side exchanges of communicator splits.
const SPLIT: u64 = 1 << 62;
const STEP_BITS: u32 = 24;

#[derive(Debug, Clone)]
pub struct CommConfig {
    /// How long init waits for every rank to join.
    pub connect_timeout: Duration,
    /// Device memory the communicator's buffers take, outside any allocation of the caller's;
    /// released by a suspend (ncclCommSuspend) and taken again by a resume.
    pub buffer_bytes: u64,
    /// Device memory the communicator keeps while it lives, suspended or not.
    pub persistent_bytes: u64,
}

/// A communicator's device memory as ncclCommMemStats reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemStats {
    pub suspendable: u64,
    pub suspended: bool,
    pub persistent: u64,
}

#[derive(Default)]
struct Charges {
    persistent: bool,
    buffers: bool,
    suspended: bool,
}

/// One operation, with device addresses as the caller gave them. `count` is in elements: the
/// whole buffer for broadcast, reduce and all-reduce; one rank's share for all-gather,
/// reduce-scatter, gather and all-to-all (as NCCL counts them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    Broadcast { send: usize, recv: usize, count: usize, dtype: DType, root: usize },
    Reduce { send: usize, recv: usize, count: usize, dtype: DType, op: RedOp, root: usize },
    AllReduce { send: usize, recv: usize, count: usize, dtype: DType, op: RedOp },
    AllGather { send: usize, recv: usize, count: usize, dtype: DType },
    ReduceScatter { send: usize, recv: usize, count: usize, dtype: DType, op: RedOp },
    AllToAll { send: usize, recv: usize, count: usize, dtype: DType },
    Gather { send: usize, recv: usize, count: usize, dtype: DType, root: usize },
    Send { buf: usize, count: usize, dtype: DType, peer: usize },
    Recv { buf: usize, count: usize, dtype: DType, peer: usize },
    Barrier,
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Broadcast { .. } => "broadcast",
            Op::Reduce { .. } => "reduce",
            Op::AllReduce { .. } => "all-reduce",
            Op::AllGather { .. } => "all-gather",
            Op::ReduceScatter { .. } => "reduce-scatter",
            Op::AllToAll { .. } => "all-to-all",
            Op::Gather { .. } => "gather",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            Op::Barrier => "barrier",
        }
    }

    fn kind(&self) -> u64 {
        match self {
            Op::Broadcast { .. } => 1,
            Op::Reduce { .. } => 2,
            Op::AllReduce { .. } => 3,
            Op::AllGather { .. } => 4,
            Op::ReduceScatter { .. } => 5,
            Op::AllToAll { .. } => 6,
            Op::Gather { .. } => 7,
            Op::Send { .. } | Op::Recv { .. } => 8,
            Op::Barrier => 9,
        }
    }

    /// What every rank must agree on: (kind, count, type, reduction, root).
    fn header(&self) -> [u64; 5] {
        let (count, dtype, op, root) = match *self {
            Op::Broadcast { count, dtype, root, .. } | Op::Gather { count, dtype, root, .. } => {
                (count, dtype.code(), 0, root as u64)
            }
            Op::Reduce { count, dtype, op, root, .. } => (count, dtype.code(), op.code(), root as u64),
            Op::AllReduce { count, dtype, op, .. } | Op::ReduceScatter { count, dtype, op, .. } => {
                (count, dtype.code(), op.code(), 0)
            }
            Op::AllGather { count, dtype, .. } | Op::AllToAll { count, dtype, .. } => (count, dtype.code(), 0, 0),
            Op::Send { count, dtype, .. } | Op::Recv { count, dtype, .. } => (count, dtype.code(), 0, 0),
            Op::Barrier => (0, 0, 0, 0),
        };
        [self.kind(), count as u64, dtype, op, root]
    }

    fn describe(h: &[u64; 5]) -> String {
        let kind = [
            "?",
            "broadcast",
            "reduce",
            "all-reduce",
            "all-gather",
            "reduce-scatter",
            "all-to-all",
            "gather",
            "send/recv",
            "barrier",
        ]
        .get(h[0] as usize)
        .copied()
        .unwrap_or("?");
        format!("{kind} of {} elements (type {}, reduction {}, root {})", h[1], h[2], h[3] & 0xff, h[4])
    }
}

/// The rank's link: busy until this time (ns), per device of this process.
static LINK_BUSY: [AtomicU64; crate::core::config::MAX_DEVICES] =
    [const { AtomicU64::new(0) }; crate::core::config::MAX_DEVICES];

struct Pace {
    start: u64,
    duration: u64,
    total: usize,
}

impl Pace {
    /// Waits until the modelled link has carried `done` of the operation's `total` bytes.
    fn wait(&self, done: usize) {
        if self.duration == 0 || self.total == 0 {
            return;
        }
        let lands = self.start + (self.duration as f64 * done as f64 / self.total as f64) as u64;
        crate::core::timing::sleep_until(lands);
    }
}

struct Pending {
    issued: u64,
    done: u64,
}

pub struct Comm {
    pub rank: usize,
    pub nranks: usize,
    pub device: usize,
    mesh: Mesh,
    /// Some peer is on another simulated node: the inter-node rate applies.
    crosses_nodes: bool,
    seq: AtomicU64,
    splits: AtomicU64,
    sent: Mutex<Vec<u64>>,
    received: Mutex<Vec<u64>>,
    error: Mutex<Option<CollError>>,
    pending: (Mutex<Pending>, Condvar),
    buffer_bytes: u64,
    persistent_bytes: u64,
    /// What of its device memory is charged now.
    charges: Mutex<Charges>,
    /// Set by abort and destroy: operations stuck on a lost peer may end.
    stopped: (Mutex<bool>, Condvar),
    /// Buffers registered with ncclCommRegister, by the handle it returned.
    registrations: Mutex<std::collections::HashMap<u64, Pins>>,
    next_registration: AtomicU64,
}

impl Comm {
    /// Joins communicator `id` as `rank` of `nranks` on `device`: takes the buffers' device
    /// memory, then waits (up to the connect timeout) for every rank.
    pub fn init(
        id: UniqueId,
        nranks: usize,
        rank: usize,
        device: usize,
        cfg: &CommConfig,
    ) -> Result<Arc<Comm>, CollError> {
        if nranks == 0 || rank >= nranks {
            return Err(CollError::InvalidArgument(format!("rank {rank} of {nranks} ranks")));
        }
        let s = sim();
        if device >= s.devices() {
            return Err(CollError::InvalidArgument(format!("device {device} does not exist")));
        }
        let total = cfg.buffer_bytes + cfg.persistent_bytes;
        if !s.node.charge(device, total) {
            let (free, _) = s.mem_info(device);
            return Err(CollError::OutOfMemory(format!(
                "the communicator's buffers need {total} bytes on device {device}, {free} are free"
            )));
        }
        let mesh = match Mesh::join(id, rank, nranks, &s.cfg.node, cfg.connect_timeout) {
            Ok(m) => m,
            Err(e) => {
                s.node.uncharge(device, total);
                return Err(e);
            }
        };
        let crosses_nodes = mesh.peers.iter().any(|p| p.node != s.cfg.node);
        Ok(Arc::new(Comm {
            rank,
            nranks,
            device,
            mesh,
            crosses_nodes,
            seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            sent: Mutex::new(vec![0; nranks]),
            received: Mutex::new(vec![0; nranks]),
            error: Mutex::new(None),
            pending: (Mutex::new(Pending { issued: 0, done: 0 }), Condvar::new()),
            buffer_bytes: cfg.buffer_bytes,
            persistent_bytes: cfg.persistent_bytes,
            charges: Mutex::new(Charges { persistent: true, buffers: true, suspended: false }),
            stopped: (Mutex::new(false), Condvar::new()),
            registrations: Mutex::new(std::collections::HashMap::new()),
            next_registration: AtomicU64::new(0x7e61_0000_0001),
        }))
    }

    fn charges(&self) -> std::sync::MutexGuard<'_, Charges> {
        self.charges.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn mem_stats(&self) -> MemStats {
        MemStats {
            suspendable: self.buffer_bytes,
            suspended: self.charges().suspended,
            persistent: self.persistent_bytes,
        }
    }

    /// Releases the buffers' device memory once queued work has run (ncclCommSuspend with
    /// NCCL_SUSPEND_MEM). Until a resume, operations are refused. A second suspend changes
    /// nothing.
    pub fn suspend(&self) {
        self.finalize();
        let mut c = self.charges();
        if c.suspended {
            return;
        }
        if c.buffers {
            sim().node.uncharge(self.device, self.buffer_bytes);
            c.buffers = false;
        }
        c.suspended = true;
    }

    /// Takes the buffers' device memory again (ncclCommResume); fails when the device has no
    /// room for them, leaving the communicator suspended.
    pub fn resume(&self) -> Result<(), CollError> {
        let mut c = self.charges();
        if !c.suspended {
            return Ok(());
        }
        if !sim().node.charge(self.device, self.buffer_bytes) {
            let (free, _) = sim().mem_info(self.device);
            return Err(CollError::OutOfMemory(format!(
                "resuming needs {} bytes on device {}, {free} are free",
                self.buffer_bytes, self.device
            )));
        }
        c.buffers = true;
        c.suspended = false;
        Ok(())
    }

    /// The simulated node each rank runs on, in rank order.
    pub fn nodes(&self) -> Vec<String> {
        self.mesh.peers.iter().map(|p| p.node.clone()).collect()
    }

    pub fn async_error(&self) -> Option<CollError> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Registers `[addr, addr+len)` (ncclCommRegister): pins the physical memory mapped there
    /// now. Returns the registration's handle.
    pub fn register(&self, addr: usize, len: usize) -> u64 {
        let handle = self.next_registration.fetch_add(1, Ordering::AcqRel);
        let what = format!("ncclCommRegister's registration {handle:#x}");
        // With local registration off NCCL keeps the handle but works through the address.
        let len = if register_switch("NCCL_LOCAL_REGISTER") { len } else { 0 };
        let pins = Pins::take(what, addr, len);
        self.registrations.lock().unwrap_or_else(|e| e.into_inner()).insert(handle, pins);
        handle
    }

    /// Drops a registration (ncclCommDeregister); false for a handle this communicator never gave.
    pub fn deregister(&self, handle: u64) -> bool {
        self.registrations.lock().unwrap_or_else(|e| e.into_inner()).remove(&handle).is_some()
    }

    /// The device ranges `op` reads or writes on this rank.
    pub fn ranges(&self, op: &Op) -> Vec<(usize, usize)> {
        let n = self.nranks;
        let (send, recv, send_len, recv_len) = match *op {
            Op::Broadcast { send, recv, count, dtype, .. }
            | Op::Reduce { send, recv, count, dtype, .. }
            | Op::AllReduce { send, recv, count, dtype, .. } => {
                (send, recv, count * dtype.size(), count * dtype.size())
            }
            Op::AllGather { send, recv, count, dtype } | Op::Gather { send, recv, count, dtype, .. } => {
                (send, recv, count * dtype.size(), count * dtype.size() * n)
            }
            Op::ReduceScatter { send, recv, count, dtype, .. } => {
                (send, recv, count * dtype.size() * n, count * dtype.size())
            }
            Op::AllToAll { send, recv, count, dtype } => {
                (send, recv, count * dtype.size() * n, count * dtype.size() * n)
            }
            Op::Send { buf, count, dtype, .. } | Op::Recv { buf, count, dtype, .. } => {
                (buf, 0, count * dtype.size(), 0)
            }
            Op::Barrier => (0, 0, 0, 0),
        };
        [(send, send_len), (recv, recv_len)].into_iter().filter(|&(p, len)| p != 0 && len > 0).collect()
    }

    /// Why `op` cannot run on the memory its registrations pinned (ncclCommRegister's, and
    /// `graph`'s: the capture's), if one went stale.
    fn stale_registration(&self, op: &Op, graph: &[Pins]) -> Option<String> {
        let ranges = self.ranges(op);
        let registered: Vec<Pins> =
            self.registrations.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        registered
            .iter()
            .filter(|p| ranges.iter().any(|&(a, l)| p.overlaps(a, l)))
            .chain(graph.iter())
            .find_map(Pins::stale)
    }

    fn fail(&self, e: CollError) {
        let mut slot = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }

    /// Checks one operation's arguments against this communicator (before anything is queued).
    pub fn check(&self, op: &Op) -> Result<(), CollError> {
        let n = self.nranks;
        let bytes = |count: usize, dtype: DType, times: usize| {
            count
                .checked_mul(dtype.size())
                .and_then(|b| b.checked_mul(times))
                .filter(|b| *b < isize::MAX as usize)
                .ok_or_else(|| {
                    CollError::InvalidArgument(format!(
                        "{count} elements of {} bytes overflow the address space",
                        dtype.size()
                    ))
                })
        };
        let buffers = |ptrs: &[usize], len: usize| {
            if len > 0 && ptrs.contains(&0) {
                Err(CollError::InvalidArgument(format!("{}: a null buffer for {len} bytes", op.name())))
            } else {
                Ok(())
            }
        };
        let in_range = |what: &str, r: usize| {
            if r < n {
                Ok(())
            } else {
                Err(CollError::InvalidArgument(format!("{what} {r} is out of range for {n} ranks")))
            }
        };
        let reducible = |dtype: DType, red: RedOp| {
            if !dtype.reducible() {
                return Err(CollError::InvalidArgument(format!(
                    "reductions of {dtype:?} are not modelled by the simulator"
                )));
            }
            if matches!(red, RedOp::PreMulSum(_)) && !dtype.is_float() {
                return Err(CollError::InvalidArgument("a pre-multiplied sum needs a floating-point type here".into()));
            }
            Ok(())
        };
        match *op {
            Op::Broadcast { send, recv, count, dtype, root } => {
                in_range("root", root)?;
                let len = bytes(count, dtype, 1)?;
                buffers(&[recv], len)?;
                if self.rank == root { buffers(&[send], len) } else { Ok(()) }
            }
            Op::Reduce { send, recv, count, dtype, op, root } => {
                in_range("root", root)?;
                reducible(dtype, op)?;
                let len = bytes(count, dtype, 1)?;
                buffers(&[send], len)?;
                if self.rank == root { buffers(&[recv], len) } else { Ok(()) }
            }
            Op::AllReduce { send, recv, count, dtype, op } => {
                reducible(dtype, op)?;
                buffers(&[send, recv], bytes(count, dtype, 1)?)
            }
            Op::ReduceScatter { send, recv, count, dtype, op } => {
                reducible(dtype, op)?;
                bytes(count, dtype, n)?;
                buffers(&[send, recv], bytes(count, dtype, 1)?)
            }
            Op::AllGather { send, recv, count, dtype } | Op::AllToAll { send, recv, count, dtype } => {
                bytes(count, dtype, n)?;
                buffers(&[send, recv], bytes(count, dtype, 1)?)
            }
            Op::Gather { send, recv, count, dtype, root } => {
                in_range("root", root)?;
                let len = bytes(count, dtype, n)?;
                buffers(&[send], len)?;
                if self.rank == root { buffers(&[recv], len) } else { Ok(()) }
            }
            Op::Send { buf, count, dtype, peer } | Op::Recv { buf, count, dtype, peer } => {
                in_range("peer", peer)?;
                buffers(&[buf], bytes(count, dtype, 1)?)
            }
            Op::Barrier => Ok(()),
        }
    }

    /// Queues `ops` (one operation, or a group's) on `stream`: they run in order when the stream
    /// reaches them (the group's sends first, so no order of sends and receives can deadlock).
    /// `fault_code` turns a device fault into the front end's runtime code for the stream.
    /// Returns the communicator's error if it already has one, or an argument error; nothing is
    /// queued then.
    pub fn submit(
        self: &Arc<Self>,
        stream: crate::core::streams::StreamId,
        ops: Vec<Op>,
        fault_code: fn(MemError) -> i32,
    ) -> Result<(), CollError> {
        if let Some(e) = self.async_error() {
            return Err(e);
        }
        if self.charges().suspended {
            return Err(CollError::InvalidUsage(
                "the communicator is suspended (ncclCommSuspend): its buffers are released; resume it first (ncclCommResume)".into(),
            ));
        }
        for op in &ops {
            self.check(op)?;
        }
        if sim().graphs.capture_of(stream).is_some() {
            // Captured, not run: the graph performs it, with the peers, at each launch; the ranks
            // number it then, so every rank replaying the same sequence matches.
            let pins: Vec<Pins> = if register_switch("NCCL_GRAPH_REGISTER") {
                let what = "the CUDA graph's registration at capture (NCCL_GRAPH_REGISTER)";
                ops.iter().flat_map(|op| self.ranges(op)).map(|(a, l)| Pins::take(what.into(), a, l)).collect()
            } else {
                Vec::new()
            };
            let comm = self.clone();
            let node =
                move || crate::core::graphs::Node::Collective(Arc::new(move || comm.replay(&ops, &pins, fault_code)));
            if sim().graphs.record(stream, node) {
                return Ok(());
            }
            return Err(CollError::Internal("the stream's capture ended while the collective was recorded".into()));
        }
        let tagged = self.number(ops);
        self.pending.0.lock().unwrap_or_else(|e| e.into_inner()).issued += 1;
        let comm = self.clone();
        let job = Box::new(move || comm.execute(&tagged, &[], fault_code));
        match sim().streams.submit_async(stream, self.device, job) {
            Ok(_) => Ok(()),
            Err(_) => {
                let (lock, cv) = &self.pending;
                lock.lock().unwrap_or_else(|e| e.into_inner()).issued -= 1;
                cv.notify_all();
                Err(CollError::InvalidArgument("the stream does not exist".into()))
            }
        }
    }

    /// Runs numbered operations counted in `pending`; returns the stream's code (a device fault's,
    /// else 0: other failures are the communicator's asynchronous error).
    fn execute(&self, tagged: &[(Op, u64)], graph: &[Pins], fault_code: fn(MemError) -> i32) -> i32 {
        let code = match self.run(tagged, graph) {
            Ok(()) => 0,
            Err(e) => {
                let code = if let CollError::Device(m) = e { fault_code(m) } else { 0 };
                let lost_peer = matches!(e, CollError::Remote(_));
                self.fail(e);
                if lost_peer {
                    // A kernel waiting for a peer that is gone never completes: the stream
                    // stays blocked until the communicator is aborted (or destroyed), which
                    // is what the caller's watchdog does on seeing the asynchronous error.
                    self.wait_stopped();
                }
                code
            }
        };
        let (lock, cv) = &self.pending;
        lock.lock().unwrap_or_else(|e| e.into_inner()).done += 1;
        cv.notify_all();
        code
    }

    /// A captured collective at a graph launch: numbered now, in launch order, and run in the
    /// launching thread as the graph's other nodes are. A communicator that has failed or is
    /// suspended runs nothing; the failure is its asynchronous error, as for a kernel that
    /// cannot proceed.
    fn replay(&self, ops: &[Op], graph: &[Pins], fault_code: fn(MemError) -> i32) -> i32 {
        if self.async_error().is_some() {
            return 0;
        }
        if self.charges().suspended {
            self.fail(CollError::InvalidUsage(
                "a CUDA graph replayed a collective of a suspended communicator (ncclCommSuspend released its buffers)"
                    .into(),
            ));
            return 0;
        }
        let tagged = self.number(ops.to_vec());
        self.pending.0.lock().unwrap_or_else(|e| e.into_inner()).issued += 1;
        self.execute(&tagged, graph, fault_code)
    }

    /// Gives each operation its message tag, in the order the host issued them.
    fn number(&self, ops: Vec<Op>) -> Vec<(Op, u64)> {
        let mut sent = self.sent.lock().unwrap_or_else(|e| e.into_inner());
        let mut received = self.received.lock().unwrap_or_else(|e| e.into_inner());
        let mut tagged: Vec<(Op, u64)> = ops
            .into_iter()
            .map(|op| {
                let tag = match op {
                    Op::Send { peer, .. } => {
                        sent[peer] += 1;
                        P2P | (sent[peer] << STEP_BITS)
                    }
                    Op::Recv { peer, .. } => {
                        received[peer] += 1;
                        P2P | (received[peer] << STEP_BITS)
                    }
                    _ => (self.seq.fetch_add(1, Ordering::AcqRel) + 1) << STEP_BITS,
                };
                (op, tag)
            })
            .collect();
        // Sends never wait, so running them first lets any order of receives complete.
        tagged.sort_by_key(|(op, _)| !matches!(op, Op::Send { .. }));
        tagged
    }

    /// Every rank of this communicator calls this with its color (negative: no new
    /// communicator) and key. Ranks of one color form a communicator ordered by (key, rank here);
    /// its first member starts a bootstrap root and sends the id to the others. Returns the id,
    /// the new rank and the new size, or None for a negative color.
    pub fn split(
        &self,
        color: i32,
        key: i32,
        timeout: Duration,
    ) -> Result<Option<(UniqueId, usize, usize)>, CollError> {
        let tag = SPLIT | ((self.splits.fetch_add(1, Ordering::AcqRel) + 1) << STEP_BITS);
        let mine = [color as i64 as u64, key as i64 as u64];
        let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
        for p in self.others() {
            self.mesh.send(p, tag, &bytes)?;
        }
        let mut all = vec![(color, key); self.nranks];
        for p in self.others() {
            let b = self.mesh.recv(p, tag)?;
            if b.len() != 16 {
                return Err(CollError::Internal("a malformed split message".into()));
            }
            let c = u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as i64 as i32;
            let k = u64::from_le_bytes(b[8..].try_into().expect("8 bytes")) as i64 as i32;
            all[p] = (c, k);
        }
        if color < 0 {
            return Ok(None);
        }
        let mut members: Vec<usize> = (0..self.nranks).filter(|&r| all[r].0 == color).collect();
        members.sort_by_key(|&r| (all[r].1, r));
        let new_rank = members.iter().position(|&r| r == self.rank).unwrap_or(0);
        let id = if new_rank == 0 {
            let id = super::transport::create_root(timeout)?;
            let mut b = [0u8; super::transport::ID_BYTES];
            id.encode(&mut b);
            for &m in &members[1..] {
                self.mesh.send(m, tag | 1, &b)?;
            }
            id
        } else {
            let b = self.mesh.recv(members[0], tag | 1)?;
            UniqueId::decode(&b).ok_or_else(|| CollError::Internal("a malformed split id".into()))?
        };
        Ok(Some((id, new_rank, members.len())))
    }

    /// Waits until every queued operation has run (ncclCommFinalize, destroy).
    pub fn finalize(&self) {
        let (lock, cv) = &self.pending;
        let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
        while p.done < p.issued {
            p = cv.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Fails everything under way and to come, closes the connections and gives the buffers'
    /// memory back (ncclCommAbort).
    pub fn abort(&self) {
        self.fail(CollError::Aborted);
        self.mesh.abort();
        self.stop();
        self.release_buffers();
    }

    fn stop(&self) {
        let (lock, cv) = &self.stopped;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }

    fn wait_stopped(&self) {
        let (lock, cv) = &self.stopped;
        let mut stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !*stopped {
            stopped = cv.wait(stopped).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Flushes queued work, closes the connections and gives the buffers' memory back. A
    /// communicator that lost a peer has operations that would never finish: they are ended as
    /// by an abort.
    pub fn destroy(&self) {
        if self.async_error().is_some() {
            self.mesh.abort();
            self.stop();
        }
        self.finalize();
        self.mesh.close();
        self.release_buffers();
    }

    fn release_buffers(&self) {
        let mut c = self.charges();
        if std::mem::take(&mut c.buffers) {
            sim().node.uncharge(self.device, self.buffer_bytes);
        }
        if std::mem::take(&mut c.persistent) {
            sim().node.uncharge(self.device, self.persistent_bytes);
        }
    }

    fn run(&self, ops: &[(Op, u64)], graph: &[Pins]) -> Result<(), CollError> {
        if let Some(e) = self.async_error() {
            return Err(e);
        }
        for (op, tag) in ops {
            if let Some(why) = self.stale_registration(op, graph) {
                return Err(self.give_up(op, *tag, why));
            }
            self.run_one(op, *tag)?;
        }
        Ok(())
    }

    /// A rank that cannot take part in `op`: after the bounded wait, it tells the others (their
    /// collective fails too) and fails with `why`.
    fn give_up(&self, op: &Op, tag: u64, why: String) -> CollError {
        std::thread::sleep(stale_timeout());
        if !matches!(op, Op::Send { .. } | Op::Recv { .. }) {
            let header = [STALE, self.rank as u64, 0, 0, 0];
            let bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
            for p in self.others() {
                let _ = self.mesh.send(p, tag, &bytes);
            }
        }
        CollError::System(format!("rank {}: {} #{}: {why}", self.rank, op.name(), tag >> STEP_BITS))
    }

    fn run_one(&self, op: &Op, tag: u64) -> Result<(), CollError> {
        let n = self.nranks;
        match *op {
            Op::Send { buf, count, dtype, peer } => return self.send(op, tag, buf, count * dtype.size(), peer),
            Op::Recv { buf, count, dtype, peer } => return self.recv(op, tag, buf, count * dtype.size(), peer),
            _ => {}
        }
        self.agree(op, tag)?;
        match *op {
            Op::Broadcast { send, recv, count, dtype, root } => {
                self.broadcast(tag, send, recv, count * dtype.size(), root)
            }
            Op::AllReduce { send, recv, count, dtype, op } => self.reduce_into(tag, send, recv, count, dtype, op, None),
            Op::Reduce { send, recv, count, dtype, op, root } => {
                self.reduce_into(tag, send, recv, count, dtype, op, Some(root))
            }
            Op::AllGather { send, recv, count, dtype } => self.gather_into(tag, send, recv, count * dtype.size(), None),
            Op::Gather { send, recv, count, dtype, root } => {
                self.gather_into(tag, send, recv, count * dtype.size(), Some(root))
            }
            Op::ReduceScatter { send, recv, count, dtype, op } => {
                self.reduce_scatter(tag, send, recv, count, dtype, op)
            }
            Op::AllToAll { send, recv, count, dtype } => self.all_to_all(tag, send, recv, count * dtype.size()),
            Op::Barrier => {
                let _ = n;
                Ok(())
            }
            Op::Send { .. } | Op::Recv { .. } => Ok(()),
        }
    }

    /// Every rank tells every other what it called; a disagreement fails the operation here and
    /// on the ranks that see it.
    fn agree(&self, op: &Op, tag: u64) -> Result<(), CollError> {
        let mine = op.header();
        let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
        for p in self.others() {
            self.mesh.send(p, tag, &bytes)?;
        }
        for p in self.others() {
            let theirs = decode_header(&self.mesh.recv(p, tag)?)?;
            if theirs[0] == STALE {
                return Err(CollError::System(format!(
                    "collective #{}: rank {p} gave up on it, a buffer registration of its went stale \
                     (the physical memory registered was unmapped or released and other memory mapped there)",
                    tag >> STEP_BITS
                )));
            }
            if theirs != mine {
                return Err(CollError::InvalidUsage(format!(
                    "ranks disagree on collective #{}: rank {} called {}, rank {p} called {}",
                    tag >> STEP_BITS,
                    self.rank,
                    Op::describe(&mine),
                    Op::describe(&theirs)
                )));
            }
        }
        Ok(())
    }

    fn others(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.nranks).filter(move |&r| r != self.rank)
    }

    /// Books the link for `link_bytes` and returns the pacing of an operation moving `total`
    /// bytes through this rank.
    fn book(&self, link_bytes: f64, total: usize) -> Pace {
        let cfg = &sim().cfg;
        let rate = if self.crosses_nodes { cfg.link_inter_bytes_per_sec } else { cfg.link_intra_bytes_per_sec };
        if rate <= 0.0 || link_bytes <= 0.0 {
            return Pace { start: 0, duration: 0, total };
        }
        let duration = (link_bytes / rate * 1e9) as u64;
        let mut start = 0;
        let slot = &LINK_BUSY[self.device.min(LINK_BUSY.len() - 1)];
        let _ = slot.fetch_update(Ordering::AcqRel, Ordering::Acquire, |busy| {
            start = busy.max(crate::core::timing::now_ns());
            Some(start + duration)
        });
        Pace { start, duration, total }
    }

    fn broadcast(&self, tag: u64, send: usize, recv: usize, len: usize, root: usize) -> Result<(), CollError> {
        let pace = self.book(len as f64, len);
        for (i, off, n) in chunks(len) {
            let data = if self.rank == root {
                let data = read(send + off, n)?;
                for p in self.others() {
                    self.mesh.send(p, tag | i, &data)?;
                }
                data
            } else {
                expect_len(self.mesh.recv(root, tag | i)?, n, root)?
            };
            pace.wait(off + n);
            if self.rank != root || recv != send {
                write(recv + off, &data)?;
            }
        }
        Ok(())
    }

    /// All-reduce (`root` None) or reduce to `root`.
    #[allow(clippy::too_many_arguments)]
    fn reduce_into(
        &self,
        tag: u64,
        send: usize,
        recv: usize,
        count: usize,
        dtype: DType,
        op: RedOp,
        root: Option<usize>,
    ) -> Result<(), CollError> {
        let len = count * dtype.size();
        let n = self.nranks;
        let link = match root {
            None => 2.0 * (n - 1) as f64 / n as f64 * len as f64,
            Some(_) => len as f64,
        };
        let pace = self.book(link, len);
        for (i, off, m) in chunks(len) {
            let Some(parts) = self.pool_chunk(tag | i, read(send + off, m)?, root)? else {
                pace.wait(off + m);
                continue;
            };
            let acc = combine_all(dtype, op, parts, n);
            pace.wait(off + m);
            write(recv + off, &acc)?;
        }
        Ok(())
    }

    /// Sends this rank's chunk to every other rank (`root` None) or to `root`, and returns every
    /// rank's chunk in rank order where this rank receives (all of them, or the root); None on a
    /// rank that only sends.
    fn pool_chunk(&self, tag: u64, mine: Vec<u8>, root: Option<usize>) -> Result<Option<Vec<Vec<u8>>>, CollError> {
        match root {
            None => {
                for p in self.others() {
                    self.mesh.send(p, tag, &mine)?;
                }
            }
            Some(r) if r != self.rank => {
                self.mesh.send(r, tag, &mine)?;
                return Ok(None);
            }
            Some(_) => {}
        }
        let m = mine.len();
        let mut mine = Some(mine);
        (0..self.nranks)
            .map(|r| {
                if r == self.rank {
                    Ok(mine.take().unwrap_or_default())
                } else {
                    expect_len(self.mesh.recv(r, tag)?, m, r)
                }
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// All-gather (`root` None) or gather to `root`: rank r's `len` bytes land at r * len.
    fn gather_into(
        &self,
        tag: u64,
        send: usize,
        recv: usize,
        len: usize,
        root: Option<usize>,
    ) -> Result<(), CollError> {
        let n = self.nranks;
        let pace = self.book(((n - 1) * len) as f64, len);
        for (i, off, m) in chunks(len) {
            let Some(parts) = self.pool_chunk(tag | i, read(send + off, m)?, root)? else {
                pace.wait(off + m);
                continue;
            };
            pace.wait(off + m);
            for (r, part) in parts.iter().enumerate() {
                write(recv + r * len + off, part)?;
            }
        }
        Ok(())
    }

    fn reduce_scatter(
        &self,
        tag: u64,
        send: usize,
        recv: usize,
        count: usize,
        dtype: DType,
        op: RedOp,
    ) -> Result<(), CollError> {
        let len = count * dtype.size();
        let n = self.nranks;
        let pace = self.book(((n - 1) * len) as f64, len);
        for (i, off, m) in chunks(len) {
            let parts = self.exchange_slices(tag | i, send, len, off, m)?;
            let acc = combine_all(dtype, op, parts, n);
            pace.wait(off + m);
            write(recv + off, &acc)?;
        }
        Ok(())
    }

    /// Sends rank p the chunk at `off` of slice p of `send` (slices of `len` bytes) and returns
    /// what every rank sent this one, in rank order (this rank's own slice included).
    fn exchange_slices(
        &self,
        tag: u64,
        send: usize,
        len: usize,
        off: usize,
        m: usize,
    ) -> Result<Vec<Vec<u8>>, CollError> {
        for p in self.others() {
            self.mesh.send(p, tag, &read(send + p * len + off, m)?)?;
        }
        (0..self.nranks)
            .map(
                |r| {
                    if r == self.rank {
                        read(send + r * len + off, m)
                    } else {
                        expect_len(self.mesh.recv(r, tag)?, m, r)
                    }
                },
            )
            .collect()
    }

    fn all_to_all(&self, tag: u64, send: usize, recv: usize, len: usize) -> Result<(), CollError> {
        let n = self.nranks;
        let pace = self.book(((n - 1) * len) as f64, len);
        for (i, off, m) in chunks(len) {
            let parts = self.exchange_slices(tag | i, send, len, off, m)?;
            pace.wait(off + m);
            for (r, part) in parts.iter().enumerate() {
                write(recv + r * len + off, part)?;
            }
        }
        Ok(())
    }

    fn send(&self, op: &Op, tag: u64, buf: usize, len: usize, peer: usize) -> Result<(), CollError> {
        let header: Vec<u8> = op.header().iter().flat_map(|v| v.to_le_bytes()).collect();
        self.mesh.send(peer, tag, &header)?;
        let pace = self.book(len as f64, len);
        for (i, off, n) in chunks(len) {
            let data = read(buf + off, n)?;
            self.mesh.send(peer, tag | i, &data)?;
            pace.wait(off + n);
        }
        Ok(())
    }

    fn recv(&self, op: &Op, tag: u64, buf: usize, len: usize, peer: usize) -> Result<(), CollError> {
        let theirs = decode_header(&self.mesh.recv(peer, tag)?)?;
        if theirs != op.header() {
            return Err(CollError::InvalidUsage(format!(
                "rank {} receives {} from rank {peer}, which sends {}",
                self.rank,
                Op::describe(&op.header()),
                Op::describe(&theirs)
            )));
        }
        for (i, off, n) in chunks(len) {
            let data = expect_len(self.mesh.recv(peer, tag | i)?, n, peer)?;
            write(buf + off, &data)?;
        }
        Ok(())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.release_buffers();
    }
}

/// (step, offset, length) of each chunk of a `len`-byte transfer; steps start at 1 (step 0 of
/// a tag is the header).
fn chunks(len: usize) -> impl Iterator<Item = (u64, usize, usize)> {
    (0..len.div_ceil(CHUNK)).map(move |i| ((i + 1) as u64, i * CHUNK, CHUNK.min(len - i * CHUNK)))
}

fn decode_header(b: &[u8]) -> Result<[u64; 5], CollError> {
    if b.len() != 40 {
        return Err(CollError::Internal(format!("a header of {} bytes", b.len())));
    }
    let mut h = [0u64; 5];
    for (i, v) in h.iter_mut().enumerate() {
        *v = u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    }
    Ok(h)
}

fn expect_len(data: Vec<u8>, len: usize, from: usize) -> Result<Vec<u8>, CollError> {
    if data.len() == len {
        Ok(data)
    } else {
        Err(CollError::Internal(format!("rank {from} sent {} bytes where {len} were expected", data.len())))
    }
}

/// Combines the ranks' contributions in rank order (see reduce.rs).
fn combine_all(dtype: DType, op: RedOp, mut parts: Vec<Vec<u8>>, n: usize) -> Vec<u8> {
    let premul = match op {
        RedOp::Avg if dtype.is_float() => Some(1.0 / n as f64),
        RedOp::PreMulSum(s) => Some(s),
        _ => None,
    };
    if let Some(factor) = premul {
        for p in &mut parts {
            reduce::scale(dtype, p, factor);
        }
    }
    let mut iter = parts.into_iter();
    let mut acc = iter.next().unwrap_or_default();
    for p in iter {
        reduce::combine(dtype, op, &mut acc, &p);
    }
    if op == RedOp::Avg && !dtype.is_float() {
        reduce::divide_ints(dtype, &mut acc, n);
    }
    acc
}

fn read(addr: usize, len: usize) -> Result<Vec<u8>, CollError> {
    let mut buf = vec![0u8; len];
    sim().kernel_read(addr, &mut buf).map_err(CollError::Device)?;
    Ok(buf)
}

fn write(addr: usize, data: &[u8]) -> Result<(), CollError> {
    sim().kernel_write(addr, data).map_err(CollError::Device)
}

/// NCCL's registration switches, both on unless set to 0: `NCCL_GRAPH_REGISTER` (the buffers of
/// collectives captured in a CUDA graph; NCCL environment variables, user guide "User Buffer
/// Registration") and `NCCL_LOCAL_REGISTER` (buffers given to ncclCommRegister; NCCL's
/// `ncclParamLocalRegister`, src/include/register.h).
fn register_switch(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v.trim() != "0")
}
