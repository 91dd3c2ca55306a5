//! One step of the colocated cycle: prompts, generation, the trainer's wake-up and passes, the
//! advantages, training, and the hand-over of the new weights.

use super::Colocate;
use super::row::StepData;
use crate::run::config::AlgoName;
use crate::run::metrics::mean;
use crate::run::protocol::{
    Generate, GenerateParams, LoadState, LogProbs, LogProbsParams, Model, Pair, SamplesParams, Step, Train,
    TrainParams, TrainReply, Values,
};
use crate::run::task::{self, Rng};
use crate::run::{FailKind, R, Role, algo, model};
use std::time::Instant;

impl Colocate {
    /// One step of the colocated cycle, phases in slime's order.
    pub(in crate::run) fn rl_step(&mut self, rng: &mut Rng) -> R<()> {
        self.rec.new_step();
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
                seed: self.cfg.run.seed.wrapping_mul(1_000_003) ^ (self.step() << 8) ^ k as u64,
                step: self.step(),
            })
            .collect();
        let replies = self.call_each::<Generate>(&rollouts, params)?;
        let mut all = Vec::new();
        for ((k, &i), reply) in rollouts.iter().enumerate().zip(replies) {
            let name = self.fleet.worker(i).name.clone();
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
        self.phase("rollout_offload", |r| r.control(Role::Rollout, true, None))?;
        self.phase("wake_up", |r| {
            r.control(Role::Trainer, false, None)?;
            if !r.cfg.memory.backup {
                r.call_all::<LoadState>(Role::Trainer, Step { step: r.step() })?;
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
        let log_probs = |r: &mut Colocate, model: Model| {
            let p = LogProbsParams { model, samples: pairs.clone(), step: r.step() };
            r.call_all::<LogProbs>(Role::Trainer, p).map(first)
        };
        let reference = self.phase("ref_log_probs", |r| log_probs(r, Model::Ref))?;
        let actor = self.phase("log_probs", |r| log_probs(r, Model::Actor))?;
        if reference.logprobs.len() != samples.len() || actor.logprobs.len() != samples.len() {
            return Err(self.fail(FailKind::Worker, None, "log_probs returned the wrong number of sequences"));
        }
        let values = if self.cfg.algo.name == AlgoName::Ppo {
            let p = SamplesParams { samples: pairs.clone(), step: self.step() };
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
        let p = TrainParams { samples, minibatches: a.minibatches, epochs: a.epochs, step: self.step() };
        self.call_all::<Train>(Role::Trainer, p).map(first)
    }
}
/// The first worker's reply (the trainers are replicas).
fn first<T>(replies: Vec<T>) -> T {
    replies.into_iter().next().expect("every role has a worker")
}

/// A rollout's sample: the prompt, the response and the rollout's log-probs of it.
pub(super) struct Sample {
    pub(super) prompt: Vec<u32>,
    pub(super) response: Vec<u32>,
    pub(super) logprobs: Vec<f64>,
}

/// The trainer's per-token numbers for each sample.
pub(super) struct Scores {
    pub(super) old_lp: Vec<Vec<f64>>,
    pub(super) ref_lp: Vec<Vec<f64>>,
    pub(super) entropy: Vec<Vec<f64>>,
    /// PPO only.
    pub(super) values: Vec<Vec<f64>>,
}

pub(super) struct Advantages {
    pub(super) advantages: Vec<Vec<f64>>,
    /// PPO only.
    pub(super) returns: Vec<Vec<f64>>,
    pub(super) kl_ref: f64,
    /// The sequence reward after the KL penalty.
    pub(super) penalized: Vec<f64>,
}
