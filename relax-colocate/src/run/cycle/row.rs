//! The step's metrics row: every layout's part (job.rs's `step_row`) with colocate's account of
//! the step: slime's, step = train_wait + train, every phase of the step counted.

use crate::run::job::{self, StepTimes, Trained};
use crate::run::rig::Rig;

/// The step's row, written to metrics.jsonl, the loggers and the progress line.
pub(super) fn write_metrics(rig: &mut Rig, trained: &Trained, wall_s: f64) {
    let step_s: f64 = rig.rec.step_times().values().sum();
    let times = StepTimes { step_s, wait_s: step_s - job::train_seconds(&rig.rec), wall_s };
    let row = job::step_row(&rig.cfg, &rig.task, &rig.rec, trained, times);
    rig.rec.record_step(&row);
}
