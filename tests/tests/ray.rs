//! `relax-colocate run --launcher ray` on a throwaway local Ray cluster (`--ray-address local`):
//! 2 nodes x 2 devices run the same cycle and checks as the local launcher, each node its own
//! simulated device node; async mode trains on one node and generates on the other, the weights
//! broadcast between them over the simulated NCCL, and elastic mode lends the trainer's device to
//! the engine Ray placed beside it on its node (and, with elastic.lend_rollout, an engine's device
//! to the lent trainer beside it); a worker killed, hung or losing its node's agent mid-run fails the run
//! naming node and worker, and nothing is left behind (workers, the bridge, the cluster's
//! processes), not even when the runner itself is killed; `tms.ray` pauses and resumes the
//! processes of one node, and those of chosen Ray actors (their hooked child processes). Without
//! run.ray_python the runner finds the user's own Ray (a python3 on PATH) or says where it looked;
//! joining a cluster from another Ray version stops the run with exit 2 naming both versions.
//!
//! Ray comes from scripts/ray-env.sh (pinned, cached in ~/.cache/tms/ray-venv; installed here when
//! missing). `TMS_RAY_TESTS=0` skips these tests, and says so, when that environment is absent.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tms_e2e::runner::{MODELLED_4B, trainer_bound_model};
use tms_e2e::*;

/// The marker every process of a test run inherits (the runner, the bridge, Ray's processes and
/// the workers), so the test can find whatever outlives the run.
const MARK: &str = "TMS_RAY_TEST_RUN";

/// Two Ray clusters at a time, however many test threads run (CI runs twice as many as cores):
/// each cluster is a dozen processes, and the lend tests' decisions follow the switch the run
/// measures, which a busier machine lengthens past what a lend would save.
static CLUSTERS: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

struct ClusterSlot;

fn cluster_slot() -> ClusterSlot {
    let (running, freed) = &CLUSTERS;
    let mut running = running.lock().unwrap_or_else(|e| e.into_inner());
    while *running >= 2 {
        running = freed.wait(running).unwrap_or_else(|e| e.into_inner());
    }
    *running += 1;
    ClusterSlot
}

impl Drop for ClusterSlot {
    fn drop(&mut self) {
        let (running, freed) = &CLUSTERS;
        *running.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        freed.notify_one();
    }
}

/// The Ray environment's Python, or None when it is absent and the user allowed skipping.
fn ray_python() -> Option<&'static PathBuf> {
    static PY: OnceLock<Option<PathBuf>> = OnceLock::new();
    PY.get_or_init(|| {
        let script = workspace().root.join("scripts/ray-env.sh");
        let ready = Command::new(&script).arg("--check").status().is_ok_and(|s| s.success());
        if !ready && std::env::var("TMS_RAY_TESTS").is_ok_and(|v| v == "0") {
            eprintln!("TMS_RAY_TESTS=0 and no Ray environment (scripts/ray-env.sh): skipping the Ray launcher tests");
            return None;
        }
        let out =
            Command::new(&script).stderr(std::process::Stdio::inherit()).output().expect("run scripts/ray-env.sh");
        assert!(
            out.status.success(),
            "scripts/ray-env.sh could not prepare Ray (see above); TMS_RAY_TESTS=0 skips these tests"
        );
        Some(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()))
    })
    .as_ref()
}

/// A run with `--launcher ray` on `address`, its Python left to the runner to find.
fn ray_cmd(out: &Path, address: &str) -> Command {
    let mut c = Command::new(workspace().bin("relax-colocate"));
    c.current_dir(&workspace().root)
        .args(["run", "--device", "sim", "--quiet", "--launcher", "ray", "--ray-address", address, "--out"])
        .arg(out)
        .env(MARK, out)
        .env_remove("LD_PRELOAD")
        .env_remove("RELAX_WORKER_FAULT");
    c
}

fn ray_run(python: &Path, out: &Path, args: &[&str]) -> Command {
    let mut c = ray_cmd(out, "local");
    c.args(["--set", &format!("run.ray_python={}", python.display())]).args(args);
    c
}

fn text(o: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Live processes whose environment holds `key=value` (zombies are gone for every purpose here).
fn processes_with(key: &str, value: &str) -> Vec<(u32, String)> {
    let needle = format!("{key}={value}");
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        if pid == std::process::id() {
            continue;
        }
        if let Ok(env) = std::fs::read(e.path().join("environ"))
            && env.split(|b| *b == 0).any(|v| v == needle.as_bytes())
        {
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            if !stat.contains(") Z ") {
                let cmd = std::fs::read_to_string(e.path().join("cmdline")).unwrap_or_default().replace('\0', " ");
                found.push((pid, cmd));
            }
        }
    }
    found
}

