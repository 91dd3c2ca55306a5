//! The step's metrics row, under slime's names (metrics.rs renames it for verl): phase times,
//! rewards, pass rates, lengths, log-probs, KL, advantages, the trainer's metrics and memory.

use super::Colocate;
use super::step::{Advantages, Sample, Scores};
use crate::run::metrics::{self, mean};
use crate::run::protocol::TrainReply;
use crate::run::task;

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

        let flat = |v: &[Vec<f64>]| mean(v.iter().flatten().copied());
        row.set("rollout/raw_reward", mean(d.scored.iter().map(|s| s.0)));
        row.set("rollout/kl_penalized_reward", mean(d.adv.penalized.iter().copied()));
        let passed: Vec<bool> = d.scored.iter().map(|s| s.1).collect();
        for (k, v) in metrics::pass_at_k(&passed, self.cfg.rollout.samples_per_prompt) {
            row.set(&format!("passrate/pass@{k}"), v);
        }
        let lengths: Vec<f64> = d.samples.iter().map(|s| s.response.len() as f64).collect();
        for (stat, v) in metrics::statistics(&lengths) {
            row.set(&format!("rollout/response_len/{stat}"), v);
        }
        let max_new = self.task.max_new_tokens();
        let truncated = d.samples.iter().map(|s| {
            let r = &s.response;
            f64::from(u8::from(r.len() >= max_new && r.last() != Some(&task::EOS)))
        });
        row.set("rollout/truncated_ratio", mean(truncated));
        row.set("rollout/log_probs", flat(&d.scores.old_lp));
        row.set("rollout/ref_log_probs", flat(&d.scores.ref_lp));
        row.set("rollout/rollout_log_probs", mean(d.samples.iter().flat_map(|s| s.logprobs.iter().copied())));
        row.set("rollout/entropy", flat(&d.scores.entropy));
        row.set("rollout/kl", d.adv.kl_ref);
        row.set("rollout/advantages", flat(&d.adv.advantages));
        if !d.adv.returns.is_empty() {
            row.set("rollout/returns", flat(&d.adv.returns));
            row.set("rollout/values", flat(&d.scores.values));
        }
        let diffs = || {
            let pairs = d.samples.iter().zip(&d.scores.old_lp);
            pairs.flat_map(|(s, o)| s.logprobs.iter().zip(o).map(|(a, b)| (a - b).abs()))
        };
        row.set("train/train_rollout_logprob_abs_diff", mean(diffs()));
        row.set("rollout/logprob_abs_diff_max", diffs().fold(0.0, f64::max));
        row.set("train/lr-pg_0", self.cfg.algo.lr);
        for (k, v) in &d.train.0 {
            if let Some(x) = v {
                row.set(&metrics::train_metric(k), *x);
            }
        }
        for s in self.rec.step_memory() {
            metrics::add_memory(&mut row, s);
        }
        self.rec.record_step(&row);
    }
}
