//! `relax-colocate run` end to end on the simulator: GRPO and PPO learn, every phase is timed and
//! checked, the run directory holds what it promises; the same node that runs with pause/resume
//! fails with OOM without it; a crash, a hang, a frozen (SIGSTOPped) worker, an OOM on wake-up and
//! Ctrl-C each stop the run with the phase, the worker and the cause named, leave partial results
//! and no process behind; an external Python worker runs the same cycle, and one whose reply does
//! not read as its method's type fails the run naming the worker and the field.

use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use tms_e2e::runner::*;
use tms_e2e::*;

#[test]
fn grpo_run_learns_times_every_phase_checks_and_writes_its_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_cmd(dir.path(), &["--steps", "14"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for row in ["generate", "sleep", "update_weights", "wake_up", "actor_train", "train_wait", "step"] {
        assert!(stdout.lines().any(|l| l.starts_with(row)), "phase table lacks {row}:\n{stdout}");
    }
    // The totals under the table say what they add up.
    assert!(
        stdout.contains("train_wait = the rest of each step (generation, sleep and wake, weight update)"),
        "{stdout}"
    );
    assert!(stdout.contains("(mean of the first and last 3 steps)"), "{stdout}");
    let m = metrics(dir.path());
    assert_eq!(m.len(), 14);
    for step in &m {
        for k in [
            "perf/sleep_time",
            "perf/wake_up_time",
            "perf/update_weights_time",
            "perf/train_wait_time",
            "perf/ref_log_probs_time",
            "perf/log_probs_time",
            "perf/actor_train_time",
            "perf/step_time",
            "perf/rollout_time",
            "rollout/raw_reward",
            "rollout/response_len/mean",
            "rollout/kl",
            "passrate/pass@1",
            "passrate/pass@8",
            "train/kl_loss",
            "train/pg_clipfrac",
            "train/ppo_kl",
            "train/entropy_loss",
            "train/pg_loss",
            "train/grad_norm",
        ] {
            assert!(step[k].is_number(), "step lacks {k}: {step}");
        }
        // step_time = train_wait + train, as slime defines it.
        let sum = step["perf/train_wait_time"].as_f64().unwrap() + step["perf/train_time"].as_f64().unwrap();
        assert!((sum - step["perf/step_time"].as_f64().unwrap()).abs() < 1e-9);
        // Memory per process per tag at phase boundaries: the rollout is empty after its offload
        // and holds weights + KV after onload; the trainer is resident only while awake.
        assert_eq!(resident(step, "rollout_offload", "rollout-0"), 0, "{step}");
        assert!(resident(step, "actor_train", "trainer-0") > 0);
        assert_eq!(resident(step, "sleep", "trainer-0"), 0);
        assert!(step["memory/rollout-0/kv_cache/onload_kv_bytes"].as_u64().unwrap() > 0);
        assert!(step["memory/trainer-0/paused/sleep_bytes"].as_u64().unwrap() > 0);
        // The device really had room freed: in use after the trainer sleeps is below in use while it trains.
        let used = |phase: &str| step[format!("memory/device0/used/{phase}_bytes")].as_u64().unwrap();
        assert!(used("sleep") < used("actor_train"));
    }
    let first: f64 = m[..3].iter().map(|s| s["rollout/raw_reward"].as_f64().unwrap()).sum::<f64>() / 3.0;
    let last: f64 = m[11..].iter().map(|s| s["rollout/raw_reward"].as_f64().unwrap()).sum::<f64>() / 3.0;
    assert!(last > first + 0.15, "reward did not rise: {first:.3} -> {last:.3}");
    let summary = json(&dir.path().join("summary.json"));
    assert_eq!(summary["status"], "ok");
    assert!(summary["checks"]["passed"].as_u64().unwrap() > 14 * 4, "{summary}");
    let cfg = std::fs::read_to_string(dir.path().join("config.toml")).unwrap();
    assert!(cfg.contains("steps = 14"), "{cfg}");
    for svg in ["memory_timeline.svg", "memory_per_step.svg", "reward.svg"] {
        let s = std::fs::read_to_string(dir.path().join(svg)).unwrap();
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>") && s.contains("polyline"), "{svg}");
        // Axes in units a person reads (ticks used to read 78.8 / 157.5 MiB and steps 8.2).
        assert!(!s.contains("e6") && !s.contains("e-1"), "{svg}: {s}");
    }
    let timeline = std::fs::read_to_string(dir.path().join("memory_timeline.svg")).unwrap();
    assert!(timeline.contains("memory (MiB)") && timeline.contains("time (s)"), "{timeline}");
    assert!(timeline.contains("trainer-0") && timeline.contains("capacity") && timeline.contains("phase: generate"));
    assert!(dir.path().join("logs/trainer-0.log").is_file() && dir.path().join("logs/rollout-0.log").is_file());
    // A successful run's worker logs say what each hook did (they used to be empty).
    for worker in ["trainer-0", "rollout-0"] {
        let log = std::fs::read_to_string(dir.path().join(format!("logs/{worker}.log"))).unwrap();
        assert!(log.contains("tms: pause") && log.contains("tms: resume"), "{worker}: {log}");
    }
    assert!(survivors(dir.path()).is_empty());
}

#[test]
fn ppo_run_uses_values_and_gae() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_cmd(dir.path(), &["--algo", "ppo", "--steps", "5", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let summary: Value = serde_json::from_slice(&out.stdout).expect("--json prints the summary");
    assert_eq!(summary["algo"], "ppo");
    let m = metrics(dir.path());
    assert!(m.iter().all(|s| s["perf/values_time"].is_number() && s["train/value_loss"].as_f64().unwrap() > 0.0));
}

/// A run without a reference model takes no reference pass, and one whose old log-probs are the
/// rollout's no actor pass: the skipped phase does not occur, what only it measured is left out
/// of the rows, and the run passes its checks. A reference-less run that asks for a KL is refused.
#[test]
fn skipped_trainer_passes_do_not_occur_and_the_run_passes_its_checks() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "no-ref",
            vec!["--set", "algo.reference=false", "--set", "algo.kl_coef=0"],
            ("ref_log_probs", ["rollout/kl", "rollout/ref_log_probs", "train/kl_loss"]),
            "perf/log_probs_time",
        ),
        (
            "rollout-lp",
            vec!["--set", "algo.rollout_log_probs=true"],
            ("log_probs", ["rollout/entropy", "rollout/log_probs", "train/rollout_train_logprob_diff"]),
            "perf/ref_log_probs_time",
        ),
    ];
    for (name, sets, (phase, gone), kept) in cases {
        let out_dir = dir.path().join(name);
        let (out, summary) = tms_e2e::runner::run_ok(&out_dir, &[&["--steps", "2"][..], &sets].concat());
        assert_eq!(summary["status"], "ok");
        assert!(summary["checks"]["passed"].as_u64().unwrap() >= 2, "{summary}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!stdout.lines().any(|l| l.split_whitespace().next() == Some(phase)), "{phase} in the table:\n{stdout}");
        let m = metrics(&out_dir);
        assert_eq!(m.len(), 2);
        for row in &m {
            assert!(row.get(format!("perf/{phase}_time")).is_none(), "{name}: {row}");
            for k in gone {
                assert!(row.get(k).is_none(), "{name}: {k} in {row}");
            }
            for k in [kept, "perf/actor_train_time", "train/pg_loss", "rollout/rollout_log_probs"] {
                assert!(row[k].is_number(), "{name}: step lacks {k}: {row}");
            }
        }
    }
    let out = run_cmd(dir.path(), &["--set", "algo.reference=false"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("algo.reference = false") && err.contains("set algo.kl_coef = 0"), "{err}");
}

#[test]
fn the_same_node_ooms_without_the_saver_and_runs_with_it() {
    // Trainer (236 MiB) + rollout (168 MiB) exceed the 300 MiB the two processes' contexts
    // (2 x 300 MiB) leave of 900 MiB; each alone fits.
    let without = tempfile::tempdir().unwrap();
    let out =
        run_cmd(without.path(), &["--steps", "2", "--sim-memory", "900MiB", "--offload", "false"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("init_") && err.contains("out of device memory") && err.contains("offload"), "{err}");
    assert_eq!(json(&without.path().join("summary.json"))["failure"]["kind"], "out_of_memory");
    assert!(survivors(without.path()).is_empty());
    // The plots show the moment it ran out: memory.jsonl's last sample is the failure's, with the
    // rollout's memory resident, and the timeline marks it.
    let mem = std::fs::read_to_string(without.path().join("memory.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(mem.lines().last().unwrap()).unwrap();
    assert!(last["phase"].as_str().unwrap().starts_with("failed: init_"), "{last}");
    assert!(last["device_used"][0].as_u64().unwrap() > 0, "{last}");
    let timeline = std::fs::read_to_string(without.path().join("memory_timeline.svg")).unwrap();
    assert!(timeline.contains("run stopped: out of memory in init_trainer (trainer-0)"), "{timeline}");
    // The allocation that did not fit: recorded with its size and tag, and drawn with them.
    let request = &json(&without.path().join("summary.json"))["failure"]["request"];
    let (bytes, tag) = (request["bytes"].as_u64().unwrap(), request["tag"].as_str().unwrap());
    assert!(bytes > 0 && request["device_used"].as_u64().unwrap() + bytes > 900 * MIB, "{request}");
    assert!(timeline.contains(&format!("failed: +{} ({tag})", tms_proto::size::format_size(bytes))), "{timeline}");
    let per_step = std::fs::read_to_string(without.path().join("memory_per_step.svg")).unwrap();
    assert!(per_step.contains("no step completed, out of memory in init_trainer"), "{per_step}");

    let with = tempfile::tempdir().unwrap();
    let out = run_cmd(with.path(), &["--steps", "2", "--sim-memory", "900MiB"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let peak = json(&with.path().join("summary.json"))["memory"]["peak_device_used"][0].as_u64().unwrap();
    assert!(peak <= 900 * MIB, "{peak}");
}

#[test]
fn a_crashed_worker_is_named_with_its_phase_and_signal() {
    let (dir, out) = failing_run("train:2:crash", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("step 2, phase actor_train") && err.contains("trainer-0") && err.contains("signal 6"),
        "{err}"
    );
    // Partial metrics survive: step 1 completed.
    assert_eq!(metrics(dir.path()).len(), 1);
    let s = json(&dir.path().join("summary.json"));
    assert_eq!(s["status"], "failed");
    assert_eq!(s["failure"]["kind"], "crash");
}

#[test]
fn a_hung_worker_times_out() {
    let (dir, out) = failing_run("generate:2:hang", &["--phase-timeout", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("phase generate") && err.contains("rollout-0") && err.contains("within 2s"), "{err}");
    assert_eq!(json(&dir.path().join("summary.json"))["failure"]["kind"], "timeout");
}

#[test]
fn memory_held_by_the_rollout_makes_wake_up_fail_with_oom() {
    let (dir, out) = failing_run("generate:2:hog", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("phase wake_up") && err.contains("trainer-0") && err.contains("out of device memory"),
        "{err}"
    );
    let failure = &json(&dir.path().join("summary.json"))["failure"];
    assert_eq!(failure["kind"], "out_of_memory");
    // What the trainer could not bring back, on top of what the device held, drawn over its
    // capacity in the timeline.
    let bytes = failure["request"]["bytes"].as_u64().unwrap();
    assert!(bytes > 0 && failure["request"]["device_used"].as_u64().unwrap() > 0, "{failure}");
    let timeline = std::fs::read_to_string(dir.path().join("memory_timeline.svg")).unwrap();
    assert!(timeline.contains(&format!("failed: +{}", tms_proto::size::format_size(bytes))), "{timeline}");
    assert!(timeline.contains(r##"fill="none" stroke="#CC0000""##), "no box: {timeline}");
}

#[test]
fn ctrl_c_stops_every_worker_and_keeps_partial_metrics() {
    // SIGTERM (a scheduler's stop) was reported as "Ctrl-C".
    for (signal, said) in [(libc::SIGINT, "interrupted (Ctrl-C, SIGINT)"), (libc::SIGTERM, "interrupted (SIGTERM)")] {
        let dir = tempfile::tempdir().unwrap();
        let child = run_cmd(dir.path(), &["--steps", "10000"]).stderr(std::process::Stdio::piped()).spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while std::fs::read_to_string(dir.path().join("metrics.jsonl")).map(|s| s.lines().count()).unwrap_or(0) < 2 {
            assert!(Instant::now() < deadline, "no step completed");
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, signal) };
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(130));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(said), "{said}: {err}");
        let s = json(&dir.path().join("summary.json"));
        assert_eq!(s["status"], "interrupted");
        assert!(s["steps_completed"].as_u64().unwrap() >= 2);
        assert!(survivors(dir.path()).is_empty(), "workers left behind");
    }
}

#[test]
fn a_second_ctrl_c_kills_workers_that_ignore_sigterm_at_once() {
    // Stopping waited a fixed 3 s for workers that ignore SIGTERM (5 s more after a normal end)
    // and a second Ctrl-C changed nothing.
    let dir = tempfile::tempdir().unwrap();
    let bin = workspace().bin("relax-colocate");
    // An ignored signal stays ignored across exec: this trainer does not end on SIGTERM.
    let stubborn = format!("trap '' TERM; exec {} worker trainer", bin.display());
    let child = run_cmd(dir.path(), &["--steps", "10000", "--trainer-cmd", &stubborn])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(dir.path().join("metrics.jsonl")).map(|s| s.lines().count()).unwrap_or(0) < 1 {
        assert!(Instant::now() < deadline, "no step completed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let first = Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let took = first.elapsed();
    eprintln!("two Ctrl-C, a trainer ignoring SIGTERM: the run ended {took:?} after the first");
    assert_eq!(out.status.code(), Some(130), "{}", text(&out));
    assert!(took < Duration::from_millis(2500), "the run ended only {took:?} after the first Ctrl-C");
    assert!(survivors(dir.path()).is_empty(), "workers left behind");
}

#[test]
fn external_python_workers_run_the_same_cycle() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = "python3 scripts/example_worker.py";
    let out = run_cmd(dir.path(), &["--steps", "3", "--trainer-cmd", cmd, "--rollout-cmd", cmd]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let s = json(&dir.path().join("summary.json"));
    assert!(s["checks"]["passed"].as_u64().unwrap() > 10, "{s}");
    // The hook tracked the Python workers' allocations under their tags.
    let m = metrics(dir.path());
    assert!(m[0]["memory/trainer-0/ref/actor_train_bytes"].as_u64().unwrap() > 0);
}

/// A reply that does not read as its method's type fails the run naming the worker and the field,
/// rather than reading as empty (here a checksum that is a number, not a string).
#[test]
fn a_malformed_reply_names_the_worker_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("malformed_worker.py");
    let source = "import os, sys\n\
                  sys.path.insert(0, os.path.join(os.getcwd(), 'scripts'))\n\
                  import example_worker as ew, relax_worker as rw\n\
                  names = ['init', 'checksum', 'generate', 'log_probs', 'train', 'update_begin', 'pack', 'unpack', \
                  'update_end']\n\
                  handlers = {n: getattr(ew, n) for n in names}\n\
                  handlers['checksum'] = lambda p: {'weights': 7}\n\
                  rw.serve(handlers, implementation='malformed')\n";
    std::fs::write(&script, source).unwrap();
    let cmd = format!("python3 {}", script.display());
    let good = "python3 scripts/example_worker.py";
    let out = run_cmd(&dir.path().join("run"), &["--steps", "1", "--trainer-cmd", &cmd, "--rollout-cmd", good])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("trainer-0: malformed checksum reply: field `weights`: invalid type"), "{err}");
    let s = json(&dir.path().join("run/summary.json"));
    assert_eq!(s["failure"]["kind"], "worker_error", "{s}");
    assert!(survivors(&dir.path().join("run")).is_empty(), "workers left behind");
}

#[test]
fn acl_api_and_two_devices_on_the_simulator() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_cmd(dir.path(), &["--steps", "2", "--devices", "2", "--set", "sim.api=acl"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let m = metrics(dir.path());
    let mut workers: Vec<&str> = m[0]
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.ends_with("/onload_kv_bytes") && !k.starts_with("memory/device"))
        .filter_map(|k| k.split('/').nth(1))
        .collect();
    workers.dedup();
    assert_eq!(workers.len(), 4, "{workers:?}");
    assert!(m[0]["memory/device1/used/onload_kv_bytes"].as_u64().unwrap() > 0);
    // The timeline draws each device in a panel of its own: its processes, its use, its capacity.
    let timeline = std::fs::read_to_string(dir.path().join("memory_timeline.svg")).unwrap();
    for d in 0..2 {
        let title = format!("device {d}: rollout-{d}, trainer-{d}");
        assert!(timeline.contains(&title), "no panel {title:?}: {timeline}");
        assert!(timeline.contains(&format!("device {d} in use (+ contexts)")), "{timeline}");
    }
    let legend_lines = timeline.lines().map(str::trim);
    assert_eq!(legend_lines.filter(|l| *l == "capacity").count(), 2, "a capacity line per device: {timeline}");
}

#[test]
fn configuration_errors_exit_2_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_cmd(dir.path(), &["--set", "algo.lrr=1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--print-config"));
    let printed = Command::new(workspace().bin("relax-colocate")).args(["run", "--print-config"]).output().unwrap();
    let text = String::from_utf8_lossy(&printed.stdout);
    assert!(text.contains("[algo]") && text.contains("kl_type"), "{text}");
    // A file's unknown section is named.
    let f = dir.path().join("c.toml");
    std::fs::write(&f, format!("{text}\n[extra]\nx = 1\n")).unwrap();
    let out = run_cmd(dir.path(), &["--config", f.to_str().unwrap()]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("extra"), "{}", String::from_utf8_lossy(&out.stderr));
    // The metrics keys: an unknown logger or style, and wandb asked for where its package is not
    // installed (a Python that cannot import it stands in), each name the fix before anything starts.
    let no_wandb = dir.path().join("python-without-wandb");
    std::fs::write(&no_wandb, "#!/bin/sh\nexit 1\n").unwrap();
    let exec = <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755);
    std::fs::set_permissions(&no_wandb, exec).unwrap();
    let python = format!("metrics.python={}", no_wandb.display());
    for (args, said) in [
        (vec!["--set", "metrics.loggers=tb"], "tensorboard"),
        (vec!["--set", "metrics.style=mlflow"], "metrics.style"),
        (vec!["--logger", "wandb", "--set", &python], "-m pip install wandb"),
    ] {
        let out = run_cmd(dir.path(), &args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(said), "{args:?}: {err}");
    }
    assert!(!dir.path().join("metrics.jsonl").exists(), "a configuration error started the run");
}

#[test]
fn an_external_worker_that_cannot_start_shows_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_cmd(dir.path(), &["--trainer-cmd", "no-such-trainer-binary"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("trainer-0") && err.contains("status 127") && err.contains("not found"), "{err}");
    assert_eq!(json(&dir.path().join("summary.json"))["status"], "failed");
    assert!(survivors(dir.path()).is_empty());
}

#[test]
fn a_simulated_run_larger_than_the_host_is_refused_with_a_scale_that_fits() {
    // It used to start, run for a while, then the host's OOM killer ended a worker (or another
    // process) with nothing pointing at memory.scale.
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    // kv_cache_gib=1000 sized a 1000 GiB simulated device; it is a configuration error (exit 2)
    // that names the key and the host's memory.
    let out = run_cmd(dir.path(), &["--steps", "1", "--set", "memory.kv_cache_gib=100000"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("relax-colocate run: memory.kv_cache_gib = 100000 ")
            && err.contains("host memory")
            && err.contains("available")
            && err.contains("--set memory.scale="),
        "{err}"
    );
    // Refused before the run starts: nothing is written into the run folder.
    assert!(!dir.path().join("summary.json").exists(), "a refused run wrote a summary");
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "refused only after {:?}", started.elapsed());
    assert!(survivors(dir.path()).is_empty());
}

#[test]
fn the_readmes_qwen3_4b_tp2_on_a_small_hosts_simulator_suggests_memory_scale() {
    // It ran silently for a minute, then the host killed a worker; nothing suggested memory.scale.
    let available_gib = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:").map(|v| v.split_whitespace().next().unwrap().parse::<u64>()))
        .unwrap()
        .unwrap()
        >> 20;
    let dir = tempfile::tempdir().unwrap();
    // About 79 GiB of simulated device: a host with room for it runs it, which this test skips.
    if available_gib * 8 / 10 >= 80 {
        eprintln!("skipped: the host has {available_gib} GiB available, enough to run it");
        return;
    }
    let out = run_cmd(dir.path(), &["--steps", "1", "--memory-profile", "qwen3-4b", "--tp", "2"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("relax-colocate run: memory.profile = \"qwen3-4b\" with memory.tp = 2")
            && err.contains("host memory")
            && err.contains("--set memory.scale=0."),
        "{err}"
    );
    assert!(survivors(dir.path()).is_empty());
}

#[test]
fn a_simulated_device_too_small_for_the_contexts_is_refused() {
    // sim.memory=1MiB printed "1 x 1.0 MiB" while the simulator silently used 16 GiB. A size the
    // user chose is configuration: exit 2, and `--json` still prints one object saying why.
    for size in ["1MiB", "500MiB"] {
        let dir = tempfile::tempdir().unwrap();
        let out = run_cmd(dir.path(), &["--steps", "1", "--sim-memory", size, "--json"]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{size}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("sim.memory={size} leaves no room")) && err.contains("contexts"), "{err}");
        let summary: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("--json printed no JSON object ({e}): {}", text(&out)));
        assert_eq!(summary["status"], "failed", "{summary}");
        assert_eq!(summary["failure"]["kind"], "configuration", "{summary}");
    }
    // Errors found while reading the configuration print one object too.
    let dir = tempfile::tempdir().unwrap();
    let out = run_cmd(dir.path(), &["--set", "run.steps=abc", "--json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(summary["failure"]["cause"].as_str().unwrap().contains("run.steps"), "{summary}");
}

#[test]
fn a_weight_bucket_of_a_few_bytes_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out =
        run_cmd(dir.path(), &["--steps", "1", "--set", "memory.update_weight_buffer_size=\"1\""]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("update_weight_buffer_size") && err.contains("at least 1MiB"), "{err}");
}

/// The worker process of `role` in the run in `dir` (the one the hook is loaded in).
fn worker_pid(dir: &Path, role: &str) -> u32 {
    let run_dir = format!("RELAX_RUN_DIR={}", dir.display());
    let role = format!("RELAX_ROLE={role}");
    survivors(dir)
        .into_iter()
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|env| {
                    let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
                    vars.contains(&run_dir.as_bytes()) && vars.contains(&role.as_bytes())
                })
                .unwrap_or(false)
        })
        .unwrap_or_else(|| panic!("no {role} worker for {}", dir.display()))
}

/// A run with `args` whose rollout is SIGSTOPped once `steps` steps completed; the runner, the
/// frozen pid and when it froze. The worker gets SIGKILL when the guard drops, whatever happened.
struct Frozen {
    runner: std::process::Child,
    pid: u32,
    at: Instant,
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: signalling processes this test started.
        unsafe {
            libc::kill(self.pid as i32, libc::SIGKILL);
            libc::kill(self.runner.id() as i32, libc::SIGKILL);
        }
        let _ = self.runner.wait();
    }
}

