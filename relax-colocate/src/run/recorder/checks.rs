//! The checks a driver runs as it goes, each counted when it passes (run.checks turns them off):
//! a pause frees the memory it reports, and the weights a worker holds are the ones expected.
//! The leak check is sampling.rs's.

use super::report::human;
use super::{MemSample, Recorder};
use crate::run::{FailKind, NCCL_TAG, R};
use tms_proto::OpReport;

impl Recorder {
    /// A check the driver made itself passed (e.g. no sample over the staleness bound trained on).
    pub(in crate::run) fn count_check(&mut self) {
        if self.cfg.run.checks {
            self.checks.passed += 1;
        }
    }

    /// After a pause of `what` (`tag "weights"`, `every tag`): each worker's device free memory rose
    /// by at least the bytes it reports paused. On a real device the driver's own allocations move
    /// the free figure too (an H200 with driver 580 took 2 MiB for a process's first streams): a
    /// shortfall up to DRIVER_SLACK is allowed there, never on the simulator, which is exact.
    pub(in crate::run) fn check_paused(&mut self, what: &str, reports: &[(String, OpReport)]) -> R<()> {
        const DRIVER_SLACK: u64 = 4 << 20;
        if !self.cfg.run.checks {
            return Ok(());
        }
        let slack = if self.cfg.run.device == crate::run::config::DeviceChoice::Sim { 0 } else { DRIVER_SLACK };
        for (name, report) in reports {
            let rose = report.device_free_after.saturating_sub(report.device_free_before);
            if rose + slack < report.bytes_done {
                let cause = format!(
                    "pause {what} reported {} paused but device free memory rose by only {}",
                    human(report.bytes_done),
                    human(rose)
                );
                return Err(self.fail(FailKind::Check, Some(name), cause));
            }
            self.checks.passed += 1;
        }
        Ok(())
    }

    /// A pause of tag `nccl` suspended these communicator bytes (the reports' `bytes_done`:
    /// ncclCommMemStats' suspendable figure of each communicator suspended), for the summary.
    pub(in crate::run) fn record_comm_suspended(&mut self, reports: &[(String, OpReport)]) {
        for (name, report) in reports {
            self.comm_suspended.insert(name.clone(), report.bytes_done);
        }
    }

    /// Each worker's weights checksum (`sums`: name, checksum) is `expected`; `when` says at which
    /// point of the cycle.
    pub(in crate::run) fn check_weights(&mut self, sums: &[(String, String)], expected: &str, when: &str) -> R<()> {
        for (name, sum) in sums {
            if sum != expected {
                let cause =
                    format!("weights checksum {when} is {sum}, expected {expected}: the weights were not preserved");
                return Err(self.fail(FailKind::Check, Some(name), cause));
            }
            self.checks.passed += 1;
        }
        Ok(())
    }

    /// Elastic mode: pairs of workers that share a device (a trainer and the lent engine on its
    /// device; with elastic.lend_rollout also a lent trainer and the engine it sits beside), for
    /// `check_one_holder` at every phase boundary.
    pub(in crate::run) fn add_shared_devices(&mut self, pairs: Vec<(String, String)>) {
        self.checks.shared_devices.extend(pairs);
    }

    /// On a device one side lends, its worker and the lent one never both hold their tagged
    /// memory: one of them is asleep at every phase boundary, and the device is never over its
    /// capacity. Communicator buffers are not tagged memory and stay out of it.
    pub(super) fn check_one_holder(&mut self, s: &MemSample) -> R<()> {
        if !self.cfg.run.checks || self.checks.shared_devices.is_empty() {
            return Ok(());
        }
        let held = |name: &str| -> u64 {
            s.workers.get(name).map_or(0, |tags| tags.iter().filter(|(t, _)| *t != NCCL_TAG).map(|(_, b)| b).sum())
        };
        for (trainer, engine) in &self.checks.shared_devices {
            let (t, e) = (held(trainer), held(engine));
            if t > 0 && e > 0 {
                let cause = format!(
                    "after {} both {trainer} ({}) and {engine} ({}) hold device memory on the device they share: one of \
                     them must be asleep",
                    s.phase,
                    human(t),
                    human(e)
                );
                return Err(self.fail(FailKind::Check, None, cause));
            }
            self.checks.passed += 1;
        }
        for (d, (used, total)) in s.device_used.iter().zip(&s.device_total).enumerate() {
            if *total > 0 && used > total {
                let cause = format!("after {} device {d} uses {}, over its {}", s.phase, human(*used), human(*total));
                return Err(self.fail(FailKind::Check, None, cause));
            }
        }
        Ok(())
    }
}
