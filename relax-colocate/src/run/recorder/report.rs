//! What a run shows and leaves behind: the progress line, the phase table, summary.json, and the
//! SVG memory timeline and reward curve.

use super::{MemSample, Recorder};
use crate::plot::{self, Axis, Chart, Quantity, RGBColor, Series, Shape, Span, color};
use crate::run::profile::Profile;
use crate::run::summary::{
    AsyncSummary, Checks, Correction, ElasticSummary, Ends, LengthsSteps, LengthsSummary, Memory, PhaseStats,
    RolloutLendSummary, RunSummary, Status, Summary, SwitchStage, SwitchSummary, WeightSyncSummary,
};
use crate::run::{FailKind, RunError};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write as _};

pub fn human(bytes: u64) -> String {
    tms_proto::size::format_size(bytes)
}

/// A live line on a terminal; one line per step otherwise; nothing when quiet.
pub struct Progress {
    quiet: bool,
    tty: bool,
    open_line: std::cell::Cell<bool>,
}

impl Progress {
    pub fn new(quiet: bool) -> Progress {
        Progress { quiet, tty: std::io::stderr().is_terminal(), open_line: std::cell::Cell::new(false) }
    }

    pub fn note(&self, msg: &str) {
        if !self.quiet {
            eprintln!("{msg}");
        }
    }

    /// `m` is under slime's names whatever the style (it is the row before renaming).
    pub fn step(&self, step: u64, steps: u64, m: &super::metrics::Row) {
        if self.quiet {
            return;
        }
        let g = |k: &str| m.get(k).unwrap_or(0.0);
        // A run without a reference pass has no KL to show, not a KL of 0.
        let kl = m.get("rollout/kl").map_or_else(|| "-".to_string(), |k| format!("{k:.4}"));
        let width = 24usize;
        let filled = (step as usize * width) / steps.max(1) as usize;
        let line = format!(
            "[{}{}] step {step}/{steps}  reward {:.3}  pass {:.2}  kl {kl}  step {:.2}s  sleep {:.3}s  update {:.3}s  wake {:.3}s",
            "#".repeat(filled),
            ".".repeat(width - filled),
            g("rollout/raw_reward"),
            g("passrate/pass@1"),
            g("perf/step_time"),
            g("perf/sleep_time"),
            g("perf/update_weights_time"),
            g("perf/wake_up_time"),
        );
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{line}");
            self.open_line.set(true);
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }

    pub fn finish(&self) {
        if self.open_line.get() {
            eprintln!();
        }
    }
}

fn percentile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((v.len() - 1) as f64 * q).round() as usize;
    v[idx]
}

/// Phases of a step in cycle order, with the names slime logs.
pub const STEP_PHASES: &[&str] = &[
    "generate",
    "rollout_offload",
    "wake_up",
    "ref_log_probs",
    "log_probs",
    "values",
    "advantages",
    "actor_train",
    "sleep",
    "onload_weights",
    "pause_generation",
    "update_weights",
    "onload_kv",
];

/// The lines of a JSON-lines file of the run directory, one at a time (a run of many steps has
/// more than the runner should hold at once); unreadable lines are skipped.
fn read_lines<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> impl Iterator<Item = T> {
    use std::io::BufRead;
    let file = std::fs::File::open(path).ok();
    file.into_iter()
        .flat_map(|f| std::io::BufReader::new(f).lines())
        .filter_map(|l| serde_json::from_str(&l.ok()?).ok())
}

/// Per-step numbers of metrics.jsonl: `keys` (slime's names; read under the run's style) series
/// in file order (only those numbers, not the rows, are held).
fn metric_series(r: &Recorder, keys: &[String]) -> BTreeMap<String, Vec<f64>> {
    let style = r.cfg.metrics.style;
    let mut out: BTreeMap<String, Vec<f64>> = keys.iter().map(|k| (k.clone(), Vec::new())).collect();
    for row in read_lines::<Value>(&r.run_dir.join("metrics.jsonl")) {
        for (k, v) in out.iter_mut() {
            if let Some(x) = row.get(super::metrics::name(style, k)).and_then(Value::as_f64) {
                v.push(x);
            }
        }
    }
    out
}

/// The per-step correction metrics the summary sums up (docs/metrics.md).
const CORRECTION_KEYS: [&str; 4] =
    ["train/tis", "train/tis_max", "train/tis_clipfrac", "train/rollout_train_logprob_diff"];

/// The series `k` of `all` (empty when no step recorded it).
fn series<'a>(all: &'a BTreeMap<String, Vec<f64>>, k: &str) -> &'a [f64] {
    all.get(k).map(Vec::as_slice).unwrap_or_default()
}

/// The mean of `v`; None for no values, which a summary leaves out rather than call 0.
fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The run's off-policy correction and its importance ratios over the steps: mean of the steps'
/// means, the largest, the mean share truncated; and the mean rollout - trainer log-prob gap.
fn correction_summary(r: &Recorder, all: &BTreeMap<String, Vec<f64>>) -> Correction {
    let avg = |k: &str| mean(series(all, k));
    Correction {
        // The clipped PPO ratio to the rollout's log-probs is the correction then, not "none".
        method: if r.cfg.algo.rollout_log_probs { "rollout_log_probs" } else { r.cfg.off_policy_correction().as_str() }
            .into(),
        tis_cap: r.cfg.algo.tis_cap,
        tis_mean: avg("train/tis"),
        tis_max: series(all, "train/tis_max").iter().copied().reduce(f64::max),
        tis_clipfrac_mean: avg("train/tis_clipfrac"),
        rollout_train_logprob_diff_mean: avg("train/rollout_train_logprob_diff"),
    }
}

/// The phases the summary's table gives: every step phase, then the trainer's compute, its wait
/// and the whole step.
fn summary_phases() -> Vec<&'static str> {
    STEP_PHASES.iter().copied().chain(["train", "train_wait", "step"]).collect()
}

