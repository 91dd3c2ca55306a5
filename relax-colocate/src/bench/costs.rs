//! The hook's own costs, each a scenario: interception outside regions, a region allocation
//! against the bare virtual-memory sequence, pause/resume against bytes and against allocation
//! count, and host memory.

use super::plot;
use super::scenario::{About, Bench, Results, Scenario};
use super::table::{Target, f, gbs, human, table};
use crate::environment::SimNode;
use crate::vendor::ApiKind;
use serde_json::{Value, json};
use std::path::Path;

const MIB: usize = 1 << 20;

fn rows(figures: &Value) -> Vec<Value> {
    figures["rows"].as_array().cloned().unwrap_or_default()
}

/// Direct and hooked calls outside any region.
pub(super) struct Passthrough(pub ApiKind);

impl Scenario for Passthrough {
    fn about(&self) -> About {
        About { key: "passthrough", step: "interception overhead (direct vs through the hook)" }
    }

    fn run(&mut self, bench: &Bench) -> Result<Value, String> {
        let env = &bench.env;
        let iters = if bench.quick() { 200_000 } else { 2_000_000 };
        let (direct, hooked) = match self.0 {
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
                        let pair = |v: &Value| f(v, "malloc_free_pair_ns");
                        if best[side].as_ref().is_none_or(|b| pair(&v) < pair(b)) {
                            best[side] = Some(v);
                        }
                    }
                }
                let [direct, hooked] = best;
                (direct.unwrap_or_default(), hooked.unwrap_or_default())
            }
        };
        self.table(&direct, &hooked);
        Ok(json!({ "direct": direct, "hooked": hooked }))
    }

    fn targets(&self, results: &Results) -> Vec<Target> {
        let (direct, hooked) = (&results["passthrough"]["direct"], &results["passthrough"]["hooked"]);
        // Per intercepted call: CUDA's no-op cudaFree(NULL); ACL's pair is two intercepted calls.
        let added = match self.0 {
            ApiKind::Cuda => f(hooked, "free_null_ns") - f(direct, "free_null_ns"),
            ApiKind::Acl => (f(hooked, "malloc_free_pair_ns") - f(direct, "malloc_free_pair_ns")) / 2.0,
        };
        vec![("passthrough adds <= 50 ns per call", format!("{added:.1} ns"), added <= 50.0)]
    }
}

