//! The trainer's weights as both drivers move and check them: the checksums the roles report, and
//! `WeightSync`, the run's weight transport (transport/: host, ipc or broadcast) with what its
//! updates moved, for the step rows and the summary.

use super::config::{Config, DeviceChoice, WeightTransport};
use super::fleet::Fleet;
use super::launch::Plan;
use super::protocol::{Checksum, Step};
use super::recorder::Recorder;
use super::recorder::report::human;
use super::summary::{Transport as TransportSummary, WeightSyncSummary};
use super::switch::{self, SwitchModel};
use super::transport::{self, Moved, Transport};
use super::{Cursor, FailKind, R, Role};
use crate::run::clock::Instant;
use std::rc::Rc;

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

/// How a driver moves the trainer's weights to the rollout engines, and what it moved.
pub(super) struct WeightSync {
    transport: Box<dyn Transport>,
    /// Why `auto` cannot fall back to host in this layout (the run fails at `join`).
    refused: Option<String>,
    bucket_bytes: u64,
    /// The simulator's modelled link between the group's members, GB/s (None: no model, as on a
    /// real device or with sim.link_gbps = 0).
    link_gbps: Option<f64>,
    updates: u64,
    moved: Moved,
    /// With compute.model: each update lasts at least the full-scale weights' time on the device.
    switch: Option<Rc<SwitchModel>>,
}

impl WeightSync {
    pub(super) fn new(cfg: &Config, plan: &Plan, fleet: &Fleet, switch: Option<Rc<SwitchModel>>) -> WeightSync {
        let (intra, inter) = cfg.link_gbps().unwrap_or((0.0, 0.0));
        // A group across the run's nodes is as fast as the link between nodes.
        let node = |i: usize| fleet.worker(i).rank / cfg.run.devices.max(1);
        let members = transport::broadcast_members(fleet);
        let nodes: Vec<u32> = members.iter().map(|&i| node(i)).collect();
        let gbps = if nodes.windows(2).all(|w| w[0] == w[1]) { intra } else { inter };
        // Auto (async mode, worker commands) broadcasts when every member's hello says it can.
        let speak = members.iter().all(|&i| fleet.worker(i).transports.iter().any(|t| t == "broadcast"));
        let resolved = match plan.transport {
            WeightTransport::Auto => cfg.resolve_weight_transport(speak),
            t => Ok(t),
        };
        WeightSync {
            transport: transport::runner_half(resolved.clone().unwrap_or(WeightTransport::Host), plan.api),
            refused: resolved.err(),
            bucket_bytes: plan.bucket_bytes,
            link_gbps: Some(gbps).filter(|g| *g > 0.0 && plan.device == DeviceChoice::Sim),
            updates: 0,
            moved: Moved::default(),
            switch,
        }
    }

    /// The update's bucket size (memory.update_weight_buffer_size).
    pub(super) fn bucket_bytes(&self) -> u64 {
        self.bucket_bytes
    }

    /// What the transport sets up once (broadcast: its group), or the refusal `auto` met.
    pub(super) fn join(&mut self, fleet: &mut Fleet, rec: &mut Recorder) -> R<()> {
        if let Some(cause) = self.refused.take() {
            return Err(rec.cursor().fail(FailKind::Config, None, cause));
        }
        self.transport.join(fleet, rec)
    }

    /// The trainer's weights to every engine, as version `version`; the update's bytes, buckets
    /// and rate join the step's metrics row.
    pub(super) fn transfer(&mut self, fleet: &mut Fleet, at: &Cursor, rec: &mut Recorder, version: u64) -> R<Moved> {
        let t0 = Instant::now();
        let moved = self.transport.transfer(fleet, at, self.bucket_bytes, version)?;
        if let Some(m) = &self.switch {
            switch::charge(rec, "update_weights", t0, m.update_s(self.transport.kind()));
        }
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

    /// What the transport tears down at the run's end (broadcast: the group, every member
    /// together).
    pub(super) fn leave(&mut self, fleet: &mut Fleet, rec: &mut Recorder) -> R<()> {
        self.transport.leave(fleet, rec)
    }

    fn link_share(&self, rate_gbps: f64) -> Option<f64> {
        // The modelled link is the collective's: the host and IPC transports never cross it.
        self.transport.library()?;
        self.link_gbps.map(|l| rate_gbps / l)
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
            self.transport.describe(),
            human(m.bytes),
            m.buckets,
            human(m.host_bytes),
            m.seconds
        )
    }

    /// The summary's lines on the transport (in the weight_sync block, and merged into the async
    /// block).
    pub(super) fn summary(&self) -> TransportSummary {
        let rate = gbs(&self.moved);
        let library = self.transport.library();
        TransportSummary {
            weight_transport: self.transport.kind().as_str().into(),
            weight_sync_library: library.map(|l| l.name().into()),
            weight_sync_group_setup_s: self.transport.setup_s(),
            update_weights_buckets: self.moved.buckets,
            update_weights_host_bytes: self.moved.host_bytes,
            update_weights_transfer_s: self.moved.seconds,
            update_weights_gbps: rate,
            link_gbps: self.link_gbps.filter(|_| library.is_some()),
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
            weight_transport_detail: self.transport.describe(),
        }
    }
}

/// GB/s of an update, when it took measurable time.
fn gbs(m: &Moved) -> Option<f64> {
    (m.seconds > 0.0).then(|| m.bytes as f64 / m.seconds / 1e9)
}
