//! The worker protocol's messages (docs/worker-protocol.md): the hello, the envelopes, and for each
//! method one params type and one reply type, shared by the runner (fleet/) and the built-in worker
//! (worker.rs). wire.rs carries them as JSON lines.
//!
//! A reply that does not read as its type is an error that names the field (`decode`); a result of
//! `null` (a Python handler that returns nothing) reads as `{}`.

use super::compute::{FIGURES, Mfu, Stage};
use super::model::{Adam, LossConfig, Shape, TrainSample};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

pub const PROTOCOL: u64 = 1;

/// A method: its name on the wire, what the runner sends and what the worker answers.
pub trait Method {
    const NAME: &'static str;
    type Params: Serialize + DeserializeOwned;
    type Reply: Serialize + DeserializeOwned;
}

/// Declares methods: `Name = "wire_name": Params => Reply;`, each a unit type implementing
/// `Method`. The transports declare theirs with it too.
macro_rules! methods {
    ($($ty:ident = $name:literal: $params:ty => $reply:ty;)*) => {
        $(
            pub struct $ty;
            impl $crate::run::protocol::Method for $ty {
                const NAME: &'static str = $name;
                type Params = $params;
                type Reply = $reply;
            }
        )*
    };
}
pub(crate) use methods;

// The methods every worker answers, as docs/worker-protocol.md lists them.
methods! {
    // Both roles.
    Init = "init": InitParams => InitReply;
    Checksum = "checksum": Step => ChecksumReply;
    UpdateBegin = "update_begin": UpdateBeginParams => UpdateBeginReply;
    UpdateEnd = "update_end": Step => Ack;
    Shutdown = "shutdown": Ack => Ack;
    // Each weight transport's own methods are declared in its file (transport/), with this macro.
    // The rollout's.
    Generate = "generate": GenerateParams => GenerateReply;
    // The trainer's.
    LogProbs = "log_probs": LogProbsParams => LogProbsReply;
    Values = "values": SamplesParams => ValuesReply;
    Train = "train": TrainParams => TrainReply;
    SaveState = "save_state": Step => Ack;
    LoadState = "load_state": Step => Ack;
    // Elastic mode's reverse lend: the trainer writes its whole state to a file in the run
    // directory (through the host, as a checkpoint) and a lent trainer reads it.
    ExportState = "export_state": StateFile => Ack;
    ImportState = "import_state": StateFile => Ack;
}

/// Where `export_state` writes the trainer's state and `import_state` reads it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StateFile {
    pub path: PathBuf,
    #[serde(default)]
    pub step: u64,
}

/// The worker's first message, `{"hello": {...}}`.
#[derive(Debug, Serialize, Deserialize)]
pub struct HelloMsg {
    pub hello: Hello,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: u64,
    pub role: String,
    /// The process the hook is loaded in (an external command may be a shell around it).
    pub pid: Option<u32>,
    pub implementation: Option<String>,
    /// The weight transports beyond `host` (which every worker speaks) that the worker takes part
    /// in: `ipc`, `broadcast` (docs/worker-protocol.md). Absent: none. `run.weight_transport =
    /// "auto"` picks a transport only when every worker it involves names it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transports: Vec<String>,
}

/// Reads a worker's first message: a hello of this protocol for `role`.
pub fn read_hello(msg: Value, role: &str) -> Result<Hello, String> {
    let shown = msg.to_string();
    match decode::<HelloMsg>(msg) {
        Ok(HelloMsg { hello }) if hello.protocol == PROTOCOL && hello.role == role => Ok(hello),
        Ok(_) => Err(format!("bad hello {shown}: expected protocol {PROTOCOL} and role {role}")),
        Err(e) => Err(format!("bad hello {shown}: {e}")),
    }
}

/// A request: `{"id", "method", "params"}`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Request {
    #[serde(default)]
    pub id: Value,
    #[serde(default)]
    pub method: String,
    #[serde(default)]
    pub params: Value,
}

