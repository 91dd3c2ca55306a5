//! `relax-colocate run`: one trainer and one rollout worker per device, taking turns with device
//! memory through the full GRPO/PPO cycle in slime's order, every phase timed, every step checked.
//!
//! The runner owns the RL loop (prompts, rewards, advantages) and the device-memory choreography
//! (pause/resume through each worker's tms control socket); workers own the model state in device
//! memory and speak the worker protocol (protocol.rs over wire.rs, docs/worker-protocol.md).
//!
//! A driver runs over two shared parts: the fleet (fleet/: the worker processes, requests to them,
//! their control sockets, supervision and the launchers) and the recorder (recorder/: phase
//! timings, memory samples, checks, the run directory's files, loggers, progress and report).
//! cycle/ is the colocated driver. launch.rs resolves a run's plan without side effects, then
//! acts on it (sizing.rs sizes the device); signals.rs records Ctrl-C and SIGTERM. Here: the
//! run's types, its entry point and how it ends.

pub mod algo;
pub mod config;
pub mod device;
pub mod model;
pub mod profile;
pub mod protocol;
pub mod task;
pub mod wire;
pub mod worker;

pub(crate) mod admission;
mod answer;
mod asynchronous;
pub(crate) mod clock;
pub(crate) mod compute;
mod cycle;
mod fleet;
mod handover;
mod job;
mod launch;
pub(crate) mod learn;
pub(crate) mod lengths;
mod pacer;
mod recorder;
mod rig;
mod signals;
mod sizing;
pub(crate) mod summary;
pub(crate) mod switch;
mod transport;
mod weights;

pub(crate) use compute::FIGURES_JSON;
pub use recorder::{loggers, metrics};

use asynchronous::Async;
use cycle::Colocate;
use launch::{make_run_dir, plan, start};
use serde_json::{Value, json};
use std::cell::{Cell, RefCell};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use summary::{Status, Summary};
use task::Rng;

const MIB: u64 = 1 << 20;
/// The hook's reserved tag for the process's communicators (README, "The hook"): pausing it
/// suspends NCCL's buffers, which pausing every tag leaves alone.
const NCCL_TAG: &str = "nccl";
/// The simulator's (and CUDA's usual) VMM granularity: region allocations round up to it.
const GRANULARITY: u64 = 2 * MIB;

pub struct Options {
    pub config: Option<PathBuf>,
    pub sets: Vec<String>,
    pub hook: Option<PathBuf>,
    /// The workers' control-socket folder (--ctl-dir or TMS_CONTROL_DIR); None: the run's own.
    pub ctl_dir: Option<PathBuf>,
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
    /// Out of memory: the request that did not fit, where known (the timeline draws it). Boxed:
    /// every `R` carries room for a `RunError`.
    pub request: Option<Box<summary::FailedRequest>>,
}

impl RunError {
    /// The summary's `failure` block.
    fn failure(&self) -> summary::Failure {
        summary::Failure {
            kind: self.kind.as_str().into(),
            step: self.step,
            phase: self.phase.clone(),
            worker: self.worker.clone(),
            cause: self.cause.clone(),
            request: self.request.as_deref().cloned(),
        }
    }
}

type R<T> = Result<T, RunError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
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

/// Where the run is: the step and the phase a failure is reported at. The driver moves it (the
/// recorder's phases name it); the fleet and the driver read it when they fail.
#[derive(Default)]
struct Cursor {
    step: Cell<u64>,
    phase: RefCell<String>,
}

impl Cursor {
    fn new() -> Rc<Cursor> {
        Rc::new(Cursor { step: Cell::new(0), phase: RefCell::new("setup".into()) })
    }

    fn step(&self) -> u64 {
        self.step.get()
    }

    fn set_step(&self, step: u64) {
        self.step.set(step);
    }

    fn phase(&self) -> String {
        self.phase.borrow().clone()
    }

    fn set_phase(&self, phase: &str) {
        *self.phase.borrow_mut() = phase.to_string();
    }

    /// A failure here.
    fn fail(&self, kind: FailKind, worker: Option<&str>, cause: impl Into<String>) -> RunError {
        let worker = worker.map(String::from);
        RunError { kind, step: self.step(), phase: self.phase(), worker, cause: cause.into(), request: None }
    }
}

/// A configuration that cannot run on this machine (a device it lacks, a device too small): the
/// user's to change, so exit 2 as for the errors found while reading it.
fn config_err(cause: impl Into<String>) -> RunError {
    RunError {
        kind: FailKind::Config,
        step: 0,
        phase: "setup".into(),
        worker: None,
        cause: cause.into(),
        request: None,
    }
}

