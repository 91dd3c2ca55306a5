//! The hardware kit (scripts/gpu-check.sh) must work the first time a GPU machine appears, which
//! may be for minutes: CI makes a kit exactly as for the GPU machine and runs it twice on the
//! simulator, once as `run --sim` (the checks that need no PyTorch) and once as the GPU run itself
//! with the simulator standing in for the driver and the PyTorch test environment for the
//! machine's Python (the real-device code paths: the runtime search, the wheel installed into a
//! fresh environment, the torch scenarios with TMS_TEST_REAL_DEVICE=1). Its elastic run, on the
//! simulator's CUDA and ACL sides, must have lent the trainer's device at least once.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use tms_e2e::*;

/// One kit per test binary, made by `gpu-check.sh prepare`.
fn kit() -> &'static PathBuf {
    static KIT: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &KIT.get_or_init(|| {
        let ws = workspace();
        let dir = tempfile::tempdir().unwrap();
        let kit = dir.path().join("kit");
        let out = Command::new(ws.root.join("scripts/gpu-check.sh"))
            .arg("prepare")
            .arg(&kit)
            .stderr(std::process::Stdio::inherit())
            .output()
            .expect("run gpu-check.sh prepare");
        assert!(out.status.success(), "gpu-check.sh prepare failed (see above)");
        (dir, kit)
    })
    .1
}

fn size_of_tree(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            if m.is_dir() { size_of_tree(&e.path()) } else { m.len() }
        })
        .sum()
}

/// Runs the kit and returns (exit code, summary.json, summary.md).
fn run_kit(args: &[&str], out: &Path, env: &[(&str, String)], strip_sim: bool) -> (i32, serde_json::Value, String) {
    let kit = kit();
    let mut cmd = Command::new(kit.join("gpu-check.sh"));
    cmd.arg("run")
        .args(args)
        .arg(kit)
        .arg(out)
        .env_remove("LD_PRELOAD")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit());
    if strip_sim {
        for (k, _) in std::env::vars() {
            if k.starts_with("TMS_") {
                cmd.env_remove(&k);
            }
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let status = cmd.status().expect("run gpu-check.sh run");
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap_or_default();
    let json = std::fs::read_to_string(out.join("summary.json")).expect("summary.json written");
    (status.code().unwrap_or(-1), serde_json::from_str(&json).unwrap(), md)
}

fn results(summary: &serde_json::Value) -> Vec<(String, String)> {
    summary["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["check"].as_str().unwrap().to_string(), c["result"].as_str().unwrap().to_string()))
        .collect()
}

/// The kit's elastic check printed the run's elastic block: a lend happened and the engine
/// generated (what the check asserted, read here so that a check that asserts nothing fails).
fn elastic_lent(log: &Path) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let block: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(block["lends"].as_u64() >= Some(1), "{block}");
    assert!(block["lent_tokens"].as_u64() > Some(0), "{block}");
    assert_eq!(block["forced_reclaims"], 0, "{block}");
}

/// How an H200's free memory moved under the probe's calls (driver 580.159.04, 2026-11-27,
/// docs/hardware.md): the simulator must move it the same way. The second batch of streams was
/// not measured there.
const H200_DRIVER_580: &[(&str, i64)] = &[
    ("reserve", 0),
    ("create", -14 << 20),
    ("map", 0),
    ("set_access", 0),
    ("unmap", 0),
    ("release", 14 << 20),
    ("stream_create_x4", -2 << 20),
    ("event_create", 0),
    ("host_alloc_64MiB", 0),
    ("mem_alloc_1MiB", -2 << 20),
    ("mem_free_1MiB", 2 << 20),
];

fn driver_figures_match_the_h200(log: &Path) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let steps: Vec<(String, i64)> = text
        .lines()
        .filter_map(|l| {
            let (step, delta) = l.strip_prefix("step=")?.split_once(" delta=")?;
            Some((step.to_string(), delta.parse().ok()?))
        })
        .collect();
    for (step, want) in H200_DRIVER_580 {
        let got: Vec<i64> = steps.iter().filter(|(s, _)| s == step).map(|(_, d)| *d).collect();
        assert!(!got.is_empty(), "the probe has no step {step}:\n{text}");
        assert!(got.iter().all(|d| d == want), "{step}: {got:?} on the simulator, {want} on the H200:\n{text}");
    }
}

