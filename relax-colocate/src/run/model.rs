//! The built-in policy: a one-hidden-layer network over the context, small enough to train on two
//! CPU cores in seconds, real enough that every phase of the cycle has work to do.
//!
//! hidden_pre = b1 + Σ_p embed[p][token_p]   (position-specific token embeddings)
//! h = tanh(hidden_pre); logits = h·W2 + b2; value = h·wv + bv (the PPO value head)
//!
//! `hidden_pre` is what the rollout keeps in its KV cache: each generated token adds one
//! embedding row to it. Parameters are f32 (that is what lives in device memory); the math is f64.

use super::algo::{self, Aggregation, Clip, KlKind};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    pub vocab: usize,
    /// Positions the model can condition on: prompt + all but the last response token.
    pub context: usize,
    pub hidden: usize,
}

/// Named tensors in storage order, with their lengths in f32 elements.
pub fn layout(s: &Shape) -> Vec<(&'static str, usize)> {
    vec![
        ("embed", s.context * s.vocab * s.hidden),
        ("b1", s.hidden),
        ("w2", s.hidden * s.vocab),
        ("b2", s.vocab),
        ("wv", s.hidden),
        ("bv", 1),
    ]
}

pub fn param_count(s: &Shape) -> usize {
    layout(s).iter().map(|(_, n)| n).sum()
}

struct Offsets {
    embed: usize,
    b1: usize,
    w2: usize,
    b2: usize,
    wv: usize,
    bv: usize,
}

/// Where each tensor starts in the flat parameter vector (the order of `layout`). Computed
/// without allocating: it runs for every token of generation and training.
fn offsets(s: &Shape) -> Offsets {
    let embed = 0;
    let b1 = embed + s.context * s.vocab * s.hidden;
    let w2 = b1 + s.hidden;
    let b2 = w2 + s.hidden * s.vocab;
    let wv = b2 + s.vocab;
    let bv = wv + s.hidden;
    Offsets { embed, b1, w2, b2, wv, bv }
}

/// Small random embeddings and a near-zero output layer, so the first policy is close to uniform.
pub fn init(s: &Shape, seed: u64) -> Vec<f32> {
    let mut rng = super::task::Rng::new(seed);
    let o = offsets(s);
    let mut p = vec![0f32; param_count(s)];
    let embed_scale = 1.0 / (s.context as f64).sqrt();
    for x in &mut p[o.embed..o.b1] {
        *x = (rng.normal() * embed_scale) as f32;
    }
    for x in &mut p[o.w2..o.b2] {
        *x = (rng.normal() * 0.01) as f32;
    }
    p
}

/// One forward evaluation at a context.
pub struct Eval {
    pub h: Vec<f64>,
    pub logits: Vec<f64>,
    pub value: f64,
}

pub struct Policy<'a> {
    pub shape: Shape,
    pub params: &'a [f32],
}

