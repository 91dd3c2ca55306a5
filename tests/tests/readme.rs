//! Every command line in README.md's `sh` blocks is run here, as written, on the simulator, or
//! named with the test that runs it (a build, the wheel, the GPU kit, real PyTorch). A line this
//! file does not know fails the test, so an example cannot be added, or changed, without being
//! run.
//!
//! The lines run in one bash per block from a scratch folder laid out like a checkout:
//! `target/release` and `target/debug` hold the built binaries and the hook, `bin/` (first on
//! PATH) the installed names (`tms-ctl`, `tms-sim`, `relax-colocate`, `python`), and `cargo`
//! stands for a build already made. The README's placeholders for the user's own programs
//! (`train.py`, `./my_cuda_program`) are small stand-ins that do what the text says they do.
//! Only three kinds of change are made to a line, each listed below with its reason: fewer steps
//! for `relax-colocate run`, `--print-config` where a GPU is named, and the pid and the `...` of
//! the tms-ctl example.

use std::path::Path;
use tms_e2e::*;

/// What the test does with one README line.
enum Plan {
    /// Run (after `edit`), expect this exit code and these words in its output.
    Run { edit: fn(&str) -> String, rc: i32, says: &'static [&'static str] },
    /// Run elsewhere: the named test or CI step does it.
    Elsewhere(&'static str),
}

fn as_written(line: &str) -> String {
    line.to_string()
}

/// A run of 30 steps (or 60) is the example's point for a person, not for a test.
fn two_steps(line: &str) -> String {
    match line.find("--steps ") {
        Some(i) => {
            let rest = &line[i + 8..];
            let end = rest.find(' ').map_or(line.len(), |j| i + 8 + j);
            format!("{}--steps 2{}", &line[..i], &line[end..])
        }
        None => format!("{line} --steps 2"),
    }
}

/// No GPU here: the flags are parsed and the whole configuration printed.
fn configuration_only(line: &str) -> String {
    format!("{line} --print-config")
}

