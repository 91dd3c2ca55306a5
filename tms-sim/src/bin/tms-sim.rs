//! `tms-sim`: point processes at the simulator and inspect simulated nodes.

use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tms_sim::core::config::{self, state_dir, state_file_for};

/// Names under which programs look for the vendor runtimes; each becomes a link to libtms_sim.so.
const RUNTIME_NAMES: &[&str] = &[
    "libcudart.so.12",
    "libcudart.so.13",
    "libcudart.so",
    "libcuda.so.1",
    "libcuda.so",
    "libascendcl.so",
    "libnvidia-ml.so.1",
    "libnccl.so.2",
    "libnccl.so",
    "libhccl.so",
    // The rest of CANN that torch_npu's libraries need (ascend/cann.rs).
    "libacl_op_compiler.so",
    "libge_runner.so",
    "libgraph.so",
    "libacl_tdt_channel.so",
    "libfmk_parser.so",
    "libascend_protobuf.so",
    "libatb.so",
];

#[derive(Parser)]
#[command(
    name = "tms-sim",
    version,
    about = "Emulated CUDA + Ascend devices on host memory",
    long_about = "Emulated CUDA + Ascend devices on host memory.\n\n\
        Programs run on the simulator by finding libtms_sim.so under the names of the vendor \
        runtimes (libcudart.so.12, libcudart.so.13, libcuda.so.1, libascendcl.so). `tms-sim env` \
        prints the environment that does this; `eval \"$(tms-sim env)\"` applies it to a shell. \
        PyTorch's CUDA wheels run unchanged under it: the Python start-up hook it puts on \
        PYTHONPATH loads the simulator before torch and then installs a CPU compute layer that runs \
        torch's kernels on the CPU in the simulated device memory (TMS_SIM_TORCH_LAYER=0: off; \
        its kernels are queued on their streams, asynchronous to the host; TMS_SIM_TORCH_ASYNC=0: computed in the caller).\n\n\
        Environment read by the simulator:\n  \
        TMS_SIM_NODE       node name; processes naming the same node share its devices (default: default)\n  \
        TMS_SIM_DIR        folder for node state files (default: /dev/shm, else the temp dir)\n  \
        TMS_SIM_DEVICES    devices per node, 1-64 (default 1)\n  \
        TMS_SIM_MEMORY     capacity of each device, e.g. 16GiB (default 16GiB)\n  \
        TMS_SIM_COPY_GBPS  host<->device copy rate per direction per device, GB/s (default 50; 0: no modelled time)\n  \
        TMS_SIM_PIN_GBPS   cost of allocating pinned host memory, GB/s (default: none)\n  \
        TMS_SIM_CONTEXT_MEMORY  device memory a process's context takes (default 300MiB CUDA, 200MiB ACL)\n  \
        TMS_SIM_LINK_GBPS  collectives' link, INTRA[,INTER] GB/s within and between nodes (default 450,50; 0: no modelled time)\n  \
        TMS_SIM_NCCL_CONNECT_TIMEOUT, TMS_SIM_HCCL_CONNECT_TIMEOUT  seconds ranks wait for each other to join\n  \
        TMS_SIM_NCCL_STALE_TIMEOUT  seconds a collective through a stale NCCL registration waits before it fails (default 10)\n  \
        TMS_SIM_COMMIT     1: commit host pages when device memory is created\n  \
        TMS_SIM_CUDA       0: CUDA sees no device, the node's devices are Ascend NPUs only (as on a 910B host)\n  \
        TMS_SIM_FAIL       fault injection, NAME:N[+][:CODE],... e.g. cuMemCreate:3:2;\n                     \
        NAME:N[+]:corrupt flips a byte a copy wrote (cuMemcpyHtoDAsync_v2:1:corrupt)\n\n\
        A node's devices and capacity are fixed by the first process that attaches while no live \
        process uses it.\n\nExit codes: 0 success, 1 failure, 2 usage error."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print shell `export` lines that point processes at the simulator.
    Env(EnvArgs),
    /// Print the folder of runtime-named links to libtms_sim.so (created if needed).
    LibDir {
        #[arg(long)]
        lib: Option<PathBuf>,
    },
    /// List the CUDA runtime entry points the simulator exports and how each is answered.
    Surface {
        /// Print the Markdown table docs/simulator.md carries.
        #[arg(long, conflicts_with = "json")]
        markdown: bool,
        /// Machine-readable output: [{"name": ..., "cuda_majors": "12, 13"|"12"|"13",
        /// "support": "implemented"|"not supported"}].
        #[arg(long)]
        json: bool,
    },
    /// Show a node's devices, usage and attached processes.
    Status {
        /// Node name (default: $TMS_SIM_NODE or "default").
        #[arg(long)]
        node: Option<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Print the manual page (roff; scripts/install.sh puts it in PREFIX/share/man/man1).
    Man,
}

