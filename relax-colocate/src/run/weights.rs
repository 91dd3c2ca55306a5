//! The trainer's weights as both drivers move and check them: the checksums the roles report, the
//! host transport (`update_weights` through the run's shared bucket file: the first trainer packs
//! each bucket once, every rollout engine unpacks it), the IPC transport (colocate mode: each
//! rollout copies from the device buffer the trainer on its device exports, device to device) and
//! the broadcast transport (NCCL or HCCL from the first trainer to every engine, in a group made
//! once): `WeightSync`.

use super::config::{Config, DeviceChoice, WeightTransport};
use super::fleet::Fleet;
use super::launch::Plan;
use super::protocol::{
    BroadcastWeights, BroadcastWeightsParams, BucketParams, Checksum, GroupDestroy, GroupId, GroupIdParams, GroupInit,
    GroupInitParams, IpcClose, IpcCopy, IpcExport, IpcExportParams, IpcImport, IpcImportParams, IpcPack, IpcPid, Pack,
    Step, Unpack, UpdateBegin, UpdateBeginParams, UpdateBeginReply, UpdateEnd,
};
use super::recorder::Recorder;
use super::recorder::report::human;
use super::summary::{Transport, WeightSyncSummary};
use super::{Cursor, FailKind, R, Role};
use crate::collective::Library;
use std::time::Instant;

/// Every worker of `role`'s weights checksum, in the fleet's order.
pub(super) fn checksums(fleet: &mut Fleet, role: Role, step: u64) -> R<Vec<String>> {
    let replies = fleet.call_all::<Checksum>(role, Step { step })?;
    Ok(replies.into_iter().map(|r| r.weights).collect())
}

/// The trainer's checksum; its replicas must agree.
pub(super) fn trainer_checksum(fleet: &mut Fleet, at: &Cursor) -> R<String> {
    let sums = checksums(fleet, Role::Trainer, at.step())?;
    if sums.windows(2).any(|w| w[0] != w[1]) {
        return Err(at.fail(FailKind::Check, None, format!("trainer replicas disagree on their weights: {sums:?}")));
    }
    Ok(sums[0].clone())
}

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

/// update_weights through the host: the trainers and the rollouts map the bucket file; per bucket
/// the first trainer packs it and every rollout unpacks it (the trainers are replicas).
pub(super) fn host_transfer(fleet: &mut Fleet, at: &Cursor, bucket_bytes: u64) -> R<Moved> {
    let (trainers, rollouts) = (fleet.indices(Role::Trainer), fleet.indices(Role::Rollout));
    host_transfer_to(fleet, at, bucket_bytes, &trainers, &rollouts)
}

/// `host_transfer` from `trainers` (the first packs) to `receivers`.
fn host_transfer_to(
    fleet: &mut Fleet,
    at: &Cursor,
    bucket_bytes: u64,
    trainers: &[usize],
    receivers: &[usize],
) -> R<Moved> {
    let t0 = Instant::now();
    let step = at.step();
    let p = UpdateBeginParams { shm: fleet.shm().to_path_buf(), bucket_bytes, step };
    let t = fleet.call_each::<UpdateBegin>(trainers, vec![p.clone(); trainers.len()])?;
    fleet.call_each::<UpdateBegin>(receivers, vec![p; receivers.len()])?;
    let (buckets, bytes) = stream_size(fleet, at, trainers[0], &t)?;
    for b in 0..buckets {
        let q = BucketParams { bucket: b, step };
        fleet.call_each::<Pack>(&trainers[..1], vec![q])?;
        fleet.call_each::<Unpack>(receivers, vec![q; receivers.len()])?;
    }
    fleet.call_each::<UpdateEnd>(trainers, vec![Step { step }; trainers.len()])?;
    fleet.call_each::<UpdateEnd>(receivers, vec![Step { step }; receivers.len()])?;
    Ok(Moved { bytes, buckets, seconds: t0.elapsed().as_secs_f64(), host_bytes: bytes })
}

