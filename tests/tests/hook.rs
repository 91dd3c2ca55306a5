//! libtms_hook.so preloaded into C programs on the simulator, CUDA and Ascend, all loading styles.

use std::path::PathBuf;
use std::process::Command;
use tms_e2e::*;

fn hooked(node: &SimNode, style: Style, args: &[&str]) -> String {
    let mut argv = c_program("hook_consumer", style);
    argv.extend(args.iter().map(PathBuf::from));
    run_ok(&mut node.hooked(&argv))
}

#[test]
fn pause_resume_100_cycles_keeps_bytes_and_addresses_in_every_style() {
    for style in STYLES {
        for api in ["cuda", "acl"] {
            let node = SimNode::new("1GiB");
            let out = hooked(&node, style, &["cycle", api, "100"]);
            assert!(out.contains("cycles=100"), "{style:?} {api}: {out}");
        }
    }
}

/// Region memory on several devices: one pause releases each device's share, resume restores
/// each allocation on its own device, from a thread whose current device is another one.
#[test]
fn one_tag_on_several_devices_pauses_and_resumes_each_device_s_memory() {
    for api in ["cuda", "acl"] {
        let node = SimNode::new("1GiB").with_devices(3);
        let out = hooked(&node, Style::Linked, &["multi-device", api, "10"]);
        assert!(out.contains("multi-device ok: devices=3 cycles=10"), "{api}: {out}");
    }
}

#[test]
fn allocations_of_many_pieces_cycle_with_contents_and_free_memory_exact() {
    // 2 MiB pieces and copies: every allocation of the cycle test is split, so pause releases
    // pieces while others are copied and resume creates them while others are restored.
    for api in ["cuda", "acl"] {
        let node = SimNode::new("1GiB").env("TMS_PHYSICAL_CHUNK_MB", "2").env("TMS_BACKUP_CHUNK_MB", "2");
        let out = hooked(&node, Style::Linked, &["cycle", api, "20"]);
        assert!(out.contains("cycles=20"), "{api}: {out}");
    }
}

#[test]
fn pause_frees_device_memory_others_can_see() {
    // The C program checks its own free memory; here a second process checks it too.
    let node = SimNode::new("1GiB");
    let mut trainer = Served::start(&node, "cuda");
    assert_eq!(trainer.ask("alloc 600"), "rc=0");
    assert_eq!(trainer.ask("fill"), "rc=0");
    let mut rollout = Served::start(&node, "acl");
    // Both need more than half the device: without pause the second cannot allocate.
    assert_eq!(rollout.ask("alloc 600"), "rc=207001");
    let paused = trainer.ask("pause");
    assert!(paused.starts_with("rc=0 done=629145600"), "{paused}");
    assert_eq!(field(&paused, "freed"), 600 * MIB, "{paused}");
    let info = rollout.ask("info");
    // Both processes' contexts stay: 1 GiB + a CUDA context, less that and an Ascend one, and
    // the 2 MiB the trainer's first CUDA streams took (the hook's copy streams).
    assert_eq!(field(&info, "free"), 822 * MIB, "{info}");
    assert_eq!(rollout.ask("alloc 600"), "rc=0");
    assert_eq!(rollout.ask("fill"), "rc=0");
    // The trainer cannot come back while the rollout holds the memory: OOM, nothing lost.
    let refused = trainer.ask("resume");
    assert!(refused.starts_with("rc=2 done=0 driver=2"), "{refused}");
    assert!(rollout.ask("pause").starts_with("rc=0"));
    assert!(trainer.ask("resume").starts_with("rc=0 done=629145600"));
    assert_eq!(trainer.ask("verify"), "rc=0");
    assert!(trainer.ask("pause").starts_with("rc=0"));
    assert!(rollout.ask("resume").starts_with("rc=0"));
    assert_eq!(rollout.ask("verify"), "rc=0");
    assert_eq!(rollout.ask("free"), "rc=0");
    assert!(trainer.ask("resume").starts_with("rc=0"));
    assert_eq!(trainer.ask("verify"), "rc=0");
    assert_eq!(trainer.ask("free"), "rc=0");
    trainer.quit();
    rollout.quit();
}