fn plan(line: &str) -> Option<Plan> {
    if let Some(by) = run_elsewhere(line) {
        return Some(Plan::Elsewhere(by));
    }
    let run = |edit, rc, says| Some(Plan::Run { edit, rc, says });
    match line {
        "cargo build --release && target/release/relax-colocate run" => {
            run(two_steps, 0, &["checks:", "passed", "run directory:"])
        }
        "cargo build --release" => run(as_written, 0, &[]),
        "LD_PRELOAD=$PWD/target/release/libtms_hook.so TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1 python train.py" => {
            run(as_written, 0, &["train.py: 8 MiB paused and resumed with its contents"])
        }
        "TMS_NAME=trainer-rank0 LD_PRELOAD=.../libtms_hook.so TMS_INIT_ENABLE=1 python train.py &" => run(
            // `...` is where the user installed it; the test waits for the process to serve.
            |l| {
                format!(
                    "{}\nTRAIN_PID=$!\nfor _ in $(seq 200); do tms-ctl list 2>/dev/null | grep -q trainer-rank0 && break; sleep 0.1; done",
                    l.replace(".../libtms_hook.so", "$PWD/target/release/libtms_hook.so")
                )
            },
            0,
            &[],
        ),
        "tms-ctl list" => run(as_written, 0, &["trainer-rank0", "weights"]),
        "tms-ctl pause trainer-rank0" => run(as_written, 0, &["paused 1 allocations, 8.0 MiB"]),
        "tms-ctl resume --tag weights --all" => run(as_written, 0, &["resumed 1 allocations, 8.0 MiB"]),
        // The README's pid is an example; the test's process has its own.
        "tms-ctl status 1234 --json" => {
            run(|l| l.replace("1234", "$TRAIN_PID"), 0, &["\"weights\"", "\"bytes_active\""])
        }
        // `watch` redraws until Ctrl-C; one frame is the example's content.
        "tms-ctl watch" => run(|l| format!("{l} --count 1"), 0, &["trainer-rank0"]),
        "target/release/relax-colocate run" => run(two_steps, 0, &["checks:", "passed"]),
        "target/release/relax-colocate run --algo ppo --steps 60" => {
            run(two_steps, 0, &["PPO 2 steps on tms-sim", "checks:"])
        }
        "target/release/relax-colocate run --memory-profile qwen3-4b --tp 2 --device cuda" => {
            run(configuration_only, 0, &["qwen3-4b", "cuda"])
        }
        // Without the saver the same job cannot wake up: exit 1, out of memory, named.
        "target/release/relax-colocate run --offload false" => run(two_steps, 1, &["out of device memory"]),
        "target/release/relax-colocate run --mode async --devices 2 --max-staleness 2" => {
            run(two_steps, 0, &["async: trainer on device(s) 0, rollout on 1", "checks:"])
        }
        "target/release/relax-colocate run --mode async --devices 3 --rollout-devices 1-2 --algo ppo" => {
            run(two_steps, 0, &["rollout on 1,2", "checks:"])
        }
        "target/release/relax-colocate run --mode elastic --devices 2" => {
            run(two_steps, 0, &["elastic: trainer on device(s) 0, rollout on 1", "lending:", "checks:"])
        }
        // One run of each layout here: the repeats are compare's own test's.
        "target/release/relax-colocate compare --devices 4 --steps 10" => run(
            |l| format!("{} --repeats 1", two_steps(l)),
            0,
            &["async / colocate throughput", "elastic / the better of the others", "samples/s"],
        ),
        "target/release/relax-colocate plan --devices 4 --steps 8 --config jobs/long-tail.toml" => {
            run(as_written, 0, &["colocate", "async", "elastic", "_over_colocate"])
        }
        "target/release/relax-colocate run --print-config" => run(as_written, 0, &["steps", "phase_timeout_s"]),
        "target/release/relax-colocate run --metrics-style verl --logger tensorboard" => {
            run(two_steps, 0, &["checks:", "passed"])
        }
        "W=\"python3 scripts/torch_worker.py\"" => run(as_written, 0, &[]),
        // No GPU here: the error must say so and what to use instead.
        "target/release/relax-colocate bench --device cuda" => {
            run(as_written, 1, &["libcuda.so.1 cannot be loaded", "--device sim"])
        }
        "scripts/ray-env.sh" => run(as_written, 0, &["ray-venv/bin/python"]),
        // No NPU here: the error says what to do.
        "target/release/relax-colocate bench --device npu" => {
            run(as_written, 1, &["libascendcl.so cannot be loaded", "--device sim --api acl"])
        }
        "eval \"$(scripts/sim-env.sh --node mynode --memory 16GiB)\"" => run(as_written, 0, &[]),
        "./my_cuda_program" => run(as_written, 0, &["my_cuda_program: 16.0 GiB total"]),
        "target/release/tms-sim status --node mynode" => run(as_written, 0, &["mynode"]),
        "target/release/tms-sim surface" => run(as_written, 0, &["cudaMalloc"]),
        _ => None,
    }
}