/// Each trainer and the rollout on its device (colocate mode: the same rank), in the fleet's
/// order of the trainers.
fn device_pairs(fleet: &Fleet, at: &Cursor) -> R<Vec<(usize, usize)>> {
    let rollouts = fleet.indices(Role::Rollout);
    let pairs: Vec<(usize, usize)> = fleet
        .indices(Role::Trainer)
        .into_iter()
        .filter_map(|t| rollouts.iter().find(|&&r| fleet.worker(r).rank == fleet.worker(t).rank).map(|&r| (t, r)))
        .collect();
    if pairs.len() != rollouts.len() {
        let cause = "run.weight_transport = \"ipc\": every rollout needs a trainer on its own device (colocate mode)";
        return Err(at.fail(FailKind::Config, None, cause));
    }
    Ok(pairs)
}

/// update_weights by IPC: every trainer exports a buffer to the rollout on its device (`pids`:
/// each rollout's id for the exporter's whitelist, by fleet index), which opens it; per bucket
/// the trainers pack it and the rollouts copy it into their weights, device to device; then the
/// rollouts close their imports before the trainers end their exports.
fn ipc_transfer(fleet: &mut Fleet, at: &Cursor, bucket_bytes: u64, pids: &[(usize, i32)]) -> R<Moved> {
    let pairs = device_pairs(fleet, at)?;
    ipc_transfer_pairs(fleet, at, bucket_bytes, &pairs, pids)
}

/// `ipc_transfer` between the (trainer, rollout) pairs given, each on one device.
fn ipc_transfer_pairs(
    fleet: &mut Fleet,
    at: &Cursor,
    bucket_bytes: u64,
    pairs: &[(usize, usize)],
    pids: &[(usize, i32)],
) -> R<Moved> {
    let t0 = Instant::now();
    let step = at.step();
    let (trainers, rollouts): (Vec<usize>, Vec<usize>) = pairs.iter().copied().unzip();
    let pid_of = |r: usize| pids.iter().find(|p| p.0 == r).map_or(0, |p| p.1);
    let params = rollouts.iter().map(|&r| IpcExportParams { bucket_bytes, importers: vec![pid_of(r)], step }).collect();
    let exports = fleet.call_each::<IpcExport>(&trainers, params)?;
    let (buckets, bytes) = (exports[0].buckets, exports[0].bytes);
    if let Some(k) = exports.iter().position(|e| (e.buckets, e.bytes) != (buckets, bytes)) {
        let name = &fleet.worker(trainers[k]).name;
        let cause =
            format!("ipc_export: a weights stream of {} bytes, the first trainer's has {bytes}", exports[k].bytes);
        return Err(at.fail(FailKind::Check, Some(name), cause));
    }
    let params = exports
        .iter()
        .map(|e| IpcImportParams { handle: e.handle.clone(), buffer_bytes: e.buffer_bytes, bucket_bytes, step })
        .collect();
    fleet.call_each::<IpcImport>(&rollouts, params)?;
    for b in 0..buckets {
        let q = BucketParams { bucket: b, step };
        fleet.call_each::<IpcPack>(&trainers, vec![q; trainers.len()])?;
        fleet.call_each::<IpcCopy>(&rollouts, vec![q; rollouts.len()])?;
    }
    fleet.call_each::<IpcClose>(&rollouts, vec![Step { step }; rollouts.len()])?;
    fleet.call_each::<IpcClose>(&trainers, vec![Step { step }; trainers.len()])?;
    Ok(Moved { bytes, buckets, seconds: t0.elapsed().as_secs_f64(), host_bytes: 0 })
}

/// The IPC transport needs workers that said so in their hello (the built-in ones do); each
/// rollout's id for the exporters' whitelists, by fleet index.
fn ipc_ready(fleet: &mut Fleet, at: &Cursor) -> R<Vec<(usize, i32)>> {
    let all = [fleet.indices(Role::Trainer), fleet.indices(Role::Rollout)].concat();
    if let Some(&i) = all.iter().find(|&&i| !speaks_ipc(fleet, i)) {
        let name = fleet.worker(i).name.clone();
        let cause = format!(
            "run.weight_transport = \"ipc\": {name} does not speak the IPC transport (its hello names no \"ipc\" in \
             `transports`, docs/worker-protocol.md): use --weight-transport host"
        );
        return Err(at.fail(FailKind::Config, Some(&name), cause));
    }
    let rollouts = fleet.indices(Role::Rollout);
    ipc_pids(fleet, at, &rollouts)
}

