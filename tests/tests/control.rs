//! The control plane end to end: tms-ctl and raw clients against hooked processes on tms-sim.

use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use tms_e2e::*;

fn json(mut cmd: Command) -> (i32, serde_json::Value) {
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {text}\nstderr: {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code().unwrap_or(-1), v)
}

fn socket_of(node: &SimNode, pid: u32) -> PathBuf {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(e) = tms_proto::list_sockets(&node.control_dir()).into_iter().find(|s| s.pid == pid) {
            return e.path;
        }
        assert!(Instant::now() < deadline, "no control socket for pid {pid}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn external_pause_frees_memory_another_process_uses_and_resume_restores_it() {
    let node = SimNode::new("1GiB");
    let mut trainer = Served::start_with(&node, "cuda", &[("TMS_NAME", "trainer-rank0")]);
    assert_eq!(trainer.ask("alloc 600"), "rc=0");
    assert_eq!(trainer.ask("fill"), "rc=0");
    socket_of(&node, trainer.pid());

    let (code, list) = json(node.ctl(&["list", "--json"]));
    assert_eq!(code, 0);
    let row = &list[0];
    assert_eq!(row["pid"], trainer.pid());
    assert_eq!(row["status"]["name"], "trainer-rank0");
    assert_eq!(row["status"]["tags"][0]["tag"], "train");
    assert_eq!(row["status"]["tags"][0]["bytes_active"], 600 * MIB);
    let human = run_ok(&mut node.ctl(&["list"]));
    assert!(human.contains("trainer-rank0") && human.contains("600.0 MiB"), "{human}");
    // A reader that is already gone (`tms-ctl list | head -1`): tms-ctl ends on SIGPIPE like
    // other tools; it used to panic on the broken pipe (exit 101).
    let mut fds = [0; 2];
    // SAFETY: a fresh pipe whose read end is closed at once; the write end goes to the child.
    let gone_reader = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        libc::close(fds[0]);
        std::os::fd::OwnedFd::from_raw_fd(fds[1])
    };
    let out = node.ctl(&["list"]).stdout(std::process::Stdio::from(gone_reader)).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked") && out.status.code() != Some(101), "{:?}: {err}", out.status);

    let mut rollout = Served::start(&node, "acl");
    assert_eq!(rollout.ask("alloc 600"), "rc=207001");
    let (code, paused) = json(node.ctl(&["pause", "trainer-rank0", "--json"]));
    assert_eq!(code, 0, "{paused}");
    assert_eq!(paused[0]["report"]["bytes_done"], 600 * MIB);
    assert_eq!(
        paused[0]["report"]["device_free_after"].as_u64().unwrap()
            - paused[0]["report"]["device_free_before"].as_u64().unwrap(),
        600 * MIB
    );
    assert_eq!(rollout.ask("alloc 600"), "rc=0");

    // While the rollout holds the memory, resume fails with out_of_memory and loses nothing.
    let (code, refused) = json(node.ctl(&["resume", "--all", "--json"]));
    assert_eq!(code, 1, "{refused}");
    let trainer_row = refused.as_array().unwrap().iter().find(|r| r["pid"] == trainer.pid()).unwrap();
    assert!(trainer_row["error"].as_str().unwrap().starts_with("out_of_memory"), "{trainer_row}");
    assert_eq!(trainer_row["report"]["allocations_done"], 0);

    assert_eq!(rollout.ask("free"), "rc=0");
    let pid = trainer.pid().to_string();
    let resumed = run_ok(&mut node.ctl(&["resume", &pid]));
    assert!(resumed.contains("resumed 1 allocations, 600.0 MiB"), "{resumed}");
    // The change itself, which rounding each side to a tenth of a GiB can hide on a large device.
    assert!(resumed.contains("(-600.0 MiB)"), "{resumed}");
    assert_eq!(trainer.ask("verify"), "rc=0");
    // Its pinned buffer stays pooled for the next pause, and the host memory it holds is shown.
    let (code, status) = json(node.ctl(&["status", &pid, "--json"]));
    assert_eq!(code, 0);
    assert_eq!(status[0]["status"]["pooled_backup_bytes"], 600 * MIB, "{status}");
    let human = run_ok(&mut node.ctl(&["status", &pid]));
    assert!(
        human.contains("pinned buffers pooled 600.0 MiB (kept by resumed allocations for their next pause"),
        "{human}"
    );
    trainer.quit();
    rollout.quit();
}

