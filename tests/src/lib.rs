//! Shared machinery of the end-to-end tests: build the workspace's cdylibs and binaries once,
//! ask `tms-sim env` for the simulator's environment, compile the C consumers in their three
//! loading styles, and give each test a private simulated node.

pub mod runner;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};

pub struct Workspace {
    pub root: PathBuf,
    /// target/debug or target/release, matching how the tests were built.
    pub bin_dir: PathBuf,
    /// Where compiled C artifacts go.
    pub c_out: PathBuf,
    /// Link-time stand-ins for the vendor libraries (symbol names and sonames only).
    pub stub_dir: PathBuf,
}

impl Workspace {
    pub fn hook(&self) -> PathBuf {
        self.bin_dir.join("libtms_hook.so")
    }

    pub fn sim_lib(&self) -> PathBuf {
        self.bin_dir.join("libtms_sim.so")
    }

    pub fn bin(&self, name: &str) -> PathBuf {
        self.bin_dir.join(name)
    }

    pub fn c_src(&self, name: &str) -> PathBuf {
        self.root.join("tests/c").join(name)
    }

    /// The environment `tms-sim env --json ARGS` gives a process on the simulator (`--node`,
    /// `--dir`, `--devices`, `--memory`, ...): the tests ask the simulator's own CLI, as
    /// launchers do, instead of writing its variables. Folders it would prepend are set alone,
    /// so that nothing of the test process's own library path leaks in.
    pub fn sim_env(&self, args: &[&str]) -> Vec<(String, String)> {
        let out = Command::new(self.bin("tms-sim"))
            .args(["env", "--json", "--lib"])
            .arg(&self.bin_dir)
            .args(args)
            .output()
            .expect("run tms-sim env");
        assert!(out.status.success(), "tms-sim env {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        env_of(&out.stdout)
    }
}

/// The variables `tms-sim env --json` printed, prepended folders set alone.
pub fn env_of(json: &[u8]) -> Vec<(String, String)> {
    let doc: serde_json::Value = serde_json::from_slice(json).expect("tms-sim env --json prints JSON");
    ["prepend", "set"]
        .iter()
        .flat_map(|key| doc[key].as_object().cloned().unwrap_or_default())
        .map(|(k, v)| (k, v.as_str().expect("a string").to_string()))
        .collect()
}

/// Builds what the tests run (once per test binary) and prepares the folders.
pub fn workspace() -> &'static Workspace {
    static WS: OnceLock<Workspace> = OnceLock::new();
    WS.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is in the workspace").to_path_buf();
        let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
        let release = !cfg!(debug_assertions);
        let mut cmd = Command::new(env!("CARGO"));
        cmd.current_dir(&root).args(["build", "--quiet"]);
        for package in ["tms-sim", "tms-hook", "tms-ctl", "relax-colocate"] {
            cmd.args(["-p", package]);
        }
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "cargo build of the cdylibs failed");
        let bin_dir = target.join(if release { "release" } else { "debug" });
        let c_out = target.join("tms-e2e");
        std::fs::create_dir_all(&c_out).unwrap();
        // The simulator's runtime-named links are laid out by its own CLI, as users get them
        // (`sim_env`).
        let stub_dir = c_out.join("stubs");
        std::fs::create_dir_all(&stub_dir).unwrap();
        let ws = Workspace { root, bin_dir, c_out, stub_dir };
        build_stubs(&ws);
        ws
    })
}

/// The vendor functions vendor.h declares, by library.
fn vendor_functions(ws: &Workspace) -> (Vec<String>, Vec<String>, Vec<String>) {
    let header = std::fs::read_to_string(ws.c_src("vendor.h")).unwrap();
    let (mut rt, mut drv, mut acl) = (Vec::new(), Vec::new(), Vec::new());
    for line in header.lines() {
        let Some(open) = line.find('(') else { continue };
        let Some(name) = line[..open].split_whitespace().last() else { continue };
        let name = name.trim_start_matches('*').to_string();
        if !(line.starts_with("cudaError_t")
            || line.starts_with("CUresult")
            || line.starts_with("aclError")
            || line.starts_with("const char"))
        {
            continue;
        }
        if name.starts_with("cuda") {
            rt.push(name);
        } else if name.starts_with("cu") {
            drv.push(name);
        } else if name.starts_with("acl") {
            acl.push(name);
        }
    }
    (rt, drv, acl)
}

