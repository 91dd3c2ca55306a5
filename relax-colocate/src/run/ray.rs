//! Launcher ray: the workers are placed by Ray and started on their nodes by one agent actor per
//! node (python/tms/ray/bridge.py, docs/ray.md). The runner starts the bridge as one child process
//! and sees, per worker, the same two Unix sockets as with local workers: the worker-protocol
//! connection (the bridge connects to the runner's listener in the worker's place) and a control
//! socket (the bridge's, relayed to the worker's own on its node). The phase loop is unchanged.

use super::config::{Config, DeviceChoice};
use super::signals::interruption;
use super::supervise::{describe_exit, phase_timeout};
use super::{FailKind, Proc, R, Role, RunError, Worker, protocol, setup_err, tail, wire};
use serde_json::{Value, json};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// The bridge itself, written next to the run's sockets and run as `__main__` so that Ray ships
/// its agent class to the nodes by value: nodes need Ray, not the tms package.
const BRIDGE_PY: &str = include_str!("../../../python/tms/ray/bridge.py");

/// How long Ray may take to start a local cluster, place the bundles and start the agents: on a
/// loaded 2-core machine a 2-node cluster takes tens of seconds.
const RAY_START: Duration = Duration::from_secs(300);

/// How long the bridge may take to stop the workers and a local cluster before it is killed.
const BRIDGE_STOP: Duration = Duration::from_secs(60);

pub(super) struct Bridge {
    child: Child,
    /// Held open for as long as the workers are wanted: the bridge ends at its EOF, so a runner
    /// that dies takes every node's workers with it.
    stdin: Option<ChildStdin>,
    log: PathBuf,
}

impl Bridge {
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
    }
}

/// The Python that has Ray: run.ray_python, else scripts/ray-env.sh's environment.
fn ray_python(cfg: &Config) -> Result<PathBuf, String> {
    let py = if !cfg.run.ray_python.is_empty() {
        PathBuf::from(&cfg.run.ray_python)
    } else if let Some(v) = std::env::var_os("TMS_RAY_VENV") {
        PathBuf::from(v).join("bin/python")
    } else {
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"));
        cache.join("tms/ray-venv/bin/python")
    };
    if py.is_file() {
        Ok(py)
    } else {
        Err(format!(
            "--launcher ray needs a Python with Ray, and {} is not there: create it with scripts/ray-env.sh \
             (it installs the pinned Ray, scripts/ray-requirements.txt), or point run.ray_python at one",
            py.display()
        ))
    }
}

/// Per-node values of the workers' environment: each node its own control folder and, on the
/// simulator, its own device node (so nodes of a local cluster do not share device memory).
pub(super) fn node_env(base: &[(String, String)], tmp: &Path, node: u32) -> Vec<(String, String)> {
    let run_id = tmp.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    base.iter()
        .map(|(k, v)| match k.as_str() {
            "TMS_CONTROL_DIR" => (k.clone(), tmp.join(format!("ctl-node{node}")).display().to_string()),
            "TMS_SIM_NODE" => (k.clone(), format!("{run_id}-node{node}")),
            _ => (k.clone(), v.clone()),
        })
        .collect()
}