#[test]
fn status_shows_what_the_last_pause_copied_and_skipped_adding_fields_only() {
    let node = SimNode::new("1GiB");
    let mut trainer = Served::start(&node, "cuda");
    assert_eq!(trainer.ask("alloc 64"), "rc=0");
    assert_eq!(trainer.ask("fill"), "rc=0");
    let pid = trainer.pid().to_string();
    socket_of(&node, trainer.pid());
    let (_, before) = json(node.ctl(&["status", &pid, "--json"]));
    // Every field a status had before this one is still there, unchanged in kind.
    let st = &before[0]["status"];
    let old = ["pid", "name", "hook_version", "protocol", "devices", "tags", "margin_bytes", "retain_backup"];
    for key in old.into_iter().chain(["default_backup", "pooled_backup_bytes"]) {
        assert!(st.get(key).is_some(), "{key} missing: {st}");
    }
    assert!(st.get("last_pause").is_none(), "no pause yet: {st}");

    assert_eq!(trainer.ask("dead 16"), "rc=0");
    assert!(trainer.ask("pause").starts_with("rc=0 done=67108864"));
    let (code, status) = json(node.ctl(&["status", &pid, "--json"]));
    assert_eq!(code, 0);
    let last = &status[0]["status"]["last_pause"];
    assert_eq!(
        (last["backup_bytes"].as_u64(), last["backup_bytes_skipped"].as_u64()),
        (Some(48 * MIB), Some(16 * MIB))
    );
    assert_eq!(last["bytes_done"], 64 * MIB, "{last}");
    let human = run_ok(&mut node.ctl(&["status", &pid]));
    assert!(human.contains("last pause (every tag): paused 1 allocations, 64.0 MiB"), "{human}");
    assert!(human.contains("backup copied 48.0 MiB, skipped 16.0 MiB (marked dead)"), "{human}");

    // The resume restores what the pause copied; from outside, with no marks, the whole
    // allocation is copied, as before.
    let resumed = run_ok(&mut node.ctl(&["resume", &pid]));
    assert!(resumed.contains("backup copied 48.0 MiB, skipped 16.0 MiB (marked dead)"), "{resumed}");
    let (code, paused) = json(node.ctl(&["pause", &pid, "--json"]));
    assert_eq!(code, 0, "{paused}");
    let report = &paused[0]["report"];
    assert_eq!((report["backup_bytes"].as_u64(), report["backup_bytes_skipped"].as_u64()), (Some(64 * MIB), Some(0)));
    let resumed = run_ok(&mut node.ctl(&["resume", &pid]));
    assert!(resumed.contains("backup copied 64.0 MiB, skipped 0 B (marked dead)"), "{resumed}");
    trainer.quit();
}