/// The metrics.jsonl series the summary reads: the `phases`' times, reward and pass rate, the
/// correction's, the wall step time and the drawn lengths' counts.
fn summary_keys(phases: &[&str]) -> Vec<String> {
    let mut keys: Vec<String> = phases.iter().map(|p| super::metrics::phase_time(p)).collect();
    keys.extend(["rollout/raw_reward".to_string(), "passrate/pass@1".to_string()]);
    keys.extend(CORRECTION_KEYS.iter().map(|k| k.to_string()));
    keys.push("perf/wall_step_time".into());
    keys.extend(["compute/drawn_samples".to_string(), "compute/drawn_response_tokens".to_string()]);
    keys
}

/// Each of the `phases` some step timed: its median, p90 and mean per step, and its share of
/// the steps' time.
fn phase_stats(phases: &[&str], all: &BTreeMap<String, Vec<f64>>) -> Vec<PhaseStats> {
    let total_step: f64 = series(all, "perf/step_time").iter().sum();
    let mut stats = Vec::new();
    for &p in phases {
        let v = series(all, &super::metrics::phase_time(p));
        if v.is_empty() {
            continue;
        }
        let sum: f64 = v.iter().sum();
        stats.push(PhaseStats {
            phase: p.into(),
            median_s: percentile(v.to_vec(), 0.5),
            p90_s: percentile(v.to_vec(), 0.9),
            mean_s: sum / v.len() as f64,
            share_of_step: if total_step > 0.0 { sum / total_step } else { 0.0 },
        });
    }
    stats
}

/// The means of `v`'s first and last `window` steps (all of it when shorter).
fn ends(v: &[f64], window: usize) -> Ends {
    let n = window.min(v.len());
    Ends { first3_mean: mean(&v[..n]), last3_mean: mean(&v[v.len() - n..]), window_steps: window }
}

/// The memory block: what the profile allocates on each device, and what the run saw.
fn memory_summary(r: &Recorder, profile: &Profile) -> Memory {
    Memory {
        profile: r.cfg.memory.profile.clone(),
        trainer_bytes_per_device: profile.trainer.bytes(),
        rollout_bytes_per_device: profile.rollout.bytes(),
        weights_bytes_per_device: profile.rollout.tag_bytes("weights"),
        trainer_allocations: profile.trainer.count() as u64,
        rollout_allocations: profile.rollout.count() as u64,
        peak_device_used: r.peak_used.clone(),
        communicator_bytes_suspended: r.comm_suspended.clone(),
    }
}

/// The lengths block, when the job draws its response lengths (compute.lengths): the figures of
/// the lengths the run's steps draw from, and what the trained samples drew.
fn lengths_summary(r: &Recorder, all: &BTreeMap<String, Vec<f64>>) -> Option<LengthsSummary> {
    r.cfg.lengths_drawn().map(|(l, steps)| LengthsSummary {
        file: r.cfg.compute.lengths.clone(),
        steps,
        values: l.count,
        mean: l.mean,
        p50: l.p50,
        p90: l.p90,
        max: l.max,
        trained_samples: series(all, "compute/drawn_samples").iter().sum::<f64>() as u64,
        trained_response_tokens: series(all, "compute/drawn_response_tokens").iter().sum(),
    })
}

/// How the run ended, by the error that ended it, if any.
fn status(err: Option<&RunError>) -> Status {
    match err {
        None => Status::Ok,
        Some(e) if e.kind == FailKind::Interrupted => Status::Interrupted,
        Some(_) => Status::Failed,
    }
}

/// The run's summary as the recorder saw it; the drivers add their blocks (`async`,
/// `weight_sync`).
pub(in crate::run) fn summary(r: &Recorder, err: Option<&RunError>, profile: &Profile) -> Summary {
    let phases = summary_phases();
    let all = metric_series(r, &summary_keys(&phases));
    let rewards = series(&all, "rollout/raw_reward");
    // The pass rate is recorded at the same steps as the reward: one window serves both.
    let k = before_after_window(rewards.len());
    let run = RunSummary {
        device: r.device_label.clone(),
        algo: Some(r.cfg.algo.name),
        steps_requested: r.cfg.run.steps,
        phases: phase_stats(&phases, &all),
        reward: ends(rewards, k),
        pass_rate: ends(series(&all, "passrate/pass@1"), k),
        checks: Checks { enabled: r.cfg.run.checks, passed: r.checks.passed },
        memory: memory_summary(r, profile),
        off_policy_correction: correction_summary(r, &all),
        compute: crate::run::learn::compute_label(&r.cfg, profile),
        lengths: lengths_summary(r, &all),
        decode: decode_summary(r, series(&all, "perf/wall_step_time").iter().sum()),
        decode_unreported: r.unreported.iter().cloned().collect(),
        wall_time_s: r.started.elapsed().as_secs_f64(),
        clock: clock_summary(r),
        run_dir: r.run_dir.clone(),
        asynchronous: None,
        weight_sync: WeightSyncSummary::default(),
        switch: switch_summary(r),
    };
    Summary {
        status: status(err),
        failure: err.map(RunError::failure),
        steps_completed: r.steps_completed,
        run: Some(run),
    }
}

/// The roles' decode figures, `run_s` the run's steps' time in all.
fn decode_summary(r: &Recorder, run_s: f64) -> BTreeMap<String, crate::run::summary::RoleDecode> {
    r.decode
        .iter()
        .map(|(role, t)| {
            let device_s = run_s * t.devices.len() as f64;
            let d = crate::run::summary::RoleDecode {
                decode_steps: t.stats.steps,
                devices: t.devices.len(),
                kv_peak_share: t.stats.kv_peak_share,
                kv_queued_s: t.stats.kv_queued_s,
                preemptions: t.stats.preemptions,
                recomputed_tokens: t.stats.recomputed_tokens,
                slot_occupancy: (t.slot_capacity > 0.0).then(|| t.stats.slot_steps / t.slot_capacity),
                tokens: t.tokens,
                tokens_per_device_s: (device_s > 0.0).then(|| t.tokens as f64 / device_s),
            };
            (role.clone(), d)
        })
        .collect()
}