impl Policy<'_> {
    pub fn embed_row(&self, pos: usize, token: u32) -> &[f32] {
        let o = offsets(&self.shape).embed + (pos * self.shape.vocab + token as usize) * self.shape.hidden;
        &self.params[o..o + self.shape.hidden]
    }

    pub fn bias(&self) -> &[f32] {
        let o = offsets(&self.shape);
        &self.params[o.b1..o.w2]
    }

    /// hidden_pre for a whole context (what the KV cache accumulates token by token).
    pub fn hidden_pre(&self, context: &[u32]) -> Vec<f64> {
        let mut pre: Vec<f64> = self.bias().iter().map(|&b| b as f64).collect();
        for (pos, &tok) in context.iter().enumerate() {
            for (a, e) in pre.iter_mut().zip(self.embed_row(pos, tok)) {
                *a += *e as f64;
            }
        }
        pre
    }

    pub fn head(&self, pre: &[f64]) -> Eval {
        let s = &self.shape;
        let o = offsets(s);
        let h: Vec<f64> = pre.iter().map(|x| x.tanh()).collect();
        let mut logits: Vec<f64> = self.params[o.b2..o.wv].iter().map(|&b| b as f64).collect();
        for (i, hi) in h.iter().enumerate() {
            let row = &self.params[o.w2 + i * s.vocab..o.w2 + (i + 1) * s.vocab];
            for (z, w) in logits.iter_mut().zip(row) {
                *z += hi * *w as f64;
            }
        }
        let value = self.params[o.bv] as f64
            + h.iter().zip(&self.params[o.wv..o.bv]).map(|(hi, w)| hi * *w as f64).sum::<f64>();
        Eval { h, logits, value }
    }

    /// Accumulates the gradient of one evaluation given d/dlogits and d/dvalue.
    fn backward(&self, context: &[u32], eval: &Eval, dlogits: &[f64], dvalue: f64, grad: &mut [f64]) {
        let s = &self.shape;
        let o = offsets(s);
        let mut dh = vec![0.0; s.hidden];
        for (i, hi) in eval.h.iter().enumerate() {
            let row = o.w2 + i * s.vocab;
            for (v, dz) in dlogits.iter().enumerate() {
                grad[row + v] += hi * dz;
                dh[i] += self.params[row + v] as f64 * dz;
            }
            grad[o.wv + i] += hi * dvalue;
            dh[i] += self.params[o.wv + i] as f64 * dvalue;
        }
        for (v, dz) in dlogits.iter().enumerate() {
            grad[o.b2 + v] += dz;
        }
        grad[o.bv] += dvalue;
        let dpre: Vec<f64> = dh.iter().zip(&eval.h).map(|(d, h)| d * (1.0 - h * h)).collect();
        for (i, d) in dpre.iter().enumerate() {
            grad[o.b1 + i] += d;
        }
        for (pos, &tok) in context.iter().enumerate() {
            let row = o.embed + (pos * s.vocab + tok as usize) * s.hidden;
            for (i, d) in dpre.iter().enumerate() {
                grad[row + i] += d;
            }
        }
    }

    /// Log-probability of each response token (at `temperature`), the entropy of each step's
    /// distribution and the value before each token.
    pub fn score(&self, prompt: &[u32], response: &[u32], temperature: f64) -> Vec<TokenScore> {
        let mut ctx = prompt.to_vec();
        let mut out = Vec::with_capacity(response.len());
        for &tok in response {
            let e = self.head(&self.hidden_pre(&ctx));
            let scaled: Vec<f64> = e.logits.iter().map(|z| z / temperature).collect();
            let (logp, _) = algo::log_softmax(&scaled);
            out.push(TokenScore { logprob: logp[tok as usize], entropy: algo::entropy(&scaled).0, value: e.value });
            ctx.push(tok);
        }
        out
    }
}

#[derive(Debug, Clone, Copy)]
pub struct TokenScore {
    pub logprob: f64,
    pub entropy: f64,
    pub value: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LossConfig {
    pub clip: Clip,
    pub kl_coef: f64,
    pub kl_kind: KlKind,
    pub entropy_coef: f64,
    pub aggregation: Aggregation,
    /// 0 disables the value loss (GRPO).
    pub value_coef: f64,
    pub value_clip: f64,
    pub temperature: f64,
}

/// One training sample: a response with per-token advantages and the reference quantities.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainSample {
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    pub advantages: Vec<f64>,
    pub old_logprobs: Vec<f64>,
    pub ref_logprobs: Vec<f64>,
    #[serde(default)]
    pub returns: Vec<f64>,
    #[serde(default)]
    pub old_values: Vec<f64>,
    /// The off-policy correction's per-token weights on the policy-gradient term (truncated
    /// importance sampling; docs/async.md). Empty: every weight 1, as before the field existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub is_weights: Vec<f64>,
}

