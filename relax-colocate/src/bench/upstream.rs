//! torch_memory_saver's own library side by side with libtms_hook.so, in the same run: the same
//! worker scenario (`side`, calling only the C ABI both export) preloaded once with each, on the
//! same sizes, device and copy bus. CUDA only: torch_memory_saver has no Ascend backend.

use super::options::UpstreamLib;
use super::scenario::{About, Bench, Results, Scenario};
use super::spawn::Env;
use super::table::{Target, f, human, table};
use crate::environment::SimNode;
use crate::vendor::ApiKind;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: usize = 1 << 20;

/// The scenario: the library to compare with (or why there is none) and, once run, the ratios
/// `compare` found.
pub(super) struct Upstream {
    pub lib: Option<Result<PathBuf, String>>,
    ratios: Option<(f64, f64)>,
}

impl Upstream {
    pub fn new(lib: Result<PathBuf, String>) -> Upstream {
        Upstream { lib: Some(lib), ratios: None }
    }
}

impl Scenario for Upstream {
    fn about(&self) -> About {
        About { key: "side_by_side", step: "torch_memory_saver's library side by side (same calls, same run)" }
    }

    fn run(&mut self, bench: &Bench) -> Result<Value, String> {
        let lib = self.lib.take().unwrap_or_else(|| Err("already compared".into()));
        let (side_by_side, ratios) = match bench.api {
            ApiKind::Cuda => compare(&bench.env, lib, bench.quick()),
            ApiKind::Acl => {
                println!("\nSide by side with torch_memory_saver's library: skipped (it has no Ascend backend)");
                (json!({ "skipped": "torch_memory_saver has no Ascend backend" }), None)
            }
        };
        self.ratios = ratios;
        Ok(side_by_side)
    }

    /// Judged only where torch_memory_saver's library ran beside ours.
    fn targets(&self, _results: &Results) -> Vec<Target> {
        let no_slower = |name: &'static str, x: f64| (name, format!("{x:.2}x"), x >= 1.0);
        self.ratios
            .into_iter()
            .flat_map(|(pause_x, resume_x)| {
                [
                    no_slower("pause with backup no slower than torch_memory_saver (its time / ours)", pause_x),
                    no_slower("resume with backup no slower than torch_memory_saver (its time / ours)", resume_x),
                ]
            })
            .collect()
    }
}

/// libtms_hook.so carries its own API next to the shared ABI (ours is also installed under
/// torch_memory_saver's file names, so a name proves nothing).
fn is_torch_memory_saver(path: &Path) -> bool {
    let Ok(bytes) = std::fs::read(path) else { return false };
    let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    has(b"tms_set_interesting_region") && !has(b"tms_pause_report")
}

/// The preload library of `python3`'s torch_memory_saver package, newest CUDA major first. The
/// package is located without importing it (its import loads torch).
fn find_in_python() -> Result<PathBuf, String> {
    let probe = "import importlib.util as u; s = u.find_spec('torch_memory_saver'); \
                 print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')";
    let out =
        Command::new("python3").args(["-c", probe]).output().map_err(|e| format!("python3 not runnable ({e})"))?;
    let package = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if package.is_empty() {
        return Err("python3 has no torch_memory_saver package (pip install torch_memory_saver, or pass \
                    --upstream-lib PATH)"
            .into());
    }
    let site = Path::new(&package).parent().unwrap_or(Path::new("/"));
    for suffix in ["_cu13", "_cu12", ""] {
        let lib = site.join(format!("torch_memory_saver_hook_mode_preload{suffix}.abi3.so"));
        if is_torch_memory_saver(&lib) {
            return Ok(lib);
        }
    }
    Err(format!(
        "no torch_memory_saver library of its own in {} (the installed package may be tms-memory-saver's)",
        site.display()
    ))
}

