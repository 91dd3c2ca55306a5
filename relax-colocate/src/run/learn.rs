//! What both drivers do with a batch of samples, whatever the layout: the advantages (GRPO's
//! group baseline, PPO's GAE over the critic's values), the trainer's request, the loss and
//! optimizer settings, and the batch's metrics under slime's names.

use super::Role;
use super::config::{AlgoName, Config, Launcher, OffPolicyCorrection};
use super::fleet::Fleet;
use super::metrics::{self, mean};
use super::profile::Profile;
use super::protocol::{ComputeModel, InitParams, TrainerGroup};
use super::protocol::{TrainParams, TrainReply};
use super::task::{self, Addition};
use super::{algo, model};

/// A rollout's sample: the prompt, the response and the rollout's log-probs of it.
pub(super) struct Sample {
    pub(super) prompt: Vec<u32>,
    pub(super) response: Vec<u32>,
    pub(super) logprobs: Vec<f64>,
}

/// The trainer's per-token numbers for each sample.
pub(super) struct Scores {
    /// The actor's pass, or with algo.rollout_log_probs the rollout's own.
    pub(super) old_lp: Vec<Vec<f64>>,
    /// Empty without a reference pass (algo.reference = false).
    pub(super) ref_lp: Vec<Vec<f64>>,
    /// Empty without the actor's pass.
    pub(super) entropy: Vec<Vec<f64>>,
    /// PPO only.
    pub(super) values: Vec<Vec<f64>>,
}

pub(super) struct Advantages {
    pub(super) advantages: Vec<Vec<f64>>,
    /// PPO only.
    pub(super) returns: Vec<Vec<f64>>,
    /// None without a reference pass: there is nothing to measure a KL to.
    pub(super) kl_ref: Option<f64>,
    /// The sequence reward after the KL penalty.
    pub(super) penalized: Vec<f64>,
}

/// A trained batch, for its metrics row.
pub(super) struct Outcome<'a> {
    pub(super) samples: &'a [Sample],
    /// (reward, exact) per sample.
    pub(super) scored: &'a [(f64, bool)],
    pub(super) scores: &'a Scores,
    pub(super) adv: &'a Advantages,
    pub(super) train: &'a TrainReply,
}

/// Advantages (and PPO's returns) in the runner, with the KL to the reference.
pub(super) fn advantages(
    cfg: &Config,
    samples: &[Sample],
    rewards: &[f64],
    scores: &Scores,
) -> Result<Advantages, String> {
    let kl_type = cfg.algo.kl_type;
    let (kl_tok, kl_ref): (Vec<Vec<f64>>, _) = if scores.ref_lp.is_empty() {
        // No reference: PPO's token rewards carry no KL term (algo.kl_coef is 0, checks.rs).
        (samples.iter().map(|s| vec![0.0; s.response.len()]).collect(), None)
    } else {
        let kl_tok: Vec<Vec<f64>> = (scores.old_lp.iter().zip(&scores.ref_lp))
            .map(|(o, f)| o.iter().zip(f).map(|(a, b)| algo::kl(*a, *b, kl_type).0).collect())
            .collect();
        let kl_ref = mean(kl_tok.iter().flatten().copied());
        (kl_tok, Some(kl_ref))
    };
    match cfg.algo.name {
        AlgoName::Grpo => {
            let a = algo::grpo_advantages(rewards, cfg.rollout.samples_per_prompt, cfg.algo.dr_grpo);
            let advantages = samples.iter().zip(&a).map(|(s, a)| vec![*a; s.response.len()]).collect();
            // The sequence reward after the KL penalty (verl's critic/rewards): the score for
            // GRPO, whose KL is in the loss.
            Ok(Advantages { advantages, returns: Vec::new(), kl_ref, penalized: rewards.to_vec() })
        }
        AlgoName::Ppo => {
            if scores.values.len() != samples.len() {
                return Err("values returned the wrong number of sequences".into());
            }
            Ok(gae(cfg, rewards, &kl_tok, &scores.values, kl_ref))
        }
    }
}

