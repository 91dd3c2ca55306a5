//! The real consumers on the simulator: PyTorch's CUDA 13.2 build from the package index and
//! torch_memory_saver 0.0.10, installed once into a cached virtual environment by
//! scripts/torch-env.sh (about 3 GB the first time). The scenarios are pytest files under
//! tests/torch-consumers/; each runs its Python snippets in fresh processes on private simulated nodes.
//!
//! `TMS_TORCH_TESTS=0` skips them (and says so), for machines that cannot reach the package index.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use tms_e2e::*;

/// The test environment's Python (PyTorch's CUDA 13.2 build), or None when the user opted out.
fn torch_python() -> Option<&'static PathBuf> {
    static PY: OnceLock<Option<PathBuf>> = OnceLock::new();
    PY.get_or_init(|| prepared_python(13)).as_ref()
}

/// The CUDA 12 test environment's Python (PyTorch 2.9.1, built for CUDA 12.8), or None when the
/// user opted out.
fn torch12_python() -> Option<&'static PathBuf> {
    static PY: OnceLock<Option<PathBuf>> = OnceLock::new();
    PY.get_or_init(|| prepared_python(12)).as_ref()
}

/// The Ascend test environment's Python (torch_npu 2.9.1 beside PyTorch 2.9.1), or None when the
/// user opted out.
fn torch_npu_python() -> Option<&'static PathBuf> {
    static PY: OnceLock<Option<PathBuf>> = OnceLock::new();
    PY.get_or_init(|| prepared_env(&["--npu"])).as_ref()
}

fn prepared_python(cuda_major: u32) -> Option<PathBuf> {
    prepared_env(&["--cuda", &cuda_major.to_string()])
}

fn prepared_env(args: &[&str]) -> Option<PathBuf> {
    if std::env::var("TMS_TORCH_TESTS").is_ok_and(|v| v == "0") {
        eprintln!("TMS_TORCH_TESTS=0: skipping the real-PyTorch tests");
        return None;
    }
    let ws = workspace();
    let out = Command::new(ws.root.join("scripts/torch-env.sh"))
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run scripts/torch-env.sh");
    assert!(
        out.status.success(),
        "scripts/torch-env.sh {} could not prepare PyTorch (see above); TMS_TORCH_TESTS=0 skips these tests",
        args.join(" ")
    );
    Some(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()))
}

/// The tms-memory-saver wheel, built once per test binary by scripts/build-wheel.sh (glibc 2.17
/// through cargo-zigbuild; the script checks the symbol versions).
fn wheel() -> &'static PathBuf {
    static WHEEL: OnceLock<PathBuf> = OnceLock::new();
    WHEEL.get_or_init(|| {
        let ws = workspace();
        let out_dir = ws.c_out.join("wheel");
        let _ = std::fs::remove_dir_all(&out_dir);
        let out = Command::new(ws.root.join("scripts/build-wheel.sh"))
            .arg(&out_dir)
            .stderr(std::process::Stdio::inherit())
            .output()
            .expect("run scripts/build-wheel.sh");
        assert!(out.status.success(), "scripts/build-wheel.sh failed (exit {:?}; see above)", out.status.code());
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
}

/// Runs a pytest file of tests/torch-consumers/, whose scenarios start their own processes on
/// private simulated nodes. `with_wheel`: the file installs the wheel (TMS_TEST_WHEEL).
fn pytest(file: &str) {
    pytest_with(file, false)
}

fn pytest_with(file: &str, with_wheel: bool) {
    let Some(python) = torch_python() else { return };
    pytest_under(python, file, with_wheel);
}

fn pytest_under(python: &PathBuf, file: &str, with_wheel: bool) {
    pytest_files(python, &[file], with_wheel, &[]);
}

/// Runs pytest files of tests/torch-consumers/ in one pytest process (they share its
/// session fixtures, such as the venv with the wheel), with `env` set.
fn pytest_files(python: &PathBuf, files: &[&str], with_wheel: bool, env: &[(&str, &str)]) {
    let ws = workspace();
    let scratch = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(python);
    if with_wheel {
        cmd.env("TMS_TEST_WHEEL", wheel());
    }
    cmd.envs(env.iter().copied());
    cmd.current_dir(ws.root.join("tests/torch-consumers"))
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rxXs"])
        .args(files)
        .env("TMS_TEST_SIM", ws.bin("tms-sim"))
        .env("TMS_TEST_HOOK", ws.hook())
        .env("TMS_TEST_TMP", scratch.path())
        .env_remove("LD_PRELOAD");
    run_pytest(cmd, &files.join(" "));
}

/// Runs a pytest file whose own process is on the simulator, as after `eval "$(tms-sim env)"`.
fn pytest_on_simulator(file: &str) {
    let Some(python) = torch_python() else { return };
    let ws = workspace();
    let scratch = tempfile::tempdir().unwrap();
    let path = ws.root.join(file);
    let mut cmd = Command::new(python);
    cmd.current_dir(scratch.path())
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rxXs"])
        .arg(&path)
        .envs(ws.sim_env(&[
            "--node",
            &format!("torch-layer-{}", std::process::id()),
            "--dir",
            &scratch.path().display().to_string(),
        ]))
        .env("TMS_TEST_HOOK", ws.hook())
        // Two cores: one kernel thread each avoids oversubscription in the CPU-computed ops.
        .env("OMP_NUM_THREADS", "1")
        .env_remove("LD_PRELOAD")
        .env_remove("TMS_SIM_TORCH_LAYER");
    let text = run_pytest(cmd, file);
    assert!(!text.contains(" skipped"), "{file}: tests were skipped on the simulator:\n{text}");
}

fn run_pytest(mut cmd: Command, file: &str) -> String {
    let out = cmd.output().expect("run pytest");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success(), "pytest {file} failed:\n{text}");
    text
}

