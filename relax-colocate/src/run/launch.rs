//! Starting a run, in two parts. `plan` resolves everything the run will use without changing
//! anything: the device and its API, the hook, the model's shape and memory profile, the weight
//! bucket, and on the simulator the device's size and environment (refusing what cannot run here).
//! `start` then acts on the plan: it sweeps what dead runs left, makes the temp and shared-memory
//! files (fleet/tmpfiles.rs), opens the run directory's outputs (the recorder's), and launches the
//! fleet: each worker up to its hello (fleet/local.rs, or through Ray: fleet/ray.rs).

use super::config::{self, AlgoName, Config, DeviceChoice, Launcher, WeightTransport};
use super::fleet::Fleet;
use super::fleet::ray_python::{self, RayPython};
use super::fleet::tmpfiles::Scratch;
use super::profile::Profile;
use super::recorder::report::{Progress, human};
use super::recorder::{Outputs, Recorder};
use super::sizing::{
    Footprint, check_host_memory_for_sim, footprint, host_footprint, round_up, sim_communicator_bytes,
};
use super::task::{Addition, VOCAB};
use super::{Cursor, FailKind, GRANULARITY, MIB, Options, R, RunError, config_err, model, profile, setup_err};
use crate::environment::{SimNode, find_hook, provide_relax_worker, sim_environment};
use crate::runtime::{can_load, has_symbol};
use crate::vendor::ApiKind;
use std::path::{Path, PathBuf};

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
    pub(super) api: ApiKind,
    hook: PathBuf,
    pub(super) task: Addition,
    pub(super) shape: model::Shape,
    pub(super) profile: Profile,
    pub(super) bucket_bytes: u64,
    /// run.weight_transport resolved for this machine (`Config::weight_transport`, then `auto`'s
    /// ipc falls back to host on a CANN without the IPC calls).
    pub(super) transport: WeightTransport,
    /// The size of the file one bucket of weights crosses in.
    shm_bytes: u64,
    sim: Option<SimDevice>,
    /// The device as the run's first line and the summary name it.
    pub(super) device_label: String,
    /// The Python that runs the Ray bridge (launcher ray).
    ray_python: Option<RayPython>,
}