/// PPO: the KL in the token rewards, GAE over the critic's values.
fn gae(cfg: &Config, rewards: &[f64], kl_tok: &[Vec<f64>], values: &[Vec<f64>], kl_ref: Option<f64>) -> Advantages {
    let a = &cfg.algo;
    let mut out = Advantages { advantages: Vec::new(), returns: Vec::new(), kl_ref, penalized: Vec::new() };
    for ((reward, kl), values) in rewards.iter().zip(kl_tok).zip(values) {
        let tr = algo::ppo_token_rewards(*reward, kl, a.kl_coef);
        out.penalized.push(tr.iter().sum());
        let (adv, ret) = algo::gae(&tr, values, a.gamma, a.lambda);
        out.advantages.push(adv);
        out.returns.push(ret);
    }
    if a.whiten_advantages {
        algo::whiten(&mut out.advantages);
    }
    out
}

/// Beyond this log-ratio a token's importance ratio is reported as e^20, as verl bounds it: a
/// token the trainer finds near-impossible would otherwise overflow the ratio's statistics.
const LOG_RATIO_BOUND: f64 = 20.0;

/// Each token's importance ratio exp(old_lp - rollout_lp): the trainer's current (proximal)
/// policy over the behaviour policy that generated the token, under whatever weights the rollout
/// held then. A token without a rollout log-prob counts as on-policy (1).
fn is_ratios(sample: &Sample, old_lp: &[f64]) -> Vec<f64> {
    let ratio = |(t, old): (usize, &f64)| match sample.logprobs.get(t) {
        Some(behaviour) => (old - behaviour).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp(),
        None => 1.0,
    };
    old_lp.iter().enumerate().map(ratio).collect()
}

/// The off-policy correction's per-token weights for the trainer (truncated importance
/// sampling, min(ratio, algo.tis_cap)); none when the run has no correction.
pub(super) fn is_weights(cfg: &Config, samples: &[Sample], scores: &Scores) -> Vec<Vec<f64>> {
    if cfg.off_policy_correction() != OffPolicyCorrection::Tis {
        return Vec::new();
    }
    let cap = cfg.algo.tis_cap;
    let weights = samples.iter().zip(&scores.old_lp).map(|(s, old)| is_ratios(s, old));
    weights.map(|r| r.into_iter().map(|x| x.min(cap)).collect()).collect()
}

/// The modelled tokens per task token of a batch whose samples hold (tokens, mean weight version
/// that generated them): each sample's scale weighted by its tokens, which is what the trainer's
/// passes over them cost (linear in tokens). None: no growth (compute.token_scale_final = 0).
pub(super) fn batch_token_scale(cfg: &Config, samples: &[(usize, f64)]) -> Option<f64> {
    let tokens: usize = samples.iter().map(|(t, _)| t).sum();
    let mut weighted = 0.0;
    for (t, version) in samples {
        weighted += *t as f64 * cfg.token_scale_at(*version)?;
    }
    Some(weighted / tokens.max(1) as f64)
}

/// The trainer's request for a batch: every sample with its per-token numbers.
pub(super) fn train_params(
    cfg: &Config,
    samples: &[Sample],
    scores: &Scores,
    adv: &Advantages,
    step: u64,
    token_scale: Option<f64>,
) -> TrainParams {
    let mut weights = is_weights(cfg, samples, scores).into_iter();
    let samples = (0..samples.len())
        .map(|i| model::TrainSample {
            prompt: samples[i].prompt.clone(),
            response: samples[i].response.clone(),
            advantages: adv.advantages[i].clone(),
            old_logprobs: scores.old_lp[i].clone(),
            // The protocol wants one reference log-prob a token; without a reference pass the
            // KL term is weighted 0 (checks.rs), so the old log-probs hold the place, and the
            // row leaves out the trainer's KL, which then measures nothing asked for.
            ref_logprobs: scores.ref_lp.get(i).unwrap_or(&scores.old_lp[i]).clone(),
            returns: adv.returns.get(i).cloned().unwrap_or_default(),
            old_values: scores.values.get(i).cloned().unwrap_or_default(),
            is_weights: weights.next().unwrap_or_default(),
        })
        .collect();
    let a = &cfg.algo;
    TrainParams {
        samples,
        minibatches: a.minibatches,
        epochs: a.epochs,
        step,
        token_scale,
        replicas: None,
        modelled_tokens: None,
    }
}