fn speaks_ipc(fleet: &Fleet, i: usize) -> bool {
    fleet.worker(i).transports.iter().any(|t| t == "ipc")
}

/// Each of `rollouts`' process id, for an exporter's whitelist.
fn ipc_pids(fleet: &mut Fleet, at: &Cursor, rollouts: &[usize]) -> R<Vec<(usize, i32)>> {
    let replies = fleet.call_each::<IpcPid>(rollouts, vec![Step { step: at.step() }; rollouts.len()])?;
    Ok(rollouts.iter().copied().zip(replies.into_iter().map(|r| r.pid)).collect())
}

/// Elastic mode: the trainers' weights to the lent engines on their devices (`pairs`: trainer,
/// engine), by IPC when both speak it, as a colocated hand-over is, else through the host.
pub(super) fn lend_transfer(fleet: &mut Fleet, at: &Cursor, bucket_bytes: u64, pairs: &[(usize, usize)]) -> R<Moved> {
    if pairs.iter().all(|&(t, r)| speaks_ipc(fleet, t) && speaks_ipc(fleet, r)) {
        let engines: Vec<usize> = pairs.iter().map(|p| p.1).collect();
        let pids = ipc_pids(fleet, at, &engines)?;
        return ipc_transfer_pairs(fleet, at, bucket_bytes, pairs, &pids);
    }
    let (trainers, engines): (Vec<usize>, Vec<usize>) = pairs.iter().copied().unzip();
    host_transfer_to(fleet, at, bucket_bytes, &trainers, &engines)
}

/// How many buckets the weights stream has and its bytes, as the first trainer (`packer`) says.
fn stream_size(fleet: &Fleet, at: &Cursor, packer: usize, trainers: &[UpdateBeginReply]) -> R<(u64, u64)> {
    trainers[0].buckets.map(|b| (b, trainers[0].bytes.unwrap_or(0))).ok_or_else(|| {
        let name = &fleet.worker(packer).name;
        at.fail(FailKind::Worker, Some(name), "malformed update_begin reply: missing field `buckets`")
    })
}

/// The group's members in rank order: the first trainer (rank 0, the root), then every engine.
/// The other trainers are replicas holding the same weights; they stay out.
fn members(fleet: &Fleet) -> Vec<usize> {
    let mut m = vec![fleet.indices(Role::Trainer)[0]];
    m.extend(fleet.indices(Role::Rollout));
    m
}

/// update_weights by broadcast: every member is asked at once and answers when its part is done
/// (the engines once the last bucket is in their weights), so the update takes the slowest member.
pub(super) fn broadcast_transfer(fleet: &mut Fleet, bucket_bytes: u64, version: u64, step: u64) -> R<Moved> {
    let members = members(fleet);
    let p = BroadcastWeightsParams { bucket_bytes, version, step };
    let replies = fleet.call_together::<BroadcastWeights>(&members, vec![p; members.len()], "the weight broadcast")?;
    let root = &replies[0];
    Ok(Moved {
        bytes: root.bytes,
        buckets: root.buckets,
        seconds: replies.iter().map(|r| r.seconds).fold(0.0, f64::max),
        host_bytes: 0,
    })
}

/// How a driver moves the trainer's weights to the rollout engines, and what it moved.
pub(super) struct WeightSync {
    /// Resolved: ipc, host or broadcast.
    transport: WeightTransport,
    /// Why `auto` cannot fall back to host in this layout (the run fails at `join`).
    refused: Option<String>,
    library: Library,
    api: crate::vendor::ApiKind,
    /// IPC: each rollout's id for the exporters' whitelists, asked at the first update.
    ipc_pids: Option<Vec<(usize, i32)>>,
    bucket_bytes: u64,
    /// The simulator's modelled link between the group's members, GB/s (None: no model, as on a
    /// real device or with sim.link_gbps = 0).
    link_gbps: Option<f64>,
    joined: bool,
    group_setup_s: f64,
    updates: u64,
    moved: Moved,
}

