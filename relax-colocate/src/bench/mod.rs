//! `relax-colocate bench`: the hook's costs measured against the physical limit in the same run.
//!
//! Each scenario runs in a child process (`relax-colocate bench-worker`), with libtms_hook.so
//! preloaded or not as the comparison needs, on the simulator (a private node) or the real
//! driver. Results: tables on stdout, `results.json` and SVG plots in the output folder.
//!
//! Scenarios go through the CUDA API (`--device cuda`) or the Ascend ACL API (`--device npu`);
//! the simulator serves both, `--api` picking one (CUDA by default), so CI proves the NPU path.

pub mod collective;
mod costs;
mod options;
pub mod plot;
mod scenario;
mod spawn;
mod suspend;
mod switch;
mod table;
pub mod upstream;
pub mod worker;

use crate::environment::{SimNode, find_hook, sim_environment};
use crate::vendor::ApiKind;
pub use options::{DeviceKind, Options, UpstreamLib};
use scenario::{Bench, Results, Scenario};
use serde_json::{Value, json};
use spawn::Env;
use std::path::PathBuf;
use table::{Target, print_targets};

fn cuda_present() -> bool {
    crate::runtime::can_load(c"libcuda.so.1")
}

fn acl_present() -> bool {
    crate::runtime::can_load(c"libascendcl.so")
}

/// The device and API a run uses, or why that pair cannot run here (naming the fix).
fn resolve(device: DeviceKind, api: Option<ApiKind>) -> Result<(DeviceKind, ApiKind), String> {
    let device = match device {
        DeviceKind::Auto if cuda_present() => DeviceKind::Cuda,
        DeviceKind::Auto if acl_present() => DeviceKind::Npu,
        DeviceKind::Auto => DeviceKind::Sim,
        d => d,
    };
    match (device, api) {
        (DeviceKind::Cuda, Some(ApiKind::Acl)) => {
            Err("--device cuda --api acl: a CUDA device takes the CUDA API; use --device npu for ACL".into())
        }
        (DeviceKind::Npu, Some(ApiKind::Cuda)) => {
            Err("--device npu --api cuda: an Ascend NPU takes the ACL API; use --device cuda for CUDA".into())
        }
        (DeviceKind::Cuda, _) if !cuda_present() => {
            Err("--device cuda: libcuda.so.1 cannot be loaded on this machine; use --device sim".into())
        }
        (DeviceKind::Npu, _) if !acl_present() => Err("--device npu: libascendcl.so cannot be loaded on this \
             machine; source CANN's set_env.sh (e.g. . /usr/local/Ascend/ascend-toolkit/set_env.sh) or use \
             --device sim --api acl"
            .into()),
        (DeviceKind::Npu, _) => Ok((device, ApiKind::Acl)),
        (d, api) => Ok((d, api.unwrap_or(ApiKind::Cuda))),
    }
}

/// The run's verdict on its targets: how many were judged, how many missed.
pub struct Verdict {
    pub targets: usize,
    pub missed: Vec<String>,
}

/// The scenarios in the order they run.
fn scenarios(api: ApiKind, upstream_lib: Result<PathBuf, String>) -> Vec<Box<dyn Scenario>> {
    vec![
        Box::new(costs::Passthrough(api)),
        Box::new(costs::Region),
        Box::new(costs::Bytes),
        Box::new(costs::Count),
        Box::new(costs::Memory),
        Box::new(switch::Switch),
        Box::new(upstream::Upstream::new(upstream_lib)),
        Box::new(collective::Collective::default()),
    ]
}

/// The order of the targets table (by scenario key): the copy-bound figures first, as the table
/// has always listed them.
const TARGET_ORDER: [&str; 8] =
    ["bytes", "region", "passthrough", "memory", "count", "colocate_switch", "side_by_side", "collective"];