#[test]
fn unknown_targets_and_bad_usage_exit_2() {
    let node = SimNode::new("1GiB");
    for args in [vec!["pause", "nobody"], vec!["pause"], vec!["resume", "12345678"], vec!["set", "--all"]] {
        let out = node.ctl(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(!out.stderr.is_empty());
    }
    for timeout in ["1e20", "0", "nan"] {
        let out = node.ctl(&["--timeout", timeout, "list"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--timeout {timeout}: {err}");
        assert!(!err.contains("panicked"), "--timeout {timeout}: {err}");
    }
    let help = run_ok(&mut node.ctl(&["--help"]));
    assert!(help.contains("Exit codes") && help.contains("TARGET"), "{help}");
    let completions = run_ok(&mut node.ctl(&["completions", "bash"]));
    assert!(completions.contains("tms-ctl"));
}

#[test]
fn a_managed_process_refuses_an_outside_pause_naming_its_manager_unless_forced() {
    let node = SimNode::new("1GiB");
    let manager = "my-launcher (pid 4242)";
    let mut worker = Served::start_with(&node, "cuda", &[("TMS_MANAGED_BY", manager)]);
    assert_eq!(worker.ask("alloc 8"), "rc=0");
    assert_eq!(worker.ask("fill"), "rc=0");
    let pid = worker.pid().to_string();
    socket_of(&node, worker.pid());
    for verb in ["pause", "resume"] {
        let refused = node.ctl(&[verb, &pid]).output().unwrap();
        let said = format!("{}{}", String::from_utf8_lossy(&refused.stdout), String::from_utf8_lossy(&refused.stderr));
        assert_eq!(refused.status.code(), Some(1), "{verb}: {said}");
        assert!(said.contains(&format!("managed by {manager}")) && said.contains("--force"), "{verb}: {said}");
    }
    let (code, status) = json(node.ctl(&["status", &pid, "--json"]));
    assert_eq!(code, 0);
    assert_eq!(status[0]["status"]["managed_by"], manager, "{status}");
    assert_eq!(status[0]["status"]["tags"][0]["bytes_paused"], 0, "a refused pause paused something: {status}");
    let shown = run_ok(&mut node.ctl(&["status", &pid]));
    assert!(shown.contains(&format!("managed by {manager} (pause and resume from here need --force)")), "{shown}");
    let forced = run_ok(&mut node.ctl(&["pause", "--force", &pid]));
    assert!(forced.contains("paused 1 allocations, 8.0 MiB"), "{forced}");
    run_ok(&mut node.ctl(&["resume", "--force", &pid]));
    assert_eq!(worker.ask("verify"), "rc=0");
    worker.quit();
}

#[test]
fn a_plain_list_with_nothing_in_its_folder_names_a_runs_folder_that_has_processes() {
    // A run's private folder, as relax-colocate makes them (<tmp>/relax-*/ctl).
    let run = tempfile::Builder::new().prefix("relax-tmsctl-test-").tempdir_in(std::env::temp_dir()).unwrap();
    let ctl = run.path().join("ctl");
    std::fs::create_dir(&ctl).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ctl, std::fs::Permissions::from_mode(0o700)).unwrap();
    let node = SimNode::new("1GiB");
    let mut worker = Served::start_with(&node, "cuda", &[("TMS_CONTROL_DIR", ctl.to_str().unwrap())]);
    assert_eq!(worker.ask("alloc 8"), "rc=0");
    let empty = node.dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::set_permissions(&empty, std::fs::Permissions::from_mode(0o700)).unwrap();
    let listed = run_ok(node.ctl(&["list"]).env("TMS_CONTROL_DIR", &empty));
    assert!(listed.contains("no hooked processes"), "{listed}");
    assert!(listed.contains(&format!("serve in {}", ctl.display())) && listed.contains(" list"), "{listed}");
    // Named with --dir, the folder is what was asked for: no hint about others.
    let named = run_ok(&mut node.ctl(&["--dir", empty.to_str().unwrap(), "list"]));
    assert!(!named.contains("serve in"), "{named}");
    worker.quit();
}

#[test]
fn a_socket_folder_named_with_dir_that_is_not_there_exits_2_naming_it() {
    let node = SimNode::new("1GiB");
    let missing = node.dir.path().join("no-such-folder");
    for args in [vec!["list"], vec!["status"], vec!["pause", "--all"]] {
        let out = node.ctl(&[&["--dir", missing.to_str().unwrap()][..], &args].concat()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("no-such-folder") && err.contains("does not exist"), "{args:?}: {err}");
    }
    // The default folder (here TMS_CONTROL_DIR) appears with the first hooked process: before
    // that there is simply nothing to list.
    let out = node.ctl(&["list"]).env("TMS_CONTROL_DIR", &missing).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Operations never report success for nothing: a tag no process carries, the empty tag and a
/// margin larger than the device are refused with what would work; a process without the tag
/// beside one with it is skipped, not failed.
#[test]
fn a_tag_nothing_carries_an_empty_tag_and_an_impossible_margin_are_refused() {
    let node = SimNode::new("1GiB");
    let mut trainer = Served::start(&node, "cuda");
    assert_eq!(trainer.ask("alloc 8"), "rc=0");
    assert_eq!(trainer.ask("fill"), "rc=0");
    let mut idle = Served::start_with(&node, "cuda", &[("TMS_CONTROL", "1")]);
    assert_eq!(idle.ask("plain 2"), "rc=0");
    socket_of(&node, idle.pid());
    socket_of(&node, trainer.pid());
    let trainer_pid = trainer.pid().to_string();

    let out = node.ctl(&["pause", "--tag", "nosuchtag", &trainer_pid]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("no process asked has an allocation tagged \"nosuchtag\""), "{err}");
    let out = node.ctl(&["pause", "--tag", "", &trainer_pid]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("leave --tag out"));
    assert_eq!(trainer.ask("verify"), "rc=0", "a refused pause touched memory");

    // `--all --tag train` reaches the idle process too: skipped there, paused in the trainer.
    let (code, rows) = json(node.ctl(&["--json", "pause", "--tag", "train", "--all"]));
    assert_eq!(code, 0, "{rows}");
    let rows = rows.as_array().unwrap().clone();
    let idle_row = rows.iter().find(|r| r["pid"] == idle.pid()).expect("the idle process was asked");
    assert!(idle_row["skipped"].as_str().unwrap().contains("no allocation carries tag \"train\""), "{idle_row}");
    let trainer_row = rows.iter().find(|r| r["pid"] == trainer.pid()).unwrap();
    assert_eq!(trainer_row["report"]["allocations_done"], 1, "{trainer_row}");
    assert!(trainer.ask("resume").starts_with("rc=0"));
    assert_eq!(trainer.ask("verify"), "rc=0");

    let out = node.ctl(&["set", "--margin", "99TiB", &trainer_pid]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("more than this process's largest device holds"), "{text}");
    assert!(run_ok(&mut node.ctl(&["set", "--margin", "512MiB", &trainer_pid])).contains("ok"));
    trainer.quit();
    idle.quit();
}

#[test]
fn garbage_on_the_socket_changes_nothing_but_an_error_reply() {
    let node = SimNode::new("1GiB");
    let mut app = Served::start(&node, "cuda");
    assert_eq!(app.ask("alloc 64"), "rc=0");
    assert_eq!(app.ask("fill"), "rc=0");
    let sock = socket_of(&node, app.pid());
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let templates: &[&[u8]] = &[
        b"{\"op\":\"pause\",\"tag\":5}\n",
        b"{\"op\":\"explode\"}\n",
        b"{\"v\":99,\"op\":\"ping\"}\n",
        b"[1,2,3]\n",
        b"{\"op\":\"set\",\"margin_bytes\":-4}\n",
        b"{\"op\":\"status\",\"extra\":1}\n",
        b"{\"op\":\"resume\"",
        b"\n",
        b"null\n",
    ];
    let mut replies = 0;
    for i in 0..10_000u64 {
        let mut msg: Vec<u8> = match i % 4 {
            0 => templates[(rand() % templates.len() as u64) as usize].to_vec(),
            1 => (0..(rand() % 200)).map(|_| (rand() & 0xff) as u8).chain([b'\n']).collect(),
            2 => {
                let mut m = templates[(rand() % templates.len() as u64) as usize].to_vec();
                let cut = (rand() as usize) % m.len().max(1);
                m.truncate(cut);
                m
            }
            _ => {
                let mut m = b"{\"op\":\"ping\"".to_vec();
                let k = (rand() % 8) as usize;
                m.insert(k.min(m.len()), (rand() & 0xff) as u8);
                m.push(b'\n');
                m
            }
        };
        if i % 2500 == 0 {
            msg = vec![b'x'; 70 * 1024]; // over the 64 KiB limit
        }
        let mut s = UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(&msg);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        if !reply.is_empty() {
            let v: serde_json::Value = serde_json::from_str(reply.trim()).unwrap_or_else(|e| panic!("{e}: {reply}"));
            if v["ok"] == false {
                assert!(v["error"]["code"].is_string(), "{reply}");
            }
            replies += 1;
        }
    }
    assert!(replies > 9_000, "only {replies} replies");
    // Still alive, still answering, memory untouched.
    let ping = tms_proto::call(&sock, &tms_proto::Request::Ping, Duration::from_secs(5)).unwrap();
    assert_eq!(ping["pong"], true);
    let st = tms_proto::status(&sock, Duration::from_secs(5)).unwrap();
    assert_eq!(st.tags[0].allocations_active, 1);
    assert_eq!(app.ask("verify"), "rc=0");
    app.quit();
}

#[test]
fn a_silent_client_does_not_block_others() {
    let node = SimNode::new("1GiB");
    let mut app = Served::start(&node, "cuda");
    assert_eq!(app.ask("alloc 8"), "rc=0");
    let sock = socket_of(&node, app.pid());
    let _silent: Vec<UnixStream> = (0..4).map(|_| UnixStream::connect(&sock).unwrap()).collect();
    let start = Instant::now();
    tms_proto::call(&sock, &tms_proto::Request::Ping, Duration::from_secs(5)).unwrap();
    assert!(start.elapsed() < Duration::from_secs(2), "ping waited {:?}", start.elapsed());
    // A silent client is answered with a timeout error and closed.
    let mut s = UnixStream::connect(&sock).unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.contains("\"timeout\""), "{reply}");
    app.quit();
}

#[test]
fn stale_sockets_of_dead_processes_are_reaped() {
    let node = SimNode::new("1GiB");
    let dir = node.control_dir();
    std::fs::create_dir_all(&dir).unwrap();
    // As the hook makes it: private.
    std::fs::set_permissions(&dir, <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o700))
        .unwrap();
    let stale = dir.join(tms_proto::socket_name(4_000_000, 1));
    let _l = std::os::unix::net::UnixListener::bind(&stale).unwrap();
    let orphan = tms_proto::name_file(&dir.join(tms_proto::socket_name(4_000_001, 1)));
    std::fs::write(&orphan, "gone").unwrap();
    let out = node.ctl(&["list"]).output().unwrap();
    assert!(!stale.exists(), "stale socket still there");
    assert!(!orphan.exists(), "the name file of a process without socket or life is still there");
    assert!(String::from_utf8_lossy(&out.stderr).contains("removed stale socket"));
    let watch = run_ok(&mut node.ctl(&["watch", "--count", "2", "--interval", "0.05"]));
    assert_eq!(watch.matches("tms-ctl watch: 0 process(es)").count(), 2, "{watch}");
    // With nothing to show, status says so (it used to print nothing at all).
    let status = run_ok(&mut node.ctl(&["status"]));
    assert!(status.starts_with("no hooked processes"), "{status:?}");
}

#[test]
fn socket_is_private_and_removed_at_exit() {
    use std::os::unix::fs::PermissionsExt;
    let node = SimNode::new("1GiB");
    let mut app = Served::start(&node, "cuda");
    assert_eq!(app.ask("alloc 8"), "rc=0");
    let sock = socket_of(&node, app.pid());
    assert_eq!(std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::metadata(node.control_dir()).unwrap().permissions().mode() & 0o777, 0o700);
    app.quit();
    assert!(!sock.exists(), "socket left behind after exit");
}

#[test]
fn other_users_are_refused() {
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } != 0 {
        eprintln!("skipped: switching uid needs root (the check itself is unit-tested in tms-hook)");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let node = SimNode::new("1GiB");
    let mut app = Served::start(&node, "cuda");
    assert_eq!(app.ask("alloc 8"), "rc=0");
    let sock = socket_of(&node, app.pid());
    // Open the way on purpose so that only the peer-credential check stands.
    for p in [node.dir.path().to_path_buf(), node.control_dir()] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o711)).unwrap();
    }
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = node.ctl(&["--json", "ping", sock.to_str().unwrap()]).uid(65534).gid(65534).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("forbidden"), "{}", String::from_utf8_lossy(&out.stdout));
    app.quit();
}

