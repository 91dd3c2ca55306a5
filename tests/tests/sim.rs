//! tms-sim end to end: C programs in each loading style, on private simulated nodes.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use tms_e2e::*;

#[test]
fn vmm_cycle_and_bad_inputs_in_every_loading_style() {
    for style in STYLES {
        let prog = c_program("sim_consumer", style);
        for mode in ["cuda-vmm", "cuda-errors", "acl-vmm", "acl-errors"] {
            let node = SimNode::new("1GiB");
            let mut argv = prog.clone();
            argv.push(mode.into());
            let out = run_ok(&mut node.command(&argv));
            assert!(!out.is_empty(), "{style:?} {mode} printed nothing");
        }
    }
}

#[test]
fn free_memory_drops_and_rises_with_create_and_release() {
    let node = SimNode::new("1GiB");
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.push("cuda-vmm".into());
    let out = run_ok(&mut node.command(&argv));
    let (f0, f1, f2) = (field(&out, "free0"), field(&out, "free_after_create"), field(&out, "free_after_release"));
    assert_eq!(f0, 1024 * MIB);
    assert_eq!(f0 - f1, 8 * MIB);
    assert_eq!(f2, f0);
}

#[test]
fn consumer_carries_the_versioned_runtime_reference() {
    let prog = c_program("sim_consumer", Style::Linked);
    let out = Command::new("objdump").arg("-T").arg(&prog[0]).output().expect("objdump");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines().any(|l| l.contains("(libcudart.so.12)") && l.trim_end().ends_with(" cudaMemcpy")),
        "the consumer should reference cudaMemcpy@libcudart.so.12:\n{text}"
    );
    let sim = Command::new("objdump").arg("-T").arg(workspace().sim_lib()).output().expect("objdump");
    let text = String::from_utf8_lossy(&sim.stdout);
    // Both runtime majors' references bind: .12 as a non-default version, .13 as the default.
    assert!(text.lines().any(|l| l.contains("(libcudart.so.12)") && l.trim_end().ends_with(" cudaMalloc")));
    assert!(text.lines().any(|l| l.contains(" libcudart.so.13 ") && l.trim_end().ends_with(" cudaMalloc")));
}

/// Starts a process holding `mib` on the node; returns it and its HOLD line.
fn hold(node: &SimNode, api: &str, mib: u64) -> (std::process::Child, String) {
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.extend(["hold".into(), api.into(), mib.to_string().into()]);
    let mut child = node.command(&argv).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    (child, line)
}