/// Waits (bounded) for every process of the run in `dir` to be gone; returns those left.
fn left_behind(dir: &Path) -> Vec<(u32, String)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = processes_with(MARK, &dir.display().to_string());
        if left.is_empty() {
            return left;
        }
        if Instant::now() > deadline {
            // What the bridge did on the way out, and who started each leftover, for the report.
            let log = std::fs::read_to_string(dir.join("logs/ray-bridge.log")).unwrap_or_default();
            eprintln!("the bridge's log:\n{log}");
            for (pid, _) in &left {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                eprintln!("left behind: {stat}");
            }
            return left;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn metrics_lines(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl")).map(|t| t.lines().count()).unwrap_or(0)
}

/// A 2-node, 1000-step run, returned once its first step is done (every worker past its start).
fn long_run_past_its_first_step(py: &Path, dir: &Path, capture: bool) -> std::process::Child {
    let mut cmd = ray_run(py, dir, &["--nodes", "2", "--devices", "1", "--steps", "1000"]);
    if capture {
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    }
    let mut runner = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    while metrics_lines(dir) < 1 {
        assert!(Instant::now() < deadline, "no step completed in 300s");
        assert!(runner.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(100));
    }
    runner
}

#[test]
fn two_nodes_of_two_devices_on_a_local_ray_cluster_run_the_cycle_and_pass_its_checks() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let dir = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let out = ray_run(py, dir.path(), &["--nodes", "2", "--devices", "2", "--steps", "2"]).output().unwrap();
    eprintln!("2 nodes x 2 devices, 2 steps: {:.1}s", t0.elapsed().as_secs_f64());
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(metrics_lines(dir.path()), 2);
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "ok", "{summary}");
    assert!(summary["checks"]["passed"].as_u64().unwrap() > 0, "{summary}");
    // Four devices, each with its own memory: the nodes' simulated devices are not shared.
    let mem = std::fs::read_to_string(dir.path().join("memory.jsonl")).unwrap();
    let last: Value = serde_json::from_str(mem.lines().last().unwrap()).unwrap();
    let used: Vec<u64> = last["device_used"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(used.len(), 4, "{last}");
    assert!(used.iter().all(|&u| u > 0), "every device holds its pair's memory: {last}");
    for rank in 0..4 {
        for role in ["trainer", "rollout"] {
            assert!(last["workers"].get(format!("{role}-{rank}")).is_some(), "no {role}-{rank} in {last}");
        }
    }
    let bridge = std::fs::read_to_string(dir.path().join("logs/ray-bridge.log")).unwrap();
    for node in ["node0", "node1"] {
        assert!(bridge.contains(&format!("{node} on host")), "{node} not started:\n{bridge}");
    }
    // Every worker opens the device Ray gave its bundle: on the simulator, the node's device
    // numbered by Ray's id (each node of the local cluster numbers its 2 GPUs 0 and 1).
    let placed = placement(dir.path());
    for node in 0..2u64 {
        let mut ids = Vec::new();
        for rank in [2 * node, 2 * node + 1] {
            let (t, r) = (&placed[format!("trainer-{rank}")], &placed[format!("rollout-{rank}")]);
            assert_eq!(t["node"], format!("node{node}"), "{placed}");
            assert_eq!(
                (&t["accelerator_id"], &t["device"]),
                (&r["accelerator_id"], &r["device"]),
                "one device per pair"
            );
            assert_eq!(t["device"].to_string(), t["accelerator_id"].as_str().unwrap(), "{placed}");
            ids.push(t["device"].as_u64().unwrap());
        }
        ids.sort();
        assert_eq!(ids, [0, 1], "node{node}'s two devices: {placed}");
    }
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

#[test]
fn async_mode_trains_on_one_node_and_generates_on_the_other() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let dir = tempfile::tempdir().unwrap();
    let args = ["--mode", "async", "--nodes", "2", "--devices", "1", "--steps", "3"];
    let out = ray_run(py, dir.path(), &args).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(metrics_lines(dir.path()), 3);
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "ok", "{summary}");
    assert_eq!(summary["async"]["weight_updates"].as_u64(), Some(3), "{summary}");
    // The weights crossed between the nodes by NCCL broadcast, the async default, judged against
    // the simulator's inter-node link (50 GB/s by default), not the intra-node one.
    assert_eq!(summary["async"]["weight_transport"], "broadcast", "{summary}");
    assert_eq!(summary["async"]["weight_sync_library"], "nccl", "{summary}");
    assert_eq!(summary["async"]["link_gbps"].as_f64(), Some(50.0), "{summary}");
    let rate = summary["async"]["update_weights_gbps"].as_f64().unwrap();
    assert!(rate > 0.0 && rate <= 50.0, "a broadcast between nodes faster than their link: {rate} GB/s");
    // Every update reached the engine on the other node and was checked there.
    assert!(summary["checks"]["passed"].as_u64().unwrap() >= 6, "{summary}");
    let placed = placement(dir.path());
    assert_eq!(placed["trainer-0"]["node"], "node0", "{placed}");
    assert_eq!(placed["rollout-1"]["node"], "node1", "{placed}");
    assert!(placed.get("rollout-0").is_none() && placed.get("trainer-1").is_none(), "one role per device: {placed}");
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// What the bridge says Ray placed: each worker's node, device and accelerator id.
fn placement(dir: &Path) -> Value {
    let bridge = std::fs::read_to_string(dir.join("logs/ray-bridge.log")).unwrap();
    let placed = bridge.lines().find_map(|l| l.strip_prefix("ray-bridge: devices from Ray: ")).expect(&bridge);
    serde_json::from_str(placed).unwrap()
}