/// The modelled clock against the wall clock, when compute.time_scale runs it faster.
fn clock_summary(r: &Recorder) -> Option<crate::run::summary::ClockSummary> {
    let k = crate::run::clock::scale();
    (k != 1.0).then(|| crate::run::summary::ClockSummary {
        time_scale: k,
        real_wall_time_s: r.started.wall().elapsed().as_secs_f64(),
    })
}

/// The switch block: every stage measured and modelled, when compute.model charged any.
fn switch_summary(r: &Recorder) -> Option<SwitchSummary> {
    if !r.cfg.compute.model || r.switch.is_empty() {
        return None;
    }
    let stages: Vec<SwitchStage> = r.switch.values().cloned().collect();
    let sum = |f: fn(&SwitchStage) -> f64| stages.iter().map(f).sum();
    Some(SwitchSummary {
        charged_s: sum(|s| s.charged_s),
        measured_s: sum(|s| s.measured_s),
        modelled_s: sum(|s| s.modelled_s),
        device: r.cfg.compute.device.clone(),
        stages,
    })
}

/// Steps averaged at each end for "reward before -> after": three, fewer on runs under six steps
/// so that the two ends never share a step (a one-step run has only the one).
fn before_after_window(steps: usize) -> usize {
    if steps >= 6 { 3 } else { (steps / 2).max(steps.min(1)) }
}

/// What the totals under the phase table add up (slime's step = train + train_wait:
/// perf/train_time, perf/train_wait_time).
fn print_totals_legend(split: bool) {
    println!(
        "{}",
        if split {
            "train = the trainer's compute; train_wait = the trainer waiting for its next batch"
        } else {
            "train = the trainer's compute phases; train_wait = the rest of each step (generation, sleep and wake, \
             weight update)"
        }
    );
}

/// Reward and pass rate at the start and at the end of the run (windows that share no step).
fn print_reward(steps_completed: u64, reward: &Ends, pass: &Ends) {
    let f = |v: Option<f64>| v.unwrap_or(f64::NAN);
    match reward.window_steps {
        0 => println!("\nreward -, pass rate - (no step completed)"),
        1 if steps_completed == 1 => println!(
            "\nreward {:.3}, pass rate {:.2} (one step: nothing to compare it with)",
            f(reward.first3_mean),
            f(pass.first3_mean)
        ),
        k => println!(
            "\nreward {:.3} -> {:.3}, pass rate {:.2} -> {:.2} (mean of the first and last {k} step{})",
            f(reward.first3_mean),
            f(reward.last3_mean),
            f(pass.first3_mean),
            f(pass.last3_mean),
            if k == 1 { "" } else { "s" }
        ),
    }
}

/// Each role's batch-slot occupancy and throughput, and its KV capacity's figures when modelled.
fn print_decode(decode: &BTreeMap<String, crate::run::summary::RoleDecode>) {
    for (role, d) in decode {
        let filled = d.slot_occupancy.map_or_else(|| "-".into(), |x| format!("{:.0}%", 100.0 * x));
        let rate = d.tokens_per_device_s.map_or_else(|| "-".into(), |x| format!("{x:.1}"));
        let kv = match d.kv_peak_share {
            Some(peak) => format!(
                "; KV: peak {:.0}% held, {} preemptions, {:.0} tokens recomputed, {:.2} s queued",
                100.0 * peak,
                d.preemptions,
                d.recomputed_tokens,
                d.kv_queued_s
            ),
            None => String::new(),
        };
        println!("decode ({role}): {filled} of the batch slots filled, {rate} tokens/s per device{kv}");
    }
}

pub(in crate::run) fn print_table(r: &Recorder, summary: &Summary) {
    let Some(run) = summary.run.as_ref() else { return };
    println!("\nPhase times over {} steps ({})", summary.steps_completed, r.device_label);
    println!("{:<16} {:>10} {:>10} {:>8}", "phase", "median s", "p90 s", "share");
    let mut totals = false;
    for p in &run.phases {
        if p.phase == "train" {
            println!("{}", "-".repeat(47));
            totals = true;
        }
        println!("{:<16} {:>10.4} {:>10.4} {:>7.1}%", p.phase, p.median_s, p.p90_s, 100.0 * p.share_of_step);
    }
    if totals {
        print_totals_legend(run.asynchronous.is_some());
    }
    print_reward(summary.steps_completed, &run.reward, &run.pass_rate);
    print_decode(&run.decode);
    if let Some(l) = &run.lengths {
        println!(
            "lengths: drawn from {}{} ({} values, mean {:.0}, p50 {}, p90 {}, max {} tokens); the {} trained samples \
             drew {:.0} modelled response tokens",
            l.file,
            l.steps.as_ref().map(LengthsSteps::describe).unwrap_or_default(),
            l.values,
            l.mean,
            l.p50,
            l.p90,
            l.max,
            l.trained_samples,
            l.trained_response_tokens
        );
    }
    if let Some(a) = &run.asynchronous {
        print_async(a, &run.compute);
        print_correction(&run.off_policy_correction);
    } else {
        let w = &run.weight_sync;
        let t = &w.transport;
        let rate = t.update_weights_gbps.map_or_else(|| "-".into(), |r| format!("{r:.2} GB/s"));
        println!(
            "weights: {} updates over {}: {} in {} buckets, {} through the host, {:.2} s of transfer ({rate})",
            w.weight_updates,
            w.weight_transport_detail,
            human(w.update_weights_bytes),
            t.update_weights_buckets,
            human(t.update_weights_host_bytes),
            t.update_weights_transfer_s
        );
    }
    if r.cfg.run.checks && run.asynchronous.is_some() {
        println!(
            "checks: {} passed (weights identical on every rollout engine after each update, no batch over the \
             staleness bound, no leak)",
            run.checks.passed
        );
    } else if r.cfg.run.checks {
        println!(
            "checks: {} passed (memory freed on every pause, weights identical after wake_up and update_weights, no leak)",
            run.checks.passed
        );
    }
    print_communicators(&r.comm_suspended);
    let tensorboard = if r.cfg.metrics.loggers.contains("tensorboard") { ", tensorboard/" } else { "" };
    println!(
        "run directory: {} (metrics.jsonl, memory.jsonl, summary.json, memory_timeline.svg, memory_per_step.svg, reward.svg, logs/{tensorboard})",
        r.run_dir.display()
    );
}

