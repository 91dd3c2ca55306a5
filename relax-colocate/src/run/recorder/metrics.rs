//! What a metrics row is called and holds: slime's names (the default) or verl's, every value a
//! number, memory as flat scalar keys. The one table of names is `NAMES`; README and
//! docs/metrics.md describe it.
//!
//! The runner builds each row under slime's names; `render` renames it for the configured style
//! just before the row is written, so the report reads any run through `name`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Number, Value};
use std::collections::BTreeMap;

/// Whose metric names a run writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Style {
    /// slime's names (`rollout/raw_reward`, `train/pg_clipfrac`, `perf/*_time`).
    Slime,
    /// verl's names (`critic/score/mean`, `actor/pg_clipfrac`, `timing_s/*`).
    Verl,
}

/// slime's name → verl's, for every metric both have (each verl name as volcengine/verl emits it:
/// verl/trainer/ppo/metric_utils.py, ray_trainer.py, rollout_corr_helper.py, workers/utils/
/// losses.py, experimental/fully_async_policy/). A slime `perf/<x>_time` not listed here becomes
/// verl's `timing_s/<x>` (verl logs every timer that way); a `rollout/`, `train/`, `passrate/` or
/// `partial/` name verl has no metric for goes under `relax/` (VERL_HAS_NONE), so a verl-style
/// row holds no slime namespace; every other name (ours: `memory/`, `elastic/`, `fully_async/`,
/// `perf/`, …) is the same in both styles.
pub const NAMES: &[(&str, &str)] = &[
    ("perf/rollout_time", "timing_s/gen"),
    ("perf/log_probs_time", "timing_s/old_log_prob"),
    ("perf/ref_log_probs_time", "timing_s/ref"),
    ("perf/values_time", "timing_s/values"),
    ("perf/advantages_time", "timing_s/adv"),
    ("perf/actor_train_time", "timing_s/update_actor"),
    ("perf/update_weights_time", "timing_s/update_weights"),
    ("perf/step_time", "timing_s/step"),
    ("rollout/raw_reward", "critic/score/mean"),
    ("rollout/kl_penalized_reward", "critic/rewards/mean"),
    ("rollout/advantages", "critic/advantages/mean"),
    ("rollout/returns", "critic/returns/mean"),
    ("rollout/values", "critic/values/mean"),
    ("rollout/response_len/mean", "response_length/mean"),
    ("rollout/response_len/max", "response_length/max"),
    ("rollout/response_len/min", "response_length/min"),
    ("rollout/truncated_ratio", "response_length/clip_ratio"),
    ("rollout/kl", "actor/reward_kl_penalty"),
    ("train/pg_loss", "actor/pg_loss"),
    ("train/pg_clipfrac", "actor/pg_clipfrac"),
    ("train/dual_clip_frac", "actor/pg_clipfrac_lower"),
    ("train/ppo_kl", "actor/ppo_kl"),
    ("train/kl_loss", "actor/kl_loss"),
    // verl's old-log-prob pass logs the entropy before training as `actor/entropy`; its engine
    // workers name the entropy while training `actor/entropy_loss`.
    ("rollout/entropy", "actor/entropy"),
    ("train/entropy_loss", "actor/entropy_loss"),
    // verl's engine workers' total loss (ours adds the value loss in PPO; verl's critic is apart).
    ("train/loss", "actor/loss"),
    ("perf/train_wait_time", "fully_async/total_wait_time"),
    ("partial/partial_ratio", "fully_async/partial/partial_ratio"),
    ("partial/max_partial_span", "fully_async/partial/max_partial_span"),
    ("train/grad_norm", "actor/grad_norm"),
    ("train/lr-pg_0", "actor/lr"),
    ("train/value_loss", "critic/vf_loss"),
    ("train/value_clipfrac", "critic/vf_clipfrac"),
    ("train/tis", "rollout_corr/rollout_is_mean"),
    ("train/tis_max", "rollout_corr/rollout_is_max"),
    ("train/tis_min", "rollout_corr/rollout_is_min"),
    ("train/tis_clipfrac", "rollout_corr/rollout_is_ratio_fraction_high"),
    ("train/rollout_train_logprob_diff", "rollout_corr/kl"),
];

/// The name `slime_name` is written under in `style`.
pub fn name(style: Style, slime_name: &str) -> String {
    if style == Style::Slime {
        return slime_name.to_string();
    }
    if let Some((_, verl)) = NAMES.iter().find(|(s, _)| *s == slime_name) {
        return (*verl).to_string();
    }
    if let Some(timer) = slime_name.strip_prefix("perf/").and_then(|r| r.strip_suffix("_time")) {
        return format!("timing_s/{timer}");
    }
    if VERL_HAS_NONE.iter().any(|ns| slime_name.starts_with(ns)) {
        return format!("relax/{slime_name}");
    }
    slime_name.to_string()
}

