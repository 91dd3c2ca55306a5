//! The response lengths a plan charges: what the built-in policy samples at its initial weights
//! on the run's prompts (the prompts drawn in the runner's order, each sequence from its own
//! stream, as async engines draw them). A job whose policy is held still (`algo.lr` near 0, as in
//! jobs/long-tail.toml) keeps that distribution for the whole run; one that learns changes it,
//! which a plan does not follow.

use crate::run::config::Config;
use crate::run::model::{self, Policy, Shape};
use crate::run::task::{self, Addition, Rng};
use crate::run::worker::{sample_token, token_rng};

/// Task tokens of every sample's response, by the group's place in the run's order of prompts.
pub(super) struct Responses {
    groups: Vec<Vec<usize>>,
}

impl Responses {
    /// The responses of the run's first `groups` prompt groups as async engines draw them: each
    /// sequence from its own stream (rollouter.rs, `send_generate`).
    pub(super) fn sample(cfg: &Config, groups: usize) -> Responses {
        let sampler = Sampler::new(cfg);
        let base = cfg.run.seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let n = cfg.rollout.samples_per_prompt;
        let groups = sampler
            .prompts(groups)
            .iter()
            .enumerate()
            .map(|(started, prompt)| {
                let seeds: Vec<u64> =
                    (0..n).map(|j| Rng::new(base ^ ((started as u64) << 20) ^ j as u64).next_u64()).collect();
                sampler.decode(&vec![prompt.clone(); n], Streams::Own(&seeds))
            })
            .collect();
        Responses { groups }
    }

    /// The responses of a colocated run of `steps` steps on `engines` engines: each engine's
    /// request draws its sequences' tokens from one stream, step by step in order (cycle/step.rs).
    pub(super) fn sample_colocated(cfg: &Config, steps: u64, engines: usize) -> Responses {
        let sampler = Sampler::new(cfg);
        let per_step = cfg.rollout.prompts_per_step;
        let shard = per_step / engines.max(1);
        let n = cfg.rollout.samples_per_prompt;
        let prompts = sampler.prompts(steps as usize * per_step);
        let mut groups = Vec::new();
        for step in 1..=steps {
            let first = (step as usize - 1) * per_step;
            for k in 0..engines {
                let mine = &prompts[first + k * shard..first + (k + 1) * shard];
                let seqs: Vec<Vec<u32>> = mine.iter().flat_map(|p| std::iter::repeat_n(p.clone(), n)).collect();
                let seed = cfg.run.seed.wrapping_mul(1_000_003) ^ (step << 8) ^ k as u64;
                let lengths = sampler.decode(&seqs, Streams::Shared(seed));
                groups.extend(lengths.chunks(n.max(1)).map(<[usize]>::to_vec));
            }
        }
        Responses { groups }
    }

    /// Task tokens of sample `j` of group `started`.
    pub(super) fn length(&self, started: u64, j: usize) -> usize {
        let g = &self.groups[started as usize % self.groups.len().max(1)];
        g[j % g.len().max(1)]
    }

    /// Mean, 90th percentile and longest response, in task tokens.
    pub(super) fn stats(&self) -> (f64, usize, usize) {
        let mut all: Vec<usize> = self.groups.iter().flatten().copied().collect();
        all.sort_unstable();
        let mean = all.iter().sum::<usize>() as f64 / all.len().max(1) as f64;
        let p90 = all.get((all.len() * 9 / 10).min(all.len().saturating_sub(1))).copied().unwrap_or(0);
        (mean, p90, all.last().copied().unwrap_or(0))
    }
}

/// Where a request's sequences draw their tokens from.
enum Streams<'a> {
    /// Each its own, keyed by position (a seed per sequence).
    Own(&'a [u64]),
    /// One for the whole request, in sequence order at every step.
    Shared(u64),
}

/// The built-in policy at its initial weights and the task, as the rollout engines decode them.
struct Sampler {
    task: Addition,
    shape: Shape,
    params: Vec<f32>,
    temperature: f64,
    seed: u64,
}

impl Sampler {
    fn new(cfg: &Config) -> Sampler {
        let task = Addition::new(cfg.task.digits, cfg.task.max_new_tokens);
        let context = task.prompt_len() + task.max_new_tokens() - 1;
        let shape = Shape { vocab: task::VOCAB, context, hidden: cfg.model.hidden };
        let params = model::init(&shape, cfg.run.seed);
        Sampler { task, shape, params, temperature: cfg.rollout.temperature, seed: cfg.run.seed }
    }

    /// The run's first `count` prompts, in the order every layout draws them.
    fn prompts(&self, count: usize) -> Vec<Vec<u32>> {
        let mut rng = Rng::new(self.seed ^ 0xDA7A);
        let lim = self.task.operand_limit();
        (0..count).map(|_| self.task.prompt(rng.below(lim), rng.below(lim))).collect()
    }

    /// The response length of each sequence (a prompt each) decoded together: EOS or the task's
    /// limit ends one.
    fn decode(&self, prompts: &[Vec<u32>], streams: Streams) -> Vec<usize> {
        let pol = Policy { shape: self.shape, params: &self.params };
        let max_new = self.task.max_new_tokens();
        let mut pre: Vec<Vec<f64>> = prompts.iter().map(|p| pol.hidden_pre(p)).collect();
        let mut len = vec![0usize; prompts.len()];
        let mut done = vec![false; prompts.len()];
        let mut shared = match streams {
            Streams::Shared(seed) => Some(Rng::new(seed)),
            Streams::Own(_) => None,
        };
        while done.iter().any(|d| !d) {
            for i in 0..prompts.len() {
                if done[i] {
                    continue;
                }
                let logits = pol.head(&pre[i]).logits;
                let (tok, _) = match (&mut shared, &streams) {
                    (Some(rng), _) => sample_token(&logits, self.temperature, rng),
                    (None, Streams::Own(seeds)) => {
                        sample_token(&logits, self.temperature, &mut token_rng(seeds[i], len[i]))
                    }
                    (None, Streams::Shared(_)) => unreachable!("a shared stream is made above"),
                };
                let pos = prompts[i].len() + len[i];
                len[i] += 1;
                done[i] = tok as u32 == task::EOS || len[i] == max_new;
                if !done[i] {
                    for (a, w) in pre[i].iter_mut().zip(pol.embed_row(pos, tok as u32)) {
                        *a += *w as f64;
                    }
                }
            }
        }
        len
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::config;

    /// jobs/long-tail.toml's policy: about 13 tokens on average (EOS 1 in 13), a few many times
    /// that, none past the limit; the same seed draws the same responses.
    #[test]
    fn the_initial_policy_rambles_with_a_long_tail_up_to_the_limit() {
        let cfg = config::load(None, &["task.max_new_tokens=96".into()]).unwrap();
        let r = Responses::sample(&cfg, 64);
        let (mean, p90, max) = r.stats();
        assert!((8.0..20.0).contains(&mean), "mean {mean}");
        assert!(p90 as f64 > 1.5 * mean && max as f64 > 3.0 * mean && max <= 96, "p90 {p90}, max {max}");
        assert_eq!(Responses::sample(&cfg, 64).groups, r.groups);
    }
}