#[test]
fn pytorch_runs_on_the_simulator() {
    pytest("test_sim_torch.py");
}

/// The simulator's scenarios and the hook under torch_memory_saver's package (its `_cu12`
/// libraries) with PyTorch's CUDA 12.8 build, whose libraries import the runtime as
/// `@libcudart.so.12` and expect CUDA 12's `cudaDeviceProp` layout and 6-argument capture query.
#[test]
fn pytorch_built_for_cuda_12_runs_on_the_simulator_with_the_hook() {
    let Some(python) = torch12_python() else { return };
    pytest_under(python, "test_sim_torch.py", false);
    pytest_under(python, "test_hook_under_torch.py", false);
}

/// torch_npu 2.9.1 unchanged on the simulator's Ascend devices (test_torch_npu.py): its caching
/// allocator's memory path, the tms-memory-saver wheel pausing and resuming its memory in preload
/// and torch modes (with tms-ctl looking on), operators computed on the CPU (a model's training
/// steps exact against the CPU's, torch_npu's own operators refused by name), torch.distributed's
/// "hccl" backend between two simulated NPUs, and verl's stateless HCCL weight sync on the same
/// tensors. In the same pytest process, the Ascend kit's programs (test_npu_programs.py, which
/// npu-check.sh runs on a 910B) on device "npu" through the wheel.
#[test]
fn torch_npu_runs_on_the_simulator_with_the_wheel_and_hccl() {
    let Some(python) = torch_npu_python() else { return };
    pytest_files(python, &["test_torch_npu.py", "test_npu_programs.py"], true, &[("TMS_TEST_DEVICE", "npu")]);
}

/// torch.distributed's "nccl" backend on the simulator's libnccl.so.2 (2 and 4 ranks, against
/// gloo), a rank killed mid-broadcast, and NCCL's C ABI with bad input (test_nccl.py).
#[test]
fn torch_distributed_nccl_runs_on_the_simulator() {
    pytest("test_nccl.py");
}

/// `dist.all_reduce` captured in `torch.cuda.graph` by an unchanged 2-rank program and replayed,
/// the collective performed with the peer at each replay (test_nccl_graphs.py).
#[test]
fn torch_collectives_captured_in_cuda_graphs_replay_with_the_peers() {
    pytest("test_nccl_graphs.py");
}

/// CUDA IPC when the exporter frees what it shared: the importer keeps reading the pages it
/// opened, and the exporter's next allocation is other memory; so the preloaded hook refuses
/// every export of region memory (CUDA IPC, Ascend IPC keys, NCCL windows), naming the tag
/// (test_cuda_ipc.py).
#[test]
fn cuda_ipc_importers_keep_the_pages_they_opened_and_region_memory_is_never_exported() {
    pytest("test_cuda_ipc.py");
}

/// Tag `nccl` under an unchanged torch.distributed program: 2 ranks with the hook, a default and a
/// second NCCL process group, paused and resumed through tms's Python API and tms-ctl; a
/// collective while suspended, idempotence, groups destroyed while suspended
/// (test_nccl_pause.py).
#[test]
fn torch_process_groups_pause_with_the_tag_nccl() {
    pytest("test_nccl_pause.py");
}

