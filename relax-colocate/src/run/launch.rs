//! Starting a run: the run directory, the environment workers get (hook, control folder,
//! simulator), the temp and shared-memory files, and each worker up to its hello.

use super::config::{self, AlgoName, Config, DeviceChoice, Launcher};
use super::signals::interruption;
use super::sizing::{check_host_memory_for_sim, footprint, round_up, sim_context_bytes};
use super::supervise::{describe_exit, phase_timeout};
use super::task::{Addition, VOCAB};
use super::{
    FailKind, GRANULARITY, MIB, Options, Proc, R, Role, RunError, Runner, Worker, config_err, model, profile, protocol,
    ray, report, setup_err, tmpfiles, wire,
};
use crate::bench::find_hook;
use crate::runtime::can_load;
use crate::simulator::sim_environment;
use std::collections::BTreeMap;
use std::os::unix::net::UnixListener;
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
    let hello = match protocol::read_hello(hello, role.as_str()) {
        Ok(h) => h,
        Err(cause) => return Err(fail(&mut child, cause)),
    };
    let pid = hello.pid.unwrap_or(child.id());
    Ok(Worker {
        name,
        role,
        rank,
        device: rank,
        proc: Proc::Local(child),
        conn: Some(conn),
        pid,
        log,
        control: None,
        control_relay: None,
        next_id: 0,
    })
}

pub(super) fn start(cfg: &Config, opts: &Options, run_dir: PathBuf) -> R<Runner> {
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
            let explicit = config::parse_size(&cfg.sim.memory).map_err(config_err)?;
            // The simulator would replace a capacity under its granularity by its 16 GiB default,
            // and a device without room for both contexts fails every worker's first call.
            if explicit < contexts + GRANULARITY {
                return Err(config_err(format!(
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
    if cfg.run.launcher == Launcher::Ray {
        device_label = format!(
            "{device_label}; placed by Ray ({}): {} node(s) x {} device(s)",
            cfg.run.ray_address.trim(),
            cfg.run.nodes,
            cfg.run.devices
        );
    }
    std::fs::write(run_dir.join("config.toml"), cfg.to_toml()).map_err(|e| setup_err(e.to_string()))?;
    let open = |name: &str| std::fs::File::create(run_dir.join(name)).map_err(|e| setup_err(e.to_string()));
    let metrics_file = open("metrics.jsonl")?;
    let memory_file = open("memory.jsonl")?;
    let kinds = super::loggers::parse_list(&cfg.metrics.loggers).map_err(setup_err)?;
    let loggers = super::loggers::Loggers::open(&kinds, &run_dir, &cfg.metrics.python, &cfg.metrics.wandb_project)
        .map_err(|cause| RunError { kind: FailKind::Config, ..setup_err(cause) })?;
    let shm_dir = if shm_dir.is_dir() { shm_dir.to_path_buf() } else { tmp.path().to_path_buf() };
    let shm_bytes = fp.transfer.max(4096);
    let shm = tempfile::Builder::new()
        .prefix(&format!("{}{owner}", tmpfiles::BUCKET_PREFIX))
        .tempfile_in(&shm_dir)
        .map_err(|e| setup_err(format!("cannot create the update bucket file in {}: {e}", shm_dir.display())))?;
    shm.as_file().set_len(shm_bytes).map_err(|e| setup_err(e.to_string()))?;
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
    for line in loggers.describe() {
        progress.note(&format!("relax-colocate run: {line}"));
    }
    // The workers' control sockets live in the run's private folder, which `tms-ctl list` does
    // not look in by default: say how to reach them while the run goes on.
    if cfg.run.launcher == Launcher::Local {
        progress.note(&format!(
            "relax-colocate run: workers' control sockets in {0} (`tms-ctl --dir {0} list`)",
            ctl_dir.display()
        ));
    }
    let mut workers = Vec::new();
    let mut bridge = None;
    let mut runner_err = None;
    if cfg.run.launcher == Launcher::Ray {
        match ray::start_workers(cfg, device, &env, tmp.path(), &run_dir, (&shm_path, shm_bytes)) {
            Ok((w, b)) => {
                workers = w;
                bridge = Some(b);
            }
            Err(e) => runner_err = Some(e),
        }
    } else {
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
    }
    let runner = Runner {
        cfg: cfg.clone(),
        task,
        shape,
        profile,
        started: Instant::now(),
        workers,
        bridge,
        _tmp: tmp,
        ctl_dir,
        run_dir,
        api,
        step: 0,
        phase: "setup".into(),
        step_memory: Vec::new(),
        step_times: BTreeMap::new(),
        steps_completed: 0,
        peak_used: vec![0; cfg.total_devices()],
        metrics_file,
        memory_file,
        loggers,
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
