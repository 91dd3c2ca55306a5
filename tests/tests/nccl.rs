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

/// The consumer in `wait` mode: it answers one line per command on its standard input.
struct Waiting {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: BufReader<std::process::ChildStdout>,
}

impl Waiting {
    fn start(mut cmd: std::process::Command) -> Waiting {
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut w = Waiting { child, stdin, stdout };
        let mut ready = String::new();
        w.stdout.read_line(&mut ready).unwrap();
        assert_eq!(ready.trim(), "ready");
        w
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    fn quit(mut self) {
        writeln!(self.stdin, "quit").unwrap();
        assert!(self.child.wait().unwrap().success());
    }
}

fn waiting_argv() -> Vec<std::path::PathBuf> {
    let mut argv = consumer();
    argv.push("wait".into());
    argv
}

#[test]
fn without_the_hook_the_same_program_runs_and_pause_is_not_there() {
    // The consumer needs the hook's API for the cycle; here only that NCCL itself works
    // unhooked and hooked alike: setup and one all-reduce, then quit.
    let node = two_devices();
    let argv = waiting_argv();
    for hooked in [false, true] {
        let mut w = Waiting::start(if hooked { node.hooked(&argv) } else { node.command(&argv) });
        let line = w.ask("go");
        assert!(line.contains("all_reduce=0"), "hooked={hooked}: {line}");
        w.quit();
    }
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap()
}

/// Before any pause: two communicators, each with its suspendable and persistent bytes.
fn status_shows_two_live_communicators(node: &SimNode) {
    let status = json(&run_ok(&mut node.ctl(&["status", "trainer-rank0", "--json"])));
    let comms = status[0]["status"]["communicators"].as_array().cloned().unwrap_or_default();
    assert_eq!(comms.len(), 2, "{status}");
    for c in &comms {
        assert_eq!(c["suspendable_bytes"], 16 * MIB, "{status}");
        assert_eq!(c["persistent_bytes"], MIB, "{status}");
        assert_eq!(c["suspended"], false, "{status}");
    }
    let listed = run_ok(&mut node.ctl(&["list", "--json"]));
    assert!(listed.contains("\"suspended\": 0,\n") && listed.contains("\"count\": 2,"), "{listed}");
}

/// Two pauses of tag nccl: the first frees each device's 16 MiB, the second changes nothing.
fn pause_twice(node: &SimNode, w: &mut Waiting, free: (u64, u64)) {
    for round in 0..2 {
        let paused = json(&run_ok(&mut node.ctl(&["pause", "trainer-rank0", "--tag", "nccl", "--json"])));
        let report = &paused[0]["report"];
        if round == 0 {
            assert_eq!(report["allocations_done"], 2, "{paused}");
            assert_eq!(report["bytes_done"], 32 * MIB, "{paused}");
        } else {
            assert_eq!(report["allocations_skipped"], 2, "a second pause changes nothing: {paused}");
        }
        let now = w.ask("look");
        assert_eq!(field(&now, "free0"), free.0 + 16 * MIB, "{now}");
        assert_eq!(field(&now, "free1"), free.1 + 16 * MIB, "{now}");
        assert!(now.ends_with("all_reduce=5"), "a collective while suspended is ncclInvalidUsage: {now}");
    }
}

/// While suspended: status says so per communicator, and list adds them up per process.
fn status_and_list_show_them_suspended(node: &SimNode, pid: u32) {
    let human = run_ok(&mut node.ctl(&["status", "trainer-rank0"]));
    assert_eq!(human.matches("suspended (tag nccl)").count(), 2, "{human}");
    let listed = json(&run_ok(&mut node.ctl(&["list", "--json"])));
    let row = listed.as_array().unwrap().iter().find(|r| r["pid"] == pid).cloned().unwrap_or_default();
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
}

/// Two resumes: the first brings the buffers back and the all-reduce is correct again.
fn resume_twice(node: &SimNode, w: &mut Waiting, free: (u64, u64)) {
    for round in 0..2 {
        let resumed = json(&run_ok(&mut node.ctl(&["resume", "trainer-rank0", "--tag", "nccl", "--json"])));
        let want = if round == 0 { "allocations_done" } else { "allocations_skipped" };
        assert_eq!(resumed[0]["report"][want], 2, "{resumed}");
        let now = w.ask("look");
        assert!(now.ends_with("all_reduce=0"), "{now}");
        assert_eq!((field(&now, "free0"), field(&now, "free1")), free, "{now}");
    }
}

#[test]
fn tms_ctl_pauses_and_resumes_tag_nccl_and_status_shows_each_communicator() {
    let node = two_devices().env("TMS_CONTROL", "1").env("TMS_NAME", "trainer-rank0");
    let mut w = Waiting::start(node.hooked(&waiting_argv()));
    let pid = w.child.id();
    assert_eq!(w.ask("ready?").split_whitespace().last(), Some("all_reduce=0"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !tms_proto::list_sockets(&node.control_dir()).iter().any(|s| s.pid == pid) {
        assert!(Instant::now() < deadline, "no control socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = w.ask("look");
    let free = (field(&before, "free0"), field(&before, "free1"));
    status_shows_two_live_communicators(&node);
    pause_twice(&node, &mut w, free);
    status_and_list_show_them_suspended(&node, pid);
    resume_twice(&node, &mut w, free);

    // Destroyed while suspended: everything comes back and status forgets them.
    run_ok(&mut node.ctl(&["pause", "trainer-rank0", "--tag", "nccl"]));
    let destroyed = w.ask("destroy");
    assert!(destroyed.starts_with("destroyed=0,0"), "{destroyed}");
    assert_eq!(field(&destroyed, "free0"), free.0 + 17 * MIB, "{destroyed}");
    assert_eq!(field(&destroyed, "free1"), free.1 + 17 * MIB, "{destroyed}");
    let status = run_ok(&mut node.ctl(&["status", "trainer-rank0", "--json"]));
    assert!(!status.contains("communicators"), "{status}");
    let table = run_ok(&mut node.ctl(&["list"]));
    assert!(!table.contains("communicator"), "{table}");
    let resumed = run_ok(&mut node.ctl(&["resume", "trainer-rank0", "--tag", "nccl", "--json"]));
    assert!(resumed.contains("\"allocations_done\": 0"), "{resumed}");
    w.quit();
}
