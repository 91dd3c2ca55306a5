//! What a run shows and leaves behind: the progress line, the phase table, summary.json, and the
//! SVG memory timeline and reward curve.

use super::{MemSample, RunError, Runner};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;
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

    pub fn step(&self, step: u64, steps: u64, m: &BTreeMap<String, Value>) {
        if self.quiet {
            return;
        }
        let g = |k: &str| m.get(k).and_then(Value::as_f64).unwrap_or(0.0);
        let width = 24usize;
        let filled = (step as usize * width) / steps.max(1) as usize;
        let line = format!(
            "[{}{}] step {step}/{steps}  reward {:.3}  pass {:.2}  kl {:.4}  step {:.2}s  sleep {:.3}s  update {:.3}s  wake {:.3}s",
            "#".repeat(filled),
            ".".repeat(width - filled),
            g("rollout/reward_mean"),
            g("rollout/pass_rate"),
            g("train/kl_ref"),
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

/// Per-step numbers of metrics.jsonl: `keys` series in file order (only those numbers, not the
/// rows, are held).
fn metric_series(r: &Runner, keys: &[String]) -> BTreeMap<String, Vec<f64>> {
    let mut out: BTreeMap<String, Vec<f64>> = keys.iter().map(|k| (k.clone(), Vec::new())).collect();
    for row in read_lines::<Value>(&r.run_dir.join("metrics.jsonl")) {
        for (k, v) in out.iter_mut() {
            if let Some(x) = row.get(k).and_then(Value::as_f64) {
                v.push(x);
            }
        }
    }
    out
}

pub fn summary(r: &Runner, err: Option<&RunError>) -> Value {
    let phase_names: Vec<&str> = STEP_PHASES.iter().copied().chain(["train", "train_wait", "step"]).collect();
    let mut keys: Vec<String> = phase_names.iter().map(|p| format!("perf/{p}_time")).collect();
    keys.extend(["rollout/reward_mean".to_string(), "rollout/pass_rate".to_string()]);
    let all = metric_series(r, &keys);
    let series = |k: &str| -> Vec<f64> { all.get(k).cloned().unwrap_or_default() };
    let total_step: f64 = series("perf/step_time").iter().sum();
    let mut phases = Vec::new();
    for p in phase_names {
        let v = series(&format!("perf/{p}_time"));
        if v.is_empty() {
            continue;
        }
        let sum: f64 = v.iter().sum();
        phases.push(json!({
            "phase": p, "median_s": percentile(v.clone(), 0.5), "p90_s": percentile(v.clone(), 0.9),
            "mean_s": sum / v.len() as f64, "share_of_step": if total_step > 0.0 { sum / total_step } else { 0.0 },
        }));
    }
    let rewards = series("rollout/reward_mean");
    let pass = series("rollout/pass_rate");
    let head = |v: &[f64]| -> f64 {
        let k = v.len().min(3);
        if k == 0 { f64::NAN } else { v[..k].iter().sum::<f64>() / k as f64 }
    };
    let last = |v: &[f64]| -> f64 {
        let k = v.len().min(3);
        if k == 0 { f64::NAN } else { v[v.len() - k..].iter().sum::<f64>() / k as f64 }
    };
    json!({
        "status": match err { None => "ok", Some(e) if e.kind == super::FailKind::Interrupted => "interrupted", Some(_) => "failed" },
        "failure": err.map(|e| json!({"kind": e.kind.as_str(), "step": e.step, "phase": e.phase, "worker": e.worker, "cause": e.cause})),
        "device": r.device_label,
        "algo": r.cfg.algo.name,
        "steps_completed": r.steps_completed,
        "steps_requested": r.cfg.run.steps,
        "phases": phases,
        "reward": {"first3_mean": head(&rewards), "last3_mean": last(&rewards)},
        "pass_rate": {"first3_mean": head(&pass), "last3_mean": last(&pass)},
        "checks": {"enabled": r.cfg.run.checks, "passed": r.checks_passed},
        "memory": {
            "profile": r.cfg.memory.profile, "trainer_bytes_per_device": r.profile.trainer.bytes(),
            "rollout_bytes_per_device": r.profile.rollout.bytes(),
            "weights_bytes_per_device": r.profile.rollout.tag_bytes("weights"),
            "trainer_allocations": r.profile.trainer.count(), "rollout_allocations": r.profile.rollout.count(),
            "peak_device_used": r.peak_used,
        },
        "wall_time_s": r.started.elapsed().as_secs_f64(),
        "run_dir": r.run_dir,
    })
}

pub fn print_table(r: &Runner, summary: &Value) {
    println!("\nPhase times over {} steps ({})", summary["steps_completed"], r.device_label);
    println!("{:<16} {:>10} {:>10} {:>8}", "phase", "median s", "p90 s", "share");
    for p in summary["phases"].as_array().into_iter().flatten() {
        let name = p["phase"].as_str().unwrap_or("");
        if name == "train" {
            println!("{}", "-".repeat(47));
        }
        println!(
            "{:<16} {:>10.4} {:>10.4} {:>7.1}%",
            name,
            p["median_s"].as_f64().unwrap_or(f64::NAN),
            p["p90_s"].as_f64().unwrap_or(f64::NAN),
            100.0 * p["share_of_step"].as_f64().unwrap_or(0.0)
        );
    }
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    println!(
        "\nreward {:.3} -> {:.3}, pass rate {:.2} -> {:.2} (mean of the first and last 3 steps)",
        f(&summary["reward"]["first3_mean"]),
        f(&summary["reward"]["last3_mean"]),
        f(&summary["pass_rate"]["first3_mean"]),
        f(&summary["pass_rate"]["last3_mean"])
    );
    if r.cfg.run.checks {
        println!(
            "checks: {} passed (memory freed on every pause, weights identical after wake_up and update_weights, no leak)",
            summary["checks"]["passed"]
        );
    }
    println!(
        "run directory: {} (metrics.jsonl, memory.jsonl, summary.json, memory_timeline.svg, reward.svg, logs/)",
        r.run_dir.display()
    );
}

const COLORS: &[&str] = &["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"];

fn phase_color(p: &str) -> &'static str {
    match p {
        "generate" => "#cfe2f3",
        "rollout_offload" | "sleep" => "#f4cccc",
        "wake_up" | "onload_weights" | "onload_kv" => "#d9ead3",
        "update_weights" => "#fff2cc",
        "ref_log_probs" | "log_probs" | "values" | "advantages" | "actor_train" => "#ead1dc",
        _ => "#eeeeee",
    }
}

struct Frame {
    w: f64,
    h: f64,
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
}

impl Frame {
    fn px(&self, x: f64) -> f64 {
        self.left + (x - self.x0) / (self.x1 - self.x0).max(1e-12) * (self.w - self.left - self.right)
    }
    fn py(&self, y: f64) -> f64 {
        self.h - self.bottom - (y - self.y0) / (self.y1 - self.y0).max(1e-12) * (self.h - self.top - self.bottom)
    }

    fn open(&self, out: &mut String, title: &str, x_label: &str, y_label: &str, y_fmt: &dyn Fn(f64) -> String) {
        let _ = write!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" font-size="15" text-anchor="middle">{title}</text>"#,
            self.w,
            self.h,
            self.w / 2.0
        );
        for i in 0..=4 {
            let y = self.y0 + (self.y1 - self.y0) * i as f64 / 4.0;
            let py = self.py(y);
            let _ = write!(
                out,
                r##"<line x1="{}" y1="{py}" x2="{}" y2="{py}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                self.left,
                self.w - self.right,
                self.left - 6.0,
                py + 4.0,
                y_fmt(y)
            );
            let x = self.x0 + (self.x1 - self.x0) * i as f64 / 4.0;
            let _ = write!(
                out,
                r#"<text x="{}" y="{}" text-anchor="middle">{:.1}</text>"#,
                self.px(x),
                self.h - self.bottom + 16.0,
                x
            );
        }
        let _ = write!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">{x_label}</text><text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">{y_label}</text>"#,
            (self.left + self.w - self.right) / 2.0,
            self.h - 14.0,
            self.h / 2.0,
            self.h / 2.0
        );
    }

    fn axes(&self, out: &mut String) {
        let _ = write!(
            out,
            r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
            self.left,
            self.top,
            self.w - self.left - self.right,
            self.h - self.top - self.bottom
        );
    }
}

