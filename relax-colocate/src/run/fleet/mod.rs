//! The worker fleet: the workers' processes and connections, requests to them over the worker
//! protocol, pause/resume/status through their tms control sockets, supervision (every wait
//! bounded by run.phase_timeout_s and interruptible, supervise.rs) and stopping them. The local
//! launcher starts the workers as children (local.rs), the Ray launcher through a bridge (ray.rs);
//! the run's temp and bucket files are tmpfiles.rs's. Drivers use the fleet without knowing which
//! launcher started it.

pub(super) mod local;
pub(super) mod ray;
pub(super) mod ray_python;
mod supervise;
mod together;
pub(super) use together::call_together;

pub(super) use supervise::InFlight;
pub(super) mod tmpfiles;

use super::config::{Config, DeviceChoice, Mode};
use super::{Cursor, FailKind, R, Role, RunError, wire};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::rc::Rc;
use tmpfiles::Scratch;
use tms_proto::{OpReport, Status};

/// A worker's process as the runner sees it.
pub(super) enum Proc {
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

pub(super) struct Worker {
    pub(super) name: String,
    pub(super) role: Role,
    /// Elastic mode: a rollout engine on a trainer's device, awake only while the trainer lends it.
    pub(super) lent: bool,
    /// Global rank: the device's index in the run (node-major), and the worker's metrics column.
    pub(super) rank: u32,
    /// The device index on the worker's own node.
    pub(super) device: u32,
    pub(super) proc: Proc,
    pub(super) conn: Option<wire::Conn>,
    /// The process that said hello (the one the hook is loaded in; an external command may be a
    /// shell around it).
    pub(super) pid: u32,
    /// The weight transports beyond host the worker said it speaks in its hello.
    pub(super) transports: Vec<String>,
    pub(super) log: PathBuf,
    pub(super) control: Option<PathBuf>,
    /// Launcher ray: the bridge's socket that carries control requests to the worker's own one.
    pub(super) control_relay: Option<PathBuf>,
    pub(super) next_id: u64,
}

/// One worker's tms status, for the memory sample at a phase boundary.
pub(super) struct WorkerStatus {
    pub(super) name: String,
    pub(super) rank: u32,
    pub(super) status: Status,
}

pub(super) struct Fleet {
    workers: Vec<Worker>,
    /// Launcher ray: the process that placed the workers and carries their messages.
    bridge: Option<ray::Bridge>,
    /// The sockets, the control folder, the simulator state and the bucket file; removed on drop.
    scratch: Scratch,
    /// run.phase_timeout_s: every wait on a worker ends by then.
    timeout_s: f64,
    at: Rc<Cursor>,
}

/// One worker's place: its device (the rank, node-major) and role, and whether it is elastic
/// mode's lent engine on a trainer's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Placement {
    pub(super) rank: u32,
    pub(super) role: Role,
    pub(super) lent: bool,
}

impl Placement {
    /// The worker's name: its role and rank; a lent engine says so, its device being a trainer's.
    pub(super) fn name(&self) -> String {
        let lent = if self.lent { "lent-" } else { "" };
        format!("{lent}{}-{}", self.role.as_str(), self.rank)
    }
}

/// Which worker runs on which device, in start order: colocate mode puts a rollout and a trainer
/// on every device, async mode one role per device as run.trainer_devices and
/// run.rollout_devices say, and elastic mode adds a lent rollout engine beside every trainer.
pub(super) fn placements(cfg: &Config) -> Vec<Placement> {
    let at = |rank, role, lent| Placement { rank, role, lent };
    match cfg.mode_layout() {
        Ok(Some(split)) => {
            let lent = cfg.run.mode == Mode::Elastic;
            let mut v: Vec<Placement> = split.rollout.iter().map(|&d| at(d, Role::Rollout, false)).collect();
            // The lent engine starts before the trainer, as colocate's rollout does: it sleeps
            // before the trainer takes the device's memory.
            v.extend(split.trainer.iter().filter(|_| lent).map(|&d| at(d, Role::Rollout, true)));
            v.extend(split.trainer.iter().map(|&d| at(d, Role::Trainer, false)));
            // elastic.lend_rollout: a lent trainer beside every engine, started (and put to
            // sleep) before it for the same reason.
            let lend_rollout = lent && cfg.elastic.lend_rollout;
            v.extend(split.rollout.iter().filter(|_| lend_rollout).map(|&d| at(d, Role::Trainer, true)));
            v.sort_by_key(|p| p.rank);
            v
        }
        _ => (0..cfg.total_devices() as u32)
            .flat_map(|d| [at(d, Role::Rollout, false), at(d, Role::Trainer, false)])
            .collect(),
    }
}

impl Fleet {
    fn new(cfg: &Config, workers: Vec<Worker>, bridge: Option<ray::Bridge>, scratch: Scratch, at: Rc<Cursor>) -> Fleet {
        Fleet { workers, bridge, scratch, timeout_s: cfg.run.phase_timeout_s, at }
    }

