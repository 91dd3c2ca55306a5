//! `relax-colocate run`: one trainer and one rollout worker per device, taking turns with device
//! memory through the full GRPO/PPO cycle in slime's order, every phase timed, every step checked.
//!
//! The runner owns the RL loop (prompts, rewards, advantages) and the device-memory choreography
//! (pause/resume through each worker's tms control socket); workers own the model state in device
//! memory and speak the worker protocol (wire.rs, docs/worker-protocol.md).

pub mod algo;
pub mod config;
pub mod device;
pub mod model;
pub mod profile;
pub mod report;
pub mod task;
pub mod tmpfiles;
pub mod wire;
pub mod worker;

use crate::bench::find_hook;
use crate::runtime::can_load;
use crate::simulator::sim_environment;
use config::{AlgoName, Config, DeviceChoice};
use profile::Profile;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};
use task::{Addition, Rng, VOCAB};
use tms_proto::OpReport;

/// The signal that asked the run to stop (SIGINT or SIGTERM), 0 while none has.
static INTERRUPTED_BY: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    INTERRUPTED_BY.store(signal, Ordering::SeqCst);
}

/// Whether a signal asked the run to stop, as the words the failure reports.
fn interruption() -> Option<String> {
    match INTERRUPTED_BY.load(Ordering::SeqCst) {
        0 => None,
        libc::SIGINT => Some("interrupted (Ctrl-C, SIGINT)".into()),
        libc::SIGTERM => Some("interrupted (SIGTERM)".into()),
        other => Some(format!("interrupted (signal {other})")),
    }
}

const MIB: u64 = 1 << 20;
/// The simulator's (and CUDA's usual) VMM granularity: region allocations round up to it.
const GRANULARITY: u64 = 2 * MIB;
/// How often a wait on a worker looks at the interruption flag: Ctrl-C and SIGTERM take effect
/// within this even while a worker never answers.
const POLL: Duration = Duration::from_millis(20);

/// `run.phase_timeout_s` as a duration; a huge value means "practically never", not a panic.
fn phase_timeout(cfg: &Config) -> Duration {
    Duration::try_from_secs_f64(cfg.run.phase_timeout_s).unwrap_or(Duration::from_secs(365 * 86_400))
}

/// The scheduling state of `pid` from /proc/PID/stat, in words, for messages about a worker that
/// does not answer.
fn process_state(pid: u32) -> Option<&'static str> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let state = stat.get(stat.rfind(')')? + 2..)?.chars().next()?;
    Some(match state {
        'R' => "running",
        'S' => "sleeping",
        'D' => "in uninterruptible sleep (D: waiting on the kernel or a device)",
        'T' => "stopped (T: SIGSTOP or SIGTSTP; SIGCONT resumes it)",
        't' => "stopped by a debugger (t)",
        'Z' | 'X' | 'x' => "exited (zombie)",
        _ => "in an unknown state",
    })
}

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

struct Worker {
    name: String,
    role: Role,
    rank: u32,
    child: Child,
    conn: Option<wire::Conn>,
    /// The process that said hello (the one the hook is loaded in; an external command may be a
    /// shell around it).
    pid: u32,
    log: PathBuf,
    control: Option<PathBuf>,
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
    /// Holds the sockets, the control folder and the simulator state; removed on drop.
    _tmp: tempfile::TempDir,
    ctl_dir: PathBuf,
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
    memory_file: std::fs::File,
    shm: PathBuf,
    bucket_bytes: u64,
    weights_checksum: Option<String>,
    leak_baseline: BTreeMap<String, Vec<u64>>,
    progress: report::Progress,
    device_label: String,
    checks_passed: u64,
}

fn setup_err(cause: impl Into<String>) -> RunError {
    RunError { kind: FailKind::Setup, step: 0, phase: "setup".into(), worker: None, cause: cause.into() }
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

/// Bytes each role holds on one device, as the hook will charge them.
struct Footprint {
    trainer: u64,
    rollout: u64,
    rollout_weights: u64,
    transfer: u64,
}

/// What the hook charges for allocations of these sizes (each rounded up to the granularity).
fn charged<'a>(sizes: impl IntoIterator<Item = &'a u64>) -> u64 {
    sizes.into_iter().map(|s| round_up(*s, GRANULARITY)).sum()
}