/// Every input that decides a simulated process's environment: programs that launch processes on
/// the simulator pass these instead of naming its variables themselves.
#[derive(clap::Args)]
struct EnvArgs {
    /// The node's devices are Ascend NPUs only: CUDA sees no device, as on a 910B host (sets
    /// TMS_SIM_CUDA=0; torch_npu refuses to load beside a CUDA device).
    #[arg(long)]
    npu_only: bool,
    /// Simulated node name (sets TMS_SIM_NODE).
    #[arg(long)]
    node: Option<String>,
    /// Devices on the node (sets TMS_SIM_DEVICES).
    #[arg(long)]
    devices: Option<u32>,
    /// Capacity of each device, e.g. 16GiB (sets TMS_SIM_MEMORY).
    #[arg(long)]
    memory: Option<String>,
    /// Folder of the node state files (sets TMS_SIM_DIR).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Host<->device copy rate per direction per device, GB/s; 0: no modelled time (sets
    /// TMS_SIM_COPY_GBPS).
    #[arg(long)]
    copy_gbps: Option<f64>,
    /// The link collectives run over, INTRA[,INTER] GB/s within a node and between nodes; 0: no
    /// modelled time (sets TMS_SIM_LINK_GBPS).
    #[arg(long)]
    link_gbps: Option<String>,
    /// Seconds a communicator's ranks wait for each other to join, NCCL and HCCL alike (sets
    /// TMS_SIM_NCCL_CONNECT_TIMEOUT and TMS_SIM_HCCL_CONNECT_TIMEOUT).
    #[arg(long, value_name = "SECONDS")]
    connect_timeout: Option<u64>,
    /// Commit host pages when device memory is created, as a device does, so that timed copies
    /// take no first-touch page faults (sets TMS_SIM_COMMIT=1).
    #[arg(long)]
    commit: bool,
    /// Folder holding libtms_sim.so (default: next to this binary, or ../lib).
    #[arg(long)]
    lib: Option<PathBuf>,
    /// Print a JSON object instead, for programs that launch processes on the simulator:
    /// {"set": {NAME: VALUE}, "prepend": {NAME: FOLDER}, "context_bytes": {"cuda": N, "acl": N}}
    /// (prepend FOLDER to a `:`-separated list, or set it if the variable is empty;
    /// context_bytes: the device memory a process's context will take, by API).
    #[arg(long)]
    json: bool,
}

/// The variables `tms-sim env` sets and the folders it prepends, in the order it prints them.
type Vars = Vec<(&'static str, String)>;

fn environment(a: &EnvArgs) -> Result<(Vars, Vars), String> {
    let dir = link_dir(a.lib.as_deref())?;
    let mut prepend = vec![("LD_LIBRARY_PATH", dir.display().to_string())];
    // PyTorch reaches its runtime through an RPATH that beats LD_LIBRARY_PATH; the Python
    // start-up hook loads this file (soname libcudart.so.13) before torch so it stands in.
    let mut set = vec![("TMS_SIM_LIB", dir.join("libcudart.so.13").display().to_string())];
    if let Some(py) = python_dir() {
        prepend.push(("PYTHONPATH", py.display().to_string()));
    }
    if let Some(n) = &a.node {
        set.push(("TMS_SIM_NODE", n.clone()));
    }
    if let Some(d) = &a.dir {
        set.push(("TMS_SIM_DIR", d.display().to_string()));
    }
    if let Some(d) = a.devices {
        if !(1..=config::MAX_DEVICES as u32).contains(&d) {
            return Err(format!("--devices must be 1 to {}", config::MAX_DEVICES));
        }
        set.push(("TMS_SIM_DEVICES", d.to_string()));
    }
    if let Some(m) = &a.memory {
        config::parse_size(m).ok_or_else(|| format!("--memory {m:?} is not a size like 16GiB"))?;
        set.push(("TMS_SIM_MEMORY", m.clone()));
    }
    if let Some(g) = a.copy_gbps {
        if !(g >= 0.0 && g.is_finite()) {
            return Err(format!("--copy-gbps {g} is not a rate of 0 GB/s or more"));
        }
        set.push(("TMS_SIM_COPY_GBPS", g.to_string()));
    }
    if let Some(l) = &a.link_gbps {
        config::parse_link_gbps(l).ok_or_else(|| {
            format!("--link-gbps {l:?} is not INTRA[,INTER] in GB/s (e.g. 450,50; 0: no modelled time)")
        })?;
        set.push(("TMS_SIM_LINK_GBPS", l.trim().to_string()));
    }
    if let Some(s) = a.connect_timeout {
        set.push(("TMS_SIM_NCCL_CONNECT_TIMEOUT", s.to_string()));
        set.push(("TMS_SIM_HCCL_CONNECT_TIMEOUT", s.to_string()));
    }
    if a.commit {
        set.push(("TMS_SIM_COMMIT", "1".to_string()));
    }
    if a.npu_only {
        set.push(("TMS_SIM_CUDA", "0".to_string()));
    }
    Ok((set, prepend))
}

fn print_environment(a: &EnvArgs) -> Result<(), String> {
    let (set, prepend) = environment(a)?;
    if a.json {
        let object = |pairs: &[(&str, String)]| {
            pairs.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(v.as_str()))).collect()
        };
        // What a context takes is the simulator's to say (its own defaults or the inherited
        // TMS_SIM_CONTEXT_MEMORY), so launchers sizing a device need not know either.
        let context = config::context_bytes_from_env();
        let doc = serde_json::json!({
            "set": serde_json::Value::Object(object(&set)),
            "prepend": serde_json::Value::Object(object(&prepend)),
            "context_bytes": {
                "cuda": context.unwrap_or(tms_sim::cuda::CONTEXT_BYTES),
                "acl": context.unwrap_or(tms_sim::ascend::CONTEXT_BYTES),
            },
        });
        println!("{doc}");
        return Ok(());
    }
    for (name, folder) in &prepend {
        println!("export {name}={}${{{name}:+:${name}}}", shell_quote(folder));
    }
    for (name, value) in &set {
        println!("export {name}={}", shell_quote(value));
    }
    Ok(())
}

