//! The step's metrics row, under slime's names (metrics.rs renames it for verl): phase times,
//! rewards, pass rates, lengths, log-probs, KL, advantages, the trainer's metrics and memory.

use super::Colocate;
use crate::run::learn::{self, Advantages, Sample, Scores};
use crate::run::metrics;
use crate::run::protocol::TrainReply;

/// What one step produced, for its metrics row.
pub(super) struct StepData<'a> {
    pub(super) wall_s: f64,
    pub(super) samples: &'a [Sample],
    /// (reward, exact) per sample.
    pub(super) scored: &'a [(f64, bool)],
    pub(super) scores: &'a Scores,
    pub(super) adv: &'a Advantages,
    pub(super) train: TrainReply,
}

impl Colocate {
    /// The step's row under slime's names (metrics.rs renames it for verl), written to
    /// metrics.jsonl, the loggers and the progress line.
    pub(super) fn write_metrics(&mut self, d: &StepData) {
        let mut row = metrics::Row::new(self.step());
        let times = self.rec.step_times();
        let t = |k: &str| times.get(k).copied().unwrap_or(0.0);
        let train_time = t("ref_log_probs") + t("log_probs") + t("values") + t("advantages") + t("actor_train");
        let step_time: f64 = times.values().sum();
        for (k, v) in times {
            row.set(&metrics::phase_time(k), *v);
        }
        // slime: step = train_wait + train, and the share of it spent waiting.
        row.set("perf/train_time", train_time);
        row.set("perf/train_wait_time", step_time - train_time);
        row.set("perf/step_time", step_time);
        if step_time > 0.0 {
            row.set("perf/wait_time_ratio", (step_time - train_time) / step_time);
        }
        row.set("perf/wall_step_time", d.wall_s);
        if let Some(scale) = self.token_scale() {
            row.set("compute/token_scale", scale);
        }

        learn::sample_metrics(
            &mut row,
            &self.cfg,
            &self.task,
            &learn::Outcome { samples: d.samples, scored: d.scored, scores: d.scores, adv: d.adv, train: &d.train },
        );
        for s in self.rec.step_memory() {
            metrics::add_memory(&mut row, s);
        }
        self.rec.record_step(&row);
    }
}