/// The simulator's libhccl.so under a ctypes client written from CANN's documentation, as
/// vllm-ascend's communicator loads it (test_hccl.py).
#[test]
fn hccl_clients_run_on_the_simulator() {
    pytest("test_hccl.py");
}

/// The frameworks' weight-sync call sequences on the simulator's NCCL and HCCL: SGLang's
/// weights-update group driven as slime drives it, and verl's stateless group with a ctypes
/// communicator, including its group-creation race (test_weight_sync.py).
#[test]
fn weight_sync_call_sequences_of_sglang_slime_and_verl() {
    pytest("test_weight_sync.py");
}

#[test]
fn hook_under_real_torch_and_torch_memory_saver_package() {
    pytest("test_hook_under_torch.py");
}

#[test]
fn our_python_package_isolates_regions_in_pytorch() {
    pytest("test_tms_package.py");
}

/// A fragmented pool paused through tms and torch_memory_saver copies only the blocks PyTorch's
/// caching allocator has in use; with TMS_BACKUP_LIVE_ONLY=0, whole segments (test_live_only.py).
#[test]
fn a_fragmented_pool_backs_up_only_its_live_blocks() {
    pytest("test_live_only.py");
}

/// scripts/soak-verify.py for 30 cycles: a churning pool paused and resumed with every restore
/// verified, no tensor changed, free memory back where cycle 1 left it (test_soak_verify.py).
#[test]
fn verified_cycles_of_a_churning_pool_change_nothing_and_leak_nothing() {
    pytest("test_soak_verify.py");
}

#[test]
fn sglang_and_slime_call_sequences_with_ours_the_wheel_and_upstream() {
    pytest_with("test_frameworks.py", true);
}

/// The scenarios of torch_memory_saver's `test_examples.py` that no other test covers, re-enacted:
/// its scenario scripts are not in the sdist that CI can download.
#[test]
fn torch_memory_saver_s_example_scenarios_with_ours_the_wheel_and_upstream() {
    pytest_with("test_upstream_scenarios.py", true);
}

#[test]
fn the_wheel_installs_with_pip_and_replaces_torch_memory_saver() {
    pytest_with("test_wheel.py", true);
}

#[test]
fn cpu_compute_layer_matches_the_cpu_exactly() {
    pytest_on_simulator("tms-sim/python/tests/test_cpu_layer.py");
}

#[test]
fn cuda_graphs_capture_and_replay_through_the_layer() {
    pytest_on_simulator("tms-sim/python/tests/test_cuda_graphs.py");
}

/// torch_memory_saver's own tests, unchanged, from its pinned sdist on the package index (the
/// files that run without the repository's test/examples/), against its package, its Python over
/// our hook, and our wheel. scripts/upstream-suite.sh checks each variant imports its own package.
#[test]
fn torch_memory_saver_own_tests_pass_with_its_package_our_hook_and_our_wheel() {
    let Some(_) = torch_python() else { return };
    let ws = workspace();
    let out = Command::new(ws.root.join("scripts/upstream-suite.sh"))
        .args(["--sdist", "all"])
        .env("TMS_UPSTREAM_WHEEL", wheel())
        .env_remove("LD_PRELOAD")
        .output()
        .expect("run scripts/upstream-suite.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success(), "torch_memory_saver's own tests failed:\n{text}");
    for variant in ["upstream", "ours", "wheel"] {
        let section = text
            .split(&format!("== torch_memory_saver's suite with {variant} libraries"))
            .nth(1)
            .unwrap_or_else(|| panic!("the {variant} variant did not run:\n{text}"));
        let summary = section.lines().find(|l| l.contains(" passed")).unwrap_or("");
        let passed: u32 = summary.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0);
        // test_configure_subprocess.py has 3 tests and test_utils.py 7 in 0.0.10.
        assert!(
            passed >= 10 && !summary.contains("failed") && !summary.contains("error"),
            "{variant}: {summary}\n{text}"
        );
    }
}

