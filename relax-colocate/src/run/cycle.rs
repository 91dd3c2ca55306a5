//! The colocated cycle in slime's order: setup, then per step generate, offload, wake-up, the
//! trainer's phases, sleep and the weights hand-over, with the checks and the step's metrics row.

use super::config::AlgoName;
use super::metrics::{self, mean};
use super::protocol::{
    BucketParams, Checksum, Generate, GenerateParams, Init, InitParams, LoadState, LogProbs, LogProbsParams, Model,
    Pack, Pair, SamplesParams, SaveState, Step, Train, TrainParams, TrainReply, Unpack, UpdateBegin, UpdateBeginParams,
    UpdateBeginReply, UpdateEnd, Values,
};
use super::task::{self, Rng};
use super::{FailKind, R, Role, Runner, algo, model, report};
use std::io::Write as _;
use std::time::Instant;
use tms_proto::OpReport;

impl Runner {
    /// Pause or resume `tag` (None: all) in every worker of `role`, in parallel, through the
    /// control sockets; checks each report, and after a pause that free memory rose.
    fn control(&mut self, role: Role, pause: bool, tag: Option<&str>) -> R<Vec<OpReport>> {
        let targets = self.indices(role);
        let verb = if pause { "pause" } else { "resume" };
        let what = tag.map(|t| format!("tag {t:?}")).unwrap_or_else(|| "every tag".into());
        let owned = tag.map(String::from);
        let results = self.control_calls(&targets, &format!("{verb} {what}"), move |path, timeout| {
            let answer = if pause {
                tms_proto::pause(path, owned.as_deref(), timeout)
            } else {
                tms_proto::resume(path, owned.as_deref(), timeout)
            };
            // A worker that never allocated under the tag (an external worker without CUDA
            // graphs) has nothing to pause or resume: an empty report, as before tags were checked.
            match answer {
                Err(tms_proto::ClientError::Remote(e)) if e.code == tms_proto::ErrorCode::UnknownTag => {
                    Ok(OpReport { tag: owned.clone(), ..OpReport::default() })
                }
                other => other,
            }
        })?;
        let mut reports = Vec::new();
        for (&i, report) in targets.iter().zip(results) {
            let name = self.workers[i].name.clone();
            if let Some(err) = &report.error {
                let kind = if err.code == tms_proto::ErrorCode::OutOfMemory {
                    FailKind::OutOfMemory
                } else {
                    FailKind::Worker
                };
                let hint = if kind == FailKind::OutOfMemory && !pause {
                    " (something else holds the device memory this worker needs to wake up: look at the memory timeline)"
                } else {
                    ""
                };
                return Err(self.fail(
                    kind,
                    Some(&name),
                    format!(
                        "{verb} {what}: {err}; {} of {} bytes done{hint}",
                        report.bytes_done,
                        report.bytes_done + report.bytes_failed
                    ),
                ));
            }
            if pause && self.cfg.run.checks {
                let rose = report.device_free_after.saturating_sub(report.device_free_before);
                if rose < report.bytes_done {
                    return Err(self.fail(
                        FailKind::Check,
                        Some(&name),
                        format!(
                            "pause {what} reported {} paused but device free memory rose by only {}",
                            report::human(report.bytes_done),
                            report::human(rose)
                        ),
                    ));
                }
                self.checks_passed += 1;
            }
            reports.push(report);
        }
        Ok(reports)
    }

    fn checksums(&mut self, role: Role) -> R<Vec<String>> {
        let replies = self.call_all::<Checksum>(role, Step { step: self.step })?;
        Ok(replies.into_iter().map(|r| r.weights).collect())
    }

