//! `relax-colocate run`: one trainer and one rollout worker per device, taking turns with device
//! memory through the full GRPO/PPO cycle in slime's order, every phase timed, every step checked.
//!
//! The runner owns the RL loop (prompts, rewards, advantages) and the device-memory choreography
//! (pause/resume through each worker's tms control socket); workers own the model state in device
//! memory and speak the worker protocol (wire.rs, docs/worker-protocol.md).
//!
//! Here: the run's types, its entry point and how it ends. launch.rs starts it (sizing.rs sizes
//! the device, tmpfiles.rs names the files outside the run directory; ray.rs places the workers
//! with Ray instead of starting them as children, docs/ray.md), cycle.rs drives the steps,
//! sampling.rs times phases and samples memory, supervise.rs bounds every wait on a worker and
//! stops them, signals.rs records Ctrl-C and SIGTERM, report.rs writes what the run shows.

pub mod algo;
pub mod config;
pub mod device;
pub mod loggers;
pub mod metrics;
pub mod model;
pub mod profile;
pub mod protocol;
pub mod report;
pub mod task;
pub mod tmpfiles;
pub mod wire;
pub mod worker;

mod cycle;
mod launch;
mod ray;
mod sampling;
mod signals;
mod sizing;
mod supervise;

use config::Config;
use launch::{make_run_dir, start};
use profile::Profile;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Instant;
use task::{Addition, Rng};

const MIB: u64 = 1 << 20;
/// The simulator's (and CUDA's usual) VMM granularity: region allocations round up to it.
const GRANULARITY: u64 = 2 * MIB;

pub struct Options {
    pub config: Option<PathBuf>,
    pub sets: Vec<String>,
    pub hook: Option<PathBuf>,
    pub json: bool,
    pub quiet: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailKind {
    /// The configuration cannot run here (found once the device and host are known): exit 2.
    Config,
    Setup,
    Crash,
    Timeout,
    OutOfMemory,
    Worker,
    Check,
    Interrupted,
}

impl FailKind {
    /// The process exit status for a run that ended this way.
    fn exit_code(self) -> u8 {
        match self {
            FailKind::Interrupted => 130,
            FailKind::Config => 2,
            _ => 1,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            FailKind::Config => "configuration",
            FailKind::Setup => "setup",
            FailKind::Crash => "crash",
            FailKind::Timeout => "timeout",
            FailKind::OutOfMemory => "out_of_memory",
            FailKind::Worker => "worker_error",
            FailKind::Check => "check_failed",
            FailKind::Interrupted => "interrupted",
        }
    }
}

#[derive(Debug)]
pub struct RunError {
    pub kind: FailKind,
    pub step: u64,
    pub phase: String,
    pub worker: Option<String>,
    pub cause: String,
}

type R<T> = Result<T, RunError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Trainer,
    Rollout,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::Trainer => "trainer",
            Role::Rollout => "rollout",
        }
    }
}

/// A worker's process as the runner sees it.
enum Proc {
    /// A child of the runner, leading its own process group.
    Local(Child),
    /// Started on `node` by the Ray bridge (ray.rs); the bridge writes `exit_file`, naming how the
    /// process ended, before it closes the worker's connection.
    Remote { node: String, exit_file: PathBuf },
}

impl Proc {
    /// How the process ended, once it has.
    fn exited(&mut self) -> Option<String> {
        match self {
            Proc::Local(c) => c.try_wait().ok().flatten().map(supervise::describe_exit),
            Proc::Remote { exit_file, .. } => std::fs::read_to_string(exit_file).ok(),
        }
    }

    fn node(&self) -> Option<&str> {
        match self {
            Proc::Local(_) => None,
            Proc::Remote { node, .. } => Some(node),
        }
    }
}

struct Worker {
    name: String,
    role: Role,
    /// Global rank: the device's index in the run (node-major), and the worker's metrics column.
    rank: u32,
    /// The device index on the worker's own node.
    device: u32,
    proc: Proc,
    conn: Option<wire::Conn>,
    /// The process that said hello (the one the hook is loaded in; an external command may be a
    /// shell around it).
    pid: u32,
    log: PathBuf,
    control: Option<PathBuf>,
    /// Launcher ray: the bridge's socket that carries control requests to the worker's own one.
    control_relay: Option<PathBuf>,
    next_id: u64,
}

