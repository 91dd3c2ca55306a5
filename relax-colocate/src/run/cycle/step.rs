//! One step of the colocated cycle: prompts, generation, the trainer's wake-up and passes, the
//! advantages, training, and the hand-over of the new weights.

use super::Colocate;
use super::row::StepData;
use crate::run::config::AlgoName;
use crate::run::handover::{Handover, Phases, Sleep, Wake};
use crate::run::learn::{self, Advantages, Sample, Scores};
use crate::run::protocol::{
    Generate, GenerateParams, LogProbs, LogProbsParams, Model, Pair, SamplesParams, Train, TrainReply, Values,
};
use crate::run::task::{self, Rng};
use crate::run::{FailKind, R, Role};
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
        let adv = self.phase("advantages", |r| {
            learn::advantages(&r.cfg, &samples, &rewards, &scores).map_err(|e| r.fail(FailKind::Worker, None, e))
        })?;
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

    /// The modelled tokens per task token of this step's samples, which the weights of the
    /// previous step generate (compute.token_scale_final); None: init's.
    pub(super) fn token_scale(&self) -> Option<f64> {
        self.cfg.token_scale_at(self.step().saturating_sub(1) as f64)
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
                responses: Vec::new(),
                segment_tokens: None,
                prefix_cached: false,
                cached: Vec::new(),
                token_scale: self.token_scale(),
                segment_s: None,
                progress: Vec::new(),
                sequence_seeds: Vec::new(),
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
        let (rollouts, trainers) = (self.indices(Role::Rollout), self.indices(Role::Trainer));
        let expected = self.weights_checksum.clone().unwrap_or_default();
        let comms = std::mem::take(&mut self.comms_suspended);
        Handover {
            from: &rollouts,
            sleep: Sleep::default(),
            to: &trainers,
            wake: Wake::Whole { comms, load_state: !self.cfg.memory.backup },
            expect: Some((&expected, "after wake_up")),
            phases: Some(Phases { sleep: "rollout_offload", wake: "wake_up", cargo: None, finish: "" }),
        }
        .run(&mut self.fleet, &mut self.rec, |_, _| Ok(()))
        .map(drop)
    }

    /// The trainer's passes over the samples: reference and actor log-probs, and values for PPO.
    fn score(&mut self, samples: &[Sample]) -> R<Scores> {
        let pairs: Vec<Pair> =
            samples.iter().map(|s| Pair { prompt: s.prompt.clone(), response: s.response.clone() }).collect();
        let log_probs = |r: &mut Colocate, model: Model| {
            let p = LogProbsParams { model, samples: pairs.clone(), step: r.step(), token_scale: r.token_scale() };
            r.call_all::<LogProbs>(Role::Trainer, p).map(first)
        };
        let reference = self.phase("ref_log_probs", |r| log_probs(r, Model::Ref))?;
        let actor = self.phase("log_probs", |r| log_probs(r, Model::Actor))?;
        if reference.logprobs.len() != samples.len() || actor.logprobs.len() != samples.len() {
            return Err(self.fail(FailKind::Worker, None, "log_probs returned the wrong number of sequences"));
        }
        let values = if self.cfg.algo.name == AlgoName::Ppo {
            let p = SamplesParams { samples: pairs.clone(), step: self.step(), token_scale: self.token_scale() };
            self.phase("values", |r| r.call_all::<Values>(Role::Trainer, p).map(first))?.values
        } else {
            Vec::new()
        };
        Ok(Scores { old_lp: actor.logprobs, ref_lp: reference.logprobs, entropy: actor.entropy, values })
    }

    fn train(&mut self, samples: &[Sample], scores: &Scores, adv: &Advantages) -> R<TrainReply> {
        let p = learn::train_params(&self.cfg, samples, scores, adv, self.step(), self.token_scale());
        self.call_all::<Train>(Role::Trainer, p).map(first)
    }
}
/// The first worker's reply (the trainers are replicas).
fn first<T>(replies: Vec<T>) -> T {
    replies.into_iter().next().expect("every role has a worker")
}
