//! `relax-colocate compare`: the same job (profile, batch, steps, total devices) run colocated,
//! async and elastic, one after the other, with one table and one plot of them. Each layout is an
//! ordinary `relax-colocate run` in a child process (its run directory under the comparison's), so
//! every figure here is one the run itself wrote.

use crate::plot::{self, Axis, Chart, Quantity, Series, Shape};
use crate::run::config::Config;
use crate::run::metrics;
use crate::run::summary::{ElasticSummary, Summary};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;

mod reward;

/// The job and its layouts: what `compare` runs and `plan` predicts, so that both take the
/// same flags and mean the same by them.
#[derive(clap::Args)]
pub struct JobArgs {
    /// Total devices, the same for every layout [run.devices].
    #[arg(long, default_value_t = 2)]
    pub devices: u32,
    /// Async and elastic: the trainer's devices (default: the first half).
    #[arg(long)]
    pub trainer_devices: Option<String>,
    /// Async and elastic: the rollout engines' devices (default: the rest).
    #[arg(long)]
    pub rollout_devices: Option<String>,
    /// The layouts, in this order, comma-separated: colocate, async, elastic (compare runs at
    /// least two).
    #[arg(long, value_delimiter = ',', default_value = "colocate,async,elastic")]
    pub layouts: Vec<crate::run::config::Mode>,
    /// Trainer steps of each run, in the job's batches: a layout whose section of the job file
    /// (`[layouts.async]`, ...) gives it a batch of its own runs as many of its own steps as hold
    /// the same prompts.
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Async and elastic: the staleness bound [async.max_staleness].
    #[arg(long, default_value_t = 2)]
    pub max_staleness: i64,
    /// A TOML job file for every run (`run --config`), e.g. jobs/long-tail.toml; its
    /// `[layouts.colocate]`, `[layouts.async]` and `[layouts.elastic]` sections reach their own
    /// layout's runs alone; this command's own flags (--steps, --devices, the device split,
    /// --max-staleness, --lengths) and every --set win over its keys.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A file of your job's response lengths for every run (`run --lengths`): each sample's
    /// modelled response length is drawn from it by the sample's identity, the same in every
    /// layout; JSON lines that each name their "step" give each step its own lengths
    /// [compute.lengths, compute.lengths_first_step].
    #[arg(long, value_name = "FILE")]
    pub lengths: Option<PathBuf>,
    /// Any configuration key for every run: --set memory.profile=qwen3-4b (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
}

