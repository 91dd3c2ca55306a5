//! tms on aarch64 (Kunpeng + Ascend 910B, Grace), proven under emulation: the aarch64 kit is made
//! exactly as for a Kunpeng host (`npu-check.sh prepare --arch aarch64`, which builds the
//! `manylinux2014_aarch64` wheel too), and its programs run under `qemu-aarch64` on the kit's own
//! aarch64 simulator: C consumers in both loading styles (through the PLT, and torch_npu's
//! dlopen + dlsym path) with the hook from the build and from the wheel, also with 64 KiB pages;
//! the hook's aarch64 `dlsym` trampoline; NCCL and HCCL communicators; and a CUDA runtime
//! consumer nobody here wrote (the cudarc crate's loader) paused and resumed from outside by the
//! aarch64 `tms-ctl`. No PyTorch is emulated.
//!
//! Needs `qemu-aarch64` (Debian: qemu-user), `aarch64-linux-gnu-gcc` (gcc-aarch64-linux-gnu) and
//! the aarch64 C library (libc6-dev-arm64-cross); `.ci/run` installs them. Where they cannot be
//! installed, `TMS_AARCH64_TESTS=0` skips these tests, saying so.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use tms_e2e::*;

const SYSROOT: &str = "/usr/aarch64-linux-gnu";
const CROSS_CC: &str = "aarch64-linux-gnu-gcc";
/// ELF e_machine of AArch64 (System V ABI, ELF for the Arm 64-bit Architecture).
const EM_AARCH64: u16 = 183;

struct Arm {
    _tmp: tempfile::TempDir,
    kit: PathBuf,
    /// The wheel, unpacked.
    wheel_dir: PathBuf,
    wheel: PathBuf,
    /// The kit's simulator libraries under their vendor names (`tms-sim env` lays them out).
    sim_lib: PathBuf,
    bin: PathBuf,
}

impl Arm {
    fn built_hook(&self) -> PathBuf {
        self.kit.join("lib/libtms_hook.so")
    }

    /// The file slime and SGLang preload from an installed wheel.
    fn wheel_hook(&self) -> PathBuf {
        self.wheel_dir.join("torch_memory_saver_hook_mode_preload_cu12.abi3.so")
    }
}

fn tools_missing() -> Vec<String> {
    let mut missing = Vec::new();
    for tool in ["qemu-aarch64", CROSS_CC] {
        if Command::new(tool).arg("--version").output().is_err() {
            missing.push(tool.to_string());
        }
    }
    if !Path::new(SYSROOT).join("lib/ld-linux-aarch64.so.1").exists() {
        missing.push(format!("{SYSROOT}/lib/ld-linux-aarch64.so.1"));
    }
    missing
}

/// The aarch64 kit and consumers, built once per test binary; None when the tests are skipped.
fn arm() -> Option<&'static Arm> {
    static ARM: OnceLock<Option<Arm>> = OnceLock::new();
    ARM.get_or_init(|| {
        let missing = tools_missing();
        if !missing.is_empty() {
            if std::env::var("TMS_AARCH64_TESTS").as_deref() == Ok("0") {
                eprintln!("aarch64 tests SKIPPED (TMS_AARCH64_TESTS=0): missing {missing:?}");
                return None;
            }
            panic!(
                "the aarch64 tests need {missing:?}: apt-get install qemu-user gcc-aarch64-linux-gnu \
                 libc6-dev-arm64-cross (.ci/run does), or set TMS_AARCH64_TESTS=0 to skip them"
            );
        }
        Some(build())
    })
    .as_ref()
}

