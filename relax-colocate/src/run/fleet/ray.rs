//! Launcher ray: the workers are placed by Ray and started on their nodes by one agent actor per
//! node (python/ray_bridge.py of this crate, docs/ray.md). The runner starts the bridge as one child process
//! and sees, per worker, the same two Unix sockets as with local workers: the worker-protocol
//! connection (the bridge connects to the runner's listener in the worker's place) and a control
//! socket (the bridge's, relayed to the worker's own on its node). The phase loop is unchanged.

use super::local::{listen, worker_argv, worker_vars};
use super::ray_python::RayPython;
use super::supervise::{describe_exit, phase_timeout};
use super::{Proc, Worker};
use crate::run::config::{Config, DeviceChoice};
use crate::run::signals::interruption;
use crate::run::{FailKind, R, Role, RunError, protocol, setup_err, tail, wire};
use serde_json::{Value, json};
use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// The bridge itself, written next to the run's sockets and run as `__main__` so that Ray ships
/// its agent class to the nodes by value: nodes need Ray, not the tms package.
const BRIDGE_PY: &str = include_str!("../../../python/ray_bridge.py");

/// How long Ray may take to start a local cluster, place the bundles and start the agents: on a
/// loaded 2-core machine a 2-node cluster takes tens of seconds.
const RAY_START: Duration = Duration::from_secs(300);

/// The file, in the run's temp folder, where the bridge says why the configuration cannot run.
const CONFIG_ERROR_FILE: &str = "ray-config-error";

/// How long the bridge may take to stop the workers and a local cluster before it is killed.
const BRIDGE_STOP: Duration = Duration::from_secs(60);

/// The variable, `NAME=<run id>`, that every process of a local cluster inherits from the bridge,
/// so that those Ray's own shutdown misses can be found and ended: the cluster is the run's alone.
const LOCAL_CLUSTER_MARK: &str = "TMS_RAY_LOCAL_CLUSTER";

/// How long the sweep for a local cluster's leftovers watches for latecomers after its last find.
const LEFTOVER_SETTLE: Duration = Duration::from_secs(3);

pub(super) struct Bridge {
    child: Child,
    /// Held open for as long as the workers are wanted: the bridge ends at its EOF, so a runner
    /// that dies takes every node's workers with it.
    stdin: Option<ChildStdin>,
    log: PathBuf,
    /// Where the bridge says why this configuration cannot run (a Ray version the cluster
    /// refuses), before it exits.
    config_error: PathBuf,
    /// `TMS_RAY_LOCAL_CLUSTER=<run id>` when the bridge starts a local cluster.
    local_cluster: Option<String>,
}

impl Bridge {
    /// The bridge's own end of the run: the configuration's fault (exit 2), or its failure.
    fn failure(&mut self) -> Option<(FailKind, String)> {
        let exited = self.exited()?;
        match std::fs::read_to_string(&self.config_error) {
            Ok(cause) => {
                Some((FailKind::Config, format!("{} (the Ray bridge's log: {})", cause.trim(), self.log.display())))
            }
            Err(_) => Some((FailKind::Setup, exited)),
        }
    }

    /// How the bridge ended, once it has.
    pub(super) fn exited(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok().flatten()?;
        Some(format!(
            "the Ray bridge {} (every remote worker's connection closed with it); its log, {}:\n{}",
            describe_exit(status),
            self.log.display(),
            tail(&self.log, 15)
        ))
    }

    /// Stops every worker on every node and a local cluster, within BRIDGE_STOP.
    pub(super) fn stop(&mut self) {
        self.stdin = None;
        let deadline = Instant::now() + BRIDGE_STOP;
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        if matches!(self.child.try_wait(), Ok(None)) {
            // The bridge leads its own process group, with a local cluster's Ray processes in it.
            // SAFETY: signalling a process group we created.
            unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
            let _ = self.child.wait();
        }
        // The bridge ends its cluster's leftovers itself, but not when it was killed above, and a
        // CI run found a node's DashboardAgent and RuntimeEnvAgent alive after a bridge that had
        // exited: whatever still carries the mark is ended here, and named in the bridge's log.
        if let Some(mark) = &self.local_cluster {
            let ended = end_marked_processes(mark);
            if !ended.is_empty()
                && let Ok(mut log) = std::fs::OpenOptions::new().append(true).open(&self.log)
            {
                let _ = writeln!(
                    log,
                    "relax-colocate: ended processes of the local cluster left after the bridge: {ended:?}"
                );
            }
        }
    }
}