/// Worker `lent` was placed on `owner`'s device of `owner`'s node.
fn assert_same_device(placed: &Value, owner: &str, lent: &str) {
    let (o, l) = (&placed[owner], &placed[lent]);
    assert_eq!(
        (&l["node"], &l["accelerator_id"], &l["device"]),
        (&o["node"], &o["accelerator_id"], &o["device"]),
        "{lent} shares {owner}'s device: {placed}"
    );
}

/// Every phase's memory sample: `owner` or `lent` holds their device's tagged memory (the
/// communicators left out), never both. Returns how many `lend_phase` samples found `lent`
/// holding it.
fn phases_lent(dir: &Path, owner: &str, lent: &str, lend_phase: &str) -> usize {
    let memory = std::fs::read_to_string(dir.join("memory.jsonl")).unwrap();
    let held = |s: &Value, w: &str| -> u64 {
        let tags = s["workers"][w].as_object().cloned().unwrap_or_default();
        tags.iter().filter(|(t, _)| *t != "nccl").map(|(_, b)| b.as_u64().unwrap()).sum()
    };
    let mut lent_phases = 0;
    for s in memory.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()) {
        let (o, l) = (held(&s, owner), held(&s, lent));
        assert!(o == 0 || l == 0, "both {owner} and {lent} hold their device after {}: {s}", s["phase"]);
        lent_phases += usize::from(s["phase"] == lend_phase && l > 0);
    }
    lent_phases
}

/// elastic.lend_rollout through the runner's own local Ray cluster, 2 nodes x 1 device, on a
/// trainer-bound job (the trainer's passes at 8% of the modelled peak, one version of staleness:
/// the engine fills the queue early in each step): Ray places the lent trainer in the engine's
/// device bundle on the engine's node, the engine lends it its device for step 2's train stage
/// (the trainer's state through a file in the run directory, which the local cluster's nodes
/// share), and gets it back before the update; the run's checks find the lent trainer's weights
/// equal to the trainer's after the load and after the step, and the device never held by both.
#[test]
fn the_reverse_lend_places_the_lent_trainer_beside_the_engine_on_its_node() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["--mode", "elastic", "--nodes", "2", "--devices", "1", "--steps", "3", "--max-staleness", "1"];
    args.extend(trainer_bound_model(true));
    let out = ray_run(py, dir.path(), &args).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "ok", "{summary}");
    let r = &summary["async"]["elastic"]["rollout_lend"];
    assert!(r["lends"].as_u64().unwrap() >= 1, "the idle engine never lent its device: {r}");
    let placed = placement(dir.path());
    assert_eq!(placed["rollout-1"]["node"], "node1", "{placed}");
    assert_same_device(&placed, "rollout-1", "lent-trainer-1");
    let lent_phases = phases_lent(dir.path(), "rollout-1", "lent-trainer-1", "lend_rollout");
    // The lends of the run and setup's calibration.
    assert_eq!(lent_phases as u64, r["lends"].as_u64().unwrap() + 1, "the lent trainer held the device at every lend");
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// Elastic mode through Ray, 2 nodes x 1 device, on a rollout-bound job (a 4B model's decode at
/// 5% of the modelled peak: the first batch takes over a second; `elastic.lend_after_s` small so
/// that the lend before it does not depend on the machine's speed): the lent engine is placed in
/// the trainer's device bundle on the trainer's node, the trainer lends it its device (the
/// engines' weights by IPC, both being built-in workers on one node) and gets it back with its
/// exact bytes (the run's checksum check), and never do both hold the device's memory.
#[test]
fn elastic_mode_lends_the_trainers_device_on_its_node_to_the_engine_beside_it() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let dir = tempfile::tempdir().unwrap();
    let layout = ["--mode", "elastic", "--nodes", "2", "--devices", "1", "--steps", "2"];
    let rollout_bound = ["--set", "compute.rollout_mfu=0.05", "--set", "elastic.lend_after_s=0.05"];
    let args = [&layout[..], &MODELLED_4B, &rollout_bound].concat();
    let out = ray_run(py, dir.path(), &args).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(metrics_lines(dir.path()), 2);
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "ok", "{summary}");
    let e = &summary["async"]["elastic"];
    assert_eq!(summary["async"]["mode"], "elastic", "{summary}");
    assert!(e["lends"].as_u64().unwrap() >= 1, "the waiting trainer never lent its device: {e}");
    assert!(e["lent_tokens"].as_u64().unwrap() > 0, "the lent engine generated nothing: {e}");
    assert_eq!(e["forced_reclaims"], 0, "{e}");
    let log: Vec<Value> = std::fs::read_to_string(dir.path().join("lending.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let lends: Vec<&Value> = log.iter().filter(|d| d["action"] == "lend").collect();
    assert!(lends.len() >= 2 && lends.iter().all(|d| d["weights_transport"] == "ipc"), "{log:?}");
    assert_eq!(log.iter().filter(|d| d["action"] == "reclaim").count(), lends.len(), "{log:?}");
    let placed = placement(dir.path());
    assert_eq!(placed["trainer-0"]["node"], "node0", "{placed}");
    assert_eq!(placed["rollout-1"]["node"], "node1", "{placed}");
    assert_same_device(&placed, "trainer-0", "lent-rollout-0");
    let lent_phases = phases_lent(dir.path(), "trainer-0", "lent-rollout-0", "lend");
    assert_eq!(lent_phases, lends.len(), "the engine held the device after every lend");
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

#[test]
fn a_worker_killed_on_one_node_fails_the_run_naming_node_and_worker_and_stops_every_node() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let dir = tempfile::tempdir().unwrap();
    // Once a step has completed, every worker is past its start: kill node1's trainer.
    let runner = long_run_past_its_first_step(py, dir.path(), true);
    let victims: Vec<u32> = processes_with("TMS_NAME", "trainer-1")
        .into_iter()
        .filter(|(pid, _)| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let mark = format!("{MARK}={}", dir.path().display());
            env.split(|b| *b == 0).any(|v| v == mark.as_bytes())
        })
        .map(|(pid, _)| pid)
        .collect();
    assert_eq!(victims.len(), 1, "node1's trainer: {victims:?}");
    // SAFETY: signalling a worker process this test's run started.
    unsafe { libc::kill(victims[0] as i32, libc::SIGKILL) };
    let out = runner.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("the run's report:\n{err}");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(err.contains("worker trainer-1"), "{}", text(&out));
    assert!(err.contains("on node1"), "{}", text(&out));
    assert!(err.contains("signal 9"), "{}", text(&out));
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["failure"]["worker"], "trainer-1", "{summary}");
    assert!(metrics_lines(dir.path()) >= 1, "partial metrics kept");
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// The driver of the `tms.ray` test: a local cluster whose node k's Ray workers look for hooked
/// processes in argv[k+1] (a node's control folder, as each real node has its own), then status,
/// pause and resume through `tms.ray` from the driver.
const API_DRIVER: &str = r#"
import json, os, shutil, sys
import ray
from ray.cluster_utils import Cluster
import tms.ray

