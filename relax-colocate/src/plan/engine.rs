//! One rollout engine's generate request in modelled time, charged as the built-in rollout
//! charges it (run/worker/rollout.rs): the prefill of every sequence whose prefix the engine does
//! not hold, at the prefill stage's FLOPs; then decode steps over the sequences the KV capacity
//! admits (run/admission.rs, the same scheduler), each step the compute model's roofline and fixed
//! latency; a budget of modelled seconds or of tokens ends a segment part-way.

use crate::run::admission::Admission;
use crate::run::compute::FIGURES;
use crate::run::protocol::ComputeModel;

/// A sequence as the model sees it: task tokens, each `scale` modelled ones.
#[derive(Debug, Clone)]
pub(super) struct Seq {
    /// Prompt tokens (task tokens).
    pub(super) prompt: usize,
    /// The response's length in task tokens (fractional when a lengths file gives modelled
    /// tokens that are not a whole number of task tokens).
    pub(super) length: f64,
    /// Task tokens generated so far (fractional after a segment that ended mid-token).
    pub(super) done: f64,
    /// Modelled tokens per task token of this sequence (compute.token_scale_final grows it by
    /// the batch its prompt was drawn for).
    pub(super) scale: f64,
    /// Its length drawn from compute.lengths: its KV then grows by every modelled step, not by
    /// whole task tokens (run/worker/rollout.rs).
    pub(super) drawn: bool,
}

impl Seq {
    pub(super) fn finished(&self) -> bool {
        self.done >= self.length - 1e-9
    }

    /// Task tokens in its KV cache: the prompt and the whole tokens generated, or with a drawn
    /// length every modelled step decoded.
    fn context(&self) -> f64 {
        let generated = if self.drawn { self.done } else { (self.done + 1e-9).floor() };
        self.prompt as f64 + generated
    }
}

/// What a request cost and did.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) struct Request {
    pub(super) seconds: f64,
    /// Modelled decode steps run, and the sequences they held (slot occupancy).
    pub(super) steps: f64,
    pub(super) slot_steps: f64,
    pub(super) preemptions: u64,
}

/// The limits of one request: its batch slots, a budget in modelled seconds of decoding, and in
/// task tokens per sequence.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) slots: usize,
    pub(super) budget_s: Option<f64>,
    pub(super) segment_tokens: Option<usize>,
}

