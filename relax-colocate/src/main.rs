//! `relax-colocate`: the colocate driver and the benchmark harness of tms.
//!
//! `relax-colocate bench` measures the hook against the physical limit in one command. The
//! colocated GRPO/PPO runner (`relax-colocate run`) is not implemented yet.

mod bench;
mod runtime;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "relax-colocate",
    version,
    about = "Colocated RL driver and benchmark harness for tms",
    after_help = "Exit codes: 0 success, 1 a measurement or run failed, 2 usage error."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure interception, region allocation, pause/resume (bytes and counts, with and without
    /// backup) against the raw pinned copy, and host memory; print tables, write JSON and SVG.
    Bench {
        /// Where to run: the real CUDA driver, the simulator, or auto (CUDA if present).
        #[arg(long, value_enum, default_value = "auto")]
        device: bench::DeviceKind,
        /// Small sizes and iteration counts (about a minute; what CI runs).
        #[arg(long)]
        quick: bool,
        /// Output folder for results.json and the plots.
        #[arg(long, default_value = "runs/bench")]
        out: PathBuf,
        /// libtms_hook.so to measure (default: next to this binary, or ../lib).
        #[arg(long)]
        hook: Option<PathBuf>,
        /// Simulator: capacity of the device.
        #[arg(long, default_value = "64GiB")]
        sim_memory: String,
        /// Simulator: host<->device copy bandwidth per direction in GB/s, like a PCIe link
        /// (0: unthrottled host memcpy).
        #[arg(long, default_value_t = 25.0)]
        sim_copy_gbps: f64,
    },
    /// Internal: one measurement, run in a child process by `bench`.
    #[command(hide = true)]
    BenchWorker { args: Vec<String> },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench { device, quick, out, hook, sim_memory, sim_copy_gbps } => {
            if !(sim_copy_gbps >= 0.0 && sim_copy_gbps.is_finite()) {
                eprintln!("relax-colocate: --sim-copy-gbps must be a number >= 0");
                return ExitCode::from(2);
            }
            let opts = bench::Options { device, quick, out, hook, sim_memory, sim_copy_gbps };
            match bench::run(&opts) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("relax-colocate: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::BenchWorker { args } => match bench::worker_main(&args) {
            Ok(v) => {
                println!("{v}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(1)
            }
        },
    }
}