os.environ["TMS_CONTROL_DIR"] = sys.argv[1]
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
os.environ["TMS_CONTROL_DIR"] = sys.argv[2]
node1 = cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
try:
    out = {
        "status_all": tms.ray.status(timeout=10),
        "pause": tms.ray.pause(nodes=[node1.node_id], timeout=10),
        "status_node1": tms.ray.status(nodes=[node1.node_id], timeout=10),
        "resume": tms.ray.resume(nodes=[node1.node_id], target="trainer-b", timeout=10),
        "node1": node1.node_id,
    }
finally:
    session = cluster.head_node.get_session_dir_path()
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(session, ignore_errors=True)
print(json.dumps(out))
"#;

/// Runs a Ray driver script with the repository's `tms` package importable; its last stdout line
/// is the JSON result.
fn run_driver(py: &std::path::Path, script: &str, args: &[std::path::PathBuf]) -> Value {
    let out = Command::new(py)
        .args(["-c", script])
        .args(args)
        .env("PYTHONPATH", workspace().root.join("python"))
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {}", text(&out)))
}

#[test]
fn tms_ray_pauses_and_resumes_the_hooked_processes_of_chosen_nodes_from_a_ray_driver() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let (n0, n1) = (SimNode::new("64MiB"), SimNode::new("64MiB"));
    let mut a = Served::start_with(&n0, "cuda", &[("TMS_NAME", "trainer-a")]);
    let mut b = Served::start_with(&n1, "cuda", &[("TMS_NAME", "trainer-b")]);
    for p in [&mut a, &mut b] {
        assert_eq!(p.ask("alloc 8"), "rc=0");
        assert_eq!(p.ask("fill"), "rc=0");
    }
    let r = run_driver(py, API_DRIVER, &[n0.control_dir(), n1.control_dir()]);
    let names = |rows: &Value| -> Vec<String> {
        let mut v: Vec<String> =
            rows.as_array().unwrap().iter().map(|x| x["name"].as_str().unwrap_or("").to_string()).collect();
        v.sort();
        v
    };
    assert_eq!(names(&r["status_all"]), ["trainer-a", "trainer-b"], "{r}");
    // Node 1 only: its process paused its 8 MiB, the other node's untouched.
    assert_eq!(names(&r["pause"]), ["trainer-b"], "{r}");
    let paused = &r["pause"][0];
    assert_eq!(paused["node_id"], r["node1"], "{r}");
    assert_eq!(paused["pid"], b.pid(), "{r}");
    assert_eq!(paused["result"]["bytes_done"], 8 * MIB, "{r}");
    let tags = r["status_node1"][0]["result"]["tags"].as_array().unwrap();
    assert!(tags.iter().any(|t| t["bytes_paused"] == 8 * MIB), "{r}");
    assert_eq!(r["resume"][0]["result"]["bytes_done"], 8 * MIB, "{r}");
    // Resumed with its contents; the other node's process never paused.
    assert_eq!(b.ask("verify"), "rc=0");
    assert_eq!(a.ask("verify"), "rc=0");
    let st = serde_json::to_string(&r["status_all"]).unwrap();
    assert!(!st.contains("\"error\""), "{r}");
    a.quit();
    b.quit();
}

/// The driver of the `tms.ray` by-actor test: a 2-node local cluster (node k's control folder is
/// argv[k+1], as in API_DRIVER) with three engine actors, each starting one hooked process as its
/// child (the command of argv[3] per node, as SGLang's engine runs its model in a child of the
/// actor): A and B on node 1, C on node 0. It pauses A and C by actor, reads every status, and
/// asks for an actor that is dead, one that never existed and bad arguments.
const ACTOR_DRIVER: &str = r#"
import json, os, shutil, subprocess, sys, tempfile, time
import ray
from ray._private import state
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
import tms.ray