#[test]
fn out_of_memory_on_resume_then_retry_succeeds() {
    for api in ["cuda", "acl"] {
        let node = SimNode::new("256MiB");
        hooked(&node, Style::Linked, &["oom-resume", api]);
        let node = SimNode::new("256MiB").env("TMS_RESUME_KEEPS_MARGIN", "1");
        hooked(&node, Style::Linked, &["oom-resume", api]);
    }
}

#[test]
fn the_mmap_backend_backs_up_to_pageable_memory_given_back_at_resume() {
    let node = SimNode::new("256MiB");
    let out = hooked(&node, Style::Linked, &["backup-backends", "cuda"]);
    assert!(out.contains("backup-backends ok"), "{out}");
}

#[test]
fn region_memory_is_gpu_direct_rdma_capable_like_cudamalloc_memory() {
    // 2 MiB pieces: an allocation of several physical handles carries the flag on every one.
    let node = SimNode::new("256MiB").env("TMS_PHYSICAL_CHUNK_MB", "2");
    let out = hooked(&node, Style::Linked, &["rdma", "cuda"]);
    assert!(out.contains("rdma ok"), "{out}");
}

#[test]
fn pause_waits_for_blocking_streams_and_not_for_a_stalled_collective() {
    let node = SimNode::new("256MiB");
    let out = hooked(&node, Style::Linked, &["pause-streams", "cuda"]);
    assert!(out.contains("pause-streams ok"), "{out}");
}

#[test]
fn ascend_malloc_policies_choose_the_physical_memory_of_region_allocations() {
    let node = SimNode::new("256MiB");
    let out = hooked(&node, Style::Linked, &["acl-policies", "acl"]);
    assert!(out.contains("acl-policies ok"), "{out}");
}

#[test]
fn pooled_pinned_buffers_stay_under_their_cap() {
    let node = SimNode::new("256MiB").env("TMS_PINNED_POOL_MAX_MB", "4");
    let out = hooked(&node, Style::Linked, &["pool-cap", "cuda", "4"]);
    assert!(out.contains("pool-cap ok"), "{out}");
}

#[test]
fn an_unreadable_pinned_pool_cap_means_no_cap_and_says_so() {
    // It used to say "using 17592186044415": the sentinel behind "no limit".
    let node =
        SimNode::new("256MiB").env("TMS_PINNED_POOL_MAX_MB", "lots").env("TMS_PINNED_POOL_HOST_RESERVE_PERCENT", "0");
    let mut argv = c_program("hook_consumer", Style::Linked);
    argv.extend(["pool-cap".into(), "cuda".into(), "12".into()]);
    let out = node.hooked(&argv).output().unwrap();
    assert_ok(&out, "pool-cap with TMS_PINNED_POOL_MAX_MB=lots");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("TMS_PINNED_POOL_MAX_MB=\"lots\" is not a whole number of MiB; using no limit"), "{err}");
    assert!(!err.contains("17592186044415"), "{err}");
}

#[test]
fn pooled_pinned_buffers_go_when_the_host_runs_short_of_memory() {
    // A reserve of all the host's memory can never be met: every buffer is freed at resume, as
    // it must be on a machine whose memory a resume's buffers would exhaust. With no reserve
    // (and no cap) all three stay for the next pause.
    for (reserve, kept_mib) in [("100", "0"), ("0", "12")] {
        let node = SimNode::new("256MiB").env("TMS_PINNED_POOL_HOST_RESERVE_PERCENT", reserve);
        let out = hooked(&node, Style::Linked, &["pool-cap", "cuda", kept_mib]);
        assert!(out.contains("pool-cap ok"), "reserve {reserve}%: {out}");
    }
}

