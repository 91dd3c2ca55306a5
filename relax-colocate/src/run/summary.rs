//! summary.json as one type: the run writes it, the phase table prints from it and `compare`
//! reads it back, so a field is named once and a misspelt one is a compile error, not a NaN in a
//! table. The shape is docs/metrics.md's; every block's fields are in alphabetical order, the
//! order the file has always had. Figures that a run may not have (no steps, no lends) are
//! `Option`s, written as null.

use super::config::AlgoName;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    #[default]
    Ok,
    Interrupted,
    Failed,
}

/// Why a run stopped early.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Failure {
    pub cause: String,
    pub kind: String,
    pub phase: String,
    /// An out-of-memory failure's request that did not fit, where the failure says it (the
    /// built-in workers' allocations, a resume); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<FailedRequest>,
    pub step: u64,
    pub worker: Option<String>,
}

/// A device memory request that did not fit: its size and tag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedRequest {
    pub bytes: u64,
    /// The device's memory in use when the request came, where known (the request stands on it
    /// in the timeline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_used: Option<u64>,
    pub tag: Option<String>,
}

impl FailedRequest {
    /// The allocation call as a worker's out-of-memory message names it, `cudaMalloc(2048 bytes,
    /// tag kv_cache)`: the wire's error carries a message only, and `find_in` reads it back.
    pub fn call(&self, api_call: &str) -> String {
        match &self.tag {
            Some(t) => format!("{api_call}({} bytes, tag {t})", self.bytes),
            None => format!("{api_call}({} bytes)", self.bytes),
        }
    }

    /// What the device held when it was asked, for the message after `call`'s:
    /// `the device had 471859200 of 943718400 bytes in use`.
    pub fn used_note(&self, total: u64) -> String {
        format!("the device had {} of {total} bytes in use", self.device_used.unwrap_or(0))
    }

    /// The request in a message that `call` (and `used_note`) wrote, behind an allocation
    /// function's name, which ends in `Malloc`: cudaMalloc, aclrtMalloc.
    pub fn find_in(msg: &str) -> Option<FailedRequest> {
        let args = &msg[msg.find("Malloc(")? + "Malloc(".len()..];
        let args = &args[..args.find(')')?];
        let (bytes, tag) = match args.split_once(", tag ") {
            Some((b, t)) => (b, Some(t.to_string())),
            None => (args, None),
        };
        let used = msg.split_once("the device had ").and_then(|(_, rest)| rest.split_once(' ')?.0.parse().ok());
        Some(FailedRequest { bytes: bytes.strip_suffix(" bytes")?.parse().ok()?, device_used: used, tag })
    }
}

/// What every run writes, even one whose workers never got going (`run` None: only these three).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Summary {
    pub failure: Option<Failure>,
    pub status: Status,
    pub steps_completed: u64,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunSummary>,
}

/// A run that started: its phases, rewards, memory, checks and, by layout, its blocks.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunSummary {
    pub algo: Option<AlgoName>,
    /// The async and elastic layouts' block (absent in colocate).
    #[serde(rename = "async", default, skip_serializing_if = "Option::is_none")]
    pub asynchronous: Option<AsyncSummary>,
    pub checks: Checks,
    pub compute: String,
    /// How the engines filled their batch slots and KV cache, by role ("rollout"; elastic's lent
    /// engines "lent"). Absent: no engine reported it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub decode: BTreeMap<String, RoleDecode>,
    /// Engines whose generate replies report no decode figures (left out of `decode`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decode_unreported: Vec<String>,
    pub device: String,
    /// With compute.lengths: the file's lengths and what the trained samples drew (absent
    /// otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lengths: Option<LengthsSummary>,
    pub memory: Memory,
    pub off_policy_correction: Correction,
    pub pass_rate: Ends,
    pub phases: Vec<PhaseStats>,
    pub reward: Ends,
    pub run_dir: PathBuf,
    pub steps_requested: u64,
    /// With compute.model: the switch's phases, measured and modelled (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switch: Option<SwitchSummary>,
    pub wall_time_s: f64,
    /// With compute.time_scale above 1: the modelled clock against the wall clock (absent on the
    /// wall clock, where `wall_time_s` is both).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock: Option<ClockSummary>,
    pub weight_sync: WeightSyncSummary,
}