/// The lines another test or CI step runs, and which.
fn run_elsewhere(line: &str) -> Option<&'static str> {
    match line {
        "cargo test --workspace" => Some(".ci/run (this test is part of it)"),
        // The measured comparisons of the layout tables: tens of minutes each on this CPU;
        // compare's own tests run its flags and a job file for one step.
        "relax-colocate compare --devices 4 --steps 10 --repeats 1 --set rollout.prompts_per_step=24 \\"
        | "--set memory.profile=qwen3-4b --set memory.scale=0.002 \\"
        | "--set compute.token_scale=300 --set task.max_new_tokens=24"
        | "relax-colocate compare --devices 4 --steps 8 --repeats 1 --config jobs/long-tail.toml"
        | "--set compute.token_scale=150 --set compute.token_scale_final=600 \\"
        | "--set task.max_new_tokens=24 --set algo.lr=1e-9 --set run.phase_timeout_s=600" => {
            Some("the tables' measurements, docs/perf.md (run_async::compare_* run compare's flags and a job file)")
        }
        // The modelled job takes minutes; the test runs the same file for one step on this CPU.
        "target/release/relax-colocate compare --devices 4 --steps 8 --config jobs/long-tail.toml" => {
            Some("run_async::compare_takes_a_job_file_for_every_layout_and_its_own_flags_win")
        }
        // Minutes of 20 steps; the tests time a given reward target (run_async) and the arithmetic
        // of an automatic one (compare::reward's unit tests); the README's figures are its run.
        "target/release/relax-colocate compare --devices 4 --steps 20 --config jobs/learning.toml" => {
            Some("run_async::compare_takes_a_job_file_for_every_layout_and_its_own_flags_win (--reward-target)")
        }
        "scripts/build-wheel.sh dist/"
        | "pip uninstall -y torch_memory_saver && pip install dist/tms_memory_saver-*.whl" => {
            Some("torch::the_wheel_installs_with_pip_and_replaces_torch_memory_saver")
        }
        // The quickstart's check: the path printed is the wheel's preload hook in site-packages.
        "python -m tms library" => {
            Some("torch::the_wheel_installs_with_pip_and_replaces_torch_memory_saver (test_wheel.py)")
        }
        "python -m tms doctor" => Some(
            "torch::the_wheel_installs_with_pip_and_replaces_torch_memory_saver (test_wheel.py: a whole install, \
             a hook for another CPU, expandable segments, a framework's pin installed after the wheel)",
        ),
        "relax-colocate run --memory-profile tiny --steps 30 --trainer-cmd \"$W\" --rollout-cmd \"$W\"" => {
            Some("torch::the_colocated_cycle_runs_with_pytorch_workers (PyTorch from scripts/torch-env.sh)")
        }
        "relax-colocate run --mode async --devices 2 --memory-profile tiny --trainer-cmd \"$W\" --rollout-cmd \"$W\"" => {
            Some("torch::the_async_loop_runs_with_pytorch_workers_* (PyTorch from scripts/torch-env.sh)")
        }
        "target/release/relax-colocate bench --device sim --quick" => {
            Some("bench::quick_bench_prints_every_table_and_writes_results")
        }
        "target/release/relax-colocate run --launcher ray --ray-address local --nodes 2 --devices 2" => {
            Some("ray::two_nodes_of_two_devices_on_a_local_ray_cluster_run_the_cycle_and_pass_its_checks (2 steps)")
        }
        "target/release/relax-colocate bench --device sim --api acl --quick" => {
            Some("bench::quick_bench_through_acl_prints_every_table_and_writes_results")
        }
        "scripts/build-wheel.sh --arch aarch64 dist/" | "scripts/npu-check.sh prepare --arch aarch64 kit/" => Some(
            "aarch64::the_aarch64_wheel_and_kit_hold_aarch64_programs_only_with_upstreams_file_names \
             (npu-check.sh prepare --arch aarch64 builds the wheel; the other aarch64 tests run the kit under qemu)",
        ),
        // On an NPU host; here the same kit runs on the simulator's ACL side.
        "kit/npu-check.sh run kit/ out/" => Some("gpu_kit::the_ascend_kit_passes_on_the_simulators_acl_side"),
        "scripts/gpu-check.sh prepare kit/" | "kit/gpu-check.sh run kit/ out/" => {
            Some("gpu_kit::the_kit_is_small_and_self_contained, gpu_kit::the_kit_passes_on_the_simulator")
        }
        "python -c 'import torch; print(torch.cuda.mem_get_info())'" => {
            Some("torch::pytorch_runs_on_the_simulator (PyTorch from scripts/torch-env.sh)")
        }
        _ => None,
    }
}

