//! The reserved tag `nccl`: a hooked process's NCCL communicators (the simulator's NCCL, two
//! devices, one process) suspended and resumed through the hook's API and through tms-ctl.

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tms_e2e::*;

fn consumer() -> Vec<std::path::PathBuf> {
    let ws = workspace();
    let linked = [
        format!("-L{}", ws.stub_dir.display()),
        "-l:libnccl.so.2".to_string(),
        "-l:libcudart.so.12".to_string(),
        "-ldl".to_string(),
    ];
    let extra: Vec<&str> = linked.iter().map(String::as_str).collect();
    vec![compile("nccl_consumer", &[ws.c_src("nccl_consumer.c")], &extra)]
}

fn two_devices() -> SimNode {
    SimNode::new("1GiB").with_devices(2)
}

#[test]
fn pausing_tag_nccl_suspends_communicators_on_each_device_and_resume_brings_them_back() {
    let node = two_devices();
    let mut argv = consumer();
    argv.push("cycle".into());
    let out = run_ok(&mut node.hooked(&argv));
    assert!(out.contains("nccl cycle ok"), "{out}");
    // NCCL_BUFFSIZE (4 MiB) x 2 channels x send+receive x 1 peer per device, as the simulator charges.
    assert!(out.contains(&format!("suspendable={},{}", 16 * MIB, 16 * MIB)), "{out}");
    assert!(out.contains("while_paused=5"), "{out}");
    assert!(out.contains("ncclCommResume"), "the collective's error names the way out: {out}");
}

#[test]
fn without_the_hook_the_same_program_runs_and_pause_is_not_there() {
    // The consumer needs the hook's API for the cycle; here only that NCCL itself works
    // unhooked and hooked alike: setup and one all-reduce, then quit.
    let node = two_devices();
    let mut argv = consumer();
    argv.push("wait".into());
    for hooked in [false, true] {
        let mut cmd = if hooked { node.hooked(&argv) } else { node.command(&argv) };
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "hooked={hooked}");
        writeln!(stdin, "go").unwrap();
        line.clear();
        stdout.read_line(&mut line).unwrap();
        assert!(line.contains("all_reduce=0"), "hooked={hooked}: {line}");
        writeln!(stdin, "quit").unwrap();
        assert!(child.wait().unwrap().success());
    }
}

#[test]
fn tms_ctl_pauses_and_resumes_tag_nccl_and_status_shows_each_communicator() {
    let node = two_devices().env("TMS_CONTROL", "1").env("TMS_NAME", "trainer-rank0");
    let mut argv = consumer();
    argv.push("wait".into());
    let mut child = node.hooked(&argv).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut ready = String::new();
    stdout.read_line(&mut ready).unwrap();
    assert_eq!(ready.trim(), "ready");
    let mut ask = |cmd: &str| {
        writeln!(stdin, "{cmd}").unwrap();
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    };
    assert_eq!(ask("ready?").split_whitespace().last(), Some("all_reduce=0"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !tms_proto::list_sockets(&node.control_dir()).iter().any(|s| s.pid == child.id()) {
        assert!(Instant::now() < deadline, "no control socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = ask("look");
    let (free0, free1) = (field(&before, "free0"), field(&before, "free1"));

    let status = run_ok(&mut node.ctl(&["status", "trainer-rank0", "--json"]));
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let comms = status[0]["status"]["communicators"].as_array().cloned().unwrap_or_default();
    assert_eq!(comms.len(), 2, "{status}");
    for c in &comms {
        assert_eq!(c["suspendable_bytes"], 16 * MIB, "{status}");
        assert_eq!(c["persistent_bytes"], MIB, "{status}");
        assert_eq!(c["suspended"], false, "{status}");
    }

    let listed = run_ok(&mut node.ctl(&["list", "--json"]));
    assert!(listed.contains("\"suspended\": 0,\n") && listed.contains("\"count\": 2,"), "{listed}");

    for round in 0..2 {
        let paused = run_ok(&mut node.ctl(&["pause", "trainer-rank0", "--tag", "nccl", "--json"]));
        let paused: serde_json::Value = serde_json::from_str(&paused).unwrap();
        let report = &paused[0]["report"];
        if round == 0 {
            assert_eq!(report["allocations_done"], 2, "{paused}");
            assert_eq!(report["bytes_done"], 32 * MIB, "{paused}");
        } else {
            assert_eq!(report["allocations_skipped"], 2, "a second pause changes nothing: {paused}");
        }
        let now = ask("look");
        assert_eq!(field(&now, "free0"), free0 + 16 * MIB, "{now}");
        assert_eq!(field(&now, "free1"), free1 + 16 * MIB, "{now}");
        assert!(now.ends_with("all_reduce=5"), "a collective while suspended is ncclInvalidUsage: {now}");
    }
    let human = run_ok(&mut node.ctl(&["status", "trainer-rank0"]));
    assert_eq!(human.matches("suspended (tag nccl)").count(), 2, "{human}");
    // list adds them up per process, in JSON and in its table.
    let listed = run_ok(&mut node.ctl(&["list", "--json"]));
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let row = listed.as_array().unwrap().iter().find(|r| r["pid"] == child.id()).cloned().unwrap_or_default();
    assert_eq!(
        row["communicators"],
        serde_json::json!([{
            "library": "nccl", "count": 2, "suspendable_bytes": 32 * MIB, "persistent_bytes": 2 * MIB,
            "suspended": 2, "suspended_bytes": 32 * MIB
        }]),
        "{listed}"
    );
    let table = run_ok(&mut node.ctl(&["list"]));
    assert!(
        table.contains("2 nccl communicator(s): suspendable 32.0 MiB, suspended 2 (32.0 MiB), persistent 2.0 MiB"),
        "{table}"
    );

    for round in 0..2 {
        let resumed = run_ok(&mut node.ctl(&["resume", "trainer-rank0", "--tag", "nccl", "--json"]));
        let resumed: serde_json::Value = serde_json::from_str(&resumed).unwrap();
        let want = if round == 0 { "allocations_done" } else { "allocations_skipped" };
        assert_eq!(resumed[0]["report"][want], 2, "{resumed}");
        // The look runs an all-reduce, correct again, and the buffers are back on each device.
        let now = ask("look");
        assert!(now.ends_with("all_reduce=0"), "{now}");
        assert_eq!((field(&now, "free0"), field(&now, "free1")), (free0, free1), "{now}");
    }

    // Destroyed while suspended: everything comes back and status forgets them.
    run_ok(&mut node.ctl(&["pause", "trainer-rank0", "--tag", "nccl"]));
    let destroyed = ask("destroy");
    assert!(destroyed.starts_with("destroyed=0,0"), "{destroyed}");
    assert_eq!(field(&destroyed, "free0"), free0 + 17 * MIB, "{destroyed}");
    assert_eq!(field(&destroyed, "free1"), free1 + 17 * MIB, "{destroyed}");
    let status = run_ok(&mut node.ctl(&["status", "trainer-rank0", "--json"]));
    assert!(!status.contains("communicators"), "{status}");
    let table = run_ok(&mut node.ctl(&["list"]));
    assert!(!table.contains("communicator"), "{table}");
    let resumed = run_ok(&mut node.ctl(&["resume", "trainer-rank0", "--tag", "nccl", "--json"]));
    assert!(resumed.contains("\"allocations_done\": 0"), "{resumed}");

    writeln!(stdin, "quit").unwrap();
    assert!(child.wait().unwrap().success());
}