/// The batch's rollout and training metrics: rewards, pass rates, lengths, log-probs, KL,
/// advantages and the trainer's own numbers.
pub(super) fn sample_metrics(row: &mut metrics::Row, cfg: &Config, task: &Addition, o: &Outcome) {
    let flat = |v: &[Vec<f64>]| mean(v.iter().flatten().copied());
    row.set("rollout/raw_reward", mean(o.scored.iter().map(|s| s.0)));
    row.set("rollout/kl_penalized_reward", mean(o.adv.penalized.iter().copied()));
    let passed: Vec<bool> = o.scored.iter().map(|s| s.1).collect();
    for (k, v) in metrics::pass_at_k(&passed, cfg.rollout.samples_per_prompt) {
        row.set(&format!("passrate/pass@{k}"), v);
    }
    let lengths: Vec<f64> = o.samples.iter().map(|s| s.response.len() as f64).collect();
    for (stat, v) in metrics::statistics(&lengths) {
        row.set(&format!("rollout/response_len/{stat}"), v);
    }
    let max_new = task.max_new_tokens();
    let truncated = o.samples.iter().map(|s| {
        let r = &s.response;
        f64::from(u8::from(r.len() >= max_new && r.last() != Some(&task::EOS)))
    });
    row.set("rollout/truncated_ratio", mean(truncated));
    // A pass the run skipped measured nothing: its metrics are left out, not written as zeros
    // (and with the rollout's log-probs as the old ones, the trainer-rollout gaps are 0 by
    // construction).
    let rollout_old = cfg.algo.rollout_log_probs;
    if !rollout_old {
        row.set("rollout/log_probs", flat(&o.scores.old_lp));
    }
    if !o.scores.ref_lp.is_empty() {
        row.set("rollout/ref_log_probs", flat(&o.scores.ref_lp));
    }
    row.set("rollout/rollout_log_probs", mean(o.samples.iter().flat_map(|s| s.logprobs.iter().copied())));
    if !o.scores.entropy.is_empty() {
        row.set("rollout/entropy", flat(&o.scores.entropy));
    }
    if let Some(kl) = o.adv.kl_ref {
        row.set("rollout/kl", kl);
    }
    row.set("rollout/advantages", flat(&o.adv.advantages));
    if !o.adv.returns.is_empty() {
        row.set("rollout/returns", flat(&o.adv.returns));
        row.set("rollout/values", flat(&o.scores.values));
    }
    let diffs = || {
        let pairs = o.samples.iter().zip(&o.scores.old_lp);
        pairs.flat_map(|(s, o)| s.logprobs.iter().zip(o).map(|(a, b)| (a - b).abs()))
    };
    if !rollout_old {
        row.set("train/train_rollout_logprob_abs_diff", mean(diffs()));
        row.set("rollout/logprob_abs_diff_max", diffs().fold(0.0, f64::max));
        correction_metrics(row, cfg, o.samples, o.scores);
    }
    row.set("train/lr-pg_0", cfg.algo.lr);
    for (k, v) in &o.train.0 {
        // Without a reference the trainer's KL is to the old log-probs standing in for it.
        if k == "kl" && o.scores.ref_lp.is_empty() {
            continue;
        }
        if let Some(x) = v {
            row.set(&metrics::train_metric(k), *x);
        }
    }
}

