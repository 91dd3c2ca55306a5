//! `relax-colocate`: the colocate driver and the benchmark harness of tms.
//!
//! `relax-colocate run` drives a trainer and a rollout worker per device through the colocated
//! GRPO/PPO cycle and times it; `relax-colocate bench` measures the hook against the physical
//! limit in one command.

mod bench;
mod collective;
mod compare;
mod environment;
mod plan;
mod plot;
mod run;
mod runtime;
mod vendor;

use clap::{CommandFactory, Parser, Subcommand};
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
    /// Run a colocated GRPO/PPO job: per device one trainer and one rollout worker under
    /// libtms_hook.so, taking turns with device memory every step (generate, rollout offload,
    /// wake_up, ref/old log-probs, advantages, train, sleep, update_weights, onload). Times every
    /// phase, checks memory and weights every step, and writes metrics, a summary and plots.
    #[command(after_long_help = RUN_HELP)]
    Run(Box<RunArgs>),
    /// Measure interception, region allocation, pause/resume (bytes and counts, with and without
    /// backup) against the raw pinned copy, host memory, and an ncclBroadcast between two devices
    /// against the link, through CUDA or ACL (Ascend); print tables, write JSON and SVG.
    Bench(Box<BenchArgs>),
    /// Run the same job colocated, async and elastic (same profile, batch, steps and total
    /// devices), one after the other, and print one table (samples/s, tokens/s, step time, each
    /// side's busy and idle share, weight-update time, lends and their cost, staleness, reward)
    /// and plot reward against time. Device compute
    /// is modelled from the memory profile by default (compute.model), so the comparison shows the
    /// layout rather than this machine's CPU.
    #[command(after_long_help = COMPARE_HELP)]
    Compare(Box<compare::Options>),
    /// Predict each layout's step time, phase times and samples/s for a job without running it:
    /// the compute model, the switch model and the schedules compare's runs are charged by,
    /// played on a modelled clock in milliseconds (the runner's own overhead is not in it).
    #[command(after_long_help = PLAN_HELP)]
    Plan(Box<plan::Options>),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Print the manual page (roff; scripts/install.sh puts it in PREFIX/share/man/man1).
    Man,
    /// Internal: a built-in worker process of `run` (trainer or rollout).
    #[command(hide = true)]
    Worker { role: String },
    /// Internal: one measurement, run in a child process by `bench`.
    #[command(hide = true)]
    BenchWorker { args: Vec<String> },
}