/// Stand-ins to link against, shaped like the real libraries: right sonames, and the runtime's
/// symbols under the `libcudart.so.12` version node, so consumers carry the same references as
/// programs built against the real toolkit.
fn build_stubs(ws: &Workspace) {
    let (rt, drv, acl) = vendor_functions(ws);
    let mk = |soname: &str, names: &[String], version_node: Option<&str>| {
        let src = ws.stub_dir.join(format!("{soname}.c"));
        let body: String = names.iter().map(|n| format!("void {n}(void) {{}}\n")).collect();
        std::fs::write(&src, body).unwrap();
        let mut args = vec![
            "-shared".to_string(),
            "-fPIC".into(),
            "-o".into(),
            ws.stub_dir.join(soname).display().to_string(),
            src.display().to_string(),
            format!("-Wl,-soname,{soname}"),
        ];
        if let Some(node) = version_node {
            let map = ws.stub_dir.join(format!("{soname}.map"));
            std::fs::write(&map, format!("{node} {{ global: *; }};\n")).unwrap();
            args.push(format!("-Wl,--version-script={}", map.display()));
        }
        cc(&args);
    };
    mk("libcudart.so.12", &rt, Some("libcudart.so.12"));
    mk("libcuda.so.1", &drv, None);
    mk("libascendcl.so", &acl, None);
    let nccl: Vec<String> = NCCL_FUNCTIONS.iter().map(|n| n.to_string()).collect();
    mk("libnccl.so.2", &nccl, None);
}

/// The NCCL functions tests/c/nccl_consumer.c calls (it declares them itself).
const NCCL_FUNCTIONS: &[&str] = &[
    "ncclCommInitAll",
    "ncclCommDestroy",
    "ncclCommSuspend",
    "ncclCommResume",
    "ncclCommMemStats",
    "ncclAllReduce",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclGetLastError",
];

fn cc(args: &[String]) {
    let out = Command::new("cc").args(args).output().expect("run cc");
    assert!(out.status.success(), "cc {:?} failed:\n{}", args, String::from_utf8_lossy(&out.stderr));
}

/// Compiles `sources` into `name` under target/tms-e2e once per test binary; atomic against other
/// test binaries doing the same.
pub fn compile(name: &str, sources: &[PathBuf], extra: &[&str]) -> PathBuf {
    static DONE: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let ws = workspace();
    let mut done = DONE.get_or_init(Default::default).lock().unwrap();
    if let Some(p) = done.get(name) {
        return p.clone();
    }
    let out = ws.c_out.join(name);
    let tmp = ws.c_out.join(format!(".{name}.{}", std::process::id()));
    let mut args: Vec<String> = vec!["-O1".into(), "-g".into(), "-Wall".into(), "-o".into(), tmp.display().to_string()];
    args.extend(sources.iter().map(|s| s.display().to_string()));
    args.push(format!("-I{}", ws.root.join("tests/c").display()));
    args.push(format!("-I{}", ws.root.join("include").display()));
    args.extend(extra.iter().map(|s| s.to_string()));
    cc(&args);
    std::fs::rename(&tmp, &out).unwrap();
    done.insert(name.to_string(), out.clone());
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Executable linked against the sonames (calls through the PLT).
    Linked,
    /// Shared library linked against the sonames, dlopened RTLD_LOCAL by a loader.
    Plugin,
    /// Every call through dlopen(soname) + dlsym(handle, name).
    Dlsym,
}

pub const STYLES: [Style; 3] = [Style::Linked, Style::Plugin, Style::Dlsym];

/// A compiled C program in one loading style: the argv prefix that runs it.
pub fn c_program(base: &str, style: Style) -> Vec<PathBuf> {
    let ws = workspace();
    let src = ws.c_src(&format!("{base}.c"));
    let link = |v: &mut Vec<String>| {
        v.push(format!("-L{}", ws.stub_dir.display()));
        v.extend(["-l:libcudart.so.12", "-l:libcuda.so.1", "-l:libascendcl.so", "-lpthread", "-ldl"].map(String::from));
    };
    match style {
        Style::Linked => {
            let mut extra = Vec::new();
            link(&mut extra);
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            vec![compile(&format!("{base}-linked"), &[src, ws.c_src("main_direct.c")], &extra)]
        }
        Style::Plugin => {
            let mut extra = vec!["-shared".to_string(), "-fPIC".to_string()];
            link(&mut extra);
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            let plugin = compile(&format!("{base}-plugin.so"), &[src], &extra);
            let loader = compile("loader", &[ws.c_src("main_plugin.c")], &["-ldl"]);
            vec![loader, plugin]
        }
        Style::Dlsym => vec![compile(
            &format!("{base}-dlsym"),
            &[src, ws.c_src("main_direct.c")],
            &["-DTMS_TEST_DLSYM", "-lpthread", "-ldl"],
        )],
    }
}