    /// Every worker of `role` must hold `expected`.
    fn expect_checksum(&mut self, role: Role, expected: &str, when: &str) -> R<()> {
        if !self.cfg.run.checks {
            return Ok(());
        }
        let got = self.checksums(role)?;
        for (i, c) in self.indices(role).into_iter().zip(got) {
            if c != expected {
                let name = self.workers[i].name.clone();
                return Err(self.fail(
                    FailKind::Check,
                    Some(&name),
                    format!("weights checksum {when} is {c}, expected {expected}: the weights were not preserved"),
                ));
            }
            self.checks_passed += 1;
        }
        Ok(())
    }

    fn trainer_checksum(&mut self) -> R<String> {
        let sums = self.checksums(Role::Trainer)?;
        if sums.windows(2).any(|w| w[0] != w[1]) {
            return Err(self.fail(
                FailKind::Check,
                None,
                format!("trainer replicas disagree on their weights: {sums:?}"),
            ));
        }
        Ok(sums[0].clone())
    }

    fn sleep_trainer(&mut self) -> R<()> {
        self.phase("sleep", |r| {
            if !r.cfg.memory.backup {
                r.call_all::<SaveState>(Role::Trainer, Step { step: r.step })?;
            }
            r.control(Role::Trainer, true, None).map(|_| ())
        })
    }

    fn update_weights(&mut self) -> R<()> {
        self.phase("update_weights", |r| {
            let p = UpdateBeginParams { shm: r.scratch.shm.clone(), bucket_bytes: r.bucket_bytes, step: r.step };
            let t = r.call_all::<UpdateBegin>(Role::Trainer, p.clone())?;
            r.call_all::<UpdateBegin>(Role::Rollout, p)?;
            let buckets = r.bucket_count(&t)?;
            let trainers = r.indices(Role::Trainer);
            let rollouts = r.indices(Role::Rollout);
            // One shared bucket file per pair would let pairs run in parallel; pairs take turns
            // here, each bucket packed by the trainer and unpacked by its rollout.
            for (ti, ri) in trainers.into_iter().zip(rollouts) {
                for b in 0..buckets {
                    let q = BucketParams { bucket: b, step: r.step };
                    r.call_each::<Pack>(&[ti], vec![q])?;
                    r.call_each::<Unpack>(&[ri], vec![q])?;
                }
            }
            r.call_all::<UpdateEnd>(Role::Trainer, Step { step: r.step })?;
            r.call_all::<UpdateEnd>(Role::Rollout, Step { step: r.step })?;
            Ok(())
        })
    }

    /// Rollout and trainer start, the trainer's initial weights reach the rollout: slime's
    /// colocated startup.
    pub(super) fn setup(&mut self) -> R<()> {
        let offload = self.cfg.run.offload;
        let per_device = self.cfg.rollout.prompts_per_step / self.cfg.total_devices();
        let max_batch = per_device * self.cfg.rollout.samples_per_prompt;
        let rollout_mem = self.profile.rollout.tags.clone();
        let trainer_mem = self.profile.trainer.tags.clone();
        let init = |r: &Runner, role: Role, mem: &[(String, Vec<u64>)]| -> Vec<InitParams> {
            r.indices(role)
                .iter()
                .map(|&i| InitParams {
                    api: r.api.into(),
                    device: r.workers[i].device,
                    shape: r.shape,
                    seed: r.cfg.run.seed,
                    memory: mem.to_vec(),
                    backup: r.cfg.memory.backup,
                    max_batch,
                    loss: Some(r.loss_config()),
                    adam: Some(r.adam()),
                    step: 0,
                })
                .collect()
        };
        self.phase("init_rollout", |r| {
            let p = init(r, Role::Rollout, &rollout_mem);
            let targets = r.indices(Role::Rollout);
            r.call_each::<Init>(&targets, p)?;
            r.find_control_sockets(Role::Rollout)
        })?;
        if offload {
            self.phase("rollout_offload", |r| r.control(Role::Rollout, true, None).map(|_| ()))?;
        }
        self.phase("init_trainer", |r| {
            let p = init(r, Role::Trainer, &trainer_mem);
            let targets = r.indices(Role::Trainer);
            r.call_each::<Init>(&targets, p).map_err(|mut e| {
                if e.kind == FailKind::OutOfMemory && !r.cfg.run.offload {
                    e.cause += "; the trainer and the rollout do not fit on the device together: \
                                run with offload (run.offload = true) so the rollout sleeps first";
                }
                e
            })?;
            r.find_control_sockets(Role::Trainer)
        })?;
        self.hand_weights_to_rollout("on the rollout after the initial update_weights")
    }