/// Device memory at one phase boundary (a line of memory.jsonl).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct MemSample {
    /// When the phase ended (and the sample was taken), seconds since the run started.
    pub t_s: f64,
    /// When the phase began: with `t_s`, its span on the timeline plot.
    #[serde(default)]
    pub start_s: f64,
    pub step: u64,
    pub phase: String,
    /// Per device: bytes in use (total − free).
    pub device_used: Vec<u64>,
    pub device_total: Vec<u64>,
    /// Per worker: active (resident) bytes per tag.
    pub workers: BTreeMap<String, BTreeMap<String, u64>>,
    /// Per worker: paused bytes in all.
    pub paused: BTreeMap<String, u64>,
}

pub struct Runner {
    cfg: Config,
    task: Addition,
    shape: model::Shape,
    profile: Profile,
    started: Instant,
    workers: Vec<Worker>,
    /// Launcher ray: the process that placed the workers and carries their messages.
    bridge: Option<ray::Bridge>,
    /// The sockets, the control folder, the simulator state and the bucket file; removed on drop.
    scratch: tmpfiles::Scratch,
    run_dir: PathBuf,
    api: &'static str,
    step: u64,
    phase: String,
    /// This step's memory samples, for its metrics row. Everything older is in memory.jsonl and
    /// metrics.jsonl only, which the report and the plots read back at the end: the runner's own
    /// memory stays flat however many steps a run has.
    step_memory: Vec<MemSample>,
    step_times: BTreeMap<String, f64>,
    steps_completed: u64,
    /// Per device: the most memory in use at any phase boundary.
    peak_used: Vec<u64>,
    metrics_file: std::fs::File,
    /// TensorBoard and wandb, when asked for (metrics.loggers).
    loggers: loggers::Loggers,
    memory_file: std::fs::File,
    bucket_bytes: u64,
    weights_checksum: Option<String>,
    leak_baseline: BTreeMap<String, Vec<u64>>,
    progress: report::Progress,
    device_label: String,
    checks_passed: u64,
}

/// A configuration that cannot run on this machine (a device it lacks, a device too small): the
/// user's to change, so exit 2 as for the errors found while reading it.
fn config_err(cause: impl Into<String>) -> RunError {
    RunError { kind: FailKind::Config, step: 0, phase: "setup".into(), worker: None, cause: cause.into() }
}

fn setup_err(cause: impl Into<String>) -> RunError {
    RunError { kind: FailKind::Setup, step: 0, phase: "setup".into(), worker: None, cause: cause.into() }
}

impl Runner {
    fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn fail(&self, kind: FailKind, worker: Option<&str>, cause: impl Into<String>) -> RunError {
        RunError {
            kind,
            step: self.step,
            phase: self.phase.clone(),
            worker: worker.map(String::from),
            cause: cause.into(),
        }
    }