/// slime's namespaces: in verl style a metric of theirs that verl does not have (pass@k, the mean
/// log-probs, the median length, tokens trained, …) is written as `relax/<slime name>`.
pub const VERL_HAS_NONE: &[&str] = &["rollout/", "train/", "passrate/", "partial/"];

/// slime's name for the time of one of the cycle's phases: generating is slime's rollout time.
pub fn phase_time(phase: &str) -> String {
    match phase {
        "generate" => "perf/rollout_time".into(),
        p => format!("perf/{p}_time"),
    }
}

/// slime's name for a metric a trainer worker returns from `train`: the worker protocol lets a
/// worker name its numbers freely; the names tms's own workers and the example use are mapped to
/// slime's, any other lands under `train/` as it is.
pub fn train_metric(worker_name: &str) -> String {
    let slime = match worker_name {
        "kl" => "kl_loss",
        "entropy" => "entropy_loss",
        "clip_frac" => "pg_clipfrac",
        "value_clip_frac" => "value_clipfrac",
        other => other,
    };
    format!("train/{slime}")
}

/// One step's metrics under slime's names: `step` and numbers, nothing nested.
#[derive(Debug, Clone)]
pub struct Row {
    pub step: u64,
    values: BTreeMap<String, Number>,
}

impl Row {
    pub fn new(step: u64) -> Row {
        Row { step, values: BTreeMap::new() }
    }

    /// Sets a metric; a NaN or infinity is left out, since JSON (and so metrics.jsonl) has no
    /// number for it and a `null` would break the rule that every value is a number.
    pub fn set(&mut self, key: &str, v: f64) {
        if let Some(n) = Number::from_f64(v) {
            self.values.insert(key.to_string(), n);
        }
    }

    /// Sets a byte count, kept an integer so it reads back exactly.
    pub fn set_bytes(&mut self, key: &str, v: u64) {
        self.values.insert(key.to_string(), Number::from(v));
    }

    pub fn get(&self, key: &str) -> Option<f64> {
        self.values.get(key).and_then(Number::as_f64)
    }

    /// The row as written to metrics.jsonl and handed to the loggers, under `style`'s names.
    pub fn render(&self, style: Style) -> Map<String, Value> {
        let mut out = Map::new();
        out.insert("step".into(), Value::from(self.step));
        for (k, v) in &self.values {
            out.insert(name(style, k), Value::Number(v.clone()));
        }
        out
    }
}

/// A rendered row as one metrics.jsonl line, `step` first (serde_json's maps sort their keys,
/// which would put it among the `memory/` keys, where a reader of the file looks last).
pub fn json_line(row: &Map<String, Value>) -> String {
    let step = row.get("step").cloned().unwrap_or(Value::from(0));
    let rest: Map<String, Value> =
        row.iter().filter(|(k, _)| *k != "step").map(|(k, v)| (k.clone(), v.clone())).collect();
    let body = Value::Object(rest).to_string();
    let sep = if body.len() > 2 { "," } else { "" };
    format!("{{\"step\":{step}{sep}{}", &body[1..])
}

/// Mean of an iterator; 0 for none.
pub fn mean(it: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = it.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}

