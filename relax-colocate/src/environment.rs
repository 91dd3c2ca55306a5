//! What a launched process needs, for `run` and `bench` alike: the hook (`find_hook`), and the
//! environment that puts it on tms-sim, as `tms-sim env` defines it: the runtime-named links on
//! the library path, and for Python programs the start-up hook that loads the simulator before
//! PyTorch (whose RPATH would otherwise find NVIDIA's runtime) and runs its kernels on the CPU.
//! Asking the tool keeps one definition of it. `SimNode` names the node a process joins, for the
//! runner's workers and the bench's alike.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The folder of this executable, where a build puts the hook and tms-sim beside it.
pub(crate) fn exe_dir() -> PathBuf {
    std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or_default()
}

/// `libtms_hook.so`: the one given, else beside this executable or in ../lib.
pub(crate) fn find_hook(explicit: Option<&Path>) -> Result<PathBuf, String> {
    let dir = exe_dir();
    let candidates: Vec<PathBuf> = match explicit {
        Some(p) => vec![p.to_path_buf()],
        None => vec![dir.join("libtms_hook.so"), dir.join("../lib/libtms_hook.so")],
    };
    candidates.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        format!("libtms_hook.so not found (looked at {candidates:?}); build it (cargo build) or pass --hook PATH")
    })
}

pub(crate) struct SimEnvironment {
    /// The folder of runtime-named links to libtms_sim.so.
    pub lib_dir: String,
    /// Variables to set in the launched process, folder lists already joined with this
    /// process's values.
    pub vars: Vec<(String, String)>,
}

/// A simulated node a launched process runs on (docs/simulator.md's variables).
pub(crate) struct SimNode<'a> {
    /// The folder the node's shared state lives in.
    pub dir: &'a Path,
    pub name: &'a str,
    pub devices: u32,
    /// Each device's capacity, in tms's size syntax.
    pub memory: &'a str,
    /// The modelled copy bus per direction, GB/s; 0: none (host memcpy speed).
    pub copy_gbps: f64,
}

impl SimNode<'_> {
    pub fn vars(&self) -> Vec<(String, String)> {
        let mut vars = vec![
            ("TMS_SIM_DIR".to_string(), self.dir.display().to_string()),
            ("TMS_SIM_NODE".to_string(), self.name.to_string()),
            ("TMS_SIM_MEMORY".to_string(), self.memory.to_string()),
            ("TMS_SIM_DEVICES".to_string(), self.devices.to_string()),
        ];
        if self.copy_gbps > 0.0 {
            vars.push(("TMS_SIM_COPY_GBPS".to_string(), self.copy_gbps.to_string()));
        }
        vars
    }
}

pub(crate) fn sim_environment() -> Result<SimEnvironment, String> {
    let tool = exe_dir().join("tms-sim");
    let out = Command::new(&tool)
        .args(["env", "--json"])
        .output()
        .map_err(|e| format!("cannot run {} ({e}); build it with `cargo build -p tms-sim`", tool.display()))?;
    if !out.status.success() {
        return Err(format!("{} env --json failed: {}", tool.display(), String::from_utf8_lossy(&out.stderr).trim()));
    }
    let doc: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("{} env --json printed something else than JSON ({e})", tool.display()))?;
    let object = |key: &str| doc[key].as_object().cloned().unwrap_or_default();
    let mut vars = Vec::new();
    let mut lib_dir = None;
    for (name, folder) in object("prepend") {
        let folder = folder.as_str().unwrap_or_default().to_string();
        if name == "LD_LIBRARY_PATH" {
            lib_dir = Some(folder.clone());
        }
        let joined = match std::env::var(&name) {
            Ok(old) if !old.is_empty() => format!("{folder}:{old}"),
            _ => folder,
        };
        vars.push((name, joined));
    }
    for (name, value) in object("set") {
        vars.push((name, value.as_str().unwrap_or_default().to_string()));
    }
    let lib_dir = lib_dir.ok_or_else(|| format!("{} env --json named no library folder", tool.display()))?;
    Ok(SimEnvironment { lib_dir, vars })
}