/// Freezes the rollout after `steps` steps, while the trainer works: the runner's next word to the
/// rollout then goes through its control socket (memory status, pause, resume), not the worker
/// protocol.
fn freeze_rollout(dir: &Path, args: &[&str], steps: usize) -> Frozen {
    let mut runner = run_cmd(dir, args).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let training = || {
        use std::io::{Read, Seek, SeekFrom};
        let done = std::fs::read_to_string(dir.join("metrics.jsonl")).map(|s| s.lines().count()).unwrap_or(0);
        let Ok(mut memory) = std::fs::File::open(dir.join("memory.jsonl")) else { return false };
        // The last line is enough, and the file grows every phase.
        let len = memory.seek(SeekFrom::End(0)).unwrap();
        memory.seek(SeekFrom::Start(len.saturating_sub(16 << 10))).unwrap();
        let mut tail = String::new();
        let _ = memory.read_to_string(&mut tail);
        let phase = tail.lines().last().and_then(|l| serde_json::from_str::<Value>(l).ok()).map(|v| v["phase"].clone());
        let phase = phase.as_ref().and_then(Value::as_str).unwrap_or("");
        done >= steps
            && ["rollout_offload", "wake_up", "ref_log_probs", "log_probs", "advantages", "actor_train", "sleep"]
                .contains(&phase)
    };
    while !training() {
        if runner.try_wait().unwrap().is_some() {
            let mut err = String::new();
            std::io::Read::read_to_string(runner.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("the run ended before the freeze: {err}");
        }
        assert!(Instant::now() < deadline, "the run did not reach step {}'s training", steps + 1);
        std::thread::sleep(Duration::from_millis(2));
    }
    let pid = worker_pid(dir, "rollout");
    // SAFETY: signalling a worker of our own run.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    Frozen { runner, pid, at: Instant::now() }
}

/// Waits at most `limit` for the runner to exit; its status, stderr and how long after the
/// freeze it exited.
fn finish(f: &mut Frozen, limit: Duration) -> (Option<i32>, String, Duration) {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = f.runner.try_wait().unwrap() {
            let took = f.at.elapsed();
            let mut err = String::new();
            std::io::Read::read_to_string(f.runner.stderr.as_mut().unwrap(), &mut err).unwrap();
            return (status.code(), err, took);
        }
        assert!(Instant::now() < deadline, "the runner still runs {limit:?} after the worker froze");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_frozen_worker_fails_the_run_within_the_phase_timeout_naming_it() {
    // A SIGSTOPped worker stalled the run about 150 s with run.phase_timeout_s=5 (control calls
    // waited a fixed 120 s) and the message was "os error 11".
    let dir = tempfile::tempdir().unwrap();
    // 5 s rather than less: a loaded machine must not time out a healthy phase before the freeze.
    let mut f = freeze_rollout(dir.path(), &["--steps", "10000", "--phase-timeout", "5"], 1);
    let (code, err, took) = finish(&mut f, Duration::from_secs(60));
    eprintln!("frozen worker: the run ended {took:?} after the freeze (phase timeout 5 s)");
    assert_eq!(code, Some(1), "{err}");
    assert!(took < Duration::from_secs(5 + 5), "the run ended only {took:?} after the freeze");
    let pid = f.pid;
    assert!(
        err.contains("worker rollout-0: timed out: the rollout (pid ")
            && err.contains(&format!("pid {pid})"))
            && err.contains("within 5s (run.phase_timeout_s)")
            && err.contains("stopped")
            && err.contains("[timeout]")
            && err.contains(", phase "),
        "{err}"
    );
    assert!(!err.contains("os error"), "{err}");
    let s = json(&dir.path().join("summary.json"));
    assert_eq!(s["failure"]["kind"], "timeout");
    assert!(s["steps_completed"].as_u64().unwrap() >= 1);
    assert!(survivors(dir.path()).is_empty(), "workers left behind");
}

#[test]
fn sigterm_ends_a_run_waiting_on_a_frozen_worker_at_once() {
    // Ctrl-C and SIGTERM were ignored while the runner waited on a frozen worker's control socket.
    let dir = tempfile::tempdir().unwrap();
    let mut f = freeze_rollout(dir.path(), &["--steps", "10000", "--phase-timeout", "600"], 2);
    // Let the runner reach the frozen worker and block on it.
    std::thread::sleep(Duration::from_secs(1));
    f.at = Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(f.runner.id() as i32, libc::SIGTERM) };
    let (code, err, took) = finish(&mut f, Duration::from_secs(30));
    eprintln!("SIGTERM while waiting on a frozen worker: the runner exited {took:?} after it");
    assert_eq!(code, Some(130), "{err}");
    assert!(err.contains("interrupted (SIGTERM)"), "{err}");
    assert!(took < Duration::from_secs(3), "the run ended only {took:?} after SIGTERM");
    let s = json(&dir.path().join("summary.json"));
    assert_eq!(s["status"], "interrupted");
    assert!(s["steps_completed"].as_u64().unwrap() >= 2);
    assert!(survivors(dir.path()).is_empty(), "workers left behind");
}

/// Names in `dir` that start with `prefix`.
fn entries(dir: &Path, prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    names
}

#[test]
fn a_killed_runs_temp_and_shared_memory_files_are_swept_by_the_next_run_and_a_live_runs_kept() {
    // A SIGKILLed runner left /tmp/relax-* and /dev/shm/relax-bucket-* (host RAM) behind for good.
    let shm = Path::new("/dev/shm");
    let tmp = tempfile::tempdir().unwrap();
    let first = tempfile::tempdir().unwrap();
    let mut killed = run_cmd(first.path(), &["--steps", "10000"]).env("TMPDIR", tmp.path()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(first.path().join("metrics.jsonl")).map(|s| s.lines().count()).unwrap_or(0) < 1 {
        assert!(Instant::now() < deadline, "no step completed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = killed.id();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    killed.wait().unwrap();
    let left_dir = entries(tmp.path(), &format!("relax-{pid}-"));
    let left_bucket = entries(shm, &format!("relax-bucket-{pid}-"));
    assert_eq!((left_dir.len(), left_bucket.len()), (1, 1), "{left_dir:?} {left_bucket:?}");
    // Its workers see the connection close and exit.
    while !survivors(first.path()).is_empty() {
        assert!(Instant::now() < deadline, "the killed runner's workers stay");
        std::thread::sleep(Duration::from_millis(20));
    }

    // This test process stands for a live run; the same pid with another start time is a dead
    // owner whose pid was reused.
    let me = std::process::id();
    let start = tms_proto::process_start_time(me).unwrap();
    let live_dir = tmp.path().join(format!("relax-{me}-{start}-live"));
    let live_bucket = shm.join(format!("relax-bucket-{me}-{start}-live"));
    let dead_bucket = shm.join(format!("relax-bucket-{me}-{}-dead", start + 1));
    std::fs::create_dir(&live_dir).unwrap();
    std::fs::write(&live_bucket, b"live").unwrap();
    std::fs::write(&dead_bucket, b"dead").unwrap();

    let second = tempfile::tempdir().unwrap();
    let child = run_cmd(second.path(), &["--steps", "1"])
        .env("TMPDIR", tmp.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let second_pid = child.id();
    let out = child.wait_with_output().unwrap();
    let (kept, dead_stayed) = ((live_dir.is_dir(), live_bucket.is_file()), dead_bucket.exists());
    let _ = std::fs::remove_file(&live_bucket);
    let _ = std::fs::remove_file(&dead_bucket);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(kept, (true, true), "a live run's files were removed");
    assert!(!dead_stayed, "a dead owner's bucket stayed");
    assert!(entries(shm, &format!("relax-bucket-{second_pid}-")).is_empty(), "the second run left its bucket");
    assert!(!tmp.path().join(&left_dir[0]).exists(), "the killed run's temp dir stayed");
    assert!(!shm.join(&left_bucket[0]).exists(), "the killed run's bucket stayed");
    // The second run removed its own on the way out.
    assert_eq!(entries(tmp.path(), "relax-"), vec![format!("relax-{me}-{start}-live")]);
}

/// Resident memory of `pid` in KiB (VmRSS).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn the_runners_memory_stays_flat_over_steps() {
    // The runner kept every metric and memory sample: about 62 KB more per step, for good.
    let dir = tempfile::tempdir().unwrap();
    let mut child = run_cmd(dir.path(), &["--steps", "41"]).spawn().unwrap();
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut rss = Vec::new();
    for at in [10, 40] {
        while std::fs::read_to_string(dir.path().join("metrics.jsonl")).map(|s| s.lines().count()).unwrap_or(0) < at {
            assert!(child.try_wait().unwrap().is_none(), "the run ended before step {at}");
            assert!(Instant::now() < deadline, "step {at} not reached");
            std::thread::sleep(Duration::from_millis(5));
        }
        rss.push(rss_kib(pid));
    }
    assert!(child.wait().unwrap().success());
    let growth = rss[1] as i64 - rss[0] as i64;
    eprintln!("runner RSS at step 10: {} KiB, at step 40: {} KiB ({growth:+} KiB over 30 steps)", rss[0], rss[1]);
    assert!(growth < 512, "the runner grew {growth} KiB over 30 steps");
}

/// Whether `python3` can import `module` (the optional loggers' packages).
fn python_has(module: &str) -> bool {
    Command::new("python3").args(["-c", &format!("import {module}")]).output().is_ok_and(|o| o.status.success())
}

#[test]
fn verl_style_names_and_tensorboard_events() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_cmd(dir.path(), &["--steps", "3", "--metrics-style", "verl", "--logger", "tensorboard", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let m = metrics(dir.path());
    assert_eq!(m.len(), 3);
    for k in [
        "critic/score/mean",
        "critic/rewards/mean",
        "critic/advantages/mean",
        "response_length/mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_loss",
        "actor/grad_norm",
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_s/update_weights",
        "timing_s/step",
        "timing_s/sleep",
        "actor/entropy_loss",
        "actor/loss",
        "relax/passrate/pass@1",
        "relax/rollout/response_len/median",
    ] {
        assert!(m[2][k].is_number(), "verl style lacks {k}: {}", m[2]);
    }
    // No slime namespace is left in a verl-style row.
    for k in m[2].as_object().unwrap().keys() {
        let slime = ["rollout/", "train/", "passrate/", "partial/"].iter().any(|ns| k.starts_with(ns));
        let slime_timer = k.starts_with("perf/") && k.ends_with("_time");
        assert!(!slime && !slime_timer, "verl style still writes slime's {k}");
    }
    // The summary reads the run under its own names.
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(summary["reward"]["last3_mean"].as_f64().unwrap() > 0.0, "{summary}");
    let phases = summary["phases"].as_array().unwrap();
    assert!(phases.iter().any(|p| p["phase"] == "generate" && p["median_s"].as_f64().unwrap() > 0.0), "{summary}");
    let events: Vec<_> = std::fs::read_dir(dir.path().join("tensorboard"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("events.out.tfevents."))
        .collect();
    assert_eq!(events.len(), 1);
    // TensorBoard's own reader, where it is installed (the Rust unit test checks the framing
    // and the CRCs either way).
    if !python_has("tensorboard") {
        println!("skipped reading the event file with TensorBoard: python3 cannot import tensorboard");
        return;
    }
    let script = "import sys\n\
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
        acc = EventAccumulator(sys.argv[1]); acc.Reload()\n\
        s = acc.Scalars('critic/score/mean')\n\
        print(len(s), s[-1].step, len(acc.Tags()['scalars']))\n";
    let read = Command::new("python3").args(["-c", script]).arg(dir.path().join("tensorboard")).output().unwrap();
    assert!(read.status.success(), "{}", text(&read));
    let said = String::from_utf8_lossy(&read.stdout);
    let fields: Vec<u64> = said.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert_eq!(fields[..2], [3, 3], "{said}");
    assert!(fields[2] > 50, "scalars: {said}");
}

#[test]
fn wandb_logger_runs_offline_or_names_the_install() {
    let dir = tempfile::tempdir().unwrap();
    let out =
        run_cmd(dir.path(), &["--steps", "2", "--logger", "wandb"]).env("WANDB_MODE", "offline").output().unwrap();
    if !python_has("wandb") {
        println!("wandb is not installed for python3: checking the error that names the install");
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("pip install wandb"), "{err}");
        return;
    }
    assert!(out.status.success(), "{}", text(&out));
    let runs: Vec<_> = std::fs::read_dir(dir.path().join("wandb"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("offline-run-"))
        .collect();
    assert_eq!(runs.len(), 1, "no offline wandb run in {}", dir.path().display());
}

/// A run this machine cannot start (a device it lacks) is refused before anything is made: no
/// run folder left behind, no "partial results" of a run that never began.
#[test]
fn a_device_this_machine_lacks_is_refused_before_the_run_folder_exists() {
    // SAFETY: probing for the driver; the handle is closed at once.
    let has_cuda = unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        !h.is_null() && libc::dlclose(h) == 0
    };
    if has_cuda {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("never");
    for json in [false, true] {
        let mut cmd = Command::new(workspace().bin("relax-colocate"));
        cmd.current_dir(&workspace().root).args(["run", "--device", "cuda", "--out"]).arg(&out_dir);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.env_remove("LD_PRELOAD").env_remove("LD_LIBRARY_PATH").output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("libcuda.so.1") && !err.contains("partial results"), "{err}");
        assert!(!out_dir.exists(), "a run folder was left: {}", out_dir.display());
        if json {
            let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(doc["failure"]["kind"], "configuration", "{doc}");
        }
    }
}

/// A folder chosen for the workers' sockets (--ctl-dir, or TMS_CONTROL_DIR) is where they serve,
/// and the run folder says so from the start; a folder others can write to is refused.
#[test]
fn the_control_folder_can_be_chosen_and_the_run_folder_names_it() {
    let dir = tempfile::tempdir().unwrap();
    for (how, ctl) in [("flag", dir.path().join("by-flag")), ("env", dir.path().join("by-env"))] {
        let out_dir = dir.path().join(format!("run-{how}"));
        let mut cmd = Command::new(workspace().bin("relax-colocate"));
        cmd.current_dir(&workspace().root).args(["run", "--device", "sim", "--steps", "1", "--out"]).arg(&out_dir);
        if how == "flag" {
            cmd.arg("--ctl-dir").arg(&ctl);
        } else {
            cmd.env("TMS_CONTROL_DIR", &ctl);
        }
        let out = cmd.env_remove("LD_PRELOAD").env_remove("RELAX_WORKER_FAULT").output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{how}: {}", text(&out));
        let named = std::fs::read_to_string(out_dir.join("ctl_dir")).unwrap();
        assert_eq!(named.trim(), ctl.display().to_string(), "{how}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("control sockets in {}", ctl.display())), "{how}: {err}");
    }
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out =
        run_cmd(&dir.path().join("run-open"), &["--steps", "1", "--ctl-dir", open.to_str().unwrap()]).output().unwrap();
    assert_ne!(out.status.code(), Some(0), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the control folder"), "{}", text(&out));
}

/// `relax-colocate run` of `steps` on the simulator in the background, its workers serving in
/// `ctl`; its stderr piped for the test to read.
fn spawn_run(ctl: &Path, out_dir: &Path, steps: u32) -> std::process::Child {
    Command::new(workspace().bin("relax-colocate"))
        .current_dir(&workspace().root)
        .args(["run", "--device", "sim", "--quiet", "--steps", &steps.to_string(), "--ctl-dir"])
        .arg(ctl)
        .arg("--out")
        .arg(out_dir)
        .env_remove("LD_PRELOAD")
        .env_remove("RELAX_WORKER_FAULT")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// A run's workers are managed by the runner: a pause from outside, mid-run, is refused naming
/// the run, the job finishes, and the worker's log says who asked.
#[test]
fn an_outside_pause_of_a_running_jobs_worker_is_refused_and_the_job_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let (ctl, out_dir) = (dir.path().join("ctl"), dir.path().join("run"));
    let mut run = spawn_run(&ctl, &out_dir, 6);
    let deadline = Instant::now() + Duration::from_secs(60);
    while tms_proto::list_sockets(&ctl).iter().all(|s| !s.alive) {
        assert!(Instant::now() < deadline, "no worker served in {}", ctl.display());
        std::thread::sleep(Duration::from_millis(50));
    }
    let refused =
        Command::new(workspace().bin("tms-ctl")).arg("--dir").arg(&ctl).args(["pause", "--all"]).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&refused.stdout), String::from_utf8_lossy(&refused.stderr));
    assert_eq!(refused.status.code(), Some(1), "{said}");
    assert!(said.contains("managed by relax-colocate run (pid") && said.contains("--force"), "{said}");
    let status = run.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(run.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(status.success(), "the job did not finish after a refused outside pause: {err}");
    let logs: String = ["trainer-0", "rollout-0"]
        .iter()
        .map(|w| std::fs::read_to_string(out_dir.join(format!("logs/{w}.log"))).unwrap_or_default())
        .collect();
    assert!(logs.contains("control request from pid") && logs.contains("(tms-ctl)"), "{logs}");
}

/// With --force the outside pause happens; the run fails, and its failure names the pause it
/// found in the worker's log as the likely cause, instead of a bare 700.
#[test]
fn a_forced_outside_pause_that_breaks_a_run_is_named_as_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    let (ctl, out_dir) = (dir.path().join("ctl"), dir.path().join("run"));
    let mut run = spawn_run(&ctl, &out_dir, 40);
    // Paused from outside again and again, whatever each worker is doing, until the run stops.
    let deadline = Instant::now() + Duration::from_secs(120);
    while run.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the run kept going with its memory paused from outside");
        let _ = Command::new(workspace().bin("tms-ctl"))
            .arg("--dir")
            .arg(&ctl)
            .args(["--timeout", "2", "pause", "--force", "--all"])
            .output();
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = run.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(run.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("driven from outside the run: control request from pid") && err.contains("(tms-ctl)"),
        "{err}"
    );
}

/// `tms-ctl list` during a run must be able to find its workers: the run says where they serve.
#[test]
fn the_run_prints_where_its_workers_control_sockets_are() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(workspace().bin("relax-colocate"))
        .current_dir(&workspace().root)
        .args(["run", "--device", "sim", "--steps", "1", "--out"])
        .arg(dir.path())
        .env_remove("LD_PRELOAD")
        .env_remove("RELAX_WORKER_FAULT")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err.lines().find(|l| l.contains("control sockets in")).unwrap_or_else(|| panic!("{err}"));
    assert!(line.contains("`tms-ctl --dir ") && line.contains(" list`"), "{line}");
    // One step has no before and after (it used to print "0.063 -> 0.063").
    let stdout = String::from_utf8_lossy(&out.stdout);
    let reward = stdout.lines().find(|l| l.starts_with("reward ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(reward.ends_with("(one step: nothing to compare it with)") && !reward.contains("->"), "{reward}");
}

/// The colocated default moves the weights by IPC, as slime's `update_weights_from_tensor` does:
/// each rollout opens the buffer the trainer on its device exports (CUDA IPC handles; Ascend IPC
/// keys on the ACL side) and copies device to device. The runner's checks compare every rollout's
/// weights with the trainer's checksum after each update; the summary says no byte crossed the
/// host, where the host transport moves every byte through it.
#[test]
fn ipc_is_the_colocated_default_and_moves_no_byte_through_the_host() {
    for (api, transport) in [("cuda", None), ("acl", None), ("cuda", Some("host"))] {
        let dir = tempfile::tempdir().unwrap();
        let sim_api = format!("sim.api={api}");
        let mut args = vec!["--steps", "2", "--devices", "2", "--set", &sim_api];
        args.extend(transport.iter().flat_map(|t| ["--weight-transport", t]));
        let (_, s) = tms_e2e::runner::run_ok(dir.path(), &args);
        let w = &s["weight_sync"];
        assert_eq!(w["weight_transport"], transport.unwrap_or("ipc"), "{api}: {w}");
        assert_eq!(w["weight_updates"], 3, "the initial weights and one update per step: {w}");
        let bytes = w["update_weights_bytes"].as_u64().unwrap();
        let through_host = if transport == Some("host") { bytes } else { 0 };
        assert!(bytes > 0 && w["update_weights_buckets"].as_u64().unwrap() >= 3, "{w}");
        assert_eq!(w["update_weights_host_bytes"].as_u64(), Some(through_host), "{api} {transport:?}: {w}");
        assert!(w["update_weights_gbps"].as_f64().unwrap() > 0.0, "{w}");
        // Every update was checked on both rollouts: the run would have failed otherwise.
        assert!(s["checks"]["passed"].as_u64().unwrap() >= 6, "{s}");
        for row in metrics(dir.path()) {
            let per_update = row["perf/update_weights_bytes"].as_f64().unwrap();
            let host = row["perf/update_weights_host_bytes"].as_f64().unwrap();
            assert_eq!(host, if transport == Some("host") { per_update } else { 0.0 }, "{row}");
        }
    }
}

/// `ipc` asked of external workers that do not say in their hello that they speak it: exit 2
/// naming the key, the worker and the transport that works.
#[test]
fn ipc_with_workers_that_do_not_speak_it_is_a_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = "python3 scripts/example_worker.py";
    let args = ["--steps", "1", "--weight-transport", "ipc", "--trainer-cmd", cmd, "--rollout-cmd", cmd];
    let out = run_cmd(dir.path(), &args).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("run.weight_transport = \"ipc\"") && err.contains("--weight-transport host"), "{err}");
    assert!(err.contains("trainer-0") || err.contains("rollout-0"), "{err}");
    assert!(survivors(dir.path()).is_empty(), "workers left behind");
}