#[derive(clap::Args)]
pub struct Options {
    #[command(flatten)]
    pub job: JobArgs,
    /// Runs of every layout, interleaved (each layout once, then again): the table shows their
    /// mean, and a winner is named only when its slowest run beats the runner-up's fastest.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub repeats: u32,
    /// Model device compute time from the memory profile (true), or measure this CPU (false)
    /// [compute.model].
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub model_compute: bool,
    /// Output folder.
    #[arg(long, default_value = "runs/compare")]
    pub out: PathBuf,
    /// libtms_hook.so to preload (default: next to this binary, or ../lib).
    #[arg(long)]
    pub hook: Option<PathBuf>,
    /// The reward level each layout is timed to (time to reward). Default: 90% of the way from the
    /// highest smoothed reward any run started at to the lowest best any run reached, when the
    /// reward rose by at least 0.05 in every run; otherwise layouts are judged by throughput alone.
    #[arg(long, value_name = "REWARD")]
    pub reward_target: Option<f64>,
    /// Print compare.json on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One layout's run as the comparison reads it back.
struct Layout {
    name: &'static str,
    dir: PathBuf,
    summary: Summary,
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

/// Where repeat `k` (from 1) of layout `name` runs: `<out>/<name>` for the first, `<out>/<name>-k`
/// for the others.
fn run_dir(o: &Options, name: &str, k: u32) -> PathBuf {
    if k == 1 { o.out.join(name) } else { o.out.join(format!("{name}-{k}")) }
}

fn run_layout(o: &Options, mode: crate::run::config::Mode, k: u32, steps: u64) -> Result<Layout, (u8, String)> {
    let name = mode.as_str();
    let exe = std::env::current_exe().map_err(|e| (1, format!("cannot find this program: {e}")))?;
    let dir = run_dir(o, name, k);
    let mut cmd = Command::new(exe);
    cmd.args(["run", "--quiet", "--json", "--steps", &steps.to_string(), "--devices", &o.job.devices.to_string()])
        .arg("--out")
        .arg(&dir)
        .args(mode_args(o, mode));
    if let Some(file) = &o.job.config {
        cmd.arg("--config").arg(file);
    }
    // Said either way: a job file's compute.model must not outvote this command's flag.
    cmd.args(["--set", &format!("compute.model={}", o.model_compute)]);
    if let Some(file) = &o.job.lengths {
        // Absolute, so that every run reads the same file whatever its own directory.
        cmd.arg("--lengths").arg(std::path::absolute(file).unwrap_or_else(|_| file.clone()));
    }
    for s in o.job.sets.iter().chain(&layout_overrides(mode)) {
        cmd.args(["--set", s]);
    }
    if let Some(h) = &o.hook {
        cmd.arg("--hook").arg(h);
    }
    if !o.json {
        let of = if o.repeats > 1 { format!(", run {k} of {}", o.repeats) } else { String::new() };
        eprintln!("relax-colocate compare: running the {name} layout ({steps} steps{of}) into {}", dir.display());
    }
    let out = cmd.output().map_err(|e| (1, format!("cannot start the {name} run: {e}")))?;
    if !out.status.success() {
        let code = out.status.code().unwrap_or(1).clamp(1, 255) as u8;
        let err = String::from_utf8_lossy(&out.stderr);
        return Err((code, format!("the {name} run failed (exit {code}):\n{}", err.trim_end())));
    }
    let summary: Summary = serde_json::from_slice(&out.stdout)
        .map_err(|e| (1, format!("the {name} run's summary (its --json output) does not read: {e}")))?;
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
    let run = l.summary.run.clone().unwrap_or_default();
    let a = run.asynchronous.as_ref();
    let wall = run.wall_time_s;
    let step_times = l.series("perf/wall_step_time");
    let run_s: f64 = step_times.iter().sum();
    let batch = l.batch();
    let tokens: f64 = l.series("rollout/response_len/mean").iter().map(|len| len * batch).sum();
    let samples = l.rows.len() as f64 * batch;
    // After the job's first batch: async's first step fills the pipeline (the trainer waits for
    // the first batch's whole generation), a cost a long run pays once. A layout in parts of the
    // job's batch leaves out as many of its steps, so that every layout counts the same samples.
    let first = l.config.steps_in_job_batch();
    let steady_s: f64 = step_times.iter().skip(first).sum();
    let steady = (l.rows.len() > first).then(|| (l.rows.len() - first) as f64 * batch / steady_s);
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
    let devices = f64::from(l.config.run.devices.max(1));
    let trained: f64 = l.series("train/tokens").iter().sum();
    let trainer_devices = match l.config.mode_layout() {
        Ok(Some(split)) => split.trainer.len() as f64,
        _ => devices,
    };
    let rollout_busy = match a {
        Some(a) => 1.0 - a.rollout_idle_ratio,
        None => l.series(&metrics::phase_time("generate")).iter().sum::<f64>() / run_s,
    };
    json!({
        "layout": l.name,
        "run_dir": l.dir,
        "steps": l.rows.len(),
        "prompts_per_step": l.config.rollout.prompts_per_step,
        "samples_per_s": samples / run_s,
        "samples_per_s_after_first_step": steady,
        "tokens_per_s": tokens / run_s,
        "tokens_per_device_s": tokens / run_s / devices,
        // Each role's own devices: how hard a device of each works, where busy only says how long.
        "rollout_tokens_per_device_s": run.decode.get("rollout").and_then(|d| d.tokens_per_device_s),
        "trainer_tokens_per_device_s": trained / run_s / trainer_devices,
        "lent_slot_occupancy": run.decode.get("lent").and_then(|d| d.slot_occupancy),
        // With compute.lengths: the modelled response tokens a trained sample drew, which every
        // layout must charge alike (the same samples draw the same lengths).
        "drawn_tokens_per_sample": run.lengths.as_ref().filter(|l| l.trained_samples > 0)
            .map(|l| l.trained_response_tokens / l.trained_samples as f64),
        "step_time_median_s": median(step_times),
        "slot_occupancy": run.decode.get("rollout").and_then(|d| d.slot_occupancy),
        "kv_preemptions": run.decode.get("rollout").map(|d| d.preemptions),
        "trainer_busy": train / run_s,
        "rollout_busy": rollout_busy,
        "update_weights_median_s": median(update),
        "switch_median_s": median(switch),
        "staleness_histogram": a.map(|a| &a.staleness_histogram),
        "reward_first3": run.reward.first3_mean,
        "reward_last3": run.reward.last3_mean,
        "wall_time_s": wall,
        "compute": run.compute,
        "trainer_idle": a.map(|a| a.trainer_idle_ratio),
        "trainer_wait": a.map(|a| a.trainer_wait_ratio),
        "flush_s_mean": a.and_then(|a| a.flush_s_mean),
        "elastic": a.and_then(|a| a.elastic.as_ref()).map(|e| elastic_figures(l, e)),
    })
}

/// The throughputs whose every run and spread the figures keep, and the verdict weighs.
const THROUGHPUTS: [&str; 2] = ["samples_per_s", "samples_per_s_after_first_step"];

/// Seconds of wall time a run took to reach the reward target (null: it did not), kept like a
/// throughput: every run and the spread.
const TIME_TO_REWARD: &str = "time_to_reward_s";

/// A run's steps as (wall time, mean reward).
fn reward_steps(l: &Layout) -> Vec<(f64, f64)> {
    l.rows.iter().filter_map(|r| Some((l.get(r, "perf/wall_step_time")?, l.get(r, "rollout/raw_reward")?))).collect()
}

/// One layout's figures over its runs: a number the runs disagree on is their mean, the
/// staleness histograms are summed, and beside each throughput stand every run's figure
/// (`KEY_runs`) and their spread (`KEY_spread`: max - min over the mean).
fn combined(runs: &[Value]) -> Value {
    let mut out = mean_of(runs);
    let mut hist = serde_json::Map::new();
    for r in runs {
        for (k, v) in r["staleness_histogram"].as_object().into_iter().flatten() {
            let sum = hist.get(k).and_then(Value::as_u64).unwrap_or(0) + v.as_u64().unwrap_or(0);
            hist.insert(k.clone(), json!(sum));
        }
    }
    if !hist.is_empty() {
        out["staleness_histogram"] = Value::Object(hist);
    }
    let timed = runs.iter().any(|r| r.get(TIME_TO_REWARD).is_some());
    for key in THROUGHPUTS.into_iter().chain(timed.then_some(TIME_TO_REWARD)) {
        let each: Vec<f64> = runs.iter().map(|r| r[key].as_f64().unwrap_or(f64::NAN)).collect();
        let (lo, hi) = each.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        let mean = each.iter().sum::<f64>() / each.len() as f64;
        out[format!("{key}_runs")] = json!(each);
        out[format!("{key}_spread")] = json!((hi - lo) / mean);
        // A run that never got there leaves no mean to speak of.
        if each.iter().any(|x| x.is_nan()) {
            out[key] = Value::Null;
        }
    }
    out["repeats"] = json!(runs.len());
    out["run_dirs"] = runs.iter().map(|r| r["run_dir"].clone()).collect();
    out
}

/// `runs`' first object with every number the runs disagree on replaced by their mean (over the
/// runs that have it), nested objects alike.
fn mean_of(runs: &[Value]) -> Value {
    let Some(Value::Object(first)) = runs.first() else { return runs.first().cloned().unwrap_or(Value::Null) };
    let mut out = serde_json::Map::new();
    for (k, v) in first {
        let all: Vec<&Value> = runs.iter().map(|r| &r[k]).collect();
        let value = if all.iter().all(|x| *x == v) {
            v.clone()
        } else if v.is_object() {
            mean_of(&all.into_iter().cloned().collect::<Vec<_>>())
        } else {
            let nums: Vec<f64> = all.iter().filter_map(|x| x.as_f64()).collect();
            if nums.is_empty() { v.clone() } else { json!(nums.iter().sum::<f64>() / nums.len() as f64) }
        };
        out.insert(k.clone(), value);
    }
    Value::Object(out)
}

/// Elastic mode's lending: how often and at what cost, and the trainer devices' idle share with
/// the time they were lent counted as work.
fn elastic_figures(l: &Layout, e: &ElasticSummary) -> Value {
    let steps = l.rows.len().max(1) as f64;
    let nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
    let r = e.rollout_lend.as_ref();
    json!({
        "lends_per_step": e.lends as f64 / steps,
        "switch_s_mean": nan(e.lend_s_mean) + nan(e.reclaim_s_mean),
        "switch_saver_s_mean": e.switch_saver_s_mean,
        "trainer_device_idle": e.trainer_device_idle_ratio,
        "lent_tokens": e.lent_tokens,
        "lent_engine_idle_s": e.lent_engine_idle_s,
        "forced_reclaims": e.forced_reclaims,
        // elastic.lend_rollout: the engines' devices lent to the trainer (absent: not asked for).
        "rollout_lends_per_step": r.map_or(f64::NAN, |r| r.lends as f64 / steps),
        "rollout_device_idle": r.map_or(f64::NAN, |r| r.rollout_device_idle_ratio),
    })
}

/// A line of the table: its label, the figure's key (`elastic.KEY` inside the elastic block), how
/// to show it.
type TableRow = (&'static str, &'static str, fn(f64) -> String);

fn figure(v: &Value, key: &str) -> f64 {
    match key.split_once('.') {
        Some((block, k)) => v[block][k].as_f64(),
        None => v[key].as_f64(),
    }
    .unwrap_or(f64::NAN)
}

fn print_table(names: &[&str], figs: &[Value]) {
    let pct = |x: f64| if x.is_nan() { "-".into() } else { format!("{:.0}%", 100.0 * x) };
    let secs = |x: f64| if x.is_nan() { "-".into() } else { format!("{x:.3}") };
    print!("\n{:<34}", "");
    for n in names {
        print!(" {n:>12}");
    }
    println!();
    let repeats = figs[0]["repeats"].as_u64().unwrap_or(1);
    if repeats > 1 {
        println!("(each figure the mean of {repeats} runs)");
    }
    let rows: [TableRow; 29] = [
        ("samples/s", "samples_per_s", |x| format!("{x:.1}")),
        ("samples/s after step 1", "samples_per_s_after_first_step", |x| format!("{x:.1}")),
        ("  spread over the runs", "samples_per_s_after_first_step_spread", |x| {
            if x.is_nan() || x == 0.0 { "-".into() } else { format!("±{:.0}%", 50.0 * x) }
        }),
        ("tokens/s", "tokens_per_s", |x| format!("{x:.1}")),
        ("tokens/s per device", "tokens_per_device_s", |x| format!("{x:.1}")),
        ("  per rollout device", "rollout_tokens_per_device_s", |x| format!("{x:.1}")),
        ("trained tokens/s per trainer device", "trainer_tokens_per_device_s", |x| format!("{x:.1}")),
        ("step time, median (s)", "step_time_median_s", |x| format!("{x:.3}")),
        ("trainer busy", "trainer_busy", pct),
        ("trainer idle (wait + flush)", "trainer_idle", pct),
        ("  of which waiting for samples", "trainer_wait", pct),
        ("update flush, mean (s)", "flush_s_mean", secs),
        ("trainer devices idle", "elastic.trainer_device_idle", pct),
        ("rollout busy", "rollout_busy", pct),
        ("rollout devices idle (lent = work)", "elastic.rollout_device_idle", pct),
        ("rollout batch slots filled", "slot_occupancy", pct),
        ("lent engines' batch slots filled", "lent_slot_occupancy", pct),
        ("KV preemptions", "kv_preemptions", |x| if x.is_nan() { "-".into() } else { format!("{x:.0}") }),
        ("weight update, median (s)", "update_weights_median_s", secs),
        ("sleep/wake switch, median (s)", "switch_median_s", secs),
        ("lends per step", "elastic.lends_per_step", |x| if x.is_nan() { "-".into() } else { format!("{x:.2}") }),
        ("lend + reclaim, mean (s)", "elastic.switch_s_mean", secs),
        ("  of which the saver's (s)", "elastic.switch_saver_s_mean", secs),
        ("rollout lends per step", "elastic.rollout_lends_per_step", |x| {
            if x.is_nan() { "-".into() } else { format!("{x:.2}") }
        }),
        ("reward, first 3 steps", "reward_first3", |x| format!("{x:.3}")),
        ("reward, last 3 steps", "reward_last3", |x| format!("{x:.3}")),
        ("time to reward target (s)", TIME_TO_REWARD, secs),
        ("wall time (s)", "wall_time_s", |x| format!("{x:.1}")),
        ("lent tokens", "elastic.lent_tokens", |x| if x.is_nan() { "-".into() } else { format!("{x:.0}") }),
    ];
    for (label, key, show) in rows {
        print!("{label:<34}");
        for f in figs {
            print!(" {:>12}", show(figure(f, key)));
        }
        println!();
    }
    print!("{:<34}", "staleness (updates: samples)");
    for f in figs {
        let hist = f["staleness_histogram"]
            .as_object()
            .map(|h| h.iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|| "0:all".into());
        print!(" {hist:>12}");
    }
    println!();
    println!("compute: {}", figs[0]["compute"].as_str().unwrap_or("?"));
}

/// Reward against wall time for every layout (each run's step ends on its own clock), and the
/// target each is timed to.
fn reward_plot(layouts: &[Layout], target: Option<f64>) -> String {
    let mut series: Vec<Series> = layouts
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
    let end = series.iter().flat_map(|s| s.points.last()).map(|p| p.0).fold(0.0, f64::max);
    if let Some(level) = target.filter(|_| end > 0.0) {
        series.push(Series {
            name: format!("target {level:.3}"),
            points: vec![(0.0, level), (end, level)],
            shape: Shape::Dashed,
            color: plot::RGBColor(120, 120, 120),
            width: 1,
        });
    }
    plot::svg(&Chart {
        title: format!("Reward against time: {} on the same job", names(layouts).join(", ")),
        width: 900,
        height: 420,
        x: Some(Axis::linear("time (s)", Quantity::Seconds)),
        y: Some(Axis::linear("mean reward", Quantity::Plain)),
        series,
        ..Chart::default()
    })
}

fn names(layouts: &[Layout]) -> Vec<&'static str> {
    layouts.iter().map(|l| l.name).collect()
}

/// Each layout's throughput over the others', all samples and after step 1: `X_over_Y_samples_per_s`
/// and `X_over_Y_after_first_step`; and, when elastic ran, over the better of the others (its
/// target).
fn ratios(names: &[&str], figs: &[Value]) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    let keys = [("samples_per_s", "samples_per_s"), ("samples_per_s_after_first_step", "after_first_step")];
    for (i, a) in names.iter().enumerate() {
        for (j, b) in names.iter().enumerate().filter(|(j, _)| *j < i) {
            for (key, suffix) in keys {
                out.insert(format!("{a}_over_{b}_{suffix}"), json!(figure(&figs[i], key) / figure(&figs[j], key)));
            }
        }
    }
    if let Some(e) = names.iter().position(|n| *n == "elastic") {
        for (key, suffix) in keys {
            let best = (0..figs.len()).filter(|&j| j != e).map(|j| figure(&figs[j], key)).fold(f64::NAN, f64::max);
            out.insert(format!("elastic_over_best_other_{suffix}"), json!(figure(&figs[e], key) / best));
        }
    }
    out
}

