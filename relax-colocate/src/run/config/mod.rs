//! Configuration: the commented default file (default.toml) is the single source of defaults; a
//! user file and `--set` overrides are merged over it, then checked. Unknown keys are errors.

use super::algo::{Aggregation, KlKind};
use super::task::RewardKind;
use serde::{Deserialize, Serialize};

mod checks;
pub mod devices;

pub const DEFAULT_TOML: &str = include_str!("../default.toml");

/// tms-sim's own link model when TMS_SIM_LINK_GBPS is not set (docs/simulator.md): an H100's
/// NVLink within a node, 50 GB/s between nodes.
const SIM_LINK_INTRA_GBPS: f64 = 450.0;
const SIM_LINK_INTER_GBPS: f64 = 50.0;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub run: RunSection,
    #[serde(rename = "async")]
    pub asynchronous: AsyncSection,
    pub elastic: ElasticSection,
    pub compute: ComputeSection,
    pub task: TaskSection,
    pub rollout: RolloutSection,
    pub algo: AlgoSection,
    pub model: ModelSection,
    pub memory: MemorySection,
    pub sim: SimSection,
    pub metrics: MetricsSection,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    pub mode: Mode,
    pub steps: u64,
    pub seed: u64,
    pub device: DeviceChoice,
    pub devices: u32,
    pub trainer_devices: String,
    pub rollout_devices: String,
    pub out: String,
    pub phase_timeout_s: f64,
    pub checks: bool,
    pub leak_tolerance_mib: f64,
    pub offload: bool,
    pub trainer_cmd: String,
    pub rollout_cmd: String,
    pub launcher: Launcher,
    pub nodes: u32,
    pub ray_address: String,
    pub ray_python: String,
    pub weight_transport: WeightTransport,
}

/// How the trainer's weights reach the rollout: declared with the transports (transport/mod.rs).
pub use super::transport::WeightTransport;

/// How trainer and rollout share the devices (docs/async.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Every device holds a trainer and a rollout worker, which take turns with its memory.
    Colocate,
    /// The trainer and the rollout engines on separate devices, overlapped, samples at most
    /// `async.max_staleness` weight versions old.
    Async,
    /// Async's layout, plus lending: a trainer waiting for samples sleeps and an extra rollout
    /// engine generates on its device until the batch is ready ([elastic]).
    Elastic,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Colocate => "colocate",
            Mode::Async => "async",
            Mode::Elastic => "elastic",
        }
    }

    /// Whether trainer and rollout engines have devices of their own (async and elastic).
    pub fn split(self) -> bool {
        self != Mode::Colocate
    }
}