    fn indices(&self, role: Role) -> Vec<usize> {
        self.workers.iter().enumerate().filter(|(_, w)| w.role == role).map(|(i, _)| i).collect()
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs the configured job; returns the process exit code.
/// What `--json` prints when a run fails before its workers report anything: one object, as a
/// finished or failed run prints, so scripts always have one to read.
fn early_failure(kind: FailKind, cause: &str) -> Value {
    json!({
        "status": if kind == FailKind::Interrupted { "interrupted" } else { "failed" },
        "failure": {"kind": kind.as_str(), "step": 0, "phase": "setup", "worker": null, "cause": cause},
        "steps_completed": 0,
    })
}

pub fn run(opts: &Options) -> u8 {
    let refuse = |kind: FailKind, e: &str| {
        eprintln!("relax-colocate run: {e}");
        if opts.json {
            println!("{}", serde_json::to_string_pretty(&early_failure(kind, e)).expect("serializes"));
        }
        kind.exit_code()
    };
    let cfg = match config::load(opts.config.as_deref(), &opts.sets) {
        Ok(c) => c,
        Err(e) => return refuse(FailKind::Config, &e.to_string()),
    };
    // A missing wandb package is found before anything starts, as the other configuration errors.
    let kinds = loggers::parse_list(&cfg.metrics.loggers).unwrap_or_default();
    if let Err(e) = loggers::preflight(&kinds, &cfg.metrics.python) {
        return refuse(FailKind::Config, &e.to_string());
    }
    signals::install();
    let run_dir = match make_run_dir(&cfg) {
        Ok(d) => d,
        Err(e) => return refuse(FailKind::Setup, &e.to_string()),
    };
    let mut runner = match start(&cfg, opts, run_dir.clone()) {
        Ok(r) => r,
        Err(e) => {
            let summary = report_failure(&e, None, &run_dir);
            if opts.json {
                println!("{}", serde_json::to_string_pretty(&summary).expect("serializes"));
            }
            return e.kind.exit_code();
        }
    };
    let result = drive(&mut runner);
    let graceful = result.is_ok();
    runner.stop_workers(graceful);
    runner.progress.finish();
    runner.loggers.finish();
    for w in &runner.loggers.warnings {
        eprintln!("relax-colocate run: {w}");
    }
    let summary = report::summary(&runner, result.as_ref().err());
    let _ = std::fs::write(run_dir.join("summary.json"), serde_json::to_string_pretty(&summary).expect("serializes"));
    let _ = report::write_plots(&runner);
    match result {
        Ok(()) => {
            if opts.json {
                println!("{}", serde_json::to_string_pretty(&summary).expect("serializes"));
            } else {
                report::print_table(&runner, &summary);
            }
            0
        }
        Err(e) => {
            report_failure(&e, Some(&runner), &run_dir);
            if opts.json {
                println!("{}", serde_json::to_string_pretty(&summary).expect("serializes"));
            }
            e.kind.exit_code()
        }
    }
}

fn drive(r: &mut Runner) -> R<()> {
    r.setup()?;
    let mut rng = Rng::new(r.cfg.run.seed ^ 0xDA7A);
    for step in 1..=r.cfg.run.steps {
        r.step = step;
        r.rl_step(&mut rng)?;
    }
    Ok(())
}

/// Says on stderr why the run failed; returns the summary written when no runner got going.
fn report_failure(e: &RunError, runner: Option<&Runner>, run_dir: &Path) -> Value {
    let at =
        if e.step == 0 { format!("setup, phase {}", e.phase) } else { format!("step {}, phase {}", e.step, e.phase) };
    let who = e.worker.as_ref().map(|w| format!("worker {w}: ")).unwrap_or_default();
    if e.kind == FailKind::Config {
        // As the errors found while reading the configuration: the key first.
        eprintln!("relax-colocate run: {}", e.cause);
    } else {
        eprintln!("relax-colocate run: failed at {at}: {who}{} [{}]", e.cause, e.kind.as_str());
    }
    if let Some(w) = &e.worker {
        let log = runner
            .and_then(|r| r.workers.iter().find(|x| &x.name == w))
            .map(|wk| wk.log.clone())
            .unwrap_or_else(|| run_dir.join("logs").join(format!("{w}.log")));
        let t = tail(&log, 20);
        if !t.is_empty() {
            eprintln!("--- last lines of {} ---\n{t}\n---", log.display());
        }
    }
    let summary = json!({
        "status": if e.kind == FailKind::Interrupted { "interrupted" } else { "failed" },
        "failure": {"kind": e.kind.as_str(), "step": e.step, "phase": e.phase, "worker": e.worker, "cause": e.cause},
        "steps_completed": 0,
    });
    if runner.is_none() {
        // The workers never got going: the summary says why, for scripts that read it.
        let _ =
            std::fs::write(run_dir.join("summary.json"), serde_json::to_string_pretty(&summary).expect("serializes"));
    }
    eprintln!("partial results: {}", run_dir.display());
    summary
}