/// Kills every live process whose environment holds `mark`, watching for latecomers until none
/// has appeared for LEFTOVER_SETTLE (at most ten times that); returns those it found.
fn end_marked_processes(mark: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    let started = Instant::now();
    let mut quiet_since = Instant::now();
    let mut ended: Vec<(u32, String)> = Vec::new();
    while quiet_since.elapsed() < LEFTOVER_SETTLE && started.elapsed() < LEFTOVER_SETTLE * 10 {
        for (pid, name) in marked_processes(mark, me) {
            // SAFETY: the process carries this run's own cluster mark.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            if !ended.iter().any(|(p, _)| *p == pid) {
                ended.push((pid, name));
            }
            quiet_since = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    ended
}

/// Live processes (zombies excluded: they are already dead) whose environment holds `mark`.
fn marked_processes(mark: &str, me: u32) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        if pid == me {
            continue;
        }
        let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
        if !env.split(|b| *b == 0).any(|v| v == mark.as_bytes()) {
            continue;
        }
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let state = stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next());
        if state.is_some_and(|s| s != "Z" && s != "X") {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            found.push((pid, comm.trim().to_string()));
        }
    }
    found
}

/// Per-node values of the workers' environment: each node its own control folder and, on the
/// simulator, its own device node (so nodes of a local cluster do not share device memory).
pub(in crate::run) fn node_env(base: &[(String, String)], tmp: &Path, node: u32) -> Vec<(String, String)> {
    let run_id = tmp.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    base.iter()
        .map(|(k, v)| match k.as_str() {
            "TMS_CONTROL_DIR" => (k.clone(), tmp.join(format!("ctl-node{node}")).display().to_string()),
            "TMS_SIM_NODE" => (k.clone(), format!("{run_id}-node{node}")),
            _ => (k.clone(), v.clone()),
        })
        .collect()
}

/// A worker the bridge will start, and the runner's end of its connection.
struct Pending {
    name: String,
    role: Role,
    lent: bool,
    rank: u32,
    /// Its device on its own node.
    device: u32,
    node: u32,
    listener: UnixListener,
    log: PathBuf,
}

/// Where the run's files are for the bridge: the temp folder, its worker sockets and the run
/// directory as every node sees it.
struct Paths<'a> {
    tmp: &'a Path,
    sock_dir: PathBuf,
    run_dir: PathBuf,
    exe_argv: [Vec<String>; 2],
}

/// The bridge's description of one worker: what to run where, with which environment and sockets.
fn worker_spec(paths: &Paths, node_env: &[(String, String)], p: &Pending) -> Value {
    let Paths { tmp, sock_dir, run_dir, exe_argv } = paths;
    let name = &p.name;
    let node_sock = tmp.join(format!("n{}", p.node)).join(format!("{name}.sock"));
    let mut wenv: serde_json::Map<String, Value> =
        node_env.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
    for (k, v) in worker_vars(name, p.role, p.rank, p.device, &node_sock, run_dir) {
        wenv.insert(k.into(), Value::String(v));
    }
    let argv = &exe_argv[usize::from(p.role == Role::Trainer)];
    json!({
        "name": name, "node": format!("node{}", p.node), "device": p.device, "argv": argv, "env": wenv,
        "log": p.log, "node_socket": node_sock, "ctl_dir": tmp.join(format!("ctl-node{}", p.node)),
        "runner_socket": sock_dir.join(format!("{name}.sock")), "control_socket": sock_dir.join(format!("{name}.ctl")),
    })
}

