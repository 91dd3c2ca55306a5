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
    /// The responses of the run's first `groups` prompt groups.
    pub(super) fn sample(cfg: &Config, groups: usize) -> Responses {
        let task = Addition::new(cfg.task.digits, cfg.task.max_new_tokens);
        let max_new = task.max_new_tokens();
        let shape = Shape { vocab: task::VOCAB, context: task.prompt_len() + max_new - 1, hidden: cfg.model.hidden };
        let params = model::init(&shape, cfg.run.seed);
        let pol = Policy { shape, params: &params };
        let mut prompts = Rng::new(cfg.run.seed ^ 0xDA7A);
        let lim = task.operand_limit();
        let base = cfg.run.seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let n = cfg.rollout.samples_per_prompt;
        let groups = (0..groups as u64)
            .map(|started| {
                let prompt = task.prompt(prompts.below(lim), prompts.below(lim));
                (0..n)
                    .map(|j| {
                        let seed = Rng::new(base ^ (started << 20) ^ j as u64).next_u64();
                        response_len(&pol, &prompt, seed, cfg.rollout.temperature, max_new)
                    })
                    .collect()
            })
            .collect();
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

/// The tokens one sequence generates: EOS ends it, as does the task's limit.
fn response_len(pol: &Policy, prompt: &[u32], seed: u64, temperature: f64, max_new: usize) -> usize {
    let mut pre = pol.hidden_pre(prompt);
    for len in 1..=max_new {
        let logits = pol.head(&pre).logits;
        let (tok, _) = sample_token(&logits, temperature, &mut token_rng(seed, len - 1));
        if tok as u32 == task::EOS || len == max_new {
            return len;
        }
        for (a, w) in pre.iter_mut().zip(pol.embed_row(prompt.len() + len - 1, tok as u32)) {
            *a += *w as f64;
        }
    }
    max_new
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