pub fn run(opts: &Options) -> Result<Verdict, String> {
    let (device, api) = resolve(opts.device, opts.api)?;
    let hook = find_hook(opts.hook.as_deref())?;
    let upstream_lib = upstream_lib(&opts.upstream_lib, api)?;
    let sim = if device == DeviceKind::Sim {
        // Asked once here so that a missing tms-sim stops the bench before its first scenario.
        sim_environment(&SimNode::default())?;
        Some(tempfile::tempdir().map_err(|e| e.to_string())?)
    } else {
        None
    };
    let env = Env::new(api, sim, hook, opts.sim_memory.clone(), opts.sim_copy_gbps);
    std::fs::create_dir_all(&opts.out).map_err(|e| format!("cannot create {}: {e}", opts.out.display()))?;
    let device_name = device_name(device, api, opts.sim_copy_gbps);
    println!("relax-colocate bench on {device_name}{}", if opts.quick { ", --quick" } else { "" });
    let bench = Bench { env, device, api, opts };
    let mut scenarios = scenarios(api, upstream_lib);
    let (n, mut results) = (scenarios.len(), Results::new());
    for (i, s) in scenarios.iter_mut().enumerate() {
        eprintln!("[{}/{n}] {}...", i + 1, s.about().step);
        let figures = s.run(&bench)?;
        results.insert(s.about().key.to_string(), figures);
    }
    let targets: Vec<Target> = TARGET_ORDER
        .iter()
        .flat_map(|key| scenarios.iter().filter(|s| s.about().key == *key).flat_map(|s| s.targets(&results)))
        .collect();
    print_targets(&targets);

    let mut result = results.clone();
    result.insert("device".into(), json!(device_name));
    result.insert("vendor".into(), json!(api.as_str()));
    result.insert("quick".into(), json!(opts.quick));
    let judged = targets.iter().map(|(t, m, ok)| json!({"target": t, "measured": m, "met": ok})).collect();
    result.insert("targets".into(), Value::Array(judged));
    let json_path = opts.out.join("results.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&result).expect("serializes"))
        .map_err(|e| e.to_string())?;
    for s in &scenarios {
        s.plot(&opts.out, &results).map_err(|e| e.to_string())?;
    }
    println!(
        "\nresults: {} (plots: time_vs_bytes.svg, time_vs_count.svg, throughput_vs_limit.svg)",
        json_path.display()
    );
    Ok(Verdict {
        targets: targets.len(),
        missed: targets.iter().filter(|(_, _, ok)| !ok).map(|(t, m, _)| format!("{} ({m})", t.trim())).collect(),
    })
}

/// The torch_memory_saver library to compare with, or why there is none. A library named by the
/// user must be usable before minutes of measuring; `auto` may find none.
fn upstream_lib(choice: &UpstreamLib, api: ApiKind) -> Result<Result<PathBuf, String>, String> {
    match (choice, api) {
        (UpstreamLib::Path(_), ApiKind::Acl) => {
            Err("--upstream-lib: torch_memory_saver has no Ascend backend (leave it out with --api acl)".into())
        }
        (choice @ UpstreamLib::Path(_), ApiKind::Cuda) => Ok(Ok(upstream::resolve(choice)
            .map_err(|e| format!("--upstream-lib: {e}; pass torch_memory_saver's own preload library, or none"))?)),
        (choice, _) => Ok(upstream::resolve(choice)),
    }
}

/// The device line of the report.
fn device_name(device: DeviceKind, api: ApiKind, copy_gbps: f64) -> String {
    let through = match api {
        ApiKind::Cuda => "CUDA API",
        ApiKind::Acl => "ACL API",
    };
    match device {
        DeviceKind::Sim if copy_gbps > 0.0 => format!("tms-sim (copy bus {copy_gbps} GB/s per direction), {through}"),
        DeviceKind::Sim => format!("tms-sim (no copy throttle: host memcpy), {through}"),
        DeviceKind::Npu => "Ascend NPU 0 (ACL)".to_string(),
        _ => "CUDA device 0".to_string(),
    }
}

/// Entry point of the child process.
pub fn worker_main(args: &[String]) -> Result<Value, String> {
    let api = args
        .first()
        .and_then(|s| ApiKind::parse(s))
        .ok_or("bench-worker: the first argument must be the API (cuda or acl)")?;
    let args = &args[1..];
    let num = |i: usize| -> Result<usize, String> {
        args.get(i).and_then(|s| s.parse().ok()).ok_or_else(|| format!("bench-worker: argument {i} must be a number"))
    };
    let list = |i: usize| -> Result<Vec<usize>, String> {
        args.get(i)
            .ok_or("bench-worker: missing list")?
            .split(',')
            .map(|s| s.parse().map_err(|_| format!("bench-worker: bad number {s:?}")))
            .collect()
    };
    match args.first().map(String::as_str) {
        Some("passthrough") => worker::passthrough(api, num(1)?),
        Some("region") => worker::region(api, num(1)?, num(2)?),
        Some("bytes") => worker::bytes_scan(api, &list(1)?, num(2)?),
        Some("count") => worker::count_scan(api, &list(1)?, num(2)?),
        Some("memory") => worker::memory(api, num(1)?, num(2)?),
        Some("side") => worker::side_by_side(&list(1)?, num(2)?),
        Some("broadcast") => {
            collective::rank(num(1)?, args.get(2).ok_or("bench-worker: missing id file")?, &list(3)?, num(4)?)
        }
        other => Err(format!("bench-worker: unknown scenario {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_simulator_takes_either_api_and_real_devices_only_their_own() {
        assert_eq!(resolve(DeviceKind::Sim, None), Ok((DeviceKind::Sim, ApiKind::Cuda)));
        assert_eq!(resolve(DeviceKind::Sim, Some(ApiKind::Acl)), Ok((DeviceKind::Sim, ApiKind::Acl)));
        let wrong = resolve(DeviceKind::Cuda, Some(ApiKind::Acl)).unwrap_err();
        assert!(wrong.contains("--device npu"), "{wrong}");
        let wrong = resolve(DeviceKind::Npu, Some(ApiKind::Cuda)).unwrap_err();
        assert!(wrong.contains("--device cuda"), "{wrong}");
    }

    #[test]
    fn workers_are_told_their_api_first() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let e = worker_main(&args(&["passthrough", "10"])).unwrap_err();
        assert!(e.contains("cuda or acl"), "{e}");
        let e = worker_main(&args(&["acl", "nothing"])).unwrap_err();
        assert!(e.contains("unknown scenario"), "{e}");
    }
}
