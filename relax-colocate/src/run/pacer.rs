//! A generate request's decoding in modelled decode steps (the built-in rollout's side of
//! `async.segment_s`, docs/async.md "Segments in modelled time"). Each task token stands for
//! `scale` modelled steps (compute.token_scale), and a sequence may have done part of them in an
//! earlier segment, possibly on another engine: it carries those steps as its `progress`. The
//! batch decodes together, so every live sequence advances by the same steps; a token is sampled
//! when a sequence's steps reach `scale`. A budget in modelled seconds ends the request part-way
//! through a token, the steps paid for kept in each sequence's progress: a token costs its steps
//! once, however many segments it spans.

use super::compute::FIGURES;

/// The modelled decode of one request: steps per task token, the budget, what was charged.
pub(crate) struct Pacer {
    /// Modelled decode steps per task token (1 without a compute model).
    scale: f64,
    /// Modelled seconds of decoding the request may take; None: no bound.
    budget: Option<f64>,
    /// Modelled seconds of decoding charged so far.
    pub(crate) spent: f64,
    /// Modelled decode steps the last `advance` ran (what occupancy is weighed by).
    pub(crate) last_steps: f64,
    /// Steps this close to a whole token, as a share of `scale`, complete it (the compute model's
    /// token_tolerance).
    tolerance: f64,
}

impl Pacer {
    pub(crate) fn new(scale: f64, budget: Option<f64>) -> Pacer {
        let tolerance = FIGURES.token_tolerance;
        Pacer { scale: scale.max(f64::MIN_POSITIVE), budget, spent: 0.0, last_steps: 0.0, tolerance }
    }

    /// Advances the `live` sequences, `done[i]` steps into their next token, to the first token
    /// any of them completes, one task step of the live batch costing `step_s` modelled seconds.
    /// Returns the sequences that complete a token now (their progress back to 0), in order; None
    /// when the budget ran out first, every live sequence's progress advanced by the steps it paid
    /// for.
    pub(crate) fn advance(&mut self, done: &mut [f64], live: &[bool], step_s: f64) -> Option<Vec<usize>> {
        let whole = vec![self.scale; done.len()];
        let complete = self.advance_to(done, live, &whole, step_s)?;
        for &i in &complete {
            done[i] = 0.0;
        }
        Some(complete)
    }

    /// `advance` towards each sequence's own `target` in modelled steps (`done` counting from
    /// wherever the caller does): the live batch runs to the nearest target, and the sequences
    /// that reach theirs are returned, their steps left as they are. A drawn response length
    /// (compute.lengths) ends a sequence at a target that need not be a whole task token.
    pub(crate) fn advance_to(
        &mut self,
        done: &mut [f64],
        live: &[bool],
        target: &[f64],
        step_s: f64,
    ) -> Option<Vec<usize>> {
        let need = done
            .iter()
            .zip(live)
            .zip(target)
            .filter(|((_, l), _)| **l)
            .map(|((d, _), t)| (t - d).max(0.0))
            .fold(f64::INFINITY, f64::min);
        self.last_steps = 0.0;
        if !need.is_finite() {
            return Some(Vec::new());
        }
        let per_step = step_s / self.scale;
        let mut steps = need;
        let mut ran_out = false;
        if let Some(budget) = self.budget.filter(|_| per_step > 0.0) {
            let affordable = (budget - self.spent).max(0.0) / per_step;
            if affordable < need - self.tolerance * self.scale {
                (steps, ran_out) = (affordable, true);
            }
        }
        self.spent += steps * per_step;
        self.last_steps = steps;
        for (d, _) in done.iter_mut().zip(live).filter(|(_, l)| **l) {
            *d += steps;
        }
        if ran_out {
            return None;
        }
        let reached = |i: usize| live[i] && target[i] - done[i] <= self.tolerance * self.scale;
        Some((0..done.len()).filter(|&i| reached(i)).collect())
    }

    /// Modelled decode steps per task token.
    pub(crate) fn scale(&self) -> f64 {
        self.scale
    }