impl Passthrough {
    fn table(&self, direct: &Value, hooked: &Value) {
        println!("\nInterception outside regions (ns per call)");
        let calls: &[(&str, &str)] = match self.0 {
            ApiKind::Cuda => {
                &[("cudaFree(NULL)", "free_null_ns"), ("cudaMalloc(4 KiB) + cudaFree", "malloc_free_pair_ns")]
            }
            // ACL has no no-op call to time (worker::passthrough says why).
            ApiKind::Acl => &[("aclrtMalloc(4 KiB) + aclrtFree", "malloc_free_pair_ns")],
        };
        let calls = calls
            .iter()
            .map(|(label, key)| {
                let (d, h) = (f(direct, key), f(hooked, key));
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
    }
}

/// A region malloc/free against the vendor's own virtual-memory sequence.
pub(super) struct Region;

impl Scenario for Region {
    fn about(&self) -> About {
        About { key: "region", step: "region malloc/free vs the bare virtual-memory sequence" }
    }

    fn run(&mut self, bench: &Bench) -> Result<Value, String> {
        let iters = if bench.quick() { 300 } else { 3000 };
        let region = bench.env.worker(true, "region", &[iters.to_string(), (2 * MIB).to_string()])?;
        println!("\nRegion allocation, 2 MiB (ns per malloc+free)");
        let row = vec![
            region["sequence"].as_str().unwrap_or("").to_string(),
            format!("{:.0}", f(&region, "bare_ns")),
            format!("{:.0}", f(&region, "hooked_ns")),
            format!("{:.2}", f(&region, "hooked_ns") / f(&region, "bare_ns")),
        ];
        println!("{}", table(&["sequence", "bare VMM", "hook", "ratio"], vec![row]));
        Ok(region)
    }

    /// A pause without backup per allocation (the count scan's largest) against the driver's
    /// own unmap+release of one.
    fn targets(&self, results: &Results) -> Vec<Target> {
        let per_alloc = rows(&results["count"]).last().map(|r| f(r, "pause_ns_per_allocation")).unwrap_or(f64::NAN);
        let ratio = per_alloc / f(&results["region"], "unmap_release_ns");
        vec![("pause w/o backup <= 2x driver unmap+release per allocation", format!("{ratio:.2}x"), ratio <= 2.0)]
    }
}

/// Pause/resume of one allocation per size, with and without backup, against the raw pinned copy.
pub(super) struct Bytes;

impl Scenario for Bytes {
    fn about(&self) -> About {
        About { key: "bytes", step: "pause/resume against bytes, with and without backup, and the raw pinned copy" }
    }

    fn run(&mut self, bench: &Bench) -> Result<Value, String> {
        let q = bench.quick();
        let sizes: Vec<usize> =
            if q { vec![1, 16, 128] } else { vec![1, 4, 16, 64, 256, 1024] }.into_iter().map(|m| m * MIB).collect();
        let sizes_arg = sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
        // Pages are committed at create, as on a device, so restores are not charged the simulator's
        // first-touch page faults (a device allocates physical memory in cuMemCreate).
        let args = [sizes_arg, (if q { 3 } else { 5 }).to_string()];
        let bytes =
            bench.env.worker_with(true, "bytes", &args, &SimNode { commit: true, ..SimNode::default() }, &[])?;
        print_bytes(&bounded(&bytes));
        Ok(bytes)
    }

    fn targets(&self, results: &Results) -> Vec<Target> {
        let rows = bounded(&results["bytes"]);
        let largest_backup =
            rows.iter().filter(|r| r["backup"] == true).max_by(|a, b| f(a, "bytes").total_cmp(&f(b, "bytes")));
        let share = |num: &str, den: &str| largest_backup.map(|r| f(r, num) / f(r, den)).unwrap_or(f64::NAN);
        let at_least_90 = |name: &'static str, share: f64| (name, format!("{:.0}%", 100.0 * share), share >= 0.9);
        vec![
            at_least_90(
                "pause with backup >= 90% of raw D2H copy (whole op)",
                share("pause_bytes_per_s", "raw_d2h_bytes_per_s"),
            ),
            at_least_90(
                "resume with backup >= 90% of raw H2D copy (whole op)",
                share("resume_bytes_per_s", "raw_h2d_bytes_per_s"),
            ),
            at_least_90(
                "  pause with backup >= 90% of its bound (copy overlapping release)",
                share("pause_bound_ns", "pause_ns"),
            ),
            at_least_90(
                "  resume with backup >= 90% of its bound (copy overlapping create)",
                share("resume_bound_ns", "resume_ns"),
            ),
        ]
    }

    fn plot(&self, out: &Path, results: &Results) -> std::io::Result<()> {
        plot::write_bytes(out, &bounded(&results["bytes"]))
    }
}

/// The bytes scan's rows, each with backup given the time the whole operation could take at best
/// when the copy and the driver's own work (release on pause, create on resume) overlap perfectly:
/// the slower of the raw pinned copy and the same operation without backup, both measured in this
/// run.
fn bounded(bytes: &Value) -> Vec<Value> {
    let mut rows = rows(bytes);
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
    rows
}

fn print_bytes(rows: &[Value]) {
    println!("\nPause/resume of one allocation (median), whole operation. raw: a plain pinned copy of the same size");
    println!("in the same process; %: share of it. bound: the slower of that copy and the same operation without");
    println!("backup (releasing or creating the memory), i.e. the best a pipeline overlapping them can do.");
    println!("1st pause: the first one, which also allocates the pinned buffers that later pauses reuse.");
    let pct = |a: f64, b: f64| format!("{:.0}", 100.0 * a / b);
    let mut lines = Vec::new();
    for r in rows {
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
}

/// Pause/resume without backup against the number of allocations.
pub(super) struct Count;

impl Scenario for Count {
    fn about(&self) -> About {
        About { key: "count", step: "pause/resume against allocation count" }
    }

    fn run(&mut self, bench: &Bench) -> Result<Value, String> {
        let counts: Vec<usize> = if bench.quick() { vec![1, 10, 100, 1000] } else { vec![1, 10, 100, 1000, 10_000] };
        let counts_arg = counts.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
        let count = bench.env.worker(true, "count", &[counts_arg, "3".into()])?;
        println!("\nPause/resume without backup against allocation count (mixed 2/4/6 MiB)");
        let lines = rows(&count)
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
        let header = ["allocations", "bytes", "pause ms", "resume ms", "pause µs/alloc", "resume µs/alloc"];
        println!("{}", table(&header, lines));
        Ok(count)
    }

    /// The per-allocation pause cost at the largest count against that at 100.
    fn targets(&self, results: &Results) -> Vec<Target> {
        let rows = rows(&results["count"]);
        let per_alloc = rows.last().map(|r| f(r, "pause_ns_per_allocation")).unwrap_or(f64::NAN);
        let mid =
            rows.iter().find(|r| r["allocations"] == 100).map(|r| f(r, "pause_ns_per_allocation")).unwrap_or(f64::NAN);
        let scaling = per_alloc / mid;
        vec![("per-allocation pause cost at max count <= 2x at 100 (linear)", format!("{scaling:.2}x"), scaling <= 2.0)]
    }

    fn plot(&self, out: &Path, results: &Results) -> std::io::Result<()> {
        plot::write_count(out, &rows(&results["count"]))
    }
}

/// Host memory: the hook's bookkeeping per allocation, and growth across pause/resume cycles.
pub(super) struct Memory;

impl Scenario for Memory {
    fn about(&self) -> About {
        About { key: "memory", step: "host memory: bookkeeping per allocation, growth across cycles" }
    }

    fn run(&mut self, bench: &Bench) -> Result<Value, String> {
        let q = bench.quick();
        let args = [(if q { 1000 } else { 10_000 }).to_string(), (if q { 200 } else { 1000 }).to_string()];
        let mem = bench.env.worker(true, "memory", &args)?;
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
        Ok(mem)
    }

    fn targets(&self, results: &Results) -> Vec<Target> {
        let mem = &results["memory"];
        let heap = f(mem, "hook_heap_bytes_per_allocation");
        let growth = mem["rss_growth"].as_i64().unwrap_or(i64::MAX);
        vec![
            ("hook bookkeeping <= 512 B per allocation", format!("{heap:.0} B"), heap <= 512.0),
            ("no resident-memory growth across pause/resume cycles", format!("{growth:+} B"), growth <= 64 * 1024),
        ]
    }
}
