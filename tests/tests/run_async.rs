//! `relax-colocate run --mode async` end to end on the simulator: the trainer and the rollout
//! engines on devices of their own, overlapped; the staleness bound holds (stale groups are dropped
//! and counted, never trained on); every weight update is checked on every engine; PPO runs with
//! several engines and several trainer steps per update; the weights go by broadcast over the
//! simulated NCCL and HCCL (the async default) or through the host; a worker that dies mid-update
//! or never joins the weight-sync group fails the run naming it with nothing left behind; device
//! sets and transports that cannot work exit 2 naming the key. Elastic mode lends a waiting
//! trainer's device and gets it back with the trainer's exact bytes, never both sides on it at
//! once, a lend drops no sample to staleness (the engines stay within the queue's capacity), and
//! a lent engine that keeps the device is paused from outside while the run goes on; with
//! elastic.lend_rollout a trainer-bound step's train stage goes to a lent trainer on the idle
//! engine's device too, paced at its share, and the engine gets its device back. Responses
//! that grow over the run (compute.token_scale_final) cost each step by the weight version that
//! generated it, colocated and async alike. A budget of modelled decoding per segment
//! (async.segment_s) ends segments mid-token without changing a sequence's tokens, each update's
//! flush counts as the trainer's idle time, and a malformed carried progress is named.

use serde_json::Value;
use tms_e2e::runner::*;

fn staleness_keys(summary: &Value) -> Vec<u64> {
    let hist = summary["async"]["staleness_histogram"].as_object().expect("a staleness histogram");
    hist.keys().map(|k| k.parse().unwrap()).collect()
}

#[test]
fn async_grpo_trains_on_its_own_device_within_the_staleness_bound_and_checks_every_update() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_cmd(dir.path(), &["--mode", "async", "--devices", "2", "--steps", "12", "--max-staleness", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let m = metrics(dir.path());
    assert_eq!(m.len(), 12);
    for (i, row) in m.iter().enumerate() {
        for k in [
            "perf/actor_train_time",
            "perf/update_weights_time",
            "perf/step_time",
            "trainer/idle_ratio",
            "rollouter/idle_ratio",
            "fully_async/count/stale_samples_processed",
            "fully_async/count/dropped_stale_samples",
            "partial/partial_ratio",
            "rollout/raw_reward",
            "train/pg_loss",
        ] {
            assert!(row[k].is_number(), "step lacks {k}: {row}");
        }
        assert!(row["fully_async/staleness_max"].as_f64().unwrap() <= 2.0, "{row}");
        // Every step's weights reached the engines: version = steps so far.
        assert_eq!(row["fully_async/weight_version"].as_f64(), Some(i as f64 + 1.0), "{row}");
        // One role per device: the trainer never shows on the rollout's device and back.
        assert!(resident(row, "actor_train", "trainer-0") > 0);
        assert!(resident(row, "actor_train", "rollout-1") > 0);
        assert!(row.get("memory/trainer-1/weights/actor_train_bytes").is_none(), "{row}");
    }
    let summary = json(&dir.path().join("summary.json"));
    assert_eq!(summary["status"], "ok");
    let a = &summary["async"];
    assert_eq!(a["trainer_devices"], serde_json::json!([0]));
    assert_eq!(a["rollout_devices"], serde_json::json!([1]));
    assert_eq!(a["samples_trained"].as_u64(), Some(12 * 32 * 8));
    assert_eq!(a["weight_updates"].as_u64(), Some(12));
    assert_eq!(a["dropped_stale_samples"].as_u64(), Some(0), "the default queue keeps groups within the bound");
    assert!(staleness_keys(&summary).iter().all(|s| *s <= 2), "{a}");
    // Overlap: some samples were generated while the trainer trained on earlier ones.
    assert!(staleness_keys(&summary).iter().any(|s| *s >= 1), "{a}");
    importance_weights_follow_staleness(&m, 2.0, 1);
    let c = &summary["off_policy_correction"];
    assert_eq!((&c["method"], c["tis_cap"].as_f64()), (&"tis".into(), Some(2.0)), "async's default: {c}");
    assert!(c["tis_max"].as_f64().unwrap() > 1.0 && c["tis_clipfrac_mean"].as_f64().unwrap() > 0.0, "{c}");
    // Each update is checked on the engine, and each batch against the bound.
    assert!(summary["checks"]["passed"].as_u64().unwrap() >= 2 * 12, "{summary}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("async") && stdout.contains("staleness"), "{stdout}");
    assert!(survivors(dir.path()).is_empty());
}

/// The off-policy correction's numbers per step (truncated importance sampling, cap `cap`): with
/// one trainer step per update a batch of staleness 0 came from the trainer's own weights, so
/// every ratio is 1 and the trainer applies weights of 1; a batch of stale samples has ratios off
/// 1 both ways, the trainer's weights within the cap and not all 1, and the tokens over the cap
/// counted.
fn importance_weights_follow_staleness(m: &[Value], cap: f64, steps_per_update: u64) {
    let (mut fresh, mut stale) = (0, 0);
    for row in m {
        let f = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("step lacks {k}: {row}"));
        let (max, min, clipfrac) = (f("train/tis_max"), f("train/tis_min"), f("train/tis_clipfrac"));
        let applied = f("train/tis_weight_mean");
        assert!(f("train/rollout_train_logprob_diff").is_finite() && f("train/tis_abs") >= 0.0, "{row}");
        assert!(min <= f("train/tis") && f("train/tis") <= max && (0.0..=1.0).contains(&clipfrac), "{row}");
        assert!(applied > 0.0 && applied <= cap, "weights over the cap reached the trainer: {row}");
        assert_eq!(clipfrac > 0.0, max > cap, "{row}");
        if steps_per_update == 1 && f("fully_async/staleness_max") == 0.0 {
            fresh += 1;
            let one = |x: f64| (x - 1.0).abs() < 1e-9;
            assert!(one(max) && one(min) && clipfrac == 0.0 && one(applied), "on-policy: {row}");
        } else if f("fully_async/staleness_mean") >= 1.0 {
            stale += 1;
            assert!(max > 1.0 && min < 1.0 && applied != 1.0, "stale samples weighted as fresh: {row}");
        }
    }
    assert!(stale > 0, "no step trained on a wholly stale batch");
    assert!(steps_per_update > 1 || fresh > 0, "no step trained on a batch of the current weights");
}

#[test]
fn groups_staler_than_the_bound_are_dropped_and_counted_never_trained_on() {
    let dir = tempfile::tempdir().unwrap();
    // A queue far larger than the bound lets the engines run ahead of the trainer.
    let args = [
        "--mode",
        "async",
        "--devices",
        "2",
        "--steps",
        "5",
        "--max-staleness",
        "0",
        "--set",
        "async.queue_groups=128",
    ];
    let (_, summary) = run_ok(dir.path(), &args);
    let a = &summary["async"];
    assert!(a["dropped_stale_samples"].as_u64().unwrap() > 0, "{a}");
    assert_eq!(staleness_keys(&summary), vec![0], "{a}");
    for row in metrics(dir.path()) {
        assert_eq!(row["fully_async/count/stale_samples_processed"].as_f64(), Some(0.0), "{row}");
    }
}

/// The default queue admits no group the staleness bound would drop, even where an engine's
/// request holds more groups than the bound (async.engine_groups 80 against 32 to 64 here) and
/// the bound is the tightest: staleness 0 with a weight update every 2 steps.
#[test]
fn the_default_queue_drops_nothing_when_an_engine_holds_more_than_it() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--mode",
        "async",
        "--devices",
        "2",
        "--steps",
        "6",
        "--max-staleness",
        "0",
        "--train-iters-per-update",
        "2",
        "--set",
        "async.engine_groups=80",
    ];
    let (_, summary) = run_ok(dir.path(), &args);
    let a = &summary["async"];
    assert_eq!((a["dropped_stale_samples"].as_u64(), a["queue_capacity_groups"].as_u64()), (Some(0), Some(64)), "{a}");
    assert_eq!(summary["steps_completed"].as_u64(), Some(6), "{summary}");
}