spec = json.loads(sys.argv[3])
os.environ["TMS_CONTROL_DIR"] = sys.argv[1]
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
os.environ["TMS_CONTROL_DIR"] = sys.argv[2]
node1 = cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
node0 = next(n["node_id"] for n in tms.ray.nodes() if n["node_id"] != node1.node_id)


@ray.remote(num_cpus=0)
class Engine:
    def __init__(self, cmd, name):
        env = dict(os.environ)
        for k, v in cmd["env"].items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        env["TMS_NAME"] = name
        # Ray hides every GPU from an actor that asked for none; the engine's device is its
        # simulated node's.
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.err = tempfile.TemporaryFile()
        self.p = subprocess.Popen(
            cmd["argv"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True
        )

    def ask(self, line):
        try:
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
            answer = self.p.stdout.readline()
        except OSError:
            answer = ""
        if not answer:
            self.err.seek(0)
            raise RuntimeError(f"{line}: the engine's process ended ({self.p.wait()}): {self.err.read().decode()}")
        return answer.strip()

    def pids(self):
        return os.getpid(), self.p.pid

    def quit(self):
        self.p.stdin.write("quit\n")
        self.p.stdin.close()
        return self.p.wait(timeout=30)


@ray.remote(num_cpus=0)
class Idle:
    def pid(self):
        return os.getpid()


def on(node, cls=Engine):
    return cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))


def error_of(**kw):
    try:
        tms.ray.status(timeout=10, **kw)
        return None
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


try:
    engines = {
        "a": on(node1.node_id).remote(spec["node1"], "engine-a"),
        "b": on(node1.node_id).remote(spec["node1"], "engine-b"),
        "c": on(node0).remote(spec["node0"], "engine-c"),
    }
    a, b, c = engines["a"], engines["b"], engines["c"]
    for e in engines.values():
        assert ray.get(e.ask.remote("alloc 8")) == "rc=0"
        assert ray.get(e.ask.remote("fill")) == "rc=0"
    dead = on(node1.node_id, Idle).remote()
    ray.get(dead.pid.remote())
    ray.kill(dead)
    deadline = time.monotonic() + 60
    while state.actors(actor_id=dead._actor_id.hex()).get("State") != "DEAD":
        assert time.monotonic() < deadline, "the killed actor is not dead in 60s"
        time.sleep(0.1)
    out = {
        "node0": node0,
        "node1": node1.node_id,
        "ids": {k: e._actor_id.hex() for k, e in engines.items()},
        "pids": {k: ray.get(e.pids.remote()) for k, e in engines.items()},
        "dead_id": dead._actor_id.hex(),
        "pause": tms.ray.pause(actors=[a, c], timeout=10),
        "status": tms.ray.status(actors=[a, b, c], timeout=10),
        "status_node1": tms.ray.status(nodes=[node1.node_id], timeout=10),
        "own_only": tms.ray.status(actors=[a], include_children=False, timeout=10),
        "named": tms.ray.status(actors=[a, b], target="engine-b", timeout=10),
        "dead": tms.ray.pause(actors=[dead, "ff" * 16], timeout=10),
        "resume": tms.ray.resume(actors=[a, c], timeout=10),
        "verify": {k: ray.get(e.ask.remote("verify")) for k, e in engines.items()},
        "bad": {
            "int": error_of(actors=[5]),
            "name": error_of(actors=["engine-a"]),
            "both": error_of(actors=[a], nodes=[node0]),
        },
        "quit": {k: ray.get(e.quit.remote()) for k, e in engines.items()},
    }
finally:
    session = cluster.head_node.get_session_dir_path()
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(session, ignore_errors=True)
print(json.dumps(out))
"#;

/// A command as JSON for the actor driver: argv and the variables set (null: removed).
fn command_json(cmd: &Command) -> Value {
    let mut argv = vec![cmd.get_program().to_string_lossy().into_owned()];
    argv.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    let env: serde_json::Map<String, Value> = cmd
        .get_envs()
        .map(|(k, v)| (k.to_string_lossy().into_owned(), v.map_or(Value::Null, |v| v.to_string_lossy().into())))
        .collect();
    serde_json::json!({ "argv": argv, "env": env })
}