/// `relax-colocate run` with real PyTorch workers (scripts/torch_worker.py, both roles): a small
/// transformer trained with AdamW in the trainer's tags, the rollout's weights and KV cache in
/// its own, weights handed over every step by CUDA IPC (`--weight-transport ipc`: the trainer's
/// cudaMalloc'd buffer, opened by the rollout, no byte through the host). The runner gives the
/// workers the simulator's Python start-up hook itself; its checks compare the weights after
/// wake_up and update_weights.
#[test]
fn the_colocated_cycle_runs_with_pytorch_workers() {
    let Some(python) = torch_python() else { return };
    let ws = workspace();
    let out = tempfile::tempdir().unwrap();
    let worker =
        format!("env OMP_NUM_THREADS=1 {} {}", python.display(), ws.root.join("scripts/torch_worker.py").display());
    let run = Command::new(ws.bin("relax-colocate"))
        .current_dir(out.path())
        .args(["run", "--device", "sim", "--quiet", "--out"])
        .arg(out.path().join("run"))
        .args(["--steps", "2", "--prompts", "4", "--samples", "4", "--memory-profile", "tiny"])
        .args(["--trainer-cmd", &worker, "--rollout-cmd", &worker, "--weight-transport", "ipc"])
        .env_remove("LD_PRELOAD")
        .env_remove("PYTHONPATH")
        .env_remove("TMS_SIM_LIB")
        .output()
        .expect("run relax-colocate");
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "relax-colocate run with torch workers failed:\n{text}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("run/summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "ok", "{summary}");
    assert_eq!(summary["steps_completed"], 2, "{summary}");
    assert!(summary["checks"]["passed"].as_u64().unwrap() >= 10, "{summary}");
    let w = &summary["weight_sync"];
    assert_eq!(w["weight_transport"], "ipc", "{w}");
    assert_eq!(w["update_weights_host_bytes"], 0, "{w}");
    assert!(w["update_weights_bytes"].as_u64() > Some(0), "{w}");
    // The trainer's tensors were in its tags while it trained and gone from the device asleep.
    let samples: Vec<serde_json::Value> = std::fs::read_to_string(out.path().join("run/memory.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let trainer_at = |phase: &str| {
        samples.iter().find(|s| s["phase"] == phase).map(|s| s["workers"]["trainer-0"].clone()).unwrap_or_default()
    };
    let trained = trainer_at("actor_train");
    let asleep = trainer_at("sleep");
    for tag in ["weights", "ref", "grads", "optimizer"] {
        assert!(trained[tag].as_u64().unwrap_or(0) > 0, "{tag} empty while training: {trained}");
        assert_eq!(asleep[tag].as_u64(), Some(0), "{tag} still on the device asleep: {asleep}");
    }
}

/// `relax-colocate run` with PyTorch workers in colocate mode on 2 simulated devices: the two
/// trainers form a torch.distributed "nccl" process group (init's `trainer_group`), train data-
/// parallel (each its share of a minibatch, gradients all-reduced), and sleep with their
/// communicators suspended (tag `nccl`). What a rank wins is the simulator's buffer figure,
/// (ranks - 1) x 2 channels x 2 x NCCL_BUFFSIZE (4 MiB) = 16 MiB, which ncclCommMemStats reports as
/// suspendable; the 1 MiB it keeps stays. The runner's checks pass: free memory rose by every
/// pause's bytes (the communicators' included), the replicas' weights agree at every hand-over and
/// after every wake_up. A collective on a suspended communicator raises (test_nccl_pause.py), so a
/// train step on one would fail the run; memory.jsonl shows none was suspended while the trainers
/// worked.
#[test]
fn the_colocated_cycle_suspends_the_trainers_process_group() {
    let Some(python) = torch_python() else { return };
    let ws = workspace();
    let out = tempfile::tempdir().unwrap();
    let worker =
        format!("env OMP_NUM_THREADS=1 {} {}", python.display(), ws.root.join("scripts/torch_worker.py").display());
    let run = Command::new(ws.bin("relax-colocate"))
        .current_dir(out.path())
        .args(["run", "--device", "sim", "--quiet", "--out"])
        .arg(out.path().join("run"))
        .args(["--devices", "2", "--steps", "2", "--prompts", "4", "--samples", "4", "--memory-profile", "tiny"])
        .args(["--trainer-cmd", &worker, "--rollout-cmd", &worker])
        .env_remove("LD_PRELOAD")
        .env_remove("PYTHONPATH")
        .env_remove("TMS_SIM_LIB")
        .env_remove("NCCL_BUFFSIZE")
        .env_remove("TMS_SIM_NCCL_CHANNELS")
        .env_remove("TMS_SIM_NCCL_PERSISTENT_MEMORY")
        .output()
        .expect("run relax-colocate");
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "relax-colocate run with two torch trainers failed:\n{text}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("run/summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "ok", "{summary}");
    assert_eq!(summary["steps_completed"], 2, "{summary}");
    let buffers = 2 * 2 * (4u64 << 20);
    let won = &summary["memory"]["communicator_bytes_suspended"];
    assert_eq!(*won, serde_json::json!({"trainer-0": buffers, "trainer-1": buffers}), "{summary}");
    // Per step, on each device: the rollout's offload, the trainer's sleep and its `nccl` pause
    // (3 free-memory checks), the trainer's checksum after wake_up and the rollout's after
    // update_weights (2); setup has the same but the wake_up: 2 x 2 x 5 + 2 x 4 = 28 (22 without
    // the communicators' pauses).
    assert!(summary["checks"]["passed"].as_u64().unwrap() >= 28, "{summary}");
    let samples: Vec<serde_json::Value> = std::fs::read_to_string(out.path().join("run/memory.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut slept = 0;
    for s in samples.iter().filter(|s| s["step"].as_u64() > Some(0)) {
        for t in ["trainer-0", "trainer-1"] {
            let (suspended, resident) = (&s["comm_suspended"][t], &s["workers"][t]["nccl"]);
            match s["phase"].as_str().unwrap() {
                "ref_log_probs" | "log_probs" | "actor_train" | "wake_up" => {
                    assert_eq!(suspended.as_u64(), Some(0), "{t} worked with its communicator suspended: {s}");
                    assert_eq!(resident.as_u64(), Some(buffers + (1 << 20)), "{s}");
                }
                "sleep" => {
                    assert_eq!(suspended.as_u64(), Some(buffers), "{s}");
                    assert_eq!(resident.as_u64(), Some(1 << 20), "only the persistent MiB stays asleep: {s}");
                    slept += 1;
                }
                _ => {}
            }
        }
    }
    assert_eq!(slept, 2 * 2, "a sleep per step and trainer");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.path().join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows[0]["memory/trainer-1/nccl_suspended/sleep_bytes"].as_u64(), Some(buffers), "{}", rows[0]);
    assert!(rows.iter().all(|r| r["train/grad_norm"].as_f64().is_some_and(f64::is_finite)), "{rows:?}");
    let plot = std::fs::read_to_string(out.path().join("run/memory_timeline.svg")).unwrap();
    assert!(plot.contains("communicator bytes suspended"), "the timeline's legend names them");
}