/// Device memory a CUDA context takes on the simulator by default (tms-sim's
/// `CUDA_CONTEXT_BYTES`; Ascend contexts take less).
pub const CONTEXT_BYTES: u64 = 300 << 20;

/// Bytes in `16GiB`, `256MiB` (the sizes tests write).
pub fn size_bytes(text: &str) -> u64 {
    let (num, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = num.parse().expect("a size");
    n * match unit {
        "" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => panic!("unknown unit {other}"),
    }
}

/// A private simulated node: its own state folder, so concurrent tests never share devices.
/// `memory` is what a process has left once its CUDA context exists: the devices' capacity is
/// that plus `CONTEXT_BYTES`, so tests keep their arithmetic while contexts cost what they cost.
pub struct SimNode {
    pub dir: tempfile::TempDir,
    pub memory: String,
    pub devices: u32,
    pub extra_env: Vec<(String, String)>,
}

impl SimNode {
    pub fn new(memory: &str) -> SimNode {
        SimNode { dir: tempfile::tempdir().unwrap(), memory: memory.to_string(), devices: 1, extra_env: Vec::new() }
    }

    /// Each device's capacity: `memory` plus one CUDA context.
    pub fn capacity(&self) -> u64 {
        size_bytes(&self.memory) + CONTEXT_BYTES
    }

    pub fn with_devices(mut self, devices: u32) -> SimNode {
        self.devices = devices;
        self
    }

    pub fn env(mut self, key: &str, value: &str) -> SimNode {
        self.extra_env.push((key.to_string(), value.to_string()));
        self
    }

    /// This node's private control-socket folder.
    pub fn control_dir(&self) -> PathBuf {
        self.dir.path().join("ctl")
    }

    /// `tms-ctl` pointed at this node's sockets.
    pub fn ctl(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(workspace().bin("tms-ctl"));
        cmd.args(args).env("TMS_CONTROL_DIR", self.control_dir()).stdin(Stdio::null());
        cmd
    }

    /// A command for `argv` (program first) on this node.
    pub fn command(&self, argv: &[PathBuf]) -> Command {
        let ws = workspace();
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]);
        let (dir, memory, devices) =
            (self.dir.path().display().to_string(), self.capacity().to_string(), self.devices.to_string());
        let sim = ws.sim_env(&["--dir", &dir, "--node", "test", "--memory", &memory, "--devices", &devices]);
        // Fault injection is what a test asks for (`env`), never what it inherits.
        cmd.envs(sim)
            .env("TMS_CONTROL_DIR", self.control_dir())
            .env_remove("LD_PRELOAD")
            .env_remove("TMS_SIM_FAIL")
            .stdin(Stdio::null());
        for (k, v) in &self.extra_env {
            cmd.env(k, v);
        }
        cmd
    }

    /// Same, preloading the hook.
    pub fn hooked(&self, argv: &[PathBuf]) -> Command {
        let mut cmd = self.command(argv);
        cmd.env("LD_PRELOAD", workspace().hook());
        cmd
    }
}

/// Runs to completion; panics with both streams when the exit status is not 0.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("spawn");
    assert_ok(&out, &format!("{cmd:?}"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn assert_ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed with {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Extracts `key=NUMBER` from program output.
pub fn field(text: &str, key: &str) -> u64 {
    let pat = format!("{key}=");
    let start = text.find(&pat).unwrap_or_else(|| panic!("no {key}= in output:\n{text}")) + pat.len();
    text[start..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

pub const MIB: u64 = 1 << 20;

/// A hooked C program in `serve` mode, driven line by line over stdin (see hook_consumer.c).
pub struct Served {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Served {
    pub fn start(node: &SimNode, api: &str) -> Served {
        Served::start_with(node, api, &[])
    }

    pub fn start_with(node: &SimNode, api: &str, env: &[(&str, &str)]) -> Served {
        let mut argv = c_program("hook_consumer", Style::Linked);
        argv.extend(["serve".into(), api.into()]);
        let mut cmd = node.hooked(&argv);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Served { child, stdin, stdout }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    pub fn quit(mut self) {
        writeln!(self.stdin, "quit").unwrap();
        assert!(self.child.wait().unwrap().success());
    }
}