/// The gap between the rollout's log-probs and the trainer's, signed (verl's rollout_corr/kl,
/// rollout minus trainer), and with the correction on, its importance ratios before truncation:
/// mean (slime's train/tis), largest, smallest, mean |ratio - 1| (slime's tis_abs) and the share
/// of tokens the cap truncated (slime's tis_clipfrac).
fn correction_metrics(row: &mut metrics::Row, cfg: &Config, samples: &[Sample], scores: &Scores) {
    let pairs = samples.iter().zip(&scores.old_lp);
    let gap = pairs.clone().flat_map(|(s, old)| s.logprobs.iter().zip(old).map(|(r, o)| r - o));
    row.set("train/rollout_train_logprob_diff", mean(gap));
    if cfg.off_policy_correction() != OffPolicyCorrection::Tis {
        return;
    }
    let ratios: Vec<f64> = pairs.flat_map(|(s, old)| is_ratios(s, old)).collect();
    if ratios.is_empty() {
        return;
    }
    let cap = cfg.algo.tis_cap;
    row.set("train/tis", mean(ratios.iter().copied()));
    row.set("train/tis_max", ratios.iter().copied().fold(f64::MIN, f64::max));
    row.set("train/tis_min", ratios.iter().copied().fold(f64::MAX, f64::min));
    row.set("train/tis_abs", mean(ratios.iter().map(|r| (r - 1.0).abs())));
    row.set("train/tis_clipfrac", mean(ratios.iter().map(|r| f64::from(u8::from(*r > cap)))));
}

pub(super) fn loss_config(cfg: &Config) -> model::LossConfig {
    let a = &cfg.algo;
    let ppo = a.name == AlgoName::Ppo;
    model::LossConfig {
        clip: algo::Clip {
            eps_low: a.clip_eps_low,
            eps_high: a.clip_eps_high,
            dual: (a.dual_clip > 1.0).then_some(a.dual_clip),
        },
        // PPO puts the KL in the token reward; GRPO in the loss.
        kl_coef: if ppo { 0.0 } else { a.kl_coef },
        kl_kind: a.kl_type,
        entropy_coef: a.entropy_coef,
        aggregation: a.aggregation,
        value_coef: if ppo { a.value_coef } else { 0.0 },
        value_clip: a.value_clip,
        temperature: cfg.rollout.temperature,
    }
}

pub(super) fn adam(cfg: &Config) -> model::Adam {
    model::Adam { lr: cfg.algo.lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, max_grad_norm: cfg.algo.max_grad_norm }
}

/// What each worker of `role` starts with: its device, the model, its share of the memory profile,
/// the largest batch it will generate (rollouts), and the loss and optimizer (trainers).
pub(super) fn init_params(
    cfg: &Config,
    fleet: &Fleet,
    role: Role,
    api: crate::vendor::ApiKind,
    shape: model::Shape,
    profile: &Profile,
    max_batch: usize,
) -> Vec<InitParams> {
    let memory = if role == Role::Trainer { &profile.trainer.tags } else { &profile.rollout.tags };
    let group = if role == Role::Trainer { trainer_group(cfg, fleet, api) } else { None };
    let targets = fleet.indices(role);
    let params = |(rank, i): (usize, usize)| InitParams {
        api: api.as_str().into(),
        device: fleet.worker(i).device,
        shape,
        seed: cfg.run.seed,
        memory: memory.clone(),
        backup: cfg.memory.backup,
        max_batch,
        loss: Some(loss_config(cfg)),
        adam: Some(adam(cfg)),
        step: 0,
        compute: compute_model(cfg, fleet, profile),
        time_scale: cfg.compute.time_scale,
        trainer_group: group.as_ref().map(|(backend, init_method)| TrainerGroup {
            backend: backend.to_string(),
            init_method: init_method.clone(),
            rank: rank as u32,
            world: targets.len() as u32,
        }),
    };
    targets.iter().copied().enumerate().map(params).collect()
}

/// The trainers' data-parallel group, when there are several: the backend of `api` and a
/// rendezvous on a port free here, where rank 0 (the first trainer) runs. A remote Ray cluster
/// places rank 0 on a host the runner does not know, so its trainers stay replicas without one.
fn trainer_group(cfg: &Config, fleet: &Fleet, api: crate::vendor::ApiKind) -> Option<(&'static str, String)> {
    let remote_cluster = cfg.run.launcher == Launcher::Ray && cfg.run.ray_address.trim() != "local";
    if fleet.indices(Role::Trainer).len() < 2 || remote_cluster {
        return None;
    }
    // The port is free now; rank 0's store binds it moments later (the usual MASTER_PORT race).
    let port = std::net::TcpListener::bind(("127.0.0.1", 0)).and_then(|l| l.local_addr()).ok()?.port();
    let backend = crate::collective::Library::of(api).name();
    Some((backend, format!("tcp://127.0.0.1:{port}")))
}