#[test]
fn cli_pauses_and_resumes_while_the_process_allocates() {
    let node = SimNode::new("1GiB");
    let mut argv = c_program("hook_consumer", Style::Linked);
    argv.extend(["churn".into(), "cuda".into(), "4".into()]);
    let child = node.hooked(&argv).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let sock = socket_of(&node, child.id());
    let target = sock.to_str().unwrap().to_string();
    // The socket opens at the first region allocation; a tag the process has not allocated with
    // yet is unknown (exit 2), so wait until both exist before churning.
    let ready = Instant::now();
    for tag in ["volatile", "stable"] {
        while !node.ctl(&["pause", "--tag", tag, &target]).output().unwrap().status.success() {
            assert!(ready.elapsed() < Duration::from_secs(20), "tag {tag} never appeared");
            std::thread::sleep(Duration::from_millis(20));
        }
        run_ok(&mut node.ctl(&["resume", "--tag", tag, &target]));
    }
    let mut cycles = 0;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        for tag in ["volatile", "stable"] {
            run_ok(&mut node.ctl(&["pause", "--tag", tag, &target]));
            run_ok(&mut node.ctl(&["resume", "--tag", tag, &target]));
        }
        cycles += 1;
    }
    let out = child.wait_with_output().unwrap();
    assert_ok(&out, "churn");
    assert!(String::from_utf8_lossy(&out.stdout).contains("churn ok"));
    assert!(cycles > 3, "only {cycles} cycles");
}