/// Why a request failed: `oom` (reported as out of memory), or any other kind (`bad_request`,
/// `unknown_method`, `unsupported`, `device`, `internal`), reported as a worker error.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    pub kind: String,
    pub message: Option<String>,
}

/// An answer: `{"id", "result"}` or `{"id", "error"}`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Response {
    #[serde(default)]
    pub id: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// A reply the runner does not read, or params that carry nothing: `{}` on the wire.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Ack {}

/// Params of the methods that carry only the step.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Step {
    #[serde(default)]
    pub step: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitParams {
    pub api: String,
    pub device: u32,
    pub shape: Shape,
    pub seed: u64,
    /// The memory profile's allocations for this role: (tag, sizes).
    pub memory: Vec<(String, Vec<u64>)>,
    #[serde(default = "yes")]
    pub backup: bool,
    #[serde(default)]
    pub max_batch: usize,
    pub loss: Option<LossConfig>,
    pub adam: Option<Adam>,
    #[serde(default)]
    pub step: u64,
    /// Modelled device compute (compute.model): each request takes at least the time the memory
    /// profile's model would take on the modelled device. None: only what it costs here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<ComputeModel>,
    /// Trainers only, when there are several: the data-parallel process group they form. None:
    /// a single trainer, or a layout the runner cannot give a rendezvous (a remote Ray cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer_group: Option<TrainerGroup>,
    /// Modelled seconds per wall-clock second (compute.time_scale): a worker paces its requests
    /// at their modelled time over this and reports the times it measures times this. Absent
    /// (a runner that predates it): 1, the wall clock.
    #[serde(default = "wall_clock", skip_serializing_if = "is_wall_clock")]
    pub time_scale: f64,
}

fn wall_clock() -> f64 {
    1.0
}

fn is_wall_clock(k: &f64) -> bool {
    *k == 1.0
}

/// Where the trainers meet for their data-parallel process group (torch.distributed's
/// `init_process_group(backend, init_method, rank, world_size)`): rank 0 (the first trainer)
/// serves the store at `init_method`, every trainer is on a device of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainerGroup {
    /// "nccl" (CUDA) or "hccl" (Ascend).
    pub backend: String,
    /// `tcp://HOST:PORT`: a free port the runner picked on rank 0's host.
    pub init_method: String,
    pub rank: u32,
    pub world: u32,
}

/// The device time a request models: FLOPs per token times tokens over the device's rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ComputeModel {
    /// FLOPs of one token through the model's forward pass on one device (2 x its parameters).
    pub forward_flops_per_token: f64,
    /// The device's peak dense TFLOPS.
    pub tflops: f64,
    /// Shares of the peak the trainer's passes and generation reach.
    pub train_mfu: f64,
    pub rollout_mfu: f64,
    /// Each token of the task stands for this many tokens of the modelled job.
    pub token_scale: f64,
    /// The trainers are replicas: each takes the time of its share of the batch.
    pub trainers: f64,
    /// The device's memory bandwidth (GB/s). Every decode step reads the weights and the KV
    /// cache of every active sequence, so a step lasts at least those bytes over it. None: no
    /// memory floor (decoding is charged by its FLOPs alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hbm_gbps: Option<f64>,
    /// Bytes of weights one device reads per decode step (2 per parameter, bf16).
    #[serde(default)]
    pub weight_bytes: f64,
    /// Bytes of K and V per token of context on one device.
    #[serde(default)]
    pub kv_bytes_per_token: f64,
    /// Milliseconds every decode step costs beyond its roofline: kernel launches, the engine's
    /// scheduler, sampling, the device-to-host sync of the sampled tokens. Absent (a runner that
    /// predates it): 0, the roofline alone.
    #[serde(default)]
    pub decode_step_ms: f64,
    /// Modelled tokens of KV cache one engine holds (the profile's KV-cache bytes at full scale
    /// over `kv_bytes_per_token`): sequences are admitted while their tokens fit, and preempted
    /// when a decode step's growth does not (docs/async.md, "KV capacity"). None: unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_capacity_tokens: Option<f64>,
}