/// The off-policy correction and what its importance ratios were over the run.
fn print_correction(c: &Correction) {
    if c.method == "rollout_log_probs" {
        println!(
            "       off-policy correction: the PPO ratio to the rollout's log-probs, clipped (algo.rollout_log_probs)"
        );
        return;
    }
    if c.method != "tis" {
        println!("       off-policy correction: none");
        return;
    }
    let f = |v: Option<f64>| v.unwrap_or(f64::NAN);
    println!(
        "       off-policy correction: tis capped at {}; importance ratio mean {:.3}, max {:.3}, {:.1}% of tokens \
         truncated; rollout - trainer log-prob {:+.4}",
        c.tis_cap,
        f(c.tis_mean),
        f(c.tis_max),
        100.0 * f(c.tis_clipfrac_mean),
        f(c.rollout_train_logprob_diff_mean)
    );
}

/// What the trainers' sleep won from their NCCL communicators (tag `nccl`), per process.
fn print_communicators(suspended: &BTreeMap<String, u64>) {
    if suspended.is_empty() {
        return;
    }
    let each: Vec<String> = suspended.iter().map(|(name, b)| format!("{name} {}", human(*b))).collect();
    println!(
        "communicator bytes suspended at sleep (NCCL buffers, tag nccl): {}; {} in all",
        each.join(", "),
        human(suspended.values().sum())
    );
}

/// Async mode's lines: the layout, throughput, staleness, both sides' idle shares, the updates.
fn print_async(a: &AsyncSummary, compute: &str) {
    let devices = |d: &Option<Vec<u32>>| {
        d.as_ref().map(|v| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",")).unwrap_or_default()
    };
    let hist: Vec<String> = a.staleness_histogram.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    println!(
        "{}: trainer on device(s) {}, rollout on {}; {} samples trained ({:.1}/s, {:.1} tokens/s; {})",
        a.mode,
        devices(&a.trainer_devices),
        devices(&a.rollout_devices),
        a.samples_trained,
        a.samples_per_s,
        a.tokens_per_s,
        compute
    );
    println!(
        "       staleness (updates behind: samples) {}; {} dropped over the bound of {}; {} partial (spanning an update)",
        hist.join(" "),
        a.dropped_stale_samples,
        a.max_staleness,
        a.partial_samples
    );
    let t = &a.transport;
    let library = t.weight_sync_library.as_ref().map(|l| format!(" ({})", l.to_uppercase())).unwrap_or_default();
    println!(
        "       idle: trainer {:.0}% (waiting {:.0}%, update flush {:.0}%), rollout {:.0}%; {} weight updates over \
         {}{library}, {} in {:.2} s",
        100.0 * a.trainer_idle_ratio,
        100.0 * a.trainer_wait_ratio,
        100.0 * a.flush_ratio,
        100.0 * a.rollout_idle_ratio,
        a.weight_updates,
        t.weight_transport,
        human(a.update_weights_bytes),
        a.update_weights_s
    );
    if let Some(rate) = t.update_weights_gbps {
        let link = match (t.link_gbps, t.link_share) {
            (Some(l), Some(share)) => format!(", {:.0}% of the modelled {l} GB/s link", 100.0 * share),
            _ => String::new(),
        };
        println!(
            "       weights moved at {rate:.2} GB/s ({} buckets in {:.2} s of transfer{link})",
            t.update_weights_buckets, t.update_weights_transfer_s
        );
    }
    if let Some(e) = &a.elastic {
        print_lending(e);
    }
}

/// Elastic mode: the lends, what they cost and what they gave.
fn print_lending(e: &ElasticSummary) {
    let f = |v: Option<f64>| v.unwrap_or(f64::NAN);
    let retired = if e.retired_engines.is_empty() {
        String::new()
    } else {
        format!("; retired (kept the device past the reclaim timeout): {}", e.retired_engines.join(", "))
    };
    // No lend: no mean cost to print (it used to read "NaN s").
    if e.lends == 0 {
        println!(
            "       lending: none (a lend needs the trainer to have waited {:.3} s, {}); trainer devices idle \
             {:.0}%{retired}",
            e.lend_after_s,
            e.lend_after_s_source,
            100.0 * e.trainer_device_idle_ratio,
        );
    } else {
        println!(
            "       lending: {} lend(s) after the trainer waited {:.3} s ({}), each {:.3} s to lend and {:.3} s to \
             reclaim ({:.3} s of it the saver's); lent {:.1} s ({:.1} s of it idle), {} tokens; trainer devices idle \
             {:.0}% (idle unlent, flush included, {:.0}%){retired}",
            e.lends,
            e.lend_after_s,
            e.lend_after_s_source,
            f(e.lend_s_mean),
            f(e.reclaim_s_mean),
            f(e.switch_saver_s_mean),
            e.lent_s,
            e.lent_engine_idle_s,
            e.lent_tokens,
            100.0 * e.trainer_device_idle_ratio,
            100.0 * e.trainer_idle_ratio_unlent,
        );
    }
    if let Some(r) = &e.rollout_lend {
        print_rollout_lending(r);
    }
}

