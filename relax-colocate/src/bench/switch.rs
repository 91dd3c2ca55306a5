//! The colocate switch: sleep, update_weights and wake_up per step of a `relax-colocate run
//! --memory-profile`, read from its summary.

use super::options::{DeviceKind, Options};
use super::scenario::{About, Bench, Scenario};
use super::table::{f, human, table};
use crate::run::summary::Summary;
use crate::vendor::ApiKind;
use serde_json::{Value, json};
use std::process::Command;

pub(super) struct Switch;

impl Scenario for Switch {
    fn about(&self) -> About {
        About {
            key: "colocate_switch",
            step: "the colocate switch (sleep + update_weights + wake_up) from a memory-profile run",
        }
    }

    fn run(&mut self, bench: &Bench) -> Result<Value, String> {
        let switch = measure(bench.device, bench.api, bench.opts)?;
        println!("\nColocate switch per step (median over the run's steps; relax-colocate run --memory-profile)");
        let row = vec![
            switch["profile"].as_str().unwrap_or("").to_string(),
            human(f(&switch, "trainer_bytes")),
            human(f(&switch, "weights_bytes")),
            format!("{:.4}", f(&switch, "sleep_s")),
            format!("{:.4}", f(&switch, "update_weights_s")),
            format!("{:.4}", f(&switch, "wake_up_s")),
            format!("{:.4}", f(&switch, "switch_s")),
            format!("{:.4}", f(&switch, "switch_s_per_gib")),
        ];
        let header = ["profile", "trainer", "weights", "sleep s", "update s", "wake_up s", "switch s", "s per GiB"];
        println!("{}", table(&header, vec![row]));
        Ok(switch)
    }
}

/// Runs `relax-colocate run` with a memory profile and reads the switch phases from its summary.
/// "Per GiB" is per GiB of trainer state (weights, grads, optimizer), which sleep and wake_up
/// move; update_weights moves the weights alone.
fn measure(device: DeviceKind, api: ApiKind, opts: &Options) -> Result<Value, String> {
    let (profile, scale, steps) = match (device, opts.quick) {
        (_, true) => ("tiny", "1.0", "3"),
        (DeviceKind::Sim, false) => ("qwen3-0.6b", "0.1", "5"),
        _ => ("qwen3-0.6b", "1.0", "5"),
    };
    let out = opts.out.join("colocate");
    let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
    cmd.args(["run", "--quiet", "--json", "--steps", steps, "--memory-profile", profile])
        .args([
            "--device",
            match device {
                DeviceKind::Sim => "sim",
                DeviceKind::Npu => "npu",
                _ => "cuda",
            },
        ])
        .args(["--set", &format!("sim.api={}", api.as_str())])
        .args(["--set", &format!("memory.scale={scale}")])
        .args(["--set", &format!("sim.copy_gbps={}", opts.sim_copy_gbps)])
        .arg("--out")
        .arg(&out)
        .env_remove("LD_PRELOAD");
    if let Some(h) = &opts.hook {
        cmd.arg("--hook").arg(h);
    }
    let run = cmd.output().map_err(|e| format!("cannot run relax-colocate run: {e}"))?;
    if !run.status.success() {
        return Err(format!("the colocate run failed:\n{}", String::from_utf8_lossy(&run.stderr)));
    }
    let summary: Summary = serde_json::from_slice(&run.stdout).map_err(|e| format!("colocate run summary: {e}"))?;
    let run = summary.run.ok_or("the colocate run's summary has no figures")?;
    let median = |phase: &str| run.phases.iter().find(|p| p.phase == phase).map_or(f64::NAN, |p| p.median_s);
    let (sleep, update, wake) = (median("sleep"), median("update_weights"), median("wake_up"));
    let trainer = run.memory.trainer_bytes_per_device as f64;
    let switch = sleep + update + wake;
    Ok(json!({
        "profile": format!("{profile}{}", if scale == "1.0" { String::new() } else { format!(" x{scale}") }),
        "trainer_bytes": trainer, "weights_bytes": run.memory.weights_bytes_per_device as f64,
        "sleep_s": sleep, "update_weights_s": update, "wake_up_s": wake, "switch_s": switch,
        "switch_s_per_gib": switch / (trainer / (1u64 << 30) as f64), "run_dir": out,
    }))
}