/// The driver's pause and status by actor (see ACTOR_DRIVER): exactly A's and C's children paused.
fn actors_paused_and_their_status(r: &Value) {
    let child = |k: &str| r["pids"][k][1].clone();
    let actor_pid = |k: &str| r["pids"][k][0].clone();
    let rows = |key: &str| r[key].as_array().unwrap().clone();
    let row_of = |key: &str, name: &str| -> Value {
        let found: Vec<Value> = rows(key).into_iter().filter(|x| x["name"] == name).collect();
        assert_eq!(found.len(), 1, "one row of {name} in {key}: {r}");
        found[0].clone()
    };
    // Each engine's model process is a child of its actor's Ray worker, not the worker itself.
    for k in ["a", "b", "c"] {
        assert_ne!(child(k), actor_pid(k), "{r}");
    }
    // Paused: exactly A's and C's children (on two nodes), each its 8 MiB, device memory freed.
    let paused = rows("pause");
    assert_eq!(paused.len(), 2, "{r}");
    for (k, node, row) in [("a", "node1", &paused[0]), ("c", "node0", &paused[1])] {
        assert_eq!(row["actor_id"], r["ids"][k], "{r}");
        assert_eq!(row["pid"], child(k), "{r}");
        assert_eq!(row["name"], format!("engine-{k}"), "{r}");
        assert_eq!(row["node_id"], r[node], "{r}");
        assert!(row.get("error").is_none(), "{r}");
        let rep = &row["result"];
        assert_eq!(rep["bytes_done"], 8 * MIB, "{r}");
        let freed = rep["device_free_after"].as_u64().unwrap() - rep["device_free_before"].as_u64().unwrap();
        assert!(freed >= 8 * MIB, "device memory freed by pausing engine-{k}: {freed} B: {r}");
    }
    // Status by actor: A and C paused, B (beside A on node 1) untouched; so is the loner.
    let paused_bytes = |row: &Value| -> u64 {
        row["result"]["tags"].as_array().unwrap().iter().map(|t| t["bytes_paused"].as_u64().unwrap()).sum()
    };
    let active_bytes = |row: &Value| -> u64 {
        row["result"]["tags"].as_array().unwrap().iter().map(|t| t["bytes_active"].as_u64().unwrap()).sum()
    };
    for (k, want) in [("a", 8 * MIB), ("b", 0), ("c", 8 * MIB)] {
        let row = row_of("status", &format!("engine-{k}"));
        assert_eq!(row["actor_id"], r["ids"][k], "{r}");
        assert_eq!(paused_bytes(&row), want, "engine-{k}: {r}");
        assert_eq!(active_bytes(&row), 8 * MIB - want, "engine-{k}: {r}");
    }
    assert_eq!(rows("status").len(), 3, "{r}");
    let lone = row_of("status_node1", "loner");
    assert_eq!((paused_bytes(&lone), active_bytes(&lone)), (0, 8 * MIB), "{r}");
    assert!(lone.get("actor_id").is_none(), "{r}");
}

/// The driver's error rows (an actor without hooked children, a target no process has, a dead or
/// unknown actor, bad arguments), then the resume with every engine's contents intact.
fn rows_that_name_what_was_wrong(r: &Value) {
    let child = |k: &str| r["pids"][k][1].clone();
    let rows = |key: &str| r[key].as_array().unwrap().clone();
    // Without children, A's own (unhooked) worker process is all of it: an error row naming A.
    let own = rows("own_only");
    assert_eq!(own.len(), 1, "{r}");
    assert_eq!(own[0]["actor_id"], r["ids"]["a"], "{r}");
    assert!(own[0]["pid"].is_null(), "{r}");
    let msg = own[0]["error"].as_str().unwrap_or_default();
    assert!(msg.contains(r["ids"]["a"].as_str().unwrap()) && msg.contains("no hooked process"), "{r}");
    // `target` narrows an actor's processes: B's alone; A has none named so, and says so.
    let named = rows("named");
    assert_eq!(named.len(), 2, "{r}");
    assert!(named[0]["error"].as_str().unwrap_or_default().contains("engine-b"), "{r}");
    assert_eq!(named[1]["pid"], child("b"), "{r}");
    // A dead actor and an unknown one: an error row each, naming it.
    let dead = rows("dead");
    assert_eq!(dead.len(), 2, "{r}");
    let (d, u) = (dead[0]["error"].as_str().unwrap_or_default(), dead[1]["error"].as_str().unwrap_or_default());
    assert!(d.contains(r["dead_id"].as_str().unwrap()) && d.contains("is dead"), "{r}");
    assert!(d.contains("ray.kill"), "the death's cause: {r}");
    assert_eq!(dead[0]["actor_id"], r["dead_id"], "{r}");
    assert!(u.contains(&"ff".repeat(16)) && u.contains("unknown"), "{r}");
    // Resumed by actor with their contents; B never paused.
    let resumed = rows("resume");
    assert_eq!(resumed.len(), 2, "{r}");
    assert!(resumed.iter().all(|x| x["result"]["bytes_done"] == 8 * MIB), "{r}");
    for k in ["a", "b", "c"] {
        assert_eq!(r["verify"][k], "rc=0", "{r}");
        assert_eq!(r["quit"][k], 0, "{r}");
    }
    // Bad arguments are refused before any Ray call, naming what was wrong.
    let bad = &r["bad"];
    assert!(bad["int"].as_str().unwrap_or_default().starts_with("TypeError: actors:"), "{r}");
    assert!(bad["name"].as_str().unwrap_or_default().starts_with("ValueError: actors: 'engine-a'"), "{r}");
    assert!(bad["both"].as_str().unwrap_or_default().starts_with("ValueError: give nodes or actors"), "{r}");
}