#[test]
fn a_new_tag_every_step_does_not_grow_the_process() {
    // 100,000 distinct tags interned for good cost the reporter +24 MB and a linear
    // search per allocation; now each goes with its last allocation.
    let node = SimNode::new("256MiB");
    let out = hooked(&node, Style::Linked, &["tag-churn", "cuda", "20000"]);
    println!("{}", out.lines().find(|l| l.starts_with("tag-churn:")).unwrap_or_default());
    assert!(out.contains("tag-churn ok"), "{out}");
}

#[test]
fn faults_in_every_driver_call_return_errors_and_leak_nothing() {
    for api in ["cuda", "acl"] {
        let node = SimNode::new("256MiB");
        let out = hooked(&node, Style::Linked, &["faults", api]);
        assert!(out.contains("faults ok"), "{out}");
    }
}

#[test]
fn faults_in_a_later_piece_of_a_large_allocation_lose_nothing() {
    // 2 MiB pieces and copies: an 8 MiB allocation has 4 handles, and the second call of each
    // per-piece driver function fails, after the first piece was already released (pause) or
    // created (resume, malloc).
    for api in ["cuda", "acl"] {
        let node = SimNode::new("256MiB").env("TMS_PHYSICAL_CHUNK_MB", "2").env("TMS_BACKUP_CHUNK_MB", "2");
        let out = hooked(&node, Style::Linked, &["faults", api, "8", "2"]);
        assert!(out.contains("faults ok"), "{out}");
        let out = hooked(&node, Style::Linked, &["rollback-fails", api]);
        assert!(out.contains("rollback-fails ok"), "{out}");
    }
}

#[test]
fn eight_threads_churn_while_another_pauses_and_resumes_1000_times() {
    for api in ["cuda", "acl"] {
        let node = SimNode::new("1GiB");
        let out = hooked(&node, Style::Linked, &["threads", api, "1000"]);
        assert!(out.contains("threads ok cycles=1000"), "{out}");
    }
}

#[test]
fn acl_malloc_align32_reached_through_dlsym_handle_is_intercepted() {
    // torch_npu's path: dlopen(libascendcl.so) + dlsym(handle, "aclrtMallocAlign32"). Pausing
    // frees the memory only if the hook saw the allocation.
    let node = SimNode::new("1GiB");
    let out = hooked(&node, Style::Dlsym, &["cycle", "acl", "3"]);
    assert!(out.contains("ok"), "{out}");
}

