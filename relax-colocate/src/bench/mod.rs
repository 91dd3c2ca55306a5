//! `relax-colocate bench`: the hook's costs measured against the physical limit in the same run.
//!
//! Each scenario runs in a child process (`relax-colocate bench-worker`), with libtms_hook.so
//! preloaded or not as the comparison needs, on the simulator (a private node) or the real
//! driver. Results: tables on stdout, `results.json` and SVG plots in the output folder.
//!
//! Scenarios go through the CUDA API (`--device cuda`) or the Ascend ACL API (`--device npu`);
//! the simulator serves both, `--api` picking one (CUDA by default), so CI proves the NPU path.

pub mod collective;
pub mod plot;
mod suspend;
pub mod upstream;
pub mod worker;

use crate::environment::find_hook;
use crate::vendor::ApiKind;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;

const MIB: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// The real CUDA driver if libcuda.so.1 loads, else CANN if libascendcl.so loads, else the
    /// simulator.
    Auto,
    /// tms-sim, through the API `--api` names (CUDA by default).
    Sim,
    /// The real CUDA driver (libcudart + libcuda).
    Cuda,
    /// An Ascend NPU through CANN's ACL (libascendcl.so, found by CANN's set_env.sh).
    Npu,
}

pub struct Options {
    pub device: DeviceKind,
    /// None: the device's own (CUDA on the simulator).
    pub api: Option<ApiKind>,
    pub quick: bool,
    pub out: PathBuf,
    pub hook: Option<PathBuf>,
    pub sim_memory: String,
    pub sim_copy_gbps: f64,
    /// Simulator: the modelled link of the collective row (`TMS_SIM_LINK_GBPS`), GB/s.
    pub sim_link_gbps: f64,
    /// The collective row's broadcast sizes; None: the defaults (fewer and smaller with --quick).
    pub broadcast_sizes: Option<Vec<usize>>,
    /// torch_memory_saver's library to compare with, side by side (CUDA only).
    pub upstream_lib: upstream::UpstreamLib,
}

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

struct Env {
    api: ApiKind,
    sim: Option<(String, tempfile::TempDir)>,
    hook: PathBuf,
    opts_memory: String,
    copy_gbps: f64,
    counter: std::cell::Cell<u32>,
}

impl Env {
    /// Runs one worker scenario; `hooked` preloads the library.
    fn worker(&self, hooked: bool, scenario: &str, args: &[String]) -> Result<Value, String> {
        self.worker_env(hooked, scenario, args, &[])
    }

    fn worker_env(
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
    fn command(
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
            cmd.env("LD_LIBRARY_PATH", libdir)
                .env("TMS_SIM_DIR", dir.path())
                .env("TMS_SIM_NODE", format!("bench-{}", self.counter.get()))
                .env("TMS_SIM_MEMORY", &self.opts_memory)
                .env("TMS_SIM_DEVICES", "1");
            if self.copy_gbps > 0.0 {
                cmd.env("TMS_SIM_COPY_GBPS", self.copy_gbps.to_string());
            }
        }
        for (k, v) in extra {
            cmd.env(k, v);
        }
        Ok(cmd)
    }
}