/// Every worker of the run, node-major, each listening for its connection; and their specs.
fn pending_workers(cfg: &Config, env: &[(String, String)], paths: &Paths) -> R<(Vec<Pending>, Vec<Value>)> {
    let mut pending = Vec::new();
    let mut specs = Vec::new();
    let node_envs: Vec<_> = (0..cfg.run.nodes).map(|node| node_env(env, paths.tmp, node)).collect();
    for place in super::placements(cfg) {
        let (role, rank, lent) = (place.role, place.rank, place.lent);
        let (node, local) = (rank / cfg.run.devices, rank % cfg.run.devices);
        let name = place.name();
        let listener = listen(&paths.sock_dir.join(format!("{name}.sock")))?;
        let log = paths.run_dir.join("logs").join(format!("{name}.log"));
        let p = Pending { name, role, lent, rank, device: local, node, listener, log };
        specs.push(worker_spec(paths, &node_envs[node as usize], &p));
        pending.push(p);
    }
    Ok((pending, specs))
}

/// Starts the bridge and waits for every worker's hello through it.
pub(super) fn start_workers(
    cfg: &Config,
    python: &RayPython,
    device: DeviceChoice,
    env: &[(String, String)],
    tmp: &Path,
    run_dir: &Path,
    bucket: (&Path, u64),
) -> R<(Vec<Worker>, Bridge)> {
    let run_dir = std::fs::canonicalize(run_dir).map_err(|e| setup_err(format!("{}: {e}", run_dir.display())))?;
    let exit_dir = tmp.join("exits");
    std::fs::create_dir_all(&exit_dir).map_err(|e| setup_err(e.to_string()))?;
    let exe_argv = [worker_argv(cfg, Role::Rollout)?, worker_argv(cfg, Role::Trainer)?];
    let paths = Paths { tmp, sock_dir: tmp.join("w"), run_dir, exe_argv };
    let (pending, specs) = pending_workers(cfg, env, &paths)?;
    let spec = json!({
        "ray_address": cfg.run.ray_address.trim(),
        "nodes": cfg.run.nodes,
        "devices": cfg.run.devices,
        "resource": if device == DeviceChoice::Npu { "NPU" } else { "GPU" },
        "simulated": device == DeviceChoice::Sim,
        "placement_file": tmp.join("placement.json"),
        "run_id": tmp.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        "cluster_mark": LOCAL_CLUSTER_MARK,
        "start_timeout_s": RAY_START.as_secs_f64(),
        "phase_timeout_s": cfg.run.phase_timeout_s,
        "exit_dir": exit_dir,
        "config_error_file": tmp.join(CONFIG_ERROR_FILE),
        "python": python.path,
        "bucket": {"path": bucket.0, "bytes": bucket.1},
        "workers": specs,
    });
    let mut bridge = start_bridge(python, &spec, tmp, &paths.run_dir)?;
    match accept_all(cfg, &mut bridge, pending, &exit_dir, &paths.sock_dir, &tmp.join("placement.json")) {
        Ok(workers) => Ok((workers, bridge)),
        Err(e) => {
            bridge.stop();
            Err(e)
        }
    }
}

/// Writes the spec and the bridge next to the sockets and starts it in a process group of its own;
/// its log starts with the Python chosen for it, and why.
fn start_bridge(python: &RayPython, spec: &Value, tmp: &Path, run_dir: &Path) -> R<Bridge> {
    let spec_path = tmp.join("ray-spec.json");
    let script = tmp.join("ray_bridge.py");
    std::fs::write(&spec_path, spec.to_string()).map_err(|e| setup_err(e.to_string()))?;
    std::fs::write(&script, BRIDGE_PY).map_err(|e| setup_err(e.to_string()))?;
    let log = run_dir.join("logs").join("ray-bridge.log");
    let mut file =
        std::fs::File::create(&log).map_err(|e| setup_err(format!("cannot create {}: {e}", log.display())))?;
    writeln!(file, "relax-colocate: the bridge runs on {}", python.describe()).map_err(|e| setup_err(e.to_string()))?;
    let mut cmd = Command::new(&python.path);
    cmd.arg(&script)
        .arg(&spec_path)
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::piped())
        .stdout(file.try_clone().map_err(|e| setup_err(e.to_string()))?)
        .stderr(file);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().map_err(|e| setup_err(format!("cannot start {}: {e}", python.path.display())))?;
    let stdin = child.stdin.take();
    let config_error = tmp.join(CONFIG_ERROR_FILE);
    let local_cluster = (spec["ray_address"] == "local")
        .then(|| format!("{}={}", LOCAL_CLUSTER_MARK, spec["run_id"].as_str().unwrap_or_default()));
    Ok(Bridge { child, stdin, log, config_error, local_cluster })
}