/// The device time the workers model (compute.model), from the profile's parameters per device.
fn compute_model(cfg: &Config, fleet: &Fleet, profile: &Profile) -> Option<ComputeModel> {
    compute_model_of(cfg, fleet.indices(Role::Trainer).len(), profile)
}

/// The compute model of a run whose batch `trainers` replicas share (`relax-colocate plan` asks
/// it of a run it does not start).
///
/// With tensor parallelism (memory.tp) the runner still has one engine and one trainer per
/// device, each serving its own share of the sequences, where a real TP group's devices serve
/// tp times as many together, each computing 1/tp of every token and reading 1/tp of the weights
/// and of each token's KV. Per device that is the whole model's FLOPs and KV bytes per token of
/// its own share, and its shard of the weights per decode step: charged so, a device here costs
/// what a device of the TP group does.
pub(crate) fn compute_model_of(cfg: &Config, trainers: usize, profile: &Profile) -> Option<ComputeModel> {
    let c = &cfg.compute;
    let m = &cfg.memory;
    let whole = if m.tp > 1 { super::profile::build(&m.profile, 1, m.scale, m.kv_cache_gib).ok() } else { None };
    let whole = whole.as_ref().unwrap_or(profile);
    c.model.then(|| ComputeModel {
        forward_flops_per_token: 2.0 * whole.params_per_device as f64,
        tflops: c.tflops,
        train_mfu: c.train_mfu,
        rollout_mfu: c.rollout_mfu,
        token_scale: c.token_scale,
        trainers: trainers as f64,
        hbm_gbps: (c.hbm_gbps > 0.0).then_some(c.hbm_gbps),
        weight_bytes: 2.0 * profile.params_per_device as f64,
        kv_bytes_per_token: whole.kv_bytes_per_token as f64,
        decode_step_ms: c.decode_step_ms,
        kv_capacity_tokens: (c.kv_capacity && whole.kv_bytes_per_token > 0)
            .then(|| profile.kv_cache_bytes as f64 / whole.kv_bytes_per_token as f64),
    })
}

/// What the phase times measure, for the summary and the table.
pub(super) fn compute_label(cfg: &Config, profile: &Profile) -> String {
    let c = &cfg.compute;
    let external = !cfg.run.trainer_cmd.trim().is_empty() || !cfg.run.rollout_cmd.trim().is_empty();
    if !c.model && external {
        return "measured: the external workers' own time (no modelled device time)".into();
    }
    if !c.model {
        return "measured: the built-in policy on this machine's CPU (no modelled device time)".into();
    }
    let caveat = if external {
        "; external workers are asked to model it (init's `compute`: the built-in ones and \
         scripts/torch_worker.py do), one that ignores it is measured"
    } else {
        ""
    };
    let memory = decode_label(c);
    let switch = match super::switch::describe(cfg) {
        Some(s) => format!("; {s}"),
        None => String::new(),
    };
    let lengths = lengths_label(cfg);
    let clock = if c.time_scale != 1.0 {
        format!(
            "; on a clock {k}x the wall clock's (compute.time_scale): every time is modelled seconds, and what the \
             simulator really spends counts {k} times",
            k = c.time_scale
        )
    } else {
        String::new()
    };
    format!(
        "modelled: {} ({:.2}B parameters per device) on a {} TFLOPS device ({}) at MFU {} (train) and {} \
         (rollout){memory}, each task token standing for {}{lengths}; every request lasts at least \
         that{caveat}{switch}{clock}",
        cfg.memory.profile,
        profile.params_per_device as f64 / 1e9,
        c.tflops,
        c.device,
        c.train_mfu,
        c.rollout_mfu,
        c.token_scale
    )
}