#[test]
fn control_can_be_disabled_or_started_early() {
    let node = SimNode::new("1GiB").env("TMS_CONTROL", "0");
    let mut app = Served::start(&node, "cuda");
    assert_eq!(app.ask("alloc 8"), "rc=0");
    std::thread::sleep(Duration::from_millis(200));
    assert!(tms_proto::list_sockets(&node.control_dir()).is_empty());
    app.quit();

    // With TMS_CONTROL=1 an allocation outside any region is enough.
    let node = SimNode::new("1GiB").env("TMS_CONTROL", "1");
    let mut app = Served::start(&node, "cuda");
    assert_eq!(app.ask("plain 1"), "rc=0");
    socket_of(&node, app.pid());
    app.quit();
}

#[test]
fn control_requests_create_no_context_on_a_device_the_process_does_not_use() {
    // A process on device 1 of two: status, pause and resume from outside, with and without
    // tracked memory, must not make a context on device 0 (on a GPU that costs hundreds of MiB
    // of memory another job may be using).
    let mut node = SimNode::new("256MiB");
    node.devices = 2;
    let mut app = Served::start_with(&node, "cuda", &[("TMS_TEST_DEVICE", "1"), ("TMS_CONTROL", "1")]);
    assert_eq!(app.ask("plain 4"), "rc=0");
    assert_eq!(app.ask("ctx 0"), "rc=0 active=0");
    assert_eq!(app.ask("ctx 1"), "rc=0 active=1");
    // Tracked memory that is freed again: the driver is loaded, nothing is tracked.
    assert_eq!(app.ask("alloc 2"), "rc=0");
    assert_eq!(app.ask("free"), "rc=0");
    socket_of(&node, app.pid());
    let pid = app.pid().to_string();
    for args in [["status", pid.as_str()], ["pause", pid.as_str()], ["resume", pid.as_str()]] {
        let (code, out) = json(node.ctl(&[args[0], args[1], "--json"]));
        assert_eq!(code, 0, "{args:?}: {out}");
    }
    assert_eq!(app.ask("ctx 0"), "rc=0 active=0", "untracked process");
    assert_eq!(app.ask("alloc 8"), "rc=0");
    assert_eq!(app.ask("fill"), "rc=0");
    let (code, status) = json(node.ctl(&["status", &pid, "--json"]));
    assert_eq!(code, 0);
    let devices = status[0]["status"]["devices"].as_array().cloned().unwrap_or_default();
    assert!(devices.iter().all(|d| d["device"] == 1), "{status}");
    for args in [["pause", pid.as_str()], ["resume", pid.as_str()], ["status", pid.as_str()]] {
        let (code, out) = json(node.ctl(&[args[0], args[1], "--json"]));
        assert_eq!(code, 0, "{args:?}: {out}");
    }
    assert_eq!(app.ask("verify"), "rc=0");
    assert_eq!(app.ask("ctx 0"), "rc=0 active=0", "tracked process");
    app.quit();
}

#[test]
fn names_with_control_characters_cannot_forge_rows() {
    // TMS_NAME is whatever the launcher set; printed raw, a newline made a second, forged row.
    let node = SimNode::new("1GiB");
    let mut app = Served::start_with(&node, "cuda", &[("TMS_NAME", "evil\n99999    forged\u{1b}[2J")]);
    assert_eq!(app.ask("alloc 8"), "rc=0");
    socket_of(&node, app.pid());
    for args in [&["list"][..], &["status"][..]] {
        let out = run_ok(&mut node.ctl(args));
        assert!(!out.lines().any(|l| l.starts_with("99999")), "{args:?}: {out}");
        assert!(!out.contains('\u{1b}'), "{args:?}: {out}");
        assert!(out.contains("evil\\n99999"), "{args:?}: {out}");
    }
    // --json carries the name as it is, escaped by JSON.
    let (_, list) = json(node.ctl(&["list", "--json"]));
    assert_eq!(list[0]["status"]["name"], "evil\n99999    forged\u{1b}[2J");
    app.quit();
}

