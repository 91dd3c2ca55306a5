//! The collective row: `ncclBroadcast` from rank 0 to rank 1, two worker processes on two devices
//! of one node, timed against the link the simulator models (`TMS_SIM_LINK_GBPS`).
//!
//! Each rank loads libnccl.so.2 at run time (after the CUDA runtime, as PyTorch does), rank 0's
//! `ncclGetUniqueId` reaches rank 1 through a file, and every size is broadcast several times on a
//! stream of each rank, the stream synchronized after each. For a broadcast NCCL's bus bandwidth
//! equals bytes / time (nccl-tests' factor is 1), which is what the simulator charges its link
//! for. The figure is the simulator's fidelity to its own model, so the bench models a link the
//! host can carry (`--sim-link-gbps`, 0.5 GB/s by default: the simulator's default of 450 GB/s,
//! an H100's NVLink, is far above what moves between two processes on a 2-core VM, about 0.7 to
//! 1.1 GB/s there with no modelled time (docs/perf.md), and would measure the host instead).
//!
//! The ranks run under the hook, which records their communicator; after the broadcasts each one
//! measures what pausing tag `nccl` wins (suspend.rs, the communicator row).

use super::options::{DeviceKind, Options};
use super::scenario::{About, Bench, Results, Scenario};
use super::spawn::{Env, finish};
use super::table::{Target, f, gbs, human, table};
use crate::collective::{self, Group, Library};
use crate::environment::SimNode;
use crate::runtime::{Runtime, Streams, check, load_nccl};
use crate::vendor;
use crate::vendor::ApiKind;
use serde_json::{Value, json};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
/// The target is judged at this size and above.
const TARGET_FROM: usize = 64 * MIB;
const TARGET: &str = "broadcast >= 90% of the modelled link at >= 64 MiB (slowest size)";

/// The sizes broadcast: the given ones, else 64 MiB to 1 GiB (16 and 64 MiB with --quick).
fn sizes(opts: &Options) -> Vec<usize> {
    let default = if opts.quick { vec![16 * MIB, 64 * MIB] } else { vec![64 * MIB, 256 * MIB, 1024 * MIB] };
    opts.broadcast_sizes.clone().unwrap_or(default)
}

/// The scenario; once run, its targets.
#[derive(Default)]
pub(super) struct Collective {
    targets: Vec<Target>,
}

impl Scenario for Collective {
    fn about(&self) -> About {
        About {
            key: "collective",
            step: "a collective: ncclBroadcast between two devices against the modelled link; its communicator suspended",
        }
    }

    fn run(&mut self, bench: &Bench) -> Result<Value, String> {
        let (figures, targets) = run(&bench.env, bench.device, bench.opts)?;
        self.targets = targets;
        Ok(figures)
    }

    fn targets(&self, _results: &Results) -> Vec<Target> {
        self.targets.clone()
    }
}

/// Runs the row: prints its table and plot, returns its JSON (rows, or why it was skipped) and its
/// target where a modelled link makes one.
/// With it, the communicator row's JSON and target (suspend.rs).
fn run(env: &Env, device: DeviceKind, opts: &Options) -> Result<(Value, Vec<Target>), String> {
    if env.api != ApiKind::Cuda {
        println!("\nCollective (ncclBroadcast): skipped (NCCL is the CUDA API's; no HCCL row yet)");
        let why = "the collective row runs through NCCL (CUDA API); no HCCL row yet";
        return Ok((json!({ "skipped": why, "communicator_suspend": { "skipped": why } }), Vec::new()));
    }
    let modelled = device == DeviceKind::Sim && opts.sim_link_gbps > 0.0;
    let link_gbps = if modelled { Some(opts.sim_link_gbps) } else { None };
    let sizes = sizes(opts);
    let reps = if opts.quick { 3 } else { 5 };
    let ranks = spawn_ranks(env, &sizes, reps, opts.sim_link_gbps)?;
    if let Some(why) = ranks.iter().find_map(|r| r["skipped"].as_str()) {
        println!("\nCollective (ncclBroadcast): skipped ({why})");
        return Ok((json!({ "skipped": why, "communicator_suspend": { "skipped": why } }), Vec::new()));
    }
    let rows = combine(&ranks, link_gbps);
    print_rows(&rows, link_gbps, reps);
    super::plot::write_collective(&opts.out, &rows).map_err(|e| e.to_string())?;
    let intact = ranks[1]["contents_intact"].as_bool();
    let target = link_gbps.and_then(|_| judge(&rows));
    let (suspend, suspend_target) = super::suspend::report(&ranks);
    let result = json!({
        "op": "broadcast", "library": "nccl", "ranks": 2, "root": 0, "reps": reps,
        "link_modelled": modelled, "link_gbps": link_gbps, "contents_intact": intact, "rows": rows,
        "communicator_suspend": suspend,
    });
    Ok((result, target.into_iter().chain(suspend_target).collect()))
}