/// The library to compare with, or why there is none.
pub fn resolve(choice: &UpstreamLib) -> Result<PathBuf, String> {
    match choice {
        UpstreamLib::Off => Err("--upstream-lib none".into()),
        UpstreamLib::Auto => find_in_python(),
        UpstreamLib::Path(p) if is_torch_memory_saver(p) => Ok(p.clone()),
        UpstreamLib::Path(p) => Err(format!(
            "{} is not torch_memory_saver's library (missing, or libtms_hook.so under its name)",
            p.display()
        )),
    }
}

/// Runs the comparison; prints its table. Returns the JSON record and, when both libraries ran,
/// the ratios (upstream time / ours) for pause and resume with backup at the largest size.
fn compare(env: &Env, lib: Result<PathBuf, String>, quick: bool) -> (Value, Option<(f64, f64)>) {
    let lib = match lib {
        Ok(lib) => lib,
        Err(why) => {
            println!("\nSide by side with torch_memory_saver's library: skipped ({why})");
            return (json!({ "skipped": why }), None);
        }
    };
    let sizes: Vec<usize> =
        if quick { vec![16, 128] } else { vec![64, 256, 1024] }.into_iter().map(|m| m * MIB).collect();
    let args =
        [sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(","), (if quick { 3 } else { 5 }).to_string()];
    let ours = env.worker(true, "side", &args);
    let lib_str = lib.to_string_lossy().to_string();
    let theirs = env.worker_with(false, "side", &args, &SimNode::default(), &[("LD_PRELOAD", lib_str.as_str())]);
    let (ours, theirs) = match (ours, theirs) {
        (Ok(o), Ok(t)) => (o, t),
        (o, t) => {
            let why = [o.err().map(|e| format!("tms: {e}")), t.err().map(|e| format!("torch_memory_saver: {e}"))]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join("; ");
            println!("\nSide by side with torch_memory_saver's library: failed ({why})");
            return (json!({ "library": lib_str, "failed": why }), None);
        }
    };
    let rows_of = |v: &Value| v["rows"].as_array().cloned().unwrap_or_default();
    let (ours_rows, their_rows) = (rows_of(&ours), rows_of(&theirs));
    println!("\nSide by side with torch_memory_saver's library ({lib_str}): the same C calls in the same run");
    println!("(median wall time of tms_pause / tms_resume; x: upstream's time over ours; kept: contents after the");
    println!("last resume, ours / upstream's).");
    let kept = |r: &Value| match r["contents_intact"].as_bool() {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "-",
    };
    let lines = ours_rows
        .iter()
        .zip(&their_rows)
        .map(|(o, t)| {
            vec![
                human(f(o, "bytes")),
                (if o["backup"] == true { "yes" } else { "no" }).to_string(),
                format!("{:.3}", f(o, "pause_ns") / 1e6),
                format!("{:.3}", f(t, "pause_ns") / 1e6),
                format!("{:.2}", f(t, "pause_ns") / f(o, "pause_ns")),
                format!("{:.3}", f(o, "resume_ns") / 1e6),
                format!("{:.3}", f(t, "resume_ns") / 1e6),
                format!("{:.2}", f(t, "resume_ns") / f(o, "resume_ns")),
                format!("{} / {}", kept(o), kept(t)),
            ]
        })
        .collect();
    let header = [
        "bytes",
        "backup",
        "pause ms ours",
        "pause ms upstream",
        "pause x",
        "resume ms ours",
        "resume ms upstream",
        "resume x",
        "kept",
    ];
    println!("{}", table(&header, lines));
    let largest = |rows: &[Value]| {
        rows.iter().filter(|r| r["backup"] == true).max_by(|a, b| f(a, "bytes").total_cmp(&f(b, "bytes"))).cloned()
    };
    let ratios = match (largest(&ours_rows), largest(&their_rows)) {
        (Some(o), Some(t)) => Some((f(&t, "pause_ns") / f(&o, "pause_ns"), f(&t, "resume_ns") / f(&o, "resume_ns"))),
        _ => None,
    };
    (json!({ "library": lib_str, "tms": ours, "torch_memory_saver": theirs }), ratios)
}