#[test]
fn the_socket_of_a_zombie_is_stale_not_a_failure() {
    // A killed process not yet reaped by its parent kept `list` and `pause --all` at exit 1,
    // although every live process answered.
    let node = SimNode::new("1GiB");
    let mut live = Served::start_with(&node, "cuda", &[("TMS_NAME", "live")]);
    assert_eq!(live.ask("alloc 8"), "rc=0");
    socket_of(&node, live.pid());
    let mut doomed = Served::start_with(&node, "cuda", &[("TMS_NAME", "doomed")]);
    assert_eq!(doomed.ask("alloc 8"), "rc=0");
    let zombie = doomed.pid();
    socket_of(&node, zombie);
    // SAFETY: signalling our own child; it stays a zombie until this test reaps it.
    unsafe { libc::kill(zombie as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !tms_proto::process_exited(zombie) {
        assert!(Instant::now() < deadline, "the child did not die");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = node.ctl(&["list"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text} {}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("live") && !text.contains("doomed"), "{text}");
    let out = node.ctl(&["pause", "--all"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(node.ctl(&["resume", "--all"]).status().unwrap().success());
    live.quit();
}

/// CPU time (user + system, clock ticks) a process has used so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

fn timed(mut cmd: Command) -> (Duration, i32, String, String) {
    let start = Instant::now();
    let out = cmd.output().unwrap();
    (
        start.elapsed(),
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn stopped_processes_delay_no_one_and_are_reported_as_not_responding() {
    // Processes used to be asked one after the other: each stopped one added the whole timeout to
    // list, pause --all and even `pause OTHERNAME`, and all it said was "Resource temporarily
    // unavailable".
    let node = SimNode::new("1GiB");
    let mut live = Served::start_with(&node, "cuda", &[("TMS_NAME", "live")]);
    assert_eq!(live.ask("alloc 8"), "rc=0");
    socket_of(&node, live.pid());
    let mut frozen = Vec::new();
    for name in ["frozen-a", "frozen-b"] {
        let mut f = Served::start_with(&node, "cuda", &[("TMS_NAME", name)]);
        assert_eq!(f.ask("alloc 8"), "rc=0");
        socket_of(&node, f.pid());
        frozen.push(f);
    }
    for f in &frozen {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(f.pid() as i32, libc::SIGSTOP) };
    }
    let (took, code, out, err) = timed(node.ctl(&["--timeout", "3", "list"]));
    assert_eq!(code, 1, "{out}{err}");
    assert!(took < Duration::from_millis(5000), "list took {took:?}");
    assert!(out.contains("live"), "{out}");
    assert_eq!(out.matches("not responding within 3s").count(), 2, "{out}");
    assert!(out.contains("stopped") && out.contains("kill -CONT"), "{out}");

    for args in [&["status"][..], &["watch", "--count", "1"][..]] {
        let mut cmd = node.ctl(&["--timeout", "3"]);
        cmd.args(args);
        let (took, code, out, err) = timed(cmd);
        assert!(took < Duration::from_millis(5000), "{args:?} took {took:?}");
        assert_eq!(out.matches("not responding within 3s").count(), 2, "{args:?}: {out}{err}");
        // watch --count used to exit 0 with processes that never answered.
        assert_eq!(code, 1, "{args:?}: {out}{err}");
    }
    let (took, code, out, err) = timed(node.ctl(&["--timeout", "3", "pause", "--all"]));
    assert_eq!(code, 1, "{out}{err}");
    assert!(took < Duration::from_millis(5000), "pause --all took {took:?}");
    // Each line names the process as well as its pid.
    let line = out.lines().find(|l| l.starts_with(&format!("pid {} (live):", live.pid()))).unwrap_or_default();
    assert!(line.contains("paused 1 allocations"), "{out}");

    // Picking a process by name waits for no one else: names are read from the socket folder.
    let (took, code, out, err) = timed(node.ctl(&["--timeout", "3", "resume", "live"]));
    assert_eq!(code, 0, "{out}{err}");
    assert!(took < Duration::from_millis(2500), "resume live took {took:?}");
    assert!(out.contains("resumed 1 allocations"), "{out}");
    let (_, code, out, err) = timed(node.ctl(&["--timeout", "3", "ping", "live"]));
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(out.trim(), format!("pid {} (live): ok", live.pid()), "{out}");
    let (code, rows) = json(node.ctl(&["--timeout", "3", "--json", "pause", "live"]));
    assert_eq!(code, 0, "{rows}");
    assert_eq!(rows[0]["name"], "live", "{rows}");
    let (code, rows) = json(node.ctl(&["--timeout", "3", "--json", "resume", "live"]));
    assert_eq!((code, rows[0]["report"]["allocations_done"].as_u64()), (0, Some(1)), "{rows}");

    for f in &mut frozen {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(f.pid() as i32, libc::SIGCONT) };
        assert_eq!(f.ask("info").split(' ').next(), Some("rc=0"));
    }
    // What the stopped processes were sent while tms-ctl waited is not done once they go on:
    // tms-ctl has reported them as not responding.
    std::thread::sleep(Duration::from_millis(500));
    let (code, list) = json(node.ctl(&["list", "--json"]));
    assert_eq!(code, 0, "{list}");
    assert_eq!(list.as_array().unwrap().len(), 3, "{list}");
    for row in list.as_array().unwrap() {
        assert_eq!(row["status"]["tags"][0]["bytes_active"], 8 * MIB, "{list}");
    }
    for f in frozen {
        f.quit();
    }
    live.quit();
}

#[test]
fn clients_over_the_limit_are_told_busy_and_a_trickling_client_loses_its_slot() {
    let node = SimNode::new("1GiB").env("TMS_CONTROL_TIMEOUT_MS", "1500");
    let mut app = Served::start_with(&node, "cuda", &[("TMS_NAME", "app")]);
    assert_eq!(app.ask("alloc 8"), "rc=0");
    let sock = socket_of(&node, app.pid());
    // 32 silent connections take every slot: the next client gets `busy` (it used to get
    // ECONNRESET, and tms-ctl then said no process matched), and tms-ctl says so.
    let silent: Vec<UnixStream> = (0..32).map(|_| UnixStream::connect(&sock).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut s = UnixStream::connect(&sock).unwrap();
    // The answer may come before the request is written: busy is said without reading.
    let _ = s.write_all(b"{\"op\":\"ping\"}\n");
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.contains("\"busy\""), "{reply}");
    let (_, code, out, err) = timed(node.ctl(&["--timeout", "0.5", "ping", "app"]));
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("busy"), "{out}{err}");
    drop(silent);
    // The server frees a slot when its thread sees the client gone: wait until one answers.
    let freed_by = Instant::now() + Duration::from_secs(10);
    loop {
        let mut s = UnixStream::connect(&sock).unwrap();
        let _ = s.write_all(b"{\"op\":\"ping\"}\n");
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        if reply.contains("\"pong\"") {
            break;
        }
        assert!(Instant::now() < freed_by, "slots never freed after the silent clients left: {reply}");
        std::thread::sleep(Duration::from_millis(50));
    }

    // The deadline is for the whole request, not for each read: one byte every 300 ms used to
    // hold a slot for as long as the client liked.
    let mut s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let start = Instant::now();
    let mut reply = Vec::new();
    for byte in b"{\"op\":\"ping\"      ".iter().cycle() {
        let _ = s.write_all(&[*byte]);
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(n) if n > 0 => reply.extend_from_slice(&buf[..n]),
            _ => {}
        }
        if reply.ends_with(b"\n") || start.elapsed() > Duration::from_secs(6) {
            break;
        }
    }
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.contains("\"timeout\""), "after {:?}: {reply}", start.elapsed());
    assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());

    // A repeated field is a bad request, not the last one winning.
    let mut s = UnixStream::connect(&sock).unwrap();
    s.write_all(b"{\"op\":\"ping\",\"op\":\"pause\"}\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.contains("bad_request") && reply.contains("appears twice"), "{reply}");
    let st = tms_proto::status(&sock, Duration::from_secs(5)).unwrap();
    assert_eq!(st.tags[0].allocations_active, 1);
    app.quit();
}

#[test]
fn out_of_file_descriptors_the_server_backs_off_instead_of_spinning() {
    let node = SimNode::new("1GiB");
    let mut app = Served::start(&node, "cuda");
    assert_eq!(app.ask("alloc 8"), "rc=0");
    let sock = socket_of(&node, app.pid());
    let pid = app.pid();
    // The limit bounds descriptor numbers: below the lowest free one, no new descriptor fits.
    let used: Vec<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let open = (0..).find(|n| !used.contains(n)).unwrap();
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    let tight = libc::rlimit { rlim_cur: open, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: reads and sets the limit of our own child.
    unsafe {
        assert_eq!(libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old), 0);
        let tight = libc::rlimit { rlim_max: old.rlim_max, ..tight };
        assert_eq!(libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, &tight, std::ptr::null_mut()), 0);
    }
    // A pending connection it cannot accept (EMFILE): accept fails again at once, for ever.
    let mut waiting = UnixStream::connect(&sock).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(1));
    let spent = cpu_ticks(pid) - before;
    assert!(spent < 20, "{spent} ticks of CPU in 1 s without a file descriptor to spare");
    // SAFETY: as above.
    unsafe { assert_eq!(libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, &old, std::ptr::null_mut()), 0) };
    // Once descriptors are back the waiting client is served.
    waiting.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    waiting.write_all(b"{\"op\":\"ping\"}\n").unwrap();
    let mut reply = String::new();
    waiting.read_to_string(&mut reply).unwrap();
    assert!(reply.contains("pong"), "{reply}");
    app.quit();
}