#[test]
fn the_kit_is_small_and_self_contained() {
    let kit = kit();
    let size = size_of_tree(kit);
    assert!(size < 60 << 20, "the kit is {size} bytes; the device tool carries at most 64 MiB");
    for f in [
        "gpu-check.sh",
        "npu-check.sh",
        "bin/relax-colocate",
        "bin/tms-ctl",
        "lib/libtms_hook.so",
        "src/hook_consumer.c",
        "src/vendor.h",
        "tests/torch-consumers/conftest.py",
        "tests/torch-consumers/test_wheel.py",
        "tests/torch-consumers/torch_build.py",
        "tests/torch-consumers/test_hook_under_torch.py",
        "tests/torch-consumers/test_nccl_pause.py",
        "scripts/torch_worker.py",
        "python/tms/__init__.py",
    ] {
        assert!(kit.join(f).exists(), "{f} missing from the kit");
    }
    let wheels: Vec<_> = std::fs::read_dir(kit.join("wheel")).unwrap().collect();
    assert_eq!(wheels.len(), 1, "one wheel in the kit");
    // Built for glibc 2.17: the GPU machine's C library may be older than the build machine's.
    for f in ["bin/relax-colocate", "bin/tms-ctl", "lib/libtms_hook.so"] {
        let out = Command::new("objdump").arg("-T").arg(kit.join(f)).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let newest = text
            .split("GLIBC_")
            .skip(1)
            .filter_map(|s| {
                let v: String = s.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
                let mut it = v.split('.').map(|n| n.parse::<u32>().unwrap_or(0));
                Some((it.next()?, it.next().unwrap_or(0)))
            })
            .max()
            .unwrap();
        assert!(newest <= (2, 17), "{f} needs GLIBC_{}.{}", newest.0, newest.1);
    }
}

#[test]
fn the_kit_passes_on_the_simulator() {
    let out = tempfile::tempdir().unwrap();
    let (code, summary, md) = run_kit(&["--sim"], out.path(), &[], true);
    assert_eq!(code, 0, "{md}");
    assert_eq!(summary["failed"], 0, "{md}");
    let got = results(&summary);
    for name in [
        "c-driver-memory-probe",
        "c-cycles-100-with-backup",
        "c-pause-ignores-stalled-nonblocking-stream",
        "c-rdma-capable-region-memory",
        "c-faults-in-every-driver-call",
        "c-ascend-malloc-policies",
        "c-multi-device",
        "relax-colocate-run",
        "relax-colocate-run-async",
        "relax-colocate-run-elastic",
        "relax-colocate-run-elastic-lent",
        "relax-colocate-bench",
    ] {
        assert!(got.iter().any(|(n, r)| n == name && r == "pass"), "{name} did not pass:\n{md}");
    }
    assert!(md.contains("| check | result |"), "{md}");
    elastic_lent(&out.path().join("logs/relax-colocate-run-elastic-lent.log"));
    driver_figures_match_the_h200(&out.path().join("logs/c-driver-memory-probe.log"));
    // The kit carries torch_memory_saver's own libraries when the test environment has them
    // (prepare takes them from there): the bench then runs them side by side with ours.
    if kit().join("upstream").is_dir() {
        let bench = std::fs::read_to_string(out.path().join("logs/relax-colocate-bench.log")).unwrap_or_default();
        assert!(bench.contains("Side by side with torch_memory_saver's library (/"), "{bench}");
        assert!(bench.contains("yes / yes"), "contents kept by both libraries:\n{bench}");
    }
}

#[test]
fn only_runs_the_chosen_checks_and_records_the_rest_as_skipped() {
    let out = tempfile::tempdir().unwrap();
    let (code, summary, md) = run_kit(&["--sim", "--only", "^c-(cycles|disk)"], out.path(), &[], true);
    assert_eq!(code, 0, "{md}");
    let got = results(&summary);
    for (name, result) in &got {
        let chosen = name == "build-c-consumers" || name.starts_with("c-cycles") || name.starts_with("c-disk");
        assert_eq!(result, if chosen { "pass" } else { "skip" }, "{name}:\n{md}");
    }
    assert!(got.len() > 10, "every check is listed:\n{md}");
    assert!(md.contains("not selected by --only"), "{md}");
    // The PyTorch suite runs torch_memory_saver's own package on a GPU machine without it: the
    // kit carries it, libraries beside it, when the test environment has it.
    if kit().join("upstream").is_dir() {
        assert!(kit().join("upstream/torch_memory_saver/__init__.py").exists());
    }
    let bad = Command::new(kit().join("gpu-check.sh")).args(["run", "--bogus"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2), "an unknown option is a usage error");
}