/// Throughput gaps under this share are called a tie: one run on a shared machine moves by that much
/// (docs/perf.md measured the same elastic job at 1.28x, 1.13x and 1.27x of colocate in three runs).
pub(crate) const TIE_MARGIN: f64 = 0.05;

/// Runs shorter than this are mostly start-up (async fills its pipeline in step 1, elastic
/// calibrates its switch): the verdict says so.
const STEPS_TO_JUDGE: u64 = 5;

/// Whether elastic's runs lent nothing, in either direction: then it ran async's layout, and any
/// gap between the two is noise.
fn lent_nothing(f: &Value) -> bool {
    let lends = |k: &str| f["elastic"][k].as_f64().unwrap_or(0.0);
    f["elastic"].is_object() && lends("lends_per_step") == 0.0 && lends("rollout_lends_per_step") == 0.0
}

/// Which layout the job should use: the highest mean throughput after step 1 (all steps when
/// there is only one), the runner-up and the margin, and whether it is a clear answer: a margin
/// of at least `TIE_MARGIN`, the winner's slowest run faster than the runner-up's fastest (with
/// `repeats` above 1; one run each leaves the spread unmeasured, never clear), a run long enough.
/// An elastic run that lent nothing is async's layout: beside async it is left out of the ranking.
fn verdict(names: &[&str], figs: &[Value], steps: u64) -> Value {
    let key = if steps > 1 { "samples_per_s_after_first_step" } else { "samples_per_s" };
    let idle_elastic =
        names.contains(&"async") && names.iter().zip(figs).any(|(n, f)| *n == "elastic" && lent_nothing(f));
    let (mut ranked, same_layout_twice) = rankable(names, figs, idle_elastic.then_some("elastic"));
    ranked.sort_by(|a, b| figure(b.1, key).total_cmp(&figure(a.1, key)));
    let ((best, top), (runner_up, next)) = (ranked[0], ranked[1]);
    let margin = figure(top, key) / figure(next, key) - 1.0;
    let runs = |f: &Value| -> Vec<f64> {
        let each = f[format!("{key}_runs")].as_array().map(|a| a.iter().filter_map(Value::as_f64).collect());
        each.unwrap_or_else(|| vec![figure(f, key)])
    };
    let (best_runs, next_runs) = (runs(top), runs(next));
    let repeats = best_runs.len().min(next_runs.len());
    let slowest = best_runs.iter().copied().fold(f64::INFINITY, f64::min);
    let fastest = next_runs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // NaN runs count as overlapping.
    let within_spread = repeats > 1 && slowest.partial_cmp(&fastest) != Some(std::cmp::Ordering::Greater);
    let tie = margin.is_nan() || margin < TIE_MARGIN || within_spread || same_layout_twice;
    let short = steps < STEPS_TO_JUDGE;
    json!({
        "layout": best,
        "runner_up": runner_up,
        "by": key,
        "margin": margin,
        "repeats": repeats,
        "winner_slowest": slowest,
        "runner_up_fastest": fastest,
        "within_spread": within_spread,
        "tie": tie,
        "short_run": short,
        "elastic_lent_nothing": idle_elastic,
        "clear": !tie && !short && repeats > 1,
    })
}