#[test]
fn harmless_in_processes_that_never_use_a_device() {
    let ws = workspace();
    let dir = tempfile::tempdir().unwrap();
    for argv in [vec!["sh", "-c", "true"], vec!["python3", "-c", "pass"], vec!["sh", "-c", "echo hi"]] {
        let out = Command::new(argv[0])
            .args(&argv[1..])
            .env("LD_PRELOAD", ws.hook())
            .env("TMS_INIT_ENABLE", "1")
            .env("TMS_CONTROL_DIR", dir.path())
            .env("XDG_RUNTIME_DIR", dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{argv:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(out.stderr.is_empty(), "{argv:?} printed: {}", String::from_utf8_lossy(&out.stderr));
        let expected: &[u8] = if argv[2] == "echo hi" { b"hi\n" } else { b"" };
        assert_eq!(out.stdout, expected);
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the hook created files");
}

#[test]
fn bad_environment_values_warn_and_keep_defaults() {
    let node = SimNode::new("1GiB").env("TMS_INIT_ENABLE_CPU_BACKUP", "maybe").env("TMS_MEMORY_MARGIN_BYTES", "-3");
    let mut argv = c_program("hook_consumer", Style::Linked);
    argv.extend(["cycle".into(), "cuda".into(), "2".into()]);
    let out = node.hooked(&argv).output().unwrap();
    assert_ok(&out, "cycle with bad env");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("TMS_INIT_ENABLE_CPU_BACKUP=\"maybe\" is not a boolean"), "{err}");
    assert!(err.contains("TMS_MEMORY_MARGIN_BYTES=\"-3\""), "{err}");
}

/// Runs `hook_consumer serve` with `env`, feeding it `script` (one command a line).
fn serve_script(node: &SimNode, env: &[(&str, &str)], script: &str) -> std::process::Output {
    use std::io::Write;
    let mut argv = c_program("hook_consumer", Style::Linked);
    argv.extend(["serve".into(), "cuda".into()]);
    let mut cmd = node.hooked(&argv);
    cmd.envs(env.iter().copied());
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// A misspelt backup variable is named, with the one meant, at the first allocation (before
/// anything can be paused); a backup flag that cannot be read keeps the backup on, so the
/// contents survive the pause.
#[test]
fn a_typo_or_an_unreadable_backup_flag_never_loses_contents_silently() {
    let node = SimNode::new("1GiB");
    let out = serve_script(&node, &[("TMS_INIT_ENABLE_CPU_BAKUP", "1")], "alloc-env 4\nquit\n");
    assert_ok(&out, "serve with a misspelt variable");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("TMS_INIT_ENABLE_CPU_BAKUP is not a variable tms reads")
            && err.contains("did you mean TMS_INIT_ENABLE_CPU_BACKUP?"),
        "no warning at the first allocation: {err:?}"
    );

    let cycle = "alloc-env 4\nfill\npause\nresume\nverify\nquit\n";
    for spelling in ["Y", "2", "enabled", "on", "TRUE", "Yes"] {
        let out = serve_script(&node, &[("TMS_INIT_ENABLE_CPU_BACKUP", spelling)], cycle);
        assert_ok(&out, spelling);
        let replies: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
        assert_eq!(replies.len(), 5, "{spelling}: {replies:?}");
        assert!(replies[2].starts_with("rc=0") && replies[3].starts_with("rc=0"), "{spelling}: {replies:?}");
        assert_eq!(replies[4], "rc=0", "TMS_INIT_ENABLE_CPU_BACKUP={spelling}: contents lost");
    }
}

#[test]
fn out_of_range_settings_are_named_with_the_value_used() {
    let node = SimNode::new("1GiB")
        .env("TMS_BACKUP_STREAMS", "100000")
        .env("TMS_LOG", "verbose")
        .env("TMS_PINNED_POOL_HOST_RESERVE_PERCENT", "150")
        .env("TMS_MEMORY_MARGIN_BYTES", "64MiB")
        .env("TMS_NAME", "log-check");
    let mut argv = c_program("hook_consumer", Style::Linked);
    argv.extend(["cycle".into(), "cuda".into(), "2".into()]);
    let child =
        node.hooked(&argv).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert_ok(&out, "cycle with out-of-range settings");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("TMS_BACKUP_STREAMS=100000 is above the most it takes, 64; using 64"), "{err}");
    assert!(err.contains("TMS_PINNED_POOL_HOST_RESERVE_PERCENT=150 is above the most it takes, 100"), "{err}");
    // Read as a target name, `verbose` would have silenced every warning, this one included.
    assert!(err.contains("TMS_LOG=\"verbose\" is not a log filter"), "{err}");
    assert!(!err.contains("TMS_MEMORY_MARGIN_BYTES"), "64MiB is a size: {err}");
    // Each line says when, which process and which name, so several processes' logs can be told apart.
    let line = err.lines().find(|l| l.contains("TMS_BACKUP_STREAMS")).unwrap();
    let pid_tag = format!("[pid {pid} log-check] tms: ");
    assert!(line.starts_with("20") && line.contains("Z WARN ") && line.contains(&pid_tag), "{line}");
}

#[test]
fn dlsym_next_and_default_keep_their_meaning_under_the_hook() {
    let ws = workspace();
    let plugin = compile("dlsym_probe.so", &[ws.c_src("dlsym_probe.c")], &["-shared", "-fPIC", "-ldl"]);
    let main = compile("dlsym_probe_main", &[ws.c_src("dlsym_probe_main.c")], &["-ldl"]);
    let plain = run_ok(Command::new(&main).arg(&plugin).env_remove("LD_PRELOAD"));
    let under_hook = run_ok(Command::new(&main).arg(&plugin).env("LD_PRELOAD", ws.hook()));
    assert!(plain.contains("ok"), "{plain}");
    assert_eq!(plain, under_hook);
}

#[test]
fn forked_children_get_their_own_state() {
    let node = SimNode::new("1GiB");
    let out = hooked(&node, Style::Linked, &["fork", "cuda"]);
    assert!(out.contains("fork ok"), "{out}");
}

#[test]
fn without_a_driver_everything_passes_through() {
    // A runtime without its driver: libcudart.so.12 is there, libcuda.so.1 is not.
    let ws = workspace();
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(ws.sim_lib(), dir.path().join("libcudart.so.12")).unwrap();
    let node = SimNode::new("1GiB");
    let mut argv = c_program("hook_consumer", Style::Dlsym);
    argv.extend(["no-driver".into(), "cuda".into()]);
    let out = node.hooked(&argv).env("LD_LIBRARY_PATH", dir.path()).output().unwrap();
    assert_ok(&out, "no-driver");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cuda driver unavailable"), "one warning expected: {err}");
    assert_eq!(err.matches("driver unavailable").count(), 1, "{err}");
}

#[test]
fn expandable_segments_are_reported_once() {
    let node = SimNode::new("1GiB").env("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True");
    let mut argv = c_program("hook_consumer", Style::Linked);
    argv.extend(["cycle".into(), "cuda".into(), "1".into()]);
    let out = node.hooked(&argv).output().unwrap();
    assert_ok(&out, "cycle");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("expandable segments").count(), 1, "{err}");
}