impl WeightSync {
    pub(super) fn new(cfg: &Config, plan: &Plan, fleet: &Fleet) -> WeightSync {
        let (intra, inter) = cfg.link_gbps().unwrap_or((0.0, 0.0));
        // A group across the run's nodes is as fast as the link between nodes.
        let node = |i: usize| fleet.worker(i).rank / cfg.run.devices.max(1);
        let nodes: Vec<u32> = members(fleet).into_iter().map(node).collect();
        let gbps = if nodes.windows(2).all(|w| w[0] == w[1]) { intra } else { inter };
        // Auto (async mode, worker commands) broadcasts when every member's hello says it can.
        let speak = members(fleet).into_iter().all(|i| fleet.worker(i).transports.iter().any(|t| t == "broadcast"));
        let resolved = match plan.transport {
            WeightTransport::Auto => cfg.resolve_weight_transport(speak),
            t => Ok(t),
        };
        WeightSync {
            transport: resolved.clone().unwrap_or(WeightTransport::Host),
            refused: resolved.err(),
            library: Library::of(plan.api),
            api: plan.api,
            ipc_pids: None,
            bucket_bytes: plan.bucket_bytes,
            link_gbps: Some(gbps).filter(|g| *g > 0.0 && plan.device == DeviceChoice::Sim),
            joined: false,
            group_setup_s: 0.0,
            updates: 0,
            moved: Moved::default(),
        }
    }

    /// The update's bucket size (memory.update_weight_buffer_size).
    pub(super) fn bucket_bytes(&self) -> u64 {
        self.bucket_bytes
    }

    /// Broadcast: the first trainer makes the group's id, then every member joins, all asked
    /// before any answer is read (each waits in its library until the others come).
    pub(super) fn join(&mut self, fleet: &mut Fleet, rec: &mut Recorder) -> R<()> {
        if let Some(cause) = self.refused.take() {
            return Err(rec.cursor().fail(FailKind::Config, None, cause));
        }
        if self.transport != WeightTransport::Broadcast {
            return Ok(());
        }
        let span = rec.begin("group_init");
        let t0 = Instant::now();
        let members = members(fleet);
        let library = self.library.name().to_string();
        let p = GroupIdParams { library: library.clone(), step: 0 };
        let id = fleet.call_each::<GroupId>(&members[..1], vec![p])?.remove(0).id;
        let world = members.len() as u32;
        let params = (0..world)
            .map(|rank| GroupInitParams { library: library.clone(), id: id.clone(), rank, world, step: 0 })
            .collect();
        fleet.call_together::<GroupInit>(&members, params, "the weight-sync group")?;
        self.joined = true;
        self.group_setup_s = t0.elapsed().as_secs_f64();
        rec.end(span, fleet)
    }

    /// The trainer's weights to every engine, as version `version`; the update's bytes, buckets
    /// and rate join the step's metrics row.
    pub(super) fn transfer(&mut self, fleet: &mut Fleet, at: &Cursor, rec: &mut Recorder, version: u64) -> R<Moved> {
        let moved = match self.transport {
            WeightTransport::Broadcast => broadcast_transfer(fleet, self.bucket_bytes, version, at.step())?,
            WeightTransport::Ipc => {
                if self.ipc_pids.is_none() {
                    self.ipc_pids = Some(ipc_ready(fleet, at)?);
                }
                ipc_transfer(fleet, at, self.bucket_bytes, self.ipc_pids.as_deref().unwrap_or_default())?
            }
            _ => host_transfer(fleet, at, self.bucket_bytes)?,
        };
        self.updates += 1;
        self.moved.bytes += moved.bytes;
        self.moved.buckets += moved.buckets;
        self.moved.seconds += moved.seconds;
        self.moved.host_bytes += moved.host_bytes;
        rec.add_step_metric("perf/update_weights_bytes", moved.bytes as f64);
        rec.add_step_metric("perf/update_weights_host_bytes", moved.host_bytes as f64);
        rec.add_step_metric("perf/update_weights_buckets", moved.buckets as f64);
        if let Some(rate) = gbs(&moved) {
            rec.add_step_metric("perf/update_weights_gbps", rate);
            if let Some(share) = self.link_share(rate) {
                rec.add_step_metric("perf/update_weights_link_share", share);
            }
        }
        if self.updates == 1 {
            rec.note(&format!("relax-colocate run: initial weights: {}", self.describe(&moved)));
        }
        Ok(moved)
    }

