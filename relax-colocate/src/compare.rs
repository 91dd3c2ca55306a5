//! `relax-colocate compare`: the same job (profile, batch, steps, total devices) run colocated and
//! async, one after the other, with one table and one plot of the two. Each layout is an ordinary
//! `relax-colocate run` in a child process (its run directory under the comparison's), so every
//! figure here is one the run itself wrote.

use crate::plot::{self, Axis, Chart, Quantity, Series, Shape};
use crate::run::config::Config;
use crate::run::metrics;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;

#[derive(clap::Args)]
pub struct Options {
    /// Total devices, the same for both layouts [run.devices].
    #[arg(long, default_value_t = 2)]
    pub devices: u32,
    /// Async: the trainer's devices (default: the first half).
    #[arg(long)]
    pub trainer_devices: Option<String>,
    /// Async: the rollout engines' devices (default: the rest).
    #[arg(long)]
    pub rollout_devices: Option<String>,
    /// Trainer steps of each run.
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Async: the staleness bound [async.max_staleness].
    #[arg(long, default_value_t = 2)]
    pub max_staleness: i64,
    /// Model device compute time from the memory profile (true), or measure this CPU (false)
    /// [compute.model].
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub model_compute: bool,
    /// Any configuration key for both runs: --set memory.profile=qwen3-4b (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// Output folder.
    #[arg(long, default_value = "runs/compare")]
    pub out: PathBuf,
    /// libtms_hook.so to preload (default: next to this binary, or ../lib).
    #[arg(long)]
    pub hook: Option<PathBuf>,
    /// Print compare.json on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One layout's run as the comparison reads it back.
struct Layout {
    name: &'static str,
    dir: PathBuf,
    summary: Value,
    rows: Vec<Value>,
    /// The run's effective configuration (its config.toml): the batch, and the metric names.
    config: Config,
}

impl Layout {
    /// Samples per step.
    fn batch(&self) -> f64 {
        (self.config.rollout.prompts_per_step * self.config.rollout.samples_per_prompt) as f64
    }

    /// A row's value of the metric slime calls `key`, under the run's style.
    fn get(&self, row: &Value, key: &str) -> Option<f64> {
        row[metrics::name(self.config.metrics.style, key)].as_f64()
    }