fn start_err(kind: FailKind, worker: Option<&str>, cause: String) -> RunError {
    RunError { kind, step: 0, phase: "start".into(), worker: worker.map(String::from), cause, request: None }
}

fn accept_all(
    cfg: &Config,
    bridge: &mut Bridge,
    pending: Vec<Pending>,
    exit_dir: &Path,
    sock_dir: &Path,
    placement_file: &Path,
) -> R<Vec<Worker>> {
    let limit = RAY_START + phase_timeout(cfg);
    let deadline = Instant::now() + limit;
    let mut workers = Vec::new();
    for p in pending {
        let exit_file = exit_dir.join(format!("{}.exit", p.name));
        let stream = accept_remote(bridge, &p, &exit_file, deadline, limit)?;
        let _ = stream.set_nonblocking(false);
        let mut conn = wire::Conn::new(stream).map_err(|e| setup_err(e.to_string()))?;
        let hello = conn.recv(Some(deadline), || {
            if let Some(why) = interruption() {
                return Err(why);
            }
            std::fs::read_to_string(&exit_file).map_or(Ok(()), Err)
        });
        let hello = hello.map_err(|e| start_err(FailKind::Crash, Some(&p.name), format!("no hello: {e}")))?;
        let hello = protocol::read_hello(hello, p.role.as_str())
            .map_err(|cause| start_err(FailKind::Setup, Some(&p.name), cause))?;
        // The device Ray gave this worker's bundle, as the worker sees it (the bridge writes the
        // placement before it lets any worker say hello).
        let placement: Value =
            std::fs::read(placement_file).ok().and_then(|b| serde_json::from_slice(&b).ok()).ok_or_else(|| {
                start_err(FailKind::Setup, None, format!("the bridge wrote no {}", placement_file.display()))
            })?;
        let device = placement[&p.name]["device"].as_u64().map_or(p.device, |d| d as u32);
        workers.push(Worker {
            control_relay: Some(sock_dir.join(format!("{}.ctl", p.name))),
            name: p.name,
            role: p.role,
            lent: p.lent,
            rank: p.rank,
            device,
            proc: Proc::Remote { node: format!("node{}", p.node), exit_file },
            conn: Some(conn),
            pid: hello.pid.unwrap_or(0),
            transports: hello.transports,
            log: p.log,
            control: None,
            next_id: 0,
        });
    }
    Ok(workers)
}

/// Waits for the bridge to connect in the worker's place; fails when the worker, the bridge or
/// the wait ends first.
fn accept_remote(
    bridge: &mut Bridge,
    p: &Pending,
    exit_file: &Path,
    deadline: Instant,
    limit: Duration,
) -> R<UnixStream> {
    loop {
        match p.listener.accept() {
            Ok((s, _)) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(start_err(FailKind::Setup, Some(&p.name), format!("accept: {e}"))),
        }
        if let Ok(cause) = std::fs::read_to_string(exit_file) {
            return Err(start_err(FailKind::Crash, Some(&p.name), cause));
        }
        if let Some((kind, cause)) = bridge.failure() {
            return Err(start_err(kind, None, cause));
        }
        if let Some(why) = interruption() {
            return Err(start_err(FailKind::Interrupted, None, why));
        }
        if Instant::now() > deadline {
            return Err(start_err(
                FailKind::Timeout,
                Some(&p.name),
                format!(
                    "did not connect through Ray within {}s; the bridge's log, {}:\n{}",
                    limit.as_secs(),
                    bridge.log.display(),
                    tail(&bridge.log, 15)
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