/// Starts the bridge and waits for every worker's hello through it.
pub(super) fn start_workers(
    cfg: &Config,
    device: DeviceChoice,
    env: &[(String, String)],
    tmp: &Path,
    run_dir: &Path,
    bucket: (&Path, u64),
) -> R<(Vec<Worker>, Bridge)> {
    let python = ray_python(cfg).map_err(|cause| RunError { kind: FailKind::Config, ..setup_err(cause) })?;
    let run_dir = std::fs::canonicalize(run_dir).map_err(|e| setup_err(format!("{}: {e}", run_dir.display())))?;
    let sock_dir = tmp.join("w");
    let exit_dir = tmp.join("exits");
    std::fs::create_dir_all(&exit_dir).map_err(|e| setup_err(e.to_string()))?;
    let exe = std::env::current_exe().map_err(|e| setup_err(e.to_string()))?;
    let mut listeners = Vec::new();
    let mut specs = Vec::new();
    for node in 0..cfg.run.nodes {
        let node_env = node_env(env, tmp, node);
        let ctl_dir = tmp.join(format!("ctl-node{node}"));
        for local in 0..cfg.run.devices {
            let rank = node * cfg.run.devices + local;
            for role in [Role::Rollout, Role::Trainer] {
                let name = format!("{}-{rank}", role.as_str());
                let sock = sock_dir.join(format!("{name}.sock"));
                let listener = UnixListener::bind(&sock)
                    .map_err(|e| setup_err(format!("cannot listen on {}: {e}", sock.display())))?;
                listener.set_nonblocking(true).map_err(|e| setup_err(e.to_string()))?;
                let external = match role {
                    Role::Trainer => &cfg.run.trainer_cmd,
                    Role::Rollout => &cfg.run.rollout_cmd,
                };
                let argv: Vec<String> = if external.is_empty() {
                    vec![exe.display().to_string(), "worker".into(), role.as_str().into()]
                } else {
                    vec!["/bin/sh".into(), "-c".into(), external.clone()]
                };
                let mut wenv: serde_json::Map<String, Value> =
                    node_env.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
                let node_sock = tmp.join(format!("n{node}")).join(format!("{name}.sock"));
                for (k, v) in [
                    ("TMS_NAME", name.clone()),
                    ("RELAX_WORKER_SOCKET", node_sock.display().to_string()),
                    ("RELAX_ROLE", role.as_str().into()),
                    ("RELAX_RANK", rank.to_string()),
                    ("RELAX_DEVICE", local.to_string()),
                    ("RELAX_RUN_DIR", run_dir.display().to_string()),
                ] {
                    wenv.insert(k.into(), Value::String(v));
                }
                let log = run_dir.join("logs").join(format!("{name}.log"));
                specs.push(json!({
                    "name": name, "node": format!("node{node}"), "device": local, "argv": argv, "env": wenv,
                    "log": log, "node_socket": node_sock, "ctl_dir": ctl_dir,
                    "runner_socket": sock, "control_socket": sock_dir.join(format!("{name}.ctl")),
                }));
                listeners.push((name, role, rank, local, node, listener, log));
            }
        }
    }
    let spec = json!({
        "ray_address": cfg.run.ray_address.trim(),
        "nodes": cfg.run.nodes,
        "devices": cfg.run.devices,
        "resource": if device == DeviceChoice::Npu { "NPU" } else { "GPU" },
        "simulated": device == DeviceChoice::Sim,
        "placement_file": tmp.join("placement.json"),
        "run_id": tmp.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        "start_timeout_s": RAY_START.as_secs_f64(),
        "phase_timeout_s": cfg.run.phase_timeout_s,
        "exit_dir": exit_dir,
        "bucket": {"path": bucket.0, "bytes": bucket.1},
        "workers": specs,
    });
    let spec_path = tmp.join("ray-spec.json");
    let script = tmp.join("ray_bridge.py");
    std::fs::write(&spec_path, spec.to_string()).map_err(|e| setup_err(e.to_string()))?;
    std::fs::write(&script, BRIDGE_PY).map_err(|e| setup_err(e.to_string()))?;
    let log = run_dir.join("logs").join("ray-bridge.log");
    let file = std::fs::File::create(&log).map_err(|e| setup_err(format!("cannot create {}: {e}", log.display())))?;
    let mut cmd = Command::new(&python);
    cmd.arg(&script)
        .arg(&spec_path)
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::piped())
        .stdout(file.try_clone().map_err(|e| setup_err(e.to_string()))?)
        .stderr(file);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().map_err(|e| setup_err(format!("cannot start {}: {e}", python.display())))?;
    let stdin = child.stdin.take();
    let mut bridge = Bridge { child, stdin, log };
    match accept_all(cfg, &mut bridge, listeners, &exit_dir, &sock_dir, &tmp.join("placement.json")) {
        Ok(workers) => Ok((workers, bridge)),
        Err(e) => {
            bridge.stop();
            Err(e)
        }
    }
}

type Pending = (String, Role, u32, u32, u32, UnixListener, PathBuf);

fn accept_all(
    cfg: &Config,
    bridge: &mut Bridge,
    listeners: Vec<Pending>,
    exit_dir: &Path,
    sock_dir: &Path,
    placement_file: &Path,
) -> R<Vec<Worker>> {
    let limit = RAY_START + phase_timeout(cfg);
    let deadline = Instant::now() + limit;
    let start_err = |kind: FailKind, worker: Option<&str>, cause: String| RunError {
        kind,
        step: 0,
        phase: "start".into(),
        worker: worker.map(String::from),
        cause,
    };
    let mut workers = Vec::new();
    for (name, role, rank, device, node, listener, log) in listeners {
        let exit_file = exit_dir.join(format!("{name}.exit"));
        let stream: UnixStream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(start_err(FailKind::Setup, Some(&name), format!("accept: {e}"))),
            }
            if let Ok(cause) = std::fs::read_to_string(&exit_file) {
                return Err(start_err(FailKind::Crash, Some(&name), cause));
            }
            if let Some(cause) = bridge.exited() {
                return Err(start_err(FailKind::Setup, None, cause));
            }
            if let Some(why) = interruption() {
                return Err(start_err(FailKind::Interrupted, None, why));
            }
            if Instant::now() > deadline {
                return Err(start_err(
                    FailKind::Timeout,
                    Some(&name),
                    format!(
                        "did not connect through Ray within {}s; the bridge's log, {}:\n{}",
                        limit.as_secs(),
                        bridge.log.display(),
                        tail(&bridge.log, 15)
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let _ = stream.set_nonblocking(false);
        let mut conn = wire::Conn::new(stream).map_err(|e| setup_err(e.to_string()))?;
        let hello = conn.recv(Some(deadline), || {
            if let Some(why) = interruption() {
                return Err(why);
            }
            std::fs::read_to_string(&exit_file).map_or(Ok(()), Err)
        });
        let hello = hello.map_err(|e| start_err(FailKind::Crash, Some(&name), format!("no hello: {e}")))?;
        let hello = protocol::read_hello(hello, role.as_str())
            .map_err(|cause| start_err(FailKind::Setup, Some(&name), cause))?;
        let pid = hello.pid.unwrap_or(0);
        // The device Ray gave this worker's bundle, as the worker sees it (the bridge writes the
        // placement before it lets any worker say hello).
        let placement: Value =
            std::fs::read(placement_file).ok().and_then(|b| serde_json::from_slice(&b).ok()).ok_or_else(|| {
                start_err(FailKind::Setup, None, format!("the bridge wrote no {}", placement_file.display()))
            })?;
        let device = placement[&name]["device"].as_u64().map_or(device, |d| d as u32);
        workers.push(Worker {
            control_relay: Some(sock_dir.join(format!("{name}.ctl"))),
            name,
            role,
            rank,
            device,
            proc: Proc::Remote { node: format!("node{node}"), exit_file },
            conn: Some(conn),
            pid,
            log,
            control: None,
            next_id: 0,
        });
    }
    Ok(workers)
}