    /// The second half of every step (and of setup): record the trainer's weights, put it to
    /// sleep, wake the rollout's weights, push the trainer's into them and check they arrived,
    /// then wake the KV cache last so the peak stays low.
    fn hand_weights_to_rollout(&mut self, when: &str) -> R<()> {
        let offload = self.cfg.run.offload;
        let sum = self.trainer_checksum()?;
        self.weights_checksum = Some(sum.clone());
        if offload {
            self.sleep_trainer()?;
            self.phase("onload_weights", |r| r.control(Role::Rollout, false, Some("weights")).map(|_| ()))?;
        }
        self.update_weights()?;
        self.expect_checksum(Role::Rollout, &sum, when)?;
        if offload {
            self.phase("onload_kv", |r| {
                r.control(Role::Rollout, false, Some("kv_cache"))?;
                r.control(Role::Rollout, false, Some("cuda_graph")).map(|_| ())
            })?;
        }
        Ok(())
    }

    /// How many buckets the weights stream has, as the first trainer says.
    fn bucket_count(&self, trainers: &[UpdateBeginReply]) -> R<u64> {
        trainers[0].buckets.ok_or_else(|| {
            let name = self.workers[self.indices(Role::Trainer)[0]].name.clone();
            self.fail(FailKind::Worker, Some(&name), "malformed update_begin reply: missing field `buckets`")
        })
    }