/// `plan`, for a line whose run depends on its block: `tms-ctl list` is run where the README
/// starts train.py to list; in the quickstart it lists a framework's job, which the SGLang
/// scheduler of test_frameworks.py stands for.
fn plan_in(block: &[(usize, String)], line: &str) -> Option<Plan> {
    let trainer_started = block.iter().any(|(_, l)| l.starts_with("TMS_NAME=trainer-rank0 "));
    if line == "tms-ctl list" && !trainer_started {
        return Some(Plan::Elsewhere(
            "torch::sglang_and_slime_call_sequences_with_ours_the_wheel_and_upstream (test_frameworks.py, section e: \
             tms-ctl list shows an SGLang scheduler started under configure_subprocess)",
        ));
    }
    plan(line)
}

/// The README's `sh` blocks, each a list of (README line number, command without its comment).
fn sh_blocks(readme: &str) -> Vec<Vec<(usize, String)>> {
    let mut blocks = Vec::new();
    // Inside a fenced block: Some(lines) for `sh`, None for any other language.
    let mut open: Option<Option<Vec<(usize, String)>>> = None;
    for (i, line) in readme.lines().enumerate() {
        let trimmed = line.trim();
        if let Some(lang) = trimmed.strip_prefix("```") {
            match open.take() {
                Some(Some(block)) => blocks.push(block),
                Some(None) => {}
                None => open = Some((lang == "sh").then(Vec::new)),
            }
            continue;
        }
        if let Some(Some(block)) = open.as_mut() {
            // Comments start after two spaces; none of the commands has a `#` of its own.
            let command = trimmed.split("  #").next().unwrap_or("").trim();
            if !command.is_empty() {
                block.push((i + 1, command.to_string()));
            }
        }
    }
    blocks
}

/// Stand-in for the user's training script: allocates 8 MiB in a region under tag "weights"
/// through the preloaded hook and checks that a pause and resume keep its bytes; named
/// (`TMS_NAME`), it stays up to be driven from outside, as the tms-ctl example needs.
const TRAIN_PY: &str = r#"
import ctypes, os, time
rt = ctypes.CDLL("libcudart.so.13")
hook = ctypes.CDLL(None)
hook.tms_set_current_tag(b"weights")
ptr = ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(ptr), 8 << 20) == 0
data = bytes(range(256)) * (32 << 10)
assert rt.cudaMemcpy(ptr, data, len(data), 1) == 0
if os.environ.get("TMS_NAME"):
    time.sleep(120)
else:
    assert hook.tms_pause(b"weights") == 0 and hook.tms_resume(b"weights") == 0
    back = ctypes.create_string_buffer(len(data))
    assert rt.cudaMemcpy(back, ptr, len(data), 2) == 0
    assert back.raw == data
    print("train.py: 8 MiB paused and resumed with its contents")
"#;

/// Stand-in for a CUDA program run on the simulator (no hook): asks the runtime for memory.
const MY_CUDA_PROGRAM: &str = r#"#!/usr/bin/env python3
import ctypes
rt = ctypes.CDLL("libcudart.so.12")
free, total = ctypes.c_size_t(), ctypes.c_size_t()
assert rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0
ptr = ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(ptr), 1 << 20) == 0 and rt.cudaFree(ptr) == 0
print(f"my_cuda_program: {total.value / (1 << 30):.1f} GiB total")
"#;