    /// Starts every worker with the run's launcher, each up to its hello. A worker that cannot
    /// start fails the launch, and those started before it are stopped.
    pub(super) fn launch(
        cfg: &Config,
        ray_python: Option<&ray_python::RayPython>,
        device: DeviceChoice,
        env: &[(String, String)],
        scratch: Scratch,
        run_dir: &Path,
        at: Rc<Cursor>,
    ) -> R<Fleet> {
        let mut fleet = Fleet::new(cfg, Vec::new(), None, scratch, at);
        // The plan chose a Python for Ray exactly when the launcher is Ray's.
        let started = if let Some(python) = ray_python {
            let s = &fleet.scratch;
            ray::start_workers(cfg, python, device, env, s.tmp.path(), run_dir, (&s.shm, s.shm_bytes))
                .map(|(workers, bridge)| (fleet.workers, fleet.bridge) = (workers, Some(bridge)))
        } else {
            fleet.start_local(cfg, env, run_dir)
        };
        match started {
            Ok(()) => Ok(fleet),
            Err(e) => {
                fleet.stop(false);
                Err(e)
            }
        }
    }

    /// Starts the workers `placements` names, in its order, as children.
    fn start_local(&mut self, cfg: &Config, env: &[(String, String)], run_dir: &Path) -> R<()> {
        for place in placements(cfg) {
            let w = local::spawn_worker(cfg, place, env, &self.scratch.sock_dir, run_dir)?;
            self.workers.push(w);
        }
        Ok(())
    }

    fn fail(&self, kind: FailKind, worker: Option<&str>, cause: impl Into<String>) -> RunError {
        let mut cause = cause.into();
        if let Some(outside) = worker.and_then(|name| self.outside_request(name)) {
            cause.push_str(&format!("; before it, its memory was driven from outside the run: {outside}"));
        }
        self.at.fail(kind, worker, cause)
    }

    /// The last pause, resume or set that a worker's hook logged as coming from someone other
    /// than the runner (`tms-ctl --force`, a script): the likely cause of a failure that follows
    /// (memory paused under a step dies with 700, illegal address).
    fn outside_request(&self, name: &str) -> Option<String> {
        let w = self.workers.iter().find(|w| w.name == name)?;
        let log = std::fs::read_to_string(&w.log).ok()?;
        let line =
            log.lines().rev().find(|l| l.contains("tms: control request from") && !l.contains(", the manager:"))?;
        Some(line.split("tms: ").nth(1).unwrap_or(line).trim().to_string())
    }

    /// The workers of `role`, as indices into the fleet; elastic mode's lent engines are not
    /// among the rollouts (they sleep but while lent, and get their weights on their own).
    pub(super) fn indices(&self, role: Role) -> Vec<usize> {
        self.workers.iter().enumerate().filter(|(_, w)| w.role == role && !w.lent).map(|(i, _)| i).collect()
    }

    /// Elastic mode's lent engines, as indices into the fleet.
    pub(super) fn lent_engines(&self) -> Vec<usize> {
        self.lent(Role::Rollout)
    }

    /// elastic.lend_rollout's lent trainers (one on every rollout device), as indices into the fleet.
    pub(super) fn lent_trainers(&self) -> Vec<usize> {
        self.lent(Role::Trainer)
    }

    fn lent(&self, role: Role) -> Vec<usize> {
        self.workers.iter().enumerate().filter(|(_, w)| w.lent && w.role == role).map(|(i, _)| i).collect()
    }

    pub(super) fn worker(&self, i: usize) -> &Worker {
        &self.workers[i]
    }

    /// Every worker's name, in the fleet's order.
    /// Every worker's name with its device, in the fleet's order.
    pub(super) fn placed_names(&self) -> Vec<(String, u32)> {
        self.workers.iter().map(|w| (w.name.clone(), w.device)).collect()
    }

    /// The log of the worker named `name`, when there is one.
    pub(super) fn log_of_name(&self, name: Option<&str>) -> Option<PathBuf> {
        self.workers.iter().find(|w| Some(w.name.as_str()) == name).map(|w| w.log.clone())
    }

    /// The file one bucket of weights crosses in.
    pub(super) fn shm(&self) -> &Path {
        &self.scratch.shm
    }

    /// Each of `workers` with the first of `others` on its device (the same rank), in the order
    /// of `workers`; one without such a neighbour is left out.
    pub(super) fn paired_by_device(&self, workers: &[usize], others: &[usize]) -> Vec<(usize, usize)> {
        let rank = |i: usize| self.workers[i].rank;
        let neighbour = |w: usize| others.iter().copied().find(|&o| rank(o) == rank(w));
        workers.iter().filter_map(|&w| neighbour(w).map(|o| (w, o))).collect()
    }

