//! Starting a run, in two parts. `plan` resolves everything the run will use without changing
//! anything: the device and its API, the hook, the model's shape and memory profile, the weight
//! bucket, and on the simulator the device's size and environment (refusing what cannot run here).
//! `start` then acts on the plan: it sweeps what dead runs left, makes the temp and shared-memory
//! files (tmpfiles.rs), opens the run directory's outputs, and starts each worker up to its hello
//! (here, or through Ray: ray.rs).

use super::config::{self, AlgoName, Config, DeviceChoice, Launcher};
use super::profile::Profile;
use super::signals::interruption;
use super::sizing::{Footprint, check_host_memory_for_sim, footprint, round_up, sim_context_bytes};
use super::supervise::{describe_exit, phase_timeout};
use super::task::{Addition, VOCAB};
use super::tmpfiles::Scratch;
use super::{
    FailKind, GRANULARITY, MIB, Options, Proc, R, Role, RunError, Runner, Worker, config_err, loggers, model, profile,
    protocol, ray, report, setup_err, wire,
};
use crate::environment::{find_hook, sim_environment};
use crate::runtime::can_load;
use std::collections::BTreeMap;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

pub(super) fn make_run_dir(cfg: &Config) -> Result<PathBuf, String> {
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

/// What a run will use, resolved from the configuration and this machine.
pub(super) struct Plan {
    pub(super) device: DeviceChoice,
    /// The vendor API the workers use: "cuda" or "acl".
    pub(super) api: &'static str,
    hook: PathBuf,
    pub(super) task: Addition,
    pub(super) shape: model::Shape,
    pub(super) profile: Profile,
    pub(super) bucket_bytes: u64,
    /// The size of the file one bucket of weights crosses in.
    shm_bytes: u64,
    sim: Option<SimDevice>,
    /// The device as the run's first line and the summary name it.
    pub(super) device_label: String,
}

/// The simulated device: its size and the environment that puts a worker on it.
struct SimDevice {
    capacity: u64,
    /// What each process's context takes of it.
    contexts: u64,
    vars: Vec<(String, String)>,
}

/// The device `run.device` names, checked against what this machine can load.
fn resolve_device(cfg: &Config) -> R<DeviceChoice> {
    let device = match cfg.run.device {
        DeviceChoice::Auto if can_load(c"libcuda.so.1") => DeviceChoice::Cuda,
        DeviceChoice::Auto => DeviceChoice::Sim,
        d => d,
    };
    if device == DeviceChoice::Cuda && !can_load(c"libcuda.so.1") {
        return Err(config_err("--device cuda: libcuda.so.1 cannot be loaded here; use --device sim"));
    }
    if device == DeviceChoice::Npu && !can_load(c"libascendcl.so") {
        return Err(config_err(
            "--device npu: libascendcl.so cannot be loaded; source CANN's set_env.sh or use --device sim",
        ));
    }
    Ok(device)
}

/// Resolves the run without side effects; every refusal the configuration earns here comes before
/// anything is created.
pub(super) fn plan(cfg: &Config, hook: Option<&Path>) -> R<Plan> {
    let device = resolve_device(cfg)?;
    let hook = find_hook(hook).map_err(setup_err)?;
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
    let sim = if device == DeviceChoice::Sim { Some(plan_sim(cfg, api, &shape, bucket_bytes, &fp)?) } else { None };
    let device_label = device_label(cfg, device, api, sim.as_ref(), &fp);
    let shm_bytes = fp.transfer.max(4096);
    Ok(Plan { device, api, hook, task, shape, profile, bucket_bytes, shm_bytes, sim, device_label })
}

/// Sizes the simulated device, or refuses a run the host or the configured size cannot hold.
fn plan_sim(cfg: &Config, api: &str, shape: &model::Shape, bucket_bytes: u64, fp: &Footprint) -> R<SimDevice> {
    let per_device_at = |scale: f64| {
        let p = profile::build(&cfg.memory.profile, cfg.memory.tp, scale, cfg.memory.kv_cache_gib).ok()?;
        let f = footprint(cfg, shape, &p, bucket_bytes);
        Some(f.trainer + f.rollout)
    };
    check_host_memory_for_sim(cfg, fp.trainer + fp.rollout, per_device_at)
        .map_err(|cause| RunError { kind: FailKind::Config, ..setup_err(cause) })?;
    let vars = sim_environment().map_err(setup_err)?.vars;
    let peak = fp.trainer.max(fp.rollout).max(fp.rollout_weights + 2 * fp.transfer);
    // Each device holds two processes, and each process's context takes device memory.
    let contexts = 2 * sim_context_bytes(api);
    if cfg.sim.memory == "auto" {
        let capacity = round_up(peak + contexts + (fp.trainer.min(fp.rollout) / 2).min(64 * MIB), GRANULARITY);
        return Ok(SimDevice { capacity, contexts, vars });
    }
    let capacity = config::parse_size(&cfg.sim.memory).map_err(config_err)?;
    // The simulator would replace a capacity under its granularity by its 16 GiB default, and a
    // device without room for both contexts fails every worker's first call.
    if capacity < contexts + GRANULARITY {
        return Err(config_err(format!(
            "sim.memory={} leaves no room on the device: the trainer's and the rollout's \
             contexts take {} of it; give at least {} (or sim.memory=auto)",
            cfg.sim.memory,
            report::human(contexts),
            report::human(contexts + GRANULARITY)
        )));
    }
    Ok(SimDevice { capacity, contexts, vars })
}

fn device_label(cfg: &Config, device: DeviceChoice, api: &str, sim: Option<&SimDevice>, fp: &Footprint) -> String {
    let label = match (device, sim) {
        (DeviceChoice::Cuda, _) => "CUDA".to_string(),
        (DeviceChoice::Npu, _) => "Ascend NPU (ACL)".to_string(),
        (_, Some(sim)) => format!(
            "tms-sim ({} API), {} x {} (trainer needs {}, rollout {}, their contexts {})",
            if api == "acl" { "ACL" } else { "CUDA" },
            cfg.run.devices,
            report::human(sim.capacity),
            report::human(fp.trainer),
            report::human(fp.rollout),
            report::human(sim.contexts)
        ),
        _ => String::new(),
    };
    if cfg.run.launcher != Launcher::Ray {
        return label;
    }
    format!(
        "{label}; placed by Ray ({}): {} node(s) x {} device(s)",
        cfg.run.ray_address.trim(),
        cfg.run.nodes,
        cfg.run.devices
    )
}

impl Plan {
    /// The environment every worker gets, the run's temp files being `scratch`.
    fn worker_env(&self, cfg: &Config, scratch: &Scratch) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = vec![
            ("LD_PRELOAD".into(), self.hook.display().to_string()),
            ("TMS_CONTROL".into(), "1".into()),
            ("TMS_CONTROL_DIR".into(), scratch.ctl_dir.display().to_string()),
            ("RELAX_DEVICE_API".into(), self.api.into()),
        ];
        let Some(sim) = &self.sim else { return env };
        // Python workers (scripts/torch_worker.py) get the start-up hook that puts PyTorch on
        // the simulator with the rest of the environment.
        env.extend(sim.vars.iter().cloned());
        env.extend([
            ("TMS_SIM_DIR".into(), scratch.tmp.path().join("sim").display().to_string()),
            ("TMS_SIM_NODE".into(), "relax".into()),
            ("TMS_SIM_MEMORY".into(), sim.capacity.to_string()),
            ("TMS_SIM_DEVICES".into(), cfg.run.devices.to_string()),
        ]);
        if cfg.sim.copy_gbps > 0.0 {
            env.push(("TMS_SIM_COPY_GBPS".into(), cfg.sim.copy_gbps.to_string()));
        }
        env
    }
}

