//! The bench's worker processes: `relax-colocate bench-worker API SCENARIO ARGS...`, with the hook
//! preloaded or not, on the simulator a private node of one device each (unless told otherwise).

use crate::environment::SimNode;
use crate::vendor::ApiKind;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

pub(super) struct Env {
    pub api: ApiKind,
    /// On the simulator: its library folder and the folder of this run's nodes.
    pub sim: Option<(String, tempfile::TempDir)>,
    pub hook: PathBuf,
    pub sim_memory: String,
    pub copy_gbps: f64,
    counter: std::cell::Cell<u32>,
}

impl Env {
    pub fn new(
        api: ApiKind,
        sim: Option<(String, tempfile::TempDir)>,
        hook: PathBuf,
        sim_memory: String,
        copy_gbps: f64,
    ) -> Env {
        Env { api, sim, hook, sim_memory, copy_gbps, counter: std::cell::Cell::new(0) }
    }

    /// Runs one worker scenario; `hooked` preloads the library.
    pub fn worker(&self, hooked: bool, scenario: &str, args: &[String]) -> Result<Value, String> {
        self.worker_env(hooked, scenario, args, &[])
    }

    pub fn worker_env(
        &self,
        hooked: bool,
        scenario: &str,
        args: &[String],
        extra: &[(&str, &str)],
    ) -> Result<Value, String> {
        let out = self.command(hooked, scenario, args, extra)?.output();
        finish(scenario, out.map_err(|e| format!("cannot run the bench worker: {e}"))?)
    }

    /// The worker process of a scenario, its environment set (on the simulator: a node of its
    /// own with one device, unless `extra` says otherwise).
    pub fn command(
        &self,
        hooked: bool,
        scenario: &str,
        args: &[String],
        extra: &[(&str, &str)],
    ) -> Result<Command, String> {
        let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
        cmd.arg("bench-worker").arg(self.api.as_str()).arg(scenario).args(args).env_remove("LD_PRELOAD");
        if hooked {
            cmd.env("LD_PRELOAD", &self.hook).env("TMS_CONTROL", "0");
        }
        if let Some((libdir, dir)) = &self.sim {
            self.counter.set(self.counter.get() + 1);
            let name = format!("bench-{}", self.counter.get());
            let node = SimNode {
                dir: dir.path(),
                name: &name,
                devices: 1,
                memory: &self.sim_memory,
                copy_gbps: self.copy_gbps,
            };
            cmd.env("LD_LIBRARY_PATH", libdir).envs(node.vars());
        }
        for (k, v) in extra {
            cmd.env(k, v);
        }
        Ok(cmd)
    }
}

/// A worker's JSON, or why it failed.
pub(super) fn finish(scenario: &str, out: std::process::Output) -> Result<Value, String> {
    if !out.status.success() {
        return Err(format!(
            "bench scenario {scenario} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("scenario {scenario}: bad output ({e})"))
}