fn main() -> ExitCode {
    // A reader that stops early (`tms-sim env | head -1`) ends tms-sim quietly, as it ends other
    // command-line tools, instead of a panic on the broken pipe.
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("tms-sim: {msg}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Env(args) => print_environment(&args),
        Command::Man => {
            use clap::CommandFactory;
            clap_mangen::Man::new(Cli::command())
                .render(&mut std::io::stdout())
                .map_err(|e| format!("cannot write the manual page: {e}"))
        }
        Command::Surface { markdown, json } => {
            print!("{}", surface_text(markdown, json));
            Ok(())
        }
        Command::LibDir { lib } => {
            println!("{}", link_dir(lib.as_deref())?.display());
            Ok(())
        }
        Command::Status { node, json } => {
            let node = node.or_else(|| std::env::var("TMS_SIM_NODE").ok()).unwrap_or_else(|| "default".into());
            let path = state_file_for(&state_dir(), &node);
            let report = tms_sim::core::node::inspect(&path).map_err(|e| {
                format!("node {node:?} ({}): {e}. A node exists once a process has used it.", path.display())
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?);
                return Ok(());
            }
            println!("node {node} ({})", report.path);
            println!("{:<8} {:>14} {:>14} {:>14}", "device", "used", "free", "capacity");
            for (d, used) in report.used.iter().enumerate() {
                println!(
                    "{:<8} {:>14} {:>14} {:>14}",
                    d,
                    human(*used),
                    human(report.capacity.saturating_sub(*used)),
                    human(report.capacity)
                );
            }
            println!("\n{:<10} {:<6} used per device", "pid", "alive");
            for p in &report.processes {
                let used: Vec<String> = p.used.iter().map(|u| human(*u)).collect();
                println!("{:<10} {:<6} {}", p.pid, if p.alive { "yes" } else { "no" }, used.join(" "));
            }
            if report.held_by_exited.iter().any(|&b| b > 0) {
                println!(
                    "\nexited processes (alive: no) are not counted as used: a device frees their memory \
                     at once, and the node file hands it back when the next process attaches"
                );
            }
            Ok(())
        }
    }
}

fn surface_text(markdown: bool, json: bool) -> String {
    use tms_sim::cuda::exports::{SURFACE, Support};
    let label = |s: Support| match s {
        Support::Implemented => "implemented",
        Support::NotSupported => "not supported",
    };
    let mut rows: Vec<(&str, &str, &str)> = SURFACE.iter().map(|(n, s, m)| (*n, m.label(), label(*s))).collect();
    rows.sort();
    if json {
        let list: Vec<serde_json::Value> =
            rows.iter().map(|(n, m, s)| serde_json::json!({"name": n, "cuda_majors": m, "support": s})).collect();
        return serde_json::to_string_pretty(&list).unwrap_or_default() + "\n";
    }
    if markdown {
        let mut out = String::from("| runtime entry point | CUDA majors | answer |\n|---|---|---|\n");
        for (n, m, s) in rows {
            out.push_str(&format!("| `{n}` | {m} | {s} |\n"));
        }
        return out;
    }
    rows.iter().map(|(n, m, s)| format!("{n:<58} {m:<7} {s}\n")).collect()
}