/// The run directory's outputs, opened before any worker starts.
struct Outputs {
    metrics_file: std::fs::File,
    memory_file: std::fs::File,
    loggers: loggers::Loggers,
}

fn open_outputs(cfg: &Config, run_dir: &Path) -> R<Outputs> {
    std::fs::write(run_dir.join("config.toml"), cfg.to_toml()).map_err(|e| setup_err(e.to_string()))?;
    let open = |name: &str| std::fs::File::create(run_dir.join(name)).map_err(|e| setup_err(e.to_string()));
    let metrics_file = open("metrics.jsonl")?;
    let memory_file = open("memory.jsonl")?;
    let kinds = loggers::parse_list(&cfg.metrics.loggers).map_err(setup_err)?;
    let loggers = loggers::Loggers::open(&kinds, run_dir, &cfg.metrics.python, &cfg.metrics.wandb_project)
        .map_err(|cause| RunError { kind: FailKind::Config, ..setup_err(cause) })?;
    Ok(Outputs { metrics_file, memory_file, loggers })
}

/// The lines a run starts with: what it removed, what it runs where, its loggers, and (local
/// launcher) how to reach its workers' control sockets.
fn announce(
    cfg: &Config,
    opts: &Options,
    plan: &Plan,
    out: &Outputs,
    scratch: &Scratch,
    run_dir: &Path,
) -> report::Progress {
    let progress = report::Progress::new(opts.quiet || opts.json);
    if !scratch.swept.is_empty() {
        progress.note(&format!(
            "relax-colocate run: removed {} temp/shared-memory file(s) of runs that are gone: {}",
            scratch.swept.len(),
            scratch.swept.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ));
    }
    let algo = match cfg.algo.name {
        AlgoName::Grpo => "GRPO",
        AlgoName::Ppo => "PPO",
    };
    progress.note(&format!(
        "relax-colocate run: {algo} {} steps on {}; run directory {}",
        cfg.run.steps,
        plan.device_label,
        run_dir.display()
    ));
    for line in out.loggers.describe() {
        progress.note(&format!("relax-colocate run: {line}"));
    }
    // The workers' control sockets live in the run's private folder, which `tms-ctl list` does
    // not look in by default: say how to reach them while the run goes on.
    if cfg.run.launcher == Launcher::Local {
        progress.note(&format!(
            "relax-colocate run: workers' control sockets in {0} (`tms-ctl --dir {0} list`)",
            scratch.ctl_dir.display()
        ));
    }
    progress
}

