//! The memory at phase boundaries: every worker's tms status, sampled as each phase ends, makes
//! a line of memory.jsonl, the device peaks, the step's memory metrics and the leak check.

use super::{MemSample, Recorder};
use crate::run::fleet::WorkerStatus;
use crate::run::{FailKind, NCCL_TAG, R};
use std::collections::BTreeMap;
use std::io::Write as _;

impl Recorder {
    pub(super) fn sample_memory(&mut self, start_s: f64, statuses: Vec<WorkerStatus>) -> R<()> {
        let s = self.sample_of(start_s, statuses);
        let _ = writeln!(self.out.memory_file, "{}", serde_json::to_string(&s).expect("serializes"));
        let cfg = &self.cfg;
        if let Err(f) = self.checks.leak(&s, cfg).and_then(|()| self.checks.one_holder(&s)) {
            return Err(self.failed(f));
        }
        for (peak, used) in self.peak_used.iter_mut().zip(&s.device_used) {
            *peak = (*peak).max(*used);
        }
        if self.step.memory.first().is_some_and(|f| f.step != s.step) {
            self.step.memory.clear();
        }
        self.step.memory.push(s);
        Ok(())
    }

    /// The run failed: the memory at that moment goes into memory.jsonl as a sample of phase
    /// `failed: <phase>`, and the timeline marks it (an out-of-memory demo shows where it ran
    /// out). Whatever workers still answer are sampled; the others are missing from it.
    pub(in crate::run) fn mark_failure(&mut self, fleet: &crate::run::fleet::Fleet, e: &crate::run::RunError) {
        // An interrupted run ends at once, and the failed worker may be the one that does not
        // answer: neither is waited for.
        let statuses =
            if e.kind == FailKind::Interrupted { Vec::new() } else { fleet.statuses_of_live(e.worker.as_deref()) };
        let start_s = self.timeline.phase_started_s;
        let mut s = self.sample_of(start_s, statuses);
        s.phase = format!("failed: {}", e.phase);
        let _ = writeln!(self.out.memory_file, "{}", serde_json::to_string(&s).expect("serializes"));
        let _ = self.out.memory_file.flush();
        let what = match e.kind {
            FailKind::OutOfMemory => "out of memory",
            FailKind::Interrupted => "interrupted",
            _ => "failed",
        };
        let who = e.worker.as_deref().map(|w| format!(" ({w})")).unwrap_or_default();
        self.timeline.failure_mark = Some((s.t_s, format!("{what} in {}{who}", e.phase)));
        let device = self.names.iter().find(|n| Some(n.0.as_str()) == e.worker.as_deref()).map(|n| n.1);
        self.timeline.failed_request = e.request.as_deref().map(|r| (device, r.clone()));
    }

    fn sample_of(&self, start_s: f64, statuses: Vec<WorkerStatus>) -> MemSample {
        let devices = self.cfg.total_devices();
        let mut s = MemSample {
            t_s: self.elapsed(),
            start_s,
            step: self.at.step(),
            phase: self.at.phase(),
            device_used: vec![0; devices],
            device_total: vec![0; devices],
            workers: BTreeMap::new(),
            paused: BTreeMap::new(),
            comm_suspended: BTreeMap::new(),
        };
        for WorkerStatus { name, rank, status: st } in statuses {
            let mut tags: BTreeMap<String, u64> = st.tags.iter().map(|t| (t.tag.clone(), t.bytes_active)).collect();
            if !st.communicators.is_empty() {
                let (resident, suspended) = communicator_bytes(&st.communicators);
                tags.insert(NCCL_TAG.into(), resident);
                if st.communicators.iter().any(|c| c.library == NCCL_TAG) {
                    s.comm_suspended.insert(name.clone(), suspended);
                }
            }
            s.workers.insert(name.clone(), tags);
            s.paused.insert(name, st.tags.iter().map(|t| t.bytes_paused).sum());
            if let Some(d) = st.devices.first() {
                s.device_used[rank as usize] = d.total.saturating_sub(d.free);
                s.device_total[rank as usize] = d.total;
            }
        }
        s
    }
}

/// A process's communicators: the device bytes they hold (persistent ones always, buffers unless
/// suspended) and the bytes suspended.
fn communicator_bytes(comms: &[tms_proto::CommInfo]) -> (u64, u64) {
    comms.iter().fold((0, 0), |(resident, suspended), c| {
        if c.suspended {
            (resident + c.persistent_bytes, suspended + c.suspendable_bytes)
        } else {
            (resident + c.persistent_bytes + c.suspendable_bytes, suspended)
        }
    })
}
