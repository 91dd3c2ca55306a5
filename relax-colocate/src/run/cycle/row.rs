//! The step's metrics row: every layout's part (job.rs's `step_row`) with colocate's account of
//! the step: slime's, step = train_wait + train, every phase of the step counted.

use super::Colocate;
use crate::run::job::{self, StepTimes, Trained};

impl Colocate {
    /// The step's row, written to metrics.jsonl, the loggers and the progress line.
    pub(super) fn write_metrics(&mut self, trained: &Trained, wall_s: f64) {
        let step_s: f64 = self.rig.rec.step_times().values().sum();
        let times = StepTimes { step_s, wait_s: step_s - job::train_seconds(&self.rig.rec), wall_s };
        let row = job::step_row(&self.rig.cfg, &self.rig.task, &self.rig.rec, trained, times);
        self.rig.rec.record_step(&row);
    }
}