/// Acts on the plan: files, outputs, then the workers. A worker that cannot start stops those
/// started before it.
pub(super) fn start(cfg: &Config, opts: &Options, run_dir: PathBuf) -> R<Runner> {
    let plan = plan(cfg, opts.hook.as_deref())?;
    let scratch = Scratch::create(plan.shm_bytes).map_err(setup_err)?;
    let env = plan.worker_env(cfg, &scratch);
    let out = open_outputs(cfg, &run_dir)?;
    let progress = announce(cfg, opts, &plan, &out, &scratch, &run_dir);
    let (workers, bridge, failed) = launch_workers(cfg, &plan, &env, &scratch, &run_dir);
    let runner = Runner {
        cfg: cfg.clone(),
        task: plan.task,
        shape: plan.shape,
        profile: plan.profile,
        started: Instant::now(),
        workers,
        bridge,
        scratch,
        run_dir,
        api: plan.api,
        step: 0,
        phase: "setup".into(),
        step_memory: Vec::new(),
        step_times: BTreeMap::new(),
        steps_completed: 0,
        peak_used: vec![0; cfg.total_devices()],
        metrics_file: out.metrics_file,
        memory_file: out.memory_file,
        loggers: out.loggers,
        bucket_bytes: plan.bucket_bytes,
        weights_checksum: None,
        leak_baseline: BTreeMap::new(),
        progress,
        device_label: plan.device_label,
        checks_passed: 0,
    };
    if let Some(e) = failed {
        let mut r = runner;
        r.stop_workers(false);
        return Err(e);
    }
    Ok(runner)
}

/// Starts every worker with the run's launcher; returns those started (and the Ray bridge), and
/// why the others did not start.
fn launch_workers(
    cfg: &Config,
    plan: &Plan,
    env: &[(String, String)],
    scratch: &Scratch,
    run_dir: &Path,
) -> (Vec<Worker>, Option<ray::Bridge>, Option<RunError>) {
    if cfg.run.launcher == Launcher::Ray {
        let bucket = (scratch.shm.as_path(), plan.shm_bytes);
        return match ray::start_workers(cfg, plan.device, env, scratch.tmp.path(), run_dir, bucket) {
            Ok((w, b)) => (w, Some(b), None),
            Err(e) => (Vec::new(), None, Some(e)),
        };
    }
    let mut workers = Vec::new();
    for rank in 0..cfg.run.devices {
        for role in [Role::Rollout, Role::Trainer] {
            match spawn_worker(cfg, role, rank, env, &scratch.sock_dir, run_dir) {
                Ok(w) => workers.push(w),
                Err(e) => return (workers, None, Some(e)),
            }
        }
    }
    (workers, None, None)
}

/// The socket a worker connects to, listening.
pub(super) fn listen(sock: &Path) -> R<UnixListener> {
    let listener =
        UnixListener::bind(sock).map_err(|e| setup_err(format!("cannot listen on {}: {e}", sock.display())))?;
    listener.set_nonblocking(true).map_err(|e| setup_err(e.to_string()))?;
    Ok(listener)
}

/// The command a worker of `role` runs: the configured one under `/bin/sh -c`, else this
/// executable's built-in worker.
pub(super) fn worker_argv(cfg: &Config, role: Role) -> R<Vec<String>> {
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
pub(super) fn worker_vars(
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
        Ok((conn, pid)) => {
            let pid = pid.unwrap_or(child.id());
            let proc = Proc::Local(child);
            Ok(Worker {
                name,
                role,
                rank,
                device: rank,
                proc,
                conn: Some(conn),
                pid,
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
            Err(RunError { kind, step: 0, phase: "start".into(), worker: Some(name), cause })
        }
    }
}

/// Waits for the child's connection and hello: the connection and the pid it names, or how the
/// wait failed (Crash when the child exited first).
fn hello_from_child(
    child: &mut Child,
    listener: &UnixListener,
    role: Role,
    sock: &Path,
    deadline: Instant,
) -> Result<(wire::Conn, Option<u32>), (FailKind, String)> {
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
    Ok((conn, hello.pid))
}