    /// The steps within which a sequence `done` steps in counts as at `target`.
    pub(crate) fn tolerance_steps(&self) -> f64 {
        self.tolerance * self.scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decode of sequences that each want `lengths[i]` more tokens, from `progress`, in
    /// requests of `budget` modelled seconds (None: one request), a task step of the live batch
    /// costing `1 + active` seconds. Returns each request's tokens per sequence, the progress
    /// left after each request and the seconds charged in all.
    fn decode(lengths: &[usize], progress: &[f64], scale: f64, budget: Option<f64>) -> (Vec<Vec<usize>>, f64) {
        let mut left = lengths.to_vec();
        let mut done = progress.to_vec();
        let (mut requests, mut charged) = (Vec::new(), 0.0);
        while left.iter().any(|l| *l > 0) {
            let mut p = Pacer::new(scale, budget);
            let mut got = vec![0; left.len()];
            loop {
                let live: Vec<bool> = left.iter().map(|l| *l > 0).collect();
                let active = live.iter().filter(|l| **l).count();
                if active == 0 {
                    break;
                }
                let Some(now) = p.advance(&mut done, &live, 1.0 + active as f64) else { break };
                for i in now {
                    left[i] -= 1;
                    got[i] += 1;
                }
            }
            charged += p.spent;
            requests.push(got);
            assert!(requests.len() < 10_000, "no progress");
        }
        (requests, charged)
    }

    #[test]
    fn a_budget_splits_tokens_across_requests_without_losing_or_repeating_steps() {
        // Three sequences out of phase (one carried 150 of 200 steps from an earlier segment).
        let (lengths, progress) = ([3, 5, 1], [150.0, 0.0, 0.0]);
        let (whole, whole_s) = decode(&lengths, &progress, 200.0, None);
        assert_eq!(whole, vec![vec![3, 5, 1]]);
        for budget in [0.7, 2.5, 4.0, 13.0] {
            let (split, split_s) = decode(&lengths, &progress, 200.0, Some(budget));
            let totals: Vec<usize> = (0..3).map(|i| split.iter().map(|r| r[i]).sum()).collect();
            assert_eq!(totals, lengths, "budget {budget}: every token once");
            assert!((split_s - whole_s).abs() < 1e-6 * whole_s, "budget {budget}: {split_s} s against {whole_s} s");
            assert!(split.len() > 1, "budget {budget}: the budget never ended a request");
        }
        // A budget under one token's cost still moves every request forward.
        let (split, _) = decode(&[2], &[0.0], 100.0, Some(0.5));
        assert_eq!(split.iter().filter(|r| r[0] == 1).count(), 2);
        assert!(split.len() >= 8, "a token costs 2 s, requests of 0.5 s: {}", split.len());
    }

    #[test]
    fn a_request_ends_mid_token_and_keeps_the_steps_it_paid_for() {
        let mut p = Pacer::new(100.0, Some(3.0));
        let mut done = vec![0.0, 40.0];
        // A task step costs 4 s (0.04 s per modelled step): sequence 1 completes after 60 steps
        // (2.4 s), then the remaining 0.6 s buys 15 more steps of both.
        assert_eq!(p.advance(&mut done, &[true, true], 4.0), Some(vec![1]));
        assert_eq!(p.advance(&mut done, &[true, true], 4.0), None);
        assert!((done[0] - 75.0).abs() < 1e-9 && (done[1] - 15.0).abs() < 1e-9, "{done:?}");
        assert!((p.spent - 3.0).abs() < 1e-12);
        // Without a compute model (no cost) the budget never binds: every live sequence in step.
        let mut free = Pacer::new(1.0, Some(0.1));
        let mut done = vec![0.0; 3];
        assert_eq!(free.advance(&mut done, &[true, false, true], 0.0), Some(vec![0, 2]));
        // Progress at or past a token (a smaller scale than it was begun under) completes it free.
        let mut p = Pacer::new(50.0, Some(1.0));
        let mut done = vec![60.0];
        assert_eq!(p.advance(&mut done, &[true], 9.0), Some(vec![0]));
        assert_eq!(p.spent, 0.0);
    }
}
