//! The drop-in path for torch_memory_saver users: install into a prefix, preload the
//! compatibility file name, and run the Python package's tests with CPython on the simulator.

use std::process::Command;
use tms_e2e::*;

fn install() -> tempfile::TempDir {
    let ws = workspace();
    let prefix = tempfile::tempdir().unwrap();
    let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
    run_ok(
        Command::new(ws.root.join("scripts/install.sh")).args(["--profile", profile, "--no-build"]).arg(prefix.path()),
    );
    prefix
}

#[test]
fn install_lays_out_the_compatibility_names() {
    let prefix = install();
    let lib = prefix.path().join("lib");
    for mode in ["preload", "preload_cu12", "preload_cu13", "torch_cu12", "torch_cu13"] {
        let p = lib.join(format!("torch_memory_saver_hook_mode_{mode}.abi3.so"));
        assert_eq!(std::fs::read_link(&p).unwrap().to_str(), Some("libtms_hook.so"), "{}", p.display());
    }
    for f in [
        "lib/libtms_hook.so",
        "include/tms.h",
        "bin/tms-ctl",
        "bin/tms-sim",
        "lib/python/tms/__init__.py",
        "lib/python/torch_memory_saver/__init__.py",
        "lib/python/relax_worker.py",
        "lib/python/relax_compute_model.json",
        "share/tms/workers/torch_worker.py",
        "share/tms/workers/example_worker.py",
        "lib/debug/libtms_hook.so.debug",
        "share/man/man1/tms-ctl.1",
        "share/man/man1/tms-sim.1",
        "share/man/man1/relax-colocate.1",
        "share/bash-completion/completions/tms-ctl",
        "share/bash-completion/completions/relax-colocate",
    ] {
        assert!(prefix.path().join(f).exists(), "{f} not installed");
    }
    // The runner's own Python (its worker-protocol client, its Ray bridge) is not the saver's.
    for f in ["lib/python/tms/worker.py", "lib/python/tms/ray/bridge.py"] {
        assert!(!prefix.path().join(f).exists(), "{f} installed with the tms package");
    }
    // Installed binaries carry no debug info (it was most of their size); a link points at it.
    for f in ["lib/libtms_hook.so", "bin/tms-ctl", "bin/relax-colocate"] {
        let sections = run_ok(Command::new("objdump").arg("-h").arg(prefix.path().join(f)));
        assert!(!sections.contains(".debug_info"), "{f} still has debug info");
        assert!(sections.contains(".gnu_debuglink"), "{f} has no link to its debug file");
    }
    let page = std::fs::read_to_string(prefix.path().join("share/man/man1/tms-ctl.1")).unwrap();
    assert!(page.starts_with(".ie") && page.contains(".TH tms-ctl 1") && page.contains("pause"), "{page}");
    // relax-colocate's page has every command with its options, run's --ctl-dir among them.
    let page = std::fs::read_to_string(prefix.path().join("share/man/man1/relax-colocate.1")).unwrap();
    assert!(page.contains(".TH relax-colocate 1") && page.contains("relax\\-colocate compare"), "{page}");
    assert!(page.contains("\\-\\-ctl\\-dir"), "{page}");
    let completions =
        std::fs::read_to_string(prefix.path().join("share/bash-completion/completions/relax-colocate")).unwrap();
    assert!(completions.contains("relax-colocate") && completions.contains("--ctl-dir"), "{completions}");
    let debug = std::fs::metadata(prefix.path().join("lib/debug/libtms_hook.so.debug")).unwrap().len();
    let hook = std::fs::metadata(prefix.path().join("lib/libtms_hook.so")).unwrap().len();
    assert!(debug > hook, "the debug file ({debug} B) should hold most of the hook's former size ({hook} B now)");
}

#[test]
fn python_package_tests_pass_on_the_simulator() {
    let ws = workspace();
    let prefix = install();
    let node = SimNode::new("2GiB");
    let preload = prefix.path().join("lib/torch_memory_saver_hook_mode_preload.abi3.so");
    let out = node
        .command(&[
            "python3".into(),
            "-m".into(),
            "unittest".into(),
            "discover".into(),
            "-v".into(),
            "-s".into(),
            ws.root.join("python/tests"),
        ])
        .env("LD_PRELOAD", &preload)
        .env("PYTHONPATH", prefix.path().join("lib/python"))
        .env("TMS_PREFIX", prefix.path())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python tests failed:\n{err}");
    assert!(err.contains("\nOK"), "{err}");
    assert!(err.contains("Ran 28 tests"), "{err}");
    assert!(!err.contains("FAIL") && !err.contains("ERROR"), "{err}");
}

/// The runner's own Python (relax-colocate/python: the worker-protocol client, the Ray bridge)
/// has tests of its own, apart from the saver's package.
#[test]
fn the_runners_python_tests_pass() {
    let ws = workspace();
    let dir = ws.root.join("relax-colocate/python");
    let out = Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(dir.join("tests"))
        .env("PYTHONPATH", &dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the runner's python tests failed:\n{err}");
    assert!(err.contains("Ran 10 tests") && err.contains("\nOK"), "{err}");
}

#[test]
fn a_torch_memory_saver_program_runs_unchanged_under_the_compatibility_name() {
    let ws = workspace();
    let prefix = install();
    let node = SimNode::new("1GiB");
    let preload = prefix.path().join("lib/torch_memory_saver_hook_mode_preload.abi3.so");
    let script = ws.root.join("tests/python/tms_ctypes_check.py");
    let out = run_ok(
        node.command(&["python3".into(), script])
            .env("LD_PRELOAD", &preload)
            .env("PYTHONPATH", prefix.path().join("lib/python"))
            .env("PYTHONDONTWRITEBYTECODE", "1"),
    );
    assert!(out.contains("ctypes ok"), "{out}");
}