/// elastic.lend_rollout: the engines' devices lent to the trainer's train stage.
fn print_rollout_lending(r: &RolloutLendSummary) {
    let f = |v: Option<f64>| v.unwrap_or(f64::NAN);
    if r.lends == 0 {
        println!(
            "       lent to the trainer: none ({} skipped); rollout devices idle {:.0}%",
            r.lends_skipped,
            100.0 * r.rollout_device_idle_ratio,
        );
        return;
    }
    println!(
        "       lent to the trainer: {} lend(s) of the rollout devices ({} skipped), each {:.3} s to lend and {:.3} s to \
         reclaim ({:.3} s of it the saver's; the trainer's state {:.1} MiB through the host); {:.1} device-s trained; \
         rollout devices idle {:.0}% (lent time as idle, {:.0}%)",
        r.lends,
        r.lends_skipped,
        f(r.lend_s_mean),
        f(r.reclaim_s_mean),
        f(r.switch_saver_s_mean),
        r.state_bytes_mean.map_or(f64::NAN, |b| b as f64) / (1024.0 * 1024.0),
        r.lent_device_s,
        100.0 * r.rollout_device_idle_ratio,
        100.0 * r.rollout_idle_ratio_unlent,
    );
}

/// The phase strip's colours: one per kind of phase, strong enough to read in a thin band.
fn phase_color(p: &str) -> RGBColor {
    match p {
        "generate" => RGBColor(111, 168, 220),
        "rollout_offload" | "sleep" => RGBColor(224, 102, 102),
        "wake_up" | "onload_weights" | "onload_kv" => RGBColor(106, 168, 79),
        "update_weights" => RGBColor(241, 194, 50),
        "ref_log_probs" | "log_probs" | "values" | "advantages" | "actor_train" => RGBColor(166, 77, 121),
        _ => RGBColor(204, 204, 204),
    }
}

/// The memory plots' process colours: hues the phase strip (`phase_color`) does not use, so that
/// a process never reads as a phase (a rollout green as a wake-up).
const PROCESS_COLORS: &[RGBColor] = &[
    RGBColor(23, 190, 207),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(188, 189, 34),
    RGBColor(31, 60, 110),
    RGBColor(0, 128, 110),
    RGBColor(120, 120, 120),
];

fn process_color(i: usize) -> RGBColor {
    PROCESS_COLORS[i % PROCESS_COLORS.len()]
}

/// Steps the timeline draws in detail: every phase of 30 steps reads at 1000 px; more turn into
/// a solid block (the cycle repeats), which memory_per_step.svg shows over the whole run instead.
const TIMELINE_STEPS: u64 = 30;

/// The timeline's points: the devices' use and capacity and each process's resident bytes (every
/// `stride`-th sample), and every phase's span, from `first_step` on.
struct Timeline {
    used: Vec<(f64, f64)>,
    /// The communicator bytes suspended, all processes together.
    comm_suspended: Vec<(f64, f64)>,
    capacity: Vec<(f64, f64)>,
    per_worker: Vec<Vec<(f64, f64)>>,
    spans: Vec<Span>,
}

/// A panel of the timeline: the device it draws (None: every device, summed) and its processes.
struct Panel {
    device: Option<usize>,
    names: Vec<String>,
}

/// Every panel's points in one pass over memory.jsonl, from `first_step` on, its lines thinned
/// to every `stride`-th sample; the phases' spans, the same for every panel, are each panel's.
/// With them, the spans of the zoomed phase view (`in_zoom`), labelled with their phases.
fn timeline(path: &std::path::Path, panels: &[Panel], window: &TimelineWindow) -> (Vec<Timeline>, Vec<Span>) {
    let TimelineWindow { first_step, last_step, stride } = *window;
    let empty = |p: &Panel| Timeline {
        used: Vec::new(),
        comm_suspended: Vec::new(),
        capacity: Vec::new(),
        per_worker: vec![Vec::new(); p.names.len()],
        spans: Vec::new(),
    };
    let mut out: Vec<Timeline> = panels.iter().map(empty).collect();
    let mut spans = Vec::new();
    let shown = read_lines::<MemSample>(path).filter(|s| s.step >= first_step);
    // The last sample is drawn even when thinning skips it: a failed run's says what memory held
    // when it stopped.
    let mut skipped = None;
    let mut zoom = Vec::new();
    for (i, s) in shown.enumerate() {
        // Every phase keeps its span (it is one rectangle); only the lines are thinned.
        spans.push(Span { x0: s.start_s, x1: s.t_s, color: phase_color(&s.phase), label: None });
        if in_zoom(s.step, last_step) {
            zoom.push(Span { label: Some(s.phase.clone()), ..spans[spans.len() - 1].clone() });
        }
        if i % stride != 0 {
            skipped = Some(s);
            continue;
        }
        skipped = None;
        push_sample(panels, &mut out, &s);
    }
    if let Some(s) = skipped {
        push_sample(panels, &mut out, &s);
    }
    if spans.len() > TIMELINE_MAX_SAMPLES {
        spans = merge_spans(spans, TIMELINE_MAX_SAMPLES);
    }
    for t in &mut out {
        t.spans = spans.clone();
    }
    (out, zoom)
}

/// Runs of more steps than this get the zoomed phase view: at 30 steps a phase is a sliver of
/// the timeline's strip, at 8 its boxes still read.
const ZOOM_AFTER_STEPS: u64 = 8;

/// The steps the zoomed phase view shows: enough to see the cycle repeat, few enough that the
/// main phases' names fit in their boxes.
const ZOOM_STEPS: u64 = 2;

/// Whether a sample of `step` is in the zoomed phase view of a run whose last step is `last`.
fn in_zoom(step: u64, last: u64) -> bool {
    last > ZOOM_AFTER_STEPS && step + ZOOM_STEPS > last
}

/// The last `ZOOM_STEPS` steps' phases at the timeline's full width, each box labelled with its
/// phase where the label fits in it.
fn phase_zoom(spans: Vec<Span>, last_step: u64) -> Chart {
    let first = last_step + 1 - ZOOM_STEPS;
    Chart {
        title: format!("Phases of steps {first} to {last_step}, to scale"),
        width: 1000,
        height: 240,
        x: Some(Axis::linear("time", Quantity::Seconds)),
        spans,
        span_legend: phase_legend(),
        ..Chart::default()
    }
}