#[test]
fn async_ppo_with_two_engines_and_two_trainer_steps_per_update() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--mode",
        "async",
        "--algo",
        "ppo",
        "--devices",
        "3",
        "--trainer-devices",
        "0",
        "--rollout-devices",
        "1-2",
        "--train-iters-per-update",
        "2",
        "--steps",
        "6",
        "--set",
        "algo.tis_cap=1.2",
    ];
    let out = run_cmd(dir.path(), &args).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let summary = json(&dir.path().join("summary.json"));
    assert_eq!(summary["async"]["weight_updates"].as_u64(), Some(3), "{summary}");
    // The default queue follows the updates (one every 2 steps, staleness 2): the batch x 6 right
    // after one, x 5 a step later, and still no group goes stale.
    assert_eq!(summary["async"]["queue_capacity_groups"].as_u64(), Some(6 * 32), "the default batch x 6: {summary}");
    assert_eq!(summary["async"]["dropped_stale_samples"].as_u64(), Some(0), "{summary}");
    assert_eq!(summary["off_policy_correction"]["tis_cap"].as_f64(), Some(1.2), "{summary}");
    assert_eq!(summary["async"]["rollout_devices"], serde_json::json!([1, 2]));
    let m = metrics(dir.path());
    assert!(m.iter().all(|r| r["rollout/values"].is_number()), "PPO rows carry the critic's values");
    // Updates after steps 2, 4 and 6 only.
    let versions: Vec<f64> = m.iter().map(|r| r["fully_async/weight_version"].as_f64().unwrap()).collect();
    assert_eq!(versions, vec![0.0, 1.0, 1.0, 2.0, 2.0, 3.0]);
    // The second step of each update trains on samples of the weights before the first: off
    // policy even at staleness 0, so some tokens go over the cap, and none reach the trainer so.
    importance_weights_follow_staleness(&m, 1.2, 2);
    assert!(m.iter().any(|r| r["train/tis_clipfrac"].as_f64().unwrap() > 0.0), "nothing over the cap of 1.2");
    assert!(dir.path().join("logs/rollout-2.log").is_file() && dir.path().join("logs/trainer-0.log").is_file());
}

/// Bytes per update as every row says, with the buckets they took at `bucket` bytes each.
fn updates(m: &[Value], bucket: f64) -> Vec<f64> {
    m.iter()
        .map(|row| {
            let bytes = row["perf/update_weights_bytes"].as_f64().unwrap_or_else(|| panic!("no bytes: {row}"));
            assert_eq!(row["perf/update_weights_buckets"].as_f64(), Some((bytes / bucket).ceil()), "{row}");
            assert!(row["perf/update_weights_gbps"].as_f64().unwrap() > 0.0, "{row}");
            // The modelled link of 2 GB/s: a share of it, never more than all of it (by much).
            let share = row["perf/update_weights_link_share"].as_f64().unwrap();
            assert!(share > 0.0 && share < 1.2, "{row}");
            bytes
        })
        .collect()
}