#[test]
fn the_ascend_kit_passes_on_the_simulators_acl_side() {
    let out = tempfile::tempdir().unwrap();
    let kit = kit();
    let status = Command::new(kit.join("npu-check.sh"))
        .args(["run", "--sim"])
        .arg(kit)
        .arg(out.path())
        .env_remove("LD_PRELOAD")
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    let md = std::fs::read_to_string(out.path().join("summary.md")).unwrap_or_default();
    assert!(status.success(), "{md}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["failed"], 0, "{md}");
    let got = results(&summary);
    for name in [
        "acl-cycles-100-with-backup",
        "acl-malloc-policies",
        "acl-faults-in-every-driver-call",
        "acl-multi-device",
        "relax-colocate-run",
        "relax-colocate-run-async",
        "relax-colocate-run-elastic",
        "relax-colocate-run-elastic-lent",
        "relax-colocate-bench",
    ] {
        assert!(got.iter().any(|(n, r)| n == name && r == "pass"), "{name} did not pass:\n{md}");
    }
    elastic_lent(&out.path().join("logs/relax-colocate-run-elastic-lent.log"));
}

#[test]
fn the_gpu_run_itself_passes_with_the_simulator_as_the_gpu() {
    if std::env::var("TMS_TORCH_TESTS").is_ok_and(|v| v == "0") {
        eprintln!("TMS_TORCH_TESTS=0: skipping the kit's PyTorch dry run");
        return;
    }
    let ws = workspace();
    let torch_env = Command::new(ws.root.join("scripts/torch-env.sh")).output().expect("scripts/torch-env.sh");
    assert!(torch_env.status.success(), "scripts/torch-env.sh failed; TMS_TORCH_TESTS=0 skips this test");
    let python = PathBuf::from(String::from_utf8(torch_env.stdout).unwrap().trim());
    let scratch = tempfile::tempdir().unwrap();
    let out = scratch.path().join("out");
    // What `eval "$(tms-sim env)"` sets: to the kit, this is a machine with a driver and a GPU.
    let path = format!("{}:{}", python.parent().unwrap().display(), std::env::var("PATH").unwrap_or_default());
    let node = format!("kit-dry-run-{}", std::process::id());
    let dir = scratch.path().display().to_string();
    let sim = ws.sim_env(&["--node", &node, "--dir", &dir, "--memory", "16GiB"]);
    let mut env: Vec<(&str, String)> = sim.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    env.extend([("PATH", path), ("OMP_NUM_THREADS", "1".to_string())]);
    // One scenario of each kind of the kit's PyTorch tests, in one of its variants: every file
    // is collected, and the whole set runs on the simulator in tests/torch.rs; what this run
    // adds is the kit's own way of running them (its wheel, torch_memory_saver's package as the
    // kit carries it, no simulator in their environment). All of them here took over four
    // minutes of CI, every variant of these eight 84 s.
    let sample = [
        ("test_pause_frees_and_resume_restores_real_tensors", Some("upstream")),
        ("test_sglang_release_and_resume_memory_occupation", Some("weights_cpu_backup and wheel")),
        ("test_regions_get_their_own_pools", Some("preload")),
        ("test_a_fragmented_pool_copies_only_its_live_blocks", Some("facade")),
        ("test_pause_frees_exactly_the_suspendable_bytes_and_is_idempotent", None),
        ("test_tags_pause_free_and_resume_restore", Some("not preload")),
        ("test_nested_regions_under_whole_process_tracking", Some("wheel")),
        ("test_torch_mode_needs_no_preload", None),
    ];
    let select: Vec<String> = sample
        .iter()
        .map(|(name, variant)| variant.map_or(name.to_string(), |v| format!("({name} and {v})")))
        .collect();
    env.push(("TMS_KIT_PYTEST_K", select.join(" or ")));
    let (code, summary, md) = run_kit(&[], &out, &env, true);
    assert_eq!(code, 0, "{md}");
    assert_eq!(summary["failed"], 0, "{md}");
    let got = results(&summary);
    for name in [
        "torch-consumers",
        "c-cycles-100-with-backup",
        "relax-colocate-run",
        "relax-colocate-run-torch",
        "relax-colocate-run-torch-ipc",
    ] {
        assert!(got.iter().any(|(n, r)| n == name && r == "pass"), "{name} did not pass:\n{md}");
    }
    // Each sampled scenario ran, none skipped (a -k that matched nothing would pass with no test
    // run; the upstream variant skips where the kit carries no torch_memory_saver package).
    let junit = std::fs::read_to_string(out.join("torch-consumers.xml")).expect("the kit's junit report");
    for (name, _) in sample {
        let cases: Vec<&str> = junit.split("<testcase ").filter(|c| c.contains(&format!("name=\"{name}"))).collect();
        assert!(!cases.is_empty(), "{name} did not run:\n{junit}");
        assert!(cases.iter().all(|c| !c.contains("<skipped")), "{name} was skipped:\n{cases:?}");
    }
}
