//! What the tests of `relax-colocate run` share: the command on the simulator, its outputs read
//! back (metrics rows checked to be flat numbers), and the run's processes still alive.

use crate::workspace;
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

/// `relax-colocate run` on the simulator, quiet, writing into `out`.
pub fn run_cmd(out: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(workspace().bin("relax-colocate"));
    c.current_dir(&workspace().root)
        .args(["run", "--device", "sim", "--quiet", "--out"])
        .arg(out)
        .args(args)
        .env_remove("LD_PRELOAD")
        .env_remove("RELAX_WORKER_FAULT");
    c
}

/// `run_cmd` that must succeed: its output and summary.json.
pub fn run_ok(out: &Path, args: &[&str]) -> (Output, Value) {
    let o = run_cmd(out, args).output().unwrap();
    assert!(o.status.success(), "{args:?}: {}", text(&o));
    let summary = json(&out.join("summary.json"));
    (o, summary)
}

pub fn text(o: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

pub fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// The rows of metrics.jsonl, each checked to be a flat object of numbers (what TensorBoard and
/// wandb take as scalars), with an integer `step`.
pub fn metrics(dir: &Path) -> Vec<Value> {
    let rows: Vec<Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for row in &rows {
        let obj = row.as_object().unwrap_or_else(|| panic!("a metrics row is not an object: {row}"));
        assert!(obj["step"].is_u64(), "step: {row}");
        for (k, v) in obj {
            assert!(v.is_number(), "metrics row key {k} is not a number: {v}");
        }
    }
    rows
}

/// Resident bytes of `worker` after `phase`: its memory/<worker>/<tag>/<phase>_bytes summed over tags.
pub fn resident(row: &Value, phase: &str, worker: &str) -> u64 {
    let (prefix, suffix) = (format!("memory/{worker}/"), format!("/{phase}_bytes"));
    row.as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with(&prefix) && k.ends_with(&suffix) && !k.contains("/paused/"))
        .map(|(_, v)| v.as_u64().unwrap())
        .sum()
}

/// Worker processes of the run in `dir` still alive (they carry RELAX_RUN_DIR in their environment).
pub fn survivors(dir: &Path) -> Vec<u32> {
    let needle = format!("RELAX_RUN_DIR={}", dir.display());
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        if let Ok(env) = std::fs::read(e.path().join("environ"))
            && env.split(|b| *b == 0).any(|v| v == needle.as_bytes())
        {
            // A zombie is gone for every purpose that matters here.
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            if !stat.contains(") Z ") {
                pids.push(pid);
            }
        }
    }
    pids
}

/// A 3-step run with the worker fault `fault` (RELAX_WORKER_FAULT=METHOD:STEP:ACTION): it must exit
/// 1 and leave no worker behind.
pub fn failing_run(fault: &str, extra: &[&str]) -> (tempfile::TempDir, Output) {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["--steps", "3"];
    args.extend_from_slice(extra);
    let out = run_cmd(dir.path(), &args).env("RELAX_WORKER_FAULT", fault).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(survivors(dir.path()).is_empty(), "workers left behind");
    (dir, out)
}

/// Qwen3-4B on the modelled device: the profile's allocations shrunk to fit the simulator, the
/// device time charged for the full-scale model.
pub const MODELLED_4B: [&str; 6] =
    ["--memory-profile", "qwen3-4b", "--set", "memory.scale=0.002", "--set", "compute.model=true"];

/// The model of a trainer-bound elastic job, local or through Ray: MODELLED_4B with the trainer's
/// passes at 8% of the peak (decoding at the default 30%), and elastic.lend_rollout as given. The
/// host link is not charged: the 4B trainer's full-scale state over it (about 4 s of modelled
/// switch) would outweigh the train stage a lend saves, and these tests are about the lend.
pub fn trainer_bound_model(lend_rollout: bool) -> Vec<&'static str> {
    let lend = if lend_rollout { "elastic.lend_rollout=true" } else { "elastic.lend_rollout=false" };
    let free_link = ["--set", "compute.h2d_gbps=0", "--set", "compute.d2h_gbps=0"];
    [&MODELLED_4B[..], &["--set", "compute.train_mfu=0.08"], &free_link, &["--set", lend]].concat()
}