/// slime's `passrate/pass@k` (log_passrate): for k = 1, 2, 4, … up to the group size, the mean
/// over groups of the unbiased pass@k estimate 1 − C(n−c, k)/C(n, k), `passed` holding
/// contiguous groups of `group` samples.
pub fn pass_at_k(passed: &[bool], group: usize) -> Vec<(usize, f64)> {
    if group < 2 || passed.is_empty() || !passed.len().is_multiple_of(group) {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut k = 1;
    while k <= group {
        let estimates = passed.chunks(group).map(|g| {
            let (n, c) = (group, g.iter().filter(|p| **p).count());
            if n - c < k { 1.0 } else { 1.0 - ((n - c + 1)..=n).map(|i| 1.0 - k as f64 / i as f64).product::<f64>() }
        });
        out.push((k, mean(estimates)));
        k *= 2;
    }
    out
}

/// Statistics slime logs for a list (compute_statistics): mean, median, max, min.
pub fn statistics(values: &[f64]) -> [(&'static str, f64); 4] {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    };
    [
        ("mean", mean(v.iter().copied())),
        ("median", median),
        ("max", v.last().copied().unwrap_or(0.0)),
        ("min", v.first().copied().unwrap_or(0.0)),
    ]
}

/// Memory at one phase boundary as flat keys: `memory/<process>/<tag>/<phase>_bytes` (resident
/// bytes of the tag; `nccl`: its communicators'), `memory/<process>/paused/<phase>_bytes`,
/// `memory/<process>/nccl_suspended/<phase>_bytes` and `memory/device<d>/used/<phase>_bytes`.
pub fn add_memory(row: &mut Row, s: &super::MemSample) {
    let phase = &s.phase;
    for (d, used) in s.device_used.iter().enumerate() {
        row.set_bytes(&format!("memory/device{d}/used/{phase}_bytes"), *used);
    }
    for (worker, tags) in &s.workers {
        for (tag, bytes) in tags {
            row.set_bytes(&format!("memory/{worker}/{tag}/{phase}_bytes"), *bytes);
        }
    }
    for (worker, bytes) in &s.paused {
        row.set_bytes(&format!("memory/{worker}/paused/{phase}_bytes"), *bytes);
    }
    for (worker, bytes) in &s.comm_suspended {
        row.set_bytes(&format!("memory/{worker}/nccl_suspended/{phase}_bytes"), *bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_per_style() {
        assert_eq!(name(Style::Slime, "train/pg_clipfrac"), "train/pg_clipfrac");
        assert_eq!(name(Style::Verl, "train/pg_clipfrac"), "actor/pg_clipfrac");
        assert_eq!(name(Style::Verl, "rollout/raw_reward"), "critic/score/mean");
        assert_eq!(name(Style::Verl, &phase_time("generate")), "timing_s/gen");
        assert_eq!(name(Style::Verl, "perf/sleep_time"), "timing_s/sleep");
        assert_eq!(name(Style::Verl, "passrate/pass@1"), "relax/passrate/pass@1");
        assert_eq!(name(Style::Verl, "rollout/entropy"), "actor/entropy");
        assert_eq!(name(Style::Verl, "train/entropy_loss"), "actor/entropy_loss");
        assert_eq!(name(Style::Verl, "train/tokens"), "relax/train/tokens");
        assert_eq!(name(Style::Verl, &train_metric("my_number")), "relax/train/my_number");
        assert_eq!(name(Style::Verl, "memory/trainer-0/weights/sleep_bytes"), "memory/trainer-0/weights/sleep_bytes");
        assert_eq!(name(Style::Verl, "trainer/idle_ratio"), "trainer/idle_ratio");
        assert_eq!(train_metric("clip_frac"), "train/pg_clipfrac");
        assert_eq!(train_metric("pg_loss"), "train/pg_loss");
        // One slime name per verl name and back: renaming never merges two metrics.
        let mut verl: Vec<_> = NAMES.iter().map(|(_, v)| *v).collect();
        verl.sort_unstable();
        verl.dedup();
        assert_eq!(verl.len(), NAMES.len());
        assert!(NAMES.iter().all(|(s, _)| NAMES.iter().filter(|(t, _)| t == s).count() == 1));
    }

    #[test]
    fn pass_at_k_matches_the_estimator() {
        // Group of 4 with 1 right: pass@1 = 1/4, pass@2 = 1 − C(3,2)/C(4,2) = 1/2, pass@4 = 1.
        let p = pass_at_k(&[true, false, false, false], 4);
        assert_eq!(p.len(), 3);
        assert!((p[0].1 - 0.25).abs() < 1e-12 && (p[1].1 - 0.5).abs() < 1e-12 && (p[2].1 - 1.0).abs() < 1e-12);
        assert!(pass_at_k(&[false; 8], 4).iter().all(|(_, v)| *v == 0.0));
    }

    #[test]
    fn rows_hold_numbers_only() {
        let mut r = Row::new(3);
        r.set("rollout/raw_reward", 0.5);
        r.set("train/grad_norm", f64::NAN);
        r.set_bytes("memory/trainer-0/weights/sleep_bytes", 1 << 40);
        let m = r.render(Style::Verl);
        assert_eq!(m["step"], 3);
        assert_eq!(m["critic/score/mean"], 0.5);
        assert_eq!(m["memory/trainer-0/weights/sleep_bytes"].as_u64(), Some(1 << 40));
        assert!(!m.contains_key("actor/grad_norm"));
        let line = json_line(&m);
        assert!(line.starts_with("{\"step\":3,\""), "{line}");
        assert_eq!(serde_json::from_str::<Value>(&line).unwrap(), Value::Object(m));
        assert_eq!(json_line(&Row::new(1).render(Style::Slime)), "{\"step\":1}");
    }
}