#[test]
fn async_grpo_broadcasts_its_weights_over_nccl_and_hccl_checked_on_every_engine() {
    for (api, library) in [("cuda", "nccl"), ("acl", "hccl")] {
        let dir = tempfile::tempdir().unwrap();
        let line = format!(
            "--mode async --devices 3 --rollout-devices 1-2 --steps 3 --update-weight-buffer-size 8MiB \
             --set sim.api={api} --set sim.link_gbps=2"
        );
        let args: Vec<&str> = line.split_whitespace().collect();
        let (out, summary) = run_ok(dir.path(), &args);
        let a = &summary["async"];
        assert_eq!(a["weight_transport"], "broadcast", "the async default: {a}");
        assert_eq!(a["weight_sync_library"], library, "{a}");
        let per_update = updates(&metrics(dir.path()), (8u64 << 20) as f64);
        assert!(per_update.iter().all(|b| *b == per_update[0] && *b > 8.0 * (1 << 20) as f64), "{per_update:?}");
        // The initial weights and one update per step, the same bytes each time.
        assert_eq!(a["update_weights_bytes"].as_f64(), Some(4.0 * per_update[0]), "{a}");
        assert_eq!(a["update_weights_buckets"].as_f64(), Some(4.0 * (per_update[0] / (8 << 20) as f64).ceil()));
        assert_eq!(a["link_gbps"].as_f64(), Some(2.0), "{a}");
        assert!(a["update_weights_gbps"].as_f64().unwrap() > 0.0 && a["link_share"].as_f64().unwrap() > 0.0, "{a}");
        // Every update checked on both engines (and every batch against the bound).
        assert!(summary["checks"]["passed"].as_u64().unwrap() >= 4 + 3, "{summary}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains(&format!("over broadcast ({})", library.to_uppercase())), "{stdout}");
        assert!(survivors(dir.path()).is_empty());
    }
}

#[test]
fn a_member_that_dies_mid_broadcast_fails_the_run_naming_it() {
    for (fault, name) in
        [("broadcast_weights:2:crash:rollout", "rollout-1"), ("broadcast_weights:2:crash:trainer", "trainer-0")]
    {
        let (dir, out) = failing_run(fault, &["--mode", "async", "--devices", "2"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("phase update_weights") && err.contains(name) && err.contains("signal 6"), "{err}");
        let s = json(&dir.path().join("summary.json"));
        assert_eq!(
            (&s["status"], &s["failure"]["kind"], &s["failure"]["worker"]),
            (&"failed".into(), &"crash".into(), &name.into())
        );
    }
}

#[test]
fn a_member_that_never_joins_the_weight_sync_group_is_named_within_the_phase_timeout() {
    let t = std::time::Instant::now();
    let (dir, out) =
        failing_run("group_init:0:hang:rollout", &["--mode", "async", "--devices", "2", "--phase-timeout", "6"]);
    let err = String::from_utf8_lossy(&out.stderr);
    // The trainer gave up after its connect timeout (half the phase timeout) and said why.
    assert!(
        err.contains("phase group_init") && err.contains("rollout-1 never took part in the weight-sync group"),
        "{err}"
    );
    assert!(err.contains("trainer-0 gave up waiting for it"), "{err}");
    let s = json(&dir.path().join("summary.json"));
    assert_eq!(s["failure"]["kind"], "timeout");
    assert_eq!(s["failure"]["worker"], "rollout-1");
    // Within the phase timeout, plus starting and stopping the workers.
    assert!(t.elapsed().as_secs_f64() < 6.0 + 6.0, "{:?}", t.elapsed());
}

#[test]
fn an_engine_that_dies_mid_update_fails_the_run_naming_it() {
    let (dir, out) =
        failing_run("unpack:2:crash", &["--mode", "async", "--devices", "2", "--weight-transport", "host"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("phase update_weights") && err.contains("rollout-1") && err.contains("signal 6"), "{err}");
    let s = json(&dir.path().join("summary.json"));
    assert_eq!(s["status"], "failed");
    assert_eq!(s["failure"]["kind"], "crash");
}

/// A worker command: scripts/example_worker.py with its `generate` replaced by `body` (a Python
/// function body over the request `p`, the example's module as `ew`, indented by four spaces).
fn example_worker_with_generate(dir: &std::path::Path, name: &str, body: &str) -> String {
    let script = dir.join(format!("{name}.py"));
    let source = format!(
        "import os, sys\n\
         sys.path.insert(0, os.path.join(os.getcwd(), 'scripts'))\n\
         import example_worker as ew, relax_worker as rw\n\
         names = ['init', 'checksum', 'generate', 'log_probs', 'train', 'update_begin', 'pack', 'unpack', 'update_end']\n\
         handlers = {{n: getattr(ew, n) for n in names}}\n\
         def generate(p):\n    {body}\
         handlers['generate'] = generate\n\
         rw.serve(handlers, implementation='{name}')\n"
    );
    std::fs::write(&script, source).unwrap();
    format!("python3 {}", script.display())
}

/// External Python workers in async mode: scripts/example_worker.py does partial rollouts; a
/// worker that predates them (it ignores `responses` and `segment_tokens`, as a worker ignores
/// params it does not know) returns whole responses, which fails a segmented run with a message
/// saying what to set, and runs with `async.segment_tokens = 0`.
#[test]
fn external_workers_in_async_mode_with_and_without_partial_rollouts() {
    let dir = tempfile::tempdir().unwrap();
    let example = "python3 scripts/example_worker.py";
    let base = [
        "--mode",
        "async",
        "--devices",
        "2",
        "--steps",
        "2",
        "--prompts",
        "4",
        "--samples",
        "4",
        "--set",
        "task.digits=3",
    ];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    let args = with(&["--set", "async.segment_tokens=1", "--trainer-cmd", example, "--rollout-cmd", example]);
    let out = run_cmd(&dir.path().join("example"), &args).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let s = json(&dir.path().join("example/summary.json"));
    assert_eq!(s["async"]["segment_tokens"].as_u64(), Some(1), "{s}");
    // Its hello names no broadcast (it has no group methods), so `auto` keeps the host transport.
    assert_eq!(s["async"]["weight_transport"], "host", "{s}");
    // It applies the off-policy correction's weights the runner sends, within the cap.
    for row in metrics(&dir.path().join("example")) {
        assert!(row["train/tis_weight_mean"].as_f64().is_some_and(|w| w > 0.0 && w <= 2.0), "{row}");
    }

    let whole = "p = {k: v for k, v in p.items() if k not in ('responses', 'segment_tokens')}\n    \
                 r = ew.generate(p)\n    \
                 for s in r['samples']:\n        \
                     del s['finished']\n    \
                 return r\n";
    let old = example_worker_with_generate(dir.path(), "old", whole);
    // A segmented run with `rollout` as its engine fails naming it and `says`, leaving nothing.
    let fails = |name: &str, rollout: &str, says: &str| {
        let mut args = with(&["--set", "async.segment_tokens=1", "--trainer-cmd", example]);
        args.extend(["--rollout-cmd", rollout]);
        let out = run_cmd(&dir.path().join(name), &args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("rollout-1") && err.contains(says), "{err}");
        assert!(survivors(&dir.path().join(name)).is_empty(), "{name}: workers left behind");
    };
    fails("old", &old, "set async.segment_tokens=0");

    // A reply whose carried progress is no count of decode steps is the worker's error, named.
    let negative = "r = ew.generate(p)\n    \
                    for s in r['samples']:\n        \
                        s['progress'] = -1.5\n    \
                    return r\n";
    let bad = example_worker_with_generate(dir.path(), "bad_progress", negative);
    fails("bad", &bad, "field `progress` = -1.5");

    let mut args = with(&["--set", "async.segment_tokens=0", "--trainer-cmd", example]);
    args.extend(["--rollout-cmd", &old]);
    let out = run_cmd(&dir.path().join("whole"), &args).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let s = json(&dir.path().join("whole/summary.json"));
    assert_eq!(s["async"]["partial_samples"].as_u64(), Some(0), "{s}");
    // Three updates checked on the engine, two batches against the bound.
    assert!(s["checks"]["passed"].as_u64().unwrap() >= 5, "{s}");
}

/// Stale samples trained on without a correction are refused (exit 2, naming the keys and the
/// ways out) unless the run opts out; so opted out, the trainer gets no weights (it applies 1 to
/// every token) and the rows carry the log-prob gap but no importance ratios.
#[test]
fn uncorrected_stale_training_is_refused_unless_opted_out() {
    let dir = tempfile::tempdir().unwrap();
    let none = ["--mode", "async", "--devices", "2", "--set", "algo.off_policy_correction=none"];
    for (extra, said) in [
        (vec![], "async.max_staleness = 2 and async.train_iters_per_update = 1"),
        (vec!["--max-staleness", "0", "--train-iters-per-update", "2"], "async.train_iters_per_update = 2"),
    ] {
        let out = run_cmd(dir.path(), &[&none[..], &extra].concat()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        for key in ["algo.off_policy_correction = \"none\" in async mode", said, "algo.allow_uncorrected_stale = true"]
        {
            assert!(err.contains(key), "{extra:?}: {err}");
        }
    }
    for (args, said) in [
        (vec!["--set", "algo.tis_cap=0.5"], "algo.tis_cap=0.5 must be a number >= 1"),
        (vec!["--set", "algo.off_policy_correction=is"], "algo.off_policy_correction: unknown variant"),
    ] {
        let out = run_cmd(dir.path(), &args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.code() == Some(2) && err.contains(said), "{args:?}: {err}");
    }
    assert!(!dir.path().join("metrics.jsonl").exists(), "a refused configuration started a run");

    let args = [&none[..], &["--steps", "4", "--set", "algo.allow_uncorrected_stale=true"]].concat();
    let (_, summary) = run_ok(&dir.path().join("opted-out"), &args);
    assert_eq!(summary["off_policy_correction"]["method"], "none", "{summary}");
    assert!(staleness_keys(&summary).iter().any(|s| *s >= 1), "nothing stale was trained on: {summary}");
    for row in metrics(&dir.path().join("opted-out")) {
        assert_eq!(row["train/tis_weight_mean"].as_f64(), Some(1.0), "{row}");
        assert!(row.get("train/tis").is_none() && row.get("train/tis_clipfrac").is_none(), "{row}");
        assert!(row["train/rollout_train_logprob_diff"].is_number(), "{row}");
    }
}

/// Async with the rollout's log-probs as the old ones and no reference: the trainer's first stage
/// is training itself (no log-prob pass of either model), the clipped PPO ratio to the rollout's
/// log-probs is the correction (no TIS weights), and the run passes its checks.
#[test]
fn async_with_rollout_log_probs_and_no_reference_trains_without_a_log_prob_pass() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--mode", "async", "--devices", "2", "--steps", "3", "--max-staleness", "1"];
    let sets = ["--set", "algo.rollout_log_probs=true", "--set", "algo.reference=false", "--set", "algo.kl_coef=0"];
    let (_, summary) = run_ok(dir.path(), &[&args[..], &sets].concat());
    assert_eq!(summary["status"], "ok");
    assert_eq!(summary["off_policy_correction"]["method"], "rollout_log_probs", "{summary}");
    assert!(summary["checks"]["passed"].as_u64().unwrap() >= 3, "{summary}");
    let m = metrics(dir.path());
    assert_eq!(m.len(), 3);
    for row in &m {
        for k in ["perf/log_probs_time", "perf/ref_log_probs_time", "rollout/kl", "rollout/entropy", "train/tis"] {
            assert!(row.get(k).is_none(), "{k} in {row}");
        }
        for k in ["perf/advantages_time", "perf/actor_train_time", "train/pg_loss", "train/ppo_kl"] {
            assert!(row[k].is_number(), "step lacks {k}: {row}");
        }
        assert_eq!(row["train/tis_weight_mean"].as_f64(), Some(1.0), "{row}");
    }
}

#[test]
fn device_sets_that_cannot_work_exit_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (args, said) in [
        (vec!["--mode", "async"], "needs at least 2 devices"),
        (
            vec![
                "--mode",
                "async",
                "--launcher",
                "ray",
                "--ray-address",
                "10.0.0.1:6379",
                "--nodes",
                "2",
                "--devices",
                "1",
                "--weight-transport",
                "host",
            ],
            "moves the weights through a file on one host",
        ),
        (
            vec!["--mode", "async", "--devices", "2", "--trainer-devices", "0", "--rollout-devices", "0-1"],
            "overlap on device 0",
        ),
        (vec!["--mode", "async", "--devices", "2", "--trainer-devices", "0-1"], "run.rollout_devices is empty"),
        (vec!["--mode", "async", "--devices", "2", "--rollout-devices", "2"], "run.rollout_devices: device 2 is past"),
        (
            vec!["--mode", "async", "--devices", "2", "--trainer-devices", "x"],
            "run.trainer_devices: \"x\" is not a device",
        ),
        (vec!["--mode", "async", "--devices", "2", "--max-staleness", "-1"], "async.max_staleness=-1 is below 0"),
        (vec!["--mode", "async", "--devices", "2", "--train-iters-per-update", "0"], "async.train_iters_per_update"),
        (
            vec!["--mode", "async", "--devices", "2", "--set", "async.queue_groups=4"],
            "async.queue_groups=4 cannot hold",
        ),
        (vec!["--devices", "2", "--trainer-devices", "0"], "needs run.mode = \"async\""),
        (
            vec!["--weight-transport", "broadcast"],
            "run.weight_transport = \"broadcast\" needs run.mode = \"async\" (--mode async): colocated",
        ),
        (
            vec!["--mode", "async", "--devices", "2", "--weight-transport", "ipc"],
            "run.weight_transport = \"ipc\" shares a device buffer between the trainer and the rollout on one device",
        ),
        (vec!["--mode", "async", "--devices", "2", "--set", "sim.link_gbps=fast"], "sim.link_gbps=\"fast\" is not"),
        (vec!["--mode", "async", "--devices", "2", "--set", "async.segment_s=-1"], "async.segment_s=-1 must be >= 0"),
        (vec!["--mode", "elastic", "--devices", "2", "--set", "async.segment_s=inf"], "async.segment_s=inf must be"),
        (
            vec!["--mode", "async", "--devices", "3", "--rollout-devices", "1-2", "--prompts", "9"],
            "multiple of the 2 rollout",
        ),
        (vec!["--mode", "elastic"], "run.mode = \"elastic\" needs at least 2 devices"),
        (
            vec!["--mode", "elastic", "--devices", "2", "--offload", "false"],
            "set run.offload = true, or use --mode async",
        ),
        (
            vec!["--mode", "elastic", "--devices", "2", "--set", "elastic.reclaim_timeout_s=0"],
            "elastic.reclaim_timeout_s=0 must be > 0",
        ),
        (vec!["--mode", "elastic", "--devices", "2", "--set", "elastic.lend_after_s=-1"], "elastic.lend_after_s=-1"),
    ] {
        let out = run_cmd(dir.path(), &args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(said), "{args:?}: {err}");
    }
    assert!(!dir.path().join("metrics.jsonl").exists(), "a configuration error started a run");
}

#[test]
fn with_modelled_compute_updates_interrupt_generation_and_sequences_continue_under_new_weights() {
    let dir = tempfile::tempdir().unwrap();
    // A 4B model's device time on the modelled device, decoding at 1% of its peak, makes
    // generation slow enough that updates land while sequences are in flight. Segments of 2
    // tokens, no time budget: a segment outlasts the trainer's step, so sequences have tokens of
    // the old weights when an update lands (under the default budget a token still under way
    // then is sampled, whole, by the new ones).
    let segments = ["--set", "async.segment_s=0"];
    let args = [&["--mode", "async", "--devices", "2", "--steps", "4"][..], &ROLLOUT_BOUND, &segments].concat();
    let out = run_cmd(dir.path(), &args).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let summary = json(&dir.path().join("summary.json"));
    let a = &summary["async"];
    assert!(a["partial_samples"].as_u64().unwrap() > 0, "{a}");
    assert!(summary["compute"].as_str().unwrap().starts_with("modelled: qwen3-4b"), "{summary}");
    let m = metrics(dir.path());
    assert!(m.iter().any(|r| r["partial/max_partial_span"].as_f64().unwrap() >= 1.0), "no sample spanned an update");
    assert!(m.iter().all(|r| r["perf/pause_generation_time"].is_number()), "each update waits for the segments");
    // The trainer's devices wait through each update's flush: its idle share counts it beside
    // the wait for a batch, which keeps its own name.
    for r in &m {
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("no {k}: {r}"));
        assert!(f("perf/flush_time") > 0.0 && f("perf/flush_time") <= f("perf/step_time"), "{r}");
        let counted = f("perf/wait_time_ratio") + f("trainer/flush_ratio");
        assert!((f("trainer/idle_ratio") - counted).abs() < 1e-9, "idle is not waiting plus flush: {r}");
    }
    let share = |k: &str| a[k].as_f64().unwrap_or_else(|| panic!("no {k}: {a}"));
    assert!(share("flush_ratio") > 0.0 && share("flush_s_mean") > 0.0, "{a}");
    assert!((share("trainer_idle_ratio") - share("trainer_wait_ratio") - share("flush_ratio")).abs() < 1e-9, "{a}");
    // The continued sequences are well formed: the checks (weights on every engine, the bound) held.
    assert_eq!(summary["status"], "ok");
}

/// A budget of modelled decoding far under one task token's time (async.segment_s): segments end
/// part-way through tokens, and each sequence, continued from the steps it had done, samples the
/// same tokens as without the budget (its seed and position decide each draw, not the segment):
/// step 1's batch, all of the initial weights, is the same in every rollout figure.
#[test]
fn a_segment_budget_ends_segments_mid_token_and_the_sequences_keep_their_tokens() {
    let job = [
        &["--mode", "async", "--devices", "2", "--steps", "1", "--prompts", "4", "--samples", "4"][..],
        &ROLLOUT_BOUND,
    ]
    .concat();
    let run = |budget: &str| {
        let dir = tempfile::tempdir().unwrap();
        let set = format!("async.segment_s={budget}");
        let (_, s) = run_ok(dir.path(), &[&job[..], &["--set", &set]].concat());
        (metrics(dir.path()).remove(0), s["async"].clone())
    };
    let (whole, w) = run("0");
    let (split, s) = run("0.01");
    assert_eq!((w["segment_s"].clone(), w["segments_ended_mid_token"].as_u64()), (Value::Null, Some(0)), "{w}");
    assert_eq!(s["segment_s"].as_f64(), Some(0.01), "{s}");
    assert!(s["segments_ended_mid_token"].as_u64().unwrap() > 0, "no segment ended mid-token: {s}");
    let rollout: Vec<(&String, &Value)> =
        whole.as_object().unwrap().iter().filter(|(k, _)| k.starts_with("rollout/")).collect();
    assert!(rollout.len() >= 8, "{whole}");
    for (k, v) in rollout {
        assert_eq!(&split[k], v, "{k} differs with the budget: the split sequences sampled other tokens");
    }
}

#[test]
fn responses_that_grow_over_the_run_cost_each_step_by_the_batch_drawn_for_it_in_every_mode() {
    // Each task token stands for 1 modelled token at step 1 and 100 at step 3; every modelled
    // decode step pays 10 ms, so one task decode step at step 3 lasts at least 1 s.
    let job = [
        "--steps",
        "3",
        "--devices",
        "2",
        "--memory-profile",
        "qwen3-4b",
        "--set",
        "memory.scale=0.002",
        "--set",
        "compute.model=true",
        "--set",
        "rollout.prompts_per_step=8",
        "--set",
        "compute.token_scale=1",
        "--set",
        "compute.token_scale_final=100",
        "--set",
        "compute.decode_step_ms=10",
    ];
    // Staleness 0: every sample of step k comes from version k - 1, as colocated.
    for mode in [&["--mode", "colocate"][..], &["--mode", "async", "--max-staleness", "0"]] {
        let dir = tempfile::tempdir().unwrap();
        let (_, summary) = run_ok(dir.path(), &[mode, &job[..]].concat());
        let m = metrics(dir.path());
        let scales: Vec<f64> = m.iter().map(|r| r["compute/token_scale"].as_f64().unwrap()).collect();
        assert_eq!(scales, vec![1.0, 50.5, 100.0], "{mode:?}");
        let last = &m[2];
        // The trainer's reference pass over the last batch: at least its response tokens x 100
        // through a 4B model's forward pass (2 x 4e9 FLOPs) at 989 TFLOPS x MFU 0.4 (prompts
        // left out, so a lower bound).
        let tokens = 64.0 * last["rollout/response_len/mean"].as_f64().unwrap();
        let floor = tokens * 100.0 * 8e9 / (989e12 * 0.4);
        let pass = last["perf/ref_log_probs_time"].as_f64().unwrap();
        assert!(pass >= floor, "{mode:?}: ref_log_probs {pass} s < {floor} s at 100 modelled tokens per token");
        if mode[1] == "colocate" {
            let generate = last["perf/rollout_time"].as_f64().unwrap();
            assert!(generate >= 1.0, "step 3 generated in {generate} s: under one decode step at 100 x 10 ms");
            the_switch_was_charged_at_the_h100_s_host_link(&summary, last);
        }
    }
}

/// The colocated switch of Qwen3-4B at memory.scale 0.002: each sleep and wake-up charged the
/// full-scale trainer state (about 73 GB) over the H100 preset's D2H and H2D rates, not what the
/// simulator's 1/500 of it took, and the phases lasted at least that.
fn the_switch_was_charged_at_the_h100_s_host_link(summary: &Value, last: &Value) {
    let sw = &summary["switch"];
    assert_eq!(sw["device"], "h100", "{sw}");
    assert!(summary["compute"].as_str().unwrap().contains("the switch charged from the profile's full-scale bytes"));
    let stage = |name: &str| {
        let s = sw["stages"].as_array().unwrap().iter().find(|s| s["stage"] == name).cloned();
        s.unwrap_or_else(|| panic!("no stage {name}: {sw}"))
    };
    let each = |s: &Value| s["modelled_s"].as_f64().unwrap() / s["count"].as_f64().unwrap();
    let (sleep, wake) = (each(&stage("sleep")), each(&stage("wake_up")));
    assert!((72e9 / 52.8e9..74e9 / 52.8e9).contains(&sleep), "sleep modelled at {sleep} s");
    // The same bytes both ways: the times stand as the preset's two rates.
    assert!((wake / sleep - 52.8 / 35.0).abs() < 1e-9, "wake {wake} s against sleep {sleep} s");
    for s in sw["stages"].as_array().unwrap() {
        let f = |k: &str| s[k].as_f64().unwrap();
        assert!(f("charged_s") >= f("modelled_s") && f("charged_s") >= f("measured_s"), "{s}");
    }
    let f = |k: &str| last[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {last}"));
    assert!(f("perf/sleep_time") >= sleep && f("perf/wake_up_time") >= wake, "{last}");
    assert!(f("perf/switch_time") >= f("perf/switch_modelled_time") && f("perf/switch_modelled_time") >= sleep + wake);
}

#[test]
fn once_the_trainer_has_its_last_batch_no_engine_starts_another_segment() {
    // A rollout-bound job with responses of up to 8 tokens in 2-token segments: groups are still
    // under way when the last batch goes to the trainer, and finishing them would take more
    // segments that nobody trains on.
    let dir = tempfile::tempdir().unwrap();
    let job = ["--mode", "async", "--devices", "2", "--steps", "3", "--set", "task.max_new_tokens=24"];
    let (_, summary) = run_ok(dir.path(), &[&job[..], &ROLLOUT_BOUND].concat());
    let a = &summary["async"];
    // One engine, so at most its one segment in flight then.
    let after = a["generate_replies_after_last_batch"].as_u64().unwrap();
    assert!(after <= 1, "{after} generate replies after the last batch: the engine went on generating: {a}");
}

#[test]
fn compare_runs_the_same_job_in_every_layout_and_prints_one_table() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(tms_e2e::workspace().bin("relax-colocate"))
        .current_dir(&tms_e2e::workspace().root)
        .args(["compare", "--devices", "2", "--steps", "3", "--repeats", "1", "--out"])
        .arg(dir.path())
        .args(["--set", "run.device=\"sim\""])
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in [
        "samples/s",
        "trainer busy",
        "rollout busy",
        "rollout batch slots filled",
        "trained tokens/s per trainer device",
        "staleness",
        "async / colocate throughput",
        "modelled:",
    ] {
        assert!(stdout.contains(line), "table lacks {line}:\n{stdout}");
    }
    let report = json(&dir.path().join("compare.json"));
    for layout in ["colocate", "async", "elastic"] {
        assert!(report[layout]["samples_per_s"].as_f64().unwrap() > 0.0, "{report}");
        assert_eq!(report[layout]["steps"].as_u64(), Some(3), "{report}");
        assert!(dir.path().join(layout).join("summary.json").is_file());
        // The rollout engines' batch slots: some filled, never more than all.
        let filled = report[layout]["slot_occupancy"].as_f64().unwrap_or_else(|| panic!("{report}"));
        assert!(filled > 0.0 && filled <= 1.0, "{layout}: {filled}");
        // Each role's work per device of its own: the trainer's devices train, the rollout's
        // generate; apart, the rollout's few devices each make more than the whole run's mean.
        let per = |k: &str| report[layout][k].as_f64().unwrap_or_else(|| panic!("{layout} {k}: {report}"));
        assert!(per("trainer_tokens_per_device_s") > 0.0, "{report}");
        assert!(per("rollout_tokens_per_device_s") >= per("tokens_per_device_s") * 0.999, "{report}");
    }
    let ratio = report["async_over_colocate_samples_per_s"].as_f64().unwrap();
    let expected =
        report["async"]["samples_per_s"].as_f64().unwrap() / report["colocate"]["samples_per_s"].as_f64().unwrap();
    assert!((ratio - expected).abs() < 1e-9);
    // The steady figure leaves out step 1, which in async mode fills the pipeline.
    let steady = |l: &str| report[l]["samples_per_s_after_first_step"].as_f64().unwrap();
    let after = report["async_over_colocate_after_first_step"].as_f64().unwrap();
    assert!(steady("async") > 0.0 && (after - steady("async") / steady("colocate")).abs() < 1e-9, "{report}");
    assert!(stdout.contains("samples/s after step 1"), "{stdout}");
    // Elastic mode's lending figures, and its throughput over the better of the other two.
    assert!(stdout.contains("lends per step") && stdout.contains("elastic / the better of the others"), "{stdout}");
    assert!(report["elastic"]["elastic"]["lends_per_step"].is_number(), "{report}");
    let best = steady("colocate").max(steady("async"));
    let over = report["elastic_over_best_other_after_first_step"].as_f64().unwrap();
    assert!((over - steady("elastic") / best).abs() < 1e-9, "{report}");
    assert!(std::fs::read_to_string(dir.path().join("reward_vs_time.svg")).unwrap().contains("colocate"));
    // The verdict: the fastest after step 1, named on stdout; 3 steps are too few to be sure.
    let verdict = &report["verdict"];
    // An elastic run that lent nothing ran async's layout and is not ranked apart from it.
    let lent_nothing = report["elastic"]["elastic"]["lends_per_step"].as_f64() == Some(0.0);
    assert_eq!(verdict["elastic_lent_nothing"].as_bool(), Some(lent_nothing), "{report}");
    let ranked: &[&str] = if lent_nothing { &["colocate", "async"] } else { &["colocate", "async", "elastic"] };
    let best = ranked.iter().max_by(|a, b| steady(a).total_cmp(&steady(b))).unwrap();
    assert_eq!(verdict["layout"], *best, "{report}");
    assert!(!lent_nothing || stdout.contains("elastic lent nothing, so it ran async's layout"), "{stdout}");
    assert_eq!((verdict["short_run"].as_bool(), verdict["clear"].as_bool()), (Some(true), Some(false)), "{report}");
    assert!(stdout.contains("for this job: ") && stdout.contains("use --steps 5 or more"), "{stdout}");
    // Three steps are too few to see the reward rise: no time to reward, and the line says why.
    assert_eq!(verdict["reward"]["learned"].as_bool(), Some(false), "{report}");
    assert!(report["colocate"].get("time_to_reward_s").is_none(), "{report}");
    assert!(stdout.contains("learning: the reward did not rise by 0.05 in every run"), "{stdout}");
    // A key that does not exist is the run's configuration error, exit 2 with its name.
    let bad = std::process::Command::new(tms_e2e::workspace().bin("relax-colocate"))
        .args(["compare", "--steps", "1", "--set", "algo.lrr=1", "--out"])
        .arg(dir.path().join("bad"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("algo.lrr"));
}

/// `relax-colocate compare` of colocate and async with the job file `config`, into `out`: the file's
/// job shrunk to a step of 2 prompts on this CPU's time, each layout run twice.
fn compare_job(config: &str, out: &std::path::Path) -> std::process::Output {
    std::process::Command::new(tms_e2e::workspace().bin("relax-colocate"))
        .current_dir(&tms_e2e::workspace().root)
        .args(["compare", "--devices", "2", "--steps", "1", "--repeats", "2", "--layouts", "colocate,async"])
        .args(["--config", config, "--reward-target=-1"])
        .args(["--model-compute", "false", "--set", "rollout.prompts_per_step=2", "--set", "run.device=\"sim\""])
        .arg("--out")
        .arg(out)
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap()
}

/// Where compare ran `layout`'s run `k` (from 1).
fn compare_run(out: &std::path::Path, layout: &str, k: usize) -> std::path::PathBuf {
    if k == 1 { out.join(layout) } else { out.join(format!("{layout}-{k}")) }
}

/// How long step 1 of the run in `dir` took (its first metrics row's wall step time).
fn first_step_s(dir: &std::path::Path) -> f64 {
    let rows = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let first: Value = serde_json::from_str(rows.lines().next().unwrap()).unwrap();
    first["perf/wall_step_time"].as_f64().unwrap()
}

#[test]
fn compare_takes_a_job_file_for_every_layout_and_its_own_flags_win() {
    // The shipped long-tail job: what matters here is that every layout ran the file's job, not
    // how fast.
    let dir = tempfile::tempdir().unwrap();
    let out = compare_job("jobs/long-tail.toml", dir.path());
    assert!(out.status.success(), "{}", text(&out));
    // Each layout ran twice, interleaved; the report holds both runs' figures and their spread.
    let report = json(&dir.path().join("compare.json"));
    for layout in ["colocate", "async"] {
        assert!(compare_run(dir.path(), layout, 2).join("summary.json").is_file(), "{layout}'s second run");
        let runs = report[layout]["samples_per_s_runs"].as_array().expect("every run's samples/s");
        assert_eq!(runs.len(), 2, "{report}");
        let mean = runs.iter().map(|r| r.as_f64().unwrap()).sum::<f64>() / 2.0;
        assert!((report[layout]["samples_per_s"].as_f64().unwrap() - mean).abs() < 1e-9, "{report}");
        assert!(report[layout]["samples_per_s_spread"].as_f64().unwrap() >= 0.0, "{report}");
    }
    assert_eq!(report["verdict"]["repeats"].as_u64(), Some(2), "{report}");
    // A reward level every run starts above is reached at the end of each run's first step.
    for layout in ["colocate", "async"] {
        let times = report[layout]["time_to_reward_s_runs"].as_array().expect("every run's time to reward");
        for (k, t) in times.iter().map(|t| t.as_f64().unwrap()).enumerate() {
            let step = first_step_s(&compare_run(dir.path(), layout, k + 1));
            assert!((t - step).abs() < 1e-9, "{layout} run {}: {t} s to reward, step 1 took {step} s", k + 1);
        }
    }
    let reward = &report["verdict"]["reward"];
    assert_eq!((reward["learned"].as_bool(), reward["target"].as_f64()), (Some(true), Some(-1.0)), "{report}");
    let soonest = if report["colocate"]["time_to_reward_s"].as_f64() < report["async"]["time_to_reward_s"].as_f64() {
        "colocate"
    } else {
        "async"
    };
    assert_eq!(reward["layout"], soonest, "{report}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("learning: time to reward -1.000 (--reward-target)"));
    let progress = String::from_utf8_lossy(&out.stderr);
    let order: Vec<usize> =
        ["colocate layout (1 steps, run 1", "async layout (1 steps, run 1", "colocate layout (1 steps, run 2"]
            .iter()
            .map(|l| progress.find(l).unwrap_or_else(|| panic!("no '{l}' in:\n{progress}")))
            .collect();
    assert!(order[0] < order[1] && order[1] < order[2], "runs not interleaved:\n{progress}");
    for layout in ["colocate", "async"] {
        let config: toml::Table =
            std::fs::read_to_string(dir.path().join(layout).join("config.toml")).unwrap().parse().unwrap();
        // The file's keys reached the run; compare's --steps, its layout and every --set won.
        let want: [(&str, &str, toml::Value); 7] = [
            ("task", "max_new_tokens", 96.into()),
            ("compute", "token_scale", 40.0.into()),
            ("memory", "profile", "qwen3-4b".into()),
            ("compute", "model", false.into()),
            ("rollout", "prompts_per_step", 2.into()),
            ("run", "steps", 1.into()),
            ("run", "mode", layout.into()),
        ];
        for (section, key, value) in want {
            assert_eq!(config[section][key], value, "{layout}: {config}");
        }
    }
    // A job file that is not there is compare's own error, before any layout runs.
    let missing = compare_job("jobs/no-such-job.toml", &dir.path().join("missing"));
    assert_eq!(missing.status.code(), Some(2), "{}", text(&missing));
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("--config jobs/no-such-job.toml") && !err.contains("running the"), "{err}");
    assert!(!dir.path().join("missing").join("colocate").exists());
}

/// A rollout-bound job: a 4B model's device time on the modelled device, decoding at 1% of its
/// peak, keeps the trainer waiting for samples about half the time, long past a switch, and
/// makes updates land while sequences are in flight. The host link is not charged: these jobs
/// test lending's mechanism, and the 4B trainer's modelled switch (3.5 s) would outlast their
/// short waits.
const ROLLOUT_BOUND: [&str; 12] = [
    "--memory-profile",
    "qwen3-4b",
    "--set",
    "memory.scale=0.002",
    "--set",
    "compute.model=true",
    "--set",
    "compute.rollout_mfu=0.01",
    "--set",
    "compute.h2d_gbps=0",
    "--set",
    "compute.d2h_gbps=0",
];

/// The rollout-bound job in elastic mode: the waiting trainer lends its device.
fn waiting_trainer() -> Vec<&'static str> {
    [&["--mode", "elastic", "--devices", "2"][..], &ROLLOUT_BOUND].concat()
}

fn lending_log(dir: &std::path::Path) -> Vec<Value> {
    let text = std::fs::read_to_string(dir.join("lending.jsonl")).expect("lending.jsonl");
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Active tagged bytes of `worker` in a memory.jsonl sample (communicators left out; 0 before it
/// started).
fn held(sample: &Value, worker: &str) -> u64 {
    let Some(tags) = sample["workers"][worker].as_object() else { return 0 };
    tags.iter().filter(|(t, _)| *t != "nccl").map(|(_, b)| b.as_u64().unwrap()).sum()
}

#[test]
fn an_elastic_run_that_never_lends_says_so_instead_of_printing_nan() {
    let dir = tempfile::tempdir().unwrap();
    let (out, summary) = run_ok(
        dir.path(),
        &["--mode", "elastic", "--devices", "2", "--steps", "2", "--set", "elastic.lend_after_s=1000000"],
    );
    assert_eq!(summary["async"]["elastic"]["lends"], 0, "{summary}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("lending: none (a lend needs the trainer to have waited 1000000.000 s"), "{stdout}");
    assert!(!stdout.contains("NaN"), "{stdout}");
    // Two steps: the first against the last, not an average shared by both ends.
    assert!(stdout.contains("(mean of the first and last 1 step)"), "{stdout}");
}

#[test]
fn elastic_lends_the_waiting_trainers_device_and_gets_it_back_with_the_trainers_exact_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = waiting_trainer();
    args.extend(["--steps", "4"]);
    let (_, summary) = run_ok(dir.path(), &args);
    let a = &summary["async"];
    assert_eq!(a["mode"], "elastic", "{a}");
    let e = &a["elastic"];
    // Setup measured a switch, and the default threshold is what it measured since.
    assert!(e["calibration_switch_s"].as_f64().unwrap() > 0.0, "{e}");
    assert_eq!(e["lend_after_s_source"], "measured switch", "{e}");
    assert_eq!(e["lend_after_s"], e["switch_s"], "{e}");
    assert!(e["lends"].as_u64().unwrap() >= 1, "the waiting trainer never lent its device: {e}");
    assert!(e["lent_tokens"].as_u64().unwrap() > 0, "the lent engine generated nothing: {e}");
    assert_eq!(e["forced_reclaims"], 0, "{e}");
    // Lending turned some of the trainer's wait into generation.
    let (idle, device_idle) =
        (e["trainer_idle_ratio_unlent"].as_f64().unwrap(), e["trainer_device_idle_ratio"].as_f64().unwrap());
    assert!(device_idle < idle, "{e}");
    // The updates' flushes count as the devices' idle time; the share without them stays shown.
    let without = e["trainer_device_idle_ratio_without_flush"].as_f64().unwrap();
    assert!((device_idle - without - a["flush_ratio"].as_f64().unwrap()).abs() < 1e-9, "{a}");
    // A lent device with no request counts as idle: within the time it was lent.
    let lent_idle = e["lent_engine_idle_s"].as_f64().unwrap();
    assert!((0.0..=e["lent_s"].as_f64().unwrap()).contains(&lent_idle), "{e}");
    // Every decision is logged with its reason; lends and reclaims alternate.
    let log = lending_log(dir.path());
    let actions: Vec<&str> = log.iter().map(|d| d["action"].as_str().unwrap()).filter(|a| *a != "skip").collect();
    assert!(actions.len() >= 4 && actions.chunks(2).all(|p| p == ["lend", "reclaim"]), "{actions:?}");
    assert!(log.iter().all(|d| d["reason"].as_str().is_some_and(|r| !r.is_empty())), "{log:?}");
    // At every lend only the engine holds the device's memory, at every reclaim only the trainer,
    // and no phase ever had both (the run's own check, counted among its passed checks).
    let memory = std::fs::read_to_string(dir.path().join("memory.jsonl")).unwrap();
    let samples: Vec<Value> = memory.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let (mut lends, mut reclaims) = (0, 0);
    for s in &samples {
        let (t, l) = (held(s, "trainer-0"), held(s, "lent-rollout-0"));
        assert!(t == 0 || l == 0, "both sides hold device 0 after {}: {s}", s["phase"]);
        match s["phase"].as_str().unwrap() {
            "lend" => {
                lends += 1;
                assert!(t == 0 && l > 0, "{s}");
            }
            "reclaim" => {
                reclaims += 1;
                assert!(t > 0 && l == 0, "{s}");
            }
            _ => {}
        }
    }
    assert!(lends >= 2 && lends == reclaims, "{lends} lends, {reclaims} reclaims");
    let m = metrics(dir.path());
    assert!(m.iter().any(|r| r["elastic/lent_time"].as_f64().unwrap() > 0.0), "no step lent");
    assert!(m.iter().all(|r| {
        ["elastic/switch_time", "elastic/trainer_device_idle_ratio", "elastic/lent_idle_time"]
            .iter()
            .all(|k| r[*k].is_number())
    }));
    assert_eq!(summary["status"], "ok");
}

/// The batch a reclaim waits to hand the trainer counts among the groups under way: else, while the
/// lent engine finishes its segment, the other engine starts a batch past async's queue capacity,
/// whose groups go stale in the queue (a quarter of the samples dropped at max_staleness 1, whole
/// responses, before this was counted).
#[test]
fn a_lend_keeps_the_engines_within_the_queue_capacity_and_drops_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = waiting_trainer();
    let tight = ["--max-staleness", "1", "--set", "async.segment_tokens=0", "--set", "elastic.lend_after_s=0.05"];
    args.extend(["--steps", "4", "--set", "compute.rollout_mfu=0.05"]);
    args.extend(tight);
    let (_, summary) = run_ok(dir.path(), &args);
    let a = &summary["async"];
    assert!(a["elastic"]["lends"].as_u64().unwrap() >= 1, "{a}");
    assert_eq!(a["dropped_stale_samples"], 0, "{a}");
    assert_eq!(a["samples_trained"].as_u64(), Some(4 * 256), "{a}");
}

#[test]
fn a_lent_engine_that_keeps_the_device_is_paused_from_outside_named_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = waiting_trainer();
    args.extend(["--steps", "3", "--set", "elastic.reclaim_timeout_s=1"]);
    // The lent engine's first generate (the lend before step 1) never answers.
    let out = run_cmd(dir.path(), &args).env("RELAX_WORKER_FAULT", "generate:0:hang:lent-rollout-0").output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lent-rollout-0 did not finish its segment within 1 s"), "{err}");
    let summary = json(&dir.path().join("summary.json"));
    let e = &summary["async"]["elastic"];
    assert_eq!(e["forced_reclaims"], 1, "{e}");
    assert_eq!(e["retired_engines"], serde_json::json!(["lent-rollout-0"]), "{e}");
    let log = lending_log(dir.path());
    assert!(log.iter().any(|d| d["action"] == "forced_reclaim" && d["engine"] == "lent-rollout-0"), "{log:?}");
    // Paused from outside: the hung engine holds none of the device, the trainer has it back
    // (the reclaim's checksum passed), and every step ran.
    let memory = std::fs::read_to_string(dir.path().join("memory.jsonl")).unwrap();
    let last: Value = serde_json::from_str(memory.lines().last().unwrap()).unwrap();
    assert_eq!(held(&last, "lent-rollout-0"), 0, "{last}");
    assert_eq!(metrics(dir.path()).len(), 3);
    assert!(survivors(dir.path()).is_empty(), "workers left behind");
}

/// With two trainer steps per update the trainer is a step ahead of the engines every other
/// wait: it lends then too, the lent engine gets the trainer's weights (checked against the
/// trainer's checksum by the run), and its tokens count as the published version, so no sample
/// passes the staleness bound and none is dropped.
#[test]
fn a_trainer_ahead_of_the_engines_weights_lends_its_device_too() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = waiting_trainer();
    args.extend(["--steps", "4", "--train-iters-per-update", "2", "--set", "elastic.lend_after_s=0.05"]);
    let (_, summary) = run_ok(dir.path(), &args);
    let a = &summary["async"];
    let lends: Vec<Value> = lending_log(dir.path()).into_iter().filter(|d| d["action"] == "lend").collect();
    let ahead = lends.iter().filter(|d| d["trainer_steps_unpublished"] == 1).count();
    assert!(ahead >= 1, "no lend while the trainer was a step ahead: {lends:?}");
    assert!(a["elastic"]["lent_tokens"].as_u64().unwrap() > 0, "{a}");
    assert_eq!(a["dropped_stale_samples"], 0, "{a}");
    assert!(staleness_keys(&summary).iter().all(|&s| s <= a["max_staleness"].as_u64().unwrap()), "{a}");
    assert_eq!(summary["status"], "ok");
}

/// A trainer-bound job (trainer_bound_model): the same model, its passes at 8% of the peak and
/// decoding at the default 30%, with one version of staleness: the engines fill the queue to its capacity early in each
/// step and then have nothing they may start while the trainer trains.
const TRAINER_BOUND: [&str; 8] = ["--mode", "elastic", "--devices", "2", "--steps", "3", "--max-staleness", "1"];

fn trainer_bound(lend_rollout: bool) -> Vec<&'static str> {
    [&TRAINER_BOUND[..], &trainer_bound_model(lend_rollout)].concat()
}

