//! The recorder: what a run measures and leaves behind. Phase timings and the memory sampled at
//! each phase boundary (sampling.rs, with the leak check), the checks and their count (checks.rs),
//! the run directory's files (metrics.jsonl, memory.jsonl), the loggers (loggers.rs: TensorBoard,
//! wandb), the progress line, and at the end the summary, table and plots (report.rs). Metric
//! names are metrics.rs's. A driver says what a step produced; the recorder writes it down.

mod checks;
pub mod loggers;
pub mod metrics;
pub mod report;
mod sampling;

use super::config::Config;
use super::fleet::Fleet;
use super::{Cursor, FailKind, R, RunError, setup_err};
use crate::run::clock::Instant;
use checks::Checks;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use tms_proto::OpReport;

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
    /// Per worker: active (resident) bytes per tag; `nccl` is the device memory of its
    /// communicators (NCCL's and HCCL's buffers, what a suspend leaves included).
    pub workers: BTreeMap<String, BTreeMap<String, u64>>,
    /// Per worker: paused bytes in all.
    pub paused: BTreeMap<String, u64>,
    /// Per worker with NCCL communicators: the bytes of theirs that are suspended (tag `nccl`),
    /// given back to the device rather than held by the hook. Absent from runs without any.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub comm_suspended: BTreeMap<String, u64>,
}

/// The run directory's outputs, opened before any worker starts.
pub(super) struct Outputs {
    metrics_file: std::fs::File,
    memory_file: std::fs::File,
    pub(super) loggers: loggers::Loggers,
    /// Elastic mode: lending.jsonl, the lending decisions with their reasons.
    lending_file: Option<std::fs::File>,
}

impl Outputs {
    /// Writes config.toml, creates metrics.jsonl and memory.jsonl, and opens the loggers.
    pub(super) fn open(cfg: &Config, run_dir: &Path) -> R<Outputs> {
        std::fs::write(run_dir.join("config.toml"), cfg.to_toml()).map_err(|e| setup_err(e.to_string()))?;
        let open = |name: &str| std::fs::File::create(run_dir.join(name)).map_err(|e| setup_err(e.to_string()));
        let metrics_file = open("metrics.jsonl")?;
        let memory_file = open("memory.jsonl")?;
        let kinds = loggers::parse_list(&cfg.metrics.loggers).map_err(setup_err)?;
        let loggers = loggers::Loggers::open(&kinds, run_dir, &cfg.metrics.python, &cfg.metrics.wandb_project)
            .map_err(|cause| RunError { kind: FailKind::Config, ..setup_err(cause) })?;
        Ok(Outputs { metrics_file, memory_file, loggers, lending_file: None })
    }
}

/// A phase under way: its name and when it began.
pub(super) struct Span {
    name: String,
    start_s: f64,
    t0: Instant,
}

/// This step's record, for its metrics row. Everything older is in memory.jsonl and
/// metrics.jsonl only, which the report and the plots read back at the end: the runner's own
/// memory stays flat however many steps a run has.
#[derive(Default)]
struct StepRecord {
    memory: Vec<MemSample>,
    times: BTreeMap<String, f64>,
    /// Numbers a driver's parts add to this step's row (the weight update's bytes and rate).
    metrics: BTreeMap<String, f64>,
}

#[derive(Default)]
struct Timeline {
    /// When the phase under way began (what a failure's sample spans).
    phase_started_s: f64,
    /// Where the run failed and how, for the timeline's mark.
    failure_mark: Option<(f64, String)>,
    /// Out of memory: the request that did not fit and the device of the worker that made it
    /// (None: not one of the fleet's), drawn on that device's panel.
    failed_request: Option<(Option<u32>, crate::run::summary::FailedRequest)>,
}

pub(super) struct Recorder {
    cfg: Config,
    at: Rc<Cursor>,
    started: Instant,
    run_dir: PathBuf,
    /// The device as the run's first line and the summary name it.
    device_label: String,
    /// The workers' names in the fleet's order (the plots' series), each with its device.
    names: Vec<(String, u32)>,
    /// This step's phases, memory samples and the numbers the drivers' parts add to its row.
    step: StepRecord,
    steps_completed: u64,
    /// Per device: the most memory in use at any phase boundary.
    peak_used: Vec<u64>,
    checks: Checks,
    /// Per worker: the communicator bytes its last pause of tag `nccl` suspended.
    comm_suspended: BTreeMap<String, u64>,
    out: Outputs,
    progress: report::Progress,
    /// The memory timeline's marks: when the phase under way began, where the run failed.
    timeline: Timeline,
    /// With compute.model: each switch stage's measured and modelled time over the run.
    switch: BTreeMap<String, crate::run::summary::SwitchStage>,
    /// What the engines' generate replies said of their decode, by role ("rollout", elastic's
    /// "lent"), and the workers whose replies say nothing.
    decode: BTreeMap<String, DecodeTally>,
    unreported: std::collections::BTreeSet<String>,
}

