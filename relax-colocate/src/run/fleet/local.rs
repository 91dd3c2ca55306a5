//! The local launcher: each worker a child of the runner, under the hook, in a process group of
//! its own, connected to the runner's socket for it. `listen`, `worker_argv` and `worker_vars`
//! serve the Ray launcher too.

use super::supervise::{describe_exit, phase_timeout};
use super::{Proc, Worker};
use crate::run::config::Config;
use crate::run::signals::interruption;
use crate::run::{FailKind, R, Role, RunError, protocol, setup_err, wire};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The socket a worker connects to, listening.
pub(in crate::run) fn listen(sock: &Path) -> R<UnixListener> {
    let listener =
        UnixListener::bind(sock).map_err(|e| setup_err(format!("cannot listen on {}: {e}", sock.display())))?;
    listener.set_nonblocking(true).map_err(|e| setup_err(e.to_string()))?;
    Ok(listener)
}

/// The command a worker of `role` runs: the configured one under `/bin/sh -c`, else this
/// executable's built-in worker.
pub(in crate::run) fn worker_argv(cfg: &Config, role: Role) -> R<Vec<String>> {
    let external = match role {
        Role::Trainer => &cfg.run.trainer_cmd,
        Role::Rollout => &cfg.run.rollout_cmd,
    };
    if !external.is_empty() {
        return Ok(vec!["/bin/sh".into(), "-c".into(), external.clone()]);
    }
    let exe = std::env::current_exe().map_err(|e| setup_err(e.to_string()))?;
    Ok(vec![exe.display().to_string(), "worker".into(), role.as_str().into()])
}

/// The variables that tell a worker who it is and where the runner is (docs/worker-protocol.md).
pub(in crate::run) fn worker_vars(
    name: &str,
    role: Role,
    rank: u32,
    device: u32,
    sock: &Path,
    run_dir: &Path,
) -> [(&'static str, String); 6] {
    [
        ("TMS_NAME", name.into()),
        ("RELAX_WORKER_SOCKET", sock.display().to_string()),
        ("RELAX_ROLE", role.as_str().into()),
        ("RELAX_RANK", rank.to_string()),
        ("RELAX_DEVICE", device.to_string()),
        ("RELAX_RUN_DIR", run_dir.display().to_string()),
    ]
}

/// Starts one worker under the hook, in a process group of its own, and waits for its hello.
pub(super) fn spawn_worker(
    cfg: &Config,
    place: super::Placement,
    env: &[(String, String)],
    sock_dir: &Path,
    run_dir: &Path,
) -> Result<Worker, RunError> {
    let (role, rank) = (place.role, place.rank);
    let name = place.name();
    let sock = sock_dir.join(format!("{name}.sock"));
    let listener = listen(&sock)?;
    let log = run_dir.join("logs").join(format!("{name}.log"));
    let file = std::fs::File::create(&log).map_err(|e| setup_err(format!("cannot create {}: {e}", log.display())))?;
    let argv = worker_argv(cfg, role)?;
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .envs(worker_vars(&name, role, rank, rank, &sock, run_dir))
        .stdin(Stdio::null())
        .stdout(file.try_clone().map_err(|e| setup_err(e.to_string()))?)
        .stderr(file);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().map_err(|e| setup_err(format!("cannot start {name}: {e}")))?;
    let deadline = Instant::now() + phase_timeout(cfg);
    match hello_from_child(&mut child, &listener, role, &sock, deadline) {
        Ok((conn, hello)) => {
            let pid = hello.pid.unwrap_or(child.id());
            let transports = hello.transports;
            let proc = Proc::Local(child);
            Ok(Worker {
                name,
                role,
                lent: place.lent,
                rank,
                device: rank,
                proc,
                conn: Some(conn),
                pid,
                transports,
                log,
                control: None,
                control_relay: None,
                next_id: 0,
            })
        }
        Err((kind, cause)) => {
            if kind != FailKind::Crash {
                let _ = child.kill();
                let _ = child.wait();
            }
            let kind = if kind == FailKind::Setup && interruption().is_some() { FailKind::Interrupted } else { kind };
            Err(RunError { kind, step: 0, phase: "start".into(), worker: Some(name), cause, request: None })
        }
    }
}

/// Waits for the child's connection and hello: the connection and the hello, or how the wait
/// failed (Crash when the child exited first).
fn hello_from_child(
    child: &mut Child,
    listener: &UnixListener,
    role: Role,
    sock: &Path,
    deadline: Instant,
) -> Result<(wire::Conn, protocol::Hello), (FailKind, String)> {
    let setup = |cause: String| (FailKind::Setup, cause);
    let stream: UnixStream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(setup(format!("accept: {e}"))),
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err((FailKind::Crash, format!("{} before connecting", describe_exit(status))));
        }
        if let Some(why) = interruption() {
            return Err(setup(why));
        }
        if Instant::now() > deadline {
            return Err(setup(format!("did not connect to {} in time", sock.display())));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = stream.set_nonblocking(false);
    let mut conn = wire::Conn::new(stream).map_err(|e| setup(e.to_string()))?;
    let hello = match conn.recv(Some(deadline), || interruption().map_or(Ok(()), Err)) {
        Ok(h) => h,
        Err(wire::ReadError::Abandoned(why)) => return Err(setup(why)),
        Err(e) => return Err(setup(format!("no hello: {e}"))),
    };
    let hello = protocol::read_hello(hello, role.as_str()).map_err(setup)?;
    Ok((conn, hello))
}