#[test]
fn tms_ray_pauses_exactly_the_hooked_children_of_chosen_actors_and_names_a_dead_actor() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    // Node 1's device holds three processes (two engines and the loner), each with a context
    // (CONTEXT_BYTES) and 8 MiB.
    let (n0, n1) = (SimNode::new("1GiB"), SimNode::new("1GiB"));
    let mut argv = c_program("hook_consumer", Style::Linked);
    argv.extend(["serve".into(), "cuda".into()]);
    let spec =
        serde_json::json!({ "node0": command_json(&n0.hooked(&argv)), "node1": command_json(&n1.hooked(&argv)) });
    // A hooked process on node 1 that no actor started: choosing by actor leaves it alone.
    let mut loner = Served::start_with(&n1, "cuda", &[("TMS_NAME", "loner")]);
    assert_eq!(loner.ask("alloc 8"), "rc=0");
    assert_eq!(loner.ask("fill"), "rc=0");
    let r = run_driver(py, ACTOR_DRIVER, &[n0.control_dir(), n1.control_dir(), spec.to_string().into()]);
    actors_paused_and_their_status(&r);
    rows_that_name_what_was_wrong(&r);
    assert_eq!(loner.ask("verify"), "rc=0");
    loner.quit();
}

#[test]
fn a_runner_killed_with_sigkill_takes_the_bridge_every_nodes_workers_and_the_cluster_with_it() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let dir = tempfile::tempdir().unwrap();
    let mut runner = long_run_past_its_first_step(py, dir.path(), false);
    assert!(!processes_with(MARK, &dir.path().display().to_string()).is_empty());
    // The bridge reads its standard input until EOF: the runner's death is its signal to stop.
    runner.kill().unwrap();
    runner.wait().unwrap();
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

#[test]
fn a_worker_that_hangs_on_a_node_times_out_named_with_its_node() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let dir = tempfile::tempdir().unwrap();
    let out = ray_run(py, dir.path(), &["--nodes", "2", "--devices", "1", "--steps", "3", "--phase-timeout", "10"])
        .env("RELAX_WORKER_FAULT", "generate:2:hang")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("the run's report:\n{err}");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(err.contains("failed at step 2, phase generate"), "{}", text(&out));
    assert!(err.contains("did not answer generate within 10s"), "{}", text(&out));
    assert!(err.contains("it runs on node0 (launcher ray)"), "{}", text(&out));
    assert_eq!(metrics_lines(dir.path()), 1, "step 1's metrics kept");
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

#[test]
fn a_nodes_agent_that_dies_fails_the_run_naming_the_node_and_leaves_nothing_behind() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let dir = tempfile::tempdir().unwrap();
    let runner = long_run_past_its_first_step(py, dir.path(), true);
    // Node 1's agent: the Ray worker process whose actor started node 1's workers (their parent).
    let mark = dir.path().display().to_string();
    let trainer = processes_with("TMS_NAME", "trainer-1")
        .into_iter()
        .map(|(pid, _)| pid)
        .find(|pid| processes_with(MARK, &mark).iter().any(|(p, _)| p == pid))
        .expect("node1's trainer");
    let stat = std::fs::read_to_string(format!("/proc/{trainer}/stat")).unwrap();
    let ppid: i32 = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().nth(1).unwrap().parse().unwrap();
    let agent_cmd = std::fs::read_to_string(format!("/proc/{ppid}/cmdline")).unwrap_or_default();
    assert!(agent_cmd.contains("Agent"), "the trainer's parent is not the agent: {agent_cmd:?}");
    // SAFETY: signalling the Ray worker process that this test's run started.
    unsafe { libc::kill(ppid, libc::SIGKILL) };
    let out = runner.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("the run's report:\n{err}");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(err.contains("node1"), "{}", text(&out));
    assert!(metrics_lines(dir.path()) >= 1, "partial metrics kept");
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// The pinned Ray's version (scripts/ray-requirements.txt pins it exactly).
fn pinned_ray_version() -> String {
    let req = std::fs::read_to_string(workspace().root.join("scripts/ray-requirements.txt")).unwrap();
    req.lines().find_map(|l| l.trim().strip_prefix("ray==")).expect("ray==VERSION in ray-requirements.txt").into()
}

/// An executable shell script `dir/name`.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// A run that must find its Python by itself: no explicit choice, no active environment, and a
/// cache folder without the pinned environment.
fn ray_cmd_finding_python(out: &Path, address: &str, path: &Path, cache: &Path) -> Command {
    let mut c = ray_cmd(out, address);
    c.env("PATH", path).env("XDG_CACHE_HOME", cache).env_remove("TMS_RAY_VENV").env_remove("VIRTUAL_ENV");
    c
}

