//! The colocated driver: trainer and rollout share each device and take turns with its memory,
//! in slime's order. Setup, then per step (step.rs) generate, offload, wake-up, the trainer's
//! phases, sleep and the weights hand-over, with the checks; the step's metrics row is row.rs's.
//! It runs over the fleet (requests, pause and resume) and the recorder (phases, checks, rows).

mod row;
mod step;

use super::config::Config;
use super::fleet::Fleet;
use super::launch::Plan;
use super::profile::Profile;
use super::protocol::{Init, Method, SaveState, Step};
use super::recorder::Recorder;
use super::task::Addition;
use super::{Cursor, FailKind, NCCL_TAG, R, Role, RunError, learn, model, weights};
use std::rc::Rc;
use weights::WeightSync;

pub(super) struct Colocate {
    pub(super) cfg: Config,
    /// Where the run is (step, phase), shared with the fleet and the recorder.
    pub(super) at: Rc<Cursor>,
    task: Addition,
    shape: model::Shape,
    pub(super) profile: Profile,
    api: crate::vendor::ApiKind,
    /// How update_weights moves the weights (ipc by default), and what it moved.
    pub(super) sync: WeightSync,
    pub(super) fleet: Fleet,
    pub(super) rec: Recorder,
    /// The trainer's weights as it last went to sleep: what it must wake up with.
    weights_checksum: Option<String>,
    /// The trainers' sleep suspended their NCCL communicators: wake_up resumes them.
    comms_suspended: bool,
}

impl Colocate {
    pub(super) fn new(cfg: &Config, plan: Plan, fleet: Fleet, rec: Recorder) -> Colocate {
        let sync = WeightSync::new(cfg, &plan, &fleet);
        Colocate {
            cfg: cfg.clone(),
            at: rec.cursor(),
            task: plan.task,
            shape: plan.shape,
            profile: plan.profile,
            api: plan.api,
            sync,
            fleet,
            rec,
            weights_checksum: None,
            comms_suspended: false,
        }
    }

    fn step(&self) -> u64 {
        self.at.step()
    }

    fn fail(&self, kind: FailKind, worker: Option<&str>, cause: impl Into<String>) -> RunError {
        self.at.fail(kind, worker, cause)
    }

    fn indices(&self, role: Role) -> Vec<usize> {
        self.fleet.indices(role)
    }

    fn call_each<M: Method>(&mut self, targets: &[usize], params: Vec<M::Params>) -> R<Vec<M::Reply>> {
        self.fleet.call_each::<M>(targets, params)
    }

    fn call_all<M: Method>(&mut self, role: Role, params: M::Params) -> R<Vec<M::Reply>> {
        self.fleet.call_all::<M>(role, params)
    }

    /// Runs one timed phase: the recorder times it and samples the fleet's memory at its end.
    fn phase<T>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> R<T>) -> R<T> {
        let span = self.rec.begin(name);
        let out = f(self)?;
        self.rec.end(span, &self.fleet)?;
        Ok(out)
    }

    /// Pause or resume `tag` (None: all) in every worker of `role`; after a pause, the recorder
    /// checks that free memory rose by what was paused.
    fn control(&mut self, role: Role, pause: bool, tag: Option<&str>) -> R<()> {
        let reports = self.fleet.control(role, pause, tag)?;
        if !pause {
            return Ok(());
        }
        let what = tag.map(|t| format!("tag {t:?}")).unwrap_or_else(|| "every tag".into());
        if tag == Some(NCCL_TAG) {
            self.rec.record_comm_suspended(&reports);
        }
        self.rec.check_paused(&what, &reports)
    }

    /// Whether a trainer holds NCCL communicators now (a process group of data-parallel trainers).
    fn trainers_have_communicators(&self) -> R<bool> {
        self.fleet.holds_nccl(&self.indices(Role::Trainer))
    }

    /// Every worker of `role` must hold `expected`.
    fn expect_checksum(&mut self, role: Role, expected: &str, when: &str) -> R<()> {
        weights::expect_checksum(&mut self.fleet, &mut self.rec, role, expected, when)
    }

    fn sleep_trainer(&mut self) -> R<()> {
        self.phase("sleep", |r| {
            if !r.cfg.memory.backup {
                r.call_all::<SaveState>(Role::Trainer, Step { step: r.step() })?;
            }
            r.control(Role::Trainer, true, None)?;
            // Pausing every tag leaves communicators alone (a framework may sync weights over
            // them asleep); the trainer's are idle until wake_up, so their buffers sleep too.
            // slime destroys its process groups here; suspending keeps them.
            if r.cfg.memory.suspend_communicators && r.trainers_have_communicators()? {
                r.control(Role::Trainer, true, Some(NCCL_TAG)).map_err(|mut e| {
                    e.cause += "; memory.suspend_communicators = false leaves the communicators awake";
                    e
                })?;
                r.comms_suspended = true;
            }
            Ok(())
        })
    }

    fn update_weights(&mut self) -> R<()> {
        self.phase("update_weights", |r| r.sync.transfer(&mut r.fleet, &r.at, &mut r.rec, r.at.step()).map(drop))
    }

    /// Rollout and trainer start, the trainer's initial weights reach the rollout: slime's
    /// colocated startup.
    pub(in crate::run) fn setup(&mut self) -> R<()> {
        let offload = self.cfg.run.offload;
        let per_device = self.cfg.rollout.prompts_per_step / self.cfg.total_devices();
        let max_batch = per_device * self.cfg.rollout.samples_per_prompt;
        let init = |r: &Colocate, role: Role| {
            learn::init_params(&r.cfg, &r.fleet, role, r.api, r.shape, &r.profile, max_batch)
        };
        self.phase("init_rollout", |r| {
            let p = init(r, Role::Rollout);
            let targets = r.indices(Role::Rollout);
            r.call_each::<Init>(&targets, p)?;
            r.fleet.find_control_sockets(Role::Rollout)
        })?;
        if offload {
            self.phase("rollout_offload", |r| r.control(Role::Rollout, true, None))?;
        }
        self.phase("init_trainer", |r| {
            let p = init(r, Role::Trainer);
            let targets = r.indices(Role::Trainer);
            r.call_each::<Init>(&targets, p).map_err(|mut e| {
                if e.kind == FailKind::OutOfMemory && !r.cfg.run.offload {
                    e.cause += "; the trainer and the rollout do not fit on the device together: \
                                run with offload (run.offload = true) so the rollout sleeps first";
                }
                e
            })?;
            r.fleet.find_control_sockets(Role::Trainer)
        })?;
        self.hand_weights_to_rollout("on the rollout after the initial update_weights")
    }

    /// The second half of every step (and of setup): record the trainer's weights, put it to
    /// sleep, wake the rollout's weights, push the trainer's into them and check they arrived,
    /// then wake the KV cache last so the peak stays low.
    fn hand_weights_to_rollout(&mut self, when: &str) -> R<()> {
        let offload = self.cfg.run.offload;
        let sum = weights::trainer_checksum(&mut self.fleet, &self.at)?;
        self.weights_checksum = Some(sum.clone());
        if offload {
            self.sleep_trainer()?;
            self.phase("onload_weights", |r| r.control(Role::Rollout, false, Some("weights")))?;
        }
        self.update_weights()?;
        self.expect_checksum(Role::Rollout, &sum, when)?;
        if offload {
            self.phase("onload_kv", |r| {
                r.control(Role::Rollout, false, Some("kv_cache"))?;
                r.control(Role::Rollout, false, Some("cuda_graph"))
            })?;
        }
        Ok(())
    }
}
