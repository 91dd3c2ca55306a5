//! The weight transports: how the trainer's weights reach the rollout engines. Each is one file
//! holding both halves, the runner's (`Transport`) and the built-in worker's (`WorkerHalf`), and
//! the protocol methods only it uses, plus one entry in `transports!` below, which makes its
//! `WeightTransport` variant (the configuration's name) and its place in `TRANSPORTS`: host.rs (through the run's bucket file, every worker speaks it),
//! ipc.rs (device to device on one device, colocate mode), broadcast.rs (NCCL or HCCL from the
//! first trainer to every engine). buckets.rs cuts the weights stream for all of them;
//! weights.rs's `WeightSync` picks one and keeps its figures.

mod broadcast;
pub(super) mod buckets;
mod host;
mod ipc;

use super::answer::Failure;
use super::device::Device;
use super::fleet::Fleet;
use super::protocol::UpdateBeginReply;
use super::recorder::Recorder;
use super::{Cursor, FailKind, R};
use crate::collective::Library;
use crate::vendor::ApiKind;
use serde_json::Value;

/// What one update moved to each engine.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Moved {
    pub(super) bytes: u64,
    pub(super) buckets: u64,
    /// Moving the bytes: the host and IPC transports' calls, the broadcast's slowest member.
    pub(super) seconds: f64,
    /// Of `bytes`, those staged in host memory between trainer and rollout: all of them over the
    /// host transport, none over IPC or a broadcast.
    pub(super) host_bytes: u64,
}

/// The runner's half of a transport.
pub(super) trait Transport {
    fn kind(&self) -> WeightTransport;
    /// What it sets up once, before the first update (a group, every member together).
    fn join(&mut self, _fleet: &mut Fleet, _rec: &mut Recorder) -> R<()> {
        Ok(())
    }
    /// One update: the trainer's weights to every engine, as version `version`.
    fn transfer(&mut self, fleet: &mut Fleet, at: &Cursor, bucket_bytes: u64, version: u64) -> R<Moved>;
    /// What it tears down at the run's end.
    fn leave(&mut self, _fleet: &mut Fleet, _rec: &mut Recorder) -> R<()> {
        Ok(())
    }
    /// How the run's lines and the summary name it.
    fn describe(&self) -> String;
    /// The collective library its updates run on (they cross the modelled link); None: no
    /// library.
    fn library(&self) -> Option<Library> {
        None
    }
    /// Seconds its set-up (`join`) took.
    fn setup_s(&self) -> f64 {
        0.0
    }
}

/// What a built-in worker shows a transport's worker half: its device, its role and its weights.
pub(super) struct Weights<'a> {
    pub(super) dev: &'a Device,
    pub(super) trainer: bool,
    /// The weights stream's entries on the device (address, bytes), in layout order.
    pub(super) entries: &'a [(u64, u64)],
    /// The trainer's host copy of them, taken after each train step (what it has while its
    /// regions sleep); empty on a rollout.
    pub(super) snapshot: &'a [Vec<u8>],
}

/// The built-in worker's half of a transport.
pub(super) trait WorkerHalf {
    /// Answers `method` when it is one of this transport's for the worker's role; None when it is
    /// not.
    fn answer(&mut self, method: &str, params: &Value, w: &Weights) -> Option<Result<Value, Failure>>;
    /// The worker shuts down: what the transport still holds is released.
    fn close(&mut self, w: &Weights) -> Result<(), Failure>;
}

/// A transport: its configuration name, its runner half and its worker half.
struct Entry {
    kind: WeightTransport,
    runner: fn(ApiKind) -> Box<dyn Transport>,
    worker: fn() -> Box<dyn WorkerHalf>,
}