    /// Pause (or resume) `tag` (None: every tag) in the workers `targets` (indices into the
    /// fleet), in parallel, through their control sockets; a report that carries an error fails
    /// the run. Returns each worker's name and report.
    pub(super) fn control_of(
        &mut self,
        targets: &[usize],
        pause: bool,
        tag: Option<&str>,
    ) -> R<Vec<(String, OpReport)>> {
        let verb = if pause { "pause" } else { "resume" };
        let what = tag.map(|t| format!("tag {t:?}")).unwrap_or_else(|| "every tag".into());
        let owned = tag.map(String::from);
        let results = self.control_calls(targets, &format!("{verb} {what}"), move |path, timeout| {
            // The runner is its workers' manager (TMS_MANAGED_BY): its own requests are forced.
            let answer = tms_proto::operate_forced(path, pause, owned.as_deref(), timeout);
            // A worker that never allocated under the tag (an external worker without CUDA
            // graphs) has nothing to pause or resume: an empty report, as before tags were checked.
            match answer {
                Err(tms_proto::ClientError::Remote(e)) if e.code == tms_proto::ErrorCode::UnknownTag => {
                    Ok(OpReport { tag: owned.clone(), ..OpReport::default() })
                }
                other => other,
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
                let done = report.bytes_done;
                let cause = format!("{verb} {what}: {err}; {done} of {} bytes done{hint}", done + report.bytes_failed);
                let mut e = self.fail(kind, Some(&name), cause);
                if kind == FailKind::OutOfMemory && !pause {
                    // What the resume could not bring back is what did not fit.
                    let tag = tag.map(String::from);
                    let device_used = Some(report.device_total.saturating_sub(report.device_free_after));
                    let request = crate::run::summary::FailedRequest { bytes: report.bytes_failed, device_used, tag };
                    e.request = Some(Box::new(request));
                }
                return Err(e);
            }
            reports.push((name, report));
        }
        Ok(reports)
    }

    /// Whether any of `targets` holds NCCL communicators now (the trainers' process group, the
    /// weight-sync group).
    pub(super) fn holds_nccl(&self, targets: &[usize]) -> R<bool> {
        let names: Vec<&str> = targets.iter().map(|&i| self.workers[i].name.as_str()).collect();
        let has = |w: &WorkerStatus| w.status.communicators.iter().any(|c| c.library == crate::run::NCCL_TAG);
        Ok(self.statuses()?.iter().any(|w| names.contains(&w.name.as_str()) && has(w)))
    }

    /// The tms status of every worker whose control socket is known.
    pub(super) fn statuses(&self) -> R<Vec<WorkerStatus>> {
        let targets: Vec<usize> = (0..self.workers.len()).filter(|&i| self.workers[i].control.is_some()).collect();
        let statuses = self.control_calls(&targets, "a control status request", tms_proto::status)?;
        let status = |(&i, status): (&usize, Status)| {
            let w = &self.workers[i];
            WorkerStatus { name: w.name.clone(), rank: w.rank, status }
        };
        Ok(targets.iter().zip(statuses).map(status).collect())
    }

    /// The status of every worker but `except` that answers its control socket within 2 s (after
    /// a failure: a dead or stuck one is left out rather than waited for).
    pub(super) fn statuses_of_live(&self, except: Option<&str>) -> Vec<WorkerStatus> {
        let wait = std::time::Duration::from_secs(2);
        let live = |(i, w): (usize, &Worker)| {
            if Some(w.name.as_str()) == except {
                return None;
            }
            let status = tms_proto::status(w.control.as_ref()?, wait).ok()?;
            Some(WorkerStatus { name: w.name.clone(), rank: self.workers[i].rank, status })
        };
        self.workers.iter().enumerate().filter_map(live).collect()
    }

    /// Finds the control socket of each worker of `role`, after its init: the one its process
    /// created in the control folder (launcher ray: the bridge's relay).
    pub(super) fn find_control_sockets(&mut self, role: Role) -> R<()> {
        self.find_control_sockets_of(&self.indices(role))
    }

    /// `find_control_sockets` for the workers `targets`.
    pub(super) fn find_control_sockets_of(&mut self, targets: &[usize]) -> R<()> {
        for &i in targets {
            if let Some(relay) = self.workers[i].control_relay.clone() {
                self.workers[i].control = Some(relay);
                continue;
            }
            let pid = self.workers[i].pid;
            // The hook binds its socket from a thread of its own, started by the first region
            // allocation: on a loaded machine the worker's init reply can come first.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let found = loop {
                let found = tms_proto::list_sockets(&self.scratch.ctl_dir).into_iter().find(|s| s.pid == pid);
                if found.is_some() || std::time::Instant::now() >= deadline {
                    break found;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            };
            match found {
                Some(s) => self.workers[i].control = Some(s.path),
                None => {
                    let cause = format!(
                        "no tms control socket for pid {pid} in {} within 5 s of init: is libtms_hook.so preloaded in the \
                         worker and did it allocate inside a region?",
                        self.scratch.ctl_dir.display()
                    );
                    return Err(self.fail(FailKind::Setup, Some(&self.workers[i].name), cause));
                }
            }
        }
        Ok(())
    }
}