/// Each row's modelled train seconds per trained token, and the replicas that shared it.
fn train_shares(dir: &std::path::Path) -> Vec<(f64, f64)> {
    let rows = metrics(dir);
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {r}"));
    // The pacing is real: the stage lasts at least what it was paced at.
    assert!(rows.iter().all(|r| f(r, "perf/actor_train_time") >= f(r, "train/modelled_s")), "{rows:?}");
    rows.iter().map(|r| (f(r, "train/modelled_s") / f(r, "train/tokens"), f(r, "train/replicas"))).collect()
}

#[test]
fn lend_rollout_lends_the_idle_engines_device_to_a_trainer_bound_step_and_gives_it_back() {
    let (off, on) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let args = trainer_bound(true);
    let (_, summary) = run_ok(on.path(), &args);
    assert_eq!(summary["status"], "ok");
    let r = &summary["async"]["elastic"]["rollout_lend"];
    assert!(r["calibration_switch_s"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["lends"].as_u64().unwrap() >= 1, "the idle engines never lent their device: {r}");
    assert!(r["state_bytes_mean"].as_u64().unwrap() > 0, "{r}");
    // Their lent time counts as work on the engines' devices.
    let (unlent, device) =
        (r["rollout_idle_ratio_unlent"].as_f64().unwrap(), r["rollout_device_idle_ratio"].as_f64().unwrap());
    assert!(device < unlent, "{r}");
    // Every decision is logged with its reason; a lend says what it expected to save, more than
    // the switch; lends and reclaims alternate.
    let log = lending_log(on.path());
    assert!(log.iter().all(|d| d["reason"].as_str().is_some_and(|r| !r.is_empty())), "{log:?}");
    let reverse: Vec<&Value> =
        log.iter().filter(|d| d["action"].as_str().is_some_and(|a| a.ends_with("_rollout"))).collect();
    assert!(reverse.iter().any(|d| d["action"] == "skip_rollout"), "step 1 has no train stage to go by: {log:?}");
    let switches: Vec<&str> =
        reverse.iter().map(|d| d["action"].as_str().unwrap()).filter(|a| *a != "skip_rollout").collect();
    assert!(switches.chunks(2).all(|p| p == ["lend_rollout", "reclaim_rollout"]), "{switches:?}");
    for d in reverse.iter().filter(|d| d["action"] == "lend_rollout" && d["step"].as_u64() > Some(0)) {
        assert!(d["expected_gain_s"].as_f64().unwrap() > d["switch_s"].as_f64().unwrap(), "{d}");
    }
    // The device's two sides never both hold it; at a lend only the lent trainer does, at a
    // reclaim only the engine, with every byte it held when it started.
    let memory = std::fs::read_to_string(on.path().join("memory.jsonl")).unwrap();
    let samples: Vec<Value> = memory.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let started = samples.iter().find(|s| s["phase"] == "init_rollout").map(|s| held(s, "rollout-1")).unwrap();
    let (mut lends, mut reclaims) = (0, 0);
    for s in &samples {
        let (t, e) = (held(s, "lent-trainer-1"), held(s, "rollout-1"));
        assert!(t == 0 || e == 0, "both sides hold device 1 after {}: {s}", s["phase"]);
        match s["phase"].as_str().unwrap() {
            "lend_rollout" => {
                lends += 1;
                assert!(t > 0 && e == 0, "{s}");
            }
            "reclaim_rollout" => {
                reclaims += 1;
                assert!(t == 0 && e == started, "{s}");
            }
            _ => {}
        }
    }
    assert!(lends >= 2 && lends == reclaims, "{lends} lends, {reclaims} reclaims");
    // The lent step's train stage is paced at half the batch per replica; without the key every
    // step is paced at the whole batch.
    let args = trainer_bound(false);
    run_ok(off.path(), &args);
    let alone: Vec<(f64, f64)> = train_shares(off.path());
    assert!(alone.iter().all(|(_, n)| *n == 1.0), "{alone:?}");
    let per_token = alone.iter().map(|(s, _)| s).sum::<f64>() / alone.len() as f64;
    let lent: Vec<f64> = train_shares(on.path()).into_iter().filter(|(_, n)| *n == 2.0).map(|(s, _)| s).collect();
    assert!(!lent.is_empty(), "no step trained with the lent trainer");
    for s in lent {
        let ratio = s / per_token;
        assert!(
            (0.4..0.6).contains(&ratio),
            "a lent step's modelled train seconds per token are {ratio:.3} of alone's"
        );
    }
    let m = metrics(on.path());
    assert!(m.iter().any(|r| r["elastic/rollout_lent_time"].as_f64().unwrap() > 0.0), "{m:?}");
    assert!(m.iter().all(|r| r["elastic/rollout_device_idle_ratio"].is_number()));
}

#[test]
fn lend_rollout_outside_elastic_mode_or_with_a_trainer_that_cannot_transfer_state_exits_2_naming_the_key() {
    const REMOTE_RAY: &str = "run.ray_address=10.0.0.1:6379";
    let dir = tempfile::tempdir().unwrap();
    let key = "elastic.lend_rollout=true";
    for (args, said) in [
        (
            vec!["--set", key],
            "elastic.lend_rollout = true lends the rollout engines' devices to the trainer, which only elastic mode does",
        ),
        (vec!["--mode", "async", "--devices", "2", "--set", key], "run.mode = \"async\": use --mode elastic"),
        (
            vec!["--mode", "elastic", "--devices", "2", "--set", key, "--launcher", "ray", "--set", REMOTE_RAY],
            "elastic.lend_rollout = true needs the run directory on every worker's host",
        ),
        (
            vec!["--mode", "elastic", "--devices", "2", "--set", "elastic.lend_rollout=sometimes"],
            "elastic.lend_rollout",
        ),
    ] {
        let out = run_cmd(dir.path(), &args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(said), "{args:?}: {err}");
    }
    assert!(!dir.path().join("metrics.jsonl").exists(), "a configuration error started a run");
    // A trainer that does not answer export_state (the example worker predates it) fails the
    // first lend, at setup, with exit 2 naming the key and the worker, before any step.
    let example = dir.path().join("example");
    let mut args = vec!["--mode", "elastic", "--devices", "2", "--steps", "1", "--set", key];
    args.extend(["--prompts", "4", "--samples", "4", "--set", "task.digits=3"]);
    args.extend(["--trainer-cmd", "python3 scripts/example_worker.py"]);
    let out = run_cmd(&example, &args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let said = "elastic.lend_rollout = true needs every trainer to answer export_state and import_state";
    assert!(err.contains(said) && err.contains("trainer-0"), "{err}");
    assert_eq!(json(&example.join("summary.json"))["steps_completed"], 0);
}

/// Qwen3-4B's engines with 0.1 GiB of KV cache hold about 730 modelled tokens, some 10 of the
/// 32 sequences each of two colocated engines is asked for (each about 7 task tokens of 10
/// modelled).
const SMALL_KV: [&str; 14] = [
    "--steps",
    "2",
    "--devices",
    "2",
    "--memory-profile",
    "qwen3-4b",
    "--set",
    "memory.scale=0.002",
    "--set",
    "compute.model=true",
    "--set",
    "rollout.prompts_per_step=8",
    "--set",
    "memory.kv_cache_gib=0.1",
];

#[test]
fn engines_whose_kv_cache_holds_less_than_the_batch_queue_and_preempt_and_ample_ones_never_do() {
    for mode in ["colocate", "async"] {
        let dir = tempfile::tempdir().unwrap();
        let (_, s) = run_ok(dir.path(), &[&["--mode", mode][..], &SMALL_KV].concat());
        let d = &s["decode"]["rollout"];
        let f = |k: &str| d[k].as_f64().unwrap_or_else(|| panic!("{mode}: no {k}: {d}"));
        assert!(f("preemptions") > 0.0 && f("recomputed_tokens") > 0.0 && f("kv_queued_s") > 0.0, "{mode}: {d}");
        assert!(f("kv_peak_share") <= 1.0 && f("slot_occupancy") > 0.0 && f("slot_occupancy") < 1.0, "{mode}: {d}");
        // Every sample still generated and trained, the checks passing.
        assert_eq!(s["steps_completed"], 2, "{mode}");
        assert!(s["checks"]["passed"].as_u64().unwrap() > 0, "{mode}");
        let rows = metrics(dir.path());
        assert!(rows.iter().all(|r| r["rollout/response_len/mean"].as_f64().unwrap() > 0.0), "{mode}");
        if mode == "async" {
            assert_eq!(s["async"]["samples_trained"], 2 * 64, "{}", s["async"]);
        }
    }
    // The preset's own 40 GiB holds every sequence; the switch turns the bound off.
    for kv in ["memory.kv_cache_gib=0", "compute.kv_capacity=false"] {
        let dir = tempfile::tempdir().unwrap();
        let (_, s) = run_ok(dir.path(), &[&SMALL_KV[..], &["--set", kv]].concat());
        let d = &s["decode"]["rollout"];
        assert_eq!((d["preemptions"].as_u64(), d["recomputed_tokens"].as_f64()), (Some(0), Some(0.0)), "{kv}: {d}");
        assert_eq!(d["kv_queued_s"].as_f64(), Some(0.0), "{kv}: {d}");
        if kv.starts_with("compute") {
            assert!(d["kv_peak_share"].is_null(), "no capacity modelled: {d}");
        } else {
            assert!(d["kv_peak_share"].as_f64().unwrap() < 0.1, "{d}");
        }
    }
}

/// compute.lengths (`--lengths FILE`): every sample decodes and trains at the length drawn for it
/// (here every length of a step alike: 2000 tokens at step 1, 3000 at step 2, whatever the task's
/// few, from a file whose lines name their step), colocated and async alike, so both layouts
/// charge the same modelled response tokens; a job that cannot charge them is refused.
#[test]
fn drawn_response_lengths_charge_every_sample_its_length_in_every_layout() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lengths.jsonl");
    std::fs::write(
        &file,
        "{\"step\": 1, \"length\": 2000}\n{\"step\": 2, \"length\": 3000}\n{\"step\": 3, \"length\": 9}\n",
    )
    .unwrap();
    let file = file.to_str().unwrap();
    // No fixed step latency and no KV bound: a request's decode is its longest length, exactly.
    let modelled =
        ["--set", "compute.model=true", "--set", "compute.decode_step_ms=0", "--set", "compute.kv_capacity=false"];
    let job = [&["--devices", "2", "--steps", "2", "--lengths", file][..], &modelled].concat();
    let run = |mode: &str| {
        let out = dir.path().join(mode);
        let (_, s) = run_ok(&out, &[&job[..], &["--mode", mode]].concat());
        let recorded = std::fs::read_to_string(out.join("config.toml")).unwrap();
        assert!(recorded.contains(&format!("lengths = {file:?}")), "{recorded}");
        let rows = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let per_step: Vec<f64> = rows
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["compute/drawn_response_tokens"].as_f64().unwrap())
            .collect();
        (s, per_step)
    };
    let ((colocate, colocate_steps), (asynchronous, async_steps)) = (run("colocate"), run("async"));
    // Each step trained its 256 samples at its own step's length.
    assert_eq!(colocate_steps, [256.0 * 2000.0, 256.0 * 3000.0]);
    assert_eq!(async_steps, colocate_steps, "async's batches are step 1's and step 2's prompts too");
    for s in [&colocate, &asynchronous] {
        let l = &s["lengths"];
        // The figures are of the lines the run's two steps drew from, not step 3's.
        assert_eq!((l["values"].as_u64(), l["mean"].as_f64(), l["p90"].as_u64()), (Some(2), Some(2500.0), Some(3000)));
        assert_eq!(
            l["steps"],
            serde_json::json!({"file_first": 1, "file_last": 3, "first_drawn": 1, "last_drawn": 2, "steps_past_last": 0})
        );
        let samples = l["trained_samples"].as_f64().unwrap();
        assert_eq!(samples, 2.0 * 32.0 * 8.0, "{l}");
        assert_eq!(l["trained_response_tokens"].as_f64(), Some(2500.0 * samples), "{l}");
        let compute = s["compute"].as_str().unwrap();
        assert!(
            compute.contains(&format!(
                "response lengths drawn from {file}, steps 1 to 2 of its 1 to 3 (2 values, mean 2500"
            )),
            "{compute}"
        );
        // Every sequence decoded its modelled steps, whatever its task tokens.
        assert!(s["decode"]["rollout"]["decode_steps"].as_f64().unwrap() >= 2000.0, "{s}");
    }
    // Colocated, each of the 2 engines' requests decodes its batch for its step's length.
    assert_eq!(colocate["decode"]["rollout"]["decode_steps"].as_f64(), Some(2.0 * 2000.0 + 2.0 * 3000.0), "{colocate}");
    assert_eq!(colocate["lengths"]["trained_response_tokens"], asynchronous["lengths"]["trained_response_tokens"]);

    // Only the built-in workers under compute.model charge drawn lengths.
    let refused = |extra: &[&str], says: &str| {
        let out = run_cmd(&dir.path().join("refused"), &[&["--lengths", file][..], extra].concat()).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains(says), "{}", text(&out));
    };
    refused(&["--set", "compute.model=false"], "needs compute.model = true (--set compute.model=true)");
    refused(
        &[&modelled[..], &["--rollout-cmd", "python3 w.py"]].concat(),
        "compute.lengths needs the built-in workers",
    );
    refused(
        &["--set", "compute.model=true", "--set", "compute.lengths=/nonexistent/l.txt"],
        "cannot read /nonexistent/l.txt",
    );
}