/// Per size: the slower rank's median, the rate it gives and its share of the modelled link.
fn combine(ranks: &[Value], link_gbps: Option<f64>) -> Vec<Value> {
    let per_rank = |r: usize| ranks[r]["rows"].as_array().cloned().unwrap_or_default();
    let (r0, r1) = (per_rank(0), per_rank(1));
    r0.iter()
        .zip(&r1)
        .map(|(a, b)| {
            let time_ns = f(a, "time_ns").max(f(b, "time_ns"));
            let rate = f(a, "bytes") / (time_ns / 1e9);
            let link = link_gbps.map(|g| g * 1e9);
            json!({
                "bytes": a["bytes"], "time_ns": time_ns, "rank_time_ns": [a["time_ns"], b["time_ns"]],
                "bytes_per_s": rate, "bus_bytes_per_s": rate,
                "link_bytes_per_s": link, "link_share": link.map(|l| rate / l),
            })
        })
        .collect()
}

fn print_rows(rows: &[Value], link_gbps: Option<f64>, reps: usize) {
    match link_gbps {
        Some(g) => println!(
            "\nCollective: ncclBroadcast, rank 0 -> rank 1 on two simulated devices of one node, over a MODELLED \
             link of {g} GB/s\n(--sim-link-gbps, TMS_SIM_LINK_GBPS). Median of {reps}, the slower rank; GB/s = \
             bytes / time = NCCL's bus bandwidth for broadcast."
        ),
        None => println!(
            "\nCollective: ncclBroadcast, rank 0 -> rank 1 on devices 0 and 1 (their own link, not modelled). \
             Median of {reps}, the slower rank; GB/s = bytes / time = NCCL's bus bandwidth for broadcast."
        ),
    }
    let dash = || "-".to_string();
    let lines = rows
        .iter()
        .map(|r| {
            let share = r["link_share"].as_f64();
            vec![
                human(f(r, "bytes")),
                format!("{:.3}", f(r, "time_ns") / 1e6),
                gbs(f(r, "bytes_per_s")),
                r["link_bytes_per_s"].as_f64().map_or_else(dash, gbs),
                share.map_or_else(dash, |s| format!("{:.0}", 100.0 * s)),
            ]
        })
        .collect();
    println!("{}", table(&["bytes", "ms", "GB/s", "link GB/s", "% of link"], lines));
    println!("(plot: broadcast_vs_link.svg)");
}

/// The slowest share of the link among the sizes of 64 MiB and more; none below that size.
fn judge(rows: &[Value]) -> Option<Target> {
    let worst = rows
        .iter()
        .filter(|r| f(r, "bytes") >= TARGET_FROM as f64)
        .map(|r| f(r, "link_share"))
        .min_by(f64::total_cmp)?;
    Some((TARGET, format!("{:.0}%", 100.0 * worst), worst >= 0.9))
}