const PLAN_HELP: &str = "\
Takes the flags compare takes (--config, --set, --devices, the device split, --steps,
--max-staleness, --layouts, --lengths) and predicts what compare's runs of the same job would take, from the
same models: each engine's prefill and decode steps (roofline, fixed latency, KV capacity), the
trainer's passes, the switch (sleep, wake, offload, onload, the weight update) and the async
queue, staleness bound and weight updates on a modelled clock. Response lengths are drawn from
--lengths FILE as the runs draw them (each sample by its identity, and by its batch's step when
the file's lines name their step), or else are the ones the built-in policy samples at its
initial weights on the run's prompts.

Output: a table, or with --json {\"job\": {...}, \"layouts\": {\"colocate\": {\"samples_per_s\", \"step_s\",
\"phases\": {...}, ...}, \"async\": {...}, \"elastic\": {...}}, \"verdict\": {...}}. Times are seconds
of the modelled device; step_s is the mean step after the job's first batch (a layout in parts of
it leaves out as many of its steps).

Exit codes: 0 predicted, 2 the job does not run as configured (the run's own checks, named).";

const RUN_HELP: &str = "\
Configuration: defaults, then --config FILE, then the flags above, then each --set. Every key is
listed with its meaning by --print-config; the run directory records the effective one.

Output: a progress line per step on stderr; at the end the phase table (median, p90, share of the
step) on stdout, or the summary as JSON with --json. The run directory (run.out, default
runs/run-<UTC time>) holds config.toml, metrics.jsonl (one flat line of numbers per step, under
slime's names or verl's with --metrics-style verl: perf/*_time, rollout/raw_reward,
passrate/pass@k, train/pg_clipfrac, train/ppo_kl, ..., and device memory per process and tag at
every phase boundary as memory/<process>/<tag>/<phase>_bytes; docs/metrics.md has the table),
memory.jsonl, summary.json, memory_timeline.svg, memory_per_step.svg, reward.svg and logs/<worker>.log; with
--logger tensorboard also tensorboard/events.out.tfevents.*, with --logger wandb a wandb run
(WANDB_MODE=offline keeps it in wandb/; needs `pip install wandb`).

Device presets (compute.device, --compute-device): h100 (the default), h800, h20, 910b, 910c. With
compute.model each fills the compute model's figures the job does not set (peak TFLOPS, HBM, host
copies, collective and pinning rates, driver map/unmap costs), each from a source named in
docs/device-figures.md; a figure a preset has no source for is left unset, and a job that needs it
must set it (the 910b has no published HBM bandwidth: --set compute.hbm_gbps=...). A [compute]
key the job sets always wins. The switch (sleep, wake-up, offload, onload, update_weights) is then
charged from the memory profile's full-scale bytes at those figures; summary.json's switch block
keeps the measured times beside the modelled ones.

Checks every step (run.checks): device free memory rose by at least the bytes each pause reported;
trainer weights after wake_up and rollout weights after update_weights match the trainer's
checksum; device memory at each phase does not grow past its step-2 level. A failed check stops
the run.

Exit codes: 0 the run completed and every check passed; 1 the run failed (a worker crashed, hung
or was stopped past run.phase_timeout_s, ran out of memory, or a check failed: the message names
the phase, the worker and the cause, and partial results stay in the run directory); 2 bad
configuration or usage (a device this machine lacks, a simulated device too small for the contexts
or a simulated run larger than the host's memory included). With --json, stdout holds one JSON
object whatever the outcome (a failure's status, kind and cause included); 130 interrupted (Ctrl-C or SIGTERM, which end every wait at once).

Examples:
  relax-colocate run                                   # GRPO on the simulator (no GPU needed)
  relax-colocate run --algo ppo --steps 40
  relax-colocate run --memory-profile qwen3-4b --tp 2 --device cuda
  relax-colocate run --set memory.scale=0.01 --memory-profile qwen3-8b --device sim
  relax-colocate run --offload false                   # see the OOM the saver prevents
  relax-colocate run --mode async --devices 2 --max-staleness 2   # trainer on 0, rollout on 1, overlapped
  relax-colocate run --mode elastic --devices 2   # as async, the trainer's device generating while it waits
  relax-colocate run --trainer-cmd 'python3 my_trainer.py' --rollout-cmd 'python3 my_engine.py'";

const COMPARE_HELP: &str = "\
Each layout is a `relax-colocate run` (its run directory is OUT/colocate, OUT/async and
OUT/elastic); --set passes any configuration key to every run. compare.json holds the table's
figures and the throughput ratios (each layout over the others, and elastic over the better of the
others), reward_vs_time.svg the plot. Exit codes: 0 every run completed; 1 a run failed; 2 bad
configuration (the failed run's message says which key).

Examples:
  relax-colocate compare --devices 4 --steps 10
  relax-colocate compare --devices 4 --layouts colocate,async
  relax-colocate compare --devices 4 --trainer-devices 0 --rollout-devices 1-3 --set rollout.prompts_per_step=24";

#[derive(clap::Args)]
struct BenchArgs {
    /// Where to run: the real CUDA driver, an Ascend NPU through ACL (CANN), the simulator,
    /// or auto (CUDA if present, else an NPU if CANN is, else the simulator).
    #[arg(long, value_enum, default_value = "auto")]
    device: bench::DeviceKind,
    /// The vendor API the scenarios call: the device's own by default (cuda, acl for npu).
    /// `--device sim --api acl` runs the NPU path on the simulator.
    #[arg(long, value_enum)]
    api: Option<vendor::ApiKind>,
    /// Small sizes and iteration counts (about 30 s on the simulator; what CI runs).
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
    /// (0: the simulator's own rate, 50 GB/s).
    #[arg(long, default_value_t = 25.0)]
    sim_copy_gbps: f64,
    /// Simulator: the link between the collective row's two devices in GB/s per direction
    /// (TMS_SIM_LINK_GBPS for its ranks; 0: no modelled time). The default is a rate a busy
    /// 2-core host carries, so the row measures the simulator against its model, not the host.
    #[arg(long, default_value_t = 0.5)]
    sim_link_gbps: f64,
    /// The collective row's ncclBroadcast sizes, comma-separated (default 64MiB,256MiB,1GiB;
    /// 16MiB,64MiB with --quick).
    #[arg(long, value_delimiter = ',', value_parser = parse_bytes)]
    broadcast_sizes: Option<Vec<usize>>,
    /// Exit 1 when a target is missed (without it, missed targets are reported and the exit
    /// is 0: the figures are the product).
    #[arg(long)]
    check: bool,
    /// torch_memory_saver's own preload library to run side by side with ours, through the
    /// same C calls in the same run (CUDA only): a path, `auto` (the torch_memory_saver
    /// package of `python3` on PATH, if it is torch_memory_saver's own), or `none`. Two more
    /// targets are judged when it runs: pause and resume with backup no slower than it.
    #[arg(long, default_value = "auto", value_name = "PATH|auto|none")]
    upstream_lib: bench::UpstreamLib,
}

#[derive(clap::Args)]
struct RunArgs {
    /// TOML configuration file (see --print-config for every key); its `[layouts.MODE]` section
    /// for this run's mode applies over its other keys (docs/async.md).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override any configuration key: --set algo.lr=0.01 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// Print the default configuration with every key explained, and exit.
    #[arg(long)]
    print_config: bool,
    /// RL steps [run.steps].
    #[arg(long)]
    steps: Option<u64>,
    /// grpo or ppo [algo.name].
    #[arg(long, value_enum)]
    algo: Option<run::config::AlgoName>,
    /// auto, sim, cuda or npu [run.device].
    #[arg(long, value_enum)]
    device: Option<run::config::DeviceChoice>,
    /// colocate (trainer and rollout take turns on every device), async (each role on devices
    /// of its own, overlapped, samples at most --max-staleness updates old; docs/async.md) or
    /// elastic (async, and a trainer waiting for samples lends its devices to extra rollout
    /// engines until its batch is ready; [elastic] keys) [run.mode].
    #[arg(long, value_enum)]
    mode: Option<run::config::Mode>,
    /// Devices (per node); colocate: one trainer and one rollout worker on each [run.devices].
    #[arg(long)]
    devices: Option<u32>,
    /// Async, elastic: the trainer's devices, e.g. 0 or 0-1,4 (default: the first half)
    /// [run.trainer_devices].
    #[arg(long)]
    trainer_devices: Option<String>,
    /// Async, elastic: the rollout engines' devices (default: the rest) [run.rollout_devices].
    #[arg(long)]
    rollout_devices: Option<String>,
    /// Async: drop samples whose oldest token is more than this many weight updates old
    /// [async.max_staleness].
    #[arg(long, allow_hyphen_values = true)]
    max_staleness: Option<i64>,
    /// Async: trainer steps between weight updates to the rollout [async.train_iters_per_update].
    #[arg(long)]
    train_iters_per_update: Option<u64>,
    /// How weights reach the rollout: ipc (device memory handles, device to device; colocate
    /// mode), broadcast (NCCL/HCCL; async mode), host (the shared bucket file, the fallback) or
    /// auto (ipc colocated and broadcast in async mode when the workers name them in their hello,
    /// as the built-in workers do, and the PyTorch workers for broadcast; else host)
    /// [run.weight_transport].
    #[arg(long, value_enum)]
    weight_transport: Option<run::config::WeightTransport>,
    /// local or ray: who starts the workers [run.launcher].
    #[arg(long, value_enum)]
    launcher: Option<run::config::Launcher>,
    /// Nodes, with --devices devices each (--launcher ray) [run.nodes].
    #[arg(long)]
    nodes: Option<u32>,
    /// local (a throwaway cluster on this machine), auto, or HOST:PORT [run.ray_address].
    #[arg(long)]
    ray_address: Option<String>,
    /// Memory shape preset: none, tiny, qwen3-0.6b, qwen3-4b, qwen3-8b, qwen2.5-7b [memory.profile].
    #[arg(long)]
    memory_profile: Option<String>,
    /// The device compute.model charges at: h100, h800, h20, 910b or 910c [compute.device].
    #[arg(long, value_name = "DEVICE")]
    compute_device: Option<String>,
    /// A file of your job's response lengths (one per line in tokens, or JSON lines with a
    /// "length" field, and a "step" on every line for lengths that change over the run): each
    /// sample's modelled response length is drawn from it (from its batch's step's lines), the
    /// same in every layout; needs compute.model [compute.lengths; compute.lengths_first_step
    /// picks the file's step that step 1 stands for].
    #[arg(long, value_name = "FILE")]
    lengths: Option<PathBuf>,
    /// Tensor-parallel size of the memory profile [memory.tp].
    #[arg(long)]
    tp: Option<u32>,
    /// Pause and resume (true) or keep both roles resident (false) [run.offload].
    #[arg(long)]
    offload: Option<bool>,
    /// Trainer sleep keeps a CPU backup in the hook [memory.backup].
    #[arg(long)]
    backup: Option<bool>,
    /// update_weights bucket size, e.g. 512MiB [memory.update_weight_buffer_size].
    #[arg(long)]
    update_weight_buffer_size: Option<String>,
    /// Prompts per step [rollout.prompts_per_step].
    #[arg(long)]
    prompts: Option<usize>,
    /// Samples per prompt, the GRPO group size [rollout.samples_per_prompt].
    #[arg(long)]
    samples: Option<usize>,
    /// Learning rate [algo.lr].
    #[arg(long)]
    lr: Option<f64>,
    /// KL coefficient [algo.kl_coef].
    #[arg(long)]
    kl_coef: Option<f64>,
    /// KL estimator k1, k2 or k3 [algo.kl_type].
    #[arg(long)]
    kl_type: Option<String>,
    /// Seed [run.seed].
    #[arg(long)]
    seed: Option<u64>,
    /// Run directory [run.out].
    #[arg(long)]
    out: Option<PathBuf>,
    /// External trainer worker command (docs/worker-protocol.md) [run.trainer_cmd].
    #[arg(long)]
    trainer_cmd: Option<String>,
    /// External rollout worker command [run.rollout_cmd].
    #[arg(long)]
    rollout_cmd: Option<String>,
    /// Seconds any one wait on a worker (request or control call) may take [run.phase_timeout_s].
    #[arg(long)]
    phase_timeout: Option<f64>,
    /// Simulator capacity per device: auto or a size [sim.memory].
    #[arg(long)]
    sim_memory: Option<String>,
    /// Metric names: slime (default) or verl [metrics.style].
    #[arg(long, value_enum)]
    metrics_style: Option<run::metrics::Style>,
    /// Also log every step to tensorboard (event files in the run directory) and/or wandb
    /// (repeatable or comma-separated; default none) [metrics.loggers].
    #[arg(long = "logger", value_name = "LOGGER", value_enum, value_delimiter = ',')]
    loggers: Vec<run::loggers::LoggerKind>,
    /// libtms_hook.so to preload (default: next to this binary, or ../lib).
    #[arg(long)]
    hook: Option<PathBuf>,
    /// Folder of the workers' control sockets, for `tms-ctl --dir` and monitoring scripts
    /// (default: $TMS_CONTROL_DIR when set, else a private folder of the run). Created if
    /// missing; refused if another user owns it or others can write to it. Written to
    /// RUN_DIR/ctl_dir when the run starts. Local launcher only: with Ray each node's workers
    /// serve in a folder of that node, printed at start.
    #[arg(long, value_name = "DIR")]
    ctl_dir: Option<PathBuf>,
    /// Print the summary as JSON on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// No progress output.
    #[arg(long, short)]
    quiet: bool,
}

impl RunArgs {
    /// The named flags, as --set assignments applied before the explicit ones.
    fn assignments(&self) -> Vec<String> {
        let named = self.flag_settings().into_iter().filter_map(|(key, value)| Some(format!("{key}={}", value?)));
        named.chain(self.sets.iter().cloned()).collect()
    }

    /// Each named flag's config key and, when the flag was given, its value as --set reads it:
    /// strings quoted, floats in their round-trip form.
    fn flag_settings(&self) -> Vec<(&'static str, Option<String>)> {
        let text = |s: Option<&str>| s.map(quoted);
        vec![
            ("run.steps", self.steps.map(|x| x.to_string())),
            ("algo.name", self.algo.map(|a| quoted(algo_name(a)))),
            ("run.device", self.device.map(|d| quoted(device_name(d)))),
            ("run.mode", self.mode.map(|m| quoted(m.as_str()))),
            ("run.devices", self.devices.map(|x| x.to_string())),
            ("run.trainer_devices", text(self.trainer_devices.as_deref())),
            ("run.rollout_devices", text(self.rollout_devices.as_deref())),
            ("async.max_staleness", self.max_staleness.map(|x| x.to_string())),
            ("async.train_iters_per_update", self.train_iters_per_update.map(|x| x.to_string())),
            ("run.weight_transport", self.weight_transport.map(|t| quoted(t.as_str()))),
            ("run.launcher", self.launcher.map(|l| quoted(launcher_name(l)))),
            ("run.nodes", self.nodes.map(|x| x.to_string())),
            ("run.ray_address", text(self.ray_address.as_deref())),
            ("memory.profile", text(self.memory_profile.as_deref())),
            ("compute.device", text(self.compute_device.as_deref())),
            ("compute.lengths", self.lengths.as_ref().map(|p| quoted(&p.display().to_string()))),
            ("memory.tp", self.tp.map(|x| x.to_string())),
            ("run.offload", self.offload.map(|x| x.to_string())),
            ("memory.backup", self.backup.map(|x| x.to_string())),
            ("memory.update_weight_buffer_size", text(self.update_weight_buffer_size.as_deref())),
            ("rollout.prompts_per_step", self.prompts.map(|x| x.to_string())),
            ("rollout.samples_per_prompt", self.samples.map(|x| x.to_string())),
            ("algo.lr", self.lr.map(|x| format!("{x:?}"))),
            ("algo.kl_coef", self.kl_coef.map(|x| format!("{x:?}"))),
            ("algo.kl_type", text(self.kl_type.as_deref())),
            ("run.seed", self.seed.map(|x| x.to_string())),
            ("run.out", self.out.as_ref().map(|p| quoted(&p.display().to_string()))),
            ("run.trainer_cmd", text(self.trainer_cmd.as_deref())),
            ("run.rollout_cmd", text(self.rollout_cmd.as_deref())),
            ("run.phase_timeout_s", self.phase_timeout.map(|x| format!("{x:?}"))),
            ("sim.memory", text(self.sim_memory.as_deref())),
            ("metrics.style", self.metrics_style.map(|m| quoted(style_name(m)))),
            ("metrics.loggers", logger_list(&self.loggers)),
        ]
    }
}

/// A string value as --set parses it: a TOML basic string, quoted and escaped.
fn quoted(s: &str) -> String {
    format!("{s:?}")
}

fn algo_name(a: run::config::AlgoName) -> &'static str {
    match a {
        run::config::AlgoName::Grpo => "grpo",
        run::config::AlgoName::Ppo => "ppo",
    }
}

fn device_name(d: run::config::DeviceChoice) -> &'static str {
    match d {
        run::config::DeviceChoice::Auto => "auto",
        run::config::DeviceChoice::Sim => "sim",
        run::config::DeviceChoice::Cuda => "cuda",
        run::config::DeviceChoice::Npu => "npu",
    }
}

fn launcher_name(l: run::config::Launcher) -> &'static str {
    match l {
        run::config::Launcher::Local => "local",
        run::config::Launcher::Ray => "ray",
    }
}

fn style_name(m: run::metrics::Style) -> &'static str {
    match m {
        run::metrics::Style::Slime => "slime",
        run::metrics::Style::Verl => "verl",
    }
}

/// `--logger`'s values as one quoted, comma-separated list; None when none was given, so that
/// the configured loggers stay.
fn logger_list(loggers: &[run::loggers::LoggerKind]) -> Option<String> {
    if loggers.is_empty() {
        return None;
    }
    let names: Vec<&str> = loggers
        .iter()
        .map(|l| match l {
            run::loggers::LoggerKind::Tensorboard => "tensorboard",
            run::loggers::LoggerKind::Wandb => "wandb",
        })
        .collect();
    Some(quoted(&names.join(",")))
}

/// A size such as `64MiB` or `1GiB` (tms's size syntax).
fn parse_bytes(text: &str) -> Result<usize, String> {
    let n = tms_proto::size::parse_size(text)?;
    if n == 0 { Err("a size must be > 0".into()) } else { usize::try_from(n).map_err(|e| e.to_string()) }
}

/// `relax-colocate bench`: checks the flags, runs the bench, exits by its verdict.
fn bench_main(args: BenchArgs) -> ExitCode {
    let BenchArgs {
        device,
        api,
        quick,
        out,
        hook,
        sim_memory,
        sim_copy_gbps,
        sim_link_gbps,
        broadcast_sizes,
        check,
        upstream_lib,
    } = args;
    for (flag, v) in [("--sim-copy-gbps", sim_copy_gbps), ("--sim-link-gbps", sim_link_gbps)] {
        if !(v >= 0.0 && v.is_finite()) {
            eprintln!("relax-colocate: {flag} must be a number >= 0");
            return ExitCode::from(2);
        }
    }
    if let bench::UpstreamLib::Path(_) = &upstream_lib {
        let ascend = api == Some(vendor::ApiKind::Acl) || device == bench::DeviceKind::Npu;
        let refused = match bench::upstream::resolve(&upstream_lib) {
            Err(e) => Some(e),
            Ok(_) if ascend => Some("torch_memory_saver has no Ascend backend".to_string()),
            Ok(_) => None,
        };
        if let Some(why) = refused {
            eprintln!(
                "relax-colocate: --upstream-lib: {why}; pass torch_memory_saver's own preload library \
                 (CUDA only), or none"
            );
            return ExitCode::from(2);
        }
    }
    let opts = bench::Options {
        device,
        api,
        quick,
        out,
        hook,
        sim_memory,
        sim_copy_gbps,
        sim_link_gbps,
        broadcast_sizes,
        upstream_lib,
    };
    match bench::run(&opts) {
        Ok(verdict) if verdict.missed.is_empty() => ExitCode::SUCCESS,
        Ok(verdict) => {
            let what = format!("{} of {} targets missed", verdict.missed.len(), verdict.targets);
            if check {
                eprintln!("relax-colocate bench --check: {what}: {}", verdict.missed.join("; "));
                ExitCode::from(1)
            } else {
                eprintln!("relax-colocate bench: {what} (--check makes that exit 1)");
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("relax-colocate: {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => {
            if args.print_config {
                print!("{}", run::config::DEFAULT_TOML);
                return ExitCode::SUCCESS;
            }
            let opts = run::Options {
                config: args.config.clone(),
                sets: args.assignments(),
                hook: args.hook.clone(),
                ctl_dir: args
                    .ctl_dir
                    .clone()
                    .or_else(|| std::env::var_os("TMS_CONTROL_DIR").filter(|d| !d.is_empty()).map(PathBuf::from)),
                json: args.json,
                quiet: args.quiet,
            };
            ExitCode::from(run::run(&opts))
        }
        Command::Worker { role } => match run::worker::main(&role) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("relax-colocate worker: {e}");
                ExitCode::from(1)
            }
        },
        Command::Compare(o) => ExitCode::from(compare::main(&o)),
        Command::Plan(o) => ExitCode::from(plan::main(&o)),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "relax-colocate", &mut std::io::stdout());
            ExitCode::SUCCESS
        }
        Command::Man => match tms_proto::manual::render(Cli::command(), &mut std::io::stdout()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("relax-colocate man: cannot write the manual page: {e}");
                ExitCode::from(1)
            }
        },
        Command::Bench(args) => bench_main(*args),
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
