//! The colocated driver: trainer and rollout share each device and take turns with its memory,
//! in slime's order. Setup, then per step (step.rs) generate, offload, wake-up, the trainer's
//! phases, sleep and the weights hand-over, with the checks; the step's metrics row is row.rs's.
//! It runs over the fleet (requests, pause and resume) and the recorder (phases, checks, rows).

mod row;
mod step;

use super::config::Config;
use super::fleet::Fleet;
use super::handover::{self, Handover, Phases, Sleep, Wake};
use super::launch::Plan;
use super::protocol::{Init, Method};
use super::recorder::Recorder;
use super::rig::Rig;
use super::{FailKind, R, Role, RunError, weights};

pub(super) struct Colocate {
    pub(super) rig: Rig,
    /// The trainer's weights as it last went to sleep: what it must wake up with.
    weights_checksum: Option<String>,
    /// The trainers' sleep suspended their NCCL communicators: wake_up resumes them.
    comms_suspended: bool,
}

impl Colocate {
    pub(super) fn new(cfg: &Config, plan: Plan, fleet: Fleet, rec: Recorder) -> Colocate {
        Colocate { rig: Rig::new(cfg, plan, fleet, rec), weights_checksum: None, comms_suspended: false }
    }

    fn step(&self) -> u64 {
        self.rig.at.step()
    }

    fn fail(&self, kind: FailKind, worker: Option<&str>, cause: impl Into<String>) -> RunError {
        self.rig.at.fail(kind, worker, cause)
    }

    fn indices(&self, role: Role) -> Vec<usize> {
        self.rig.fleet.indices(role)
    }

    fn call_each<M: Method>(&mut self, targets: &[usize], params: Vec<M::Params>) -> R<Vec<M::Reply>> {
        self.rig.fleet.call_each::<M>(targets, params)
    }

    /// Runs one timed phase: the recorder times it and samples the fleet's memory at its end.
    fn phase<T>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> R<T>) -> R<T> {
        let span = self.rig.rec.begin(name);
        let out = f(self)?;
        self.rig.rec.end(span, &self.rig.fleet)?;
        Ok(out)
    }

    /// Rollout and trainer start, the trainer's initial weights reach the rollout: slime's
    /// colocated startup.
    pub(in crate::run) fn setup(&mut self) -> R<()> {
        let offload = self.rig.cfg.run.offload;
        let per_device = self.rig.cfg.rollout.prompts_per_step / self.rig.cfg.total_devices();
        let max_batch = per_device * self.rig.cfg.rollout.samples_per_prompt;
        self.phase("init_rollout", |r| {
            let p = r.rig.init_params(Role::Rollout, max_batch);
            let targets = r.indices(Role::Rollout);
            r.call_each::<Init>(&targets, p)?;
            r.rig.fleet.find_control_sockets(Role::Rollout)
        })?;
        if offload {
            let rollouts = self.indices(Role::Rollout);
            self.phase("rollout_offload", |r| handover::pause(&mut r.rig.fleet, &mut r.rig.rec, &rollouts, None))?;
        }
        self.phase("init_trainer", |r| {
            let p = r.rig.init_params(Role::Trainer, max_batch);
            let targets = r.indices(Role::Trainer);
            r.call_each::<Init>(&targets, p).map_err(|mut e| {
                if e.kind == FailKind::OutOfMemory && !r.rig.cfg.run.offload {
                    e.cause += "; the trainer and the rollout do not fit on the device together: \
                                run with offload (run.offload = true) so the rollout sleeps first";
                }
                e
            })?;
            r.rig.fleet.find_control_sockets(Role::Trainer)
        })?;
        self.hand_weights_to_rollout("on the rollout after the initial update_weights")
    }

    /// The second half of every step (and of setup): record the trainer's weights, put it to
    /// sleep, wake the rollout's weights, push the trainer's into them and check they arrived,
    /// then wake the KV cache last so the peak stays low.
    fn hand_weights_to_rollout(&mut self, when: &str) -> R<()> {
        let sum = weights::trainer_checksum(&mut self.rig.fleet, &self.rig.at)?;
        self.weights_checksum = Some(sum.clone());
        let (trainers, rollouts) = (self.indices(Role::Trainer), self.indices(Role::Rollout));
        let sleep = Sleep::of_trainer(&self.rig.cfg);
        let (sync, at, step) = (&mut self.rig.sync, &self.rig.at, self.rig.at.step());
        let mut update = |f: &mut Fleet, r: &mut Recorder| sync.transfer(f, at, r, step).map(drop);
        if !self.rig.cfg.run.offload {
            let span = self.rig.rec.begin("update_weights");
            update(&mut self.rig.fleet, &mut self.rig.rec)?;
            self.rig.rec.end(span, &self.rig.fleet)?;
            return handover::expect_weights(&mut self.rig.fleet, &mut self.rig.rec, &rollouts, &sum, when);
        }
        let handed = Handover {
            from: &trainers,
            sleep,
            to: &rollouts,
            wake: Wake::Serving,
            expect: Some((&sum, when)),
            phases: Some(Phases {
                sleep: "sleep",
                wake: "onload_weights",
                cargo: Some("update_weights"),
                finish: "onload_kv",
            }),
            model: self.rig.switch.as_deref(),
        }
        .run(&mut self.rig.fleet, &mut self.rig.rec, update)?;
        self.comms_suspended = handed.comms_suspended;
        Ok(())
    }
}