impl ComputeModel {
    /// The model for a request that says its own `token_scale` (responses grown over the run).
    pub fn scaled(&self, token_scale: Option<f64>) -> ComputeModel {
        ComputeModel { token_scale: token_scale.unwrap_or(self.token_scale), ..*self }
    }

    /// Seconds for `tokens` task tokens through `passes` forward-pass equivalents (a forward pass
    /// is 1, training 3: forward and backward) at `mfu`, on one of `devices` sharing the work.
    pub fn seconds(&self, tokens: usize, passes: f64, mfu: f64, devices: f64) -> f64 {
        self.modelled_seconds(tokens as f64 * self.token_scale, passes, mfu, devices)
    }

    /// `seconds` for `modelled` tokens of the modelled job (task tokens already scaled, or a
    /// sample's drawn length, compute.lengths).
    pub fn modelled_seconds(&self, modelled: f64, passes: f64, mfu: f64, devices: f64) -> f64 {
        let flops = modelled * passes * self.forward_flops_per_token;
        flops / (self.tflops * 1e12 * mfu * devices.max(1.0))
    }

    /// `stage_seconds` for `modelled` tokens of the modelled job.
    pub fn stage_modelled_seconds(&self, stage: &Stage, modelled: f64, devices: f64) -> f64 {
        let mfu = match stage.mfu {
            Mfu::Train => self.train_mfu,
            Mfu::Rollout => self.rollout_mfu,
        };
        self.modelled_seconds(modelled, stage.passes, mfu, devices)
    }

    /// Seconds for `tokens` task tokens through `stage` (its passes at its MFU, the compute model's
    /// figures), on one of `devices` sharing the work.
    pub fn stage_seconds(&self, stage: &Stage, tokens: usize, devices: f64) -> f64 {
        let mfu = match stage.mfu {
            Mfu::Train => self.train_mfu,
            Mfu::Rollout => self.rollout_mfu,
        };
        self.seconds(tokens, stage.passes, mfu, devices)
    }

    /// Seconds of one decode step of the task over `active` sequences whose contexts hold
    /// `context` task tokens in all. It stands for `token_scale` steps of the modelled job, each
    /// the longer of its FLOPs at `rollout_mfu` and its reads (the weights, and each sequence's
    /// KV cache, which grows over those steps) at the memory bandwidth: the roofline of a decode
    /// step, which small batches spend waiting on memory. Each modelled step then pays the fixed
    /// `decode_step_ms` whatever its batch, which is what makes a batch's last few sequences dear.
    /// `context` need not be whole: a sequence decoding to a drawn length (compute.lengths) holds
    /// its prompt's task tokens plus its modelled steps over token_scale.
    pub fn decode_step_seconds(&self, active: usize, context: f64) -> f64 {
        let s = self.token_scale;
        let fixed = s * self.decode_step_ms / 1e3;
        let compute = self.stage_seconds(&FIGURES.stages.decode, active, 1.0);
        let Some(gbps) = self.hbm_gbps.filter(|g| *g > 0.0) else { return compute + fixed };
        // Each sequence's cache grows over the modelled steps; it is charged at its size part-way.
        let kv_tokens = s * (context + FIGURES.decode_kv_midpoint * active as f64);
        let bytes = s * (self.weight_bytes + self.kv_bytes_per_token * kv_tokens);
        compute.max(bytes / (gbps * 1e9)) + fixed
    }
}

fn yes() -> bool {
    true
}

/// Anything informative; the runner reads none of it.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct InitReply {
    pub params: Option<u64>,
    pub device_free: Option<u64>,
    pub device_total: Option<u64>,
}