    /// The metric slime calls `key`, step by step.
    fn series(&self, key: &str) -> Vec<f64> {
        self.rows.iter().filter_map(|r| self.get(r, key)).collect()
    }
}

fn run_layout(o: &Options, name: &'static str, mode_args: &[String]) -> Result<Layout, (u8, String)> {
    let exe = std::env::current_exe().map_err(|e| (1, format!("cannot find this program: {e}")))?;
    let dir = o.out.join(name);
    let mut cmd = Command::new(exe);
    cmd.args(["run", "--quiet", "--json", "--steps", &o.steps.to_string(), "--devices", &o.devices.to_string()])
        .arg("--out")
        .arg(&dir)
        .args(mode_args);
    if o.model_compute {
        cmd.args(["--set", "compute.model=true"]);
    }
    for s in &o.sets {
        cmd.args(["--set", s]);
    }
    if let Some(h) = &o.hook {
        cmd.arg("--hook").arg(h);
    }
    if !o.json {
        eprintln!("relax-colocate compare: running the {name} layout ({} steps) into {}", o.steps, dir.display());
    }
    let out = cmd.output().map_err(|e| (1, format!("cannot start the {name} run: {e}")))?;
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    if !out.status.success() {
        let code = out.status.code().unwrap_or(1).clamp(1, 255) as u8;
        let err = String::from_utf8_lossy(&out.stderr);
        return Err((code, format!("the {name} run failed (exit {code}):\n{}", err.trim_end())));
    }
    let rows = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let config_file = dir.join("config.toml");
    let config = std::fs::read_to_string(&config_file)
        .map_err(|e| e.to_string())
        .and_then(|t| toml::from_str::<Config>(&t).map_err(|e| e.to_string()))
        .map_err(|e| (1, format!("the {name} run's {}: {e}", config_file.display())))?;
    Ok(Layout { name, dir, summary, rows, config })
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The figures the table and compare.json show for one layout.
fn figures(l: &Layout) -> Value {
    let s = &l.summary;
    let wall = s["wall_time_s"].as_f64().unwrap_or(f64::NAN);
    let step_times = l.series("perf/wall_step_time");
    let run_s: f64 = step_times.iter().sum();
    let batch = l.batch();
    let tokens: f64 = l.series("rollout/response_len/mean").iter().map(|len| len * batch).sum();
    let samples = l.rows.len() as f64 * batch;
    // After the first step: async's first step fills the pipeline (the trainer waits for the
    // first batch's whole generation), a cost a long run pays once.
    let steady_s: f64 = step_times.iter().skip(1).sum();
    let steady = (l.rows.len() > 1).then(|| (l.rows.len() - 1) as f64 * batch / steady_s);
    let train = l.series("perf/train_time").iter().sum::<f64>();
    let update = l.series("perf/update_weights_time");
    // Colocate's switch: the rollout offloaded, the trainer woken, put to sleep, the rollout onloaded.
    let switch: Vec<f64> = l
        .rows
        .iter()
        .map(|r| {
            ["rollout_offload", "wake_up", "sleep", "onload_weights", "onload_kv"]
                .iter()
                .filter_map(|p| l.get(r, &metrics::phase_time(p)))
                .fold(0.0, |a, b| a + b)
        })
        .collect();
    let rollout_busy = match s.get("async") {
        Some(a) => 1.0 - a["rollout_idle_ratio"].as_f64().unwrap_or(f64::NAN),
        None => l.series(&metrics::phase_time("generate")).iter().sum::<f64>() / run_s,
    };
    json!({
        "layout": l.name,
        "run_dir": l.dir,
        "steps": l.rows.len(),
        "samples_per_s": samples / run_s,
        "samples_per_s_after_first_step": steady,
        "tokens_per_s": tokens / run_s,
        "step_time_median_s": median(step_times),
        "trainer_busy": train / run_s,
        "rollout_busy": rollout_busy,
        "update_weights_median_s": median(update),
        "switch_median_s": median(switch),
        "staleness_histogram": s["async"]["staleness_histogram"].clone(),
        "reward_first3": s["reward"]["first3_mean"].clone(),
        "reward_last3": s["reward"]["last3_mean"].clone(),
        "wall_time_s": wall,
        "compute": s["compute"].clone(),
    })
}

/// A line of the table: its label, the figure's key, how to show it.
type TableRow = (&'static str, &'static str, fn(f64) -> String);

fn print_table(figs: &[Value], ratio: f64) {
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    println!("\n{:<28} {:>14} {:>14}", "", "colocate", "async");
    let rows: [TableRow; 11] = [
        ("samples/s", "samples_per_s", |x| format!("{x:.1}")),
        ("samples/s after step 1", "samples_per_s_after_first_step", |x| format!("{x:.1}")),
        ("tokens/s", "tokens_per_s", |x| format!("{x:.1}")),
        ("step time, median (s)", "step_time_median_s", |x| format!("{x:.3}")),
        ("trainer busy", "trainer_busy", |x| format!("{:.0}%", 100.0 * x)),
        ("rollout busy", "rollout_busy", |x| format!("{:.0}%", 100.0 * x)),
        ("weight update, median (s)", "update_weights_median_s", |x| format!("{x:.3}")),
        ("sleep/wake switch, median (s)", "switch_median_s", |x| format!("{x:.3}")),
        ("reward, first 3 steps", "reward_first3", |x| format!("{x:.3}")),
        ("reward, last 3 steps", "reward_last3", |x| format!("{x:.3}")),
        ("wall time (s)", "wall_time_s", |x| format!("{x:.1}")),
    ];
    for (label, key, show) in rows {
        println!("{label:<28} {:>14} {:>14}", show(f(&figs[0], key)), show(f(&figs[1], key)));
    }
    let hist = figs[1]["staleness_histogram"]
        .as_object()
        .map(|h| h.iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    println!("{:<28} {:>14} {:>14}", "staleness (updates: samples)", "0:all", hist);
    let steady = f(&figs[1], "samples_per_s_after_first_step") / f(&figs[0], "samples_per_s_after_first_step");
    println!("\nasync / colocate throughput: {ratio:.2}x (samples/s); {steady:.2}x after step 1");
    println!("compute: {}", figs[0]["compute"].as_str().unwrap_or("?"));
}

/// Reward against wall time for both layouts (each run's step ends on its own clock).
fn reward_plot(layouts: &[Layout]) -> String {
    let series = layouts
        .iter()
        .enumerate()
        .map(|(k, l)| {
            let mut t = 0.0;
            let points = l
                .rows
                .iter()
                .filter_map(|r| {
                    t += l.get(r, "perf/wall_step_time")?;
                    Some((t, l.get(r, "rollout/raw_reward")?))
                })
                .collect();
            Series { name: l.name.into(), points, shape: Shape::Line, color: plot::color(k), width: 2 }
        })
        .collect();
    plot::svg(&Chart {
        title: "Reward against time: colocate and async on the same job".into(),
        width: 900,
        height: 420,
        x: Some(Axis::linear("time (s)", Quantity::Seconds)),
        y: Some(Axis::linear("mean reward", Quantity::Plain)),
        series,
        ..Chart::default()
    })
}

/// Runs both layouts; returns the exit code (the failed run's when one fails: 2 for its
/// configuration, 1 otherwise).
pub fn main(o: &Options) -> u8 {
    if o.devices < 2 {
        eprintln!(
            "relax-colocate compare: --devices must be at least 2 (async mode puts each role on its own devices)"
        );
        return 2;
    }
    if let Err(e) = std::fs::create_dir_all(&o.out) {
        eprintln!("relax-colocate compare: cannot create {}: {e}", o.out.display());
        return 1;
    }
    let mut async_args =
        vec!["--mode".to_string(), "async".into(), "--max-staleness".into(), o.max_staleness.to_string()];
    if let Some(t) = &o.trainer_devices {
        async_args.extend(["--trainer-devices".into(), t.clone()]);
    }
    if let Some(r) = &o.rollout_devices {
        async_args.extend(["--rollout-devices".into(), r.clone()]);
    }
    let mut layouts = Vec::new();
    for (name, args) in [("colocate", vec!["--mode".to_string(), "colocate".into()]), ("async", async_args)] {
        match run_layout(o, name, &args) {
            Ok(l) => layouts.push(l),
            Err((code, msg)) => {
                eprintln!("relax-colocate compare: {msg}");
                return code;
            }
        }
    }
    let figs: Vec<Value> = layouts.iter().map(figures).collect();
    let ratio =
        figs[1]["samples_per_s"].as_f64().unwrap_or(f64::NAN) / figs[0]["samples_per_s"].as_f64().unwrap_or(f64::NAN);
    let steady = |f: &Value| f["samples_per_s_after_first_step"].as_f64().unwrap_or(f64::NAN);
    let report = json!({
        "colocate": figs[0],
        "async": figs[1],
        "async_over_colocate_samples_per_s": ratio,
        "async_over_colocate_after_first_step": steady(&figs[1]) / steady(&figs[0]),
    });
    let _ = std::fs::write(o.out.join("compare.json"), serde_json::to_string_pretty(&report).expect("serializes"));
    let _ = std::fs::write(o.out.join("reward_vs_time.svg"), reward_plot(&layouts));
    if o.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("serializes"));
    } else {
        print_table(&figs, ratio);
        println!("written: {} (compare.json, reward_vs_time.svg, colocate/, async/)", o.out.display());
    }
    0
}