/// Declares every transport once: its variant of `WeightTransport` (the configuration's and the
/// command line's `run.weight_transport`, documented by its doc comment), its name (the variant
/// in lower case), and its entry in `TRANSPORTS`.
macro_rules! transports {
    ($($(#[$doc:meta])* $kind:ident = $name:literal: runner $runner:expr, worker $worker:expr;)*) => {
        /// How the trainer's weights reach the rollout (docs/async.md, "Weight transports").
        #[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
        #[serde(rename_all = "lowercase")]
        pub enum WeightTransport {
            /// ipc in colocate mode with the built-in workers; broadcast in async mode when every
            /// member of the weight-sync group names it in its hello (the built-in workers and
            /// scripts/torch_worker.py do); host otherwise.
            Auto,
            $($(#[$doc])* $kind,)*
        }

        impl WeightTransport {
            pub fn as_str(self) -> &'static str {
                match self {
                    WeightTransport::Auto => "auto",
                    $(WeightTransport::$kind => $name,)*
                }
            }
        }

        const TRANSPORTS: &[Entry] = &[$(Entry { kind: WeightTransport::$kind, runner: $runner, worker: $worker },)*];
    };
}

// Every transport, registered once: a new one is a file beside these (both halves and its own
// protocol methods) and an entry here, in the order `--help` lists them.
transports! {
    /// Device memory handles (CUDA IPC, Ascend IPC keys): each rollout copies from the trainer on
    /// its device, device to device (colocate mode).
    Ipc = "ipc": runner |api| Box::new(ipc::Ipc::new(api)), worker || Box::<ipc::IpcWorker>::default();
    /// Through host memory: the run's shared bucket file (the fallback every worker speaks).
    Host = "host": runner |_| Box::new(host::Host), worker || Box::<host::HostWorker>::default();
    /// NCCL (CUDA API) or HCCL (ACL) from the first trainer to every rollout engine (async mode).
    Broadcast = "broadcast":
        runner |api| Box::new(broadcast::Broadcast::new(api)),
        worker || Box::<broadcast::BroadcastWorker>::default();
}

/// The runner's half of `kind` (resolved: not `auto`; the host transport otherwise).
pub(super) fn runner_half(kind: WeightTransport, api: ApiKind) -> Box<dyn Transport> {
    let of = |kind| TRANSPORTS.iter().find(|e: &&Entry| e.kind == kind);
    let entry = of(kind).or_else(|| of(WeightTransport::Host)).expect("the host transport is registered");
    (entry.runner)(api)
}

/// The built-in worker's halves of every transport.
pub(super) fn worker_halves() -> Vec<Box<dyn WorkerHalf>> {
    TRANSPORTS.iter().map(|e| (e.worker)()).collect()
}

/// The members of the broadcast transport's group, in rank order.
pub(super) fn broadcast_members(fleet: &Fleet) -> Vec<usize> {
    broadcast::members(fleet)
}

/// Elastic mode: the trainers' weights to the lent engines on their devices (`pairs`: trainer,
/// engine), by IPC when both speak it, as a colocated hand-over is, else through the host.
pub(super) fn lend_transfer(fleet: &mut Fleet, at: &Cursor, bucket_bytes: u64, pairs: &[(usize, usize)]) -> R<Moved> {
    if pairs.iter().all(|&(t, r)| ipc::speaks(fleet, t) && ipc::speaks(fleet, r)) {
        let engines: Vec<usize> = pairs.iter().map(|p| p.1).collect();
        let pids = ipc::pids(fleet, at, &engines)?;
        return ipc::transfer_pairs(fleet, at, bucket_bytes, pairs, &pids);
    }
    let (trainers, engines): (Vec<usize>, Vec<usize>) = pairs.iter().copied().unzip();
    host::transfer_to(fleet, at, bucket_bytes, &trainers, &engines)
}

/// How many buckets the weights stream has and its bytes, as the first trainer (`packer`) says.
fn stream_size(fleet: &Fleet, at: &Cursor, packer: usize, trainers: &[UpdateBeginReply]) -> R<(u64, u64)> {
    trainers[0].buckets.map(|b| (b, trainers[0].bytes.unwrap_or(0))).ok_or_else(|| {
        let name = &fleet.worker(packer).name;
        at.fail(FailKind::Worker, Some(name), "malformed update_begin reply: missing field `buckets`")
    })
}