/// The layouts to rank, each with its figures: all but `left_out` (an elastic run that lent
/// nothing, async's layout again), unless that leaves fewer than two; then all of them, and true:
/// the same layout twice, which names no winner.
fn rankable<'a>(names: &[&'a str], figs: &'a [Value], left_out: Option<&str>) -> (Vec<(&'a str, &'a Value)>, bool) {
    let all = names.iter().copied().zip(figs);
    let ranked: Vec<_> = all.clone().filter(|(n, _)| Some(*n) != left_out).collect();
    if ranked.len() < 2 { (all.collect(), true) } else { (ranked, false) }
}

/// The verdict in words, with what would make it firmer.
fn verdict_line(v: &Value, max_staleness: i64) -> String {
    let (best, other) = (v["layout"].as_str().unwrap_or("?"), v["runner_up"].as_str().unwrap_or("?"));
    let margin = v["margin"].as_f64().unwrap_or(f64::NAN);
    let by = if v["by"] == "samples_per_s" { "samples/s" } else { "samples/s after step 1" };
    let repeats = v["repeats"].as_u64().unwrap_or(1);
    let lent_nothing = v["elastic_lent_nothing"] == true;
    let same_layout = lent_nothing && [best, other].contains(&"async") && [best, other].contains(&"elastic");
    let mut line = if same_layout {
        format!(
            "for this job: no winner: elastic lent nothing, so both runs are async's layout ({:.2}x apart in {by}: the \
             machine's noise, not a layout's)",
            1.0 + margin
        )
    } else if v["within_spread"] == true {
        format!(
            "for this job: no clear winner: {best} leads {other} by {:.2}x in {by}, but across {repeats} runs each \
             {best}'s slowest ({:.2}) is not faster than {other}'s fastest ({:.2}); run more --repeats or --steps \
             before choosing",
            1.0 + margin,
            v["winner_slowest"].as_f64().unwrap_or(f64::NAN),
            v["runner_up_fastest"].as_f64().unwrap_or(f64::NAN)
        )
    } else if v["tie"] == true {
        format!(
            "for this job: no clear winner: {best} and {other} are within {:.0}% ({:.2}x in {by}); repeat the \
             comparison or run more --steps before choosing",
            TIE_MARGIN * 100.0,
            1.0 + margin
        )
    } else {
        format!("for this job: {best}, {:.2}x the next ({other}) in {by}", 1.0 + margin)
    };
    if repeats < 2 {
        line.push_str("; one run of each layout leaves the spread unmeasured: use --repeats 3 for a verdict");
    }
    if v["short_run"] == true {
        line.push_str(&format!(
            "; a run of fewer than {STEPS_TO_JUDGE} steps is mostly start-up, use --steps {STEPS_TO_JUDGE} or more"
        ));
    }
    if lent_nothing && !same_layout {
        line.push_str("; elastic lent nothing, so it ran async's layout and is not ranked apart from it");
    }
    if best != "colocate" && v["reward"]["learned"] != true {
        line.push_str(&format!(
            "; {best} trains on samples up to {max_staleness} weight version(s) stale: check reward against wall \
             time (reward_vs_time.svg) too"
        ));
    }
    line
}