/// A digest of the weights (trainer and rollout agree when they hold the same weights) and how
/// many bytes it covers.
#[derive(Debug, Serialize, Deserialize)]
pub struct ChecksumReply {
    pub weights: String,
    pub bytes: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UpdateBeginParams {
    /// The file both sides map; one bucket crosses in it at a time.
    pub shm: PathBuf,
    pub bucket_bytes: u64,
    #[serde(default)]
    pub step: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct UpdateBeginReply {
    /// How many buckets the weights stream has: the trainer's answer is read, the rollout's not.
    pub buckets: Option<u64>,
    pub bytes: Option<u64>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct BucketParams {
    pub bucket: u64,
    #[serde(default)]
    pub step: u64,
}

/// Not read by the runner.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct BucketReply {
    pub bytes: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct GenerateParams {
    pub prompts: Vec<Vec<u32>>,
    pub n: usize,
    pub max_new_tokens: usize,
    #[serde(default = "one")]
    pub temperature: f64,
    pub eos: Option<u32>,
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub step: u64,
    /// Partial rollouts (async mode): the response tokens each sequence already has, one entry per
    /// sequence in reply order (`prompts.len() * n`); generation continues after them under the
    /// weights the rollout holds now. Empty: every sequence starts fresh.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub responses: Vec<Vec<u32>>,
    /// Partial rollouts: generate at most this many new tokens per sequence in this request, and
    /// say which sequences finished. None: to the end (EOS or `max_new_tokens` in all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment_tokens: Option<usize>,
    /// Partial rollouts: no weight update came since the continued sequences' last segment, so an
    /// engine that keeps its cache between requests has their prefixes in it (re-prefilled
    /// otherwise). A sequence with an empty prefix and no `progress` is new: prefilled either way.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prefix_cached: bool,
    /// Partial rollouts: for each continued sequence (in `responses`' order), whether this engine
    /// holds its prefix, when that differs between them (groups moved between engines: a lent
    /// engine's share, an orphan); it decides in place of `prefix_cached`, which is then false,
    /// so a worker that predates it charges every prefix. Empty: `prefix_cached` for all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cached: Vec<bool>,
    /// Modelled compute with responses that grow over the run (compute.token_scale_final): the
    /// modelled tokens per task token of this request's samples, in place of init's
    /// `compute.token_scale`. None: init's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_scale: Option<f64>,
    /// Partial rollouts under modelled compute (async.segment_s): the modelled seconds of decoding
    /// this request may take; the segment ends when they are spent, even part-way through a task
    /// token. None: no budget (a worker that does not model compute ignores it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment_s: Option<f64>,
    /// With `segment_s`: the modelled decode steps each continued sequence already did towards its
    /// next task token in earlier segments, one entry per sequence as `responses` (it needs
    /// `token_scale` steps in all). Empty: none began one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub progress: Vec<f64>,
    /// Partial rollouts: a seed per sequence (reply order); the draw of a sequence's k-th response
    /// token depends on its seed and k alone, so its tokens do not depend on how it was split into
    /// segments, nor on the engines that ran them (given the same weights). Empty: one stream
    /// from `seed` for the whole request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sequence_seeds: Vec<u64>,
    /// Modelled compute with the job's own response lengths (compute.lengths): each sequence's
    /// modelled response length in decode steps (reply order). A sequence decodes until its
    /// `progress`, which then counts its modelled steps since its start, reaches its length;
    /// a task token is sampled every `token_scale` steps while its task response is open; a task
    /// response that ended (EOS, `max_new_tokens`) keeps decoding, unsampled, to the length; one
    /// whose length comes first is cut there. Empty: today's lengths, task tokens x token_scale.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lengths: Vec<f64>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Serialize, Deserialize)]
pub struct GenerateReply {
    /// `n` samples per prompt, grouped by prompt.
    pub samples: Vec<Generated>,
    /// How the request's decode filled the engine. Absent: a worker that does not report it (the
    /// runner says so once and leaves its engines out of the occupancy and KV figures).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<DecodeStats>,
}

/// A generate request's decode as its engine scheduled it (docs/metrics.md, "Decode").
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DecodeStats {
    /// Decode steps run (modelled steps with compute.model, task tokens without).
    pub steps: f64,
    /// Over those steps, the sequences decoding in each, summed: `slot_steps / (steps * slots)`
    /// is the share of the batch slots filled.
    pub slot_steps: f64,
    /// The engine's batch slots (init's `max_batch`).
    pub slots: usize,
    /// With a KV capacity (compute.kv_capacity_tokens): sequences preempted for want of KV.
    #[serde(default)]
    pub preemptions: u64,
    /// Modelled tokens prefilled again when preempted sequences were readmitted.
    #[serde(default)]
    pub recomputed_tokens: f64,
    /// The most of the KV capacity the running sequences held at once, as a share. None: no
    /// capacity modelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_peak_share: Option<f64>,
    /// Modelled seconds sequences spent waiting for KV (admission or readmission), summed over
    /// sequences.
    #[serde(default)]
    pub kv_queued_s: f64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Generated {
    pub prompt_index: usize,
    /// The tokens this request generated (after the `responses` prefix it was given, if any).
    pub response: Vec<u32>,
    pub logprobs: Vec<f64>,
    /// False when the sequence stopped at `segment_tokens` or `segment_s` and has more to generate.
    #[serde(default = "yes")]
    pub finished: bool,
    /// With `segment_s`, an unfinished sequence: the modelled decode steps done towards its next
    /// task token when the budget ran out, for the request that continues it. Absent: 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub progress: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// A sequence to score: its prompt and response tokens.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pair {
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Model {
    #[default]
    Actor,
    Ref,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct LogProbsParams {
    #[serde(default)]
    pub model: Model,
    pub samples: Vec<Pair>,
    #[serde(default)]
    pub step: u64,
    /// Modelled compute with responses that grow over the run (compute.token_scale_final): the
    /// modelled tokens per task token of this request's samples, in place of init's
    /// `compute.token_scale`. None: init's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_scale: Option<f64>,
    /// Modelled compute with the job's own response lengths (compute.lengths): the batch's modelled
    /// tokens (each sample's prompt task tokens x token_scale plus its drawn response length),
    /// charged in place of its task tokens x token_scale. None: task tokens x token_scale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modelled_tokens: Option<f64>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct SamplesParams {
    pub samples: Vec<Pair>,
    #[serde(default)]
    pub step: u64,
    /// Modelled compute with responses that grow over the run (compute.token_scale_final): the
    /// modelled tokens per task token of this request's samples, in place of init's
    /// `compute.token_scale`. None: init's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_scale: Option<f64>,
    /// Modelled compute with the job's own response lengths (compute.lengths): the batch's modelled
    /// tokens (each sample's prompt task tokens x token_scale plus its drawn response length),
    /// charged in place of its task tokens x token_scale. None: task tokens x token_scale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modelled_tokens: Option<f64>,
}

/// Per sequence, per response token.
#[derive(Debug, Serialize, Deserialize)]
pub struct LogProbsReply {
    pub logprobs: Vec<Vec<f64>>,
    pub entropy: Vec<Vec<f64>>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ValuesReply {
    pub values: Vec<Vec<f64>>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct TrainParams {
    pub samples: Vec<TrainSample>,
    #[serde(default = "one_usize")]
    pub minibatches: usize,
    #[serde(default = "one_usize")]
    pub epochs: usize,
    #[serde(default)]
    pub step: u64,
    /// Modelled compute with responses that grow over the run (compute.token_scale_final): the
    /// modelled tokens per task token of this request's samples, in place of init's
    /// `compute.token_scale`. None: init's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_scale: Option<f64>,
    /// The replicas sharing this train request (elastic mode's reverse lend adds lent trainers),
    /// in place of init's `compute.trainers`: each is paced at its share of the batch. None:
    /// init's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<f64>,
    /// As log_probs' `modelled_tokens`: the batch's modelled tokens for one epoch (compute.lengths).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modelled_tokens: Option<f64>,
}

fn one_usize() -> usize {
    1
}

/// The step's training metrics, any names (logged as `train/<name>`, metrics.rs); a `null` (a NaN
/// on the wire) is left out.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TrainReply(pub BTreeMap<String, Option<f64>>);

/// Reads a reply (a request's params, on the worker's side) as `T`; the error names the field that
/// does not read, when the message is an object and one of its fields is the cause.
pub fn decode<T: DeserializeOwned>(v: Value) -> Result<T, String> {
    let v = if v.is_null() { Value::Object(Default::default()) } else { v };
    let err = match serde_json::from_value::<T>(v.clone()) {
        Ok(t) => return Ok(t),
        Err(e) => e.to_string(),
    };
    if err.starts_with("missing field") {
        return Err(err);
    }
    let Value::Object(fields) = v else { return Err(err) };
    // The culprit is the field without which the error goes away or becomes "missing".
    for key in fields.keys() {
        let mut without = fields.clone();
        without.remove(key);
        match serde_json::from_value::<T>(Value::Object(without)) {
            Ok(_) => return Err(format!("field `{key}`: {err}")),
            Err(e) if e.to_string() == format!("missing field `{key}`") => {
                return Err(format!("field `{key}`: {err}"));
            }
            Err(_) => {}
        }
    }
    Err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_malformed_reply_names_its_field() {
        let e = decode::<ChecksumReply>(json!({"bytes": 3})).unwrap_err();
        assert_eq!(e, "missing field `weights`");
        let e = decode::<ChecksumReply>(json!({"weights": 7, "bytes": 3})).unwrap_err();
        assert!(e.starts_with("field `weights`: invalid type"), "{e}");
        let e = decode::<GenerateReply>(json!({"samples": [{"prompt_index": 0, "response": [1], "logprobs": [null]}]}))
            .unwrap_err();
        assert!(e.starts_with("field `samples`: invalid type: null"), "{e}");
        let e = decode::<UpdateBeginReply>(json!({"buckets": "two"})).unwrap_err();
        assert!(e.starts_with("field `buckets`"), "{e}");
        let e = decode::<TrainReply>(json!({"loss": 0.5, "kl": "low"})).unwrap_err();
        assert!(e.starts_with("field `kl`"), "{e}");
    }

    #[test]
    fn a_segment_budget_goes_out_only_when_set_and_carried_progress_reads_back_typed() {
        let p = GenerateParams {
            prompts: vec![vec![1]],
            n: 1,
            max_new_tokens: 4,
            temperature: 1.0,
            eos: None,
            seed: 0,
            step: 1,
            responses: vec![vec![2]],
            segment_tokens: Some(2),
            prefix_cached: true,
            cached: Vec::new(),
            token_scale: None,
            segment_s: Some(0.5),
            progress: vec![120.0],
            sequence_seeds: vec![9],
            lengths: Vec::new(),
        };
        let v = serde_json::to_value(p).unwrap();
        assert_eq!(
            (&v["segment_s"], &v["progress"], &v["sequence_seeds"]),
            (&json!(0.5), &json!([120.0]), &json!([9]))
        );
        let sample = |progress: Value| json!({"samples": [{"prompt_index": 0, "response": [], "logprobs": [], "finished": false, "progress": progress}]});
        assert_eq!(decode::<GenerateReply>(sample(json!(37.5))).unwrap().samples[0].progress, 37.5);
        let older = json!({"samples": [{"prompt_index": 0, "response": [3], "logprobs": [-0.1]}]});
        assert_eq!(decode::<GenerateReply>(older).unwrap().samples[0].progress, 0.0, "absent: none carried");
        let e = decode::<GenerateReply>(sample(json!("half"))).unwrap_err();
        assert!(e.starts_with("field `samples`: invalid type: string \"half\""), "{e}");
        // A finished sequence carries nothing, and says nothing.
        let done = Generated { prompt_index: 0, response: vec![1], logprobs: vec![0.0], finished: true, progress: 0.0 };
        assert!(serde_json::to_value(done).unwrap().get("progress").is_none());
    }

    #[test]
    fn null_reads_as_an_empty_object_and_unknown_fields_are_ignored() {
        decode::<Ack>(Value::Null).unwrap();
        let r = decode::<ChecksumReply>(json!({"weights": "ab", "extra": [1]})).unwrap();
        assert_eq!(r.weights, "ab");
        assert_eq!(decode::<UpdateBeginReply>(json!({})).unwrap().buckets, None);
    }

    #[test]
    fn params_go_out_as_the_documented_fields() {
        let p = LogProbsParams {
            model: Model::Ref,
            samples: vec![Pair { prompt: vec![1], response: vec![2] }],
            step: 3,
            token_scale: None,
            modelled_tokens: None,
        };
        assert_eq!(
            serde_json::to_value(p).unwrap(),
            json!({"model": "ref", "samples": [{"prompt": [1], "response": [2]}], "step": 3})
        );
        // Growth over the run (compute.token_scale_final) says the request's own scale.
        let p = SamplesParams { samples: Vec::new(), step: 4, token_scale: Some(650.0), modelled_tokens: None };
        assert_eq!(serde_json::to_value(p).unwrap(), json!({"samples": [], "step": 4, "token_scale": 650.0}));
        assert_eq!(serde_json::to_value(Ack {}).unwrap(), json!({}));
        assert_eq!(serde_json::to_value(TrainReply::default()).unwrap(), json!({}));
    }

    /// Qwen3-4B on an H100's datasheet figures, one task token for one modelled token.
    fn h100_4b(decode_step_ms: f64) -> ComputeModel {
        ComputeModel {
            forward_flops_per_token: 2.0 * 4.0e9,
            tflops: 989.0,
            train_mfu: 0.4,
            rollout_mfu: 0.3,
            token_scale: 1.0,
            trainers: 1.0,
            hbm_gbps: Some(3350.0),
            weight_bytes: 2.0 * 4.0e9,
            kv_bytes_per_token: 147_456.0,
            decode_step_ms,
            kv_capacity_tokens: None,
        }
    }

    #[test]
    fn every_decode_step_pays_the_fixed_latency_on_top_of_its_roofline() {
        let (bare, floored) = (h100_4b(0.0), h100_4b(2.0));
        // One sequence at an empty context: the weights' 8 GB at 3,350 GB/s, then the 2 ms.
        let weights = 8.0e9 / 3350e9;
        assert!((bare.decode_step_seconds(1, 0.0) - (weights + 147_456.0 * 0.5 / 3350e9)).abs() < 1e-9);
        for (active, context) in [(1, 0.0), (1, 4096.0), (64, 64.0 * 512.0), (4096, 4096.0 * 2.0)] {
            let extra = floored.decode_step_seconds(active, context) - bare.decode_step_seconds(active, context);
            assert!((extra - 0.002).abs() < 1e-9, "{active} sequences: {extra} s more, not 2 ms");
        }
        // Each task step stands for token_scale modelled steps, each paying the latency.
        let scaled = ComputeModel { token_scale: 300.0, ..floored };
        let extra = scaled.decode_step_seconds(1, 0.0)
            - ComputeModel { decode_step_ms: 0.0, ..scaled }.decode_step_seconds(1, 0.0);
        assert!((extra - 0.6).abs() < 1e-9, "{extra}");
        // Without a memory floor the latency still adds to the FLOPs.
        let flops_only = ComputeModel { hbm_gbps: None, ..floored };
        let compute = flops_only.seconds(8, 1.0, 0.3, 1.0);
        assert!((flops_only.decode_step_seconds(8, 0.0) - (compute + 0.002)).abs() < 1e-12);
    }

    #[test]
    fn a_compute_block_without_decode_step_ms_reads_as_the_roofline_alone() {
        let mut block = serde_json::to_value(h100_4b(2.0)).unwrap();
        assert_eq!(block["decode_step_ms"], json!(2.0));
        block.as_object_mut().unwrap().remove("decode_step_ms");
        let older: ComputeModel = serde_json::from_value(block).unwrap();
        assert_eq!(older, h100_4b(0.0));
    }

    #[test]
    fn hellos_may_omit_transports() {
        let hello = json!({"hello": {"protocol": 1, "role": "rollout", "pid": 7}});
        assert!(read_hello(hello, "rollout").unwrap().transports.is_empty());
        let hello = json!({"hello": {"protocol": 1, "role": "rollout", "transports": ["ipc"]}});
        assert_eq!(read_hello(hello, "rollout").unwrap().transports, ["ipc"]);
    }
}