/// One sample's points on every panel.
fn push_sample(panels: &[Panel], out: &mut [Timeline], s: &MemSample) {
    for (p, t) in panels.iter().zip(out) {
        let of_device = |v: &[u64]| match p.device {
            Some(d) => v.get(d).copied().unwrap_or(0),
            None => v.iter().sum::<u64>(),
        };
        t.used.push((s.t_s, of_device(&s.device_used) as f64));
        let suspended = p.names.iter().filter_map(|n| s.comm_suspended.get(n)).sum::<u64>();
        t.comm_suspended.push((s.t_s, suspended as f64));
        t.capacity.push((s.t_s, of_device(&s.device_total) as f64));
        for (name, pts) in p.names.iter().zip(&mut t.per_worker) {
            pts.push((s.t_s, s.workers.get(name).map(|t| t.values().sum::<u64>()).unwrap_or(0) as f64));
        }
    }
}

/// Device memory over time: each process's resident bytes stacked (summed over its tags), the
/// device's use and its capacity, and the phases in a strip below; one panel per device, so that
/// a device near its limit shows as such. For a run longer than `TIMELINE_STEPS`, its last
/// `TIMELINE_STEPS` steps.
///
/// Reads memory.jsonl twice (the steps first, then the drawing) rather than holding it.
fn memory_timeline(r: &Recorder) -> String {
    let path = r.run_dir.join("memory.jsonl");
    let window = TimelineWindow::of(&path);
    let devices = r.cfg.total_devices();
    let panels: Vec<Panel> = if devices <= 1 {
        vec![Panel { device: None, names: r.names.iter().map(|n| n.0.clone()).collect() }]
    } else {
        let on = |d: usize| r.names.iter().filter(|n| n.1 as usize == d).map(|n| n.0.clone()).collect();
        (0..devices).map(|d| Panel { device: Some(d), names: on(d) }).collect()
    };
    let (timelines, zoom) = timeline(&path, &panels, &window);
    let mut charts: Vec<Chart> = panels.iter().zip(timelines).map(|(p, t)| timeline_chart(r, &window, p, t)).collect();
    if !zoom.is_empty() {
        charts.push(phase_zoom(zoom, window.last_step));
    }
    plot::svg_panels(&charts)
}

/// One panel of the timeline as a chart.
fn timeline_chart(r: &Recorder, window: &TimelineWindow, panel: &Panel, t: Timeline) -> Chart {
    let Panel { device, names } = panel;
    let Timeline { used, comm_suspended, capacity, per_worker, spans } = t;
    // Process colours by their place in the fleet, the same on every panel.
    let colors: Vec<RGBColor> =
        names.iter().map(|n| process_color(r.names.iter().position(|m| &m.0 == n).unwrap_or(0))).collect();
    let stacked = process_series(names, &colors, per_worker);
    let label = match device {
        Some(d) => format!("device {d} in use (+ contexts)"),
        None => "device in use (+ contexts)".into(),
    };
    let mut series = device_series(label, used, comm_suspended, capacity);
    let mut title = match device {
        Some(d) => {
            format!("{}, device {d}: {}", window.title(), if names.is_empty() { "-".into() } else { names.join(", ") })
        }
        None => window.title(),
    };
    let mut bar = None;
    if let Some((t, what)) = &r.timeline.failure_mark {
        bar = failed_request(r, *device, *t, &series);
        series.push(failure_mark(&series, *t, what));
        title = format!("{title}: {what}");
    }
    Chart {
        title,
        width: 1000,
        height: if device.is_some() { 400 } else { 480 },
        x: Some(Axis::linear("time", Quantity::Seconds)),
        y: Some(Axis::linear("memory", Quantity::Bytes)),
        stacked,
        series,
        spans,
        span_legend: phase_legend(),
        y_range: None,
        bar,
    }
}

/// The request that did not fit, on its device's panel: stacked on what the device had in use
/// when it was asked (else at the failure's sample, the last the device answered for: a worker
/// that failed has often let go of what it held by then), up past the capacity.
fn failed_request(r: &Recorder, panel: Option<usize>, t: f64, series: &[Series]) -> Option<plot::Bar> {
    let (device, request) = r.timeline.failed_request.as_ref()?;
    if panel.is_some() && panel != device.map(|d| d as usize) {
        return None;
    }
    let (used, capacity) = (&series.first()?.points, series.iter().find(|s| s.name == "capacity"));
    // A device none of whose workers answered at the failure recorded nothing there: its last
    // sample with a capacity is the one that says what it held.
    let answered = |i: usize| capacity.is_none_or(|c| c.points.get(i).is_some_and(|p| p.1 > 0.0));
    let sampled = (0..used.len()).rev().find(|&i| answered(i)).map_or(0.0, |i| used[i].1);
    let base = request.device_used.map_or(sampled, |b| b as f64);
    let tag = request.tag.as_ref().map(|t| format!(" ({t})")).unwrap_or_default();
    Some(plot::Bar {
        x: t,
        y0: base,
        y1: base + request.bytes as f64,
        label: format!("failed: +{}{tag}", human(request.bytes)),
        color: RGBColor(204, 0, 0),
    })
}

/// Points the timeline draws at most (lines are thinned, spans merged, beyond it): a long run's
/// every sample would make an SVG too heavy for a browser to open.
const TIMELINE_MAX_SAMPLES: usize = 4000;

/// Which part of memory.jsonl the timeline draws: its last `TIMELINE_STEPS` steps, every
/// `stride`-th sample so that at most `TIMELINE_MAX_SAMPLES` lines are drawn.
#[derive(Clone, Copy)]
struct TimelineWindow {
    first_step: u64,
    last_step: u64,
    stride: usize,
}