#[test]
fn a_margin_of_u64_max_set_from_outside_is_refused_and_changes_nothing() {
    // It once wrapped around to a small margin and let every allocation through; now a margin above
    // the device's memory is refused outright (the saver's own wrap guard is tested with
    // TMS_MEMORY_MARGIN_BYTES in hook.rs).
    let node = SimNode::new("1GiB");
    let mut app = Served::start(&node, "cuda");
    assert_eq!(app.ask("alloc 8"), "rc=0");
    socket_of(&node, app.pid());
    let pid = app.pid().to_string();
    let refused = node.ctl(&["set", "--margin", "18446744073709551615", &pid]).output().unwrap();
    assert_eq!(refused.status.code(), Some(1), "{}", String::from_utf8_lossy(&refused.stdout));
    assert_eq!(app.ask("alloc 64"), "rc=0");
    // Sizes are taken as they print: 1GiB is 2^30 bytes (the device has 1 GiB, so nothing fits).
    run_ok(&mut node.ctl(&["set", "--margin", "1GiB", &pid]));
    let status = run_ok(&mut node.ctl(&["status", &pid]));
    assert!(status.contains("1.0 GiB"), "{status}");
    assert_eq!(app.ask("alloc 8"), "rc=2");
    let bad = node.ctl(&["set", "--margin", "1XB", &pid]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("GiB = 2^30"));
    run_ok(&mut node.ctl(&["set", "--margin", "0", &pid]));
    app.quit();
}