fn footprint(cfg: &Config, shape: &model::Shape, profile: &Profile, bucket: u64) -> Footprint {
    let tensors: Vec<u64> = model::layout(shape).iter().map(|(_, n)| *n as u64 * 4).collect();
    let policy = charged(&tensors);
    let max_batch = (cfg.rollout.prompts_per_step / cfg.run.devices as usize * cfg.rollout.samples_per_prompt) as u64;
    let weight_pads: Vec<u64> =
        profile.rollout.tags.iter().filter(|(t, _)| t == "weights").flat_map(|(_, s)| s).copied().collect();
    let weights_exact = tensors.iter().sum::<u64>() + weight_pads.iter().sum::<u64>();
    Footprint {
        trainer: 5 * policy + charged(profile.trainer.tags.iter().flat_map(|(_, s)| s)),
        rollout: policy
            + round_up(max_batch * shape.hidden as u64 * 8, GRANULARITY)
            + round_up(max_batch * shape.vocab as u64 * 8, GRANULARITY)
            + charged(profile.rollout.tags.iter().flat_map(|(_, s)| s)),
        rollout_weights: policy + charged(&weight_pads),
        transfer: round_up(bucket.min(weights_exact), 4096),
    }
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

    /// Worker `i` did not answer `what` within the phase timeout: say who it is, and what its
    /// process is doing (a stopped process looks exactly like a hung one from the socket).
    fn timed_out(&self, i: usize, what: &str) -> RunError {
        let w = &self.workers[i];
        let state = match process_state(w.pid) {
            Some(s) if s.starts_with("stopped") => format!("; its process is {s}"),
            Some(s) => format!("; its process is {s}: the worker may be hung"),
            None => String::new(),
        };
        self.fail(
            FailKind::Timeout,
            Some(&w.name),
            format!(
                "timed out: the {} (pid {}) did not answer {what} within {}s (run.phase_timeout_s){state}",
                w.role.as_str(),
                w.pid,
                self.cfg.run.phase_timeout_s
            ),
        )
    }

    /// Runs `call` against the control socket of each worker in `targets`, in parallel, and
    /// waits for every answer until the phase timeout or an interruption. The calls run on
    /// threads of their own so the wait can end when a worker never answers: a SIGSTOPped process
    /// still accepts connections (the kernel queues them) and answers nothing. A thread left
    /// waiting ends at its own socket timeout, the same phase timeout.
    fn control_calls<T: Send + 'static>(
        &self,
        targets: &[usize],
        what: &str,
        call: impl Fn(&Path, Duration) -> Result<T, tms_proto::ClientError> + Clone + Send + 'static,
    ) -> R<Vec<T>> {
        let timeout = phase_timeout(&self.cfg);
        let deadline = Instant::now() + timeout;
        let (tx, rx) = std::sync::mpsc::channel();
        for (k, &i) in targets.iter().enumerate() {
            let path = self.workers[i].control.clone().expect("control socket found");
            let tx = tx.clone();
            let call = call.clone();
            std::thread::spawn(move || {
                let _ = tx.send((k, call(&path, timeout)));
            });
        }
        drop(tx);
        let mut out: Vec<Option<T>> = targets.iter().map(|_| None).collect();
        let mut left = targets.len();
        while left > 0 {
            if let Some(why) = interruption() {
                return Err(self.fail(FailKind::Interrupted, None, why));
            }
            let Some(wait) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
                let k = out.iter().position(Option::is_none).expect("one is missing");
                return Err(self.timed_out(targets[k], what));
            };
            let (k, r) = match rx.recv_timeout(wait.min(POLL)) {
                Ok(got) => got,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => unreachable!("a call thread panicked"),
            };
            let i = targets[k];
            match r {
                Ok(v) => out[k] = Some(v),
                // The socket's own read timeout (EAGAIN, "os error 11") is the same timeout.
                Err(tms_proto::ClientError::Io(e))
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
                {
                    return Err(self.timed_out(i, what));
                }
                Err(e) => {
                    let name = self.workers[i].name.clone();
                    return Err(self.fail(FailKind::Worker, Some(&name), format!("{what}: {e}")));
                }
            }
            left -= 1;
        }
        Ok(out.into_iter().map(|v| v.expect("every answer arrived")).collect())
    }

    /// Sends `method` to each worker in `targets` with its own params, then collects the replies.
    fn call_each(&mut self, targets: &[usize], method: &str, params: Vec<Value>) -> R<Vec<Value>> {
        let deadline = Instant::now() + phase_timeout(&self.cfg);
        let mut ids = Vec::new();
        for (&i, p) in targets.iter().zip(params) {
            let w = &mut self.workers[i];
            w.next_id += 1;
            let id = w.next_id;
            let msg = json!({"id": id, "method": method, "params": p});
            let sent = w.conn.as_mut().expect("connected").send(&msg);
            if let Err(e) = sent {
                let cause = self.exit_cause(i).unwrap_or_else(|| format!("cannot send {method}: {e}"));
                let name = self.workers[i].name.clone();
                return Err(self.fail(FailKind::Crash, Some(&name), cause));
            }
            ids.push(id);
        }
        let mut out = Vec::new();
        for (&i, id) in targets.iter().zip(ids) {
            let name = self.workers[i].name.clone();
            let w = &mut self.workers[i];
            let child = &mut w.child;
            let reply = w.conn.as_mut().expect("connected").recv(Some(deadline), || {
                if let Some(why) = interruption() {
                    return Err(why);
                }
                match child.try_wait() {
                    Ok(Some(status)) => Err(describe_exit(status)),
                    _ => Ok(()),
                }
            });
            let reply = match reply {
                Ok(v) => v,
                Err(wire::ReadError::TimedOut) => return Err(self.timed_out(i, method)),
                Err(wire::ReadError::Abandoned(why)) if interruption().is_some() => {
                    return Err(self.fail(FailKind::Interrupted, None, why));
                }
                Err(wire::ReadError::Abandoned(why)) => return Err(self.fail(FailKind::Crash, Some(&name), why)),
                Err(wire::ReadError::Closed) => {
                    let cause = self.wait_exit_cause(i).unwrap_or_else(|| "closed its connection".into());
                    return Err(self.fail(FailKind::Crash, Some(&name), cause));
                }
                Err(e) => return Err(self.fail(FailKind::Worker, Some(&name), format!("protocol error: {e}"))),
            };
            if reply["id"].as_u64() != Some(id) {
                return Err(self.fail(
                    FailKind::Worker,
                    Some(&name),
                    format!("answered {} to request {id}", reply["id"]),
                ));
            }
            if let Some(err) = reply.get("error") {
                let kind = if err["kind"] == "oom" { FailKind::OutOfMemory } else { FailKind::Worker };
                let msg = err["message"].as_str().unwrap_or("(no message)");
                return Err(self.fail(kind, Some(&name), format!("{method} failed ({}): {msg}", err["kind"])));
            }
            out.push(reply.get("result").cloned().unwrap_or(Value::Null));
        }
        Ok(out)
    }

    fn call_all(&mut self, role: Role, method: &str, params: Value) -> R<Vec<Value>> {
        let targets = self.indices(role);
        let n = targets.len();
        self.call_each(&targets, method, vec![params; n])
    }

    fn exit_cause(&mut self, i: usize) -> Option<String> {
        self.workers[i].child.try_wait().ok().flatten().map(describe_exit)
    }

    fn wait_exit_cause(&mut self, i: usize) -> Option<String> {
        for _ in 0..40 {
            if let Some(c) = self.exit_cause(i) {
                return Some(c);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Runs one timed phase; records its span and the memory at its end.
    fn phase<T>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> R<T>) -> R<T> {
        self.phase = name.to_string();
        let start = self.elapsed();
        let t0 = Instant::now();
        let out = f(self)?;
        let secs = t0.elapsed().as_secs_f64();
        *self.step_times.entry(name.to_string()).or_default() += secs;
        self.sample_memory(start)?;
        Ok(out)
    }

    fn sample_memory(&mut self, start_s: f64) -> R<()> {
        let devices = self.cfg.run.devices as usize;
        let mut s = MemSample {
            t_s: self.elapsed(),
            start_s,
            step: self.step,
            phase: self.phase.clone(),
            device_used: vec![0; devices],
            device_total: vec![0; devices],
            workers: BTreeMap::new(),
            paused: BTreeMap::new(),
        };
        let targets: Vec<usize> = (0..self.workers.len()).filter(|&i| self.workers[i].control.is_some()).collect();
        let statuses = self.control_calls(&targets, "a control status request", tms_proto::status)?;
        for (&i, st) in targets.iter().zip(statuses) {
            let w = &self.workers[i];
            let tags = st.tags.iter().map(|t| (t.tag.clone(), t.bytes_active)).collect();
            s.workers.insert(w.name.clone(), tags);
            s.paused.insert(w.name.clone(), st.tags.iter().map(|t| t.bytes_paused).sum());
            if let Some(d) = st.devices.first() {
                s.device_used[w.rank as usize] = d.total.saturating_sub(d.free);
                s.device_total[w.rank as usize] = d.total;
            }
        }
        let _ = writeln!(self.memory_file, "{}", serde_json::to_string(&s).expect("serializes"));
        self.leak_check(&s)?;
        for (peak, used) in self.peak_used.iter_mut().zip(&s.device_used) {
            *peak = (*peak).max(*used);
        }
        if self.step_memory.first().is_some_and(|f| f.step != s.step) {
            self.step_memory.clear();
        }
        self.step_memory.push(s);
        Ok(())
    }

    fn leak_check(&mut self, s: &MemSample) -> R<()> {
        if !self.cfg.run.checks || s.step == 0 {
            return Ok(());
        }
        let baseline_step = if self.cfg.run.steps >= 2 { 2 } else { 1 };
        if s.step == baseline_step {
            self.leak_baseline.insert(s.phase.clone(), s.device_used.clone());
            return Ok(());
        }
        let tolerance = (self.cfg.run.leak_tolerance_mib * MIB as f64) as u64;
        if let Some(base) = self.leak_baseline.get(&s.phase) {
            for (d, (now, was)) in s.device_used.iter().zip(base).enumerate() {
                if *now > was + tolerance {
                    return Err(self.fail(
                        FailKind::Check,
                        None,
                        format!(
                            "leak check: device {d} uses {} after {} at step {}, {} more than at step {baseline_step} \
                             (tolerance run.leak_tolerance_mib = {})",
                            report::human(*now),
                            s.phase,
                            s.step,
                            report::human(now - was),
                            self.cfg.run.leak_tolerance_mib
                        ),
                    ));
                }
            }
            self.checks_passed += 1;
        }
        Ok(())
    }

    /// Pause or resume `tag` (None: all) in every worker of `role`, in parallel, through the
    /// control sockets; checks each report, and after a pause that free memory rose.
    fn control(&mut self, role: Role, pause: bool, tag: Option<&str>) -> R<Vec<OpReport>> {
        let targets = self.indices(role);
        let verb = if pause { "pause" } else { "resume" };
        let what = tag.map(|t| format!("tag {t:?}")).unwrap_or_else(|| "every tag".into());
        let owned = tag.map(String::from);
        let results = self.control_calls(&targets, &format!("{verb} {what}"), move |path, timeout| {
            if pause {
                tms_proto::pause(path, owned.as_deref(), timeout)
            } else {
                tms_proto::resume(path, owned.as_deref(), timeout)
            }
        })?;
        let mut reports = Vec::new();
        for (&i, report) in targets.iter().zip(results) {
            let name = self.workers[i].name.clone();
            if let Some(err) = &report.error {
                let kind = if err.code == tms_proto::ErrorCode::OutOfMemory {
                    FailKind::OutOfMemory
                } else {
                    FailKind::Worker
                };
                let hint = if kind == FailKind::OutOfMemory && !pause {
                    " (something else holds the device memory this worker needs to wake up: look at the memory timeline)"
                } else {
                    ""
                };
                return Err(self.fail(
                    kind,
                    Some(&name),
                    format!(
                        "{verb} {what}: {err}; {} of {} bytes done{hint}",
                        report.bytes_done,
                        report.bytes_done + report.bytes_failed
                    ),
                ));
            }
            if pause && self.cfg.run.checks {
                let rose = report.device_free_after.saturating_sub(report.device_free_before);
                if rose < report.bytes_done {
                    return Err(self.fail(
                        FailKind::Check,
                        Some(&name),
                        format!(
                            "pause {what} reported {} paused but device free memory rose by only {}",
                            report::human(report.bytes_done),
                            report::human(rose)
                        ),
                    ));
                }
                self.checks_passed += 1;
            }
            reports.push(report);
        }
        Ok(reports)
    }

    fn checksums(&mut self, role: Role) -> R<Vec<String>> {
        let replies = self.call_all(role, "checksum", json!({"step": self.step}))?;
        Ok(replies.iter().map(|r| r["weights"].as_str().unwrap_or("").to_string()).collect())
    }

    /// Every worker of `role` must hold `expected`.
    fn expect_checksum(&mut self, role: Role, expected: &str, when: &str) -> R<()> {
        if !self.cfg.run.checks {
            return Ok(());
        }
        let got = self.checksums(role)?;
        for (i, c) in self.indices(role).into_iter().zip(got) {
            if c != expected {
                let name = self.workers[i].name.clone();
                return Err(self.fail(
                    FailKind::Check,
                    Some(&name),
                    format!("weights checksum {when} is {c}, expected {expected}: the weights were not preserved"),
                ));
            }
            self.checks_passed += 1;
        }
        Ok(())
    }

    fn trainer_checksum(&mut self) -> R<String> {
        let sums = self.checksums(Role::Trainer)?;
        if sums.windows(2).any(|w| w[0] != w[1]) {
            return Err(self.fail(
                FailKind::Check,
                None,
                format!("trainer replicas disagree on their weights: {sums:?}"),
            ));
        }
        Ok(sums[0].clone())
    }

    fn sleep_trainer(&mut self) -> R<()> {
        self.phase("sleep", |r| {
            if !r.cfg.memory.backup {
                r.call_all(Role::Trainer, "save_state", json!({"step": r.step}))?;
            }
            r.control(Role::Trainer, true, None).map(|_| ())
        })
    }

    fn update_weights(&mut self) -> R<()> {
        self.phase("update_weights", |r| {
            let p = json!({"shm": r.shm, "bucket_bytes": r.bucket_bytes, "step": r.step});
            let t = r.call_all(Role::Trainer, "update_begin", p.clone())?;
            r.call_all(Role::Rollout, "update_begin", p)?;
            let buckets = t[0]["buckets"].as_u64().unwrap_or(0);
            let trainers = r.indices(Role::Trainer);
            let rollouts = r.indices(Role::Rollout);
            // One shared bucket file per pair would let pairs run in parallel; pairs take turns
            // here, each bucket packed by the trainer and unpacked by its rollout.
            for (ti, ri) in trainers.into_iter().zip(rollouts) {
                for b in 0..buckets {
                    let q = json!({"bucket": b, "step": r.step});
                    r.call_each(&[ti], "pack", vec![q.clone()])?;
                    r.call_each(&[ri], "unpack", vec![q])?;
                }
            }
            r.call_all(Role::Trainer, "update_end", json!({"step": r.step}))?;
            r.call_all(Role::Rollout, "update_end", json!({"step": r.step}))?;
            Ok(())
        })
    }

    /// Rollout and trainer start, the trainer's initial weights reach the rollout: slime's
    /// colocated startup.
    fn setup(&mut self) -> R<()> {
        let offload = self.cfg.run.offload;
        let per_device = self.cfg.rollout.prompts_per_step / self.cfg.run.devices as usize;
        let max_batch = per_device * self.cfg.rollout.samples_per_prompt;
        let rollout_mem = self.profile.rollout.tags.clone();
        let trainer_mem = self.profile.trainer.tags.clone();
        let init = |r: &Runner, role: Role, mem: &[(String, Vec<u64>)]| -> Vec<Value> {
            r.indices(role)
                .iter()
                .map(|&i| {
                    json!({
                        "api": r.api, "device": r.workers[i].rank, "shape": r.shape, "seed": r.cfg.run.seed,
                        "memory": mem, "backup": r.cfg.memory.backup, "max_batch": max_batch,
                        "loss": r.loss_config(), "adam": r.adam(), "step": 0,
                    })
                })
                .collect()
        };
        self.phase("init_rollout", |r| {
            let p = init(r, Role::Rollout, &rollout_mem);
            let targets = r.indices(Role::Rollout);
            r.call_each(&targets, "init", p)?;
            r.find_control_sockets(Role::Rollout)
        })?;
        if offload {
            self.phase("rollout_offload", |r| r.control(Role::Rollout, true, None).map(|_| ()))?;
        }
        self.phase("init_trainer", |r| {
            let p = init(r, Role::Trainer, &trainer_mem);
            let targets = r.indices(Role::Trainer);
            r.call_each(&targets, "init", p).map_err(|mut e| {
                if e.kind == FailKind::OutOfMemory && !r.cfg.run.offload {
                    e.cause += "; the trainer and the rollout do not fit on the device together: \
                                run with offload (run.offload = true) so the rollout sleeps first";
                }
                e
            })?;
            r.find_control_sockets(Role::Trainer)
        })?;
        self.hand_weights_to_rollout("on the rollout after the initial update_weights")
    }

    /// The second half of every step (and of setup): record the trainer's weights, put it to
    /// sleep, wake the rollout's weights, push the trainer's into them and check they arrived,
    /// then wake the KV cache last so the peak stays low.
    fn hand_weights_to_rollout(&mut self, when: &str) -> R<()> {
        let offload = self.cfg.run.offload;
        let sum = self.trainer_checksum()?;
        self.weights_checksum = Some(sum.clone());
        if offload {
            self.sleep_trainer()?;
            self.phase("onload_weights", |r| r.control(Role::Rollout, false, Some("weights")).map(|_| ()))?;
        }
        self.update_weights()?;
        self.expect_checksum(Role::Rollout, &sum, when)?;
        if offload {
            self.phase("onload_kv", |r| {
                r.control(Role::Rollout, false, Some("kv_cache"))?;
                r.control(Role::Rollout, false, Some("cuda_graph")).map(|_| ())
            })?;
        }
        Ok(())
    }

    fn find_control_sockets(&mut self, role: Role) -> R<()> {
        for i in self.indices(role) {
            let pid = self.workers[i].pid;
            let found = tms_proto::list_sockets(&self.ctl_dir).into_iter().find(|s| s.pid == pid);
            match found {
                Some(s) => self.workers[i].control = Some(s.path),
                None => {
                    let name = self.workers[i].name.clone();
                    return Err(self.fail(
                        FailKind::Setup,
                        Some(&name),
                        format!(
                            "no tms control socket for pid {pid} in {} after init: is libtms_hook.so preloaded in the \
                             worker and did it allocate inside a region?",
                            self.ctl_dir.display()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn loss_config(&self) -> model::LossConfig {
        let a = &self.cfg.algo;
        let ppo = a.name == AlgoName::Ppo;
        model::LossConfig {
            clip: algo::Clip {
                eps_low: a.clip_eps_low,
                eps_high: a.clip_eps_high,
                dual: (a.dual_clip > 1.0).then_some(a.dual_clip),
            },
            // PPO puts the KL in the token reward; GRPO in the loss.
            kl_coef: if ppo { 0.0 } else { a.kl_coef },
            kl_kind: a.kl_type,
            entropy_coef: a.entropy_coef,
            aggregation: a.aggregation,
            value_coef: if ppo { a.value_coef } else { 0.0 },
            value_clip: a.value_clip,
            temperature: self.cfg.rollout.temperature,
        }
    }

    fn adam(&self) -> model::Adam {
        model::Adam {
            lr: self.cfg.algo.lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            max_grad_norm: self.cfg.algo.max_grad_norm,
        }
    }

    fn rl_step(&mut self, rng: &mut Rng) -> R<()> {
        self.step_times.clear();
        let wall = Instant::now();
        let offload = self.cfg.run.offload;
        let cfg = self.cfg.clone();
        let n = cfg.rollout.samples_per_prompt;
        let prompts: Vec<Vec<u32>> = (0..cfg.rollout.prompts_per_step)
            .map(|_| {
                let lim = self.task.operand_limit();
                self.task.prompt(rng.below(lim), rng.below(lim))
            })
            .collect();
        // generate: each rollout takes a contiguous shard, so groups stay contiguous.
        let samples = self.phase("generate", |r| {
            let rollouts = r.indices(Role::Rollout);
            let shard = prompts.len() / rollouts.len();
            let params = rollouts
                .iter()
                .enumerate()
                .map(|(k, _)| {
                    json!({
                        "prompts": prompts[k * shard..(k + 1) * shard], "n": n,
                        "max_new_tokens": r.task.max_new_tokens(), "temperature": cfg.rollout.temperature,
                        "eos": task::EOS, "seed": cfg.run.seed.wrapping_mul(1_000_003) ^ (r.step << 8) ^ k as u64,
                        "step": r.step,
                    })
                })
                .collect();
            let replies = r.call_each(&rollouts, "generate", params)?;
            let mut all = Vec::new();
            for (k, rep) in replies.iter().enumerate() {
                let list = rep["samples"].as_array().cloned().unwrap_or_default();
                if list.len() != shard * n {
                    return Err(r.fail(
                        FailKind::Worker,
                        None,
                        format!("generate returned {} samples, expected {}", list.len(), shard * n),
                    ));
                }
                for s in list {
                    let pi = s["prompt_index"].as_u64().unwrap_or(u64::MAX) as usize;
                    let resp: Vec<u32> = serde_json::from_value(s["response"].clone()).unwrap_or_default();
                    let lps: Vec<f64> = serde_json::from_value(s["logprobs"].clone()).unwrap_or_default();
                    if pi >= shard || resp.is_empty() || lps.len() != resp.len() {
                        return Err(r.fail(FailKind::Worker, None, "generate returned a malformed sample"));
                    }
                    all.push((prompts[k * shard + pi].clone(), resp, lps));
                }
            }
            Ok(all)
        })?;
        let scored: Vec<(f64, bool)> =
            samples.iter().map(|(p, resp, _)| self.task.score(p, resp, cfg.task.reward)).collect();
        if offload {
            self.phase("rollout_offload", |r| r.control(Role::Rollout, true, None).map(|_| ()))?;
            self.phase("wake_up", |r| {
                r.control(Role::Trainer, false, None)?;
                if !r.cfg.memory.backup {
                    r.call_all(Role::Trainer, "load_state", json!({"step": r.step}))?;
                }
                Ok(())
            })?;
            let expected = self.weights_checksum.clone().unwrap_or_default();
            self.expect_checksum(Role::Trainer, &expected, "after wake_up")?;
        }
        let pairs: Vec<Value> = samples.iter().map(|(p, r, _)| json!({"prompt": p, "response": r})).collect();
        let ref_lp = self.phase("ref_log_probs", |r| {
            r.call_all(Role::Trainer, "log_probs", json!({"model": "ref", "samples": pairs, "step": r.step}))
        })?;
        let old = self.phase("log_probs", |r| {
            r.call_all(Role::Trainer, "log_probs", json!({"model": "actor", "samples": pairs, "step": r.step}))
        })?;
        let to_vecs =
            |v: &Value, key: &str| -> Vec<Vec<f64>> { serde_json::from_value(v[key].clone()).unwrap_or_default() };
        let ref_lp = to_vecs(&ref_lp[0], "logprobs");
        let old_lp = to_vecs(&old[0], "logprobs");
        let entropy = to_vecs(&old[0], "entropy");
        if ref_lp.len() != samples.len() || old_lp.len() != samples.len() {
            return Err(self.fail(FailKind::Worker, None, "log_probs returned the wrong number of sequences"));
        }
        let values = if cfg.algo.name == AlgoName::Ppo {
            let v = self
                .phase("values", |r| r.call_all(Role::Trainer, "values", json!({"samples": pairs, "step": r.step})))?;
            to_vecs(&v[0], "values")
        } else {
            Vec::new()
        };
        let rewards: Vec<f64> = scored.iter().map(|s| s.0).collect();
        let (advantages, returns, kl_ref) = self.phase("advantages", |r| {
            let kl_tok: Vec<Vec<f64>> = old_lp
                .iter()
                .zip(&ref_lp)
                .map(|(o, f)| o.iter().zip(f).map(|(a, b)| algo::kl(*a, *b, cfg.algo.kl_type).0).collect())
                .collect();
            let kl_mean = mean(kl_tok.iter().flatten().copied());
            let (adv, ret) = match cfg.algo.name {
                AlgoName::Grpo => {
                    let a = algo::grpo_advantages(&rewards, n, cfg.algo.dr_grpo);
                    (samples.iter().zip(&a).map(|((_, resp, _), a)| vec![*a; resp.len()]).collect(), Vec::new())
                }
                AlgoName::Ppo => {
                    if values.len() != samples.len() {
                        return Err(r.fail(FailKind::Worker, None, "values returned the wrong number of sequences"));
                    }
                    let mut advs = Vec::new();
                    let mut rets = Vec::new();
                    for i in 0..samples.len() {
                        let tr = algo::ppo_token_rewards(rewards[i], &kl_tok[i], cfg.algo.kl_coef);
                        let (a, rt) = algo::gae(&tr, &values[i], cfg.algo.gamma, cfg.algo.lambda);
                        advs.push(a);
                        rets.push(rt);
                    }
                    if cfg.algo.whiten_advantages {
                        algo::whiten(&mut advs);
                    }
                    (advs, rets)
                }
            };
            Ok((adv, ret, kl_mean))
        })?;
        let train_samples: Vec<model::TrainSample> = (0..samples.len())
            .map(|i| model::TrainSample {
                prompt: samples[i].0.clone(),
                response: samples[i].1.clone(),
                advantages: advantages[i].clone(),
                old_logprobs: old_lp[i].clone(),
                ref_logprobs: ref_lp[i].clone(),
                returns: returns.get(i).cloned().unwrap_or_default(),
                old_values: values.get(i).cloned().unwrap_or_default(),
            })
            .collect();
        let train = self.phase("actor_train", |r| {
            r.call_all(
                Role::Trainer,
                "train",
                json!({"samples": train_samples, "minibatches": cfg.algo.minibatches, "epochs": cfg.algo.epochs, "step": r.step}),
            )
        })?;
        self.hand_weights_to_rollout("on the rollout after update_weights")?;

        // Metrics of the step.
        let t = |k: &str| self.step_times.get(k).copied().unwrap_or(0.0);
        let train_time = t("ref_log_probs") + t("log_probs") + t("values") + t("advantages") + t("actor_train");
        let step_time: f64 = self.step_times.values().sum();
        let mut m: BTreeMap<String, Value> = BTreeMap::new();
        m.insert("step".into(), json!(self.step));
        for (k, v) in &self.step_times {
            m.insert(format!("perf/{k}_time"), json!(v));
        }
        m.insert("perf/train_time".into(), json!(train_time));
        m.insert("perf/train_wait_time".into(), json!(step_time - train_time));
        m.insert("perf/step_time".into(), json!(step_time));
        m.insert("perf/wall_step_time".into(), json!(wall.elapsed().as_secs_f64()));
        m.insert("rollout/reward_mean".into(), json!(mean(rewards.iter().copied())));
        m.insert("rollout/pass_rate".into(), json!(mean(scored.iter().map(|s| f64::from(u8::from(s.1))))));
        m.insert("rollout/response_length".into(), json!(mean(samples.iter().map(|s| s.1.len() as f64))));
        let lp_diff = samples
            .iter()
            .zip(&old_lp)
            .flat_map(|((_, _, r), o)| r.iter().zip(o).map(|(a, b)| (a - b).abs()))
            .fold(0.0, f64::max);
        m.insert("rollout/logprob_abs_diff_max".into(), json!(lp_diff));
        m.insert("train/kl_ref".into(), json!(kl_ref));
        m.insert("train/entropy_old".into(), json!(mean(entropy.iter().flatten().copied())));
        if let Some(obj) = train[0].as_object() {
            for (k, v) in obj {
                m.insert(format!("train/{k}"), v.clone());
            }
        }
        m.insert(
            "memory".into(),
            json!(
                self.step_memory
                    .iter()
                    .filter(|s| s.step == self.step)
                    .map(|s| (s.phase.clone(), json!({"device_used": s.device_used, "workers": s.workers})))
                    .collect::<BTreeMap<_, _>>()
            ),
        );
        let _ = writeln!(self.metrics_file, "{}", serde_json::to_string(&m).expect("serializes"));
        let _ = self.metrics_file.flush();
        self.progress.step(self.step, self.cfg.run.steps, &m);
        self.steps_completed += 1;
        Ok(())
    }

    fn stop_workers(&mut self, graceful: bool) {
        if graceful {
            for i in 0..self.workers.len() {
                let w = &mut self.workers[i];
                if let Some(c) = w.conn.as_mut() {
                    w.next_id += 1;
                    let _ = c.send(&json!({"id": w.next_id, "method": "shutdown", "params": {}}));
                }
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && self.workers.iter_mut().any(|w| matches!(w.child.try_wait(), Ok(None))) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        for w in &mut self.workers {
            if matches!(w.child.try_wait(), Ok(None)) {
                // Each worker leads its own process group, so a shell wrapper's children go too.
                // A stopped process keeps SIGTERM pending until it continues: SIGCONT lets a
                // frozen worker end now rather than at the SIGKILL 3 s later.
                // SAFETY: signalling a process group we created.
                unsafe {
                    libc::kill(-(w.child.id() as i32), libc::SIGTERM);
                    libc::kill(-(w.child.id() as i32), libc::SIGCONT);
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline && self.workers.iter_mut().any(|w| matches!(w.child.try_wait(), Ok(None))) {
            std::thread::sleep(Duration::from_millis(20));
        }
        for w in &mut self.workers {
            if matches!(w.child.try_wait(), Ok(None)) {
                // SAFETY: as above.
                unsafe { libc::kill(-(w.child.id() as i32), libc::SIGKILL) };
                let _ = w.child.wait();
            }
            w.conn = None;
        }
        // A killed worker cannot remove its control socket; the folder is ours alone.
        for s in tms_proto::list_sockets(&self.ctl_dir) {
            let _ = std::fs::remove_file(s.path);
        }
    }
}

fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (_, Some(s)) => format!("was killed by signal {s} ({})", signal_name(s)),
        _ => "exited".into(),
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGABRT => "SIGABRT: it aborted",
        libc::SIGSEGV => "SIGSEGV: it crashed",
        libc::SIGKILL => "SIGKILL: out of host memory or killed",
        libc::SIGTERM => "SIGTERM",
        libc::SIGBUS => "SIGBUS",
        _ => "signal",
    }
}

fn mean(it: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = it.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}

fn utc_stamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

fn make_run_dir(cfg: &Config) -> Result<PathBuf, String> {
    let dir = if cfg.run.out.is_empty() {
        let base = PathBuf::from("runs").join(format!("run-{}", utc_stamp()));
        let mut d = base.clone();
        let mut k = 2;
        while d.exists() {
            d = PathBuf::from(format!("{}-{k}", base.display()));
            k += 1;
        }
        d
    } else {
        PathBuf::from(&cfg.run.out)
    };
    std::fs::create_dir_all(dir.join("logs")).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

/// Starts one worker under the hook and waits for its hello.
fn spawn_worker(
    cfg: &Config,
    role: Role,
    rank: u32,
    env: &[(String, String)],
    sock_dir: &Path,
    run_dir: &Path,
) -> Result<Worker, RunError> {
    let name = format!("{}-{rank}", role.as_str());
    let sock = sock_dir.join(format!("{name}.sock"));
    let listener =
        UnixListener::bind(&sock).map_err(|e| setup_err(format!("cannot listen on {}: {e}", sock.display())))?;
    listener.set_nonblocking(true).map_err(|e| setup_err(e.to_string()))?;
    let log = run_dir.join("logs").join(format!("{name}.log"));
    let file = std::fs::File::create(&log).map_err(|e| setup_err(format!("cannot create {}: {e}", log.display())))?;
    let external = match role {
        Role::Trainer => &cfg.run.trainer_cmd,
        Role::Rollout => &cfg.run.rollout_cmd,
    };
    let mut cmd = if external.is_empty() {
        let mut c = Command::new(std::env::current_exe().map_err(|e| setup_err(e.to_string()))?);
        c.args(["worker", role.as_str()]);
        c
    } else {
        let mut c = Command::new("/bin/sh");
        c.args(["-c", external]);
        c
    };
    cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("TMS_NAME", &name)
        .env("RELAX_WORKER_SOCKET", &sock)
        .env("RELAX_ROLE", role.as_str())
        .env("RELAX_RANK", rank.to_string())
        .env("RELAX_DEVICE", rank.to_string())
        .env("RELAX_RUN_DIR", run_dir)
        .stdin(Stdio::null())
        .stdout(file.try_clone().map_err(|e| setup_err(e.to_string()))?)
        .stderr(file);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().map_err(|e| setup_err(format!("cannot start {name}: {e}")))?;
    let deadline = Instant::now() + phase_timeout(cfg);
    let fail = |child: &mut Child, cause: String| {
        let _ = child.kill();
        let _ = child.wait();
        let kind = if interruption().is_some() { FailKind::Interrupted } else { FailKind::Setup };
        RunError { kind, step: 0, phase: "start".into(), worker: Some(name.clone()), cause }
    };
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(fail(&mut child, format!("accept: {e}"))),
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(RunError {
                kind: FailKind::Crash,
                step: 0,
                phase: "start".into(),
                worker: Some(name.clone()),
                cause: format!("{} before connecting", describe_exit(status)),
            });
        }
        if let Some(why) = interruption() {
            return Err(fail(&mut child, why));
        }
        if Instant::now() > deadline {
            return Err(fail(&mut child, format!("did not connect to {} in time", sock.display())));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = stream.set_nonblocking(false);
    let mut conn = wire::Conn::new(stream).map_err(|e| setup_err(e.to_string()))?;
    let hello = match conn.recv(Some(deadline), || interruption().map_or(Ok(()), Err)) {
        Ok(h) => h,
        Err(wire::ReadError::Abandoned(why)) => return Err(fail(&mut child, why)),
        Err(e) => return Err(fail(&mut child, format!("no hello: {e}"))),
    };
    let h = &hello["hello"];
    if h["protocol"].as_u64() != Some(wire::PROTOCOL) || h["role"] != role.as_str() {
        return Err(fail(
            &mut child,
            format!("bad hello {hello}: expected protocol {} and role {}", wire::PROTOCOL, role.as_str()),
        ));
    }
    let pid = h["pid"].as_u64().unwrap_or(child.id() as u64) as u32;
    Ok(Worker { name, role, rank, child, conn: Some(conn), pid, log, control: None, next_id: 0 })
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs the configured job; returns the process exit code.
pub fn run(opts: &Options) -> u8 {
    let cfg = match config::load(opts.config.as_deref(), &opts.sets) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("relax-colocate run: {e}");
            return 2;
        }
    };
    // SAFETY: installing an async-signal-safe handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let run_dir = match make_run_dir(&cfg) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("relax-colocate run: {e}");
            return 1;
        }
    };
    let mut runner = match start(&cfg, opts, run_dir.clone()) {
        Ok(r) => r,
        Err(e) => {
            report_failure(&e, None, &run_dir);
            return e.kind.exit_code();
        }
    };
    let result = drive(&mut runner);
    let graceful = result.is_ok();
    runner.stop_workers(graceful);
    runner.progress.finish();
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

fn report_failure(e: &RunError, runner: Option<&Runner>, run_dir: &Path) {
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
    if runner.is_none() {
        // The workers never got going: the summary says why, for scripts that read it.
        let summary = json!({
            "status": if e.kind == FailKind::Interrupted { "interrupted" } else { "failed" },
            "failure": {"kind": e.kind.as_str(), "step": e.step, "phase": e.phase, "worker": e.worker, "cause": e.cause},
            "steps_completed": 0,
        });
        let _ =
            std::fs::write(run_dir.join("summary.json"), serde_json::to_string_pretty(&summary).expect("serializes"));
    }
    eprintln!("partial results: {}", run_dir.display());
}

fn start(cfg: &Config, opts: &Options, run_dir: PathBuf) -> R<Runner> {
    let device = match cfg.run.device {
        DeviceChoice::Auto if can_load(c"libcuda.so.1") => DeviceChoice::Cuda,
        DeviceChoice::Auto => DeviceChoice::Sim,
        d => d,
    };
    if device == DeviceChoice::Cuda && !can_load(c"libcuda.so.1") {
        return Err(setup_err("--device cuda: libcuda.so.1 cannot be loaded here; use --device sim"));
    }
    if device == DeviceChoice::Npu && !can_load(c"libascendcl.so") {
        return Err(setup_err(
            "--device npu: libascendcl.so cannot be loaded; source CANN's set_env.sh or use --device sim",
        ));
    }
    let hook = find_hook(opts.hook.as_deref()).map_err(setup_err)?;
    // The simulator serves both runtimes; sim.api picks the one the workers use.
    let api: &'static str = match device {
        DeviceChoice::Npu => "acl",
        DeviceChoice::Sim if cfg.sim.api == "acl" => "acl",
        _ => "cuda",
    };
    let task = Addition { digits: cfg.task.digits };
    let shape =
        model::Shape { vocab: VOCAB, context: task.prompt_len() + task.max_new_tokens() - 1, hidden: cfg.model.hidden };
    let profile = profile::build(&cfg.memory.profile, cfg.memory.tp, cfg.memory.scale, cfg.memory.kv_cache_gib)
        .map_err(setup_err)?;
    let bucket_bytes = config::parse_size(&cfg.memory.update_weight_buffer_size).map_err(setup_err)?;
    let fp = footprint(cfg, &shape, &profile, bucket_bytes);
    let shm_dir = Path::new("/dev/shm");
    let mut swept = tmpfiles::sweep(&std::env::temp_dir(), tmpfiles::DIR_PREFIX);
    swept.extend(tmpfiles::sweep(shm_dir, tmpfiles::BUCKET_PREFIX));
    let owner = tmpfiles::owner_tag();
    let tmp = tempfile::Builder::new()
        .prefix(&format!("{}{owner}", tmpfiles::DIR_PREFIX))
        .tempdir()
        .map_err(|e| setup_err(e.to_string()))?;
    let ctl_dir = tmp.path().join("ctl");
    let sock_dir = tmp.path().join("w");
    for d in [&ctl_dir, &sock_dir] {
        std::fs::create_dir_all(d).map_err(|e| setup_err(e.to_string()))?;
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700));
    }
    let mut env: Vec<(String, String)> = vec![
        ("LD_PRELOAD".into(), hook.display().to_string()),
        ("TMS_CONTROL".into(), "1".into()),
        ("TMS_CONTROL_DIR".into(), ctl_dir.display().to_string()),
        ("RELAX_DEVICE_API".into(), api.into()),
    ];
    let mut device_label = match device {
        DeviceChoice::Cuda => "CUDA".to_string(),
        DeviceChoice::Npu => "Ascend NPU (ACL)".to_string(),
        _ => String::new(),
    };
    if device == DeviceChoice::Sim {
        let per_device_at = |scale: f64| {
            let p = profile::build(&cfg.memory.profile, cfg.memory.tp, scale, cfg.memory.kv_cache_gib).ok()?;
            let f = footprint(cfg, &shape, &p, bucket_bytes);
            Some(f.trainer + f.rollout)
        };
        check_host_memory_for_sim(cfg, fp.trainer + fp.rollout, per_device_at)
            .map_err(|cause| RunError { kind: FailKind::Config, ..setup_err(cause) })?;
        let sim_env = sim_environment().map_err(setup_err)?;
        let peak = fp.trainer.max(fp.rollout).max(fp.rollout_weights + 2 * fp.transfer);
        // Each device holds two processes, and each process's context takes device memory.
        let contexts = 2 * sim_context_bytes(api);
        let capacity = if cfg.sim.memory == "auto" {
            round_up(peak + contexts + (fp.trainer.min(fp.rollout) / 2).min(64 * MIB), GRANULARITY)
        } else {
            let explicit = config::parse_size(&cfg.sim.memory).map_err(setup_err)?;
            // The simulator would replace a capacity under its granularity by its 16 GiB default,
            // and a device without room for both contexts fails every worker's first call.
            if explicit < contexts + GRANULARITY {
                return Err(setup_err(format!(
                    "sim.memory={} leaves no room on the device: the trainer's and the rollout's \
                     contexts take {} of it; give at least {} (or sim.memory=auto)",
                    cfg.sim.memory,
                    report::human(contexts),
                    report::human(contexts + GRANULARITY)
                )));
            }
            explicit
        };
        // Python workers (scripts/torch_worker.py) get the start-up hook that puts PyTorch on
        // the simulator with the rest of the environment.
        env.extend(sim_env.vars);
        env.extend([
            ("TMS_SIM_DIR".into(), tmp.path().join("sim").display().to_string()),
            ("TMS_SIM_NODE".into(), "relax".into()),
            ("TMS_SIM_MEMORY".into(), capacity.to_string()),
            ("TMS_SIM_DEVICES".into(), cfg.run.devices.to_string()),
        ]);
        if cfg.sim.copy_gbps > 0.0 {
            env.push(("TMS_SIM_COPY_GBPS".into(), cfg.sim.copy_gbps.to_string()));
        }
        device_label = format!(
            "tms-sim ({} API), {} x {} (trainer needs {}, rollout {}, their contexts {})",
            if api == "acl" { "ACL" } else { "CUDA" },
            cfg.run.devices,
            report::human(capacity),
            report::human(fp.trainer),
            report::human(fp.rollout),
            report::human(contexts)
        );
    }
    std::fs::write(run_dir.join("config.toml"), cfg.to_toml()).map_err(|e| setup_err(e.to_string()))?;
    let open = |name: &str| std::fs::File::create(run_dir.join(name)).map_err(|e| setup_err(e.to_string()));
    let metrics_file = open("metrics.jsonl")?;
    let memory_file = open("memory.jsonl")?;
    let shm_dir = if shm_dir.is_dir() { shm_dir.to_path_buf() } else { tmp.path().to_path_buf() };
    let shm = tempfile::Builder::new()
        .prefix(&format!("{}{owner}", tmpfiles::BUCKET_PREFIX))
        .tempfile_in(&shm_dir)
        .map_err(|e| setup_err(format!("cannot create the update bucket file in {}: {e}", shm_dir.display())))?;
    shm.as_file().set_len(fp.transfer.max(4096)).map_err(|e| setup_err(e.to_string()))?;
    let (_, shm_path) = shm.keep().map_err(|e| setup_err(e.to_string()))?;
    let progress = report::Progress::new(opts.quiet || opts.json);
    if !swept.is_empty() {
        progress.note(&format!(
            "relax-colocate run: removed {} temp/shared-memory file(s) of runs that are gone: {}",
            swept.len(),
            swept.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ));
    }
    progress.note(&format!(
        "relax-colocate run: {} {} steps on {device_label}; run directory {}",
        match cfg.algo.name {
            AlgoName::Grpo => "GRPO",
            AlgoName::Ppo => "PPO",
        },
        cfg.run.steps,
        run_dir.display()
    ));
    let mut workers = Vec::new();
    let mut runner_err = None;
    'spawn: for rank in 0..cfg.run.devices {
        for role in [Role::Rollout, Role::Trainer] {
            match spawn_worker(cfg, role, rank, &env, &sock_dir, &run_dir) {
                Ok(w) => workers.push(w),
                Err(e) => {
                    runner_err = Some(e);
                    break 'spawn;
                }
            }
        }
    }
    let runner = Runner {
        cfg: cfg.clone(),
        task,
        shape,
        profile,
        started: Instant::now(),
        workers,
        _tmp: tmp,
        ctl_dir,
        run_dir,
        api,
        step: 0,
        phase: "setup".into(),
        step_memory: Vec::new(),
        step_times: BTreeMap::new(),
        steps_completed: 0,
        peak_used: vec![0; cfg.run.devices as usize],
        metrics_file,
        memory_file,
        shm: shm_path,
        bucket_bytes,
        weights_checksum: None,
        leak_baseline: BTreeMap::new(),
        progress,
        device_label,
        checks_passed: 0,
    };
    if let Some(e) = runner_err {
        let mut r = runner;
        r.stop_workers(false);
        return Err(e);
    }
    Ok(runner)
}

impl Drop for Runner {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.shm);
    }
}

/// Device memory a process's context takes on tms-sim: its `TMS_SIM_CONTEXT_MEMORY`, else the
/// simulator's defaults (300 MiB on the CUDA API, 200 MiB on ACL; docs/simulator.md).
fn sim_context_bytes(api: &str) -> u64 {
    let default = if api == "acl" { 200 * MIB } else { 300 * MIB };
    match std::env::var("TMS_SIM_CONTEXT_MEMORY") {
        Ok(v) if v.trim() == "0" => 0,
        Ok(v) => config::parse_size(&v).unwrap_or(default),
        Err(_) => default,
    }
}

/// The simulator keeps device memory in host memory: a run whose trainer and rollout bytes do not
/// fit in what the host has available would end with the kernel's OOM killer (possibly another
/// process), a minute in. Refuse it up front and say how to scale it down.
fn check_host_memory_for_sim(
    cfg: &Config,
    per_device: u64,
    per_device_at_scale: impl Fn(f64) -> Option<u64>,
) -> Result<(), String> {
    let Some(available) = host_memory_available() else { return Ok(()) };
    let devices = cfg.run.devices as u64;
    let needed = per_device.saturating_mul(devices);
    // Leave room for the processes themselves, backups in flight and the rest of the machine.
    let usable = available / 10 * 8;
    if needed <= usable {
        return Ok(());
    }
    // Parts of a profile do not scale, so look for a scale that fits rather than divide.
    let mut fits = (cfg.memory.scale * usable as f64 / needed as f64 * 100.0).floor() / 100.0;
    while fits > 0.01 && per_device_at_scale(fits).is_none_or(|b| b.saturating_mul(devices) > usable) {
        fits = ((fits * 0.9) * 100.0).floor() / 100.0;
    }
    let m = &cfg.memory;
    // Name the key that made the run this large: an explicit KV cache size, else the profile.
    let what = if m.kv_cache_gib > 0.0 {
        format!("memory.kv_cache_gib = {} sizes a {} GiB KV cache per device", m.kv_cache_gib, m.kv_cache_gib)
    } else {
        format!("memory.profile = {:?} with memory.tp = {} at memory.scale = {}", m.profile, m.tp, m.scale)
    };
    let kv = if m.kv_cache_gib > 0.0 { "lower memory.kv_cache_gib, or " } else { "" };
    let fewer = if devices > 1 { ", or use fewer --devices" } else { "" };
    Err(format!(
        "{what}: on the simulator device memory is host memory, and this run needs about {} ({} device(s) \
         x trainer + rollout) while the host has {} available. Fix: {kv}scale the profile down with \
         --set memory.scale={:.2}{fewer}",
        report::human(needed),
        cfg.run.devices,
        report::human(available),
        fits.max(0.01),
    ))
}

/// `MemAvailable` from /proc/meminfo, in bytes.
fn host_memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