fn human(bytes: u64) -> String {
    const UNITS: &[&str] = &["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{bytes} B") } else { format!("{v:.2} {}", UNITS[i]) }
}

fn shell_quote(s: &str) -> String {
    if s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-+=:".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The simulator's Python start-up hook (sitecustomize and the CPU compute layer for PyTorch):
/// `tms-sim/python` of the source tree, or `lib/tms-sim/python` of an install.
fn python_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    // Beside an installed or in-tree build first; then the checkout this binary was built from,
    // for builds whose target folder is elsewhere (CARGO_TARGET_DIR, as CI sets it).
    [
        dir.join("../lib/tms-sim/python"),
        dir.join("../../tms-sim/python"),
        dir.join("../../../tms-sim/python"),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("python"),
    ]
    .into_iter()
    .find(|p| p.join("sitecustomize.py").is_file())
    .map(|p| p.canonicalize().unwrap_or(p))
}

fn find_library(explicit: Option<&Path>) -> Result<PathBuf, String> {
    let mut candidates = Vec::new();
    if let Some(dir) = explicit {
        candidates.push(dir.join("libtms_sim.so"));
    } else if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        candidates.push(dir.join("libtms_sim.so"));
        candidates.push(dir.join("../lib/libtms_sim.so"));
        // `cargo run` places binaries of examples/tests one level down.
        candidates.push(dir.join("../libtms_sim.so"));
    }
    candidates.iter().find(|p| p.is_file()).map(|p| p.canonicalize().unwrap_or_else(|_| p.clone())).ok_or_else(|| {
        format!(
            "libtms_sim.so not found (looked at {}); build it with `cargo build -p tms-sim` or pass --lib DIR",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        )
    })
}

/// Creates (or refreshes) `<lib dir>/tms-sim-lib/` with every runtime name linking to the library.
fn link_dir(explicit: Option<&Path>) -> Result<PathBuf, String> {
    let lib = find_library(explicit)?;
    let dir = lib.parent().expect("a file has a parent").join("tms-sim-lib");
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    for name in RUNTIME_NAMES {
        let link = dir.join(name);
        if std::fs::read_link(&link).ok().as_deref() == Some(lib.as_path()) {
            continue;
        }
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&lib, &tmp).map_err(|e| format!("cannot link {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &link).map_err(|e| format!("cannot place {}: {e}", link.display()))?;
    }
    place_cuda12_name(&dir)?;
    place_name(&dir.join("nccl"), NCCL_FILE, NCCL_NAME)?;
    Ok(dir)
}

/// The object with soname `libcudart.so.12` (built by build.rs; see there) that a CUDA 12 build
/// of PyTorch needs loaded before it, in `tms-sim-lib/cuda12/`: apart from the links, so that
/// programs linked against `tms-sim-lib/libcudart.so.12` still see every function. Its file name
/// must not contain "libcudart.so": `import torch` looks for that in /proc/self/maps and, when it
/// is there, preloads NVIDIA's runtime libraries by path beside the simulator.
const CUDA12_NAME: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libcudart.so.12"));

const CUDA12_FILE: &str = "libtms_sim_cuda12.so";

/// The object with soname `libnccl.so.2` (build.rs) that PyTorch needs loaded before it, so that
/// its `NEEDED libnccl.so.2` binds to the simulator's NCCL instead of the nvidia-nccl wheel's.
const NCCL_NAME: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libnccl.so.2"));
const NCCL_FILE: &str = "libtms_sim_nccl.so";

fn place_name(sub: &Path, file: &str, bytes: &[u8]) -> Result<(), String> {
    let path = sub.join(file);
    if std::fs::read(&path).is_ok_and(|b| b == bytes) {
        return Ok(());
    }
    std::fs::create_dir_all(sub).map_err(|e| format!("cannot create {}: {e}", sub.display()))?;
    let tmp = sub.join(format!(".{file}.{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &path).map_err(|e| format!("cannot place {}: {e}", path.display()))
}

fn place_cuda12_name(dir: &Path) -> Result<(), String> {
    let sub = dir.join("cuda12");
    let path = sub.join(CUDA12_FILE);
    // Its first name, which made torch load NVIDIA's libraries beside the simulator (see above).
    let _ = std::fs::remove_file(sub.join("libcudart.so.12"));
    if std::fs::read(&path).is_ok_and(|b| b == CUDA12_NAME) {
        return Ok(());
    }
    std::fs::create_dir_all(&sub).map_err(|e| format!("cannot create {}: {e}", sub.display()))?;
    let tmp = sub.join(format!(".{CUDA12_FILE}.{}", std::process::id()));
    std::fs::write(&tmp, CUDA12_NAME).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &path).map_err(|e| format!("cannot place {}: {e}", path.display()))
}