/// Elastic mode's lending (docs/async.md, "Elastic mode").
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ElasticSection {
    /// Seconds the trainer waits for samples before lending its devices; 0: the measured switch
    /// time (a lend and its reclaim), so the wait never exceeds what a lend costs.
    pub lend_after_s: f64,
    /// Seconds a lent engine has, once the trainer needs its device back, to finish its segment;
    /// then its memory is paused from outside and it is retired.
    pub reclaim_timeout_s: f64,
    /// The reverse: a lent trainer beside every rollout engine takes part in a trainer step
    /// while the engines have nothing they may start (a trainer-bound job).
    #[serde(default)]
    pub lend_rollout: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AsyncSection {
    /// Signed so that a negative value is refused by name rather than as a type error.
    pub max_staleness: i64,
    pub train_iters_per_update: u64,
    pub queue_groups: u64,
    /// Prompt groups an engine decodes at once; 0: the trainer's batch over the engines. A
    /// trainer that takes its batch in parts would otherwise shrink its engines' batches with
    /// them, where real engines hold what their own limits allow.
    #[serde(default)]
    pub engine_groups: u64,
    pub segment_tokens: u64,
    /// With compute.model: the modelled seconds of decoding a segment may take; it ends when they
    /// are spent, part-way through a task token if need be, the sequences keeping their progress.
    /// 0: segments bounded by segment_tokens alone.
    pub segment_s: f64,
}

fn yes() -> bool {
    true
}

fn one() -> f64 {
    1.0
}

/// Modelled device compute time (docs/async.md, "Modelled compute").
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeSection {
    pub model: bool,
    /// The device preset (config/devices.rs) whose figures fill the keys the job left out.
    pub device: String,
    pub tflops: f64,
    pub train_mfu: f64,
    pub rollout_mfu: f64,
    pub token_scale: f64,
    /// The modelled tokens per task token of the last step's samples: responses grow linearly
    /// from token_scale over the run, as RL responses lengthen while the policy learns. 0: constant.
    pub token_scale_final: f64,
    /// With token_scale_final: a sample's growth follows the weight version that generated it
    /// (stale samples cheaper), not its place in the run's order of prompts.
    pub cost_by_version: bool,
    /// Modelled seconds per wall-clock second (clock.rs): a job of modelled minutes a step runs
    /// in seconds. 1: the wall clock.
    #[serde(default = "one")]
    pub time_scale: f64,
    pub hbm_gbps: f64,
    pub decode_step_ms: f64,
    /// Engines admit sequences while the profile's KV cache holds them, and preempt when it does
    /// not (docs/async.md, "KV capacity"); false: every sequence of a request decodes at once.
    #[serde(default = "yes")]
    pub kv_capacity: bool,
    pub h2d_gbps: f64,
    pub d2h_gbps: f64,
    pub collective_gbps: f64,
    pub pin_gbps: f64,
    pub map_ms_per_gib: f64,
    pub unmap_ms_per_gib: f64,
    /// A file of response lengths (lengths.rs) each sample's modelled response length is drawn
    /// from, in place of its task tokens x token_scale; stored absolute. Empty: none.
    #[serde(default)]
    pub lengths: String,
    /// With a lengths file that names steps: the file's step the run's step 1 stands for. 0: the
    /// file's first.
    #[serde(default)]
    pub lengths_first_step: u64,
    /// The file's lengths, read when the configuration is loaded.
    #[serde(skip)]
    pub(crate) lengths_table: Option<std::sync::Arc<crate::run::lengths::Lengths>>,
    /// Figure keys neither the job nor its device's preset gives (0 above): refused where the
    /// run needs one.
    #[serde(skip)]
    pub unset: Vec<String>,
}

/// Who places the workers: child processes of the runner, or Ray (docs/ray.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Launcher {
    Local,
    Ray,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    Auto,
    Sim,
    Cuda,
    Npu,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSection {
    pub digits: u32,
    pub reward: RewardKind,
    #[serde(default)]
    pub max_new_tokens: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutSection {
    pub prompts_per_step: usize,
    pub samples_per_prompt: usize,
    pub temperature: f64,
    /// The job's prompts per step before a `[layouts.MODE]` section of the job file changed them
    /// for this layout: the batch the run's clock of prompts counts in (a lengths file's steps,
    /// responses that grow), so that every layout draws a sample alike. 0: prompts_per_step.
    /// Recorded in a run's config.toml, so that a run from that file draws as its job did.
    #[serde(default)]
    pub job_prompts_per_step: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AlgoName {
    Grpo,
    Ppo,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlgoSection {
    pub name: AlgoName,
    pub dr_grpo: bool,
    pub lr: f64,
    pub max_grad_norm: f64,
    pub minibatches: usize,
    pub epochs: usize,
    pub clip_eps_low: f64,
    pub clip_eps_high: f64,
    pub dual_clip: f64,
    pub kl_coef: f64,
    pub kl_type: KlKind,
    /// false: no reference model, so no reference pass (nothing may need its log-probs).
    pub reference: bool,
    /// true: the old log-probs are the rollout engine's, so no actor pass before training.
    pub rollout_log_probs: bool,
    pub entropy_coef: f64,
    pub aggregation: Aggregation,
    pub gamma: f64,
    pub lambda: f64,
    pub value_coef: f64,
    pub value_clip: f64,
    pub whiten_advantages: bool,
    pub off_policy_correction: OffPolicyCorrection,
    pub tis_cap: f64,
    pub allow_uncorrected_stale: bool,
}

/// How the trainer corrects for samples whose tokens older weights generated (docs/async.md,
/// "Off-policy correction").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffPolicyCorrection {
    /// `tis` whenever trainer and rollout run apart (every mode but colocate), `none` colocated.
    Auto,
    /// Truncated importance sampling: each token's policy-gradient term weighted by
    /// min(exp(old_lp - rollout_lp), algo.tis_cap).
    Tis,
    None,
}

impl OffPolicyCorrection {
    pub fn as_str(self) -> &'static str {
        match self {
            OffPolicyCorrection::Auto => "auto",
            OffPolicyCorrection::Tis => "tis",
            OffPolicyCorrection::None => "none",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub hidden: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySection {
    pub profile: String,
    pub tp: u32,
    pub scale: f64,
    pub kv_cache_gib: f64,
    pub backup: bool,
    /// The trainers' sleep also suspends their NCCL communicators (tag `nccl`).
    pub suspend_communicators: bool,
    pub update_weight_buffer_size: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimSection {
    pub api: String,
    pub memory: String,
    pub copy_gbps: f64,
    pub link_gbps: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSection {
    pub style: super::metrics::Style,
    /// Comma-separated, so that `--set metrics.loggers=tensorboard,wandb` works as a file value does.
    pub loggers: String,
    pub python: String,
    pub wandb_project: String,
}

/// Sets `section.key` in a TOML table from `value`, read as a TOML value when it parses as one
/// (numbers, booleans, quoted strings) and as a bare string otherwise.
fn apply_override(root: &mut toml::Table, assignment: &str) -> Result<(), String> {
    let (key, value) = assignment
        .split_once('=')
        .ok_or_else(|| format!("--set {assignment:?}: expected SECTION.KEY=VALUE, e.g. --set algo.lr=0.01"))?;
    let (section, field) = key
        .trim()
        .split_once('.')
        .ok_or_else(|| format!("--set {key:?}: expected SECTION.KEY (e.g. algo.lr); see --print-config"))?;
    let value = value.trim();
    let parsed = format!("v = {value}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    let table = root
        .get_mut(section)
        .and_then(toml::Value::as_table_mut)
        .ok_or_else(|| format!("--set {key}: no section [{section}]; see --print-config for the keys"))?;
    if !table.contains_key(field) {
        return Err(format!("--set {key}: no key {field:?} in [{section}]; see --print-config for the keys"));
    }
    // Integers given where floats are expected (lr=1) would fail to deserialize; widen them. A
    // number where text is expected (sim.link_gbps=2) is the text.
    let parsed = match (&table[field], parsed) {
        (toml::Value::Float(_), toml::Value::Integer(i)) => toml::Value::Float(i as f64),
        (toml::Value::String(_), toml::Value::Integer(_) | toml::Value::Float(_)) => {
            toml::Value::String(value.to_string())
        }
        (_, v) => v,
    };
    table.insert(field.to_string(), parsed);
    Ok(())
}

fn merge(base: &mut toml::Table, over: toml::Table, path: &str) -> Result<(), String> {
    for (k, v) in over {
        let at = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o, &at)?,
            (Some(slot), v) => {
                *slot = match (&*slot, v) {
                    (toml::Value::Float(_), toml::Value::Integer(i)) => toml::Value::Float(i as f64),
                    (_, v) => v,
                }
            }
            (None, _) => return Err(format!("unknown key {at:?}; see relax-colocate run --print-config")),
        }
    }
    Ok(())
}

/// Puts the key in front of a deserialization error, which names only the value ("unknown variant
/// `k9`"): the key whose value the message quotes, when exactly one has it.
fn with_key(root: &toml::Table, msg: &str) -> String {
    let quoted = msg.split('`').nth(1).or_else(|| msg.split('"').nth(1));
    let keys: Vec<String> = root
        .iter()
        .filter_map(|(section, t)| Some((section, t.as_table()?)))
        .flat_map(|(section, t)| t.iter().map(move |(k, v)| (format!("{section}.{k}"), v)))
        .filter(|(_, v)| quoted.is_some_and(|q| v.as_str() == Some(q) || v.to_string() == q))
        .map(|(k, _)| k)
        .collect();
    match keys.as_slice() {
        [key] => format!("{key}: {msg}; see relax-colocate run --print-config"),
        _ => msg.to_string(),
    }
}

/// The keys a job table (a file's, or a layout section of it) sets in `[section]`.
fn keys_in(table: &toml::Table, section: &str) -> Vec<String> {
    table.get(section).and_then(toml::Value::as_table).map_or_else(Vec::new, |t| t.keys().cloned().collect())
}

/// `--trainer-devices 0 --rollout-devices 1` name two devices: with no device count given, the
/// run has as many per node as the lists reach (a malformed list is left to the checks, which
/// name it).
fn devices_from_lists(root: &mut toml::Table) {
    let Some(run) = root.get_mut("run").and_then(toml::Value::as_table_mut) else { return };
    let highest = ["trainer_devices", "rollout_devices"]
        .iter()
        .filter_map(|k| run.get(*k).and_then(toml::Value::as_str))
        .filter(|list| !list.trim().is_empty())
        .flat_map(|list| list.split([',', '-']).map(|n| n.trim().parse::<u32>().ok()).collect::<Vec<_>>())
        .collect::<Option<Vec<u32>>>()
        .and_then(|v| v.into_iter().max());
    let nodes = run.get("nodes").and_then(toml::Value::as_integer).map_or(1, |n| n.max(1) as u64);
    let devices = run.get("devices").and_then(toml::Value::as_integer).unwrap_or(1);
    if let Some(h) = highest {
        let needed = (u64::from(h) + 1).div_ceil(nodes) as i64;
        if needed > devices {
            run.insert("devices".into(), toml::Value::Integer(needed));
        }
    }
}

/// The layouts a job file's `[layouts.NAME]` section applies to, in the order they apply: async's
/// reaches elastic runs too (elastic is async's layout with lending), then elastic's own.
fn layout_sections(mode: Mode) -> &'static [&'static str] {
    match mode {
        Mode::Colocate => &["colocate"],
        Mode::Async => &["async"],
        Mode::Elastic => &["async", "elastic"],
    }
}

/// A job file's `[layouts]` table, checked against the `defaults`: a section per layout name,
/// none changing the layout, every key one the job's sections have. Every section is checked,
/// whichever layout runs: a typo in another layout's section is found on the first run.
fn checked_layouts(layouts: toml::Value, defaults: &toml::Table) -> Result<toml::Table, String> {
    let toml::Value::Table(layouts) = layouts else {
        return Err("layouts: expected sections such as [layouts.async], each with keys of the job's sections".into());
    };
    for (name, section) in &layouts {
        if !["colocate", "async", "elastic"].contains(&name.as_str()) {
            return Err(format!("[layouts.{name}]: no such layout; the layouts are colocate, async and elastic"));
        }
        let Some(section) = section.as_table() else {
            return Err(format!(
                "layouts.{name}: expected a section, [layouts.{name}], with keys such as algo.minibatches = 4"
            ));
        };
        if section.get("run").and_then(toml::Value::as_table).is_some_and(|run| run.contains_key("mode")) {
            return Err(format!(
                "[layouts.{name}] sets run.mode: a layout's section cannot change the layout it applies to; remove the key"
            ));
        }
        if section
            .get("rollout")
            .and_then(toml::Value::as_table)
            .is_some_and(|r| r.contains_key("job_prompts_per_step"))
        {
            return Err(format!(
                "[layouts.{name}] sets rollout.job_prompts_per_step: the job's batch is the file's own \
                 rollout.prompts_per_step, whatever a section gives its layout; remove the key"
            ));
        }
        merge(&mut defaults.clone(), section.clone(), &format!("layouts.{name}"))?;
    }
    Ok(layouts)
}

/// The layout a run of this configuration takes: its mode after the file and every --set.
fn mode_of(root: &toml::Table) -> Result<Mode, String> {
    let mode = root.get("run").and_then(|r| r.get("mode")).cloned().ok_or("built-in defaults: no run.mode")?;
    mode.try_into()
        .map_err(|e: toml::de::Error| format!("run.mode: {}; see relax-colocate run --print-config", e.message()))
}

/// The default configuration, overlaid with `file` (if any), then with the file's sections for
/// the run's layout (`[layouts.async]`, ...), then with each `--set`.
pub fn load(file: Option<&std::path::Path>, sets: &[String]) -> Result<Config, String> {
    let mut root: toml::Table = DEFAULT_TOML.parse().map_err(|e| format!("built-in defaults: {e}"))?;
    let mut layouts = None;
    // The [compute] keys the job sets itself (its file, the sections its layout applies, --set):
    // a device preset fills only the others. And whether it gives run.devices.
    let (mut compute_given, mut devices_given) = (Vec::new(), false);
    if let Some(path) = file {
        let in_file = |e: String| format!("{}: {e}", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut user: toml::Table = text.parse().map_err(|e: toml::de::Error| in_file(e.to_string()))?;
        layouts = user.remove("layouts").map(|l| checked_layouts(l, &root)).transpose().map_err(in_file)?;
        compute_given.extend(keys_in(&user, "compute"));
        devices_given |= keys_in(&user, "run").iter().any(|k| k == "devices");
        merge(&mut root, user, "").map_err(in_file)?;
    }
    // The job without its layout sections: which layout this run takes, and the batch the job's
    // clock of prompts counts in.
    let mut job = root.clone();
    for s in sets {
        apply_override(&mut job, s)?;
    }
    // A recorded config.toml names its job's batch where a section had changed its layout's.
    let job_key = |key: &str| job.get("rollout").and_then(|r| r.get(key)).and_then(toml::Value::as_integer);
    let job_prompts = job_key("job_prompts_per_step").filter(|n| *n > 0).or_else(|| job_key("prompts_per_step"));
    if let (Some(layouts), Some(path)) = (layouts, file) {
        for name in layout_sections(mode_of(&job)?) {
            if let Some(toml::Value::Table(section)) = layouts.get(*name) {
                compute_given.extend(keys_in(section, "compute"));
                devices_given |= keys_in(section, "run").iter().any(|k| k == "devices");
                merge(&mut root, section.clone(), &format!("layouts.{name}"))
                    .map_err(|e| format!("{}: {e}", path.display()))?;
            }
        }
    }
    // A job file's relative path is the job's: beside it, wherever the job is run from.
    if let Some(dir) = file.and_then(std::path::Path::parent) {
        resolve_lengths(&mut root, dir)?;
    }
    for s in sets {
        apply_override(&mut root, s)?;
        let key = s.split_once('=').map(|(k, _)| k.trim());
        devices_given |= key == Some("run.devices");
        compute_given.extend(key.and_then(|k| k.strip_prefix("compute.")).map(String::from));
        if key == Some("compute.lengths") {
            resolve_lengths(&mut root, std::path::Path::new("."))?;
        }
    }
    if !devices_given {
        devices_from_lists(&mut root);
    }
    let compute = root.get_mut("compute").and_then(toml::Value::as_table_mut).expect("defaults have [compute]");
    let unset = devices::apply(compute, &compute_given)?;
    let mut cfg: Config =
        toml::Value::Table(root.clone()).try_into().map_err(|e: toml::de::Error| with_key(&root, e.message()))?;
    cfg.compute.unset = unset;
    // 0 where it is the layout's own: a run from the recorded file may change the batch.
    let job_prompts = job_prompts.map_or(0, |n| n.max(0) as usize);
    cfg.rollout.job_prompts_per_step = if job_prompts == cfg.rollout.prompts_per_step { 0 } else { job_prompts };
    cfg.validate()?;
    if !cfg.compute.lengths.is_empty() {
        let table = crate::run::lengths::Lengths::load(std::path::Path::new(&cfg.compute.lengths))
            .map_err(|e| format!("compute.lengths: {e}"))?;
        cfg.compute.lengths_table = Some(std::sync::Arc::new(table));
    }
    lengths_steps_check(&cfg)?;
    Ok(cfg)
}

/// compute.lengths_first_step names a step of the lengths file: a step the file does not reach
/// would charge every step the file's last lengths, which is not what was asked.
fn lengths_steps_check(cfg: &Config) -> Result<(), String> {
    let first = cfg.compute.lengths_first_step;
    if first == 0 {
        return Ok(());
    }
    let Some(table) = &cfg.compute.lengths_table else {
        return Err(format!(
            "compute.lengths_first_step = {first} needs a lengths file whose lines name their step (--lengths FILE)"
        ));
    };
    match table.step_span() {
        None => Err(format!(
            "compute.lengths_first_step = {first}: {} names no steps; give each JSON line a \"step\" (e.g. \
             {{\"step\": 12, \"length\": 1834}}), or drop the key",
            cfg.compute.lengths
        )),
        Some((lo, hi)) if !(lo..=hi).contains(&first) => Err(format!(
            "compute.lengths_first_step = {first} is outside the steps {} gives ({lo} to {hi}): name a step from {lo} to {hi}",
            cfg.compute.lengths
        )),
        Some(_) => Ok(()),
    }
}

/// Makes a relative compute.lengths absolute, from `base` (a job file's folder, or the working
/// directory for the command line's), so that the recorded config.toml names the file whatever
/// directory it is read from.
fn resolve_lengths(root: &mut toml::Table, base: &std::path::Path) -> Result<(), String> {
    let compute = root.get_mut("compute").and_then(toml::Value::as_table_mut).expect("defaults have [compute]");
    let Some(toml::Value::String(path)) = compute.get("lengths") else { return Ok(()) };
    if path.trim().is_empty() {
        return Ok(());
    }
    let joined = base.join(path.trim());
    let absolute = std::path::absolute(&joined)
        .map_err(|e| format!("compute.lengths={path:?}: cannot make it an absolute path: {e}"))?;
    compute.insert("lengths".into(), toml::Value::String(absolute.display().to_string()));
    Ok(())
}

impl Config {
    /// The modelled seconds of decoding a segment may take (async.segment_s): only with
    /// compute.model, which alone gives decoding a modelled cost.
    pub fn segment_budget(&self) -> Option<f64> {
        Some(self.asynchronous.segment_s).filter(|b| *b > 0.0 && self.compute.model)
    }

    /// The modelled tokens per task token of what weight version `version` generates (it may be
    /// a mean over a sample's tokens), when responses grow over the run (compute.token_scale_final):
    /// linear from compute.token_scale at version 0 (step 1's samples) to token_scale_final at
    /// version steps - 1 (the last step's), held there. None without growth or without
    /// compute.model: every request at init's compute.token_scale, as before the knob.
    pub fn token_scale_at(&self, version: f64) -> Option<f64> {
        let c = &self.compute;
        if !c.model || c.token_scale_final <= 0.0 {
            return None;
        }
        let last = self.job_batches().saturating_sub(1).max(1) as f64;
        let at = (version / last).clamp(0.0, 1.0);
        Some(c.token_scale + (c.token_scale_final - c.token_scale) * at)
    }

    /// Where a sample stands on the growth's clock (`token_scale_at`): the batch its prompt was
    /// drawn for (`started`, its group's place in the run's order of prompts, over the batch
    /// size), whatever weights generated it; with compute.cost_by_version, the mean `version` of
    /// the weights that generated its tokens. Colocated the two agree (step s draws batch s - 1
    /// and generates with version s - 1); apart, a version clock makes stale samples cheaper,
    /// which favours the layouts that make them.
    pub fn cost_clock(&self, version: f64, started: u64) -> f64 {
        if self.compute.cost_by_version {
            return version;
        }
        (started / self.clock_prompts()) as f64
    }

    /// Async and elastic: the prompt groups queued, being generated and in training before an
    /// engine waits (back-pressure), `trained` steps after the last weight update.
    /// async.queue_groups, or by default the batch x (train_iters_per_update x (max_staleness + 1)
    /// minus `trained`): Relax's batch x (max_staleness + 1) when every step updates the weights, and
    /// the most that drops nothing. Batches are taken in the order their groups started, so a
    /// group admitted behind fewer than that is in a batch taken at most
    /// train_iters_per_update x (max_staleness + 1) - trained - 1 steps after the one in training
    /// (or the next, with none in training); the steps that end before it, with the `trained`
    /// ones before them, make at most max_staleness updates. A trainer that takes its batch in
    /// parts (a weight update every few) so keeps the engines as far ahead as the bound allows,
    /// not one part's worth.
    pub fn queue_capacity_at(&self, trained: u64) -> usize {
        let a = &self.asynchronous;
        match a.queue_groups {
            0 => {
                let per_update = a.train_iters_per_update.max(1);
                let steps = per_update.saturating_mul(a.max_staleness.max(0) as u64 + 1) - trained.min(per_update - 1);
                self.rollout.prompts_per_step.saturating_mul(usize::try_from(steps).unwrap_or(usize::MAX))
            }
            n => n as usize,
        }
    }

    /// The queue's bound right after a weight update (`queue_capacity_at`), the largest.
    pub fn queue_capacity(&self) -> usize {
        self.queue_capacity_at(0)
    }

    /// Async and elastic: the prompt groups an engine's request holds (`async.engine_groups`; by
    /// default the trainer's batch shared over its `engines`).
    pub fn engine_groups(&self, engines: usize) -> usize {
        match self.asynchronous.engine_groups {
            0 => (self.rollout.prompts_per_step / engines.max(1)).max(1),
            n => n as usize,
        }
    }

    /// The prompts a batch of the job's clock holds: its prompts per step as the job file's
    /// top level and --set give them, whatever a `[layouts.MODE]` section made this layout's.
    pub(crate) fn clock_prompts(&self) -> u64 {
        let r = &self.rollout;
        (if r.job_prompts_per_step > 0 { r.job_prompts_per_step } else { r.prompts_per_step }).max(1) as u64
    }

    /// This layout's steps that hold the job's first batch: what figures "after step 1" leave
    /// out, so that every layout's count the same samples (a layout in parts of a quarter of
    /// the job's batch leaves out four). Where its batch does not divide the job's, the steps
    /// the first batch reaches into.
    pub(crate) fn steps_in_job_batch(&self) -> usize {
        self.clock_prompts().div_ceil(self.rollout.prompts_per_step.max(1) as u64).max(1) as usize
    }

    /// The job's batches this run's steps take prompts for (its steps, when its batch is the
    /// job's).
    pub(crate) fn job_batches(&self) -> u64 {
        self.run.steps.saturating_mul(self.rollout.prompts_per_step as u64).div_ceil(self.clock_prompts())
    }

    /// With compute.lengths: the modelled response length (tokens, the decode steps it takes) of
    /// sample `sample` of the group of the prompt at `prompt` in the run's order of prompts.
    /// Every layout asks by the same identity, so they charge a sample alike. None: off.
    pub(crate) fn drawn_length(&self, prompt: u64, sample: u64) -> Option<f64> {
        let table = self.compute.lengths_table.as_ref()?;
        let batch = prompt / self.clock_prompts();
        Some(table.draw(self.run.seed, prompt, sample, self.lengths_step(batch)) as f64)
    }

    /// The lengths file's step that the batch at `batch` in the run's order (0: step 1's) stands
    /// for: compute.lengths_first_step (or the file's first step) onward, one a batch.
    fn lengths_step(&self, batch: u64) -> u64 {
        let span = self.compute.lengths_table.as_ref().and_then(|t| t.step_span());
        let first = match (self.compute.lengths_first_step, span) {
            (0, Some((lo, _))) => lo,
            (first, _) => first,
        };
        first.saturating_add(batch)
    }

    /// With compute.lengths: the figures of the lengths the run's steps draw from (for a file that
    /// names steps, those of the steps the run's stand for), and those steps (`lengths_steps`).
    pub(crate) fn lengths_drawn(
        &self,
    ) -> Option<(crate::run::lengths::Figures, Option<crate::run::summary::LengthsSteps>)> {
        let table = self.compute.lengths_table.as_ref()?;
        let (from, to) = self.lengths_window();
        Some((table.figures_between(from, to), self.lengths_steps()))
    }

    /// With a lengths file that names steps: the file's first and last, the first and last the
    /// run's steps stand for, and how many of the run's steps fall past the file's end.
    pub(crate) fn lengths_steps(&self) -> Option<crate::run::summary::LengthsSteps> {
        let (lo, hi) = self.compute.lengths_table.as_ref()?.step_span()?;
        let (from, to) = self.lengths_window();
        Some(crate::run::summary::LengthsSteps {
            file_first: lo,
            file_last: hi,
            first_drawn: from,
            last_drawn: to.min(hi),
            steps_past_last: to.saturating_sub(hi),
        })
    }

    /// The file's steps the run's first and last stand for.
    fn lengths_window(&self) -> (u64, u64) {
        (self.lengths_step(0), self.lengths_step(self.job_batches().max(1) - 1))
    }

    /// With compute.lengths: a batch's modelled tokens and, of them, its drawn response tokens;
    /// each sample given as (its prompt's task tokens, the prompt's place in the run's order of
    /// prompts, its place in the group) counts its prompt x compute.token_scale plus its drawn
    /// length, whatever its task response. None: off.
    pub(crate) fn drawn_tokens(&self, samples: impl IntoIterator<Item = (usize, u64, u64)>) -> Option<DrawnTokens> {
        self.compute.lengths_table.as_ref()?;
        let (mut prompts, mut responses) = (0.0, 0.0);
        for (prompt_tokens, prompt, sample) in samples {
            prompts += prompt_tokens as f64 * self.compute.token_scale;
            responses += self.drawn_length(prompt, sample)?;
        }
        Some((prompts + responses, responses))
    }

    /// The off-policy correction the run applies: `auto` resolved by the layout. Colocated, the
    /// rollout always generates with the weights the trainer has just handed over, so the samples
    /// are on-policy; in every other mode they may be generated by older weights.
    ///
    /// With algo.rollout_log_probs the old log-probs are the behaviour policy's own, so the PPO
    /// ratio is already the clipped importance ratio and TIS's weight would be 1 on every token.
    pub fn off_policy_correction(&self) -> OffPolicyCorrection {
        match self.algo.off_policy_correction {
            OffPolicyCorrection::Auto if self.run.mode == Mode::Colocate => OffPolicyCorrection::None,
            OffPolicyCorrection::Auto if self.algo.rollout_log_probs => OffPolicyCorrection::None,
            OffPolicyCorrection::Auto => OffPolicyCorrection::Tis,
            c => c,
        }
    }

    /// Async mode: which devices train and which generate (None in colocate mode), or why the
    /// device sets cannot run. Devices are numbered node-major across the run, as ranks are.
    pub fn mode_layout(&self) -> Result<Option<DeviceSplit>, String> {
        let total = self.total_devices() as u32;
        let mode = self.run.mode.as_str();
        if self.run.mode == Mode::Colocate {
            for (key, v) in
                [("run.trainer_devices", &self.run.trainer_devices), ("run.rollout_devices", &self.run.rollout_devices)]
            {
                if v.trim().is_empty() {
                    continue;
                }
                return Err(format!(
                    "{key}={v:?} needs run.mode = \"async\" or \"elastic\" (--mode async); colocate mode puts both roles on \
                     every device"
                ));
            }
            return Ok(None);
        }
        if total < 2 {
            return Err(format!(
                "run.mode = \"{mode}\" needs at least 2 devices (one to train, one to generate) and the run has \
                 {total}: --devices 2, or --mode colocate"
            ));
        }
        let half = (total / 2).max(1);
        let trainer = match self.run.trainer_devices.trim() {
            "" => None,
            v => Some(parse_devices(v, total).map_err(|e| format!("run.trainer_devices: {e}"))?),
        };
        let rollout = match self.run.rollout_devices.trim() {
            "" => None,
            v => Some(parse_devices(v, total).map_err(|e| format!("run.rollout_devices: {e}"))?),
        };
        let rest = |taken: &[u32]| (0..total).filter(|d| !taken.contains(d)).collect::<Vec<u32>>();
        let (trainer, rollout) = match (trainer, rollout) {
            (Some(t), Some(r)) => (t, r),
            (Some(t), None) => {
                let r = rest(&t);
                (t, r)
            }
            (None, Some(r)) => {
                let t = rest(&r);
                (t, r)
            }
            (None, None) => ((0..half).collect(), (half..total).collect()),
        };
        if trainer.is_empty() || rollout.is_empty() {
            let (key, other) = if trainer.is_empty() {
                ("run.trainer_devices", "rollout")
            } else {
                ("run.rollout_devices", "trainer")
            };
            return Err(format!(
                "{key} is empty: the {other} takes every one of the run's {total} device(s); give each role its own \
                 (e.g. --trainer-devices 0 --rollout-devices 1)"
            ));
        }
        if let Some(d) = trainer.iter().find(|d| rollout.contains(d)) {
            return Err(format!(
                "run.trainer_devices and run.rollout_devices overlap on device {d}: {mode} mode gives each role its \
                 own devices (sharing one is colocate mode)"
            ));
        }
        Ok(Some(DeviceSplit { trainer, rollout }))
    }

    /// Whether both roles run the built-in worker (no run.trainer_cmd or run.rollout_cmd).
    pub fn builtin_workers(&self) -> bool {
        self.run.trainer_cmd.trim().is_empty() && self.run.rollout_cmd.trim().is_empty()
    }

    /// The weight transport as far as the configuration decides it: `auto` is, with the built-in
    /// workers, ipc in colocate mode and broadcast in async mode (as slime moves weights in each),
    /// with worker commands host in colocate mode; in async mode with worker commands it stays
    /// `Auto` until the workers' hellos say what they speak (`resolve_weight_transport`).
    pub fn weight_transport(&self) -> WeightTransport {
        let builtin = self.builtin_workers();
        match self.run.weight_transport {
            WeightTransport::Auto if self.run.mode.split() && builtin => WeightTransport::Broadcast,
            WeightTransport::Auto if self.run.mode.split() => WeightTransport::Auto,
            WeightTransport::Auto if builtin => WeightTransport::Ipc,
            WeightTransport::Auto => WeightTransport::Host,
            t => t,
        }
    }

    /// The transport the run uses once the weight-sync group's members have said hello: `auto`
    /// broadcasts when every one of them speaks it (a worker that does not say so speaks host only).
    pub fn resolve_weight_transport(&self, members_broadcast: bool) -> Result<WeightTransport, String> {
        match self.weight_transport() {
            WeightTransport::Auto if members_broadcast => Ok(WeightTransport::Broadcast),
            WeightTransport::Auto => self.check_host_on_one_host().map(|()| WeightTransport::Host),
            t => Ok(t),
        }
    }

    /// The simulator's modelled link in GB/s, within a node and between nodes (`sim.link_gbps`,
    /// INTRA[,INTER]; empty: the simulator's own 450 and 50; 0: no modelled time).
    pub fn link_gbps(&self) -> Result<(f64, f64), String> {
        let v = self.sim.link_gbps.trim();
        if v.is_empty() {
            return Ok((SIM_LINK_INTRA_GBPS, SIM_LINK_INTER_GBPS));
        }
        let parse = |s: &str| s.trim().parse::<f64>().ok().filter(|g| *g >= 0.0 && g.is_finite());
        let parts: Vec<Option<f64>> = v.split(',').map(parse).collect();
        match parts.as_slice() {
            [Some(a)] => Ok((*a, *a)),
            [Some(a), Some(b)] => Ok((*a, *b)),
            _ => Err(format!(
                "sim.link_gbps={v:?} is not INTRA[,INTER] in GB/s (e.g. 450,50; 0: no modelled time; empty: the \
                 simulator's own)"
            )),
        }
    }

    /// The device API the simulated device serves the workers (sim.api, checked when loaded).
    pub fn sim_api(&self) -> crate::vendor::ApiKind {
        crate::vendor::ApiKind::parse(&self.sim.api).unwrap_or(crate::vendor::ApiKind::Cuda)
    }

    /// Devices in the whole run: `run.devices` on each of `run.nodes` nodes.
    pub fn total_devices(&self) -> usize {
        self.run.devices as usize * self.run.nodes as usize
    }

    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("config serializes")
    }
}

/// A batch's modelled tokens and, of them, its drawn response tokens (compute.lengths).
pub(crate) type DrawnTokens = (f64, f64);

/// Async mode's devices per role, node-major indices, each list sorted and without repeats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSplit {
    pub trainer: Vec<u32>,
    pub rollout: Vec<u32>,
}

/// "0,2-3" → [0, 2, 3], each below `total`.
fn parse_devices(s: &str, total: u32) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim) {
        let num = |x: &str| {
            x.trim().parse::<u32>().map_err(|_| format!("{part:?} is not a device index or a range like 0-3"))
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(part)?, num(part)?),
        };
        if lo > hi {
            return Err(format!("range {part:?} runs backwards"));
        }
        if hi >= total {
            return Err(format!(
                "device {hi} is past the run's {total} device(s) (0-{}); raise --devices (run.devices x run.nodes)",
                total - 1
            ));
        }
        out.extend(lo..=hi);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// A size by tms's one rule (`tms_proto::size`): "512MiB", "2GiB", "1.5G" (GiB), "4096" bytes;
/// "2GB" is 2 * 10^9 bytes, as the unit says.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let bytes = tms_proto::size::parse_size(s)?;
    if bytes == 0 {
        return Err(format!("{s:?} is too small"));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists_give_the_device_count_when_none_is_given() {
        let lists = [
            "run.mode=\"async\"".to_string(),
            "run.trainer_devices=\"0\"".into(),
            "run.rollout_devices=\"1-2\"".into(),
        ];
        assert_eq!(load(None, &lists).unwrap().total_devices(), 3);
        let two_nodes = [&lists[..], &["run.nodes=2".into(), "run.launcher=\"ray\"".into()]].concat();
        assert_eq!(load(None, &two_nodes).map(|c| c.run.devices), Ok(2));
        // A count given is the user's: lists past it are still refused, naming the flag to raise.
        let given = [&lists[..], &["run.devices=2".into()]].concat();
        assert!(load(None, &given).unwrap_err().contains("raise --devices"), "{:?}", load(None, &given));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[run]\ndevices = 2\n").unwrap();
        assert!(load(Some(&f), &lists).is_err());
    }

    #[test]
    fn defaults_parse_and_validate() {
        let c = load(None, &[]).unwrap();
        assert_eq!(c.algo.name, AlgoName::Grpo);
        assert_eq!(c.memory.profile, "tiny");
    }

    #[test]
    fn overrides_apply_and_typos_are_errors() {
        let c = load(None, &["algo.name=ppo".into(), "algo.lr=1".into(), "memory.profile=qwen3-4b".into()]).unwrap();
        assert_eq!(c.algo.name, AlgoName::Ppo);
        assert_eq!(c.algo.lr, 1.0);
        assert_eq!(c.memory.profile, "qwen3-4b");
        assert!(load(None, &["algo.lrr=1".into()]).unwrap_err().contains("no key"));
        assert!(load(None, &["algo.kl_type=k9".into()]).unwrap_err().starts_with("algo.kl_type: unknown variant"));
        assert!(load(None, &["metrics.style=mlflow".into()]).unwrap_err().starts_with("metrics.style: "));
        assert!(load(None, &["run.steps=0".into()]).unwrap_err().contains("steps"));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "[algo]\nname = \"ppo\"\nbogus = 1\n").unwrap();
        assert!(load(Some(&f), &[]).unwrap_err().contains("algo.bogus"));
    }

    #[test]
    fn a_negative_decode_step_latency_is_refused_by_name() {
        let sets = |ms: &str| {
            ["compute.model=true", "memory.profile=qwen3-4b", &format!("compute.decode_step_ms={ms}")].map(String::from)
        };
        assert_eq!(load(None, &sets("0")).unwrap().compute.decode_step_ms, 0.0);
        assert_eq!(load(None, &[]).unwrap().compute.decode_step_ms, 2.0);
        let err = load(None, &sets("-1")).unwrap_err();
        assert!(err.contains("compute.decode_step_ms must be >= 0"), "{err}");
    }

    #[test]
    fn the_segment_budget_applies_only_to_modelled_compute_and_bad_ones_are_refused_by_name() {
        let sets = |model: &str, b: &str| {
            [
                "run.mode=async",
                "run.devices=2",
                "memory.profile=qwen3-4b",
                &format!("compute.model={model}"),
                &format!("async.segment_s={b}"),
            ]
            .map(String::from)
        };
        assert_eq!(load(None, &sets("true", "0.5")).unwrap().segment_budget(), Some(0.5));
        assert_eq!(load(None, &sets("true", "0")).unwrap().segment_budget(), None, "0: off");
        assert_eq!(load(None, &sets("false", "0.5")).unwrap().segment_budget(), None, "nothing modelled");
        for bad in ["-1", "nan", "inf"] {
            let err = load(None, &sets("true", bad)).unwrap_err();
            assert!(err.contains("async.segment_s=") && err.contains("must be >= 0"), "{bad}: {err}");
        }
    }

    #[test]
    fn token_scale_grows_linearly_over_the_versions_and_bad_finals_are_refused_by_name() {
        let sets = |fin: &str| {
            ["compute.model=true", "memory.profile=qwen3-4b", "run.steps=5", "compute.token_scale=100"]
                .into_iter()
                .map(String::from)
                .chain([format!("compute.token_scale_final={fin}")])
                .collect::<Vec<_>>()
        };
        let c = load(None, &sets("500")).unwrap();
        // Version 0 makes step 1's samples, version 4 the last step's (of 5); later ones hold.
        let at: Vec<_> = [0.0, 1.0, 2.5, 4.0, 9.0].iter().map(|v| c.token_scale_at(*v).unwrap()).collect();
        assert_eq!(at, vec![100.0, 200.0, 350.0, 500.0, 500.0]);
        assert_eq!(load(None, &sets("0")).unwrap().token_scale_at(3.0), None, "0: no growth");
        let mut off = sets("500");
        off[0] = "compute.model=false".into();
        assert_eq!(load(None, &off).unwrap().token_scale_at(3.0), None, "nothing is modelled");
        for bad in ["-1", "nan", "inf"] {
            let err = load(None, &sets(bad)).unwrap_err();
            assert!(err.contains("compute.token_scale_final must be >= 0"), "{bad}: {err}");
        }
    }

    /// By default a sample costs by the batch it was drawn for, whatever weights made it; only
    /// compute.cost_by_version ties it to the version.
    #[test]
    fn a_sample_s_cost_ignores_its_weight_version_unless_asked() {
        let sets = |by_version: bool| {
            [
                "compute.model=true",
                "memory.profile=qwen3-4b",
                "run.steps=10",
                "rollout.prompts_per_step=24",
                "compute.token_scale=150",
                "compute.token_scale_final=600",
            ]
            .into_iter()
            .map(String::from)
            .chain([format!("compute.cost_by_version={by_version}")])
            .collect::<Vec<_>>()
        };
        let fair = load(None, &sets(false)).unwrap();
        assert!(!load(None, &[]).unwrap().compute.cost_by_version, "off by default");
        // Group 100 belongs to the fifth batch (index 4: 100 / 24) whichever version made it.
        let scales: Vec<f64> =
            [0.0, 1.0, 2.0, 4.0, 7.5].iter().map(|v| fair.token_scale_at(fair.cost_clock(*v, 100)).unwrap()).collect();
        assert!(scales.iter().all(|s| *s == 350.0), "{scales:?}");
        assert_eq!(fair.token_scale_at(fair.cost_clock(0.0, 23)), Some(150.0), "the first batch");
        let by_version = load(None, &sets(true)).unwrap();
        let stale = by_version.token_scale_at(by_version.cost_clock(2.0, 100)).unwrap();
        let fresh = by_version.token_scale_at(by_version.cost_clock(4.0, 100)).unwrap();
        assert_eq!((stale, fresh), (250.0, 350.0), "two versions stale: cheaper, as asked");
    }

    /// A job file's relative compute.lengths is beside the job; the recorded config names it
    /// absolutely; the file's errors and the settings it needs are refused by name.
    #[test]
    fn lengths_resolve_beside_the_job_file_and_need_the_model_and_the_built_in_workers() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("lengths.txt"), "# tokens\n2000\n").unwrap();
        let job = dir.path().join("job.toml");
        std::fs::write(&job, "[compute]\nmodel = true\nlengths = \"lengths.txt\"\n[memory]\nprofile = \"qwen3-4b\"\n")
            .unwrap();
        let c = load(Some(&job), &[]).unwrap();
        let want = dir.path().join("lengths.txt");
        assert_eq!(std::path::Path::new(&c.compute.lengths), want);
        assert_eq!(c.drawn_length(5, 1), Some(2000.0));
        assert_eq!(c.drawn_tokens([(3, 0, 0), (3, 0, 1)]), Some((2.0 * (30.0 + 2000.0), 4000.0)));
        let recorded = dir.path().join("config.toml");
        std::fs::write(&recorded, c.to_toml()).unwrap();
        assert_eq!(load(Some(&recorded), &[]).unwrap().compute.lengths, c.compute.lengths);
        assert_eq!(load(None, &[]).unwrap().drawn_length(0, 0), None, "off by default");
        // On the command line a relative path is from the working directory.
        let err = with(&["compute.model=true", "memory.profile=qwen3-4b", "compute.lengths=no-such-lengths.txt"])
            .unwrap_err();
        let cwd = std::env::current_dir().unwrap().join("no-such-lengths.txt");
        assert!(err.starts_with(&format!("compute.lengths: cannot read {}", cwd.display())), "{err}");
        let file = format!("compute.lengths={}", want.display());
        let err = with(&["memory.profile=qwen3-4b", &file]).unwrap_err();
        assert!(
            err.contains("needs compute.model = true (--set compute.model=true): the lengths are modelled"),
            "{err}"
        );
        let err = with(&["compute.model=true", "memory.profile=qwen3-4b", "run.rollout_cmd=w", &file]).unwrap_err();
        assert!(
            err.contains("compute.lengths needs the built-in workers")
                && err.contains("run.rollout_cmd; scripts/torch_worker.py"),
            "{err}"
        );
        let err = with(&["compute.model=true", "memory.profile=qwen3-4b", "compute.token_scale_final=300", &file])
            .unwrap_err();
        assert!(err.contains("keep one (--set compute.token_scale_final=0"), "{err}");
        std::fs::write(&want, "2000\nlots\n").unwrap();
        let err = with(&["compute.model=true", "memory.profile=qwen3-4b", &file]).unwrap_err();
        assert!(err.contains("lengths.txt line 2: \"lots\" is not a response length"), "{err}");
    }

    /// The default queue: the batch x (the update's steps x (staleness + 1) - the steps trained
    /// since it); a queue the job gives is its own.
    #[test]
    fn the_default_queue_follows_the_weight_updates_and_the_staleness_bound() {
        let q = |sets: &[&str], trained: u64| with(sets).unwrap().queue_capacity_at(trained);
        let base = ["rollout.prompts_per_step=8"];
        let every_step = [&base[..], &["async.max_staleness=2"]].concat();
        assert_eq!((q(&every_step, 0), q(&every_step, 5)), (8 * 3, 8 * 3), "an update every step: Relax's");
        let parts = [&base[..], &["async.max_staleness=1", "async.train_iters_per_update=4"]].concat();
        assert_eq!([0, 1, 3].map(|t| q(&parts, t)), [8 * 8, 8 * 7, 8 * 5]);
        let on_policy = [&base[..], &["async.max_staleness=0", "async.train_iters_per_update=4"]].concat();
        assert_eq!([0, 3].map(|t| q(&on_policy, t)), [8 * 4, 8]);
        assert_eq!(q(&[&base[..], &["async.max_staleness=1", "async.queue_groups=12"]].concat(), 2), 12);
    }

    /// A job file's `[layouts.MODE]` sections: each reaches its own layout's runs (async's
    /// elastic's too), over the file's own keys and under --set; the job's batch stays the clock
    /// every layout draws a sample's length by; a section for no layout, one changing the layout
    /// and an unknown key are refused by name.
    #[test]
    fn a_job_files_layout_sections_reach_their_layouts_alone() {
        let dir = tempfile::tempdir().unwrap();
        let job = dir.path().join("job.toml");
        // One length a step, the step's thousands: a sample's length says which step it drew.
        let steps: String = (1..=4).map(|k| format!("{{\"step\": {k}, \"length\": {}}}\n", 1000 * k)).collect();
        std::fs::write(dir.path().join("lengths.txt"), steps).unwrap();
        let layouts = "[layouts.async]\nrollout.prompts_per_step = 4\nalgo.minibatches = 1\nasync.train_iters_per_update = 2\n\
                       [layouts.elastic]\nalgo.lr = 0.5\n[layouts.colocate.algo]\nepochs = 2\n\
                       [layouts.colocate.compute]\nhbm_gbps = 1234.0\n";
        let top = "[compute]\nmodel = true\nlengths = \"lengths.txt\"\n[memory]\nprofile = \"qwen3-4b\"\n\
                   [rollout]\nprompts_per_step = 8\n[algo]\nminibatches = 2\nlr = 0.25\n";
        std::fs::write(&job, format!("{top}{layouts}")).unwrap();
        let run = |mode: &str, more: &[&str]| {
            let mut sets = vec![format!("run.mode={mode}"), "run.devices=2".into()];
            sets.extend(more.iter().map(|s| s.to_string()));
            load(Some(&job), &sets)
        };
        let colocated = run("colocate", &[]).unwrap();
        assert_eq!((colocated.rollout.prompts_per_step, colocated.algo.minibatches, colocated.algo.epochs), (8, 2, 2));
        // A figure a section gives is the job's own: the device's preset does not replace it.
        assert_eq!(colocated.compute.hbm_gbps, 1234.0);
        let apart = run("async", &[]).unwrap();
        assert_eq!((apart.rollout.prompts_per_step, apart.algo.minibatches, apart.algo.epochs), (4, 1, 1));
        assert_eq!((apart.asynchronous.train_iters_per_update, apart.algo.lr), (2, 0.25));
        let elastic = run("elastic", &[]).unwrap();
        assert_eq!((elastic.rollout.prompts_per_step, elastic.algo.lr), (4, 0.5), "async's section, then elastic's");
        // The prompt at 12 is the job's batch 1 (of 8) in every layout, not the async layout's
        // batch 3 (of 4): both draw its length from the file's step 2.
        assert_eq!((colocated.drawn_length(12, 1), apart.drawn_length(12, 1)), (Some(2000.0), Some(2000.0)));
        for p in 0..24 {
            assert_eq!(colocated.drawn_length(p, 1), apart.drawn_length(p, 1), "prompt {p}");
            assert_eq!(colocated.cost_clock(0.0, p), apart.cost_clock(0.0, p), "prompt {p}");
        }
        let three = run("async", &["run.steps=3"]).unwrap();
        assert_eq!(
            (three.clock_prompts(), three.job_batches()),
            (8, 2),
            "3 steps of 4 reach into the job's second batch"
        );
        let drawn = three.lengths_steps().unwrap();
        assert_eq!((drawn.first_drawn, drawn.last_drawn, drawn.steps_past_last), (1, 2, 0), "the file's steps 1 and 2");
        // Figures after step 1 leave out the async layout's two steps that hold the job's first batch.
        assert_eq!((colocated.steps_in_job_batch(), apart.steps_in_job_batch()), (1, 2));
        // A batch that does not divide the job's: the steps the job's first batch reaches into.
        let uneven = with(&["rollout.prompts_per_step=4", "rollout.job_prompts_per_step=6"]).unwrap();
        assert_eq!((uneven.clock_prompts(), uneven.steps_in_job_batch()), (6, 2));
        // A run's config.toml records the job's batch: a run from it draws as its job did, and
        // one whose batch is the job's records none (a run from it may change its batch).
        let recorded = dir.path().join("config.toml");
        std::fs::write(&recorded, apart.to_toml()).unwrap();
        let again = load(Some(&recorded), &[]).unwrap();
        assert_eq!((again.rollout.prompts_per_step, again.clock_prompts(), again.steps_in_job_batch()), (4, 8, 2));
        for p in 0..24 {
            assert_eq!(again.drawn_length(p, 1), apart.drawn_length(p, 1), "prompt {p}, from config.toml");
        }
        assert_eq!(colocated.rollout.job_prompts_per_step, 0, "the colocated layout's batch is the job's");
        // --set wins over the sections; it sets the job's batch too.
        let set = run("async", &["rollout.prompts_per_step=2", "algo.lr=0.125"]).unwrap();
        assert_eq!((set.rollout.prompts_per_step, set.clock_prompts(), set.algo.lr), (2, 2, 0.125));
        let refused = |text: &str| {
            std::fs::write(&job, format!("{top}{text}")).unwrap();
            run("async", &[]).unwrap_err()
        };
        let err = refused("[layouts.fast.algo]\nlr = 1.0\n");
        assert!(err.contains("[layouts.fast]: no such layout; the layouts are colocate, async and elastic"), "{err}");
        let err = refused("[layouts.async.run]\nmode = \"colocate\"\n");
        assert!(err.contains("[layouts.async] sets run.mode: a layout's section cannot change the layout"), "{err}");
        let err = refused("[layouts.async.rollout]\njob_prompts_per_step = 2\n");
        assert!(
            err.contains("[layouts.async] sets rollout.job_prompts_per_step: the job's batch is the file's own"),
            "{err}"
        );
        let err = refused("[layouts.async.algo]\nlearning_rate = 1.0\n");
        assert!(err.contains("unknown key \"layouts.async.algo.learning_rate\""), "{err}");
        // Another layout's section is checked too, on this layout's run.
        let err = refused("[layouts.colocate.algo]\nlearning_rate = 1.0\n");
        assert!(err.contains("unknown key \"layouts.colocate.algo.learning_rate\""), "{err}");
        let err = refused("[layouts]\nasync = 3\n");
        assert!(err.contains("layouts.async: expected a section, [layouts.async]"), "{err}");
    }

    /// A lengths file that names steps: each batch draws from the step it stands for, from
    /// compute.lengths_first_step on; a first step the file does not give is refused by name.
    #[test]
    fn a_lengths_file_with_steps_charges_each_batch_its_step_s_lengths() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("lengths.jsonl");
        let lines: String = [(1, 500), (2, 1000), (4, 4000)]
            .iter()
            .map(|(step, len)| format!("{{\"step\": {step}, \"length\": {len}}}\n"))
            .collect();
        std::fs::write(&file, lines).unwrap();
        let job = |extra: &[&str]| {
            let base = ["compute.model=true", "memory.profile=qwen3-4b", "rollout.prompts_per_step=8", "run.steps=3"];
            let lengths = format!("compute.lengths={}", file.display());
            let sets: Vec<&str> = base.iter().copied().chain([lengths.as_str()]).chain(extra.iter().copied()).collect();
            with(&sets)
        };
        // Prompts 0-7 are step 1's batch, 8-15 step 2's, 16-23 step 3's (the file skips it: step 2's).
        let c = job(&[]).unwrap();
        let by_batch: Vec<Option<f64>> = [0, 7, 8, 15, 16, 23].iter().map(|p| c.drawn_length(*p, 3)).collect();
        assert_eq!(by_batch, [500.0, 500.0, 1000.0, 1000.0, 1000.0, 1000.0].map(Some));
        let (drawn, steps) = c.lengths_drawn().unwrap();
        assert_eq!((drawn.count, drawn.max), (2, 1000), "steps 1 to 3 draw step 1's and step 2's lines");
        assert!((drawn.mean - 2500.0 / 3.0).abs() < 1e-9, "step 2's line stands for two of the three: {drawn:?}");
        let steps = steps.unwrap();
        assert_eq!((steps.file_first, steps.file_last, steps.first_drawn, steps.last_drawn), (1, 4, 1, 3));
        assert_eq!(steps.steps_past_last, 0);
        assert_eq!(steps.describe(), ", steps 1 to 3 of its 1 to 4");
        // From step 2 on: the run's third step stands for the file's 4th; a longer run runs past it.
        let later = job(&["compute.lengths_first_step=2", "run.steps=5"]).unwrap();
        assert_eq!(later.drawn_length(0, 0), Some(1000.0));
        assert_eq!(later.drawn_length(16, 0), Some(4000.0));
        assert_eq!(later.drawn_length(39, 0), Some(4000.0), "step 5 stands for the file's 6th: its last, step 4's");
        let steps = later.lengths_drawn().unwrap().1.unwrap();
        assert_eq!((steps.first_drawn, steps.last_drawn, steps.steps_past_last), (2, 4, 2));
        assert_eq!(steps.describe(), ", steps 2 to 4 of its 1 to 4, and 2 steps past its last at step 4's");
        // Refused: a first step outside the file's, or given without steps to name.
        let err = job(&["compute.lengths_first_step=5"]).unwrap_err();
        assert!(
            err.contains("compute.lengths_first_step = 5 is outside the steps") && err.contains("(1 to 4)"),
            "{err}"
        );
        std::fs::write(dir.path().join("plain.txt"), "700\n").unwrap();
        let plain = format!("compute.lengths={}", dir.path().join("plain.txt").display());
        let err = with(&["compute.model=true", "memory.profile=qwen3-4b", &plain, "compute.lengths_first_step=3"])
            .unwrap_err();
        assert!(err.contains("names no steps; give each JSON line a \"step\""), "{err}");
        let err = with(&["compute.lengths_first_step=3"]).unwrap_err();
        assert!(err.contains("needs a lengths file whose lines name their step (--lengths FILE)"), "{err}");
        assert_eq!(
            with(&["compute.model=true", "memory.profile=qwen3-4b", &plain]).unwrap().lengths_drawn().unwrap().1,
            None
        );
    }

    fn with(sets: &[&str]) -> Result<Config, String> {
        load(None, &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    /// A preset fills the figures the job leaves out; the default device is the H100 the
    /// defaults always modelled.
    #[test]
    fn a_device_preset_fills_the_figures_the_job_leaves_out() {
        let h100 = with(&["compute.model=true", "memory.profile=qwen3-4b"]).unwrap().compute;
        assert_eq!((h100.device.as_str(), h100.tflops, h100.hbm_gbps), ("h100", 989.0, 3350.0));
        assert_eq!((h100.h2d_gbps, h100.d2h_gbps, h100.collective_gbps), (35.0, 52.8, 365.0));
        assert!((h100.pin_gbps - 3.0246).abs() < 1e-3 && h100.map_ms_per_gib == 0.0, "{h100:?}");
        let h20 = with(&["compute.device=h20", "run.mode=async", "run.devices=2"]).unwrap().compute;
        assert_eq!((h20.tflops, h20.hbm_gbps), (148.0, 4000.0));
        let c910 = with(&["compute.device=910c"]).unwrap().compute;
        assert_eq!((c910.tflops, c910.hbm_gbps, c910.h2d_gbps, c910.d2h_gbps), (752.0, 3200.0, 33.9, 29.5));
        let err = with(&["compute.device=h200"]).unwrap_err();
        assert!(err.contains("compute.device \"h200\" is not a preset") && err.contains("910b"), "{err}");
    }

    /// A key the job sets wins over its preset, whether given with --set or in its file.
    #[test]
    fn an_explicit_key_overrides_the_preset() {
        let c = with(&["compute.device=h20", "compute.tflops=100", "compute.h2d_gbps=20"]).unwrap().compute;
        assert_eq!((c.tflops, c.hbm_gbps, c.h2d_gbps), (100.0, 4000.0, 20.0));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("job.toml");
        std::fs::write(&f, "[compute]\ndevice = \"910c\"\nhbm_gbps = 1000.0\n").unwrap();
        let c = load(Some(&f), &["compute.tflops=700".into()]).unwrap().compute;
        assert_eq!((c.device.as_str(), c.tflops, c.hbm_gbps, c.h2d_gbps), ("910c", 700.0, 1000.0, 33.9));
        // Explicit 0 is a choice (no memory floor), not a hole the preset fills.
        assert_eq!(with(&["compute.hbm_gbps=0"]).unwrap().compute.hbm_gbps, 0.0);
    }

    /// The 910B has no published HBM bandwidth: a modelled job on it must give one, and is told
    /// which key and why; a run that models nothing is not held to it.
    #[test]
    fn a_figure_the_preset_lacks_must_be_given_by_a_job_that_needs_it() {
        let base = ["compute.model=true", "memory.profile=qwen3-4b", "compute.device=910b"];
        let err = with(&base).unwrap_err();
        assert!(err.contains("compute.hbm_gbps is unset: compute.device = \"910b\" (Huawei Ascend 910B)"), "{err}");
        assert!(err.contains("compute.d2h_gbps is unset") && err.contains("compute.h2d_gbps is unset"), "{err}");
        assert!(!err.contains("compute.tflops"), "{err}");
        let given = [&base[..], &["compute.hbm_gbps=1600", "compute.h2d_gbps=20", "compute.d2h_gbps=20"]].concat();
        let c = with(&given).unwrap().compute;
        assert_eq!((c.tflops, c.hbm_gbps, c.collective_gbps), (328.0, 1600.0, 72.0));
        assert!(with(&["compute.device=910b"]).is_ok(), "nothing modelled: no figure needed");
        // Async broadcasts the weights and never pauses: the host link is not needed, the
        // collective is (the H20 has none published).
        let apart = ["compute.model=true", "memory.profile=qwen3-4b", "run.mode=async", "run.devices=2"];
        assert!(with(&[&apart[..], &["compute.device=h800"]].concat()).is_ok());
        let err = with(&[&apart[..], &["compute.device=h20"]].concat()).unwrap_err();
        assert!(err.starts_with("compute.collective_gbps is unset") && !err.contains("h2d"), "{err}");
        let err = with(&[&apart[..], &["compute.pin_gbps=-1"]].concat()).unwrap_err();
        assert!(err.contains("compute.pin_gbps must be >= 0"), "{err}");
    }

    #[test]
    fn nodes_need_the_ray_launcher_and_devices_count_across_nodes() {
        let err = load(None, &["run.nodes=2".into()]).unwrap_err();
        assert!(err.contains("--launcher ray"), "{err}");
        let c = load(None, &["run.nodes=2".into(), "run.devices=2".into(), "run.launcher=ray".into()]).unwrap();
        assert_eq!(c.total_devices(), 4);
        // 32 prompts over 4 devices, not over 3 x 2.
        let err = load(None, &["run.nodes=3".into(), "run.devices=2".into(), "run.launcher=ray".into()]).unwrap_err();
        assert!(err.contains("multiple of run.devices x run.nodes"), "{err}");
    }

    #[test]
    fn effective_config_round_trips() {
        let c = load(None, &["rollout.temperature=0.7".into()]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, c.to_toml()).unwrap();
        assert_eq!(load(Some(&f), &[]).unwrap().rollout.temperature, 0.7);
    }

    #[test]
    fn auto_transport_waits_for_the_workers_hellos_with_a_worker_command() {
        let at = |sets: &[&str]| load(None, &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        let asynchronous = ["run.mode=async", "run.devices=2"];
        assert_eq!(at(&[]).weight_transport(), WeightTransport::Ipc);
        assert_eq!(at(&["run.trainer_cmd=w"]).weight_transport(), WeightTransport::Host);
        assert_eq!(at(&asynchronous).weight_transport(), WeightTransport::Broadcast);
        let external = at(&[&asynchronous[..], &["run.trainer_cmd=w", "run.rollout_cmd=w"]].concat());
        assert_eq!(external.weight_transport(), WeightTransport::Auto);
        assert_eq!(external.resolve_weight_transport(true), Ok(WeightTransport::Broadcast));
        assert_eq!(external.resolve_weight_transport(false), Ok(WeightTransport::Host));
        let host = at(&[&asynchronous[..], &["run.trainer_cmd=w", "run.weight_transport=host"]].concat());
        assert_eq!(host.resolve_weight_transport(true), Ok(WeightTransport::Host));
        // Workers that speak host only cannot move weights between the hosts of a real cluster.
        let remote = [
            "run.mode=async",
            "run.launcher=ray",
            "run.ray_address=10.0.0.1:6379",
            "run.nodes=2",
            "run.devices=1",
            "run.trainer_cmd=w",
            "run.rollout_cmd=w",
        ];
        let remote = at(&remote);
        assert_eq!(remote.resolve_weight_transport(true), Ok(WeightTransport::Broadcast));
        let err = remote.resolve_weight_transport(false).unwrap_err();
        assert!(err.contains("moves the weights through a file on one host"), "{err}");
    }

    #[test]
    fn auto_correction_is_tis_apart_and_none_colocated_and_stale_uncorrected_is_refused() {
        let at = |sets: &[&str]| load(None, &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let asynchronous = ["run.mode=async", "run.devices=2"];
        assert_eq!(at(&[]).unwrap().off_policy_correction(), OffPolicyCorrection::None);
        assert_eq!(at(&asynchronous).unwrap().off_policy_correction(), OffPolicyCorrection::Tis);
        let tis = at(&["algo.off_policy_correction=tis"]).unwrap();
        assert_eq!(tis.off_policy_correction(), OffPolicyCorrection::Tis, "colocated on request");
        let none = [&asynchronous[..], &["algo.off_policy_correction=none"]].concat();
        let err = at(&none).unwrap_err();
        assert!(err.contains("async.max_staleness = 2") && err.contains("algo.allow_uncorrected_stale"), "{err}");
        let on_policy = [&none[..], &["async.max_staleness=0"]].concat();
        assert_eq!(at(&on_policy).unwrap().off_policy_correction(), OffPolicyCorrection::None);
        let err = at(&[&on_policy[..], &["async.train_iters_per_update=3"]].concat()).unwrap_err();
        assert!(err.contains("async.train_iters_per_update = 3"), "{err}");
        assert!(at(&[&none[..], &["algo.allow_uncorrected_stale=true"]].concat()).is_ok());
        assert!(at(&["algo.tis_cap=0.9"]).unwrap_err().contains("algo.tis_cap=0.9 must be"));
    }

    /// A run without a reference pass may not ask for a KL to it; rollout log-probs as the old
    /// ones make the PPO ratio the correction, so TIS is off by default and refused on request,
    /// and stale samples are not refused as uncorrected.
    #[test]
    fn skipped_passes_refuse_what_needs_them() {
        let at = |sets: &[&str]| load(None, &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let err = at(&["algo.reference=false"]).unwrap_err();
        assert!(err.contains("algo.reference = false") && err.contains("algo.kl_coef = 0.001"), "{err}");
        assert!(err.contains("set algo.kl_coef = 0"), "{err}");
        let err = at(&["algo.name=ppo", "algo.reference=false", "algo.kl_coef=0.1"]).unwrap_err();
        assert!(err.contains("PPO's KL penalty"), "{err}");
        assert!(at(&["algo.reference=false", "algo.kl_coef=0"]).is_ok());

        let rollout = ["run.mode=async", "run.devices=2", "algo.rollout_log_probs=true"];
        assert_eq!(at(&rollout).unwrap().off_policy_correction(), OffPolicyCorrection::None);
        let err = at(&[&rollout[..], &["algo.off_policy_correction=tis"]].concat()).unwrap_err();
        assert!(err.contains("algo.rollout_log_probs = true") && err.contains("every weight would be"), "{err}");
        let none = [&rollout[..], &["algo.off_policy_correction=none", "async.max_staleness=2"]].concat();
        assert!(at(&none).is_ok(), "the clipped ratio to the rollout's log-probs corrects stale samples");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("12 parsecs").is_err());
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert!(parse_size("0").is_err());
    }
}