fn setup_err(cause: impl Into<String>) -> RunError {
    RunError { kind: FailKind::Setup, step: 0, phase: "setup".into(), worker: None, cause: cause.into(), request: None }
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
    // A device this machine lacks, a device too small: refused before the run folder exists, so
    // nothing is left behind for a run that never started.
    let planned = match plan(&cfg, opts.hook.as_deref()) {
        Ok(p) => p,
        Err(e) => return refuse(e.kind, &e.cause),
    };
    signals::install();
    // Before the recorder starts its clock: every time it keeps is on the modelled clock.
    clock::set_scale(cfg.compute.time_scale);
    let run_dir = match make_run_dir(&cfg) {
        Ok(d) => d,
        Err(e) => return refuse(FailKind::Setup, &e.to_string()),
    };
    let mut driver = match start(&cfg, opts, planned, run_dir.clone()) {
        Ok((plan, fleet, recorder)) if cfg.run.mode.split() => {
            Driver::Async(Box::new(Async::new(&cfg, plan, fleet, recorder)))
        }
        Ok((plan, fleet, recorder)) => Driver::Colocate(Box::new(Colocate::new(&cfg, plan, fleet, recorder))),
        Err(e) => {
            let summary = report_failure(&e, None, &run_dir);
            if opts.json {
                println!("{}", summary.to_json());
            }
            return e.kind.exit_code();
        }
    };
    let result = match &mut driver {
        Driver::Colocate(c) => drive(c),
        Driver::Async(a) => a.run(),
    };
    finish(driver, result, opts, &run_dir)
}

/// The two drivers over the same fleet and recorder.
enum Driver {
    Colocate(Box<Colocate>),
    Async(Box<Async>),
}

impl Driver {
    fn parts(&mut self) -> (&mut fleet::Fleet, &mut recorder::Recorder, &profile::Profile) {
        match self {
            Driver::Colocate(c) => (&mut c.rig.fleet, &mut c.rig.rec, &c.rig.profile),
            Driver::Async(a) => (&mut a.rig.fleet, &mut a.rig.rec, &a.rig.profile),
        }
    }
}

fn drive(c: &mut Colocate) -> R<()> {
    c.setup()?;
    let mut rng = Rng::new(c.rig.cfg.run.seed ^ 0xDA7A);
    for step in 1..=c.rig.cfg.run.steps {
        c.rig.at.set_step(step);
        c.rl_step(&mut rng)?;
    }
    Ok(())
}

/// Stops the workers, writes the summary and the plots, and says how the run ended; returns the
/// exit code.
fn finish(mut driver: Driver, result: R<()>, opts: &Options, run_dir: &Path) -> u8 {
    let (asynchronous, weight_sync) = match &driver {
        Driver::Async(a) => (Some(a.summary()), a.rig.sync.report()),
        Driver::Colocate(c) => (None, c.rig.sync.report()),
    };
    let (fleet, rec, profile) = driver.parts();
    if let Err(e) = &result {
        rec.mark_failure(fleet, e);
    }
    fleet.stop(result.is_ok());
    rec.finish();
    let mut summary = recorder::report::summary(rec, result.as_ref().err(), profile);
    if let Some(run) = summary.run.as_mut() {
        (run.asynchronous, run.weight_sync) = (asynchronous, weight_sync);
    }
    let _ = std::fs::write(run_dir.join("summary.json"), summary.to_json());
    let _ = recorder::report::write_plots(rec);
    let code = match &result {
        Ok(()) if !opts.json => {
            recorder::report::print_table(rec, &summary);
            0
        }
        Ok(()) => 0,
        Err(e) => {
            report_failure(e, Some(fleet.log_of_name(e.worker.as_deref())), run_dir);
            e.kind.exit_code()
        }
    };
    if opts.json {
        println!("{}", summary.to_json());
    }
    code
}

/// Says on stderr why the run failed; returns the summary written when no worker got going.
/// `log` is the failed worker's log as the fleet knows it (None: the workers never started).
fn report_failure(e: &RunError, log: Option<Option<PathBuf>>, run_dir: &Path) -> Summary {
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
        let log = log.clone().flatten().unwrap_or_else(|| run_dir.join("logs").join(format!("{w}.log")));
        let t = tail(&log, 20);
        if !t.is_empty() {
            eprintln!("--- last lines of {} ---\n{t}\n---", log.display());
        }
    }
    let status = if e.kind == FailKind::Interrupted { Status::Interrupted } else { Status::Failed };
    let summary = Summary { status, failure: Some(e.failure()), steps_completed: 0, run: None };
    if log.is_none() {
        // The workers never got going: the summary says why, for scripts that read it.
        let _ = std::fs::write(run_dir.join("summary.json"), summary.to_json());
    }
    eprintln!("partial results: {}", run_dir.display());
    summary
}