/// A role's decode over the run: sums of its engines' replies, and its devices.
#[derive(Default)]
pub(super) struct DecodeTally {
    pub(super) stats: crate::run::protocol::DecodeStats,
    /// Steps times slots summed (engines may differ in slots): occupancy's denominator.
    pub(super) slot_capacity: f64,
    pub(super) tokens: u64,
    pub(super) devices: std::collections::BTreeSet<u32>,
}

impl Recorder {
    pub(super) fn new(
        cfg: &Config,
        at: Rc<Cursor>,
        run_dir: PathBuf,
        device_label: String,
        names: Vec<(String, u32)>,
        out: Outputs,
        progress: report::Progress,
    ) -> Recorder {
        Recorder {
            cfg: cfg.clone(),
            at,
            started: Instant::now(),
            run_dir,
            device_label,
            names,
            step: StepRecord::default(),
            steps_completed: 0,
            peak_used: vec![0; cfg.total_devices()],
            checks: Checks::new(cfg.run.checks),
            comm_suspended: BTreeMap::new(),
            out,
            progress,
            timeline: Timeline::default(),
            switch: BTreeMap::new(),
            decode: BTreeMap::new(),
            unreported: Default::default(),
        }
    }

    /// A generate reply of `worker`'s, an engine of `role`, generated `tokens` with the decode
    /// `stats` it reports; a worker that reports none is named once and left out of the figures.
    pub(super) fn record_decode(
        &mut self,
        role: &str,
        worker: &str,
        tokens: u64,
        stats: Option<&crate::run::protocol::DecodeStats>,
    ) {
        let Some(s) = stats else {
            if self.unreported.insert(worker.to_string()) {
                self.note(&format!(
                    "{worker} does not report its decode (generate's `decode`, docs/worker-protocol.md): its engine \
                     is left out of the occupancy and KV figures, and it admits every sequence whatever the KV capacity"
                ));
            }
            return;
        };
        let device = self.names.iter().find(|(n, _)| n == worker).map(|(_, d)| *d);
        let t = self.decode.entry(role.to_string()).or_default();
        t.devices.extend(device);
        t.tokens += tokens;
        t.slot_capacity += s.steps * s.slots as f64;
        let a = &mut t.stats;
        a.steps += s.steps;
        a.slot_steps += s.slot_steps;
        a.preemptions += s.preemptions;
        a.recomputed_tokens += s.recomputed_tokens;
        a.kv_queued_s += s.kv_queued_s;
        a.kv_peak_share = match (a.kv_peak_share, s.kv_peak_share) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
    }

    /// The run directory.
    pub(super) fn run_dir(&self) -> &std::path::Path {
        &self.run_dir
    }

    /// Where the run is, shared with the fleet and the driver.
    pub(super) fn cursor(&self) -> Rc<Cursor> {
        self.at.clone()
    }

    fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn fail(&self, kind: FailKind, worker: Option<&str>, cause: impl Into<String>) -> RunError {
        self.at.fail(kind, worker, cause)
    }

    /// A phase begins: failures from here on name it.
    pub(super) fn begin(&mut self, name: &str) -> Span {
        self.at.set_phase(name);
        self.timeline.phase_started_s = self.elapsed();
        Span { name: name.to_string(), start_s: self.timeline.phase_started_s, t0: Instant::now() }
    }

    /// The phase's work is done: its time counts towards the step's, and the fleet's memory is
    /// sampled (memory.jsonl, the leak check, the peak, the step's row).
    pub(super) fn end(&mut self, span: Span, fleet: &Fleet) -> R<()> {
        *self.step.times.entry(span.name.clone()).or_default() += span.t0.elapsed().as_secs_f64();
        let statuses = fleet.statuses()?;
        self.sample_memory(span.start_s, statuses)
    }

    /// A new step: its phase times start from nothing.
    pub(super) fn new_step(&mut self) {
        self.step.times.clear();
        self.step.metrics.clear();
    }

    /// A number for this step's row, under slime's name.
    pub(super) fn add_step_metric(&mut self, key: &str, v: f64) {
        self.step.metrics.insert(key.to_string(), v);
    }

