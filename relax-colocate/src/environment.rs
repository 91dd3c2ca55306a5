//! What a launched process needs, for `run` and `bench` alike: the hook (`find_hook`), and the
//! environment that puts it on tms-sim, as `tms-sim env` defines it: the runtime-named links on
//! the library path, and for Python programs the start-up hook that loads the simulator before
//! PyTorch (whose RPATH would otherwise find NVIDIA's runtime) and runs its kernels on the CPU.
//! Asking the tool keeps one definition of it: `SimNode` holds the tool's inputs (the node a
//! process joins, its devices and memory, the modelled copy bus and link, the connect timeout),
//! for the runner's workers and the bench's alike, and no name of the simulator's variables is
//! written here or anywhere else in this crate (tests/tests/sim.rs checks that).

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

/// The worker-protocol client external Python workers import as `relax_worker`
/// (docs/worker-protocol.md): the runner's own, carried in its binary so that a worker always
/// speaks the protocol of the runner that started it.
const RELAX_WORKER_PY: &str = include_str!("../python/relax_worker.py");

/// Writes `relax_worker.py` into `dir` and puts `dir` first on the PYTHONPATH in `env` (else on
/// this process's), so that the workers started with `env` import the runner's own client. The
/// compute model's figures go beside it, where a Python worker that models compute as the
/// built-in ones do (scripts/torch_worker.py) reads the runner's own.
pub(crate) fn provide_relax_worker(env: &mut Vec<(String, String)>, dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    for (name, text) in [("relax_worker.py", RELAX_WORKER_PY), ("relax_compute_model.json", crate::run::FIGURES_JSON)] {
        let file = dir.join(name);
        std::fs::write(&file, text).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    }
    let name = "PYTHONPATH";
    let rest = match env.iter().rposition(|(k, _)| k == name) {
        Some(at) => Some(env.remove(at).1),
        None => std::env::var(name).ok(),
    };
    let joined = match rest.filter(|r| !r.is_empty()) {
        Some(r) => format!("{}:{r}", dir.display()),
        None => dir.display().to_string(),
    };
    env.push((name.to_string(), joined));
    Ok(())
}

pub(crate) struct SimEnvironment {
    /// Variables to set in the launched process, folder lists already joined with this
    /// process's values.
    pub vars: Vec<(String, String)>,
    /// Device memory a process's context takes on the simulator, on the CUDA API and on ACL.
    pub context_bytes: (u64, u64),
}

impl SimEnvironment {
    /// What a context takes on `api`.
    pub fn context_bytes(&self, api: crate::vendor::ApiKind) -> u64 {
        match api {
            crate::vendor::ApiKind::Cuda => self.context_bytes.0,
            crate::vendor::ApiKind::Acl => self.context_bytes.1,
        }
    }
}

/// A simulated node a launched process runs on: the inputs of `tms-sim env`, each left to the
/// simulator's default when None (docs/simulator.md).
#[derive(Default, Clone)]
pub(crate) struct SimNode {
    /// The folder the node's shared state lives in.
    pub dir: Option<PathBuf>,
    pub name: Option<String>,
    pub devices: Option<u32>,
    /// Each device's capacity, in tms's size syntax.
    pub memory: Option<String>,
    /// The modelled copy bus per direction, GB/s.
    pub copy_gbps: Option<f64>,
    /// The collectives' link, INTRA[,INTER] GB/s.
    pub link_gbps: Option<String>,
    /// Seconds a communicator's ranks wait for each other.
    pub connect_timeout_s: Option<u64>,
    /// Host pages committed when device memory is created.
    pub commit: bool,
}

impl SimNode {
    fn args(&self) -> Vec<String> {
        let mut args = Vec::new();
        let mut arg = |flag: &str, value: Option<String>| {
            if let Some(v) = value {
                args.extend([flag.to_string(), v]);
            }
        };
        arg("--dir", self.dir.as_ref().map(|d| d.display().to_string()));
        arg("--node", self.name.clone());
        arg("--devices", self.devices.map(|d| d.to_string()));
        arg("--memory", self.memory.clone());
        arg("--copy-gbps", self.copy_gbps.map(|g| g.to_string()));
        arg("--link-gbps", self.link_gbps.clone());
        arg("--connect-timeout", self.connect_timeout_s.map(|s| s.to_string()));
        if self.commit {
            args.push("--commit".into());
        }
        args
    }
}

/// The environment of a process on `node`, as `tms-sim env --json` gives it.
pub(crate) fn sim_environment(node: &SimNode) -> Result<SimEnvironment, String> {
    let tool = exe_dir().join("tms-sim");
    let out = Command::new(&tool)
        .args(["env", "--json"])
        .args(node.args())
        .output()
        .map_err(|e| format!("cannot run {} ({e}); build it with `cargo build -p tms-sim`", tool.display()))?;
    if !out.status.success() {
        return Err(format!("{} env --json failed: {}", tool.display(), String::from_utf8_lossy(&out.stderr).trim()));
    }
    let doc: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("{} env --json printed something else than JSON ({e})", tool.display()))?;
    let object = |key: &str| doc[key].as_object().cloned().unwrap_or_default();
    let mut vars = Vec::new();
    for (name, folder) in object("prepend") {
        let folder = folder.as_str().unwrap_or_default().to_string();
        let joined = match std::env::var(&name) {
            Ok(old) if !old.is_empty() => format!("{folder}:{old}"),
            _ => folder,
        };
        vars.push((name, joined));
    }
    for (name, value) in object("set") {
        vars.push((name, value.as_str().unwrap_or_default().to_string()));
    }
    let context = |api: &str| {
        doc["context_bytes"][api]
            .as_u64()
            .ok_or_else(|| format!("{} env --json gave no context size for {api}", tool.display()))
    };
    Ok(SimEnvironment { vars, context_bytes: (context("cuda")?, context("acl")?) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// scripts/torch_worker.py finds the compute model's figures beside the relax_worker.py it
    /// imports: the runner's copies, both.
    #[test]
    fn workers_get_the_compute_model_s_figures_beside_relax_worker() {
        let dir = tempfile::tempdir().unwrap();
        let mut env = vec![("PYTHONPATH".to_string(), "/elsewhere".to_string())];
        provide_relax_worker(&mut env, dir.path()).unwrap();
        assert_eq!(env, [("PYTHONPATH".to_string(), format!("{}:/elsewhere", dir.path().display()))]);
        let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap();
        assert_eq!(read("relax_worker.py"), RELAX_WORKER_PY);
        assert_eq!(read("relax_compute_model.json"), crate::run::FIGURES_JSON);
    }
}
