//! `relax-colocate plan` against `relax-colocate compare` on the same job, with a user's own
//! response lengths: the prediction is made without running anything, the comparison runs every
//! layout on the simulator with modelled device time; they must agree within 15% on every
//! layout's throughput. And the plan's JSON is the shape scripts read, and a job the run would
//! refuse is refused with the run's words.

use serde_json::Value;

/// A rollout-heavy job, small enough for CI: Qwen3-4B's shapes, responses with a long tail (the
/// built-in policy held still, rambling up to 48 tokens, 20 modelled tokens each).
const JOB: [&str; 14] = [
    "--devices",
    "2",
    "--steps",
    "3",
    "--set",
    "memory.profile=qwen3-4b",
    "--set",
    "memory.scale=0.002",
    "--set",
    "compute.token_scale=20",
    "--set",
    "task.max_new_tokens=48",
    "--set",
    "algo.lr=1e-9",
];

fn relax(args: &[&str]) -> std::process::Output {
    std::process::Command::new(tms_e2e::workspace().bin("relax-colocate"))
        .current_dir(&tms_e2e::workspace().root)
        .args(args)
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap()
}

fn text(out: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A user's response lengths: a long tail (median about 300 tokens, one in ten past 900,
/// capped at 4,096), 400 values written as a file of one length per line.
fn lengths_file(dir: &std::path::Path) -> std::path::PathBuf {
    let mut text = String::from("# response lengths (tokens)\n");
    let mut x: u64 = 7;
    for _ in 0..400 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let u = ((x >> 11) as f64 / (1u64 << 53) as f64).max(1e-9);
        // A Pareto tail from one uniform draw.
        let len = (160.0 * u.powf(-0.8)).clamp(1.0, 4096.0);
        text += &format!("{}\n", len as u64);
    }
    let path = dir.join("lengths.txt");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn plan_predicts_what_compare_measures_on_a_users_own_lengths() {
    let dir = tempfile::tempdir().unwrap();
    let lengths = lengths_file(dir.path());
    let own = ["--set", "rollout.prompts_per_step=4", "--lengths", lengths.to_str().unwrap()];
    let plan = relax(&[&["plan", "--json"][..], &JOB, &own].concat());
    assert!(plan.status.success(), "{}", text(&plan));
    let plan: Value = serde_json::from_slice(&plan.stdout).unwrap();
    assert_eq!(plan["job"]["responses"]["source"], lengths.to_str().unwrap(), "{plan}");
    let out = dir.path().join("compare");
    let compare =
        relax(&[&["compare", "--json", "--repeats", "1", "--out", out.to_str().unwrap()][..], &JOB, &own].concat());
    assert!(compare.status.success(), "{}", text(&compare));
    let measured: Value = serde_json::from_slice(&compare.stdout).unwrap();
    // Every layout charged its samples lengths drawn from the file (1 to 4,096 tokens).
    for layout in ["colocate", "async", "elastic"] {
        let drawn = measured[layout]["drawn_tokens_per_sample"].as_f64().unwrap_or_else(|| panic!("{measured}"));
        assert!((1.0..=4096.0).contains(&drawn), "{layout}: {drawn}");
    }
    let close = |layout: &str, key: &str, within: f64| {
        let (p, m) = (plan["layouts"][layout][key].as_f64().unwrap(), measured[layout][key].as_f64().unwrap());
        assert!((p / m - 1.0).abs() <= within, "{layout} {key}: plan {p:.3}, compare {m:.3}\n{plan}\n{measured}");
    };
    // Elastic's lends and reclaims cost about 0.7 s each on the simulator beyond the model (the
    // real pause and resume of the scaled bytes, the weights' IPC hand-over, the checks), which
    // three short steps cannot hide: its bound is the looser (on jobs/long-tail.toml's 8 steps it
    // came within 5%, docs/async.md).
    for (layout, within) in [("colocate", 0.15), ("async", 0.15), ("elastic", 0.30)] {
        close(layout, "samples_per_s", within);
        let predicted = &plan["layouts"][layout];
        assert!(predicted["phases"]["actor_train"].as_f64().unwrap() > 0.0, "{plan}");
        assert_eq!(predicted["steps"], 3, "{plan}");
    }
    // After step 1 only two steps are left: held on the layouts that do not lend.
    close("colocate", "samples_per_s_after_first_step", 0.15);
    close("async", "samples_per_s_after_first_step", 0.15);
    let colocate = &plan["layouts"]["colocate"]["phases"];
    assert!(colocate["generate"].as_f64().unwrap() > 0.0 && colocate["wake_up"].as_f64().unwrap() > 0.0, "{plan}");
    assert!(plan["verdict"]["layout"].is_string() && plan["job"]["profile"] == "qwen3-4b", "{plan}");
}

#[test]
fn plan_prints_a_table_and_refuses_what_the_run_would_refuse() {
    let table = relax(&[&["plan"][..], &JOB].concat());
    assert!(table.status.success(), "{}", text(&table));
    let stdout = String::from_utf8_lossy(&table.stdout);
    for word in ["layout", "colocate", "async", "elastic", "samples/s", "_over_"] {
        assert!(stdout.contains(word), "{word}:\n{stdout}");
    }
    // A key that does not exist, and a device without a figure the job needs: exit 2, named.
    let typo = relax(&["plan", "--set", "algo.lrr=1"]);
    assert_eq!(typo.status.code(), Some(2), "{}", text(&typo));
    assert!(text(&typo).contains("algo.lrr"), "{}", text(&typo));
    let ascend = relax(&[
        "plan",
        "--layouts",
        "colocate",
        "--set",
        "memory.profile=qwen3-4b",
        "--set",
        "compute.device=\"910b\"",
    ]);
    assert_eq!(ascend.status.code(), Some(2), "{}", text(&ascend));
    assert!(text(&ascend).contains("compute.hbm_gbps is unset"), "{}", text(&ascend));
}

/// Lengths that grow over the run (a file whose lines name their step, as a learning policy's
/// lengths do): each planned step charges its own step's lengths, from compute.lengths_first_step
/// on, and a plan that runs past the file's last step says so.
#[test]
fn plan_follows_lengths_that_change_step_by_step() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lengths.jsonl");
    // Steps 1 to 4, each 16 lengths around 150 x the step (the longest 1.5 x that).
    let lines: String = (1..=4u64)
        .flat_map(|step| (0..16u64).map(move |i| (step, 150 * step * (10 + i % 6) / 10)))
        .map(|(step, len)| format!("{{\"step\": {step}, \"length\": {len}}}\n"))
        .collect();
    std::fs::write(&file, lines).unwrap();
    let plan = |extra: &[&str]| -> Value {
        let base = ["plan", "--json", "--layouts", "colocate", "--set", "rollout.prompts_per_step=4", "--lengths"];
        let out = relax(&[&base[..], &[file.to_str().unwrap()], &JOB, extra].concat());
        assert!(out.status.success(), "{}", text(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let from_first = plan(&[]);
    let times = |p: &Value| -> Vec<f64> {
        p["layouts"]["colocate"]["step_times_s"].as_array().unwrap().iter().map(|t| t.as_f64().unwrap()).collect()
    };
    let t = times(&from_first);
    assert_eq!(t.len(), 3, "{from_first}");
    // Generation is bound by the longest response: a step's longer lengths take longer.
    assert!(t[0] < t[1] && t[1] < t[2], "{t:?}");
    let responses = &from_first["job"]["responses"];
    assert_eq!(responses["steps"]["first_drawn"], 1, "{responses}");
    assert_eq!(responses["steps"]["last_drawn"], 3, "{responses}");
    assert_eq!(responses["max_tokens"], 675, "steps 1 to 3: the longest is step 3's, 150 x 3 x 1.5");
    assert_eq!(from_first["job"]["notes"], serde_json::json!([]), "{from_first}");
    // From step 3: the plan's step 1 is the file's step 3 and its step 3 runs past the file's 4.
    let later = plan(&["--set", "compute.lengths_first_step=3"]);
    let l = times(&later);
    assert!(l[0] > t[1], "the file's step 3 from the first: {l:?} against {t:?}");
    assert_eq!(later["job"]["responses"]["steps"]["steps_past_last"], 1, "{later}");
    let notes = later["job"]["notes"].to_string();
    assert!(notes.contains("the job's last step stands for a step past the lengths file's last (4)"), "{notes}");
}

/// The CI job with responses ten times longer (steps of minutes on the modelled device), run on a
/// clock 20 times the wall clock's (compute.time_scale): compare still agrees with plan within
/// 15%, and takes a small share of the modelled time to do it.
#[test]
fn a_faster_clock_runs_minutes_of_modelled_steps_in_seconds_and_still_agrees_with_plan() {
    let mut job: Vec<&str> =
        JOB.iter().map(|a| if *a == "compute.token_scale=20" { "compute.token_scale=200" } else { a }).collect();
    assert!(job.contains(&"compute.token_scale=200"));
    job.extend(["--layouts", "colocate,async"]);
    let plan = relax(&[&["plan", "--json"][..], &job].concat());
    assert!(plan.status.success(), "{}", text(&plan));
    let plan: Value = serde_json::from_slice(&plan.stdout).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("compare");
    let clock = ["--set", "compute.time_scale=20", "--repeats", "1", "--out", out.to_str().unwrap()];
    let started = std::time::Instant::now();
    let compare = relax(&[&["compare", "--json"][..], &job, &clock].concat());
    let real = started.elapsed().as_secs_f64();
    assert!(compare.status.success(), "{}", text(&compare));
    let measured: Value = serde_json::from_slice(&compare.stdout).unwrap();
    let mut modelled = 0.0;
    for layout in ["colocate", "async"] {
        let (p, m) = (
            plan["layouts"][layout]["samples_per_s"].as_f64().unwrap(),
            measured[layout]["samples_per_s"].as_f64().unwrap(),
        );
        assert!((p / m - 1.0).abs() <= 0.15, "{layout}: plan {p:.3}, compare {m:.3}\n{plan}\n{measured}");
        assert!(measured[layout]["compute"].as_str().unwrap().contains("compute.time_scale"), "{measured}");
        let summary: Value =
            serde_json::from_slice(&std::fs::read(out.join(layout).join("summary.json")).unwrap()).unwrap();
        let (wall, clock) = (summary["wall_time_s"].as_f64().unwrap(), &summary["clock"]);
        assert_eq!(clock["time_scale"], 20.0, "{summary}");
        let ratio = wall / clock["real_wall_time_s"].as_f64().unwrap();
        assert!((ratio - 20.0).abs() < 0.5, "{layout}: every time on the modelled clock: {ratio}\n{summary}");
        modelled += measured[layout]["step_time_median_s"].as_f64().unwrap() * 3.0;
    }
    // Over two minutes a step modelled; the whole comparison, start-up included, in a fifth of it.
    assert!(modelled > 400.0, "{measured}");
    assert!(real < modelled / 5.0, "compare took {real:.0} s for {modelled:.0} modelled seconds of steps");
}

/// tests/tests/run_async.rs's trainer-bound job: Qwen3-4B's shapes, the trainer's passes at 8%
/// of the peak, one version of staleness, so the engines fill the queue early in each step and
/// then wait; with elastic.lend_rollout their devices go to the train stage. The host link is not
/// charged (the 4B trainer's full-scale state over it, about 3.4 s of modelled switch, would
/// outweigh the 2.6 s a lend saves of these steps); the policy is held still.
const TRAINER_BOUND: [&str; 22] = [
    "--layouts",
    "async,elastic",
    "--devices",
    "2",
    "--steps",
    "3",
    "--max-staleness",
    "1",
    "--set",
    "memory.profile=qwen3-4b",
    "--set",
    "memory.scale=0.002",
    "--set",
    "compute.train_mfu=0.08",
    "--set",
    "compute.h2d_gbps=0",
    "--set",
    "compute.d2h_gbps=0",
    "--set",
    "algo.lr=1e-9",
    "--set",
    "elastic.lend_rollout=true",
];

/// The same flags to both commands, elastic.lend_rollout among them (compare and plan give it to
/// the elastic layout alone): plan lends the engines' device on the step compare's run does and
/// predicts both layouts' throughput. About a minute on this 2-core VM, most of it compare's.
#[test]
fn plan_predicts_the_reverse_lend_of_a_trainer_bound_job() {
    let plan = relax(&[&["plan", "--json"][..], &TRAINER_BOUND].concat());
    assert!(plan.status.success(), "{}", text(&plan));
    let plan: Value = serde_json::from_slice(&plan.stdout).unwrap();
    assert!(plan["job"]["notes"].as_array().unwrap().is_empty(), "lend_rollout is modelled: {plan}");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("compare");
    let compare =
        relax(&[&["compare", "--json", "--repeats", "1", "--out", out.to_str().unwrap()][..], &TRAINER_BOUND].concat());
    assert!(compare.status.success(), "{}", text(&compare));
    let measured: Value = serde_json::from_slice(&compare.stdout).unwrap();
    // Step 2 lends in both: step 1 has no train stage to go by, step 3 no next batch queued.
    let planned = plan["layouts"]["elastic"]["rollout_lends"].as_f64().unwrap();
    let ran = measured["elastic"]["elastic"]["rollout_lends_per_step"].as_f64().unwrap() * 3.0;
    assert!(planned == 1.0 && (ran - 1.0).abs() < 1e-9, "plan {planned} lends, compare {ran}\n{plan}\n{measured}");
    assert!(plan["layouts"]["async"]["rollout_lends"].is_null(), "{plan}");
    // The lend and its reclaim cost the simulator about 0.6 s the model does not charge (the
    // state file's export and import, the checksums, the real pause and resume of the scaled
    // memory; 0.44 + 0.18 s measured against none modelled with the link free), on top of the
    // round trips every layout pays: plan read elastic 7% and async 1% faster than one compare
    // run, and the bound leaves room for a machine busy with the other tests beside.
    for (layout, within) in [("async", 0.15), ("elastic", 0.20)] {
        let (p, m) = (
            plan["layouts"][layout]["samples_per_s"].as_f64().unwrap(),
            measured[layout]["samples_per_s"].as_f64().unwrap(),
        );
        assert!((p / m - 1.0).abs() <= within, "{layout}: plan {p:.3}, compare {m:.3}\n{plan}\n{measured}");
    }
    let rate = |v: &Value, layout: &str| v[layout]["samples_per_s"].as_f64().unwrap();
    assert!(rate(&plan["layouts"], "elastic") > rate(&plan["layouts"], "async"), "{plan}");
}

/// A faster clock only for modelled time, and only for workers that pace by it: refused before
/// anything starts, naming the key and the fix.
#[test]
fn a_faster_clock_is_refused_where_it_would_only_multiply_measured_time() {
    for (sets, words) in [
        (&["--set", "compute.time_scale=10"][..], "needs compute.model = true"),
        (
            &["--set", "compute.model=true", "--set", "memory.profile=qwen3-4b", "--set", "compute.time_scale=0.5"][..],
            "must be 1..1000",
        ),
        (
            &[
                "--set",
                "compute.model=true",
                "--set",
                "memory.profile=qwen3-4b",
                "--set",
                "compute.time_scale=10",
                "--set",
                "run.trainer_cmd=\"python3 w.py\"",
            ][..],
            "needs the built-in workers",
        ),
    ] {
        let out = relax(&[&["run"][..], sets].concat());
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains("compute.time_scale") && text(&out).contains(words), "{}", text(&out));
    }
}

/// The command a job file's header gives (`#     relax-colocate plan ...`), its words after the
/// program's name.
fn header_command(job: &str) -> Vec<String> {
    let path = tms_e2e::workspace().root.join(job);
    let text = std::fs::read_to_string(&path).unwrap();
    let line = text
        .lines()
        .map_while(|l| l.strip_prefix('#'))
        .find_map(|l| l.trim().strip_prefix("relax-colocate plan "))
        .unwrap_or_else(|| panic!("{job}: no `relax-colocate plan` command in its header"));
    std::iter::once("plan".to_string()).chain(line.split_whitespace().map(String::from)).collect()
}

/// The published runs' job files (docs/perf.md, "2026-11-28: three published runs against the
/// plan"), each planned with its header's command: what lands within 25% of the published figure
/// is held there. vime's 910B colocated step (457.4 s) and verl's colocated 7B step (790.1 s), and
/// Relax's async speed-ups over colocate in samples/s after step 1: off-policy (1.76x, 225.9 /
/// 128.6 s) and on-policy (1.12x, 225.9 / 201.0 s). Not
/// asserted, because the plan misses them (docs/perf.md says why): Relax's step times themselves
/// and verl's async step.
#[test]
fn published_runs_job_files_plan_within_25_percent_of_their_published_step_times() {
    // The header's command with some of its flags given other values.
    let plan_with = |job: &str, changed: &[(&str, &str)]| -> Value {
        let mut args = header_command(job);
        for (flag, value) in changed {
            let at = args.iter().position(|a| a == flag).unwrap_or_else(|| panic!("{job}: no {flag}"));
            args[at + 1] = value.to_string();
        }
        let mut words: Vec<&str> = args.iter().map(String::as_str).collect();
        words.push("--json");
        let out = relax(&words);
        assert!(out.status.success(), "{job}: {}", text(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let plan = |job: &str| plan_with(job, &[]);
    let within = |what: &str, predicted: f64, published: f64| {
        assert!((predicted / published - 1.0).abs() <= 0.25, "{what}: plan {predicted:.1}, published {published:.1}");
    };
    let step = |p: &Value, layout: &str| p["layouts"][layout]["step_s"].as_f64().unwrap();
    let vime = plan("jobs/vime-910b.toml");
    within("vime 910B colocated step (s)", step(&vime, "colocate"), 457.4);
    // Relax's async trainer takes its batch in parts of 8 prompts: the layouts' steps differ, so
    // the speed-up is their throughputs' ratio (the published one is of step times, the same job).
    let relax_run = plan("jobs/relax-qwen3-4b.toml");
    let rate = |p: &Value, layout: &str| p["layouts"][layout]["samples_per_s_after_first_step"].as_f64().unwrap();
    within("Relax async over colocate", rate(&relax_run, "async") / rate(&relax_run, "colocate"), 225.9 / 128.6);
    // Its on-policy async run: staleness 0, 201.0 s a step.
    let on_policy = plan_with("jobs/relax-qwen3-4b.toml", &[("--max-staleness", "0"), ("--layouts", "async")]);
    within(
        "Relax on-policy async over colocate",
        rate(&on_policy, "async") / rate(&relax_run, "colocate"),
        225.9 / 201.0,
    );
    let verl = plan("jobs/verl-dapo-7b.toml");
    within("verl colocated 7B step (s)", step(&verl, "colocate"), 790.1);
    // verl's async trainer streams: its file's [layouts.async] gives it 128 prompts a step, a
    // weight sync every 4, so the job's 3 steps of 512 are 12 of its own, with no old_log_prob pass.
    let async_7b = &verl["layouts"]["async"];
    assert_eq!((async_7b["steps"].as_u64(), async_7b["prompts_per_step"].as_u64()), (Some(12), Some(128)), "{verl}");
    assert!(
        async_7b["phases"]["log_probs"].is_null() && verl["layouts"]["colocate"]["phases"]["log_probs"].is_number()
    );
}

/// A job file whose `[layouts.async]` section gives the async trainer batches of its own (half
/// the job's, a weight update every two: verl's fully async trainer taking its batch in parts)
/// and its engine a batch of the job's size (async.engine_groups): plan and compare give that
/// layout twice the steps, so that both layouts train on the same prompts, say so under their
/// tables, and still agree, on the engine's slots too; a batch that does not divide the job's
/// prompts is refused with the --steps that would.
#[test]
fn a_layouts_own_batch_trains_on_the_jobs_prompts_in_plan_and_compare() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    let body = "[compute]\nmodel = true\ntoken_scale = 20.0\n[task]\nmax_new_tokens = 48\n[algo]\nlr = 1e-9\n\
                [memory]\nprofile = \"qwen3-4b\"\nscale = 0.002\n[rollout]\nprompts_per_step = 4\n";
    // The engine keeps a batch of 4 groups, not the part's 2.
    let section =
        "[layouts.async]\nrollout.prompts_per_step = 2\nasync.train_iters_per_update = 2\nasync.engine_groups = 4\n";
    std::fs::write(&job, format!("{body}{section}")).unwrap();
    let args = ["--config", job.to_str().unwrap(), "--devices", "2", "--steps", "2", "--layouts", "colocate,async"];
    let plan = relax(&[&["plan", "--json"][..], &args].concat());
    assert!(plan.status.success(), "{}", text(&plan));
    let plan: Value = serde_json::from_slice(&plan.stdout).unwrap();
    let shape = |v: &Value| (v["steps"].as_u64().unwrap(), v["prompts_per_step"].as_u64().unwrap());
    assert_eq!(shape(&plan["layouts"]["colocate"]), (2, 4), "{plan}");
    assert_eq!(shape(&plan["layouts"]["async"]), (4, 2), "{plan}");
    let note = "async: batches of 2 prompts against the job's 4, so 4 steps of its own for the job's 2";
    assert!(plan["job"]["notes"].as_array().unwrap().iter().any(|n| n.as_str().unwrap().starts_with(note)), "{plan}");
    let out = dir.path().join("compare");
    let compare = relax(&[&["compare", "--repeats", "1", "--out", out.to_str().unwrap()][..], &args].concat());
    assert!(compare.status.success(), "{}", text(&compare));
    assert!(text(&compare).contains(&format!("note: {note}")), "{}", text(&compare));
    let measured: Value = serde_json::from_slice(&std::fs::read(out.join("compare.json")).unwrap()).unwrap();
    for layout in ["colocate", "async"] {
        assert_eq!(shape(&measured[layout]), shape(&plan["layouts"][layout]), "{layout}: {measured}");
        let (p, m) = (
            plan["layouts"][layout]["samples_per_s"].as_f64().unwrap(),
            measured[layout]["samples_per_s"].as_f64().unwrap(),
        );
        assert!((p / m - 1.0).abs() <= 0.15, "{layout} samples/s: plan {p:.3}, compare {m:.3}\n{plan}\n{measured}");
        // The share of the engine's slots filled: the run's engine had the slots plan gave it.
        let (p, m) = (
            plan["layouts"][layout]["slot_occupancy"].as_f64().unwrap(),
            measured[layout]["slot_occupancy"].as_f64().unwrap(),
        );
        assert!((p / m - 1.0).abs() <= 0.25, "{layout} slot occupancy: plan {p:.3}, compare {m:.3}");
    }
    let summary: Value = serde_json::from_slice(&std::fs::read(out.join("async/summary.json")).unwrap()).unwrap();
    assert_eq!(summary["async"]["train_iters_per_update"], 2, "the section reached the run: {summary}");
    let config = std::fs::read_to_string(out.join("async/config.toml")).unwrap();
    assert!(config.contains("engine_groups = 4"), "the section reached the run:\n{config}");
    assert!(config.contains("job_prompts_per_step = 4"), "the run records the job's batch:\n{config}");
    // Samples/s after step 1 leave out the job's first batch: the async layout's first two steps.
    let times: Vec<f64> = std::fs::read_to_string(out.join("async/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["perf/wall_step_time"].as_f64().unwrap())
        .collect();
    let batch = 2.0 * 8.0; // 2 prompts of the default 8 samples
    let after = measured["async"]["samples_per_s_after_first_step"].as_f64().unwrap();
    assert_eq!(times.len(), 4, "{times:?}");
    let expected = 2.0 * batch / times[2..].iter().sum::<f64>();
    assert!((after / expected - 1.0).abs() < 1e-9, "{after} against {expected}: {times:?}");
    let config = std::fs::read_to_string(out.join("colocate/config.toml")).unwrap();
    assert!(
        config.contains("engine_groups = 0") && config.contains("prompts_per_step = 4"),
        "and not colocate's:\n{config}"
    );
    std::fs::write(&job, format!("{body}[layouts.async]\nrollout.prompts_per_step = 8\n")).unwrap();
    let args = ["--config", job.to_str().unwrap(), "--devices", "2", "--steps", "3", "--layouts", "colocate,async"];
    for command in ["plan", "compare"] {
        let refused = relax(&[&[command][..], &args].concat());
        assert_eq!(refused.status.code(), Some(2), "{command}: {}", text(&refused));
        let words = "the async layout: its batch, 8 prompts (its [layouts] section of the job file), does not divide \
                     the job's --steps 3 x 4 prompts: give --steps a multiple of 2";
        assert!(text(&refused).contains(words), "{command}: {}", text(&refused));
    }
}
