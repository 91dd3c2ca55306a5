//! The bench's worker processes: `relax-colocate bench-worker API SCENARIO ARGS...`, with the hook
//! preloaded or not, on the simulator a private node of one device each (unless told otherwise).

use crate::environment::{SimNode, sim_environment};
use crate::vendor::ApiKind;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

pub(super) struct Env {
    pub api: ApiKind,
    /// On the simulator: the folder of this run's nodes.
    pub sim: Option<tempfile::TempDir>,
    pub hook: PathBuf,
    pub sim_memory: String,
    pub copy_gbps: f64,
    counter: std::cell::Cell<u32>,
}

impl Env {
    pub fn new(api: ApiKind, sim: Option<tempfile::TempDir>, hook: PathBuf, sim_memory: String, copy_gbps: f64) -> Env {
        Env { api, sim, hook, sim_memory, copy_gbps, counter: std::cell::Cell::new(0) }
    }

    /// Runs one worker scenario; `hooked` preloads the library.
    pub fn worker(&self, hooked: bool, scenario: &str, args: &[String]) -> Result<Value, String> {
        self.worker_with(hooked, scenario, args, &SimNode::default(), &[])
    }

    /// Same, on the simulator with what `node` sets (see `command`), and `extra` variables.
    pub fn worker_with(
        &self,
        hooked: bool,
        scenario: &str,
        args: &[String],
        node: &SimNode,
        extra: &[(&str, &str)],
    ) -> Result<Value, String> {
        let out = self.command(hooked, scenario, args, node, extra)?.output();
        finish(scenario, out.map_err(|e| format!("cannot run the bench worker: {e}"))?)
    }

    /// The worker process of a scenario, its environment set: on the simulator, what `node`
    /// sets and else a node of its own with one device of the bench's size and copy bus.
    pub fn command(
        &self,
        hooked: bool,
        scenario: &str,
        args: &[String],
        node: &SimNode,
        extra: &[(&str, &str)],
    ) -> Result<Command, String> {
        let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
        cmd.arg("bench-worker").arg(self.api.as_str()).arg(scenario).args(args).env_remove("LD_PRELOAD");
        if hooked {
            cmd.env("LD_PRELOAD", &self.hook).env("TMS_CONTROL", "0");
        }
        if let Some(dir) = &self.sim {
            self.counter.set(self.counter.get() + 1);
            let node = SimNode {
                dir: Some(dir.path().to_path_buf()),
                name: node.name.clone().or_else(|| Some(format!("bench-{}", self.counter.get()))),
                devices: node.devices.or(Some(1)),
                memory: node.memory.clone().or_else(|| Some(self.sim_memory.clone())),
                // 0 has always left the simulator's own copy bus in place.
                copy_gbps: node.copy_gbps.or(Some(self.copy_gbps).filter(|g| *g > 0.0)),
                ..node.clone()
            };
            cmd.envs(sim_environment(&node)?.vars);
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