impl TimelineWindow {
    /// A first pass over the file: only the sample count and the last step are kept.
    fn of(path: &std::path::Path) -> TimelineWindow {
        let (mut n, mut last_step) = (0usize, 0u64);
        for s in read_lines::<MemSample>(path) {
            n += 1;
            last_step = last_step.max(s.step);
        }
        let first_step = if last_step > TIMELINE_STEPS { last_step + 1 - TIMELINE_STEPS } else { 0 };
        TimelineWindow { first_step, last_step, stride: n.div_ceil(TIMELINE_MAX_SAMPLES).max(1) }
    }

    /// Says when the chart is only the end of the run, and where the whole run is drawn.
    fn title(&self) -> String {
        let TimelineWindow { first_step, last_step, .. } = *self;
        if first_step > 0 {
            format!(
                "Device memory, steps {first_step} to {last_step} of {last_step} (the whole run: memory_per_step.svg)"
            )
        } else {
            "Device memory over the run".into()
        }
    }
}

/// Each process's resident bytes, stacked in the order of `names`, in `colors`.
fn process_series(names: &[String], colors: &[RGBColor], per_worker: Vec<Vec<(f64, f64)>>) -> Vec<Series> {
    names
        .iter()
        .zip(colors)
        .zip(per_worker)
        .map(|((name, color), points)| Series {
            name: name.clone(),
            points,
            shape: Shape::Steps,
            color: *color,
            width: 1,
        })
        .collect()
}

/// The devices' totals drawn over the stack: in use always; the communicators suspended and the
/// capacity only when the run recorded any (a flat zero line would read as a measurement).
fn device_series(
    label: String,
    used: Vec<(f64, f64)>,
    comm_suspended: Vec<(f64, f64)>,
    capacity: Vec<(f64, f64)>,
) -> Vec<Series> {
    let mut series =
        vec![Series { name: label, points: used, shape: Shape::Steps, color: RGBColor(60, 60, 60), width: 2 }];
    if comm_suspended.iter().any(|p| p.1 > 0.0) {
        series.push(Series {
            name: "communicator bytes suspended (tag nccl)".into(),
            points: comm_suspended,
            shape: Shape::Steps,
            color: RGBColor(230, 145, 56),
            width: 2,
        });
    }
    if capacity.iter().any(|p| p.1 > 0.0) {
        series.push(Series {
            name: "capacity".into(),
            points: capacity,
            shape: Shape::Dashed,
            color: RGBColor(120, 120, 120),
            width: 1,
        });
    }
    series
}

/// The phase strip's legend: one entry per colour `phase_color` gives, named for what it covers.
fn phase_legend() -> Vec<(String, RGBColor)> {
    [
        ("generate", "generate"),
        ("offload / sleep", "sleep"),
        ("wake / onload", "wake_up"),
        ("update_weights", "update_weights"),
        ("train phases", "actor_train"),
    ]
    .iter()
    .map(|(label, phase)| (format!("phase: {label}"), phase_color(phase)))
    .collect()
}

/// A vertical mark from zero to the highest point drawn, at the moment the run failed: the
/// reader sees what memory looked like when it stopped.
fn failure_mark(series: &[Series], t: f64, what: &str) -> Series {
    let top = series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(0.0, f64::max);
    Series {
        name: format!("run stopped: {what}"),
        points: vec![(t, 0.0), (t, top)],
        shape: Shape::Line,
        color: RGBColor(204, 0, 0),
        width: 3,
    }
}

/// Every step of the run at a glance: per step, the devices' highest and lowest use (sampled at
/// phase boundaries) and each process's highest resident bytes, with the capacity. Flat lines
/// over 1,000 steps say nothing leaks; a step that needed more than the others stands out.
fn memory_per_step(r: &Recorder) -> String {
    let path = r.run_dir.join("memory.jsonl");
    let names: Vec<String> = r.names.iter().map(|n| n.0.clone()).collect();
    struct Step {
        highest: f64,
        lowest: f64,
        capacity: f64,
        process_highest: Vec<f64>,
    }
    let mut steps: BTreeMap<u64, Step> = BTreeMap::new();
    for s in read_lines::<MemSample>(&path).filter(|s| s.step > 0) {
        let used = s.device_used.iter().sum::<u64>() as f64;
        let e = steps.entry(s.step).or_insert(Step {
            highest: 0.0,
            lowest: f64::MAX,
            capacity: 0.0,
            process_highest: vec![0.0; names.len()],
        });
        e.highest = e.highest.max(used);
        e.lowest = e.lowest.min(used);
        e.capacity = e.capacity.max(s.device_total.iter().sum::<u64>() as f64);
        for (k, name) in names.iter().enumerate() {
            let resident = s.workers.get(name).map(|t| t.values().sum::<u64>()).unwrap_or(0) as f64;
            e.process_highest[k] = e.process_highest[k].max(resident);
        }
    }
    let line =
        |name: String, points: Vec<(f64, f64)>, shape, color, width| Series { name, points, shape, color, width };
    let at = |f: &dyn Fn(&Step) -> f64| -> Vec<(f64, f64)> { steps.iter().map(|(k, v)| (*k as f64, f(v))).collect() };
    let mut series = vec![
        line("device in use, highest".into(), at(&|v| v.highest), Shape::Line, RGBColor(60, 60, 60), 2),
        line("device in use, lowest".into(), at(&|v| v.lowest), Shape::Line, RGBColor(150, 150, 150), 2),
    ];
    for (k, name) in names.iter().enumerate() {
        series.push(line(format!("{name}, highest"), at(&|v| v.process_highest[k]), Shape::Line, process_color(k), 1));
    }
    if steps.values().any(|v| v.capacity > 0.0) {
        series.push(line("capacity".into(), at(&|v| v.capacity), Shape::Dashed, RGBColor(120, 120, 120), 1));
    }
    plot::svg(&Chart {
        title: format!("Device memory per step (highest and lowest at phase boundaries){}", stopped_note(r)),
        width: 1000,
        height: 440,
        x: Some(Axis::linear("step", Quantity::Count)),
        y: Some(Axis::linear("memory", Quantity::Bytes)),
        series,
        ..Chart::default()
    })
}