fn build() -> Arm {
    let ws = workspace();
    let tmp = tempfile::tempdir().unwrap();
    let kit = tmp.path().join("kit");
    let status = Command::new(ws.root.join("scripts/npu-check.sh"))
        .args(["prepare", "--arch", "aarch64"])
        .arg(&kit)
        .stderr(Stdio::inherit())
        .stdout(Stdio::null())
        .status()
        .expect("run npu-check.sh prepare");
    assert!(status.success(), "npu-check.sh prepare --arch aarch64 failed (see above)");
    let wheel = std::fs::read_dir(kit.join("wheel"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .expect("the kit holds the wheel");
    let wheel_dir = tmp.path().join("wheel");
    let status = Command::new("python3")
        .args(["-c", "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])"])
        .arg(&wheel)
        .arg(&wheel_dir)
        .status()
        .unwrap();
    assert!(status.success(), "unpack {}", wheel.display());
    let bin = tmp.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let mut arm = Arm { kit: kit.clone(), wheel_dir, wheel, sim_lib: PathBuf::new(), bin, _tmp: tmp };
    // Asking the kit's own (aarch64) tms-sim lays out its vendor-named libraries.
    let env = sim_env(&arm, "layout", 1, None);
    arm.sim_lib = PathBuf::from(env.iter().find(|(k, _)| k == "LD_LIBRARY_PATH").expect("LD_LIBRARY_PATH").1.clone());
    compile_consumers(&arm);
    arm
}

/// Cross-compiles `sources` into `arm.bin/name`.
fn cross_cc(arm: &Arm, name: &str, sources: &[&str], extra: &[&str]) -> PathBuf {
    let ws = workspace();
    let out = arm.bin.join(name);
    let mut cmd = Command::new(CROSS_CC);
    cmd.args(["-O1", "-Wall", "-o"]).arg(&out);
    for s in sources {
        cmd.arg(ws.c_src(s));
    }
    cmd.arg(format!("-I{}", ws.root.join("tests/c").display()))
        .arg(format!("-I{}", ws.root.join("include").display()))
        .args(extra);
    let out_put = cmd.output().expect("run the cross compiler");
    assert_ok(&out_put, &format!("{CROSS_CC} {name}"));
    out
}

fn compile_consumers(arm: &Arm) {
    let lib = format!("-L{}", arm.sim_lib.display());
    // Linked against the simulator's vendor-named libraries, as a program built against the
    // toolkit links against the real ones: calls go through the PLT.
    let linked = [lib.as_str(), "-l:libcudart.so.12", "-l:libcuda.so.1", "-l:libascendcl.so", "-lpthread", "-ldl"];
    cross_cc(arm, "hook_consumer-linked", &["hook_consumer.c", "main_direct.c"], &linked);
    // Every vendor call through dlopen + dlsym(handle, name): torch_npu's FunctionLoader path.
    cross_cc(
        arm,
        "hook_consumer-dlsym",
        &["hook_consumer.c", "main_direct.c"],
        &["-DTMS_TEST_DLSYM", "-lpthread", "-ldl"],
    );
    cross_cc(
        arm,
        "nccl_consumer",
        &["nccl_consumer.c"],
        &[lib.as_str(), "-l:libnccl.so.2", "-l:libcudart.so.12", "-ldl"],
    );
    cross_cc(arm, "hccl_consumer", &["hccl_consumer.c"], &[lib.as_str(), "-l:libhccl.so", "-l:libascendcl.so", "-ldl"]);
    cross_cc(arm, "dlsym_probe.so", &["dlsym_probe.c"], &["-shared", "-fPIC", "-ldl"]);
    cross_cc(arm, "dlsym_probe_main", &["dlsym_probe_main.c"], &["-ldl"]);
    cross_cc(arm, "page_size", &["page_size.c"], &[]);
    // The cudarc consumer: Rust, linked by the cross compiler (cudarc itself loads nothing at
    // build time).
    let ws = workspace();
    let target = ws.root.join("target/consumers");
    let out = Command::new(env!("CARGO"))
        .args(["build", "--release", "--quiet", "--target", "aarch64-unknown-linux-gnu", "--manifest-path"])
        .arg(ws.root.join("tests/consumers/cudarc-runtime/Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target)
        .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", CROSS_CC)
        .output()
        .expect("run cargo build for the cudarc consumer");
    assert_ok(&out, "cargo build --target aarch64-unknown-linux-gnu (tests/consumers/cudarc-runtime)");
    std::fs::copy(
        target.join("aarch64-unknown-linux-gnu/release/cudarc-runtime-consumer"),
        arm.bin.join("cudarc-runtime-consumer"),
    )
    .unwrap();
}

/// The simulator's environment from the kit's aarch64 `tms-sim env` (itself run under qemu).
fn sim_env(arm: &Arm, node: &str, devices: u32, dir: Option<&Path>) -> Vec<(String, String)> {
    let state = dir.map(Path::to_path_buf).unwrap_or_else(|| arm.kit.join("sim-layout"));
    let out = qemu(None)
        .arg(arm.kit.join("bin/tms-sim"))
        .args(["env", "--json", "--memory", "2GiB", "--node", node])
        .arg("--devices")
        .arg(devices.to_string())
        .arg("--lib")
        .arg(arm.kit.join("lib"))
        .arg("--dir")
        .arg(state)
        .output()
        .expect("run qemu-aarch64 tms-sim env");
    assert_ok(&out, "qemu-aarch64 tms-sim env");
    env_of(&out.stdout)
}

/// `qemu-aarch64` with the aarch64 C library, and `-p PAGE` when given (the page size the guest
/// is told). Nothing of this process's preloads reaches qemu itself.
fn qemu(page: Option<u32>) -> Command {
    let mut cmd = Command::new("qemu-aarch64");
    cmd.args(["-L", SYSROOT]).env_remove("LD_PRELOAD").stdin(Stdio::null());
    if let Some(p) = page {
        cmd.arg("-p").arg(p.to_string());
    }
    cmd
}

/// A private emulated node: `devices` simulated devices, its own control folder.
struct Node {
    dir: tempfile::TempDir,
    env: Vec<(String, String)>,
}

impl Node {
    fn new(arm: &Arm, devices: u32) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let env = sim_env(arm, "arm", devices, Some(&dir.path().join("sim")));
        Node { dir, env }
    }

    fn control_dir(&self) -> PathBuf {
        self.dir.path().join("ctl")
    }

    /// `program args` under qemu on this node; `preload` goes into the guest's environment only
    /// (`-E`), where its loader reads it.
    fn run(
        &self,
        page: Option<u32>,
        preload: Option<&Path>,
        extra: &[(&str, &str)],
        program: &Path,
        args: &[&str],
    ) -> Command {
        let mut cmd = qemu(page);
        cmd.envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("TMS_CONTROL_DIR", self.control_dir())
            .env_remove("TMS_SIM_FAIL");
        for (k, v) in extra {
            cmd.env(k, v);
        }
        if let Some(hook) = preload {
            cmd.arg("-E").arg(format!("LD_PRELOAD={}", hook.display()));
        }
        cmd.arg(program).args(args);
        cmd
    }

    fn ctl(&self, arm: &Arm, args: &[&str]) -> std::process::Output {
        qemu(None)
            .arg(arm.kit.join("bin/tms-ctl"))
            .args(args)
            .env("TMS_CONTROL_DIR", self.control_dir())
            .output()
            .expect("run qemu-aarch64 tms-ctl")
    }
}

fn elf_machine(path: &Path) -> Option<u16> {
    let head = std::fs::read(path).ok()?;
    (head.len() >= 20 && head[..4] == *b"\x7fELF").then(|| u16::from_le_bytes([head[18], head[19]]))
}

fn elf_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_symlink() {
            continue;
        }
        if p.is_dir() {
            elf_files(&p, found);
        } else if elf_machine(&p).is_some() {
            found.push(p);
        }
    }
}

#[test]
fn the_aarch64_wheel_and_kit_hold_aarch64_programs_only_with_upstreams_file_names() {
    let Some(arm) = arm() else { return };
    let name = arm.wheel.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("tms_memory_saver-") && name.ends_with("-manylinux2014_aarch64.whl"), "{name}");
    // The names torch_memory_saver's aarch64 wheel installs, which slime's LD_PRELOAD lookup and
    // SGLang's configure_subprocess() find (setup.py's HOOK_NAMES).
    for mode in ["preload", "torch"] {
        for cuda in ["", "_cu12", "_cu13"] {
            let f = arm.wheel_dir.join(format!("torch_memory_saver_hook_mode_{mode}{cuda}.abi3.so"));
            assert_eq!(elf_machine(&f), Some(EM_AARCH64), "{} missing or not AArch64", f.display());
        }
    }
    let mut elves = Vec::new();
    elf_files(&arm.kit, &mut elves);
    elf_files(&arm.wheel_dir, &mut elves);
    assert!(elves.len() >= 12, "{elves:?}");
    let others: Vec<_> = elves.iter().filter(|p| elf_machine(p) != Some(EM_AARCH64)).collect();
    assert!(others.is_empty(), "not AArch64: {others:?}");
    // glibc 2.17 at most, as manylinux2014 promises (build-wheel.sh checks the wheel; here the
    // kit's programs, and the simulator's helper objects that its build compiles in C).
    for p in &elves {
        let out = Command::new("objdump").arg("-T").arg(p).output().expect("objdump");
        let text = String::from_utf8_lossy(&out.stdout);
        for v in text.split("GLIBC_").skip(1) {
            let ver: Vec<u32> = v
                .split(|c: char| !c.is_ascii_digit() && c != '.')
                .next()
                .unwrap_or("")
                .split('.')
                .filter_map(|n| n.parse().ok())
                .collect();
            assert!(ver <= vec![2, 17], "{} needs GLIBC_{ver:?}", p.display());
        }
    }
}