    fn find_control_sockets(&mut self, role: Role) -> R<()> {
        for i in self.indices(role) {
            if let Some(relay) = self.workers[i].control_relay.clone() {
                self.workers[i].control = Some(relay);
                continue;
            }
            let pid = self.workers[i].pid;
            let found = tms_proto::list_sockets(&self.scratch.ctl_dir).into_iter().find(|s| s.pid == pid);
            match found {
                Some(s) => self.workers[i].control = Some(s.path),
                None => {
                    let name = self.workers[i].name.clone();
                    return Err(self.fail(
                        FailKind::Setup,
                        Some(&name),
                        format!(
                            "no tms control socket for pid {pid} in {} after init: is libtms_hook.so preloaded in the \
                             worker and did it allocate inside a region?",
                            self.scratch.ctl_dir.display()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn loss_config(&self) -> model::LossConfig {
        let a = &self.cfg.algo;
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
            temperature: self.cfg.rollout.temperature,
        }
    }

    fn adam(&self) -> model::Adam {
        model::Adam {
            lr: self.cfg.algo.lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            max_grad_norm: self.cfg.algo.max_grad_norm,
        }
    }

    /// One step of the colocated cycle, phases in slime's order.
    pub(super) fn rl_step(&mut self, rng: &mut Rng) -> R<()> {
        self.step_times.clear();
        let wall = Instant::now();
        let prompts = self.prompts(rng);
        let samples = self.phase("generate", |r| r.generate(&prompts))?;
        let reward = self.cfg.task.reward;
        let scored: Vec<(f64, bool)> =
            samples.iter().map(|s| self.task.score(&s.prompt, &s.response, reward)).collect();
        if self.cfg.run.offload {
            self.wake_trainer()?;
        }
        let scores = self.score(&samples)?;
        let rewards: Vec<f64> = scored.iter().map(|s| s.0).collect();
        let adv = self.phase("advantages", |r| r.advantages(&samples, &rewards, &scores))?;
        let train = self.phase("actor_train", |r| r.train(&samples, &scores, &adv))?;
        self.hand_weights_to_rollout("on the rollout after update_weights")?;
        let wall_s = wall.elapsed().as_secs_f64();
        self.write_metrics(&StepData { wall_s, samples: &samples, scored: &scored, scores: &scores, adv: &adv, train });
        self.steps_completed += 1;
        Ok(())
    }

    fn prompts(&self, rng: &mut Rng) -> Vec<Vec<u32>> {
        let lim = self.task.operand_limit();
        (0..self.cfg.rollout.prompts_per_step).map(|_| self.task.prompt(rng.below(lim), rng.below(lim))).collect()
    }

    /// Each rollout takes a contiguous shard of the prompts, so groups stay contiguous.
    fn generate(&mut self, prompts: &[Vec<u32>]) -> R<Vec<Sample>> {
        let rollouts = self.indices(Role::Rollout);
        let shard = prompts.len() / rollouts.len();
        let n = self.cfg.rollout.samples_per_prompt;
        let params = (0..rollouts.len())
            .map(|k| GenerateParams {
                prompts: prompts[k * shard..(k + 1) * shard].to_vec(),
                n,
                max_new_tokens: self.task.max_new_tokens(),
                temperature: self.cfg.rollout.temperature,
                eos: Some(task::EOS),
                seed: self.cfg.run.seed.wrapping_mul(1_000_003) ^ (self.step << 8) ^ k as u64,
                step: self.step,
            })
            .collect();
        let replies = self.call_each::<Generate>(&rollouts, params)?;
        let mut all = Vec::new();
        for ((k, &i), reply) in rollouts.iter().enumerate().zip(replies) {
            let name = self.workers[i].name.clone();
            if reply.samples.len() != shard * n {
                let cause = format!("generate returned {} samples, expected {}", reply.samples.len(), shard * n);
                return Err(self.fail(FailKind::Worker, Some(&name), cause));
            }
            for s in reply.samples {
                if s.prompt_index >= shard || s.response.is_empty() || s.logprobs.len() != s.response.len() {
                    return Err(self.fail(FailKind::Worker, Some(&name), "generate returned a malformed sample"));
                }
                let prompt = prompts[k * shard + s.prompt_index].clone();
                all.push(Sample { prompt, response: s.response, logprobs: s.logprobs });
            }
        }
        Ok(all)
    }

    /// The rollout sleeps, the trainer wakes up with the weights it went to sleep with.
    fn wake_trainer(&mut self) -> R<()> {
        self.phase("rollout_offload", |r| r.control(Role::Rollout, true, None).map(|_| ()))?;
        self.phase("wake_up", |r| {
            r.control(Role::Trainer, false, None)?;
            if !r.cfg.memory.backup {
                r.call_all::<LoadState>(Role::Trainer, Step { step: r.step })?;
            }
            Ok(())
        })?;
        let expected = self.weights_checksum.clone().unwrap_or_default();
        self.expect_checksum(Role::Trainer, &expected, "after wake_up")
    }

    /// The trainer's passes over the samples: reference and actor log-probs, and values for PPO.
    fn score(&mut self, samples: &[Sample]) -> R<Scores> {
        let pairs: Vec<Pair> =
            samples.iter().map(|s| Pair { prompt: s.prompt.clone(), response: s.response.clone() }).collect();
        let log_probs = |r: &mut Runner, model: Model| {
            let p = LogProbsParams { model, samples: pairs.clone(), step: r.step };
            r.call_all::<LogProbs>(Role::Trainer, p).map(first)
        };
        let reference = self.phase("ref_log_probs", |r| log_probs(r, Model::Ref))?;
        let actor = self.phase("log_probs", |r| log_probs(r, Model::Actor))?;
        if reference.logprobs.len() != samples.len() || actor.logprobs.len() != samples.len() {
            return Err(self.fail(FailKind::Worker, None, "log_probs returned the wrong number of sequences"));
        }
        let values = if self.cfg.algo.name == AlgoName::Ppo {
            let p = SamplesParams { samples: pairs.clone(), step: self.step };
            self.phase("values", |r| r.call_all::<Values>(Role::Trainer, p).map(first))?.values
        } else {
            Vec::new()
        };
        Ok(Scores { old_lp: actor.logprobs, ref_lp: reference.logprobs, entropy: actor.entropy, values })
    }

    /// Advantages (and PPO's returns) in the runner, with the KL to the reference.
    fn advantages(&self, samples: &[Sample], rewards: &[f64], scores: &Scores) -> R<Advantages> {
        let kl_type = self.cfg.algo.kl_type;
        let kl_tok: Vec<Vec<f64>> = (scores.old_lp.iter().zip(&scores.ref_lp))
            .map(|(o, f)| o.iter().zip(f).map(|(a, b)| algo::kl(*a, *b, kl_type).0).collect())
            .collect();
        let kl_ref = mean(kl_tok.iter().flatten().copied());
        match self.cfg.algo.name {
            AlgoName::Grpo => {
                let a = algo::grpo_advantages(rewards, self.cfg.rollout.samples_per_prompt, self.cfg.algo.dr_grpo);
                let advantages = samples.iter().zip(&a).map(|(s, a)| vec![*a; s.response.len()]).collect();
                // The sequence reward after the KL penalty (verl's critic/rewards): the score for
                // GRPO, whose KL is in the loss.
                Ok(Advantages { advantages, returns: Vec::new(), kl_ref, penalized: rewards.to_vec() })
            }
            AlgoName::Ppo => {
                if scores.values.len() != samples.len() {
                    return Err(self.fail(FailKind::Worker, None, "values returned the wrong number of sequences"));
                }
                Ok(self.gae(rewards, &kl_tok, &scores.values, kl_ref))
            }
        }
    }

    /// PPO: the KL in the token rewards, GAE over the critic's values.
    fn gae(&self, rewards: &[f64], kl_tok: &[Vec<f64>], values: &[Vec<f64>], kl_ref: f64) -> Advantages {
        let a = &self.cfg.algo;
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

    fn train(&mut self, samples: &[Sample], scores: &Scores, adv: &Advantages) -> R<TrainReply> {
        let samples = (0..samples.len())
            .map(|i| model::TrainSample {
                prompt: samples[i].prompt.clone(),
                response: samples[i].response.clone(),
                advantages: adv.advantages[i].clone(),
                old_logprobs: scores.old_lp[i].clone(),
                ref_logprobs: scores.ref_lp[i].clone(),
                returns: adv.returns.get(i).cloned().unwrap_or_default(),
                old_values: scores.values.get(i).cloned().unwrap_or_default(),
            })
            .collect();
        let a = &self.cfg.algo;
        let p = TrainParams { samples, minibatches: a.minibatches, epochs: a.epochs, step: self.step };
        self.call_all::<Train>(Role::Trainer, p).map(first)
    }
}

/// The first worker's reply (the trainers are replicas).
fn first<T>(replies: Vec<T>) -> T {
    replies.into_iter().next().expect("every role has a worker")
}

/// A rollout's sample: the prompt, the response and the rollout's log-probs of it.
struct Sample {
    prompt: Vec<u32>,
    response: Vec<u32>,
    logprobs: Vec<f64>,
}

/// The trainer's per-token numbers for each sample.
struct Scores {
    old_lp: Vec<Vec<f64>>,
    ref_lp: Vec<Vec<f64>>,
    entropy: Vec<Vec<f64>>,
    /// PPO only.
    values: Vec<Vec<f64>>,
}

struct Advantages {
    advantages: Vec<Vec<f64>>,
    /// PPO only.
    returns: Vec<Vec<f64>>,
    kl_ref: f64,
    /// The sequence reward after the KL penalty.
    penalized: Vec<f64>,
}

/// What one step produced, for its metrics row.
struct StepData<'a> {
    wall_s: f64,
    samples: &'a [Sample],
    /// (reward, exact) per sample.
    scored: &'a [(f64, bool)],
    scores: &'a Scores,
    adv: &'a Advantages,
    train: TrainReply,
}

impl Runner {
    /// The step's row under slime's names (metrics.rs renames it for verl), written to
    /// metrics.jsonl, the loggers and the progress line.
    fn write_metrics(&mut self, d: &StepData) {
        let mut row = metrics::Row::new(self.step);
        let t = |k: &str| self.step_times.get(k).copied().unwrap_or(0.0);
        let train_time = t("ref_log_probs") + t("log_probs") + t("values") + t("advantages") + t("actor_train");
        let step_time: f64 = self.step_times.values().sum();
        for (k, v) in &self.step_times {
            row.set(&metrics::phase_time(k), *v);
        }
        // slime: step = train_wait + train, and the share of it spent waiting.
        row.set("perf/train_time", train_time);
        row.set("perf/train_wait_time", step_time - train_time);
        row.set("perf/step_time", step_time);
        if step_time > 0.0 {
            row.set("perf/wait_time_ratio", (step_time - train_time) / step_time);
        }
        row.set("perf/wall_step_time", d.wall_s);

        let flat = |v: &[Vec<f64>]| mean(v.iter().flatten().copied());
        row.set("rollout/raw_reward", mean(d.scored.iter().map(|s| s.0)));
        row.set("rollout/kl_penalized_reward", mean(d.adv.penalized.iter().copied()));
        let passed: Vec<bool> = d.scored.iter().map(|s| s.1).collect();
        for (k, v) in metrics::pass_at_k(&passed, self.cfg.rollout.samples_per_prompt) {
            row.set(&format!("passrate/pass@{k}"), v);
        }
        let lengths: Vec<f64> = d.samples.iter().map(|s| s.response.len() as f64).collect();
        for (stat, v) in metrics::statistics(&lengths) {
            row.set(&format!("rollout/response_len/{stat}"), v);
        }
        let max_new = self.task.max_new_tokens();
        let truncated = d.samples.iter().map(|s| {
            let r = &s.response;
            f64::from(u8::from(r.len() >= max_new && r.last() != Some(&task::EOS)))
        });
        row.set("rollout/truncated_ratio", mean(truncated));
        row.set("rollout/log_probs", flat(&d.scores.old_lp));
        row.set("rollout/ref_log_probs", flat(&d.scores.ref_lp));
        row.set("rollout/rollout_log_probs", mean(d.samples.iter().flat_map(|s| s.logprobs.iter().copied())));
        row.set("rollout/entropy", flat(&d.scores.entropy));
        row.set("rollout/kl", d.adv.kl_ref);
        row.set("rollout/advantages", flat(&d.adv.advantages));
        if !d.adv.returns.is_empty() {
            row.set("rollout/returns", flat(&d.adv.returns));
            row.set("rollout/values", flat(&d.scores.values));
        }
        let diffs = || {
            let pairs = d.samples.iter().zip(&d.scores.old_lp);
            pairs.flat_map(|(s, o)| s.logprobs.iter().zip(o).map(|(a, b)| (a - b).abs()))
        };
        row.set("train/train_rollout_logprob_abs_diff", mean(diffs()));
        row.set("rollout/logprob_abs_diff_max", diffs().fold(0.0, f64::max));
        row.set("train/lr-pg_0", self.cfg.algo.lr);
        for (k, v) in &d.train.0 {
            if let Some(x) = v {
                row.set(&metrics::train_metric(k), *x);
            }
        }
        for s in self.step_memory.iter().filter(|s| s.step == self.step) {
            metrics::add_memory(&mut row, s);
        }
        let rendered = row.render(self.cfg.metrics.style);
        let _ = writeln!(self.metrics_file, "{}", metrics::json_line(&rendered));
        let _ = self.metrics_file.flush();
        self.loggers.log(&rendered);
        self.progress.step(self.step, self.cfg.run.steps, &row);
    }
}
