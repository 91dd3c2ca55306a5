//! The compute model's figures (docs/async.md, "Modelled compute"): the forward-pass equivalents
//! and the MFU each stage charges, the share of its steps a decode step's KV reads are charged at,
//! and how near a token's steps must come to complete it. They are stated once, in
//! python/relax_compute_model.json: this binary embeds it and gives it to its workers beside
//! relax_worker.py, where scripts/torch_worker.py reads it, so that a change to a figure reaches
//! both. The formulas that use them are written on both sides; the golden cases below (and
//! python/tests/test_compute_model.py on the same file) hold both to the same numbers.

use serde::Deserialize;
use std::sync::LazyLock;

/// The figures' file, as the runner gives it to its workers.
pub(crate) const FIGURES_JSON: &str = include_str!("../../python/relax_compute_model.json");

/// Which of the model's MFUs a stage reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Mfu {
    #[serde(rename = "train_mfu")]
    Train,
    #[serde(rename = "rollout_mfu")]
    Rollout,
}

/// What a stage charges per token: `passes` forward-pass equivalents at the `mfu` it names.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Stage {
    pub passes: f64,
    pub mfu: Mfu,
}

#[derive(Debug, Deserialize)]
pub struct Stages {
    pub log_probs: Stage,
    pub values: Stage,
    pub train: Stage,
    /// The rollout's prefill, compute-bound like the trainer's passes.
    pub prefill: Stage,
    /// A decode step's FLOPs (its memory reads are charged apart).
    pub decode: Stage,
}

#[derive(Debug, Deserialize)]
pub struct Figures {
    pub stages: Stages,
    /// A decode step stands for `token_scale` modelled steps, over which each sequence's KV cache
    /// grows: its reads are charged at this share of that growth (mid-way).
    pub decode_kv_midpoint: f64,
    /// A sequence's steps this close to a whole token, as a share of `token_scale`, complete it
    /// (what floating-point sums leave over).
    pub token_tolerance: f64,
}