impl TrainSample {
    /// Why the sample cannot be trained on, naming the field: every per-token list one entry per
    /// response token (is_weights may be empty), PPO's returns and old values too.
    pub fn check(&self, ppo: bool) -> Result<(), String> {
        let n = self.response.len();
        let mut lists = vec![
            ("advantages", &self.advantages),
            ("old_logprobs", &self.old_logprobs),
            ("ref_logprobs", &self.ref_logprobs),
        ];
        if ppo {
            lists.extend([("returns", &self.returns), ("old_values", &self.old_values)]);
        }
        if !self.is_weights.is_empty() {
            lists.push(("is_weights", &self.is_weights));
        }
        if let Some((name, v)) = lists.iter().find(|(_, v)| v.len() != n) {
            let empty = if *name == "is_weights" { " (or none, for weights of 1)" } else { "" };
            return Err(format!("{name} has {} entries for a response of {n} tokens: one per token{empty}", v.len()));
        }
        if let Some(w) = self.is_weights.iter().find(|w| !(w.is_finite() && **w >= 0.0)) {
            return Err(format!("is_weights holds {w}: each weight must be a finite number >= 0"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LossMetrics {
    pub loss: f64,
    pub pg_loss: f64,
    pub kl: f64,
    /// Mean of old − current log-prob over tokens (slime's and verl's ppo_kl).
    #[serde(default)]
    pub ppo_kl: f64,
    pub entropy: f64,
    pub value_loss: f64,
    pub clip_frac: f64,
    pub dual_clip_frac: f64,
    pub value_clip_frac: f64,
    /// Mean importance weight applied per token (1 without a correction).
    #[serde(default)]
    pub is_weight: f64,
    pub tokens: usize,
}

/// The aggregated loss over `samples` and, when `grad` is given, its gradient (added in).
pub fn loss(policy: &Policy, samples: &[TrainSample], cfg: &LossConfig, mut grad: Option<&mut [f64]>) -> LossMetrics {
    let lengths: Vec<usize> = samples.iter().map(|s| s.response.len()).collect();
    let weights = algo::token_weights(&lengths, cfg.aggregation);
    let mut m = LossMetrics::default();
    let tau = cfg.temperature;
    for (sample, w) in samples.iter().zip(weights) {
        let mut ctx = sample.prompt.clone();
        for (t, &tok) in sample.response.iter().enumerate() {
            let e = policy.head(&policy.hidden_pre(&ctx));
            let scaled: Vec<f64> = e.logits.iter().map(|z| z / tau).collect();
            let (logp_all, p) = algo::log_softmax(&scaled);
            let logp = logp_all[tok as usize];
            let pg = algo::policy_loss(logp, sample.old_logprobs[t], sample.advantages[t], &cfg.clip);
            // The importance weight scales the policy-gradient term only (a constant: no
            // gradient of its own), as slime's and verl's TIS do.
            let isw = sample.is_weights.get(t).copied().unwrap_or(1.0);
            let (kl, dkl) = algo::kl(logp, sample.ref_logprobs[t], cfg.kl_kind);
            let (h, dh) = algo::entropy(&scaled);
            let (vl, dv, vclipped) = if cfg.value_coef > 0.0 {
                algo::value_loss(e.value, sample.old_values[t], sample.returns[t], cfg.value_clip)
            } else {
                (0.0, 0.0, false)
            };
            m.loss += w * (isw * pg.loss + cfg.kl_coef * kl - cfg.entropy_coef * h + cfg.value_coef * vl);
            m.pg_loss += w * isw * pg.loss;
            m.value_loss += w * vl;
            m.kl += kl;
            m.ppo_kl += sample.old_logprobs[t] - logp;
            m.entropy += h;
            m.clip_frac += f64::from(u8::from(pg.clipped));
            m.dual_clip_frac += f64::from(u8::from(pg.dual_clipped));
            m.value_clip_frac += f64::from(u8::from(vclipped));
            m.is_weight += isw;
            m.tokens += 1;
            if let Some(g) = grad.as_deref_mut() {
                let dlogp = isw * pg.grad + cfg.kl_coef * dkl;
                let dlogits: Vec<f64> = (0..p.len())
                    .map(|j| {
                        let onehot = f64::from(u8::from(j == tok as usize));
                        w * (dlogp * (onehot - p[j]) - cfg.entropy_coef * dh[j]) / tau
                    })
                    .collect();
                policy.backward(&ctx, &e, &dlogits, w * cfg.value_coef * dv, g);
            }
            ctx.push(tok);
        }
    }
    let n = m.tokens.max(1) as f64;
    m.kl /= n;
    m.ppo_kl /= n;
    m.entropy /= n;
    m.clip_frac /= n;
    m.dual_clip_frac /= n;
    m.value_clip_frac /= n;
    m.is_weight /= n;
    m
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Adam {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm clip; 0 disables it.
    pub max_grad_norm: f64,
}

/// One Adam step with bias correction (step counts from 1); returns the pre-clip gradient norm.
pub fn adam_step(a: &Adam, step: u64, params: &mut [f32], grad: &[f64], m: &mut [f32], v: &mut [f32]) -> f64 {
    let norm = grad.iter().map(|g| g * g).sum::<f64>().sqrt();
    let scale = if a.max_grad_norm > 0.0 && norm > a.max_grad_norm { a.max_grad_norm / norm } else { 1.0 };
    let bc1 = 1.0 - a.beta1.powi(step as i32);
    let bc2 = 1.0 - a.beta2.powi(step as i32);
    for i in 0..params.len() {
        let g = grad[i] * scale;
        let mi = a.beta1 * m[i] as f64 + (1.0 - a.beta1) * g;
        let vi = a.beta2 * v[i] as f64 + (1.0 - a.beta2) * g * g;
        m[i] = mi as f32;
        v[i] = vi as f32;
        params[i] = (params[i] as f64 - a.lr * (mi / bc1) / ((vi / bc2).sqrt() + a.eps)) as f32;
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape { vocab: 5, context: 4, hidden: 6 }
    }

    fn sample(p: &Policy) -> TrainSample {
        let prompt = vec![1, 2];
        let response = vec![3, 0];
        let scores = p.score(&prompt, &response, 1.0);
        TrainSample {
            prompt,
            response,
            advantages: vec![0.7, -0.4],
            // Off-policy by a little, so the ratio is not 1 and the clip is in play.
            old_logprobs: scores.iter().map(|s| s.logprob - 0.05).collect(),
            ref_logprobs: scores.iter().map(|s| s.logprob + 0.1).collect(),
            returns: vec![0.5, 1.0],
            old_values: scores.iter().map(|s| s.value + 0.01).collect(),
            // Off the defaults, so the finite differences check the weighted gradient.
            is_weights: vec![1.7, 0.4],
        }
    }

    fn cfg(agg: Aggregation, kl_kind: KlKind) -> LossConfig {
        LossConfig {
            clip: Clip { eps_low: 0.2, eps_high: 0.28, dual: Some(3.0) },
            kl_coef: 0.3,
            kl_kind,
            entropy_coef: 0.05,
            aggregation: agg,
            value_coef: 0.5,
            value_clip: 0.2,
            temperature: 0.9,
        }
    }

    /// The hand-written backward pass against central differences of the loss.
    #[test]
    fn gradient_matches_finite_differences() {
        let s = shape();
        let mut params = init(&s, 3);
        // Make the output layer matter so every gradient path is exercised.
        for (i, x) in params.iter_mut().enumerate() {
            *x += ((i * 7919 % 13) as f32 - 6.0) * 0.02;
        }
        for (agg, kind) in [
            (Aggregation::TokenMean, KlKind::K3),
            (Aggregation::SeqMeanTokenMean, KlKind::K1),
            (Aggregation::SeqMeanTokenSum, KlKind::K2),
        ] {
            let c = cfg(agg, kind);
            let samples = vec![sample(&Policy { shape: s, params: &params })];
            let mut grad = vec![0.0; params.len()];
            loss(&Policy { shape: s, params: &params }, &samples, &c, Some(&mut grad));
            let mut checked = 0;
            for i in (0..params.len()).step_by(3) {
                let h = 1e-2f32;
                let mut plus = params.clone();
                plus[i] += h;
                let mut minus = params.clone();
                minus[i] -= h;
                let lp = loss(&Policy { shape: s, params: &plus }, &samples, &c, None).loss;
                let lm = loss(&Policy { shape: s, params: &minus }, &samples, &c, None).loss;
                let numeric = (lp - lm) / (2.0 * h as f64);
                assert!(
                    (numeric - grad[i]).abs() < 2e-3 + 2e-2 * numeric.abs(),
                    "{agg:?}/{kind:?} param {i}: numeric {numeric} analytic {}",
                    grad[i]
                );
                checked += usize::from(grad[i] != 0.0);
            }
            assert!(checked > 10, "too few non-zero gradients checked");
        }
    }

    /// Loss and gradient of `samples` under `c`.
    fn loss_and_grad(params: &[f32], samples: &[TrainSample], c: &LossConfig) -> (f64, Vec<f64>) {
        let mut grad = vec![0.0; params.len()];
        let m = loss(&Policy { shape: shape(), params }, samples, c, Some(&mut grad));
        (m.loss, grad)
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-12 + 1e-9 * y.abs())
    }

    /// Weights of 1 are no weights; a weight of 0 removes the token's policy-gradient term and
    /// only that (its KL and entropy terms stay); a weight scales the term's gradient.
    #[test]
    fn importance_weights_scale_each_token_s_policy_gradient() {
        let s = shape();
        let mut params = init(&s, 5);
        for (i, x) in params.iter_mut().enumerate() {
            *x += ((i * 31 % 11) as f32 - 5.0) * 0.03;
        }
        let base = sample(&Policy { shape: s, params: &params });
        let with = |w: Vec<f64>| vec![TrainSample { is_weights: w, ..base.clone() }];
        let c = cfg(Aggregation::TokenMean, KlKind::K3);
        let (plain, g_plain) = loss_and_grad(&params, &with(Vec::new()), &c);
        let (ones, g_ones) = loss_and_grad(&params, &with(vec![1.0, 1.0]), &c);
        assert!(plain == ones && g_plain == g_ones, "weights of 1 changed the loss: {plain} vs {ones}");

        // Token 0 weighted 0 is token 0 with no advantage (a zero policy-gradient term).
        let (zero, g_zero) = loss_and_grad(&params, &with(vec![0.0, 1.0]), &c);
        let no_adv = TrainSample { advantages: vec![0.0, base.advantages[1]], is_weights: Vec::new(), ..base.clone() };
        let (want, g_want) = loss_and_grad(&params, &[no_adv], &c);
        assert!((zero - want).abs() < 1e-12 && close(&g_zero, &g_want), "{zero} vs {want}");
        assert!(!close(&g_zero, &g_plain), "weight 0 left the gradient as it was");

        // Policy-gradient term only: a weight of 2 on every token doubles loss and gradient.
        let pg_only = LossConfig { kl_coef: 0.0, entropy_coef: 0.0, value_coef: 0.0, ..c };
        let (one, g_one) = loss_and_grad(&params, &with(Vec::new()), &pg_only);
        let (two, g_two) = loss_and_grad(&params, &with(vec![2.0, 2.0]), &pg_only);
        let doubled: Vec<f64> = g_one.iter().map(|g| 2.0 * g).collect();
        assert!((two - 2.0 * one).abs() < 1e-12 && close(&g_two, &doubled), "{two} vs 2 x {one}");
        let m = loss(&Policy { shape: s, params: &params }, &with(vec![0.5, 1.5]), &pg_only, None);
        assert!((m.is_weight - 1.0).abs() < 1e-12, "mean weight applied: {}", m.is_weight);
    }

    #[test]
    fn a_sample_s_lists_must_have_one_entry_per_token() {
        let s = shape();
        let params = init(&s, 1);
        let good = sample(&Policy { shape: s, params: &params });
        assert_eq!(good.check(true), Ok(()));
        assert_eq!(TrainSample { is_weights: Vec::new(), ..good.clone() }.check(false), Ok(()));
        let short = TrainSample { is_weights: vec![1.0], ..good.clone() };
        let err = short.check(false).unwrap_err();
        assert!(err.starts_with("is_weights has 1 entries for a response of 2 tokens"), "{err}");
        let negative = TrainSample { is_weights: vec![1.0, -0.5], ..good.clone() };
        assert!(negative.check(false).unwrap_err().contains("is_weights holds -0.5"));
        let err = TrainSample { advantages: vec![1.0], ..good.clone() }.check(false).unwrap_err();
        assert!(err.starts_with("advantages has 1 entries"), "{err}");
        // PPO's lists are checked only for PPO.
        let no_values = TrainSample { old_values: Vec::new(), ..good };
        assert!(no_values.check(false).is_ok() && no_values.check(true).unwrap_err().starts_with("old_values"));
    }

    #[test]
    fn offsets_follow_the_layout() {
        let s = shape();
        let o = offsets(&s);
        let starts: Vec<usize> = layout(&s)
            .iter()
            .scan(0, |at, (_, n)| {
                let start = *at;
                *at += n;
                Some(start)
            })
            .collect();
        assert_eq!(starts, vec![o.embed, o.b1, o.w2, o.b2, o.wv, o.bv]);
        assert_eq!(o.bv + 1, param_count(&s));
    }

    #[test]
    fn adam_moves_against_the_gradient_by_lr() {
        let a = Adam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, max_grad_norm: 0.0 };
        let mut p = vec![1.0f32, 1.0];
        let (mut m, mut v) = (vec![0f32; 2], vec![0f32; 2]);
        let norm = adam_step(&a, 1, &mut p, &[2.0, -0.5], &mut m, &mut v);
        assert!((norm - (4.25f64).sqrt()).abs() < 1e-9);
        // The first bias-corrected step is lr·sign(g).
        assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] - 1.1).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn scoring_is_consistent_with_the_loss_inputs() {
        let s = shape();
        let params = init(&s, 9);
        let p = Policy { shape: s, params: &params };
        let sc = p.score(&[1, 2], &[3, 0], 1.0);
        // A near-zero output layer gives a near-uniform first policy.
        assert!((sc[0].logprob - (1.0 / 5.0f64).ln()).abs() < 0.05, "{}", sc[0].logprob);
        assert!((sc[0].entropy - 5f64.ln()).abs() < 0.01);
    }
}
