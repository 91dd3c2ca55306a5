//! The checks a driver runs as it goes, each counted when it passes (run.checks turns them off):
//! a pause frees the memory it reports, the weights a worker holds are the ones expected, a device
//! two workers share has one holder, and memory at each phase boundary does not grow from step to
//! step (the leak check). `Checks` keeps their count and what they compare against; the
//! recorder's methods (mod.rs) turn a failed check into the run's failure.

use super::MemSample;
use super::report::human;
use crate::run::NCCL_TAG;
use crate::run::config::Config;
use std::collections::BTreeMap;
use tms_proto::OpReport;

/// A check that did not pass: the worker it names, if one, and why.
pub(super) struct Failed {
    pub(super) worker: Option<String>,
    pub(super) cause: String,
}

fn failed(worker: Option<&str>, cause: String) -> Failed {
    Failed { worker: worker.map(String::from), cause }
}

#[derive(Default)]
pub(super) struct Checks {
    pub(super) enabled: bool,
    pub(super) passed: u64,
    /// Per phase: each device's memory in use at its end in the baseline step (the second), for
    /// the leak check.
    leak_baseline: BTreeMap<String, Vec<u64>>,
    /// Elastic mode: each trainer and the lent engine on its device, at most one of which may
    /// hold its tagged memory at a phase boundary.
    shared_devices: Vec<(String, String)>,
}

impl Checks {
    pub(super) fn new(enabled: bool) -> Checks {
        Checks { enabled, ..Checks::default() }
    }

    /// A check the driver made itself passed.
    pub(super) fn pass(&mut self) {
        if self.enabled {
            self.passed += 1;
        }
    }

    /// After a pause of `what` (`tag "weights"`, `every tag`): each worker's device free memory rose
    /// by at least the bytes it reports paused. On a real device the driver's own allocations move
    /// the free figure too (an H200 with driver 580 took 2 MiB for a process's first streams): a
    /// shortfall up to `slack` is allowed there, never on the simulator, which is exact.
    pub(super) fn paused(&mut self, what: &str, reports: &[(String, OpReport)], slack: u64) -> Result<(), Failed> {
        if !self.enabled {
            return Ok(());
        }
        for (name, report) in reports {
            let rose = report.device_free_after.saturating_sub(report.device_free_before);
            if rose + slack < report.bytes_done {
                let cause = format!(
                    "pause {what} reported {} paused but device free memory rose by only {}",
                    human(report.bytes_done),
                    human(rose)
                );
                return Err(failed(Some(name), cause));
            }
            self.passed += 1;
        }
        Ok(())
    }

    /// Each worker's weights checksum (`sums`: name, checksum) is `expected`; `when` says at which
    /// point of the cycle.
    pub(super) fn weights(&mut self, sums: &[(String, String)], expected: &str, when: &str) -> Result<(), Failed> {
        for (name, sum) in sums {
            if sum != expected {
                let cause =
                    format!("weights checksum {when} is {sum}, expected {expected}: the weights were not preserved");
                return Err(failed(Some(name), cause));
            }
            self.passed += 1;
        }
        Ok(())
    }

    /// Elastic mode: pairs of workers that share a device (a trainer and the lent engine on its
    /// device; with elastic.lend_rollout also a lent trainer and the engine it sits beside).
    pub(super) fn share_devices(&mut self, pairs: Vec<(String, String)>) {
        self.shared_devices.extend(pairs);
    }

    /// On a device one side lends, its worker and the lent one never both hold their tagged
    /// memory: one of them is asleep at every phase boundary, and the device is never over its
    /// capacity. Communicator buffers are not tagged memory and stay out of it.
    pub(super) fn one_holder(&mut self, s: &MemSample) -> Result<(), Failed> {
        if !self.enabled || self.shared_devices.is_empty() {
            return Ok(());
        }
        let held = |name: &str| -> u64 {
            s.workers.get(name).map_or(0, |tags| tags.iter().filter(|(t, _)| *t != NCCL_TAG).map(|(_, b)| b).sum())
        };
        for (trainer, engine) in &self.shared_devices {
            let (t, e) = (held(trainer), held(engine));
            if t > 0 && e > 0 {
                let cause = format!(
                    "after {} both {trainer} ({}) and {engine} ({}) hold device memory on the device they share: one of \
                     them must be asleep",
                    s.phase,
                    human(t),
                    human(e)
                );
                return Err(failed(None, cause));
            }
            self.passed += 1;
        }
        for (d, (used, total)) in s.device_used.iter().zip(&s.device_total).enumerate() {
            if *total > 0 && used > total {
                let cause = format!("after {} device {d} uses {}, over its {}", s.phase, human(*used), human(*total));
                return Err(failed(None, cause));
            }
        }
        Ok(())
    }

    /// Memory in use at each phase boundary against the same boundary of the baseline step (the
    /// second, or the first of a one-step run), within run.leak_tolerance_mib.
    pub(super) fn leak(&mut self, s: &MemSample, cfg: &Config) -> Result<(), Failed> {
        if !self.enabled || s.step == 0 {
            return Ok(());
        }
        let baseline_step = if cfg.run.steps >= 2 { 2 } else { 1 };
        if s.step == baseline_step {
            self.leak_baseline.insert(s.phase.clone(), s.device_used.clone());
            return Ok(());
        }
        let tolerance = (cfg.run.leak_tolerance_mib * (1u64 << 20) as f64) as u64;
        let Some(base) = self.leak_baseline.get(&s.phase) else { return Ok(()) };
        for (d, (now, was)) in s.device_used.iter().zip(base).enumerate() {
            if *now > was + tolerance {
                let cause = format!(
                    "leak check: device {d} uses {} after {} at step {}, {} more than at step {baseline_step} \
                     (tolerance run.leak_tolerance_mib = {})",
                    human(*now),
                    s.phase,
                    s.step,
                    human(now - was),
                    cfg.run.leak_tolerance_mib
                );
                return Err(failed(None, cause));
            }
        }
        self.passed += 1;
        Ok(())
    }
}