pub static FIGURES: LazyLock<Figures> =
    LazyLock::new(|| serde_json::from_str(FIGURES_JSON).expect("relax_compute_model.json is the runner's own"));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::admission::Admission;
    use crate::run::pacer::Pacer;
    use crate::run::protocol::{ComputeModel, DecodeStats};
    use crate::run::transport::buckets::{bucket_count, bucket_pieces};
    use std::collections::BTreeMap;

    const CASES: &str = include_str!("../../python/tests/compute_model_cases.json");

    #[derive(Deserialize)]
    struct Cases {
        models: BTreeMap<String, ComputeModel>,
        stages: Vec<StageCase>,
        decode_steps: Vec<DecodeStepCase>,
        decodes: Vec<DecodeCase>,
        buckets: Vec<BucketCase>,
    }

    #[derive(Deserialize)]
    struct StageCase {
        model: String,
        token_scale: Option<f64>,
        stage: String,
        tokens: usize,
        devices: f64,
        seconds: f64,
    }

    #[derive(Deserialize)]
    struct DecodeStepCase {
        model: String,
        token_scale: Option<f64>,
        active: usize,
        context: usize,
        seconds: f64,
    }

    #[derive(Deserialize)]
    struct DecodeCase {
        model: String,
        token_scale: Option<f64>,
        sequences: Vec<(usize, usize)>,
        progress: Vec<f64>,
        budget: Option<f64>,
        /// The engine's batch slots (init's max_batch).
        slots: usize,
        seconds: f64,
        tokens: Vec<usize>,
        carried: Vec<f64>,
        /// Task tokens prefilled again for preempted sequences readmitted.
        recomputed: f64,
        stats: DecodeStats,
    }

    #[derive(Deserialize)]
    struct BucketCase {
        sizes: Vec<u64>,
        bucket_bytes: u64,
        count: u64,
        pieces: Vec<Vec<(usize, u64, u64, u64)>>,
    }

    fn cases() -> Cases {
        serde_json::from_str(CASES).expect("compute_model_cases.json parses")
    }

    impl Cases {
        /// A case's model at the request's own token_scale, if it gives one.
        fn model(&self, name: &str, token_scale: Option<f64>) -> ComputeModel {
            self.models.get(name).unwrap_or_else(|| panic!("no model {name:?}")).scaled(token_scale)
        }
    }

    fn stage(name: &str) -> &'static Stage {
        let s = &FIGURES.stages;
        match name {
            "log_probs" => &s.log_probs,
            "values" => &s.values,
            "train" => &s.train,
            "prefill" => &s.prefill,
            "decode" => &s.decode,
            _ => panic!("no stage {name:?}"),
        }
    }

    /// Equal but for the last bits that the two languages' operation orders may leave.
    fn close(got: f64, want: f64) -> bool {
        (got - want).abs() <= 1e-12 * got.abs().max(want.abs()) + 1e-18
    }

    /// What a decode case's request did: the figures a golden case states.
    struct Decoded {
        seconds: f64,
        /// The tokens each completed.
        tokens: Vec<usize>,
        /// The steps each carries towards its next token.
        carried: Vec<f64>,
        recomputed: f64,
        stats: DecodeStats,
    }

    /// A request's modelled decode as the built-in rollout runs it (worker/rollout.rs, generate):
    /// the sequences the KV capacity admits (Admission), each task step of them charged by
    /// decode_step_seconds at their contexts, the Pacer saying which complete a token.
    fn decode(m: &ComputeModel, c: &DecodeCase) -> Decoded {
        let mut pacer = Pacer::new(m.token_scale, c.budget);
        let mut done = if c.progress.is_empty() { vec![0.0; c.sequences.len()] } else { c.progress.clone() };
        let mut emitted = vec![0; c.sequences.len()];
        let capacity = m.kv_capacity_tokens.map(|k| k / m.token_scale);
        let mut admission = Admission::new(c.sequences.len(), c.slots, capacity, m.token_scale);
        let mut recomputed = 0.0;
        loop {
            let live: Vec<bool> = c.sequences.iter().zip(&emitted).map(|((_, new), e)| e < new).collect();
            let contexts: Vec<f64> = c.sequences.iter().zip(&emitted).map(|((ctx, _), e)| (ctx + e) as f64).collect();
            let (live, again) = admission.schedule(&live, &contexts);
            recomputed += again;
            let at = contexts.iter().zip(&live).filter(|(_, l)| **l);
            let (active, context) = at.fold((0, 0.0), |(a, sum), (ctx, _)| (a + 1, sum + ctx));
            if active == 0 {
                break;
            }
            let before = pacer.spent;
            let advanced = pacer.advance(&mut done, &live, m.decode_step_seconds(active, context));
            admission.ran(pacer.last_steps, pacer.spent - before, active);
            let Some(now) = advanced else { break };
            for i in now {
                emitted[i] += 1;
            }
        }
        Decoded { seconds: pacer.spent, tokens: emitted, carried: done, recomputed, stats: admission.stats }
    }

    /// `got` is `want`: the counts exactly, the sums of floating-point steps but for their last bits.
    fn same_stats(got: &DecodeStats, want: &DecodeStats) -> bool {
        let floats = [
            (got.steps, want.steps),
            (got.slot_steps, want.slot_steps),
            (got.recomputed_tokens, want.recomputed_tokens),
            (got.kv_queued_s, want.kv_queued_s),
        ];
        let peak = match (got.kv_peak_share, want.kv_peak_share) {
            (Some(g), Some(w)) => close(g, w),
            (g, w) => g == w,
        };
        floats.iter().all(|(g, w)| close(*g, *w))
            && peak
            && (got.slots, got.preemptions) == (want.slots, want.preemptions)
    }

    #[test]
    fn each_stage_charges_the_golden_seconds() {
        let c = cases();
        for (i, s) in c.stages.iter().enumerate() {
            let got = c.model(&s.model, s.token_scale).stage_seconds(stage(&s.stage), s.tokens, s.devices);
            assert!(close(got, s.seconds), "stages[{i}] ({} on {}): {got} s, golden {} s", s.stage, s.model, s.seconds);
        }
    }

    #[test]
    fn a_decode_step_charges_the_golden_seconds() {
        let c = cases();
        for (i, s) in c.decode_steps.iter().enumerate() {
            let got = c.model(&s.model, s.token_scale).decode_step_seconds(s.active, s.context as f64);
            assert!(close(got, s.seconds), "decode_steps[{i}] ({}): {got} s, golden {} s", s.model, s.seconds);
        }
    }

    #[test]
    fn a_paced_decode_charges_completes_and_carries_the_golden_figures() {
        let c = cases();
        for (i, d) in c.decodes.iter().enumerate() {
            let got = decode(&c.model(&d.model, d.token_scale), d);
            let figures = serde_json::json!({
                "seconds": got.seconds, "tokens": got.tokens, "carried": got.carried,
                "recomputed": got.recomputed, "stats": got.stats,
            });
            assert!(
                close(got.seconds, d.seconds),
                "decodes[{i}]: {} s, golden {} s; {figures}",
                got.seconds,
                d.seconds
            );
            assert_eq!(got.tokens, d.tokens, "decodes[{i}]: tokens; {figures}");
            let same = got.carried.iter().zip(&d.carried).all(|(g, w)| close(*g, *w));
            assert!(
                same && got.carried.len() == d.carried.len(),
                "decodes[{i}]: carried, golden {:?}; {figures}",
                d.carried
            );
            assert!(close(got.recomputed, d.recomputed), "decodes[{i}]: recomputed; {figures}");
            assert!(same_stats(&got.stats, &d.stats), "decodes[{i}]: stats, golden {:?}; {figures}", d.stats);
        }
    }

    #[test]
    fn the_weights_stream_is_cut_into_the_golden_buckets() {
        for (i, b) in cases().buckets.iter().enumerate() {
            let total = b.sizes.iter().sum();
            assert_eq!(bucket_count(total, b.bucket_bytes), b.count, "buckets[{i}]: count");
            let pieces: Vec<_> = (0..b.count).map(|k| bucket_pieces(&b.sizes, b.bucket_bytes, k)).collect();
            assert_eq!(pieces, b.pieces, "buckets[{i}]: pieces");
            assert!(bucket_pieces(&b.sizes, b.bucket_bytes, b.count).is_empty(), "buckets[{i}]: past the end");
        }
    }
}