/// The modelled clock (compute.time_scale): every time in the summary is on it, `wall_time_s`
/// included; `real_wall_time_s` is what the run took here.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ClockSummary {
    pub time_scale: f64,
    pub real_wall_time_s: f64,
}

/// The switch as compute.model charged it: each stage's time measured on this machine (the
/// profile's bytes at memory.scale) and modelled on compute.device (its full-scale bytes); every
/// stage lasted the longer of the two, `charged_s` in all.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SwitchSummary {
    pub charged_s: f64,
    pub device: String,
    pub measured_s: f64,
    pub modelled_s: f64,
    pub stages: Vec<SwitchStage>,
}

/// One stage of the switch over the run (a phase, or a part of a lend or reclaim).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SwitchStage {
    pub charged_s: f64,
    pub count: u64,
    pub measured_s: f64,
    pub modelled_s: f64,
    pub stage: String,
}

/// The job's own response lengths (compute.lengths): the file, its figures, and the modelled
/// response tokens of the samples the trainer trained on (each its drawn length).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LengthsSummary {
    pub file: String,
    /// For a file that names steps: which of them the run's steps stood for. The figures below
    /// are then of those steps' lengths.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<LengthsSteps>,
    pub values: usize,
    pub mean: f64,
    pub p50: u64,
    pub p90: u64,
    pub max: u64,
    pub trained_samples: u64,
    pub trained_response_tokens: f64,
}

/// The steps of a lengths file that names them: the file's first and last, the first and last the
/// run's steps stood for (compute.lengths_first_step onward), and how many of the run's steps fell
/// past the file's last (they drew its last step's lengths).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LengthsSteps {
    pub file_first: u64,
    pub file_last: u64,
    pub first_drawn: u64,
    pub last_drawn: u64,
    pub steps_past_last: u64,
}

impl LengthsSteps {
    /// Which steps of the file the run's steps stood for, as the lengths line, the compute line
    /// and plan's table say it (after the file's name).
    pub fn describe(&self) -> String {
        let past = match self.steps_past_last {
            0 => String::new(),
            n => format!(", and {n} step{} past its last at step {}'s", if n == 1 { "" } else { "s" }, self.file_last),
        };
        let range = if self.first_drawn == self.last_drawn {
            format!("step {}", self.first_drawn)
        } else {
            format!("steps {} to {}", self.first_drawn, self.last_drawn)
        };
        format!(", {range} of its {} to {}{past}", self.file_first, self.file_last)
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Checks {
    pub enabled: bool,
    pub passed: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Memory {
    /// Bytes of each NCCL communicator suspended, by worker.
    pub communicator_bytes_suspended: BTreeMap<String, u64>,
    /// Per device.
    pub peak_device_used: Vec<u64>,
    pub profile: String,
    pub rollout_allocations: u64,
    pub rollout_bytes_per_device: u64,
    pub trainer_allocations: u64,
    pub trainer_bytes_per_device: u64,
    pub weights_bytes_per_device: u64,
}

/// The off-policy correction's figures over the run (None: no step reported it).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Correction {
    pub method: String,
    pub rollout_train_logprob_diff_mean: Option<f64>,
    pub tis_cap: f64,
    pub tis_clipfrac_mean: Option<f64>,
    pub tis_max: Option<f64>,
    pub tis_mean: Option<f64>,
}

/// A per-step figure averaged at the run's start and at its end, over windows that share no step.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Ends {
    pub first3_mean: Option<f64>,
    pub last3_mean: Option<f64>,
    pub window_steps: usize,
}

/// A role's engines over the run: their batch slots and KV cache (docs/metrics.md, "Decode").
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RoleDecode {
    /// Decode steps over the run (modelled steps with compute.model).
    pub decode_steps: f64,
    /// Its devices (distinct).
    pub devices: usize,
    /// The most of an engine's KV capacity running sequences held at once; null: no capacity
    /// modelled (compute.model off, or compute.kv_capacity = false).
    pub kv_peak_share: Option<f64>,
    /// Modelled seconds sequences waited for KV, summed over sequences.
    pub kv_queued_s: f64,
    pub preemptions: u64,
    /// Modelled tokens prefilled again on preempted sequences' readmission.
    pub recomputed_tokens: f64,
    /// The share of the engines' batch slots filled, over their decode steps.
    pub slot_occupancy: Option<f64>,
    /// Task tokens its engines generated.
    pub tokens: u64,
    /// `tokens` per second of the run's steps per device of the role.
    pub tokens_per_device_s: Option<f64>,
}

/// One phase over the run's steps.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PhaseStats {
    pub mean_s: f64,
    pub median_s: f64,
    pub p90_s: f64,
    pub phase: String,
    pub share_of_step: f64,
}