/// Starts both ranks on one simulated node of two devices, waits for both (a failed rank stops
/// the other) and returns their JSON.
fn spawn_ranks(env: &Env, sizes: &[usize], reps: usize, link_gbps: f64) -> Result<Vec<Value>, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let id = dir.path().join("nccl-id");
    let sizes = sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let node = SimNode {
        name: Some("bench-collective".into()),
        devices: Some(2),
        link_gbps: Some(link_gbps.to_string()),
        ..SimNode::default()
    };
    let mut children = Vec::new();
    for rank in 0..2 {
        let args = [rank.to_string(), id.display().to_string(), sizes.clone(), reps.to_string()];
        let mut cmd = env.command(true, "broadcast", &args, &node, &[])?;
        children.push(start(&mut cmd, dir.path(), rank)?);
    }
    let statuses = wait_all(&mut children)?;
    statuses
        .into_iter()
        .enumerate()
        .map(|(rank, status)| {
            let read = |what: &str| std::fs::read(dir.path().join(format!("rank{rank}.{what}"))).unwrap_or_default();
            let out = std::process::Output { status, stdout: read("out"), stderr: read("err") };
            finish(&format!("broadcast (rank {rank})"), out)
        })
        .collect()
}

/// Output to files, not pipes: nothing waits on a reader while the other rank is polled.
fn start(cmd: &mut Command, dir: &Path, rank: usize) -> Result<Child, String> {
    let file = |what: &str| std::fs::File::create(dir.join(format!("rank{rank}.{what}"))).map_err(|e| e.to_string());
    cmd.stdout(Stdio::from(file("out")?)).stderr(Stdio::from(file("err")?));
    cmd.spawn().map_err(|e| format!("cannot run the bench worker: {e}"))
}