fn polyline(out: &mut String, f: &Frame, pts: &[(f64, f64)], color: &str, width: f64, step: bool) {
    let mut d = String::new();
    for (i, (x, y)) in pts.iter().enumerate() {
        if step && i > 0 {
            let _ = write!(d, "{:.1},{:.1} ", f.px(*x), f.py(pts[i - 1].1));
        }
        let _ = write!(d, "{:.1},{:.1} ", f.px(*x), f.py(*y));
    }
    let _ = write!(out, r#"<polyline points="{d}" fill="none" stroke="{color}" stroke-width="{width}"/>"#);
}

fn legend(out: &mut String, f: &Frame, items: &[(String, &str)]) {
    for (i, (name, color)) in items.iter().enumerate() {
        let y = f.top + 14.0 + i as f64 * 18.0;
        let x = f.w - f.right + 12.0;
        let _ = write!(
            out,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{color}"/><text x="{}" y="{}">{name}</text>"#,
            y - 10.0,
            x + 18.0,
            y
        );
    }
}

/// Device memory over time per process (resident bytes, summed over tags) and the device's
/// total in use, phases shaded behind.
///
/// Reads memory.jsonl twice (scales first, then the drawing) rather than holding it; past
/// `MAX_SAMPLES` boundaries it draws every k-th, so a long run's plot stays a plot.
pub fn memory_timeline(r: &Runner) -> String {
    const MAX_SAMPLES: usize = 6000;
    let path = r.run_dir.join("memory.jsonl");
    let (mut n, mut end, mut ymax, mut total) = (0usize, 1e-3f64, 1u64, 0u64);
    for s in read_lines::<MemSample>(&path) {
        n += 1;
        end = end.max(s.t_s);
        ymax = ymax.max(s.device_used.iter().copied().max().unwrap_or(0));
        total = total.max(s.device_total.iter().copied().max().unwrap_or(0));
    }
    let (ymax, total) = (ymax as f64, total as f64);
    let stride = n.div_ceil(MAX_SAMPLES).max(1);
    let samples = || read_lines::<MemSample>(&path).enumerate().filter(move |(i, _)| i % stride == 0).map(|(_, s)| s);
    let gib = (1u64 << 30) as f64;
    let unit = if ymax.max(total) >= gib { gib } else { (1u64 << 20) as f64 };
    let unit_name = if unit == gib { "GiB" } else { "MiB" };
    let f = Frame {
        w: 960.0,
        h: 460.0,
        left: 70.0,
        right: 220.0,
        top: 36.0,
        bottom: 48.0,
        x0: 0.0,
        x1: end,
        y0: 0.0,
        y1: ymax.max(total) * 1.05 / unit,
    };
    let mut out = String::new();
    f.open(&mut out, "Device memory over the run (phases shaded)", "seconds", &format!("{unit_name} in use"), &|y| {
        format!("{y:.1}")
    });
    for s in samples() {
        let _ = write!(
            out,
            r#"<rect x="{:.1}" y="{}" width="{:.2}" height="{}" fill="{}"><title>step {} {}</title></rect>"#,
            f.px(s.start_s),
            f.top,
            (f.px(s.t_s) - f.px(s.start_s)).max(0.3),
            f.h - f.top - f.bottom,
            phase_color(&s.phase),
            s.step,
            s.phase
        );
    }
    f.axes(&mut out);
    let mut items: Vec<(String, &str)> = Vec::new();
    // The device total goes underneath, wide and grey, so the per-process lines stay visible where
    // one process is all the device holds.
    let devices = r.cfg.total_devices();
    let names: Vec<String> = r.workers.iter().map(|w| w.name.clone()).collect();
    let mut device_pts: Vec<Vec<(f64, f64)>> = vec![Vec::new(); devices];
    let mut worker_pts: Vec<Vec<(f64, f64)>> = vec![Vec::new(); names.len()];
    for s in samples() {
        for (d, pts) in device_pts.iter_mut().enumerate() {
            pts.push((s.t_s, s.device_used.get(d).copied().unwrap_or(0) as f64 / unit));
        }
        for (name, pts) in names.iter().zip(&mut worker_pts) {
            pts.push((s.t_s, s.workers.get(name).map(|t| t.values().sum::<u64>()).unwrap_or(0) as f64 / unit));
        }
    }
    for pts in &device_pts {
        polyline(&mut out, &f, pts, "#bbb", 5.0, true);
    }
    items.push(("device in use".into(), "#bbb"));
    for (i, (name, pts)) in names.iter().zip(&worker_pts).enumerate() {
        let c = COLORS[i % COLORS.len()];
        polyline(&mut out, &f, pts, c, 1.6, true);
        items.push((name.clone(), c));
    }
    if total > 0.0 {
        let y = f.py(total / unit);
        let _ = write!(
            out,
            r##"<line x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#555" stroke-dasharray="6 4"/>"##,
            f.left,
            f.w - f.right
        );
        items.push(("device capacity".into(), "#555"));
    }
    for (p, c) in [
        ("generate", "generate"),
        ("offload / sleep", "sleep"),
        ("wake / onload", "wake_up"),
        ("update_weights", "update_weights"),
        ("train phases", "actor_train"),
    ] {
        items.push((p.to_string(), phase_color(c)));
    }
    legend(&mut out, &f, &items);
    out.push_str("</svg>");
    out
}

pub fn reward_curve(r: &Runner) -> String {
    let keys = ["step".to_string(), "rollout/reward_mean".to_string(), "rollout/pass_rate".to_string()];
    let series = metric_series(r, &keys);
    let get = |k: &str| -> Vec<(f64, f64)> { series["step"].iter().copied().zip(series[k].iter().copied()).collect() };
    let steps = series["step"].len().max(2) as f64;
    let f = Frame {
        w: 760.0,
        h: 400.0,
        left: 60.0,
        right: 170.0,
        top: 36.0,
        bottom: 48.0,
        x0: 1.0,
        x1: steps,
        y0: 0.0,
        y1: 1.0,
    };
    let mut out = String::new();
    f.open(&mut out, "Reward and pass rate per step", "step", "", &|y| format!("{y:.2}"));
    f.axes(&mut out);
    polyline(&mut out, &f, &get("rollout/reward_mean"), COLORS[0], 1.6, false);
    polyline(&mut out, &f, &get("rollout/pass_rate"), COLORS[2], 1.6, false);
    legend(&mut out, &f, &[("reward mean".into(), COLORS[0]), ("pass rate (exact)".into(), COLORS[2])]);
    out.push_str("</svg>");
    out
}

pub fn write_plots(r: &Runner) -> std::io::Result<()> {
    std::fs::write(r.run_dir.join("memory_timeline.svg"), memory_timeline(r))?;
    std::fs::write(r.run_dir.join("reward.svg"), reward_curve(r))
}