/// What bounds a modelled decode step beyond its FLOPs, for the compute label.
fn decode_label(c: &crate::run::config::ComputeSection) -> String {
    let mut label = if c.hbm_gbps > 0.0 {
        format!(", decode steps no faster than their weight and KV reads at {} GB/s", c.hbm_gbps)
    } else {
        String::new()
    };
    if c.decode_step_ms > 0.0 {
        label += &format!(", each decode step {} ms more (launches, scheduler, sampling)", c.decode_step_ms);
    }
    label
}

/// Where the response lengths come from, for the compute label: empty without a lengths file.
fn lengths_label(cfg: &Config) -> String {
    let Some((l, steps)) = cfg.lengths_drawn() else { return String::new() };
    format!(
        "; response lengths drawn from {}{} ({} values, mean {:.0}, p90 {}, max {} tokens) in place of task tokens x \
         token_scale",
        cfg.compute.lengths,
        steps.as_ref().map(crate::run::summary::LengthsSteps::describe).unwrap_or_default(),
        l.count,
        l.mean,
        l.p90,
        l.max
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::config;

    /// A device of a TP-2 group charges the whole model's FLOPs and KV bytes per token of its
    /// own sequences, and reads its half of the weights each decode step.
    #[test]
    fn tensor_parallel_devices_charge_whole_tokens_and_read_their_shard_of_the_weights() {
        let model = |tp: &str| {
            let sets = ["compute.model=true", "memory.profile=qwen3-4b", tp].map(String::from);
            let cfg = config::load(None, &sets).unwrap();
            let m = &cfg.memory;
            let p = super::super::profile::build(&m.profile, m.tp, m.scale, m.kv_cache_gib).unwrap();
            compute_model_of(&cfg, 4, &p).unwrap()
        };
        let (one, two) = (model("memory.tp=1"), model("memory.tp=2"));
        assert_eq!(two.forward_flops_per_token, one.forward_flops_per_token);
        assert_eq!(two.kv_bytes_per_token, one.kv_bytes_per_token);
        assert_eq!(two.kv_capacity_tokens, one.kv_capacity_tokens);
        assert!(
            (0.45..0.55).contains(&(two.weight_bytes / one.weight_bytes)),
            "{}",
            two.weight_bytes / one.weight_bytes
        );
    }

    fn scores(old_lp: Vec<Vec<f64>>) -> Scores {
        Scores { old_lp, ref_lp: Vec::new(), entropy: Vec::new(), values: Vec::new() }
    }

    /// Each token's weight is its ratio exp(old - rollout) truncated at the cap, sent only with a
    /// correction; the row's ratios are the untruncated ones.
    #[test]
    fn weights_are_the_truncated_ratios_of_trainer_over_rollout() {
        let sets = ["run.mode=async", "run.devices=2", "algo.tis_cap=1.5"].map(String::from);
        let cfg = config::load(None, &sets).unwrap();
        let sample = Sample { prompt: vec![1], response: vec![2, 3, 4], logprobs: vec![-1.0, -2.0, -0.5] };
        let sc = scores(vec![vec![-1.0, -1.0, -1.5]]);
        let w = is_weights(&cfg, std::slice::from_ref(&sample), &sc);
        let e = std::f64::consts::E;
        assert_eq!(w.len(), 1);
        let want = [1.0, 1.5, 1.0 / e];
        assert!(w[0].iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12), "{w:?}");
        let mut row = metrics::Row::new(1);
        correction_metrics(&mut row, &cfg, std::slice::from_ref(&sample), &sc);
        assert!((row.get("train/tis_max").unwrap() - e).abs() < 1e-12);
        assert!((row.get("train/tis_clipfrac").unwrap() - 1.0 / 3.0).abs() < 1e-12);
        // Rollout minus trainer: 0, -1, +1.
        assert!(row.get("train/rollout_train_logprob_diff").unwrap().abs() < 1e-12);

        let colocated = config::load(None, &[]).unwrap();
        assert!(is_weights(&colocated, &[sample], &sc).is_empty(), "no correction colocated by default");
    }

    /// Two samples of one prompt with the same response and rollout log-probs; `SCORED` scores
    /// the first right and the second wrong.
    fn two_samples() -> Vec<Sample> {
        (0..2).map(|_| Sample { prompt: vec![1], response: vec![2, 3], logprobs: vec![-0.5, -1.5] }).collect()
    }

    /// (reward, exact) of `two_samples`.
    const SCORED: [(f64, bool); 2] = [(1.0, true), (0.0, false)];

    /// The metrics row of a step that trained on `samples`, scored as `SCORED`.
    fn sample_row(cfg: &Config, samples: &[Sample], sc: &Scores, adv: &Advantages, train: &TrainReply) -> metrics::Row {
        let task = Addition::new(cfg.task.digits, cfg.task.max_new_tokens);
        let o = Outcome { samples, scored: &SCORED, scores: sc, adv, train };
        let mut row = metrics::Row::new(1);
        sample_metrics(&mut row, cfg, &task, &o);
        row
    }

    /// Without a reference pass: no KL to report, PPO's token rewards carry none, the train
    /// request's reference log-probs hold the old ones' place (the KL term weighs 0), and the
    /// row leaves out what no pass measured.
    #[test]
    fn without_a_reference_the_kl_is_left_out_not_zero() {
        let sets = ["algo.name=ppo", "algo.reference=false", "algo.kl_coef=0", "algo.whiten_advantages=false"];
        let cfg = config::load(None, &sets.map(String::from)).unwrap();
        let samples = two_samples();
        let sc = Scores {
            old_lp: vec![vec![-0.4, -1.4]; 2],
            ref_lp: Vec::new(),
            entropy: vec![vec![0.7, 0.7]; 2],
            values: vec![vec![0.0, 0.0]; 2],
        };
        let adv = advantages(&cfg, &samples, &SCORED.map(|s| s.0), &sc).unwrap();
        assert_eq!(adv.kl_ref, None);
        assert_eq!(adv.penalized, vec![1.0, 0.0]);
        assert_eq!(adv.advantages[0].len(), 2, "every token has its advantage");
        let p = train_params(&cfg, &samples, &sc, &adv, 1, None);
        assert_eq!(p.samples[0].ref_logprobs, sc.old_lp[0]);
        let mut train = TrainReply::default();
        train.0.insert("kl".into(), Some(0.3));
        let row = sample_row(&cfg, &samples, &sc, &adv, &train);
        for gone in ["rollout/kl", "rollout/ref_log_probs", "train/kl_loss"] {
            assert!(row.get(gone).is_none(), "{gone}");
        }
        assert!(row.get("rollout/entropy").is_some() && row.get("rollout/log_probs").is_some());
    }

    /// With the rollout's log-probs as the old ones there is nothing to weight: no TIS weights,
    /// the PPO ratio is taken to the rollout's log-probs, and the trainer-rollout gaps (0 by
    /// construction) and the entropy (no actor pass) are left out.
    #[test]
    fn rollout_log_probs_are_the_old_ones_and_need_no_weights() {
        let sets = ["run.mode=async", "run.devices=2", "algo.rollout_log_probs=true", "rollout.samples_per_prompt=2"];
        let cfg = config::load(None, &sets.map(String::from)).unwrap();
        let samples = two_samples();
        let old: Vec<Vec<f64>> = samples.iter().map(|s| s.logprobs.clone()).collect();
        let sc = Scores { old_lp: old.clone(), ref_lp: old.clone(), entropy: Vec::new(), values: Vec::new() };
        assert!(is_weights(&cfg, &samples, &sc).is_empty());
        let adv = advantages(&cfg, &samples, &SCORED.map(|s| s.0), &sc).unwrap();
        let p = train_params(&cfg, &samples, &sc, &adv, 1, None);
        assert_eq!(p.samples[1].old_logprobs, vec![-0.5, -1.5]);
        assert!(p.samples[1].is_weights.is_empty());
        let row = sample_row(&cfg, &samples, &sc, &adv, &TrainReply::default());
        for gone in ["rollout/entropy", "rollout/log_probs", "train/rollout_train_logprob_diff", "train/tis"] {
            assert!(row.get(gone).is_none(), "{gone}");
        }
        assert!(row.get("rollout/rollout_log_probs").is_some() && row.get("rollout/kl").is_some());
    }
}