#[test]
fn c_consumers_pass_under_qemu_with_the_built_hook_and_the_wheels() {
    let Some(arm) = arm() else { return };
    let runs: &[&[&str]] = &[
        &["cycle", "cuda", "5"],
        &["cycle", "acl", "5"],
        &["acl-policies", "acl"],
        &["threads", "cuda", "20"],
        &["oom-resume", "acl"],
    ];
    for hook in [arm.built_hook(), arm.wheel_hook()] {
        for style in ["hook_consumer-linked", "hook_consumer-dlsym"] {
            for args in runs {
                let node = Node::new(arm, 1);
                let out = node.run(None, Some(&hook), &[], &arm.bin.join(style), args).output().unwrap();
                assert_ok(&out, &format!("{style} {args:?} under {}", hook.display()));
                assert!(String::from_utf8_lossy(&out.stdout).contains("ok"), "{args:?}: {:?}", out);
            }
        }
    }
    // One tag on both devices, through ACL's dlsym path.
    let node = Node::new(arm, 2);
    let consumer = arm.bin.join("hook_consumer-dlsym");
    let out = node.run(None, Some(&arm.wheel_hook()), &[], &consumer, &["multi-device", "acl", "3"]).output().unwrap();
    assert_ok(&out, "multi-device acl");
    assert!(String::from_utf8_lossy(&out.stdout).contains("multi-device ok: devices=2"), "{out:?}");
}