    /// A switch stage ran `measured` seconds and was charged at least `modelled` (switch.rs):
    /// both join the step's row and the run's switch block.
    pub(super) fn record_switch(&mut self, stage: &str, measured: f64, modelled: f64) {
        let charged = measured.max(modelled);
        for (key, v) in [
            ("perf/switch_measured_time", measured),
            ("perf/switch_modelled_time", modelled),
            ("perf/switch_time", charged),
        ] {
            *self.step.metrics.entry(key.to_string()).or_default() += v;
        }
        let s = self.switch.entry(stage.to_string()).or_default();
        s.stage = stage.to_string();
        s.count += 1;
        s.measured_s += measured;
        s.modelled_s += modelled;
        s.charged_s += charged;
    }

    /// Elastic mode: one lending decision, its reason and figures, to lending.jsonl, stamped with
    /// the run's time, step and phase.
    pub(super) fn log_decision(&mut self, mut decision: serde_json::Value) {
        if self.out.lending_file.is_none() {
            self.out.lending_file = std::fs::File::create(self.run_dir.join("lending.jsonl")).ok();
        }
        if let Some(m) = decision.as_object_mut() {
            m.insert("t_s".into(), serde_json::json!(self.elapsed()));
            m.insert("step".into(), serde_json::json!(self.at.step()));
        }
        if let Some(f) = self.out.lending_file.as_mut() {
            use std::io::Write as _;
            let _ = writeln!(f, "{decision}");
        }
    }

    /// A line for the user (none under --quiet or --json).
    pub(super) fn note(&self, msg: &str) {
        self.progress.note(msg);
    }

    /// Seconds per phase in this step.
    pub(super) fn step_times(&self) -> &BTreeMap<String, f64> {
        &self.step.times
    }

    /// This step's memory samples.
    pub(super) fn step_memory(&self) -> impl Iterator<Item = &MemSample> {
        let step = self.at.step();
        self.step.memory.iter().filter(move |s| s.step == step)
    }

    pub(super) fn checks_enabled(&self) -> bool {
        self.checks.enabled
    }

    /// A check the driver made itself passed (e.g. no sample over the staleness bound trained on).
    pub(in crate::run) fn count_check(&mut self) {
        self.checks.pass();
    }

    /// A failed check as the run's failure, in the phase it was made in.
    fn failed(&self, f: checks::Failed) -> RunError {
        self.fail(FailKind::Check, f.worker.as_deref(), f.cause)
    }

    /// After a pause of `what`: each worker's device free memory rose by the bytes it reports
    /// paused (checks.rs; a real device's driver may take up to 4 MiB of it for itself).
    pub(in crate::run) fn check_paused(&mut self, what: &str, reports: &[(String, OpReport)]) -> R<()> {
        const DRIVER_SLACK: u64 = 4 << 20;
        let slack = if self.cfg.run.device == crate::run::config::DeviceChoice::Sim { 0 } else { DRIVER_SLACK };
        self.checks.paused(what, reports, slack).map_err(|f| self.failed(f))
    }

    /// Each worker's weights checksum (`sums`: name, checksum) is `expected`; `when` says at which
    /// point of the cycle.
    pub(in crate::run) fn check_weights(&mut self, sums: &[(String, String)], expected: &str, when: &str) -> R<()> {
        self.checks.weights(sums, expected, when).map_err(|f| self.failed(f))
    }

    /// Elastic mode: pairs of workers that share a device, whose one-holder rule is checked at
    /// every phase boundary.
    pub(in crate::run) fn add_shared_devices(&mut self, pairs: Vec<(String, String)>) {
        self.checks.share_devices(pairs);
    }

    /// A pause of tag `nccl` suspended these communicator bytes (the reports' `bytes_done`:
    /// ncclCommMemStats' suspendable figure of each communicator suspended), for the summary.
    pub(in crate::run) fn record_comm_suspended(&mut self, reports: &[(String, OpReport)]) {
        for (name, report) in reports {
            self.comm_suspended.insert(name.clone(), report.bytes_done);
        }
    }

    /// The step's row, under slime's names (metrics.rs renames it for verl): to metrics.jsonl, the
    /// loggers and the progress line; the step counts as completed.
    pub(super) fn record_step(&mut self, row: &metrics::Row) {
        let mut row = row.clone();
        for (k, v) in &self.step.metrics {
            row.set(k, *v);
        }
        let row = &row;
        let rendered = row.render(self.cfg.metrics.style);
        let _ = writeln!(self.out.metrics_file, "{}", metrics::json_line(&rendered));
        let _ = self.out.metrics_file.flush();
        self.out.loggers.log(&rendered);
        self.progress.step(self.at.step(), self.cfg.run.steps, row);
        self.steps_completed += 1;
    }

    /// The run is over: the progress line ends, the loggers flush and say what went wrong.
    pub(super) fn finish(&mut self) {
        self.progress.finish();
        self.out.loggers.finish();
        for w in &self.out.loggers.warnings {
            eprintln!("relax-colocate run: {w}");
        }
    }
}