/// The layouts to run, each once and in the order given, or the message for exit 2.
fn checked_layouts(o: &Options) -> Result<Vec<crate::run::config::Mode>, String> {
    if o.job.devices < 2 {
        return Err("--devices must be at least 2 (async and elastic modes put each role on its own devices)".into());
    }
    let mut modes = Vec::new();
    for m in &o.job.layouts {
        if !modes.contains(m) {
            modes.push(*m);
        }
    }
    if modes.len() < 2 {
        return Err("--layouts needs at least two of colocate, async, elastic".into());
    }
    // Read once here, so that a wrong path is not reported as the first layout's failure; each
    // run checks the keys against its own layout.
    if let Some(file) = &o.job.config {
        let parsed = std::fs::read_to_string(file)
            .map_err(|e| e.to_string())
            .and_then(|t| t.parse::<toml::Table>().map(drop).map_err(|e| e.to_string()));
        if let Err(e) = parsed {
            return Err(format!("--config {}: {e} (a TOML job file, see jobs/)", file.display()));
        }
    }
    if let Some(file) = &o.job.lengths {
        crate::run::lengths::Lengths::load(file).map_err(|e| format!("--lengths: {e}"))?;
    }
    Ok(modes)
}

/// Runs the layouts one after the other; returns the exit code (the failed run's when one fails:
/// 2 for its configuration, 1 otherwise).
pub fn main(o: &Options) -> u8 {
    match compare(o) {
        Ok(()) => 0,
        Err((code, msg)) => {
            eprintln!("relax-colocate compare: {msg}");
            code
        }
    }
}

