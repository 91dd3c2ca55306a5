//! One step of the colocated cycle: prompts, generation, the trainer's wake-up and passes, the
//! advantages, training, and the hand-over of the new weights.

use super::Colocate;
use crate::run::clock::Instant;
use crate::run::config::DrawnTokens;
use crate::run::handover::{Handover, Phases, Sleep, Wake};
use crate::run::job::Job;
use crate::run::learn::Sample;
use crate::run::protocol::{Generate, GenerateParams};
use crate::run::task::{self, Rng};
use crate::run::{FailKind, R, Role};

impl Colocate {
    /// One step of the colocated cycle, phases in slime's order.
    pub(in crate::run) fn rl_step(&mut self, rng: &mut Rng) -> R<()> {
        self.rig.rec.new_step();
        let wall = Instant::now();
        let prompts = self.prompts(rng);
        let (samples, drawn) = self.phase("generate", |r| r.generate(&prompts))?;
        if self.rig.cfg.run.offload {
            self.wake_trainer()?;
        }
        let trainers = self.indices(Role::Trainer);
        let job = Job::new(&self.rig.cfg, samples, self.token_scale()).with_drawn(drawn);
        let trained =
            job.run_to_end(&self.rig.cfg, &self.rig.task, &mut self.rig.fleet, &mut self.rig.rec, &trainers)?;
        self.hand_weights_to_rollout("on the rollout after update_weights")?;
        super::row::write_metrics(&mut self.rig, &trained, wall.elapsed().as_secs_f64());
        Ok(())
    }

    fn prompts(&self, rng: &mut Rng) -> Vec<Vec<u32>> {
        let lim = self.rig.task.operand_limit();
        (0..self.rig.cfg.rollout.prompts_per_step)
            .map(|_| self.rig.task.prompt(rng.below(lim), rng.below(lim)))
            .collect()
    }

    /// The modelled tokens per task token of this step's samples, which the weights of the
    /// previous step generate (compute.token_scale_final); None: init's.
    pub(super) fn token_scale(&self) -> Option<f64> {
        self.rig.cfg.token_scale_at(self.step().saturating_sub(1) as f64)
    }

    /// Each rollout takes a contiguous shard of the prompts, so groups stay contiguous. Returns
    /// the samples and, with compute.lengths, their modelled and drawn response tokens.
    fn generate(&mut self, prompts: &[Vec<u32>]) -> R<(Vec<Sample>, Option<DrawnTokens>)> {
        let rollouts = self.indices(Role::Rollout);
        let shard = prompts.len() / rollouts.len();
        let n = self.rig.cfg.rollout.samples_per_prompt;
        // Step s draws the run's batch s - 1: its prompts' places in the run's order of prompts.
        let first = self.step().saturating_sub(1) * prompts.len() as u64;
        let place = |k: usize, i: usize| first + (k * shard + i) as u64;
        let cfg = &self.rig.cfg;
        let drawn = |k: usize| -> Vec<f64> {
            let each = (0..shard).flat_map(|i| (0..n).map(move |j| (i, j)));
            each.filter_map(|(i, j)| cfg.drawn_length(place(k, i), j as u64)).collect()
        };
        let params = (0..rollouts.len())
            .map(|k| GenerateParams {
                prompts: prompts[k * shard..(k + 1) * shard].to_vec(),
                n,
                max_new_tokens: self.rig.task.max_new_tokens(),
                temperature: self.rig.cfg.rollout.temperature,
                eos: Some(task::EOS),
                seed: self.rig.cfg.run.seed.wrapping_mul(1_000_003) ^ (self.step() << 8) ^ k as u64,
                step: self.step(),
                responses: Vec::new(),
                segment_tokens: None,
                prefix_cached: false,
                cached: Vec::new(),
                token_scale: self.token_scale(),
                segment_s: None,
                progress: Vec::new(),
                sequence_seeds: Vec::new(),
                lengths: drawn(k),
            })
            .collect();
        let replies = self.call_each::<Generate>(&rollouts, params)?;
        let mut all = Vec::new();
        let mut identities = Vec::new();
        for ((k, &i), reply) in rollouts.iter().enumerate().zip(replies) {
            let name = self.rig.fleet.worker(i).name.clone();
            let tokens = reply.samples.iter().map(|s| s.response.len() as u64).sum();
            self.rig.rec.record_decode("rollout", &name, tokens, reply.decode.as_ref());
            if reply.samples.len() != shard * n {
                let cause = format!("generate returned {} samples, expected {}", reply.samples.len(), shard * n);
                return Err(self.fail(FailKind::Worker, Some(&name), cause));
            }
            let mut in_group = vec![0u64; shard];
            for s in reply.samples {
                if s.prompt_index >= shard || s.response.is_empty() || s.logprobs.len() != s.response.len() {
                    return Err(self.fail(FailKind::Worker, Some(&name), "generate returned a malformed sample"));
                }
                let prompt = prompts[k * shard + s.prompt_index].clone();
                identities.push((prompt.len(), place(k, s.prompt_index), in_group[s.prompt_index]));
                in_group[s.prompt_index] += 1;
                all.push(Sample { prompt, response: s.response, logprobs: s.logprobs });
            }
        }
        Ok((all, self.rig.cfg.drawn_tokens(identities)))
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
            wake: Wake::Whole { comms, load_state: !self.rig.cfg.memory.backup },
            expect: Some((&expected, "after wake_up")),
            phases: Some(Phases { sleep: "rollout_offload", wake: "wake_up", cargo: None, finish: "" }),
            model: self.rig.switch.as_deref(),
        }
        .run(&mut self.rig.fleet, &mut self.rig.rec, |_, _| Ok(()))
        .map(drop)
    }
}