/// At most `max` spans: neighbours merged, each merged span taking the colour of its longest part.
fn merge_spans(spans: Vec<Span>, max: usize) -> Vec<Span> {
    let per = spans.len().div_ceil(max);
    spans
        .chunks(per)
        .map(|c| {
            let longest =
                c.iter().max_by(|a, b| (a.x1 - a.x0).total_cmp(&(b.x1 - b.x0))).expect("chunks are not empty");
            Span { x0: c[0].x0, x1: c[c.len() - 1].x1, color: longest.color, label: None }
        })
        .collect()
}

/// For the per-step plots of a run that stopped before completing a step: why they are empty.
fn stopped_note(r: &Recorder) -> String {
    match &r.timeline.failure_mark {
        Some((_, what)) if r.steps_completed == 0 => format!(": no step completed, {what}"),
        _ => String::new(),
    }
}

fn reward_curve(r: &Recorder) -> String {
    let keys = ["step".to_string(), "rollout/raw_reward".to_string(), "passrate/pass@1".to_string()];
    let series = metric_series(r, &keys);
    let get = |k: &str| -> Vec<(f64, f64)> { series["step"].iter().copied().zip(series[k].iter().copied()).collect() };
    plot::svg(&Chart {
        title: format!("Reward and pass@1 per step{}", stopped_note(r)),
        width: 800,
        height: 400,
        x: Some(Axis::linear("step", Quantity::Count)),
        y: Some(Axis::linear("", Quantity::Plain)),
        series: vec![
            Series {
                name: "reward mean".into(),
                points: get("rollout/raw_reward"),
                shape: Shape::Line,
                color: color(0),
                width: 2,
            },
            Series {
                name: "pass@1 (exact)".into(),
                points: get("passrate/pass@1"),
                shape: Shape::Line,
                color: color(2),
                width: 2,
            },
        ],
        y_range: Some((0.0, 1.0)),
        ..Chart::default()
    })
}

pub(in crate::run) fn write_plots(r: &Recorder) -> std::io::Result<()> {
    std::fs::write(r.run_dir.join("memory_timeline.svg"), memory_timeline(r))?;
    std::fs::write(r.run_dir.join("memory_per_step.svg"), memory_per_step(r))?;
    std::fs::write(r.run_dir.join("reward.svg"), reward_curve(r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::read_svg::{elements, texts};

    /// memory.jsonl of a run of `steps` steps, each phase of `STEP_PHASES` taking its share of a
    /// one-second step (generate the most, advantages a millisecond).
    fn synthetic_run(dir: &std::path::Path, steps: u64) -> std::path::PathBuf {
        let path = dir.join("memory.jsonl");
        let share = |p: &str| match p {
            "generate" => 0.3,
            "wake_up" | "actor_train" | "sleep" | "update_weights" => 0.12,
            "advantages" => 0.001,
            _ => 0.02,
        };
        let mut t = 0.0;
        let mut lines = String::new();
        for step in 1..=steps {
            for p in STEP_PHASES {
                let s = MemSample {
                    t_s: t + share(p),
                    start_s: t,
                    step,
                    phase: p.to_string(),
                    device_used: vec![1 << 30],
                    device_total: vec![2 << 30],
                    workers: BTreeMap::new(),
                    paused: BTreeMap::new(),
                    comm_suspended: BTreeMap::new(),
                };
                t = s.t_s;
                lines += &format!("{}\n", serde_json::to_string(&s).unwrap());
            }
        }
        std::fs::write(&path, lines).unwrap();
        path
    }

    #[test]
    fn a_long_run_gets_its_last_steps_phases_zoomed_with_labels_that_fit_their_boxes() {
        let dir = tempfile::tempdir().unwrap();
        let path = synthetic_run(dir.path(), 30);
        let window = TimelineWindow::of(&path);
        let (_, zoom) = timeline(&path, &[Panel { device: None, names: Vec::new() }], &window);
        assert_eq!(zoom.len(), ZOOM_STEPS as usize * STEP_PHASES.len());
        let svg = plot::svg(&phase_zoom(zoom, window.last_step));
        assert!(svg.contains("Phases of steps 29 to 30"), "{svg}");
        let rects = elements(&svg, "rect");
        let num = |e: &BTreeMap<String, String>, k: &str| e[k].parse::<f64>().unwrap();
        let labels: Vec<(f64, String)> = texts(&svg)
            .into_iter()
            .filter(|(_, t)| STEP_PHASES.contains(&t.as_str()))
            .map(|(a, t)| (num(&a, "x"), t))
            .collect();
        // The long phases labelled in both steps, every label inside a box wide enough for it.
        for p in ["generate", "wake_up", "sleep"] {
            assert_eq!(labels.iter().filter(|l| l.1 == p).count(), 2, "{p}: {labels:?}");
        }
        for (x, label) in &labels {
            let inside = rects.iter().find(|r| num(r, "x") <= *x && *x <= num(r, "x") + num(r, "width")).unwrap();
            let width = num(inside, "width");
            assert!(width >= plot::label_room(label.len()) && width >= 40.0, "{label} in {width} px");
        }
        // A phase of a millisecond is a sliver: no label over its neighbours.
        assert!(!labels.iter().any(|l| l.1 == "advantages"), "{labels:?}");
    }

    #[test]
    fn a_short_run_has_no_zoomed_phases() {
        let dir = tempfile::tempdir().unwrap();
        let path = synthetic_run(dir.path(), ZOOM_AFTER_STEPS);
        let (_, zoom) = timeline(&path, &[Panel { device: None, names: Vec::new() }], &TimelineWindow::of(&path));
        assert!(zoom.is_empty());
    }

    #[test]
    fn the_before_and_after_windows_never_share_a_step() {
        let got: Vec<usize> = (0..9).map(before_after_window).collect();
        assert_eq!(got, [0, 1, 1, 1, 2, 2, 3, 3, 3]);
        for steps in 2..40 {
            assert!(2 * before_after_window(steps) <= steps, "{steps}");
        }
    }
}
