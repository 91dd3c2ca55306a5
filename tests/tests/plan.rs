//! `relax-colocate plan` against `relax-colocate compare` on the same job: the prediction is made
//! without running anything, the comparison runs every layout on the simulator with modelled
//! device time; they must agree within 15% on every layout's throughput. And the plan's JSON is
//! the shape scripts read, and a job the run would refuse is refused with the run's words.

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

#[test]
fn plan_predicts_what_compare_measures_within_15_percent_on_every_layout() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = ["--set", "rollout.prompts_per_step=4"];
    let plan = relax(&[&["plan", "--json"][..], &JOB, &prompts].concat());
    assert!(plan.status.success(), "{}", text(&plan));
    let plan: Value = serde_json::from_slice(&plan.stdout).unwrap();
    let out = dir.path().to_str().unwrap();
    let compare = relax(&[&["compare", "--json", "--repeats", "1", "--out", out][..], &JOB, &prompts].concat());
    assert!(compare.status.success(), "{}", text(&compare));
    let measured: Value = serde_json::from_slice(&compare.stdout).unwrap();
    for layout in ["colocate", "async", "elastic"] {
        let predicted = &plan["layouts"][layout];
        for key in ["samples_per_s", "samples_per_s_after_first_step"] {
            let (p, m) = (predicted[key].as_f64().unwrap(), measured[layout][key].as_f64().unwrap());
            assert!((p / m - 1.0).abs() <= 0.15, "{layout} {key}: plan {p:.3}, compare {m:.3}\n{plan}\n{measured}");
        }
        let phases = predicted["phases"].as_object().unwrap();
        assert!(phases["actor_train"].as_f64().unwrap() > 0.0, "{plan}");
        assert!(predicted["step_s"].as_f64().unwrap() > 0.0 && predicted["steps"] == 3, "{plan}");
    }
    assert!(plan["layouts"]["colocate"]["phases"]["generate"].as_f64().unwrap() > 0.0, "{plan}");
    assert!(plan["layouts"]["colocate"]["phases"]["wake_up"].as_f64().unwrap() > 0.0, "{plan}");
    assert!(plan["verdict"]["layout"].is_string() && plan["job"]["profile"] == "qwen3-4b", "{plan}");
}

#[test]
fn plan_prints_a_table_and_refuses_what_the_run_would_refuse() {
    let table = relax(&[&["plan"][..], &JOB].concat());
    assert!(table.status.success(), "{}", text(&table));
    let stdout = String::from_utf8_lossy(&table.stdout);
    for word in ["layout", "colocate", "async", "elastic", "samples/s", "fastest:"] {
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