    /// Leaves the group at the run's end, every member together.
    pub(super) fn leave(&mut self, fleet: &mut Fleet, rec: &mut Recorder) -> R<()> {
        if !self.joined {
            return Ok(());
        }
        let span = rec.begin("group_destroy");
        let members = members(fleet);
        fleet.call_together::<GroupDestroy>(&members, vec![Step::default(); members.len()], "the group's destroy")?;
        self.joined = false;
        rec.end(span, fleet)
    }

    fn link_share(&self, rate_gbps: f64) -> Option<f64> {
        // The modelled link is the collective's: the host transport never crosses it.
        (self.transport == WeightTransport::Broadcast).then_some(self.link_gbps?).map(|l| rate_gbps / l)
    }

    fn name(&self) -> String {
        match self.transport {
            WeightTransport::Broadcast => format!("broadcast over {}", self.library.name().to_uppercase()),
            WeightTransport::Ipc if self.api == crate::vendor::ApiKind::Acl => {
                "ipc (Ascend IPC keys, device to device)".into()
            }
            WeightTransport::Ipc => "ipc (CUDA IPC handles, device to device)".into(),
            _ => "host (staged in host memory)".into(),
        }
    }

    /// One line on an update: bytes, buckets, time and rate against the modelled link.
    fn describe(&self, m: &Moved) -> String {
        let rate = gbs(m).map_or_else(|| "-".into(), |r| format!("{r:.2} GB/s"));
        let link = match (gbs(m).and_then(|r| self.link_share(r)), self.link_gbps) {
            (Some(share), Some(l)) => format!(", {:.0}% of the modelled {l} GB/s link", 100.0 * share),
            _ => String::new(),
        };
        format!(
            "{}: {} in {} bucket(s), {} through the host, {:.3} s, {rate}{link}",
            self.name(),
            human(m.bytes),
            m.buckets,
            human(m.host_bytes),
            m.seconds
        )
    }

    /// The summary's lines on the transport (in the weight_sync block, and merged into the async
    /// block).
    pub(super) fn summary(&self) -> Transport {
        let rate = gbs(&self.moved);
        let broadcast = self.transport == WeightTransport::Broadcast;
        Transport {
            weight_transport: self.transport.as_str().into(),
            weight_sync_library: broadcast.then(|| self.library.name().into()),
            weight_sync_group_setup_s: self.group_setup_s,
            update_weights_buckets: self.moved.buckets,
            update_weights_host_bytes: self.moved.host_bytes,
            update_weights_transfer_s: self.moved.seconds,
            update_weights_gbps: rate,
            link_gbps: self.link_gbps.filter(|_| broadcast),
            link_share: rate.and_then(|r| self.link_share(r)),
        }
    }

    /// The summary's `weight_sync` block, in both modes: the transport's lines (`summary`), the
    /// updates and every byte they moved.
    pub(super) fn report(&self) -> WeightSyncSummary {
        WeightSyncSummary {
            transport: self.summary(),
            weight_updates: self.updates,
            update_weights_bytes: self.moved.bytes,
            weight_transport_detail: self.name(),
        }
    }
}

/// GB/s of an update, when it took measurable time.
fn gbs(m: &Moved) -> Option<f64> {
    (m.seconds > 0.0).then(|| m.bytes as f64 / m.seconds / 1e9)
}