/// Runs one request over `seqs` (the unfinished ones decode) on an engine of `model`. `cached`
/// says, per sequence, whether the engine still holds its prefix (a sequence begun on it since
/// the last weight update); a new sequence pays its prompt's prefill.
pub(super) fn request(model: &ComputeModel, seqs: &mut [&mut Seq], cached: &[bool], limits: Limits) -> Request {
    let live_seqs: Vec<usize> = (0..seqs.len()).filter(|&i| !seqs[i].finished()).collect();
    if live_seqs.is_empty() {
        return Request::default();
    }
    // One request charges one scale: the mean of its sequences'.
    let scale = live_seqs.iter().map(|&i| seqs[i].scale).sum::<f64>() / live_seqs.len() as f64;
    let m = model.scaled(Some(scale));
    let begun = |s: &Seq| s.done > 0.0;
    let mut prefill: f64 = live_seqs
        .iter()
        .filter(|&&i| !(cached.get(i).copied().unwrap_or(false) && begun(seqs[i])))
        .map(|&i| seqs[i].context())
        .sum();
    let capacity = m.kv_capacity_tokens.map(|c| c / m.token_scale);
    let mut admission = Admission::new(seqs.len(), limits.slots, capacity, m.token_scale);
    let segment = limits.segment_tokens.unwrap_or(usize::MAX).max(1) as f64;
    let start: Vec<f64> = seqs.iter().map(|s| s.done).collect();
    let tolerance = FIGURES.token_tolerance;
    let mut spent = 0.0;
    let mut out = Request::default();
    loop {
        let live: Vec<bool> =
            seqs.iter().zip(&start).map(|(s, d0)| !s.finished() && s.done - d0 < segment - tolerance).collect();
        let contexts: Vec<f64> = seqs.iter().map(|s| s.context()).collect();
        let (now, again) = admission.schedule(&live, &contexts);
        prefill += again;
        let active: Vec<usize> = (0..seqs.len()).filter(|&i| now[i]).collect();
        if active.is_empty() {
            break;
        }
        let context: f64 = active.iter().map(|&i| contexts[i]).sum();
        let step_s = m.decode_step_seconds(active.len(), context);
        // To the first token any active sequence completes, or its response's end.
        let need = active
            .iter()
            .map(|&i| {
                let s = &seqs[i];
                let to_token = 1.0 - (s.done - s.done.floor());
                to_token.min(s.length - s.done).max(0.0)
            })
            .fold(f64::INFINITY, f64::min)
            .max(tolerance);
        let mut advance = need;
        let mut ran_out = false;
        if let Some(budget) = limits.budget_s.filter(|_| step_s > 0.0) {
            let affordable = (budget - spent).max(0.0) / step_s;
            if affordable < need - tolerance {
                (advance, ran_out) = (affordable, true);
            }
        }
        spent += advance * step_s;
        let before = out.steps;
        out.steps += advance * m.token_scale;
        out.slot_steps += (out.steps - before) * active.len() as f64;
        for &i in &active {
            let s = &mut seqs[i];
            s.done = (s.done + advance).min(s.length);
            // A whole token within the tolerance is a whole token.
            if (s.done - s.done.round()).abs() < tolerance {
                s.done = s.done.round();
            }
        }
        admission.ran(advance * m.token_scale, advance * step_s, active.len());
        if ran_out {
            break;
        }
    }
    out.preemptions = admission.stats.preemptions;
    out.seconds = m.stage_modelled_seconds(&FIGURES.stages.prefill, prefill * m.token_scale, 1.0) + spent;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100_4b() -> ComputeModel {
        ComputeModel {
            forward_flops_per_token: 2.0 * 4.02e9,
            tflops: 989.0,
            train_mfu: 0.4,
            rollout_mfu: 0.3,
            token_scale: 40.0,
            trainers: 1.0,
            hbm_gbps: Some(3350.0),
            weight_bytes: 8.04e9,
            kv_bytes_per_token: 147_456.0,
            decode_step_ms: 2.0,
            kv_capacity_tokens: None,
        }
    }

    fn seqs(lengths: &[f64]) -> Vec<Seq> {
        lengths.iter().map(|&length| Seq { prompt: 4, length, done: 0.0, scale: 40.0, drawn: false }).collect()
    }

    fn unlimited(slots: usize) -> Limits {
        Limits { slots, budget_s: None, segment_tokens: None }
    }

    /// Two sequences of 2 and 3 tokens: two steps of both, then one of the longer; the prompts'
    /// prefill; every sum the compute model's own.
    #[test]
    fn a_request_charges_its_prefill_and_each_decode_step_of_the_batch_left() {
        let m = h100_4b();
        let mut s = seqs(&[2.0, 3.0]);
        let mut refs: Vec<&mut Seq> = s.iter_mut().collect();
        let r = request(&m, &mut refs, &[], unlimited(2));
        let want = m.stage_seconds(&FIGURES.stages.prefill, 8, 1.0)
            + m.decode_step_seconds(2, 8.0)
            + m.decode_step_seconds(2, 10.0)
            + m.decode_step_seconds(1, 6.0);
        assert!((r.seconds - want).abs() < 1e-12, "{} vs {want}", r.seconds);
        assert_eq!(r.steps, 3.0 * 40.0);
        assert_eq!(r.slot_steps, 5.0 * 40.0);
        assert!(s.iter().all(Seq::finished));
    }

    /// A budget ends the request part-way through a token; the next request continues from there
    /// and the two together cost what one unbounded request does (the prefix held, no prefill).
    #[test]
    fn a_budget_splits_a_request_and_the_parts_cost_the_whole() {
        let m = h100_4b();
        let whole = {
            let mut s = seqs(&[5.0]);
            let mut refs: Vec<&mut Seq> = s.iter_mut().collect();
            request(&m, &mut refs, &[], unlimited(1)).seconds
        };
        let mut s = seqs(&[5.0]);
        let step = m.decode_step_seconds(1, 4.0);
        let limits = Limits { slots: 1, budget_s: Some(step * 1.5), segment_tokens: None };
        let first = request(&m, &mut s.iter_mut().collect::<Vec<_>>(), &[], limits).seconds;
        assert!(s[0].done > 1.4 && s[0].done < 1.5, "part-way through its second token: {}", s[0].done);
        let rest = request(&m, &mut s.iter_mut().collect::<Vec<_>>(), &[true], unlimited(1)).seconds;
        assert!(s[0].finished());
        assert!((first + rest - whole).abs() < 1e-9, "{first} + {rest} vs {whole}");
    }

    /// A segment of two tokens stops each sequence after two; a KV capacity of one sequence's
    /// tokens runs them one at a time.
    #[test]
    fn segments_and_kv_capacity_bound_what_decodes() {
        let m = h100_4b();
        let mut s = seqs(&[5.0, 5.0]);
        let limits = Limits { slots: 2, budget_s: None, segment_tokens: Some(2) };
        request(&m, &mut s.iter_mut().collect::<Vec<_>>(), &[], limits);
        assert_eq!(s.iter().map(|q| q.done).collect::<Vec<_>>(), [2.0, 2.0]);
        let tight = ComputeModel { kv_capacity_tokens: Some(40.0 * 8.0), ..h100_4b() };
        let mut s = seqs(&[5.0, 5.0]);
        let r = request(&tight, &mut s.iter_mut().collect::<Vec<_>>(), &[], unlimited(2));
        assert_eq!(r.slot_steps, r.steps, "one sequence at a time");
        assert!(s.iter().all(Seq::finished));
    }
}