#[test]
fn without_an_explicit_python_the_first_python3_on_path_that_imports_ray_runs_the_bridge() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let (dir, bin, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // The user's own Python with Ray, first on PATH (here: a python3 that runs the pinned one).
    let user = script(bin.path(), "python3", &format!("exec {} \"$@\"", py.display()));
    let path = std::env::join_paths([bin.path(), Path::new("/usr/bin"), Path::new("/bin")]).unwrap();
    let out = ray_cmd_finding_python(dir.path(), "local", Path::new(&path), cache.path())
        .args(["--nodes", "1", "--devices", "1", "--steps", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let bridge = std::fs::read_to_string(dir.path().join("logs/ray-bridge.log")).unwrap();
    let first = bridge.lines().next().unwrap_or_default();
    let want = format!(
        "relax-colocate: the bridge runs on Ray {} (Python 3.", // the pinned environment's Python
        pinned_ray_version()
    );
    assert!(first.starts_with(&want), "{first:?} does not start with {want:?}");
    let chosen = format!("from {}: the first python3 on PATH that imports ray", user.display());
    assert!(first.ends_with(&chosen), "{first:?} does not end with {chosen:?}");
    let left = left_behind(dir.path());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

#[test]
fn with_no_python_that_imports_ray_the_run_stops_with_exit_2_naming_every_place_looked_at() {
    let (dir, bin, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let no_ray = script(bin.path(), "python3", "echo \"ModuleNotFoundError: No module named 'ray'\" >&2; exit 1");
    let out = ray_cmd_finding_python(dir.path(), "local", bin.path(), cache.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    let pinned = cache.path().join("tms/ray-venv/bin/python");
    for part in [
        "--launcher ray needs a Python that can import ray, and none was found",
        "run.ray_python: not set",
        "$TMS_RAY_VENV: not set",
        "$VIRTUAL_ENV: not set",
        &format!("{} (PATH): cannot import ray (ModuleNotFoundError: No module named 'ray')", no_ray.display()),
        &format!("the pinned environment {}: not there", pinned.display()),
        "pip install ray",
        "run.ray_python",
        "scripts/ray-env.sh",
    ] {
        assert!(err.contains(part), "{part:?} is not in:\n{}", text(&out));
    }
    // Refused before anything started.
    assert_eq!(metrics_lines(dir.path()), 0);
    assert!(!dir.path().join("logs/ray-bridge.log").exists());
}

/// A Ray cluster of one node with one (simulated) GPU, started by the pinned Ray as a user's
/// cluster would be; its first stdout line is its address, and it shuts down at its stdin's EOF.
const CLUSTER: &str = r#"
import shutil, sys
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 1, "include_dashboard": False})
print(cluster.address, flush=True)
sys.stdin.read()
session = cluster.head_node.get_session_dir_path()
cluster.shutdown()
shutil.rmtree(session, ignore_errors=True)
"#;

/// A Python whose Ray says it is `version`: the pinned one, with ray.__version__ (what Ray's
/// version check compares with the cluster's) replaced at start-up by a sitecustomize module.
fn python_with_ray_version(py: &Path, dir: &Path, version: &str) -> PathBuf {
    std::fs::write(dir.join("sitecustomize.py"), format!("import ray\nray.__version__ = {version:?}\n")).unwrap();
    script(
        dir,
        "python3",
        &format!("PYTHONPATH={}${{PYTHONPATH:+:$PYTHONPATH}} exec {} \"$@\"", dir.display(), py.display()),
    )
}

#[test]
fn joining_a_cluster_of_another_ray_version_stops_with_exit_2_naming_both_versions() {
    let Some(py) = ray_python() else { return };
    let _slot = cluster_slot();
    let (home, good, bad, other) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let mut cluster = Command::new(py)
        .args(["-c", CLUSTER])
        .env(MARK, home.path())
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .env_remove("LD_PRELOAD")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut address = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(cluster.stdout.take().unwrap()), &mut address).unwrap();
    let address = address.trim().to_string();
    assert!(address.contains(':'), "the cluster did not start: {address:?}");
    let pinned = pinned_ray_version();
    // The same Ray joins and runs: the cluster is one the runner can use.
    let out = ray_cmd(good.path(), &address)
        .args(["--set", &format!("run.ray_python={}", py.display()), "--steps", "1"])
        .output()
        .unwrap();
    let joined = out.status.success();
    // Another Ray version is refused by Ray at connect; the runner says so with both versions.
    let fake = python_with_ray_version(py, other.path(), "2.0.0");
    let refused = ray_cmd(bad.path(), &address)
        .args(["--set", &format!("run.ray_python={}", fake.display()), "--steps", "1"])
        .output()
        .unwrap();
    drop(cluster.stdin.take());
    let _ = cluster.wait();
    assert!(joined, "{}", text(&out));
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(good.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "ok", "{summary}");
    // The runner asked the chosen Python for its Ray and logged the version it says it has.
    let log = std::fs::read_to_string(bad.path().join("logs/ray-bridge.log")).unwrap();
    let first = log.lines().next().unwrap_or_default();
    assert!(first.starts_with("relax-colocate: the bridge runs on Ray 2.0.0 (Python "), "{log}");
    assert!(first.ends_with(&format!("from {}: run.ray_python (explicit)", fake.display())), "{log}");
    let err = String::from_utf8_lossy(&refused.stderr);
    eprintln!("the refused run's report:\n{err}");
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    let python = std::str::from_utf8(
        &Command::new(py).args(["-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"]).output().unwrap().stdout,
    )
    .unwrap()
    .trim()
    .to_string();
    let want = format!(
        "the Ray cluster runs Ray {pinned} on Python {python}, and this run's Python for Ray ({}) has Ray 2.0.0 on Python {python}",
        fake.display()
    );
    assert!(err.contains(&want), "{want:?} is not in:\n{}", text(&refused));
    assert!(err.contains("--set run.ray_python="), "{}", text(&refused));
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(bad.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["failure"]["kind"], "configuration", "{summary}");
    for d in [home.path(), good.path(), bad.path()] {
        let left = left_behind(d);
        assert!(left.is_empty(), "processes left behind: {left:?}");
    }
}