fn lay_out(root: &Path) {
    let ws = workspace();
    let link = |target: &Path, at: &Path| {
        std::fs::create_dir_all(at.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(target, at).unwrap();
    };
    for profile in ["release", "debug"] {
        for name in ["relax-colocate", "tms-ctl", "tms-sim"] {
            link(&ws.bin(name), &root.join("target").join(profile).join(name));
        }
        link(&ws.hook(), &root.join("target").join(profile).join("libtms_hook.so"));
    }
    for name in ["relax-colocate", "tms-ctl", "tms-sim"] {
        link(&ws.bin(name), &root.join("bin").join(name));
    }
    let python3 =
        std::process::Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().unwrap();
    let python3 = String::from_utf8(python3.stdout).unwrap();
    link(Path::new(python3.trim()), &root.join("bin/python"));
    std::fs::write(root.join("bin/cargo"), "#!/bin/sh\n# The test's binaries are built already.\nexit 0\n").unwrap();
    link(&ws.root.join("scripts"), &root.join("scripts"));
    link(&ws.root.join("jobs"), &root.join("jobs"));
    std::fs::write(root.join("train.py"), TRAIN_PY).unwrap();
    std::fs::write(root.join("my_cuda_program"), MY_CUDA_PROGRAM).unwrap();
    for exe in ["bin/cargo", "my_cuda_program"] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(root.join(exe), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

#[test]
fn every_readme_example_runs() {
    let ws = workspace();
    let readme = std::fs::read_to_string(ws.root.join("README.md")).unwrap();
    let blocks = sh_blocks(&readme);
    assert!(blocks.len() >= 8, "found only {} sh blocks", blocks.len());
    let unknown: Vec<String> = blocks
        .iter()
        .flat_map(|b| b.iter().filter(|(_, l)| plan_in(b, l).is_none()))
        .map(|(n, l)| format!("README.md:{n}: {l}"))
        .collect();
    assert!(
        unknown.is_empty(),
        "README examples this test does not run; add them to tests/tests/readme.rs:\n{}",
        unknown.join("\n")
    );

    let mut ran = 0;
    for block in &blocks {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path();
        lay_out(root);
        let node = SimNode::new("1GiB");
        // One bash per block (an `eval` or a `&` carries to the next line); a marker with the
        // exit code after each line splits the output.
        let mut script = String::from("exec 2>&1\ncd \"$1\"\nexport PATH=\"$PWD/bin:$PATH\"\n");
        let mut expected = Vec::new();
        for (n, line) in block {
            match plan_in(block, line).expect("checked above") {
                Plan::Elsewhere(by) => eprintln!("README.md:{n} `{line}`: run by {by}"),
                Plan::Run { edit, rc, says } => {
                    script.push_str(&format!("{}\necho \"@@readme line {n} rc=$?\"\n", edit(line)));
                    expected.push((*n, line.clone(), rc, says));
                }
            }
        }
        script.push_str("kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; exit 0\n");
        if expected.is_empty() {
            continue;
        }
        let argv = ["bash".into(), "-c".into(), script.clone().into(), "readme".into(), root.to_path_buf()];
        // relax-colocate picks its device itself (the simulator here, no GPU): a shell already
        // pointed at the simulator would make it take that for CUDA. The other blocks stand for a
        // machine with a device, which the simulator plays.
        let mut cmd = if block.iter().any(|(_, l)| l.contains("relax-colocate ")) {
            let mut c = std::process::Command::new(&argv[0]);
            c.args(&argv[1..])
                .env_remove("LD_PRELOAD")
                .env_remove("LD_LIBRARY_PATH")
                .env("TMS_CONTROL_DIR", node.control_dir());
            c
        } else {
            node.command(&argv)
        };
        let out = cmd.env_remove("CARGO_TARGET_DIR").output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut rest = stdout.as_str();
        for (n, line, rc, says) in expected {
            let marker = format!("@@readme line {n} rc=");
            let at = rest.find(&marker).unwrap_or_else(|| panic!("README.md:{n} `{line}` never finished:\n{stdout}"));
            let own = &rest[..at];
            let code: i32 = rest[at + marker.len()..].split_whitespace().next().unwrap().parse().unwrap();
            assert_eq!(code, rc, "README.md:{n} `{line}` exited {code}, not {rc}:\n{own}");
            for word in says {
                assert!(own.contains(word), "README.md:{n} `{line}` did not say {word:?}:\n{own}");
            }
            let after = &rest[at..];
            rest = &after[after.find('\n').map_or(after.len(), |i| i + 1)..];
            ran += 1;
        }
    }
    eprintln!("{ran} README command lines run");
    assert!(ran >= 15, "only {ran} README lines ran");
}

/// The quickstart's framework lines sit in a `text` block (they need SGLang, slime or verl, which
/// CI does not install), so they are not run; each switch they name must be one docs/frameworks.md
/// records with its source, and the quickstart must stay on the README's first screen.
#[test]
fn the_quickstart_names_only_switches_docs_frameworks_records() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let research = std::fs::read_to_string(root.join("docs/frameworks.md")).unwrap();
    let lines: Vec<&str> = readme.lines().collect();
    let heading = lines.iter().position(|l| l.starts_with("**Switch slime, SGLang or verl**")).expect("the quickstart");
    assert!(heading < 40, "the quickstart starts on README.md:{}, off the first screen", heading + 1);
    let open = heading + lines[heading..].iter().position(|l| l.trim() == "```text").expect("its framework block");
    let block: Vec<&str> = lines[open + 1..].iter().take_while(|l| l.trim() != "```").copied().collect();
    for framework in ["SGLang:", "slime:", "verl:"] {
        assert!(block.iter().any(|l| l.starts_with(framework)), "no {framework} line in {block:?}");
    }
    // Flags (`--x`) and Hydra overrides (`a.b=c`), stripped of the prose's brackets and commas.
    let switches: Vec<&str> = block
        .iter()
        .flat_map(|l| l.split_whitespace())
        .map(|w| w.trim_matches(|c| matches!(c, '(' | ')' | ',')))
        .filter(|w| w.starts_with("--") || (w.contains('=') && w.contains('.')))
        .collect();
    assert!(switches.len() >= 5, "{switches:?}");
    let unsourced: Vec<&&str> = switches.iter().filter(|w| !research.contains(&format!("`{w}`"))).collect();
    assert!(unsourced.is_empty(), "the quickstart names {unsourced:?}, which docs/frameworks.md does not record");
    assert!(research.contains("\n## Sources\n"), "docs/frameworks.md has no Sources list");
}

/// docs/troubleshooting.md quotes each error as the code prints it: every heading's quoted piece
/// must still be in the code (Rust, Python or the scripts), so a reworded message cannot leave
/// the page explaining a message nobody sees. The README's first screen links the page.
#[test]
fn every_error_the_troubleshooting_page_explains_is_printed_by_the_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let page = std::fs::read_to_string(root.join("docs/troubleshooting.md")).unwrap();
    let quoted: Vec<&str> =
        page.lines().filter_map(|l| l.strip_prefix("### `").and_then(|rest| rest.strip_suffix('`'))).collect();
    assert!(quoted.len() >= 15, "{quoted:?}");
    fn sources(dir: &Path, text: &mut String) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target" && n != "__pycache__") {
                    sources(&p, text);
                }
            } else if p.extension().is_some_and(|x| x == "rs" || x == "py" || x == "sh") {
                text.push_str(&std::fs::read_to_string(&p).unwrap_or_default());
            }
        }
    }
    let mut code = String::new();
    for dir in [
        "tms-hook/src",
        "tms-sim/src",
        "tms-proto/src",
        "tms-ctl/src",
        "tms-vendor/src",
        "relax-colocate/src",
        "python",
        "scripts",
    ] {
        sources(&root.join(dir), &mut code);
    }
    let missing: Vec<&&str> = quoted.iter().filter(|q| !code.contains(**q)).collect();
    assert!(missing.is_empty(), "docs/troubleshooting.md explains messages the code no longer prints: {missing:?}");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let at = readme.find("docs/troubleshooting.md").expect("the README links docs/troubleshooting.md");
    assert!(readme[..at].lines().count() < 60, "the troubleshooting link is off the README's first screen");
}