/// The simulated device: its size (the environment that puts a worker on it comes from
/// `tms-sim env`, given this and the run's scratch folder).
struct SimDevice {
    capacity: u64,
    /// What each process's context takes of it.
    contexts: u64,
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

/// The broadcast transport of the built-in workers on a real device needs the vendor's collective
/// library here (the simulator brings both; a worker command brings its own, as PyTorch does).
fn check_collective_library(cfg: &Config, device: DeviceChoice) -> R<()> {
    if cfg.weight_transport() != WeightTransport::Broadcast || !cfg.builtin_workers() {
        return Ok(());
    }
    let (lib, vendor) = match device {
        DeviceChoice::Cuda => (c"libnccl.so.2", "install NCCL (the nvidia-nccl wheel's lib/ on LD_LIBRARY_PATH)"),
        DeviceChoice::Npu => (c"libhccl.so", "source CANN's set_env.sh"),
        _ => return Ok(()),
    };
    if can_load(lib) {
        return Ok(());
    }
    Err(config_err(format!(
        "run.weight_transport = \"broadcast\": {} cannot be loaded here; {vendor}, or use --weight-transport host",
        lib.to_string_lossy()
    )))
}

/// The IPC transport on an NPU needs CANN's IPC memory-sharing calls (the simulator and every
/// CUDA runtime have them): `auto` falls back to host without them, an explicit ipc is refused.
fn resolve_transport(cfg: &Config, device: DeviceChoice) -> R<WeightTransport> {
    let t = cfg.weight_transport();
    if t != WeightTransport::Ipc
        || device != DeviceChoice::Npu
        || has_symbol(c"libascendcl.so", c"aclrtIpcMemGetExportKey")
    {
        return Ok(t);
    }
    if cfg.run.weight_transport == WeightTransport::Auto {
        return Ok(WeightTransport::Host);
    }
    Err(config_err(
        "run.weight_transport = \"ipc\": this CANN's libascendcl.so has no aclrtIpcMemGetExportKey (IPC memory \
         sharing); update CANN, or use --weight-transport host"
            .to_string(),
    ))
}

/// Resolves the run without side effects; every refusal the configuration earns here comes before
/// anything is created.
pub(super) fn plan(cfg: &Config, hook: Option<&Path>) -> R<Plan> {
    let device = resolve_device(cfg)?;
    check_collective_library(cfg, device)?;
    let transport = resolve_transport(cfg, device)?;
    let hook = find_hook(hook).map_err(setup_err)?;
    // The simulator serves both runtimes; sim.api picks the one the workers use.
    let api = match device {
        DeviceChoice::Npu => ApiKind::Acl,
        DeviceChoice::Sim => cfg.sim_api(),
        // Resolved: Auto is one of the others by now.
        DeviceChoice::Cuda | DeviceChoice::Auto => ApiKind::Cuda,
    };
    let task = Addition::new(cfg.task.digits, cfg.task.max_new_tokens);
    let shape =
        model::Shape { vocab: VOCAB, context: task.prompt_len() + task.max_new_tokens() - 1, hidden: cfg.model.hidden };
    let profile = profile::build(&cfg.memory.profile, cfg.memory.tp, cfg.memory.scale, cfg.memory.kv_cache_gib)
        .map_err(setup_err)?;
    let bucket_bytes = config::parse_size(&cfg.memory.update_weight_buffer_size).map_err(setup_err)?;
    let fp = footprint(cfg, &shape, &profile, bucket_bytes);
    let sim = if device == DeviceChoice::Sim { Some(plan_sim(cfg, api, &shape, bucket_bytes, &fp)?) } else { None };
    let device_label = device_label(cfg, device, api, sim.as_ref(), &fp);
    let shm_bytes = fp.transfer.max(4096);
    let ray_python = match cfg.run.launcher {
        Launcher::Ray => Some(ray_python::choose(cfg).map_err(config_err)?),
        Launcher::Local => None,
    };
    Ok(Plan {
        device,
        api,
        hook,
        task,
        shape,
        profile,
        bucket_bytes,
        transport,
        shm_bytes,
        sim,
        device_label,
        ray_python,
    })
}

/// Sizes the simulated device, or refuses a run the host or the configured size cannot hold.
fn plan_sim(cfg: &Config, api: ApiKind, shape: &model::Shape, bucket_bytes: u64, fp: &Footprint) -> R<SimDevice> {
    let host_at = |scale: f64| {
        let p = profile::build(&cfg.memory.profile, cfg.memory.tp, scale, cfg.memory.kv_cache_gib).ok()?;
        let f = host_footprint(cfg, shape, &p, bucket_bytes);
        Some(f.trainer + f.rollout)
    };
    let host = host_at(cfg.memory.scale).unwrap_or(fp.trainer + fp.rollout);
    check_host_memory_for_sim(cfg, host, host_at)
        .map_err(|cause| RunError { kind: FailKind::Config, ..setup_err(cause) })?;
    // Asked here too so that a missing tms-sim fails the plan, before anything is made.
    let sim_env = sim_environment(&SimNode::default()).map_err(setup_err)?;
    let mut peak = fp.trainer.max(fp.rollout).max(fp.rollout_weights + 2 * fp.transfer);
    // Auto: async workers that may speak broadcast, which their hellos decide only later.
    if matches!(cfg.weight_transport(), WeightTransport::Broadcast | WeightTransport::Auto) {
        // Each member also holds its communicator and a bucket buffer; the root has a peer per engine.
        let engines = cfg.mode_layout().ok().flatten().map_or(1, |s| s.rollout.len() as u64);
        peak = peak.max(fp.trainer.max(fp.rollout) + fp.transfer + sim_communicator_bytes(api, engines));
    }
    // Each device holds two processes, and each process's context takes device memory.
    let contexts = 2 * sim_env.context_bytes(api);
    if cfg.sim.memory == "auto" {
        let capacity = round_up(peak + contexts + (fp.trainer.min(fp.rollout) / 2).min(64 * MIB), GRANULARITY);
        return Ok(SimDevice { capacity, contexts });
    }
    let capacity = config::parse_size(&cfg.sim.memory).map_err(config_err)?;
    // The simulator would replace a capacity under its granularity by its 16 GiB default, and a
    // device without room for both contexts fails every worker's first call.
    if capacity < contexts + GRANULARITY {
        return Err(config_err(format!(
            "sim.memory={} leaves no room on the device: the trainer's and the rollout's \
             contexts take {} of it; give at least {} (or sim.memory=auto)",
            cfg.sim.memory,
            human(contexts),
            human(contexts + GRANULARITY)
        )));
    }
    Ok(SimDevice { capacity, contexts })
}

fn device_label(cfg: &Config, device: DeviceChoice, api: ApiKind, sim: Option<&SimDevice>, fp: &Footprint) -> String {
    let label = match (device, sim) {
        (DeviceChoice::Cuda, _) => "CUDA".to_string(),
        (DeviceChoice::Npu, _) => "Ascend NPU (ACL)".to_string(),
        (_, Some(sim)) => format!(
            "tms-sim ({} API), {} x {} (trainer needs {}, rollout {}, their contexts {})",
            match api {
                ApiKind::Acl => "ACL",
                ApiKind::Cuda => "CUDA",
            },
            cfg.run.devices,
            human(sim.capacity),
            human(fp.trainer),
            human(fp.rollout),
            human(sim.contexts)
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
    fn worker_env(&self, cfg: &Config, scratch: &Scratch) -> Result<Vec<(String, String)>, String> {
        let mut env: Vec<(String, String)> = vec![
            ("LD_PRELOAD".into(), self.hook.display().to_string()),
            ("TMS_CONTROL".into(), "1".into()),
            ("TMS_CONTROL_DIR".into(), scratch.ctl_dir.display().to_string()),
            ("RELAX_DEVICE_API".into(), self.api.as_str().into()),
            // The runner pauses and resumes its workers itself; a pause from outside (tms-ctl
            // without --force) is refused, naming it.
            ("TMS_MANAGED_BY".into(), format!("relax-colocate run (pid {})", std::process::id())),
        ];
        // Each worker's log (logs/<worker>.log) says what its hook did: every pause and resume
        // with its bytes and timing, not only the warnings. A TMS_LOG of the user's wins.
        if std::env::var_os("TMS_LOG").is_none() {
            env.push(("TMS_LOG".into(), "info".into()));
        }
        // The members of a collective that joined give up on one that never comes before the
        // runner's own wait on it ends, so that the runner can tell which one it was. CANN takes
        // 120 to 7200 s.
        env.push(("HCCL_CONNECT_TIMEOUT".into(), connect_timeout_s(cfg).clamp(120, 7200).to_string()));
        if let Some(sim) = &self.sim {
            env.extend(self.sim_env(cfg, scratch, sim)?);
        }
        provide_relax_worker(&mut env, &scratch.tmp.path().join("python"))?;
        Ok(env)
    }

    /// What puts a worker on the simulated device, as `tms-sim env` gives it.
    fn sim_env(&self, cfg: &Config, scratch: &Scratch, sim: &SimDevice) -> Result<Vec<(String, String)>, String> {
        // Python workers (scripts/torch_worker.py) get the start-up hook that puts PyTorch on
        // the simulator with the rest of the environment. The simulator's connect timeout takes
        // any number of seconds.
        let link = cfg.sim.link_gbps.trim();
        let node = SimNode {
            dir: Some(scratch.tmp.path().join("sim")),
            name: Some("relax".into()),
            devices: Some(cfg.run.devices),
            memory: Some(sim.capacity.to_string()),
            // 0 has always left the simulator's own copy bus in place.
            copy_gbps: Some(cfg.sim.copy_gbps).filter(|g| *g > 0.0),
            link_gbps: Some(link.to_string()).filter(|l| !l.is_empty()),
            connect_timeout_s: Some(connect_timeout_s(cfg)),
            commit: false,
        };
        Ok(sim_environment(&node)?.vars)
    }
}

/// How long a collective's members wait for each other to join: half of run.phase_timeout_s,
/// which leaves the runner time to hear from every member that did join before its own wait on
/// the one that did not ends.
fn connect_timeout_s(cfg: &Config) -> u64 {
    ((cfg.run.phase_timeout_s / 2.0).floor() as u64).max(1)
}

/// The lines a run starts with: what it removed, what it runs where, its loggers, and (local
/// launcher) how to reach its workers' control sockets.
fn announce(cfg: &Config, opts: &Options, plan: &Plan, out: &Outputs, scratch: &Scratch, run_dir: &Path) -> Progress {
    let progress = Progress::new(opts.quiet || opts.json);
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
    if let Some(py) = &plan.ray_python {
        progress.note(&format!("relax-colocate run: the Ray bridge runs on {}", py.describe()));
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

/// Acts on the plan: files, outputs, then the workers; returns the plan with the fleet and the
/// recorder a driver runs over.
pub(super) fn start(cfg: &Config, opts: &Options, plan: Plan, run_dir: PathBuf) -> R<(Plan, Fleet, Recorder)> {
    let scratch = Scratch::create(plan.shm_bytes, opts.ctl_dir.as_deref()).map_err(setup_err)?;
    let env = plan.worker_env(cfg, &scratch).map_err(setup_err)?;
    let out = Outputs::open(cfg, &run_dir)?;
    // Where to point `tms-ctl --dir` while the run is going, for scripts that watch it.
    std::fs::write(run_dir.join("ctl_dir"), format!("{}\n", scratch.ctl_dir.display()))
        .map_err(|e| setup_err(format!("cannot write {}: {e}", run_dir.join("ctl_dir").display())))?;
    let progress = announce(cfg, opts, &plan, &out, &scratch, &run_dir);
    let at = Cursor::new();
    let fleet = Fleet::launch(cfg, plan.ray_python.as_ref(), plan.device, &env, scratch, &run_dir, at.clone())?;
    let rec = Recorder::new(cfg, at, run_dir, plan.device_label.clone(), fleet.placed_names(), out, progress);
    Ok((plan, fleet, rec))
}