/// The comparison's steps, each failure with the exit code it ends the command with.
fn compare(o: &Options) -> Result<(), (u8, String)> {
    let modes = checked_layouts(o).map_err(|msg| (2, msg))?;
    let steps: Vec<u64> = modes
        .iter()
        .map(|m| {
            layout_steps(&o.job, *m, o.model_compute).map_err(|msg| (2, format!("the {} layout: {msg}", m.as_str())))
        })
        .collect::<Result<_, _>>()?;
    std::fs::create_dir_all(&o.out).map_err(|e| (1, format!("cannot create {}: {e}", o.out.display())))?;
    let runs = run_all(o, &modes, &steps)?;
    let (figs, target) = figures_and_target(o, &runs);
    // The plot and the names follow each layout's first run.
    let layouts: Vec<Layout> = runs.into_iter().filter_map(|r| r.into_iter().next()).collect();
    let mut outcome = Outcome::judge(o, names(&layouts), figs, target);
    for (l, &own_steps) in layouts.iter().zip(&steps).filter(|(_, s)| **s != o.job.steps) {
        let own = l.config.rollout.prompts_per_step as u64;
        outcome.notes.push(own_batch_note(l.name, own, own_steps, own * own_steps / o.job.steps, o.job.steps));
    }
    let report = outcome.report();
    write_files(o, &report, &layouts, &outcome.target);
    if o.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("serializes"));
    } else {
        outcome.print(o);
    }
    Ok(())
}

/// Every layout's runs, `o.repeats` of each.
fn run_all(o: &Options, modes: &[crate::run::config::Mode], steps: &[u64]) -> Result<Vec<Vec<Layout>>, (u8, String)> {
    // Interleaved, so that a change in the machine's load reaches every layout alike.
    let mut runs: Vec<Vec<Layout>> = modes.iter().map(|_| Vec::new()).collect();
    for k in 1..=o.repeats {
        for ((mode, done), steps) in modes.iter().zip(runs.iter_mut()).zip(steps) {
            done.push(run_layout(o, *mode, k, *steps)?);
        }
    }
    Ok(runs)
}