/// torch_worker.py's partial rollouts, called in-process: segments, `finished`, and sequences that
/// continue after their prefix as if generated in one go; its data-parallel trainers: the ranks'
/// shares add up to the whole minibatch, two ranks stay replicas, and with their communicators
/// suspended a train step fails with NCCL's error (tests/torch-consumers/test_torch_worker.py).
#[test]
fn the_torch_worker_continues_sequences_after_their_prefix() {
    pytest("test_torch_worker.py");
}

/// `relax-colocate run --mode MODE` (async or elastic) with the same PyTorch workers on `devices`
/// simulated devices: the trainer on device 0, a rollout engine on each of the others (elastic: and
/// a lent one beside the trainer).
fn torch_async_cmd(python: &std::path::Path, out: &std::path::Path, mode: &str, devices: u32) -> Command {
    let ws = workspace();
    let worker =
        format!("env OMP_NUM_THREADS=1 {} {}", python.display(), ws.root.join("scripts/torch_worker.py").display());
    let mut cmd = Command::new(ws.bin("relax-colocate"));
    cmd.current_dir(out)
        .args(["run", "--device", "sim", "--quiet", "--out"])
        .arg(out.join("run"))
        .args(["--mode", mode, "--devices", &devices.to_string(), "--steps", "3", "--max-staleness", "1"])
        .args(["--prompts", "4", "--samples", "4", "--memory-profile", "tiny", "--set", "task.digits=3"])
        .args(["--trainer-cmd", &worker, "--rollout-cmd", &worker])
        .env_remove("LD_PRELOAD")
        .env_remove("PYTHONPATH")
        .env_remove("TMS_SIM_LIB")
        .env_remove("RELAX_WORKER_FAULT");
    cmd
}