#[test]
fn a_thread_without_a_context_allocates_in_a_region_with_a_margin() {
    // cudaGetDevice makes no context current (the simulator refuses cuMemGetInfo without one, as
    // a GPU does): the hook must bind the device's primary context before checking the margin.
    for style in STYLES {
        let node = SimNode::new("1GiB");
        let out = hooked(&node, style, &["margin-thread", "cuda"]);
        assert!(out.contains("margin-thread ok"), "{style:?}: {out}");
    }
}

#[test]
fn resume_sees_the_memory_of_a_process_that_died() {
    // A device frees a dead process's memory at once. The hook's resume checks free memory
    // before creating anything, so the simulator must reclaim on that query too, not only when an
    // allocation fails.
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let node = SimNode::new("1GiB");
    let mut trainer = Served::start(&node, "cuda");
    assert_eq!(trainer.ask("alloc 600"), "rc=0");
    assert_eq!(trainer.ask("fill"), "rc=0");
    assert!(trainer.ask("pause").starts_with("rc=0"));
    let mut argv = c_program("sim_consumer", Style::Linked);
    argv.extend(["hold".into(), "cuda".into(), "700".into()]);
    let mut holder = node.command(&argv).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(field(&line, "rc"), 0, "{line}");
    holder.kill().unwrap();
    holder.wait().unwrap();
    let resumed = trainer.ask("resume");
    assert!(resumed.starts_with("rc=0 done=629145600"), "{resumed}");
    assert_eq!(trainer.ask("verify"), "rc=0");
    assert_eq!(trainer.ask("free"), "rc=0");
    trainer.quit();
}

#[test]
fn disk_backup_keeps_contents_in_a_file_and_survives_an_unreadable_one() {
    for api in ["cuda", "acl"] {
        let node = SimNode::new("1GiB");
        let dir = tempfile::tempdir().unwrap();
        let out = hooked(&node, Style::Linked, &["disk-backup", api, dir.path().to_str().unwrap()]);
        assert!(out.contains("disk-backup ok"), "{api}: {out}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{api}: files left behind");
    }
}