fn wait_all(children: &mut [Child]) -> Result<Vec<std::process::ExitStatus>, String> {
    loop {
        let mut done = Vec::new();
        for c in children.iter_mut() {
            done.push(c.try_wait().map_err(|e| e.to_string())?);
        }
        if done.iter().any(|s| s.is_some_and(|s| !s.success())) {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
        }
        if done.iter().all(Option::is_some) {
            return Ok(done.into_iter().flatten().collect());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---- the worker side: one rank ---------------------------------------------------------------

/// Rank 0 writes its id (empty: it skipped) under a temporary name, then renames it into place.
fn publish(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, path)).map_err(|e| e.to_string())
}

/// Rank 1 waits for rank 0's id; None when rank 0 skipped.
fn read_id(path: &Path) -> Result<Option<Vec<u8>>, String> {
    let start = Instant::now();
    while !path.exists() {
        if start.elapsed() > Duration::from_secs(120) {
            return Err(format!("rank 0 wrote no NCCL id at {} within 120 s", path.display()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    Ok(Some(bytes).filter(|b| !b.is_empty()))
}

/// Why this machine cannot run the row (fewer than two devices, no NCCL), if so.
fn unavailable() -> Result<Option<String>, String> {
    let streams = Streams::load()?;
    let mut n = 0;
    // SAFETY: writes one int.
    check("cudaGetDeviceCount", unsafe { (streams.device_count)(&mut n) })?;
    if n < 2 {
        return Ok(Some(format!("{n} CUDA device(s); the row needs 2")));
    }
    Ok(load_nccl().err())
}

/// One rank of the row (`bench-worker cuda broadcast RANK ID_FILE SIZES REPS`): joins the
/// communicator on device RANK, broadcasts each size REPS times from rank 0 (after one untimed
/// broadcast) and prints the median time of each.
pub fn rank(rank: usize, id_file: &str, sizes: &[usize], reps: usize) -> Result<Value, String> {
    let rt = vendor::cuda_runtime()?;
    let id_path = Path::new(id_file);
    if let Some(why) = unavailable()? {
        if rank == 0 {
            publish(id_path, &[])?;
        }
        return Ok(json!({ "rank": rank, "skipped": why }));
    }
    vendor::set_cuda_device(&rt, rank as i32)?;
    let id = if rank == 0 {
        let id = collective::unique_id(Library::Nccl)?;
        publish(id_path, &id)?;
        id
    } else {
        match read_id(id_path)? {
            Some(id) => id,
            None => return Ok(json!({ "rank": rank, "skipped": "rank 0 could not run the row" })),
        }
    };
    let group = Group::join(Library::Nccl, &id, rank, 2)?;
    let result = timed(&rt, &group, sizes, reps).and_then(|mut r| {
        r["suspend"] = super::suspend::measure(&rt, &group)?;
        Ok(r)
    });
    // Every broadcast was synchronized: nothing is pending on the communicator.
    group.destroy()?;
    result
}

/// The timed broadcasts of one rank, on the group's stream, into one buffer of the largest size.
fn timed(rt: &Runtime, group: &Group, sizes: &[usize], reps: usize) -> Result<Value, String> {
    let rank = group.rank;
    let largest = sizes.iter().copied().max().unwrap_or(0).max(1);
    let mut buf = std::ptr::null_mut();
    // SAFETY: runtime calls with valid out pointers; the buffer has `largest` bytes.
    unsafe {
        check("cudaMalloc", (rt.malloc)(&mut buf, largest))?;
        check("cudaMemset", (rt.memset)(buf, if rank == 0 { 0x5a } else { 0 }, largest))?;
    }
    let once = |bytes: usize| -> Result<f64, String> {
        let t = Instant::now();
        // `bytes` <= the buffer's size; root 0 sends, rank 1 receives in place.
        group.broadcast(buf as u64, bytes, 0)?;
        group.synchronize()?;
        Ok(t.elapsed().as_nanos() as f64)
    };
    once(sizes.first().copied().unwrap_or(1))?;
    let mut rows = Vec::new();
    for &bytes in sizes {
        let times = (0..reps).map(|_| once(bytes)).collect::<Result<Vec<_>, _>>()?;
        rows.push(json!({ "bytes": bytes, "time_ns": super::worker::median(times) }));
    }
    let intact = arrived(rt, buf, largest)?;
    // SAFETY: the buffer made above, idle.
    check("cudaFree", unsafe { (rt.free)(buf) })?;
    Ok(json!({ "rank": rank, "rows": rows, "contents_intact": intact }))
}

/// Whether the first and last MiB of the buffer hold rank 0's bytes.
fn arrived(rt: &Runtime, buf: *mut libc::c_void, len: usize) -> Result<bool, String> {
    let n = len.min(MIB);
    let mut host = vec![0u8; n];
    for offset in [0, len - n] {
        // SAFETY: `n` bytes at `offset` lie within the device buffer of `len` bytes.
        let src = unsafe { (buf as *const u8).add(offset) };
        check("cudaMemcpy", unsafe { (rt.memcpy)(host.as_mut_ptr().cast(), src.cast(), n, 2) })?;
        if host.iter().any(|&b| b != 0x5a) {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank_rows(times: &[(usize, f64)]) -> Value {
        json!({ "rows": times.iter().map(|(b, t)| json!({ "bytes": b, "time_ns": t })).collect::<Vec<_>>() })
    }

    #[test]
    fn a_size_takes_the_slower_rank_and_only_64_mib_and_more_are_judged() {
        let ranks =
            [rank_rows(&[(16 * MIB, 1e6), (64 * MIB, 134e6)]), rank_rows(&[(16 * MIB, 2e6), (64 * MIB, 140e6)])];
        let rows = combine(&ranks, Some(0.5));
        assert_eq!(f(&rows[1], "time_ns"), 140e6);
        let share = (64 * MIB) as f64 / 0.14 / 0.5e9;
        assert!((f(&rows[1], "link_share") - share).abs() < 1e-12);
        // 16 MiB at 8 GB/s would pass; 64 MiB at 96 % is what the target reads.
        let (_, measured, met) = judge(&rows).unwrap();
        assert_eq!((measured.as_str(), met), ("96%", true));
        assert!(judge(&rows[..1]).is_none());
        let unmodelled = combine(&ranks, None);
        assert!(unmodelled[0]["link_share"].is_null() && unmodelled[0]["link_bytes_per_s"].is_null());
    }
}