/// How the weights moved: the transport's figures, in the `weight_sync` block and in the async
/// block alike.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Transport {
    pub link_gbps: Option<f64>,
    pub link_share: Option<f64>,
    pub update_weights_buckets: u64,
    pub update_weights_gbps: Option<f64>,
    pub update_weights_host_bytes: u64,
    pub update_weights_transfer_s: f64,
    pub weight_sync_group_setup_s: f64,
    pub weight_sync_library: Option<String>,
    pub weight_transport: String,
}

/// The `weight_sync` block, in every layout.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WeightSyncSummary {
    #[serde(flatten)]
    pub transport: Transport,
    pub update_weights_bytes: u64,
    pub weight_transport_detail: String,
    pub weight_updates: u64,
}

/// The `async` block: throughput, both sides' idle shares, staleness, the updates.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AsyncSummary {
    pub dropped_stale_samples: u64,
    /// Elastic mode's lending (absent in async mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<ElasticSummary>,
    pub flush_ratio: f64,
    pub flush_s_max: Option<f64>,
    pub flush_s_mean: Option<f64>,
    pub generate_replies_after_last_batch: u64,
    pub max_staleness: u64,
    /// "async" or "elastic".
    pub mode: String,
    pub partial_samples: u64,
    pub queue_capacity_groups: usize,
    pub rollout_devices: Option<Vec<u32>>,
    pub rollout_idle_ratio: f64,
    pub samples_per_s: f64,
    pub samples_trained: u64,
    pub segment_s: Option<f64>,
    pub segment_tokens: u64,
    pub segments_ended_mid_token: u64,
    /// Trained samples by staleness (versions, as a string key).
    pub staleness_histogram: BTreeMap<String, u64>,
    pub tokens_per_s: f64,
    pub train_iters_per_update: u64,
    pub trainer_devices: Option<Vec<u32>>,
    pub trainer_idle_ratio: f64,
    pub trainer_wait_ratio: f64,
    pub update_weights_bytes: u64,
    pub update_weights_s: f64,
    pub weight_updates: u64,
    #[serde(flatten)]
    pub transport: Transport,
}

/// Elastic mode's `elastic` block: what lending did and cost, and the trainer devices' idle share
/// with and without it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ElasticSummary {
    pub calibration_switch_s: Option<f64>,
    pub forced_reclaims: u64,
    pub lend_after_s: f64,
    pub lend_after_s_source: String,
    pub lend_s_mean: Option<f64>,
    pub lends: u64,
    pub lends_skipped: u64,
    pub lent_engine_idle_s: f64,
    pub lent_groups: u64,
    pub lent_s: f64,
    pub lent_tokens: u64,
    pub reclaim_s_mean: Option<f64>,
    pub reclaim_timeout_s: f64,
    pub retired_engines: Vec<String>,
    /// elastic.lend_rollout's reverse lends (absent when not asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_lend: Option<RolloutLendSummary>,
    pub switch_s: Option<f64>,
    pub switch_saver_s_mean: Option<f64>,
    pub trainer_device_idle_ratio: f64,
    pub trainer_device_idle_ratio_without_flush: f64,
    pub trainer_idle_ratio_unlent: f64,
}