#[test]
fn a_socket_folder_open_to_others_is_reported_loudly_with_the_fix() {
    // Another user may create /tmp/tms-$UID first: every process then silently served no socket
    // and `tms-ctl list` said "no hooked processes" with exit 0.
    use std::os::unix::fs::PermissionsExt;
    let node = SimNode::new("1GiB");
    std::fs::create_dir_all(node.control_dir()).unwrap();
    std::fs::set_permissions(node.control_dir(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut argv = c_program("hook_consumer", Style::Linked);
    argv.extend(["serve".into(), "cuda".into()]);
    let mut child = node
        .hooked(&argv)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "alloc 8").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    writeln!(stdin, "quit").unwrap();
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("control socket unavailable") && log.contains("chmod 700"), "{log}");

    let out = node.ctl(&["list"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(node.control_dir().to_str().unwrap()) && err.contains("chmod 700"), "{err}");
    let out = node.ctl(&["pause", "--all"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// `tms-ctl <args> --help`'s long options.
fn long_options(args: &[&str]) -> Vec<String> {
    let mut cmd = Command::new(workspace().bin("tms-ctl"));
    let help = run_ok(cmd.args(args).arg("--help"));
    let mut opts: Vec<String> = help
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.trim_end_matches(|c: char| !c.is_alphanumeric()).to_string())
        .collect();
    opts.sort();
    opts.dedup();
    opts
}

#[test]
fn the_manual_page_has_every_command_and_option_and_the_readme_agrees_with_the_help() {
    let ctl = workspace().bin("tms-ctl");
    let man = run_ok(Command::new(&ctl).arg("man"));
    // One page: no reference to a page per subcommand that nothing installs.
    assert!(!man.contains("tms\\-ctl\\-"), "the page points at per-command pages:\n{man}");
    let top = run_ok(Command::new(&ctl).arg("--help"));
    let commands: Vec<&str> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert!(commands.len() >= 9, "{top}");
    let section = {
        let readme = std::fs::read_to_string(workspace().root.join("README.md")).unwrap();
        let start = readme.find("## Controlling processes from outside").expect("the tms-ctl section");
        let end = readme[start + 3..].find("\n## ").map_or(readme.len(), |e| start + 3 + e);
        readme[start..end].to_string()
    };
    for c in &commands {
        assert!(man.contains(&format!(".SS \"tms\\-ctl {c}")), "the page lacks {c}:\n{man}");
        for opt in long_options(&[c]) {
            if opt == "--help" {
                continue;
            }
            let escaped = opt.replace('-', "\\-");
            assert!(man.contains(&escaped), "the page lacks {c} {opt}");
        }
        assert!(section.contains(&format!("tms-ctl {c}")), "README's tms-ctl section never names `tms-ctl {c}`");
    }
    // Every option the README's section shows exists.
    let mut known = long_options(&[]);
    for c in &commands {
        known.extend(long_options(&[c]));
    }
    for word in section.split(|c: char| c.is_whitespace() || "`(),;:".contains(c)) {
        if let Some(opt) = word.strip_prefix("--").map(|o| o.trim_end_matches(|c: char| !c.is_alphanumeric())) {
            if opt.is_empty() || opt.contains('=') {
                continue;
            }
            assert!(known.contains(&format!("--{opt}")), "README shows --{opt}, which tms-ctl does not take");
        }
    }
    // What the README says each setting is, the help says too.
    let set = run_ok(Command::new(&ctl).args(["set", "--help"]));
    for var in ["TMS_MEMORY_MARGIN_BYTES", "TMS_RETAIN_CPU_BACKUP", "TMS_INIT_ENABLE_CPU_BACKUP"] {
        assert!(set.contains(var) && section.contains(var), "{var} in set --help and README:\n{set}");
    }
}
