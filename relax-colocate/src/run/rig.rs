//! What every driver works with, whatever its layout: the resolved configuration and the plan's
//! model, task and vendor, where the run is, the fleet of workers, the recorder, and the weight
//! transport. A driver holds one `Rig` and only its own state beside it.

use super::config::Config;
use super::fleet::Fleet;
use super::launch::Plan;
use super::profile::Profile;
use super::protocol::InitParams;
use super::recorder::Recorder;
use super::switch::SwitchModel;
use super::task::Addition;
use super::weights::WeightSync;
use super::{Cursor, Role, learn, model};
use crate::vendor::ApiKind;
use std::rc::Rc;

pub(super) struct Rig {
    pub(super) cfg: Config,
    /// Where the run is (step, phase), shared with the fleet and the recorder.
    pub(super) at: Rc<Cursor>,
    pub(super) task: Addition,
    pub(super) shape: model::Shape,
    pub(super) profile: Profile,
    pub(super) api: ApiKind,
    pub(super) fleet: Fleet,
    pub(super) rec: Recorder,
    /// How update_weights moves the weights, and what it moved.
    pub(super) sync: WeightSync,
    /// With compute.model: the switch's device time (switch.rs).
    pub(super) switch: Option<Rc<SwitchModel>>,
}

impl Rig {
    /// Every worker of `role`'s init request (`max_batch`: the most sequences one request of
    /// theirs holds).
    pub(super) fn init_params(&self, role: Role, max_batch: usize) -> Vec<InitParams> {
        learn::init_params(&self.cfg, &self.fleet, role, self.api, self.shape, &self.profile, max_batch)
    }

    pub(super) fn new(cfg: &Config, plan: Plan, fleet: Fleet, rec: Recorder) -> Rig {
        let switch = SwitchModel::new(cfg).map(Rc::new);
        let sync = WeightSync::new(cfg, &plan, &fleet, switch.clone());
        Rig {
            cfg: cfg.clone(),
            at: rec.cursor(),
            task: plan.task,
            shape: plan.shape,
            profile: plan.profile,
            api: plan.api,
            fleet,
            rec,
            sync,
            switch,
        }
    }
}