/// An async (or elastic) run with PyTorch workers: weights moved after every step and checked on
/// every engine (the runner's checks), samples at most one update stale, none dropped.
fn torch_async_run(
    python: &std::path::Path,
    out: &std::path::Path,
    mode: &str,
    devices: u32,
    extra: &[&str],
) -> serde_json::Value {
    let run = torch_async_cmd(python, out, mode, devices).args(extra).output().expect("run relax-colocate");
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "relax-colocate run --mode {mode} with torch workers {extra:?} failed:\n{text}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run/summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "ok", "{summary}");
    assert_eq!(summary["steps_completed"], 3, "{summary}");
    let a = &summary["async"];
    assert_eq!(a["samples_trained"].as_u64(), Some(3 * 16), "{a}");
    assert_eq!(a["weight_updates"].as_u64(), Some(3), "{a}");
    assert_eq!(a["dropped_stale_samples"].as_u64(), Some(0), "{a}");
    // The initial update and every step's are checked on every engine, and every batch against
    // the bound (3).
    let engines = u64::from(devices) - 1;
    assert!(summary["checks"]["passed"].as_u64().unwrap() >= 4 * engines + 3, "{summary}");
    let hist = a["staleness_histogram"].as_object().expect("a staleness histogram");
    assert!(hist.keys().all(|k| k.parse::<u64>().unwrap() <= 1), "{a}");
    // Overlap: the engines generated a batch while the trainer trained on the one before.
    assert!(hist.keys().any(|k| k != "0"), "{a}");
    // Async's default off-policy correction: the PyTorch trainer got each token's importance weight
    // (its own mean of those it applied), within the cap, and the stale tokens' are not 1.
    assert_eq!(summary["off_policy_correction"]["method"], "tis", "{summary}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let applied = |r: &serde_json::Value| r["train/tis_weight_mean"].as_f64().unwrap_or_else(|| panic!("{r}"));
    assert!(rows.iter().all(|r| applied(r) > 0.0 && applied(r) <= 2.0 && r["train/tis"].is_number()), "{rows:?}");
    let stale = |r: &&serde_json::Value| r["fully_async/staleness_max"].as_f64() >= Some(1.0);
    assert!(rows.iter().filter(stale).any(|r| (applied(r) - 1.0).abs() > 1e-3), "stale tokens weighted 1: {rows:?}");
    summary
}

/// Partial rollouts with real PyTorch workers, the weights broadcast over torch.distributed:
/// generation in one-token segments, decoding slowed to a modelled device's pace (the worker
/// sleeps out what the model says a request would take), so that the trainer finishes a step
/// while the engines are mid-sequence; the interrupted sequences continue after their tokens under
/// the new weights (re-prefilled) and are trained on.
///
/// The workers say in their hello that they speak the broadcast transport, so `auto` picks it:
/// the first trainer is rank 0 of a ProcessGroupNCCL on the simulator's libnccl.so.2, the two
/// engines ranks 1 and 2, and every update goes from rank 0 in buckets into each engine's weights,
/// which the runner's checks then find equal to the trainer's (training changes them every step).
#[test]
fn the_async_loop_runs_with_pytorch_workers_and_continues_interrupted_sequences() {
    let Some(python) = torch_python() else { return };
    let out = tempfile::tempdir().unwrap();
    // On a 10-TFLOPS device at 0.02% MFU a decoded token of the tiny profile takes 100 ms: a
    // batch's generation (16 sequences of up to 5 tokens) lasts seconds, several times a trainer
    // step here with the CPU layer queuing kernels (its default; TMS_SIM_TORCH_ASYNC=0 computes
    // them in the caller), whose trainer steps take twice as long.
    let summary = torch_async_run(
        python,
        out.path(),
        "async",
        3,
        &[
            "--set",
            "async.segment_tokens=1",
            "--set",
            "compute.model=true",
            "--set",
            "compute.tflops=10",
            "--set",
            "compute.rollout_mfu=0.0002",
        ],
    );
    let a = &summary["async"];
    assert_eq!(a["segment_tokens"].as_u64(), Some(1), "{a}");
    assert!(a["partial_samples"].as_u64().unwrap() > 0, "no sequence continued across an update: {a}");
    assert!(summary["compute"].as_str().unwrap().starts_with("modelled: tiny"), "{summary}");
    assert_eq!(a["weight_transport"], "broadcast", "{a}");
    assert_eq!(a["weight_sync_library"], "nccl", "{a}");
    assert!(a["update_weights_buckets"].as_u64().unwrap() >= 4, "a bucket at least per update: {a}");
    // The PyTorch engines report their modelled decode, so both are in the decode figures,
    // scheduled against the profile's KV capacity.
    let d = &summary["decode"]["rollout"];
    assert_eq!(d["devices"].as_u64(), Some(2), "{d}");
    assert!(d["tokens"].as_u64() > Some(0) && d["decode_steps"].as_f64() > Some(0.0), "{d}");
    assert!(d["slot_occupancy"].as_f64().is_some_and(|x| x > 0.0 && x <= 1.0), "{d}");
    assert!(d["kv_peak_share"].as_f64().is_some_and(|x| x > 0.0), "{d}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.path().join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let bytes = |r: &serde_json::Value| r["perf/update_weights_bytes"].as_f64();
    assert!(rows.iter().filter(|r| bytes(r).is_some()).all(|r| bytes(r) == bytes(&rows[0])), "{rows:?}");
    assert!(bytes(&rows[0]).is_some_and(|b| b > 0.0), "{}", rows[0]);
}

/// With `async.segment_tokens = 0` the engines get whole-response requests (no `segment_tokens`,
/// no `responses`), which is how a worker without partial rollouts runs in async mode; here in
/// elastic mode, whose lent engine (a third PyTorch worker, on the trainer's device) generates
/// while the trainer waits for its first batch (decoding slowed to a modelled device's pace, a
/// batch taking over a second; `elastic.lend_after_s` small so that the lend does not depend on
/// the machine's speed). The updates go by broadcast, the trainer's communicators suspended while
/// it lends its device; the lend's weights go by CUDA IPC (both workers name it), checked on the
/// lent engine; the reclaim gives the trainer back its exact weights (the runner's checksum
/// check), and the engine's extra groups leave none to go stale.
#[test]
fn the_elastic_loop_runs_with_pytorch_workers_generating_whole_responses() {
    let Some(python) = torch_python() else { return };
    let out = tempfile::tempdir().unwrap();
    let modelled = ["compute.model=true", "compute.tflops=10", "compute.rollout_mfu=0.001"];
    let mut extra = vec!["--set", "async.segment_tokens=0", "--set", "elastic.lend_after_s=0.05"];
    extra.extend(modelled.iter().flat_map(|s| ["--set", s]));
    let summary = torch_async_run(python, out.path(), "elastic", 2, &extra);
    let a = &summary["async"];
    assert_eq!(a["mode"], "elastic", "{a}");
    assert_eq!(a["segment_tokens"].as_u64(), Some(0), "{a}");
    assert_eq!(a["partial_samples"].as_u64(), Some(0), "{a}");
    assert_eq!(a["weight_transport"], "broadcast", "{a}");
    let e = &a["elastic"];
    assert!(e["lends"].as_u64().unwrap() >= 1, "the waiting trainer never lent its device: {e}");
    assert!(e["lent_tokens"].as_u64().unwrap() > 0, "the lent engine generated nothing: {e}");
    assert_eq!(e["forced_reclaims"], 0, "{e}");
    let log: Vec<serde_json::Value> = std::fs::read_to_string(out.path().join("run/lending.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let lends: Vec<_> = log.iter().filter(|d| d["action"] == "lend").collect();
    assert!(lends.len() >= 2 && lends.iter().all(|d| d["weights_transport"] == "ipc"), "{log:?}");
    assert!(lends.iter().all(|d| d["weights_bytes"].as_u64() > Some(0)), "{log:?}");
    assert_eq!(log.iter().filter(|d| d["action"] == "reclaim").count(), lends.len(), "{log:?}");
    // The trainer's communicators (the weight-sync group's) slept with it while it lent its device.
    let suspended = &summary["memory"]["communicator_bytes_suspended"]["trainer-0"];
    assert!(suspended.as_u64() > Some(0), "{summary}");
}

/// Elastic mode's reverse lend with PyTorch workers: a trainer-bound job (the trainer paced at
/// 0.1% of a 10-TFLOPS device, decoding at 5%), so that at step 2's train stage the engine has
/// filled the queue and may start nothing. The engine sleeps, a lent PyTorch trainer on its
/// device wakes and loads the trainer's state from its `torch.save` file (the actor, the
/// reference, the gradient buffers, AdamW's moments and step counts), both train the step at half
/// the batch each, and the runner's checks find the lent trainer's weights equal to the
/// trainer's after the load and again after the step: AdamW on both computed the same update
/// byte for byte, which a state transfer that missed a moment or a step count would break.
#[test]
fn the_reverse_lend_gives_a_lent_pytorch_trainer_the_trainers_exact_state() {
    let Some(python) = torch_python() else { return };
    let out = tempfile::tempdir().unwrap();
    let modelled = ["compute.model=true", "compute.tflops=10", "compute.train_mfu=0.001", "compute.rollout_mfu=0.05"];
    let mut extra = vec!["--set", "elastic.lend_rollout=true"];
    extra.extend(modelled.iter().flat_map(|s| ["--set", s]));
    let summary = torch_async_run(python, out.path(), "elastic", 2, &extra);
    let r = &summary["async"]["elastic"]["rollout_lend"];
    assert!(r["lends"].as_u64().unwrap() >= 1, "the idle engine never lent its device: {r}");
    assert!(r["state_bytes_mean"].as_u64().unwrap() > 0, "{r}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.path().join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let replicas: Vec<f64> =
        rows.iter().map(|r| r["train/replicas"].as_f64().unwrap_or_else(|| panic!("{r}"))).collect();
    assert_eq!(replicas[0], 1.0, "step 1 has no train stage to go by: {replicas:?}");
    assert!(replicas.contains(&2.0), "no step trained with the lent PyTorch trainer: {replicas:?}");
    // Every lend loaded the trainer's exact weights and every lent step ended with the same
    // weights on both (the runner's checks: a mismatch fails the run, which passed).
    let log: Vec<serde_json::Value> = std::fs::read_to_string(out.path().join("run/lending.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let lends = log.iter().filter(|d| d["action"] == "lend_rollout").count();
    assert_eq!(log.iter().filter(|d| d["action"] == "reclaim_rollout").count(), lends, "{log:?}");
}

/// A PyTorch engine that dies as an update's broadcast begins (RELAX_WORKER_FAULT, which
/// torch_worker.py reads as the built-in workers do), with the trainer already in its broadcast:
/// the run fails in update_weights naming that engine and its signal, every process stopped (the
/// trainer waiting in NCCL included), and a partial summary written.
#[test]
fn a_pytorch_engine_that_dies_mid_broadcast_fails_the_run_naming_it() {
    let Some(python) = torch_python() else { return };
    let out = tempfile::tempdir().unwrap();
    let run = torch_async_cmd(python, out.path(), "async", 2)
        .env("RELAX_WORKER_FAULT", "broadcast_weights:2:crash:rollout")
        .output()
        .expect("run relax-colocate");
    let err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{err}");
    // The abort's signal, or 128 + 6 from the shell the worker command runs in.
    let aborted = err.contains("signal 6") || err.contains("status 134");
    assert!(err.contains("phase update_weights") && err.contains("worker rollout-1") && aborted, "{err}");
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("run/summary.json")).unwrap()).unwrap();
    assert_eq!(s["failure"]["kind"], "crash", "{s}");
    assert_eq!(s["failure"]["worker"], "rollout-1", "{s}");
    assert_eq!(s["async"]["weight_transport"], "broadcast", "{s}");
    assert!(tms_e2e::runner::survivors(&out.path().join("run")).is_empty(), "workers left behind");
}

/// `relax-colocate bench --upstream-lib`: torch_memory_saver 0.0.10's own preload library (from
/// the test environment's site-packages) runs the bench's side-by-side scenario beside
/// libtms_hook.so in the same run, through the same C calls; both keep the contents, both are
/// timed, and the two comparison targets are judged. Our hook under upstream's file name is
/// refused as a comparison, not silently compared with itself.
#[test]
fn the_bench_runs_torch_memory_saver_s_library_side_by_side() {
    let Some(python) = torch_python() else { return };
    let ws = workspace();
    let site = Command::new(python)
        .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        .output()
        .expect("run the test environment's python");
    let site = PathBuf::from(String::from_utf8_lossy(&site.stdout).trim());
    let upstream = site.join("torch_memory_saver_hook_mode_preload_cu13.abi3.so");
    assert!(upstream.is_file(), "{} missing", upstream.display());
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(ws.bin("relax-colocate"))
        .args(["bench", "--device", "sim", "--quick", "--upstream-lib"])
        .arg(&upstream)
        .arg("--out")
        .arg(out.path())
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("Side by side with torch_memory_saver's library"), "{stdout}");
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("results.json")).unwrap()).unwrap();
    let side = &results["side_by_side"];
    for who in ["tms", "torch_memory_saver"] {
        let rows = side[who]["rows"].as_array().unwrap_or_else(|| panic!("{who}: {side}"));
        assert_eq!(rows.len(), 4, "2 sizes x backup on/off: {side}");
        for r in rows {
            assert!(r["pause_ns"].as_f64().unwrap_or(0.0) > 0.0 && r["resume_ns"].as_f64().unwrap_or(0.0) > 0.0, "{r}");
            if r["backup"] == true {
                assert_eq!(r["contents_intact"], true, "{who}: {r}");
            }
        }
    }
    let targets = results["targets"].as_array().unwrap();
    assert!(targets.iter().any(|t| t["target"].as_str().unwrap().contains("no slower than torch_memory_saver")));

    // Our own hook under the comparison's name is no comparison: refused before measuring.
    let run = Command::new(ws.bin("relax-colocate"))
        .args(["bench", "--device", "sim", "--quick", "--upstream-lib"])
        .arg(ws.hook())
        .arg("--out")
        .arg(out.path())
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is not torch_memory_saver's library"), "{stderr}");
}