/// The steps a run of `mode` takes for the job's `--steps`: as many, unless the job file's
/// `[layouts.MODE]` section gives the layout a batch of its own (verl's and Relax's fully async
/// trainers take theirs in parts as they arrive); then as many of its own as hold the same
/// prompts, so that every layout trains on the same samples. A batch that does not divide the
/// job's prompts is refused, with the --steps that would.
pub(crate) fn layout_steps(o: &JobArgs, mode: crate::run::config::Mode, model: bool) -> Result<u64, String> {
    let cfg = crate::run::config::load(o.config.as_deref(), &crate::plan::layout_sets(o, mode, o.steps, model))?;
    let (own, job) = (cfg.rollout.prompts_per_step as u64, cfg.clock_prompts());
    if own == job {
        return Ok(o.steps);
    }
    let prompts = o.steps.saturating_mul(job);
    if !prompts.is_multiple_of(own) {
        return Err(format!(
            "its batch, {own} prompts (its [layouts] section of the job file), does not divide the job's --steps {} x \
             {job} prompts: give --steps a multiple of {}, so that every layout trains on the same prompts",
            o.steps,
            own / gcd(own, job),
        ));
    }
    Ok(prompts / own)
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// What a layout's run is set after the job's own keys: elastic.lend_rollout asks for a way
/// of lending that only elastic mode has, so the other layouts (whose runs would refuse it) run
/// the job without it.
pub(crate) fn layout_overrides(mode: crate::run::config::Mode) -> Vec<String> {
    match mode {
        crate::run::config::Mode::Elastic => Vec::new(),
        _ => vec!["elastic.lend_rollout=false".into()],
    }
}

/// The flags that set `mode`'s layout on its run; the split layouts take the device split and the
/// staleness bound too.
fn mode_args(o: &Options, mode: crate::run::config::Mode) -> Vec<String> {
    let mut args = vec!["--mode".to_string(), mode.as_str().into()];
    if mode.split() {
        args.extend(["--max-staleness".into(), o.job.max_staleness.to_string()]);
        for (flag, v) in [("--trainer-devices", &o.job.trainer_devices), ("--rollout-devices", &o.job.rollout_devices)]
        {
            if let Some(v) = v {
                args.extend([flag.into(), v.clone()]);
            }
        }
    }
    args
}

/// Each layout's figures combined over its runs, and the reward target every run was timed to
/// (or why there is none).
fn figures_and_target(o: &Options, runs: &[Vec<Layout>]) -> (Vec<Value>, Result<reward::Target, String>) {
    let mut per_run: Vec<Vec<Value>> = runs.iter().map(|r| r.iter().map(figures).collect()).collect();
    let curves: Vec<Vec<Vec<(f64, f64)>>> =
        runs.iter().map(|r| r.iter().map(|l| reward::curve(&reward_steps(l))).collect()).collect();
    let target = reward::target(&curves.iter().flatten().cloned().collect::<Vec<_>>(), o.reward_target);
    if let Ok(t) = &target {
        for (figs, cs) in per_run.iter_mut().zip(&curves) {
            for (f, c) in figs.iter_mut().zip(cs) {
                f[TIME_TO_REWARD] = json!(reward::time_to(c, t.level));
            }
        }
    }
    (per_run.iter().map(|r| combined(r)).collect(), target)
}

/// What the comparison found: compare.json and the printed table both say it.
struct Outcome {
    names: Vec<&'static str>,
    figs: Vec<Value>,
    ratios: serde_json::Map<String, Value>,
    verdict: Value,
    target: Result<reward::Target, String>,
    /// Layouts whose batches the job file's `[layouts]` section changed, and what their steps are.
    notes: Vec<String>,
}

/// What a layout's steps are when the job file's `[layouts]` section gave it a batch of its own,
/// `own` prompts: `steps` of them for the job's `job_steps` of `job` prompts (compare and plan).
pub(crate) fn own_batch_note(layout: &str, own: u64, steps: u64, job: u64, job_steps: u64) -> String {
    format!(
        "{layout}: batches of {own} prompts against the job's {job}, so {steps} steps of its own for the job's \
         {job_steps}; its step times are its own steps', samples/s compares the layouts"
    )
}

impl Outcome {
    /// The ratios and the verdict on throughput, with the verdict on reward under its `reward`.
    fn judge(o: &Options, names: Vec<&'static str>, figs: Vec<Value>, target: Result<reward::Target, String>) -> Self {
        let ratios = ratios(&names, &figs);
        let mut verdict = verdict(&names, &figs, o.job.steps);
        verdict["reward"] = match &target {
            Ok(t) => {
                let left_out = (verdict["elastic_lent_nothing"] == true).then_some("elastic");
                let by_throughput = verdict["layout"].as_str().unwrap_or_default().to_string();
                let mut v = reward::verdict(&names, &figs, t, TIE_MARGIN, left_out, &by_throughput);
                v["learned"] = json!(true);
                v
            }
            Err(why) => json!({"learned": false, "reason": why}),
        };
        Outcome { names, figs, ratios, verdict, target, notes: Vec::new() }
    }

    /// compare.json: each layout's figures under its name, the ratios, and the verdict.
    fn report(&self) -> Value {
        let mut report: serde_json::Map<String, Value> =
            self.names.iter().zip(&self.figs).map(|(n, f)| (n.to_string(), f.clone())).collect();
        report.extend(self.ratios.clone());
        report.insert("verdict".into(), self.verdict.clone());
        Value::Object(report)
    }

    /// The table, the ratios, the verdicts and where it all was written.
    fn print(&self, o: &Options) {
        let names = &self.names;
        print_table(names, &self.figs);
        for note in &self.notes {
            println!("note: {note}");
        }
        println!();
        let ratio = |k: String| self.ratios.get(&k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        for (i, a) in names.iter().enumerate() {
            for b in names.iter().take(i) {
                let (all, after) =
                    (ratio(format!("{a}_over_{b}_samples_per_s")), ratio(format!("{a}_over_{b}_after_first_step")));
                println!("{a} / {b} throughput: {all:.2}x (samples/s); {after:.2}x after step 1");
            }
        }
        if names.contains(&"elastic") {
            let (all, after) = (
                ratio("elastic_over_best_other_samples_per_s".into()),
                ratio("elastic_over_best_other_after_first_step".into()),
            );
            println!("elastic / the better of the others: {all:.2}x (samples/s); {after:.2}x after step 1");
        }
        println!("{}", verdict_line(&self.verdict, o.job.max_staleness));
        match &self.target {
            Ok(_) => println!("{}", reward::line(&self.verdict["reward"])),
            Err(why) => println!("learning: {why}"),
        }
        let dirs: Vec<String> = names.iter().map(|n| format!("{n}/")).collect();
        println!("written: {} (compare.json, reward_vs_time.svg, {})", o.out.display(), dirs.join(", "));
    }
}

/// compare.json and the plot, written whether --json prints the report or the table is printed.
fn write_files(o: &Options, report: &Value, layouts: &[Layout], target: &Result<reward::Target, String>) {
    let _ = std::fs::write(o.out.join("compare.json"), serde_json::to_string_pretty(report).expect("serializes"));
    let _ =
        std::fs::write(o.out.join("reward_vs_time.svg"), reward_plot(layouts, target.as_ref().ok().map(|t| t.level)));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Figures of layouts whose runs after step 1 gave `runs[i]` samples/s.
    fn figs(runs: &[&[f64]]) -> Vec<Value> {
        let run = |a: f64| json!({"samples_per_s": 1.0, "samples_per_s_after_first_step": a, "steps": 10});
        runs.iter().map(|r| combined(&r.iter().map(|a| run(*a)).collect::<Vec<_>>())).collect()
    }

    #[test]
    fn the_verdict_names_the_fastest_layout_after_step_1_and_its_margin() {
        let v = verdict(&["colocate", "async", "elastic"], &figs(&[&[3.0, 2.9, 3.1], &[2.5; 3], &[3.6, 3.5, 3.7]]), 10);
        assert_eq!((v["layout"].as_str(), v["runner_up"].as_str()), (Some("elastic"), Some("colocate")));
        assert!((v["margin"].as_f64().unwrap() - 0.2).abs() < 1e-9, "{v}");
        assert_eq!(
            (v["tie"].as_bool(), v["clear"].as_bool(), v["repeats"].as_u64()),
            (Some(false), Some(true), Some(3))
        );
        let line = verdict_line(&v, 2);
        assert!(line.starts_with("for this job: elastic, 1.20x the next (colocate)"), "{line}");
        assert!(line.contains("up to 2 weight version(s) stale") && !line.contains("--repeats"), "{line}");
    }

    #[test]
    fn a_margin_within_the_runs_spread_names_no_winner() {
        // 10% apart on average, but the leader's slowest run is slower than the other's fastest.
        let v = verdict(&["colocate", "async"], &figs(&[&[3.0, 3.0, 3.0], &[2.5, 3.7, 3.7]]), 10);
        assert_eq!(v["layout"], "async", "{v}");
        assert!(v["margin"].as_f64().unwrap() > TIE_MARGIN, "{v}");
        assert_eq!(
            (v["within_spread"].as_bool(), v["tie"].as_bool(), v["clear"].as_bool()),
            (Some(true), Some(true), Some(false))
        );
        let line = verdict_line(&v, 2);
        assert!(line.contains("async's slowest (2.50) is not faster than colocate's fastest (3.00)"), "{line}");
        // The same means with runs that do not overlap: a winner.
        let v = verdict(&["colocate", "async"], &figs(&[&[3.0, 3.0, 3.0], &[3.2, 3.3, 3.4]]), 10);
        assert_eq!((v["within_spread"].as_bool(), v["clear"].as_bool()), (Some(false), Some(true)), "{v}");
    }

    #[test]
    fn a_gap_under_the_tie_margin_one_run_or_a_short_run_is_not_a_clear_answer() {
        let v = verdict(&["colocate", "async"], &figs(&[&[3.0, 3.0], &[3.1, 3.1]]), 10);
        assert_eq!(
            (v["layout"].as_str(), v["tie"].as_bool(), v["clear"].as_bool()),
            (Some("async"), Some(true), Some(false))
        );
        assert!(verdict_line(&v, 2).contains("no clear winner: async and colocate are within 5%"));
        // One run each: the spread is unmeasured, so never clear, and the line says what to do.
        let v = verdict(&["colocate", "async"], &figs(&[&[3.0], &[1.0]]), 10);
        assert_eq!((v["tie"].as_bool(), v["clear"].as_bool()), (Some(false), Some(false)), "{v}");
        assert!(verdict_line(&v, 2).contains("use --repeats 3 for a verdict"));
        let v = verdict(&["colocate", "async"], &figs(&[&[3.0, 3.0], &[1.0, 1.0]]), 3);
        assert_eq!(
            (v["layout"].as_str(), v["short_run"].as_bool(), v["clear"].as_bool()),
            (Some("colocate"), Some(true), Some(false))
        );
        let line = verdict_line(&v, 2);
        assert!(line.contains("use --steps 5 or more") && !line.contains("stale"), "{line}");
        // One step: judged on all samples, step 1 being all there is.
        assert_eq!(verdict(&["colocate", "async"], &figs(&[&[3.0], &[1.0]]), 1)["by"], "samples_per_s");
    }

    #[test]
    fn an_elastic_run_that_lent_nothing_is_asyncs_layout_not_a_winner_of_its_own() {
        let mut f = figs(&[&[3.0, 3.0], &[2.0, 2.0], &[3.5, 3.5]]);
        f[2]["elastic"] = json!({"lends_per_step": 0.0, "rollout_lends_per_step": null});
        let v = verdict(&["colocate", "async", "elastic"], &f, 10);
        assert_eq!((v["layout"].as_str(), v["runner_up"].as_str()), (Some("colocate"), Some("async")), "{v}");
        assert_eq!(v["elastic_lent_nothing"], true);
        assert!(verdict_line(&v, 2).contains("elastic lent nothing, so it ran async's layout"));
        // Async and an elastic run that lent nothing alone: the same layout twice, no winner.
        let v = verdict(&["async", "elastic"], &f[1..], 10);
        assert_eq!(
            (v["tie"].as_bool(), v["clear"].as_bool(), v["elastic_lent_nothing"].as_bool()),
            (Some(true), Some(false), Some(true))
        );
        let line = verdict_line(&v, 2);
        assert!(
            line.starts_with("for this job: no winner: elastic lent nothing, so both runs are async's layout"),
            "{line}"
        );
        // Lending once is a layout of its own.
        f[2]["elastic"]["lends_per_step"] = json!(0.5);
        assert_eq!(verdict(&["colocate", "async", "elastic"], &f, 10)["layout"], "elastic");
    }

    #[test]
    fn a_layouts_runs_combine_into_means_with_every_run_and_the_spread_beside_them() {
        let run = |sps: f64, hist: Value| {
            json!({"samples_per_s": sps, "samples_per_s_after_first_step": sps, "steps": 4, "run_dir": format!("d{sps}"),
                   "staleness_histogram": hist, "elastic": {"lends_per_step": sps / 10.0}, "compute": "modelled"})
        };
        let c = combined(&[run(2.0, json!({"0": 3, "1": 1})), run(4.0, json!({"0": 2}))]);
        assert_eq!(c["samples_per_s"].as_f64(), Some(3.0));
        assert_eq!(c["steps"].as_u64(), Some(4), "a figure every run agrees on keeps its type: {c}");
        assert_eq!(c["samples_per_s_runs"], json!([2.0, 4.0]));
        assert!((c["samples_per_s_spread"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-12, "{c}");
        assert_eq!(c["staleness_histogram"], json!({"0": 5, "1": 1}));
        assert!((c["elastic"]["lends_per_step"].as_f64().unwrap() - 0.3).abs() < 1e-12, "{c}");
        assert_eq!((c["repeats"].as_u64(), c["compute"].as_str()), (Some(2), Some("modelled")));
        assert_eq!(c["run_dirs"], json!(["d2", "d4"]));
    }
}
