//! The colocated cycle in slime's order: setup, then per step generate, offload, wake-up, the
//! trainer's phases, sleep and the weights hand-over, with the checks and the step's metrics row.

use super::config::AlgoName;
use super::metrics::{self, mean};
use super::task::{self, Rng};
use super::{FailKind, R, Role, Runner, algo, model, report};
use serde_json::{Value, json};
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
        let replies = self.call_all(role, "checksum", json!({"step": self.step}))?;
        Ok(replies.iter().map(|r| r["weights"].as_str().unwrap_or("").to_string()).collect())
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
                r.call_all(Role::Trainer, "save_state", json!({"step": r.step}))?;
            }
            r.control(Role::Trainer, true, None).map(|_| ())
        })
    }

    fn update_weights(&mut self) -> R<()> {
        self.phase("update_weights", |r| {
            let p = json!({"shm": r.shm, "bucket_bytes": r.bucket_bytes, "step": r.step});
            let t = r.call_all(Role::Trainer, "update_begin", p.clone())?;
            r.call_all(Role::Rollout, "update_begin", p)?;
            let buckets = t[0]["buckets"].as_u64().unwrap_or(0);
            let trainers = r.indices(Role::Trainer);
            let rollouts = r.indices(Role::Rollout);
            // One shared bucket file per pair would let pairs run in parallel; pairs take turns
            // here, each bucket packed by the trainer and unpacked by its rollout.
            for (ti, ri) in trainers.into_iter().zip(rollouts) {
                for b in 0..buckets {
                    let q = json!({"bucket": b, "step": r.step});
                    r.call_each(&[ti], "pack", vec![q.clone()])?;
                    r.call_each(&[ri], "unpack", vec![q])?;
                }
            }
            r.call_all(Role::Trainer, "update_end", json!({"step": r.step}))?;
            r.call_all(Role::Rollout, "update_end", json!({"step": r.step}))?;
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
        let init = |r: &Runner, role: Role, mem: &[(String, Vec<u64>)]| -> Vec<Value> {
            r.indices(role)
                .iter()
                .map(|&i| {
                    json!({
                        "api": r.api, "device": r.workers[i].device, "shape": r.shape, "seed": r.cfg.run.seed,
                        "memory": mem, "backup": r.cfg.memory.backup, "max_batch": max_batch,
                        "loss": r.loss_config(), "adam": r.adam(), "step": 0,
                    })
                })
                .collect()
        };
        self.phase("init_rollout", |r| {
            let p = init(r, Role::Rollout, &rollout_mem);
            let targets = r.indices(Role::Rollout);
            r.call_each(&targets, "init", p)?;
            r.find_control_sockets(Role::Rollout)
        })?;
        if offload {
            self.phase("rollout_offload", |r| r.control(Role::Rollout, true, None).map(|_| ()))?;
        }
        self.phase("init_trainer", |r| {
            let p = init(r, Role::Trainer, &trainer_mem);
            let targets = r.indices(Role::Trainer);
            r.call_each(&targets, "init", p).map_err(|mut e| {
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

    fn find_control_sockets(&mut self, role: Role) -> R<()> {
        for i in self.indices(role) {
            if let Some(relay) = self.workers[i].control_relay.clone() {
                self.workers[i].control = Some(relay);
                continue;
            }
            let pid = self.workers[i].pid;
            let found = tms_proto::list_sockets(&self.ctl_dir).into_iter().find(|s| s.pid == pid);
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
                            self.ctl_dir.display()
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

    pub(super) fn rl_step(&mut self, rng: &mut Rng) -> R<()> {
        self.step_times.clear();
        let wall = Instant::now();
        let offload = self.cfg.run.offload;
        let cfg = self.cfg.clone();
        let n = cfg.rollout.samples_per_prompt;
        let prompts: Vec<Vec<u32>> = (0..cfg.rollout.prompts_per_step)
            .map(|_| {
                let lim = self.task.operand_limit();
                self.task.prompt(rng.below(lim), rng.below(lim))
            })
            .collect();
        // generate: each rollout takes a contiguous shard, so groups stay contiguous.
        let samples = self.phase("generate", |r| {
            let rollouts = r.indices(Role::Rollout);
            let shard = prompts.len() / rollouts.len();
            let params = rollouts
                .iter()
                .enumerate()
                .map(|(k, _)| {
                    json!({
                        "prompts": prompts[k * shard..(k + 1) * shard], "n": n,
                        "max_new_tokens": r.task.max_new_tokens(), "temperature": cfg.rollout.temperature,
                        "eos": task::EOS, "seed": cfg.run.seed.wrapping_mul(1_000_003) ^ (r.step << 8) ^ k as u64,
                        "step": r.step,
                    })
                })
                .collect();
            let replies = r.call_each(&rollouts, "generate", params)?;
            let mut all = Vec::new();
            for (k, rep) in replies.iter().enumerate() {
                let list = rep["samples"].as_array().cloned().unwrap_or_default();
                if list.len() != shard * n {
                    return Err(r.fail(
                        FailKind::Worker,
                        None,
                        format!("generate returned {} samples, expected {}", list.len(), shard * n),
                    ));
                }
                for s in list {
                    let pi = s["prompt_index"].as_u64().unwrap_or(u64::MAX) as usize;
                    let resp: Vec<u32> = serde_json::from_value(s["response"].clone()).unwrap_or_default();
                    let lps: Vec<f64> = serde_json::from_value(s["logprobs"].clone()).unwrap_or_default();
                    if pi >= shard || resp.is_empty() || lps.len() != resp.len() {
                        return Err(r.fail(FailKind::Worker, None, "generate returned a malformed sample"));
                    }
                    all.push((prompts[k * shard + pi].clone(), resp, lps));
                }
            }
            Ok(all)
        })?;
        let scored: Vec<(f64, bool)> =
            samples.iter().map(|(p, resp, _)| self.task.score(p, resp, cfg.task.reward)).collect();
        if offload {
            self.phase("rollout_offload", |r| r.control(Role::Rollout, true, None).map(|_| ()))?;
            self.phase("wake_up", |r| {
                r.control(Role::Trainer, false, None)?;
                if !r.cfg.memory.backup {
                    r.call_all(Role::Trainer, "load_state", json!({"step": r.step}))?;
                }
                Ok(())
            })?;
            let expected = self.weights_checksum.clone().unwrap_or_default();
            self.expect_checksum(Role::Trainer, &expected, "after wake_up")?;
        }
        let pairs: Vec<Value> = samples.iter().map(|(p, r, _)| json!({"prompt": p, "response": r})).collect();
        let ref_lp = self.phase("ref_log_probs", |r| {
            r.call_all(Role::Trainer, "log_probs", json!({"model": "ref", "samples": pairs, "step": r.step}))
        })?;
        let old = self.phase("log_probs", |r| {
            r.call_all(Role::Trainer, "log_probs", json!({"model": "actor", "samples": pairs, "step": r.step}))
        })?;
        let to_vecs =
            |v: &Value, key: &str| -> Vec<Vec<f64>> { serde_json::from_value(v[key].clone()).unwrap_or_default() };
        let ref_lp = to_vecs(&ref_lp[0], "logprobs");
        let old_lp = to_vecs(&old[0], "logprobs");
        let entropy = to_vecs(&old[0], "entropy");
        if ref_lp.len() != samples.len() || old_lp.len() != samples.len() {
            return Err(self.fail(FailKind::Worker, None, "log_probs returned the wrong number of sequences"));
        }
        let values = if cfg.algo.name == AlgoName::Ppo {
            let v = self
                .phase("values", |r| r.call_all(Role::Trainer, "values", json!({"samples": pairs, "step": r.step})))?;
            to_vecs(&v[0], "values")
        } else {
            Vec::new()
        };
        let rewards: Vec<f64> = scored.iter().map(|s| s.0).collect();
        let (advantages, returns, kl_ref, penalized) = self.phase("advantages", |r| {
            let kl_tok: Vec<Vec<f64>> = old_lp
                .iter()
                .zip(&ref_lp)
                .map(|(o, f)| o.iter().zip(f).map(|(a, b)| algo::kl(*a, *b, cfg.algo.kl_type).0).collect())
                .collect();
            let kl_mean = mean(kl_tok.iter().flatten().copied());
            // The sequence reward after the KL penalty (verl's critic/rewards): the score for GRPO,
            // whose KL is in the loss.
            let mut penalized = rewards.clone();
            let (adv, ret) = match cfg.algo.name {
                AlgoName::Grpo => {
                    let a = algo::grpo_advantages(&rewards, n, cfg.algo.dr_grpo);
                    (samples.iter().zip(&a).map(|((_, resp, _), a)| vec![*a; resp.len()]).collect(), Vec::new())
                }
                AlgoName::Ppo => {
                    if values.len() != samples.len() {
                        return Err(r.fail(FailKind::Worker, None, "values returned the wrong number of sequences"));
                    }
                    let mut advs = Vec::new();
                    let mut rets = Vec::new();
                    for i in 0..samples.len() {
                        let tr = algo::ppo_token_rewards(rewards[i], &kl_tok[i], cfg.algo.kl_coef);
                        penalized[i] = tr.iter().sum();
                        let (a, rt) = algo::gae(&tr, &values[i], cfg.algo.gamma, cfg.algo.lambda);
                        advs.push(a);
                        rets.push(rt);
                    }
                    if cfg.algo.whiten_advantages {
                        algo::whiten(&mut advs);
                    }
                    (advs, rets)
                }
            };
            Ok((adv, ret, kl_mean, penalized))
        })?;
        let train_samples: Vec<model::TrainSample> = (0..samples.len())
            .map(|i| model::TrainSample {
                prompt: samples[i].0.clone(),
                response: samples[i].1.clone(),
                advantages: advantages[i].clone(),
                old_logprobs: old_lp[i].clone(),
                ref_logprobs: ref_lp[i].clone(),
                returns: returns.get(i).cloned().unwrap_or_default(),
                old_values: values.get(i).cloned().unwrap_or_default(),
            })
            .collect();
        let train = self.phase("actor_train", |r| {
            r.call_all(
                Role::Trainer,
                "train",
                json!({"samples": train_samples, "minibatches": cfg.algo.minibatches, "epochs": cfg.algo.epochs, "step": r.step}),
            )
        })?;
        self.hand_weights_to_rollout("on the rollout after update_weights")?;

        self.write_metrics(&StepData {
            wall_s: wall.elapsed().as_secs_f64(),
            samples: &samples,
            scored: &scored,
            old_lp: &old_lp,
            ref_lp: &ref_lp,
            entropy: &entropy,
            advantages: &advantages,
            returns: &returns,
            values: &values,
            penalized: &penalized,
            kl_ref,
            train: &train[0],
        });
        self.steps_completed += 1;
        Ok(())
    }
}

/// What one step produced, for its metrics row.
struct StepData<'a> {
    wall_s: f64,
    /// (prompt, response, rollout log-probs) per sample.
    samples: &'a [(Vec<u32>, Vec<u32>, Vec<f64>)],
    /// (reward, exact) per sample.
    scored: &'a [(f64, bool)],
    old_lp: &'a [Vec<f64>],
    ref_lp: &'a [Vec<f64>],
    entropy: &'a [Vec<f64>],
    advantages: &'a [Vec<f64>],
    returns: &'a [Vec<f64>],
    values: &'a [Vec<f64>],
    penalized: &'a [f64],
    kl_ref: f64,
    train: &'a Value,
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
        row.set("rollout/kl_penalized_reward", mean(d.penalized.iter().copied()));
        let passed: Vec<bool> = d.scored.iter().map(|s| s.1).collect();
        for (k, v) in metrics::pass_at_k(&passed, self.cfg.rollout.samples_per_prompt) {
            row.set(&format!("passrate/pass@{k}"), v);
        }
        let lengths: Vec<f64> = d.samples.iter().map(|s| s.1.len() as f64).collect();
        for (stat, v) in metrics::statistics(&lengths) {
            row.set(&format!("rollout/response_len/{stat}"), v);
        }
        let max_new = self.task.max_new_tokens();
        let truncated =
            d.samples.iter().map(|s| f64::from(u8::from(s.1.len() >= max_new && s.1.last() != Some(&task::EOS))));
        row.set("rollout/truncated_ratio", mean(truncated));
        row.set("rollout/log_probs", flat(d.old_lp));
        row.set("rollout/ref_log_probs", flat(d.ref_lp));
        row.set("rollout/rollout_log_probs", mean(d.samples.iter().flat_map(|s| s.2.iter().copied())));
        row.set("rollout/entropy", flat(d.entropy));
        row.set("rollout/kl", d.kl_ref);
        row.set("rollout/advantages", flat(d.advantages));
        if !d.returns.is_empty() {
            row.set("rollout/returns", flat(d.returns));
            row.set("rollout/values", flat(d.values));
        }
        let diffs =
            || d.samples.iter().zip(d.old_lp).flat_map(|((_, _, r), o)| r.iter().zip(o).map(|(a, b)| (a - b).abs()));
        row.set("train/train_rollout_logprob_abs_diff", mean(diffs()));
        row.set("rollout/logprob_abs_diff_max", diffs().fold(0.0, f64::max));
        row.set("train/lr-pg_0", self.cfg.algo.lr);
        if let Some(obj) = d.train.as_object() {
            for (k, v) in obj {
                if let Some(x) = v.as_f64() {
                    row.set(&metrics::train_metric(k), x);
                }
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