#[test]
fn with_64_kib_pages_the_simulator_and_the_hook_keep_every_byte() {
    let Some(arm) = arm() else { return };
    let node = Node::new(arm, 1);
    let page = node.run(Some(65536), None, &[], &arm.bin.join("page_size"), &[]).output().unwrap();
    assert_ok(&page, "page_size");
    assert_eq!(field(&String::from_utf8_lossy(&page.stdout), "page_size"), 65536);
    let consumer = arm.bin.join("hook_consumer-linked");
    let disk = node.dir.path().join("disk");
    std::fs::create_dir_all(&disk).unwrap();
    let disk = disk.to_str().unwrap();
    let runs: [&[&str]; 4] =
        [&["cycle", "cuda", "5"], &["cycle", "acl", "5"], &["rdma", "cuda"], &["disk-backup", "cuda", disk]];
    for args in runs {
        let out = node.run(Some(65536), Some(&arm.built_hook()), &[], &consumer, args).output().unwrap();
        assert_ok(&out, "a consumer with 64 KiB pages");
        assert!(String::from_utf8_lossy(&out.stdout).contains("ok"), "{out:?}");
    }
}

#[test]
fn dlsym_next_and_default_keep_their_meaning_under_the_aarch64_trampoline() {
    let Some(arm) = arm() else { return };
    let node = Node::new(arm, 1);
    let (main, probe) = (arm.bin.join("dlsym_probe_main"), arm.bin.join("dlsym_probe.so"));
    let probe = probe.to_str().unwrap();
    let plain = node.run(None, None, &[], &main, &[probe]).output().unwrap();
    let hooked = node.run(None, Some(&arm.built_hook()), &[], &main, &[probe]).output().unwrap();
    assert_ok(&plain, "dlsym_probe without the hook");
    assert_ok(&hooked, "dlsym_probe under the hook");
    assert!(String::from_utf8_lossy(&plain.stdout).contains(" ok"), "{plain:?}");
    assert_eq!(plain.stdout, hooked.stdout);
}