#[test]
fn a_range_marked_dead_is_not_copied_and_the_live_bytes_come_back() {
    // One handle, and 2 MiB pieces the dead range crosses; every loading style sees the export.
    for (chunk, style) in [("16", Style::Linked), ("2", Style::Linked), ("2", Style::Dlsym)] {
        for api in ["cuda", "acl"] {
            let node = SimNode::new("1GiB").env("TMS_PHYSICAL_CHUNK_MB", chunk).env("TMS_BACKUP_CHUNK_MB", "2");
            let out = hooked(&node, style, &["live-only", api]);
            assert!(out.contains("live-only ok: copied=5246976 skipped=3145728"), "{chunk} {style:?} {api}: {out}");
        }
    }
}

#[test]
fn restore_verification_catches_a_written_backup_and_a_bad_copy_naming_allocation_tag_and_offset() {
    for api in ["cuda", "acl"] {
        let node = SimNode::new("1GiB");
        let mut argv = c_program("hook_consumer", Style::Linked);
        argv.extend(["verify".into(), api.into()]);
        let out = node.hooked(&argv).env("TMS_LOG", "warn").output().unwrap();
        assert_ok(&out, &format!("verify {api}"));
        assert!(String::from_utf8_lossy(&out.stdout).contains("verify ok"), "{api}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        // The byte written at 2 MiB + 10: its 1 MiB chunk is named.
        assert!(
            err.contains("restore verification failed for allocation")
                && err.contains("tag verify")
                && err.contains("the host backup changed while paused")
                && err.contains("at offset 2097152"),
            "{api}: {err}"
        );
        // A corrupt copy flips the byte in the middle of what it wrote: found to the byte and
        // copied again once; named when every copy is bad (on Ascend the read-back goes through
        // the same aclrtMemcpyAsync, so it is bad too and the first difference lies elsewhere).
        let middle = (3 << 20) / 2 + 2048;
        assert!(
            err.contains(&format!("came back different from its backup at offset {middle}; copying it again")),
            "{api}: {err}"
        );
        assert!(err.contains("differ from the backup after two copies, first byte at offset "), "{api}: {err}");
    }
}

#[test]
fn pause_waits_for_a_kernel_still_running_on_another_stream() {
    // A simulated kernel writes the allocation 0.3 s after pause is called: a pause that does not
    // synchronize the device backs up the old bytes and unmaps memory under the kernel (700).
    let node = SimNode::new("1GiB");
    let out = hooked(&node, Style::Linked, &["kernel-pause", "cuda"]);
    assert!(out.contains("kernel-pause ok"), "{out}");
}

#[test]
fn a_margin_of_the_whole_address_space_refuses_instead_of_wrapping() {
    // needed = size + margin wrapped around to a small number and every allocation passed.
    let node = SimNode::new("1GiB");
    let mut app = Served::start_with(&node, "cuda", &[("TMS_MEMORY_MARGIN_BYTES", "18446744073709551615")]);
    assert_eq!(app.ask("alloc 64"), "rc=2");
    app.quit();
}

#[test]
fn a_pause_that_fails_on_a_stream_synchronize_reports_consistently_and_leaves_no_stale_error() {
    // The restore that undoes a failed backup was not drained when its own synchronize failed:
    // the copy's fault stayed on the stream and the next resume failed on it (700) and resumed
    // nothing. And allocations parked paused after such a failure were counted done next to
    // the error (done=3 failed=0, rc=3).
    for (api, spec) in [
        ("cuda", "cuStreamSynchronize:2+:700"),
        ("cuda", "cuStreamSynchronize:2:700,cuMemcpyHtoDAsync_v2:1:700"),
        ("acl", "aclrtSynchronizeStream:2+:107000"),
    ] {
        let node = SimNode::new("256MiB").env("TMS_PHYSICAL_CHUNK_MB", "2").env("TMS_BACKUP_CHUNK_MB", "2");
        let out = hooked(&node, Style::Linked, &["sync-fault", api, spec]);
        assert!(out.contains("sync-fault ok"), "{spec}: {out}");
    }
}