/// elastic.lend_rollout's `rollout_lend` block.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RolloutLendSummary {
    pub calibration_switch_s: Option<f64>,
    pub lend_s_mean: Option<f64>,
    pub lends: u64,
    pub lends_skipped: u64,
    pub lent_device_s: f64,
    pub reclaim_s_mean: Option<f64>,
    pub rollout_device_idle_ratio: f64,
    pub rollout_idle_ratio_unlent: f64,
    pub state_bytes_mean: Option<u64>,
    pub switch_s: Option<f64>,
    pub switch_saver_s_mean: Option<f64>,
}

impl Summary {
    /// summary.json's text.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a summary serializes")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_failed_request_is_read_back_from_the_message_that_names_it() {
        use super::FailedRequest;
        let tagged = FailedRequest { bytes: 2 << 30, device_used: Some(7 << 30), tag: Some("kv_cache".into()) };
        let msg = format!(
            "out of device memory: {} returned 2 (cudaErrorMemoryAllocation); {}",
            tagged.call("cudaMalloc"),
            tagged.used_note(8 << 30)
        );
        assert_eq!(FailedRequest::find_in(&msg), Some(tagged));
        let untagged = FailedRequest { bytes: 4096, device_used: None, tag: None };
        assert_eq!(FailedRequest::find_in(&untagged.call("aclrtMalloc")), Some(untagged));
        // Messages of other workers, which name no request.
        assert_eq!(FailedRequest::find_in("out of device memory: 10 of 20 bytes done"), None);
        assert_eq!(FailedRequest::find_in("cudaMalloc returned 2"), None);
    }

    use super::*;

    #[test]
    fn a_failure_before_the_workers_started_has_only_the_three_fields() {
        let s = Summary {
            failure: Some(Failure { cause: "no device".into(), kind: "setup".into(), ..Failure::default() }),
            status: Status::Failed,
            steps_completed: 0,
            run: None,
        };
        let v: serde_json::Value = serde_json::from_str(&s.to_json()).unwrap();
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["failure", "status", "steps_completed"]);
        assert_eq!(v["status"], "failed");
        let back: Summary = serde_json::from_str(&s.to_json()).unwrap();
        assert_eq!(back.failure.unwrap().cause, "no device");
    }

    #[test]
    fn a_run_summary_reads_back_with_its_async_and_elastic_blocks() {
        let run = RunSummary {
            asynchronous: Some(AsyncSummary {
                mode: "elastic".into(),
                staleness_histogram: BTreeMap::from([("1".into(), 8)]),
                elastic: Some(ElasticSummary { lends: 3, ..ElasticSummary::default() }),
                transport: Transport { weight_transport: "broadcast".into(), ..Transport::default() },
                ..AsyncSummary::default()
            }),
            reward: Ends { first3_mean: None, last3_mean: Some(0.5), window_steps: 1 },
            ..RunSummary::default()
        };
        let text = Summary { run: Some(run), ..Summary::default() }.to_json();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        // The blocks keep their names and nesting; a missing figure is null.
        assert_eq!(v["async"]["elastic"]["lends"], 3);
        assert_eq!(v["async"]["weight_transport"], "broadcast");
        assert!(v["reward"]["first3_mean"].is_null());
        assert!(v["async"]["elastic"].get("rollout_lend").is_none(), "absent when not asked for");
        let back: Summary = serde_json::from_str(&text).unwrap();
        let a = back.run.unwrap().asynchronous.unwrap();
        assert_eq!((a.mode.as_str(), a.elastic.as_ref().unwrap().lends), ("elastic", 3));
        assert_eq!(a.staleness_histogram["1"], 8);
    }
}