/// A worker's JSON, or why it failed.
fn finish(scenario: &str, out: std::process::Output) -> Result<Value, String> {
    if !out.status.success() {
        return Err(format!(
            "bench scenario {scenario} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("scenario {scenario}: bad output ({e})"))
}

fn gbs(bytes_per_s: f64) -> String {
    format!("{:.2}", bytes_per_s / 1e9)
}

fn human(bytes: f64) -> String {
    tms_proto::size::format_size(bytes.max(0.0) as u64)
}

/// A Markdown table (paste-able into docs/perf.md), the first column left-aligned and the
/// figures right-aligned.
fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    use comfy_table::{CellAlignment, Table, presets};
    let mut t = Table::new();
    t.load_preset(presets::ASCII_MARKDOWN).set_header(header.iter().copied());
    for row in rows {
        t.add_row(row);
    }
    for (i, column) in t.column_iter_mut().enumerate() {
        column.set_cell_alignment(if i == 0 { CellAlignment::Left } else { CellAlignment::Right });
    }
    t.to_string()
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(f64::NAN)
}

/// The run's verdict on its targets: how many were judged, how many missed.
pub struct Verdict {
    pub targets: usize,
    pub missed: Vec<String>,
}

pub fn run(opts: &Options) -> Result<Verdict, String> {
    let (device, api) = resolve(opts.device, opts.api)?;
    let hook = find_hook(opts.hook.as_deref())?;
    // A library named by the user must be usable before minutes of measuring; `auto` may find none.
    let upstream_lib = match (&opts.upstream_lib, api) {
        (upstream::UpstreamLib::Path(_), ApiKind::Acl) => {
            return Err("--upstream-lib: torch_memory_saver has no Ascend backend (leave it out with --api acl)".into());
        }
        (choice @ upstream::UpstreamLib::Path(_), ApiKind::Cuda) => Ok(upstream::resolve(choice)
            .map_err(|e| format!("--upstream-lib: {e}; pass torch_memory_saver's own preload library, or none"))?),
        (choice, _) => upstream::resolve(choice),
    };
    let sim = if device == DeviceKind::Sim {
        Some((crate::environment::sim_environment()?.lib_dir, tempfile::tempdir().map_err(|e| e.to_string())?))
    } else {
        None
    };
    let env = Env {
        api,
        sim,
        hook,
        opts_memory: opts.sim_memory.clone(),
        copy_gbps: opts.sim_copy_gbps,
        counter: std::cell::Cell::new(0),
    };
    std::fs::create_dir_all(&opts.out).map_err(|e| format!("cannot create {}: {e}", opts.out.display()))?;
    let q = opts.quick;
    let device_name = device_name(device, api, opts.sim_copy_gbps);
    println!("relax-colocate bench on {device_name}{}", if q { ", --quick" } else { "" });
    let step = |n: usize, what: &str| eprintln!("[{n}/8] {what}...");

    step(1, "interception overhead (direct vs through the hook)");
    let iters = if q { 200_000 } else { 2_000_000 };
    let (direct, hooked) = match api {
        ApiKind::Cuda => (
            env.worker(false, "passthrough", &[iters.to_string()])?,
            env.worker(true, "passthrough", &[iters.to_string()])?,
        ),
        // ACL's figure is the difference of two allocator pairs of microseconds each, taken in
        // two processes: alternating three rounds and keeping each side's fastest keeps a slow
        // moment of the machine from landing on one side only.
        ApiKind::Acl => {
            let mut best: [Option<Value>; 2] = [None, None];
            for _ in 0..3 {
                for (side, hooked) in [(0, false), (1, true)] {
                    let v = env.worker(hooked, "passthrough", &[iters.to_string()])?;
                    if best[side].as_ref().is_none_or(|b| f(&v, "malloc_free_pair_ns") < f(b, "malloc_free_pair_ns")) {
                        best[side] = Some(v);
                    }
                }
            }
            let [direct, hooked] = best;
            (direct.unwrap_or_default(), hooked.unwrap_or_default())
        }
    };
    println!("\nInterception outside regions (ns per call)");
    let calls: &[(&str, &str)] = match api {
        ApiKind::Cuda => &[("cudaFree(NULL)", "free_null_ns"), ("cudaMalloc(4 KiB) + cudaFree", "malloc_free_pair_ns")],
        // ACL has no no-op call to time (worker::passthrough says why).
        ApiKind::Acl => &[("aclrtMalloc(4 KiB) + aclrtFree", "malloc_free_pair_ns")],
    };
    let calls = calls
        .iter()
        .map(|(label, key)| {
            let (d, h) = (f(&direct, key), f(&hooked, key));
            vec![
                label.to_string(),
                format!("{d:.1}"),
                format!("{h:.1}"),
                format!("{:.1}", h - d),
                format!("{:.2}", h / d),
            ]
        })
        .collect();
    println!("{}", table(&["call", "direct", "hooked", "added", "ratio"], calls));

    step(2, "region malloc/free vs the bare virtual-memory sequence");
    let region = env.worker(true, "region", &[(if q { 300 } else { 3000 }).to_string(), (2 * MIB).to_string()])?;
    println!("\nRegion allocation, 2 MiB (ns per malloc+free)");
    let row = vec![
        region["sequence"].as_str().unwrap_or("").to_string(),
        format!("{:.0}", f(&region, "bare_ns")),
        format!("{:.0}", f(&region, "hooked_ns")),
        format!("{:.2}", f(&region, "hooked_ns") / f(&region, "bare_ns")),
    ];
    println!("{}", table(&["sequence", "bare VMM", "hook", "ratio"], vec![row]));

    step(3, "pause/resume against bytes, with and without backup, and the raw pinned copy");
    let sizes: Vec<usize> =
        if q { vec![1, 16, 128] } else { vec![1, 4, 16, 64, 256, 1024] }.into_iter().map(|m| m * MIB).collect();
    let sizes_arg = sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
    // Pages are committed at create, as on a device, so restores are not charged the simulator's
    // first-touch page faults (a device allocates physical memory in cuMemCreate).
    let bytes =
        env.worker_env(true, "bytes", &[sizes_arg, (if q { 3 } else { 5 }).to_string()], &[("TMS_SIM_COMMIT", "1")])?;
    let mut rows = bytes["rows"].as_array().cloned().unwrap_or_default();
    add_bounds(&mut rows);
    println!("\nPause/resume of one allocation (median), whole operation. raw: a plain pinned copy of the same size");
    println!("in the same process; %: share of it. bound: the slower of that copy and the same operation without");
    println!("backup (releasing or creating the memory), i.e. the best a pipeline overlapping them can do.");
    println!("1st pause: the first one, which also allocates the pinned buffers that later pauses reuse.");
    let pct = |a: f64, b: f64| format!("{:.0}", 100.0 * a / b);
    let mut lines = Vec::new();
    for r in &rows {
        let backup = r["backup"].as_bool().unwrap_or(false);
        let shares = if backup {
            [
                pct(f(r, "pause_bytes_per_s"), f(r, "raw_d2h_bytes_per_s")),
                pct(f(r, "resume_bytes_per_s"), f(r, "raw_h2d_bytes_per_s")),
                pct(f(r, "pause_bound_ns"), f(r, "pause_ns")),
                pct(f(r, "resume_bound_ns"), f(r, "resume_ns")),
            ]
        } else {
            ["-".into(), "-".into(), "-".into(), "-".into()]
        };
        let mut line = vec![
            human(f(r, "bytes")),
            (if backup { "yes" } else { "no" }).to_string(),
            format!("{:.3}", f(r, "first_pause_ns") / 1e6),
            format!("{:.3}", f(r, "pause_ns") / 1e6),
            format!("{:.3}", f(r, "resume_ns") / 1e6),
            gbs(f(r, "pause_bytes_per_s")),
            gbs(f(r, "resume_bytes_per_s")),
            gbs(f(r, "raw_d2h_bytes_per_s")),
            gbs(f(r, "raw_h2d_bytes_per_s")),
        ];
        line.extend(shares);
        lines.push(line);
    }
    let header = [
        "bytes",
        "backup",
        "1st pause ms",
        "pause ms",
        "resume ms",
        "pause GB/s",
        "resume GB/s",
        "raw D2H GB/s",
        "raw H2D GB/s",
        "pause %",
        "resume %",
        "p/bound %",
        "r/bound %",
    ];
    println!("{}", table(&header, lines));

    step(4, "pause/resume against allocation count");
    let counts: Vec<usize> = if q { vec![1, 10, 100, 1000] } else { vec![1, 10, 100, 1000, 10_000] };
    let counts_arg = counts.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
    let count = env.worker(true, "count", &[counts_arg, "3".into()])?;
    println!("\nPause/resume without backup against allocation count (mixed 2/4/6 MiB)");
    let crow = count["rows"].as_array().cloned().unwrap_or_default();
    let lines = crow
        .iter()
        .map(|r| {
            vec![
                format!("{:.0}", f(r, "allocations")),
                human(f(r, "bytes")),
                format!("{:.3}", f(r, "pause_ns") / 1e6),
                format!("{:.3}", f(r, "resume_ns") / 1e6),
                format!("{:.1}", f(r, "pause_ns_per_allocation") / 1e3),
                format!("{:.1}", f(r, "resume_ns_per_allocation") / 1e3),
            ]
        })
        .collect();
    println!(
        "{}",
        table(&["allocations", "bytes", "pause ms", "resume ms", "pause µs/alloc", "resume µs/alloc"], lines)
    );

    step(5, "host memory: bookkeeping per allocation, growth across cycles");
    let mem = env.worker(
        true,
        "memory",
        &[(if q { 1000 } else { 10_000 }).to_string(), (if q { 200 } else { 1000 }).to_string()],
    )?;
    println!("\nHost memory");
    println!(
        "heap per tracked allocation over {} allocations: {:.0} B in all, {:.0} B of it the driver's own (same allocations made by hand), {:.0} B the hook's",
        mem["tracked"],
        f(&mem, "heap_bytes_per_allocation"),
        f(&mem, "driver_heap_bytes_per_allocation"),
        f(&mem, "hook_heap_bytes_per_allocation")
    );
    println!(
        "resident anonymous memory (smaps_rollup) across {} pause/resume cycles with backup: {} -> {} bytes ({:+})",
        mem["cycles"], mem["rss_before"], mem["rss_after"], mem["rss_growth"]
    );

    step(6, "the colocate switch (sleep + update_weights + wake_up) from a memory-profile run");
    let switch = colocate_switch(device, api, opts)?;
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
    println!(
        "{}",
        table(
            &["profile", "trainer", "weights", "sleep s", "update s", "wake_up s", "switch s", "s per GiB"],
            vec![row]
        )
    );

    step(7, "torch_memory_saver's library side by side (same calls, same run)");
    let (side_by_side, upstream_ratios) = match api {
        ApiKind::Cuda => upstream::compare(&env, upstream_lib, q),
        ApiKind::Acl => {
            println!("\nSide by side with torch_memory_saver's library: skipped (it has no Ascend backend)");
            (json!({ "skipped": "torch_memory_saver has no Ascend backend" }), None)
        }
    };

    // Targets, judged on figures from this run.
    let largest_backup =
        rows.iter().filter(|r| r["backup"] == true).max_by(|a, b| f(a, "bytes").total_cmp(&f(b, "bytes")));
    let pause_share =
        largest_backup.map(|r| f(r, "pause_bytes_per_s") / f(r, "raw_d2h_bytes_per_s")).unwrap_or(f64::NAN);
    let resume_share =
        largest_backup.map(|r| f(r, "resume_bytes_per_s") / f(r, "raw_h2d_bytes_per_s")).unwrap_or(f64::NAN);
    let per_alloc = crow.last().map(|r| f(r, "pause_ns_per_allocation")).unwrap_or(f64::NAN);
    let per_alloc_ratio = per_alloc / f(&region, "unmap_release_ns");
    // Per intercepted call: CUDA's no-op cudaFree(NULL); ACL's pair is two intercepted calls.
    let added = match api {
        ApiKind::Cuda => f(&hooked, "free_null_ns") - f(&direct, "free_null_ns"),
        ApiKind::Acl => (f(&hooked, "malloc_free_pair_ns") - f(&direct, "malloc_free_pair_ns")) / 2.0,
    };
    let heap = f(&mem, "hook_heap_bytes_per_allocation");
    let growth = mem["rss_growth"].as_i64().unwrap_or(i64::MAX);
    let mid =
        crow.iter().find(|r| r["allocations"] == 100).map(|r| f(r, "pause_ns_per_allocation")).unwrap_or(f64::NAN);
    let scaling = per_alloc / mid;
    let pause_overlap = largest_backup.map(|r| f(r, "pause_bound_ns") / f(r, "pause_ns")).unwrap_or(f64::NAN);
    let resume_overlap = largest_backup.map(|r| f(r, "resume_bound_ns") / f(r, "resume_ns")).unwrap_or(f64::NAN);
    let at_least_90 = |name: &'static str, share: f64| (name, format!("{:.0}%", 100.0 * share), share >= 0.9);
    let mut targets = vec![
        at_least_90("pause with backup >= 90% of raw D2H copy (whole op)", pause_share),
        at_least_90("resume with backup >= 90% of raw H2D copy (whole op)", resume_share),
        at_least_90("  pause with backup >= 90% of its bound (copy overlapping release)", pause_overlap),
        at_least_90("  resume with backup >= 90% of its bound (copy overlapping create)", resume_overlap),
        (
            "pause w/o backup <= 2x driver unmap+release per allocation",
            format!("{per_alloc_ratio:.2}x"),
            per_alloc_ratio <= 2.0,
        ),
        ("passthrough adds <= 50 ns per call", format!("{added:.1} ns"), added <= 50.0),
        ("hook bookkeeping <= 512 B per allocation", format!("{heap:.0} B"), heap <= 512.0),
        ("no resident-memory growth across pause/resume cycles", format!("{growth:+} B"), growth <= 64 * 1024),
        ("per-allocation pause cost at max count <= 2x at 100 (linear)", format!("{scaling:.2}x"), scaling <= 2.0),
    ];
    if let Some((pause_x, resume_x)) = upstream_ratios {
        // Judged only where torch_memory_saver's library ran beside ours.
        let no_slower = |name: &'static str, x: f64| (name, format!("{x:.2}x"), x >= 1.0);
        targets.push(no_slower("pause with backup no slower than torch_memory_saver (its time / ours)", pause_x));
        targets.push(no_slower("resume with backup no slower than torch_memory_saver (its time / ours)", resume_x));
    }
    step(8, "a collective: ncclBroadcast between two devices against the modelled link; its communicator suspended");
    let (collective, collective_targets) = collective::run(&env, device, opts)?;
    targets.extend(collective_targets);
    print_targets(&targets);

    let result = json!({
        "device": device_name, "vendor": api.as_str(), "quick": q,
        "passthrough": { "direct": direct, "hooked": hooked },
        "region": region, "bytes": bytes, "count": count, "memory": mem, "colocate_switch": switch,
        "side_by_side": side_by_side, "collective": collective,
        "targets": targets.iter().map(|(t, m, ok)| json!({"target": t, "measured": m, "met": ok})).collect::<Vec<_>>(),
    });
    let json_path = opts.out.join("results.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&result).expect("serializes"))
        .map_err(|e| e.to_string())?;
    plot::write_all(&opts.out, &rows, &crow).map_err(|e| e.to_string())?;
    println!(
        "\nresults: {} (plots: time_vs_bytes.svg, time_vs_count.svg, throughput_vs_limit.svg)",
        json_path.display()
    );
    Ok(Verdict {
        targets: targets.len(),
        missed: targets.iter().filter(|(_, _, ok)| !ok).map(|(t, m, _)| format!("{} ({m})", t.trim())).collect(),
    })
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

/// A judged target: what, the figure, met or not.
type Target = (&'static str, String, bool);

fn print_targets(targets: &[Target]) {
    println!("\nTargets (this run)");
    let lines = targets
        .iter()
        .map(|(t, m, ok)| vec![t.to_string(), m.clone(), (if *ok { "yes" } else { "NO" }).to_string()])
        .collect();
    println!("{}", table(&["target", "measured", "met"], lines));
}

/// Adds to each row with backup the time the whole operation could take at best when the copy
/// and the driver's own work (release on pause, create on resume) overlap perfectly: the slower
/// of the raw pinned copy and the same operation without backup, both measured in this run.
fn add_bounds(rows: &mut [Value]) {
    let without: Vec<(f64, f64, f64)> = rows
        .iter()
        .filter(|r| r["backup"] == false)
        .map(|r| (f(r, "bytes"), f(r, "pause_ns"), f(r, "resume_ns")))
        .collect();
    for r in rows.iter_mut().filter(|r| r["backup"] == true) {
        let bytes = f(r, "bytes");
        let Some(&(_, pause_alone, resume_alone)) = without.iter().find(|w| w.0 == bytes) else { continue };
        let d2h_ns = bytes / f(r, "raw_d2h_bytes_per_s") * 1e9;
        let h2d_ns = bytes / f(r, "raw_h2d_bytes_per_s") * 1e9;
        r["pause_bound_ns"] = json!(d2h_ns.max(pause_alone));
        r["resume_bound_ns"] = json!(h2d_ns.max(resume_alone));
    }
}

/// Runs `relax-colocate run` with a memory profile and reads the switch phases from its summary.
/// "Per GiB" is per GiB of trainer state (weights, grads, optimizer), which sleep and wake_up
/// move; update_weights moves the weights alone.
fn colocate_switch(device: DeviceKind, api: ApiKind, opts: &Options) -> Result<Value, String> {
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
    let summary: Value = serde_json::from_slice(&run.stdout).map_err(|e| format!("colocate run summary: {e}"))?;
    let median = |phase: &str| -> f64 {
        summary["phases"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["phase"] == phase))
            .map(|p| f(p, "median_s"))
            .unwrap_or(f64::NAN)
    };
    let (sleep, update, wake) = (median("sleep"), median("update_weights"), median("wake_up"));
    let trainer = f(&summary["memory"], "trainer_bytes_per_device");
    let switch = sleep + update + wake;
    Ok(json!({
        "profile": format!("{profile}{}", if scale == "1.0" { String::new() } else { format!(" x{scale}") }),
        "trainer_bytes": trainer, "weights_bytes": f(&summary["memory"], "weights_bytes_per_device"),
        "sleep_s": sleep, "update_weights_s": update, "wake_up_s": wake, "switch_s": switch,
        "switch_s_per_gib": switch / (trainer / (1u64 << 30) as f64), "run_dir": out,
    }))
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