fn release(mut child: std::process::Child) {
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

#[test]
fn processes_on_one_node_share_capacity() {
    let node = SimNode::new("1GiB");
    let (a, line_a) = hold(&node, "cuda", 700);
    assert_eq!(field(&line_a, "rc"), 0, "{line_a}");
    // A second process sees the first one's usage, through either vendor API, and cannot fit.
    let (b, line_b) = hold(&node, "acl", 700);
    assert_eq!(field(&line_b, "rc"), 207001, "{line_b}");
    // 1 GiB + one CUDA context of capacity, less the first process's context and 700 MiB, less
    // this process's own Ascend context (200 MiB).
    assert_eq!(field(&line_b, "free_before"), 124 * MIB, "{line_b}");
    release(b);
    let (c, line_c) = hold(&node, "cuda", 700);
    assert_eq!(field(&line_c, "rc"), 2, "{line_c}");
    release(c);
    release(a);
    // Once the first is gone, the same request fits.
    let (d, line_d) = hold(&node, "cuda", 700);
    assert_eq!(field(&line_d, "rc"), 0, "{line_d}");
    assert_eq!(field(&line_d, "free_before"), 1024 * MIB, "{line_d}");
    release(d);
}

#[test]
fn usage_of_a_killed_process_is_reclaimed() {
    let node = SimNode::new("1GiB");
    let (mut a, line_a) = hold(&node, "cuda", 700);
    assert_eq!(field(&line_a, "rc"), 0);
    a.kill().unwrap();
    a.wait().unwrap();
    let (b, line_b) = hold(&node, "cuda", 700);
    assert_eq!(field(&line_b, "rc"), 0, "the dead process's 700 MiB should be reclaimed: {line_b}");
    release(b);
}

#[test]
fn release_returns_host_memory() {
    let node = SimNode::new("2GiB");
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.push("release".into());
    run_ok(&mut node.command(&argv));
}

/// Device memory is not in the process's resident set, as on a GPU (VmRSS is what
/// torch_memory_saver's own tests read to see a CPU backup come and go); the knob puts it back.
#[test]
fn device_memory_stays_out_of_the_process_resident_set() {
    let node = SimNode::new("2GiB");
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.extend(["device-rss".into(), "0".into()]);
    let out = run_ok(&mut node.command(&argv));
    assert!(out.contains("device rss ok"), "{out}");
    argv.pop();
    argv.push("1".into());
    let out = run_ok(node.command(&argv).env("TMS_SIM_DEVICE_IN_RSS", "1"));
    assert!(out.contains("device rss ok"), "{out}");
}

#[test]
fn ten_thousand_live_handles_use_one_descriptor() {
    let node = SimNode::new("32GiB");
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.extend(["handles".into(), "10000".into()]);
    let out = run_ok(&mut node.command(&argv));
    assert!(out.contains("handles=10000"), "{out}");
}

#[test]
fn fault_injection_fails_the_chosen_calls() {
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.extend(["creates".into(), "5".into()]);
    for (spec, want) in [
        ("cuMemCreate:3:2", "0 0 2 0 0"),
        ("cuMemCreate:2+:801", "0 801 801 801 801"),
        ("cuMemCreate:1", "2 0 0 0 0"),
        ("cuMemMap:1", "0 0 0 0 0"),
    ] {
        let node = SimNode::new("1GiB").env("TMS_SIM_FAIL", spec);
        let out = run_ok(&mut node.command(&argv));
        assert_eq!(out.trim(), want, "TMS_SIM_FAIL={spec}");
    }
}

#[test]
fn async_copies_on_streams_round_trip() {
    let node = SimNode::new("1GiB").env("TMS_SIM_COPY_GBPS", "8");
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.push("streams".into());
    run_ok(&mut node.command(&argv));
}

#[test]
fn copy_throttle_limits_bandwidth() {
    // 32 MiB in each direction at 1 GB/s cannot take less than ~67 ms.
    let node = SimNode::new("1GiB").env("TMS_SIM_COPY_GBPS", "1");
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.push("streams".into());
    let start = std::time::Instant::now();
    run_ok(&mut node.command(&argv));
    let took = start.elapsed();
    assert!(took.as_millis() >= 60, "copies took {took:?}, faster than the 1 GB/s limit allows");
}

/// Every input a launcher decides goes through `tms-sim env`, which names the variables the
/// simulator then reads; a value it would misread is refused with the option's name.
#[test]
fn cli_env_takes_every_launcher_input() {
    let ws = workspace();
    let env = |args: &[&str]| {
        let json = run_ok(Command::new(ws.bin("tms-sim")).args(["env", "--json"]).args(args));
        serde_json::from_str::<serde_json::Value>(&json).unwrap_or_else(|e| panic!("{e}: {json}"))
    };
    let doc = env(&[
        "--dir",
        "/tmp/x",
        "--devices",
        "2",
        "--copy-gbps",
        "25",
        "--link-gbps",
        "450,0.1",
        "--connect-timeout",
        "7",
        "--commit",
        "--npu-only",
    ]);
    let set = &doc["set"];
    for (name, value) in [
        ("TMS_SIM_DIR", "/tmp/x"),
        ("TMS_SIM_DEVICES", "2"),
        ("TMS_SIM_COPY_GBPS", "25"),
        ("TMS_SIM_LINK_GBPS", "450,0.1"),
        ("TMS_SIM_NCCL_CONNECT_TIMEOUT", "7"),
        ("TMS_SIM_HCCL_CONNECT_TIMEOUT", "7"),
        ("TMS_SIM_COMMIT", "1"),
        ("TMS_SIM_CUDA", "0"),
    ] {
        assert_eq!(set[name], value, "{name}: {doc}");
    }
    // A published multi-node job's devices on one simulated node (32 H20s, 64 in all).
    assert_eq!(env(&["--devices", "64"])["set"]["TMS_SIM_DEVICES"], "64");
    // Nothing asked, nothing set beyond the library: the simulator's defaults stay in force.
    let plain = env(&[]);
    let names: Vec<&String> = plain["set"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["TMS_SIM_LIB"], "{plain}");
    // A context's size is the simulator's to say, its defaults or the inherited setting.
    assert_eq!(plain["context_bytes"]["cuda"], tms_e2e::CONTEXT_BYTES, "{plain}");
    assert_eq!(plain["context_bytes"]["acl"], 200 * MIB, "{plain}");
    let sized = run_ok(Command::new(ws.bin("tms-sim")).args(["env", "--json"]).env("TMS_SIM_CONTEXT_MEMORY", "64MiB"));
    let sized: serde_json::Value = serde_json::from_str(&sized).unwrap();
    assert_eq!(sized["context_bytes"]["acl"], 64 * MIB, "{sized}");
    for (args, says) in [
        (["--link-gbps", "fast"], "--link-gbps \"fast\" is not INTRA[,INTER]"),
        (["--link-gbps", "1,2,3"], "--link-gbps \"1,2,3\" is not INTRA[,INTER]"),
        (["--copy-gbps", "inf"], "--copy-gbps inf is not a rate"),
        (["--devices", "65"], "--devices must be 1 to 64"),
        (["--devices", "0"], "--devices must be 1 to 64"),
    ] {
        let bad = Command::new(ws.bin("tms-sim")).arg("env").args(args).output().unwrap();
        assert_eq!(bad.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// The places that launch processes on the simulator (relax-colocate's runner and bench, the
/// test harness, the torch consumers' fixtures, the shell helpers) ask `tms-sim env` instead of
/// writing its variables: a variable's name written there as a value of its own (a string
/// literal, a shell assignment or expansion) fails here, so that a new one goes into
/// `tms-sim env` instead. Prose that mentions a name (help text, comments) is fine.
#[test]
fn only_tms_sim_env_names_the_simulators_variables() {
    let root = workspace().root.clone();
    // Each allowance is a file and the one name it may write, with the reason.
    let allowed: &[(&str, &str, &str)] = &[
        // The Ray launcher gives each node of a local cluster a node of its own by renaming the
        // one tms-sim env set (to be asked of tms-sim env per node).
        ("relax-colocate/src/run/fleet/ray.rs", "TMS_SIM_NODE", "per-node rename"),
        // Removes a fault-injection rule a test would otherwise inherit; it sets nothing.
        ("tests/src/lib.rs", "TMS_SIM_FAIL", "removed, never set"),
        // Read to size the host: committed pages cost the device's rounding. It sets nothing.
        ("relax-colocate/src/run/sizing.rs", "TMS_SIM_COMMIT", "read, never set"),
    ];
    let mut files = Vec::new();
    for dir in ["relax-colocate/src", "tests/src"] {
        collect(&root.join(dir), &mut files);
    }
    for file in
        ["tests/torch-consumers/conftest.py", "scripts/sim-env.sh", "scripts/demo.sh", "scripts/soak-control.sh"]
    {
        files.push(root.join(file));
    }
    let mut found = Vec::new();
    for path in &files {
        let rel = path.strip_prefix(&root).unwrap().display().to_string();
        let text = std::fs::read_to_string(path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") || code.starts_with('#') {
                continue;
            }
            for name in written_names(line) {
                found.push((rel.clone(), name, n + 1));
            }
        }
    }
    let stray: Vec<_> =
        found.iter().filter(|(f, name, _)| !allowed.iter().any(|(af, an, _)| af == f && an == name)).collect();
    assert!(
        stray.is_empty(),
        "simulator variables written outside tms-sim env (add an option to `tms-sim env` and pass it): {stray:?}"
    );
    for (file, name, why) in allowed {
        assert!(
            found.iter().any(|(f, n, _)| f == file && n == name),
            "{file} no longer writes {name} ({why}): remove its allowance here"
        );
    }
}

/// `TMS_SIM_*` names on a line written as values of their own: "NAME", 'NAME', NAME=, $NAME, ${NAME.
fn written_names(line: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("TMS_SIM_") {
        let before = rest[..at].chars().last();
        let tail = &rest[at..];
        let len = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        let after = tail[len..].chars().next();
        let quoted = matches!((before, after), (Some('"'), Some('"')) | (Some('\''), Some('\'')));
        let shell = after == Some('=') || matches!(before, Some('$') | Some('{'));
        // The bare prefix selects variables (conftest keeps a real device's own), naming none.
        if (quoted || shell) && len > "TMS_SIM_".len() {
            names.push(tail[..len].to_string());
        }
        rest = &tail[len..];
    }
    names
}

fn collect(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn cli_prints_env_and_node_status() {
    let ws = workspace();
    let out = run_ok(Command::new(ws.bin("tms-sim")).args(["env", "--node", "n1", "--memory", "8GiB"]));
    assert!(out.contains("export LD_LIBRARY_PATH="), "{out}");
    assert!(out.contains("export TMS_SIM_NODE=n1"));
    assert!(out.contains("export TMS_SIM_MEMORY=8GiB"));
    // The same environment for programs: every shell line has its JSON counterpart.
    let json = run_ok(Command::new(ws.bin("tms-sim")).args(["env", "--json", "--node", "n1", "--memory", "8GiB"]));
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    assert_eq!(doc["set"]["TMS_SIM_NODE"], "n1", "{doc}");
    assert_eq!(doc["set"]["TMS_SIM_MEMORY"], "8GiB", "{doc}");
    let lib_dir = doc["prepend"]["LD_LIBRARY_PATH"].as_str().unwrap();
    assert!(out.contains(&format!("export LD_LIBRARY_PATH={lib_dir}$")), "{out}\n{doc}");
    let sim_lib = doc["set"]["TMS_SIM_LIB"].as_str().unwrap();
    assert!(std::path::Path::new(sim_lib).exists(), "{doc}");
    assert!(doc["prepend"]["PYTHONPATH"].as_str().unwrap().ends_with("tms-sim/python"), "{doc}");
    let bad = Command::new(ws.bin("tms-sim")).args(["env", "--memory", "lots"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a size"));

    let node = SimNode::new("1GiB");
    let (a, _) = hold(&node, "cuda", 100);
    let status = run_ok(
        Command::new(ws.bin("tms-sim"))
            .args(["status", "--node", "test", "--json"])
            .env("TMS_SIM_DIR", node.dir.path()),
    );
    assert!(status.contains(&format!("\"capacity\": {}", node.capacity())), "{status}");
    // The process's usage includes its context.
    assert!(status.contains(&format!("{}", 100 * MIB + tms_e2e::CONTEXT_BYTES)), "{status}");
    release(a);
}

#[test]
fn a_reader_that_stops_early_ends_tms_sim_quietly() {
    use std::os::fd::FromRawFd;
    let ws = workspace();
    let mut fds = [0; 2];
    // SAFETY: a fresh pipe whose read end is closed at once; the write end goes to the child.
    let gone_reader = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        libc::close(fds[0]);
        std::os::fd::OwnedFd::from_raw_fd(fds[1])
    };
    let out = Command::new(ws.bin("tms-sim"))
        .args(["env", "--node", "pipe"])
        .stdout(Stdio::from(gone_reader))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked") && out.status.code() != Some(101), "{:?}: {err}", out.status);
}

#[test]
fn status_counts_a_killed_process_memory_as_free_not_used() {
    let ws = workspace();
    let node = SimNode::new("1GiB");
    let (mut a, line) = hold(&node, "cuda", 100);
    assert_eq!(field(&line, "rc"), 0, "{line}");
    let pid = a.id();
    a.kill().unwrap();
    a.wait().unwrap();
    let status = |json: bool| {
        let mut cmd = Command::new(ws.bin("tms-sim"));
        cmd.args(["status", "--node", "test"]).env("TMS_SIM_DIR", node.dir.path());
        if json {
            cmd.arg("--json");
        }
        run_ok(&mut cmd)
    };
    let doc: serde_json::Value = serde_json::from_str(&status(true)).unwrap();
    let held = 100 * MIB + tms_e2e::CONTEXT_BYTES;
    assert_eq!(doc["used"][0], 0, "{doc}");
    assert_eq!(doc["held_by_exited"][0], held, "{doc}");
    let row = doc["processes"].as_array().unwrap().iter().find(|p| p["pid"] == pid).cloned().unwrap();
    assert_eq!((row["alive"].clone(), row["used"][0].clone()), (false.into(), held.into()), "{doc}");
    let text = status(false);
    assert!(text.contains("exited processes (alive: no) are not counted as used"), "{text}");
}

#[test]
fn docs_list_the_runtime_surface_as_exported() {
    let ws = workspace();
    let out = Command::new(ws.bin("tms-sim")).args(["surface", "--markdown"]).output().expect("run tms-sim surface");
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    let docs = std::fs::read_to_string(ws.root.join("docs/simulator.md")).unwrap();
    assert!(
        docs.contains(&table),
        "docs/simulator.md's runtime table is out of date: regenerate it with `tms-sim surface --markdown`"
    );
    // Every listed name is exported under the version nodes of the majors its row names: both
    // (12 hidden, 13 the default), CUDA 12's own names as 12's default, and a name whose
    // arguments changed in CUDA 13 once under each node.
    let dynsym = Command::new("objdump").arg("-T").arg(ws.sim_lib()).output().expect("objdump");
    let dynsym = String::from_utf8_lossy(&dynsym.stdout);
    let exported = |name: &str, node: &str| {
        dynsym.lines().any(|l| l.contains(node) && l.trim_end().ends_with(&format!(" {name}")))
    };
    let rows: Vec<(&str, &str)> = table
        .lines()
        .skip(2)
        .map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            (cells[1].trim_matches('`'), cells[2])
        })
        .collect();
    for &(name, majors) in &rows {
        let split = rows.iter().filter(|(n, _)| *n == name).count() == 2;
        let nodes: &[&str] = match majors {
            "12, 13" => &["(libcudart.so.12)", " libcudart.so.13 "],
            "12" if split => &["(libcudart.so.12)"],
            "12" => &[" libcudart.so.12 "],
            "13" => &[" libcudart.so.13 "],
            other => panic!("{name}: unknown majors {other:?}"),
        };
        for node in nodes {
            assert!(exported(name, node), "{name} is not exported under {node}");
        }
        if majors == "12" && !split {
            assert!(!exported(name, " libcudart.so.13 "), "{name} is CUDA 12's only, yet exported under 13");
        }
    }
}

#[test]
fn a_device_fault_is_sticky() {
    // On a GPU an illegal address kills the context: later calls fail until the process exits.
    for style in STYLES {
        let node = SimNode::new("256MiB");
        let mut argv = c_program("sim_consumer", style);
        argv.push("cuda-sticky".into());
        let out = run_ok(&mut node.command(&argv));
        assert!(out.contains("sticky ok"), "{style:?}: {out}");
    }
}

#[test]
fn async_copies_land_over_their_modelled_time() {
    // On a forgiving simulator the bytes were all there when the call returned, so a missing
    // synchronize in pause or resume would pass.
    let node = SimNode::new("1GiB").env("TMS_SIM_COPY_GBPS", "1");
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.push("copies-land-late".into());
    let out = run_ok(&mut node.command(&argv));
    assert!(out.contains("copies land late ok"), "{out}");
}

#[test]
fn the_legacy_default_stream_is_asynchronous_as_on_a_gpu() {
    // The simulator ran every copy and memset on stream 0 in the caller, so a program that read
    // pinned memory after cudaMemcpyAsync(..., 0) without a synchronize passed here and read
    // stale bytes on a GPU. Pageable copies must still have landed (or be reusable) on return.
    for style in STYLES {
        let node = SimNode::new("1GiB").env("TMS_SIM_COPY_GBPS", "1");
        let mut argv = c_program("sim_consumer", style);
        argv.push("default-stream-async".into());
        let out = run_ok(&mut node.command(&argv));
        assert!(out.contains("default stream async ok"), "{style:?}: {out}");
    }
}

#[test]
fn work_queued_on_the_default_stream_faults_on_memory_unmapped_after_it_was_queued() {
    // Queued, the copy or memset meets the range when the stream reaches it: 700 at the next
    // synchronize and sticky, as on any other stream (run at once, it met mapped memory).
    for what in ["copy", "memset"] {
        let node = SimNode::new("256MiB");
        let mut argv = c_program("sim_consumer", Style::Linked);
        argv.extend(["default-stream-fault".into(), what.into()]);
        let out = run_ok(&mut node.command(&argv));
        assert!(out.contains("default stream fault ok"), "{what}: {out}");
    }
}

#[test]
fn unmapping_under_a_running_copy_faults_the_copy() {
    // The forgiving simulator made cuMemUnmap wait for the copy, hiding a pause that unmaps
    // before it synchronizes.
    for style in STYLES {
        let node = SimNode::new("1GiB").env("TMS_SIM_COPY_GBPS", "1");
        let mut argv = c_program("sim_consumer", style);
        argv.push("unmap-in-flight".into());
        let out = run_ok(&mut node.command(&argv));
        assert!(out.contains("unmap in flight ok"), "{style:?}: {out}");
    }
}

#[test]
fn the_cpu_cannot_touch_device_memory() {
    // A forgiving simulator let the process read device memory through its address, hiding
    // code that dereferences a device pointer (a segfault, or garbage, on a GPU).
    for what in ["plain", "vmm", "acl"] {
        let node = SimNode::new("1GiB");
        let mut argv = c_program("sim_consumer", Style::Linked);
        argv.extend(["touch-device".into(), what.into()]);
        let out = node.command(&argv).output().expect("run sim_consumer");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("copies reach it"), "{what}: {stdout} {}", String::from_utf8_lossy(&out.stderr));
        assert!(!stdout.contains("the CPU read"), "{what}: the CPU read device memory: {stdout}");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "{what}: {:?}", out.status);
    }
}

#[test]
fn contexts_and_granules_cost_device_memory_as_on_a_gpu() {
    // The forgiving simulator charged nothing for a context and 4 KiB per small allocation.
    let node = SimNode::new("1GiB");
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.extend(["accounting".into(), (CONTEXT_BYTES >> 20).to_string().into()]);
    let out = run_ok(&mut node.command(&argv));
    assert!(out.contains("accounting ok"), "{out}");
    // The context's cost is configurable.
    let node = SimNode::new("1GiB").env("TMS_SIM_CONTEXT_MEMORY", "64MiB");
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.extend(["accounting".into(), "64".into()]);
    run_ok(&mut node.command(&argv));
    // A context that does not fit is an out-of-memory error wherever it would be created.
    let node = SimNode::new("1GiB").env("TMS_SIM_CONTEXT_MEMORY", "4GiB");
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.push("context-does-not-fit".into());
    let out = run_ok(&mut node.command(&argv));
    assert!(out.contains("context does not fit ok"), "{out}");
}

/// Ascend IPC as CANN documents it ("IPC memory sharing": aclrtIpcMemGetExportKey and its
/// companions): an importer the exporter did not whitelist is refused, a whitelisted one shares
/// the bytes both ways, and once the exporter closes the key no one imports it. The refusals of
/// bad arguments, region memory and a range past the allocation are checked inside the programs.
#[test]
fn acl_ipc_shares_memory_with_whitelisted_importers_until_the_key_is_closed() {
    use std::io::Write;
    let node = SimNode::new("1GiB");
    let prog = c_program("sim_consumer", Style::Linked);
    let spawn = |args: &[&str]| {
        let mut argv = prog.clone();
        argv.extend(args.iter().map(|a| a.into()));
        node.command(&argv).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap()
    };
    let line = |r: &mut dyn BufRead| {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        l.trim().to_string()
    };
    let mut exporter = spawn(&["acl-ipc-export"]);
    let mut ex_in = exporter.stdin.take().unwrap();
    let mut ex_out = BufReader::new(exporter.stdout.take().unwrap());
    let first = line(&mut ex_out);
    let key = first.strip_prefix("KEY ").unwrap_or_else(|| panic!("no key: {first:?}")).to_string();
    // An importer: its pid, allowed by the exporter or not; the exporter closes the key first
    // when asked; then the import.
    let import = |ex_in: &mut std::process::ChildStdin, ex_out: &mut dyn BufRead, allow: bool, close: bool| {
        let mut c = spawn(&["acl-ipc-import", &key]);
        let mut out = BufReader::new(c.stdout.take().unwrap());
        let pid = line(&mut out).strip_prefix("PID ").unwrap().to_string();
        if allow {
            writeln!(ex_in, "allow {pid}").unwrap();
            assert_eq!(line(ex_out), "ALLOWED rc=0");
        }
        if close {
            writeln!(ex_in, "close").unwrap();
            assert_eq!(line(ex_out), "CLOSED rc=0");
        }
        writeln!(c.stdin.as_mut().unwrap(), "go").unwrap();
        let got = line(&mut out);
        assert!(c.wait().unwrap().success(), "importer failed: {got}");
        got
    };
    let refused = import(&mut ex_in, &mut ex_out, false, false);
    assert_eq!(refused, "IMPORT rc=107000", "a pid off the whitelist is refused");
    assert_eq!(import(&mut ex_in, &mut ex_out, true, false), "IMPORT rc=0 data_ok=1");
    writeln!(ex_in, "check 9").unwrap();
    assert_eq!(line(&mut ex_out), "CHECKED ok=1", "the importer's writes reach the exporter's memory");
    let closed = import(&mut ex_in, &mut ex_out, true, true);
    assert_eq!(closed, "IMPORT rc=107000", "a closed key imports no more");
    drop(ex_in);
    assert!(exporter.wait().unwrap().success());
}