#[test]
fn nccl_and_hccl_communicators_work_under_the_hook_on_aarch64() {
    let Some(arm) = arm() else { return };
    let node = Node::new(arm, 2);
    let out =
        node.run(None, Some(&arm.wheel_hook()), &[], &arm.bin.join("nccl_consumer"), &["cycle"]).output().unwrap();
    assert_ok(&out, "nccl_consumer cycle");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("nccl cycle ok"), "{text}");
    assert!(text.contains(&format!("suspendable={},{}", 16 * MIB, 16 * MIB)), "{text}");

    // HCCL: region memory paused and resumed under two ranks' all-reduce; while it waits, the
    // aarch64 tms-ctl sees both communicators the hook recorded.
    let mut child = node
        .run(None, Some(&arm.wheel_hook()), &[("TMS_NAME", "hccl")], &arm.bin.join("hccl_consumer"), &[])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    if line.trim() != "ready" {
        let out = child.wait_with_output().unwrap();
        panic!("hccl_consumer: {line}{}", String::from_utf8_lossy(&out.stderr));
    }
    let status = node.ctl(arm, &["--json", "status", "hccl"]);
    assert_ok(&status, "tms-ctl status hccl");
    let doc: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let comms = doc[0]["status"]["communicators"].as_array().cloned().unwrap_or_default();
    let mut devices: Vec<i64> =
        comms.iter().filter(|c| c["library"] == "hccl").filter_map(|c| c["device"].as_i64()).collect();
    devices.sort_unstable();
    assert_eq!(devices, [0, 1], "{doc}");
    writeln!(child.stdin.take().unwrap(), "go").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_ok(&out, "hccl_consumer");
    assert!(rest.contains("hccl ok ranks=2"), "{rest}");
}

#[test]
fn tms_ctl_pauses_and_resumes_a_cudarc_program_under_qemu() {
    let Some(arm) = arm() else { return };
    let node = Node::new(arm, 1);
    // The program knows nothing of tms: every allocation is tagged from the start
    // (TMS_INIT_ENABLE, torch_memory_saver's variable) and backed up on pause.
    let env = [("TMS_NAME", "cudarc"), ("TMS_INIT_ENABLE", "1"), ("TMS_INIT_ENABLE_CPU_BACKUP", "1")];
    let mut child = node
        .run(None, Some(&arm.wheel_hook()), &env, &arm.bin.join("cudarc-runtime-consumer"), &["64"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut ask = |cmd: Option<&str>| {
        if let Some(c) = cmd {
            writeln!(stdin, "{c}").unwrap();
        }
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    };
    let ready = ask(None);
    assert!(ready.starts_with("ready bytes=67108864"), "{ready}");
    let live = field(&ready, "free");
    let pause = node.ctl(arm, &["--json", "pause", "cudarc"]);
    assert_ok(&pause, "tms-ctl pause cudarc");
    let paused = ask(Some("info"));
    assert!(field(&paused, "free") >= live + 64 * MIB, "free memory did not rise by 64 MiB: {live} -> {paused}");
    let resume = node.ctl(arm, &["--json", "resume", "cudarc"]);
    assert_ok(&resume, "tms-ctl resume cudarc");
    assert_eq!(ask(Some("check")), "ok identical bytes=67108864");
    assert_eq!(field(&ask(Some("info")), "free"), live);
    ask(Some("quit"));
    let out = child.wait_with_output().unwrap();
    assert_ok(&out, "cudarc-runtime-consumer");
}

#[test]
fn the_aarch64_kit_refuses_to_run_on_this_x86_64_machine_naming_the_prepare_to_use() {
    let Some(arm) = arm() else { return };
    if std::env::consts::ARCH != "x86_64" {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(arm.kit.join("npu-check.sh"))
        .args(["run", "--sim"])
        .arg(&arm.kit)
        .arg(out.path())
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2), "{run:?}");
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("this kit is for aarch64 and this machine is x86_64"), "{err}");
    assert!(err.contains("prepare --arch x86_64"), "{err}");
}
