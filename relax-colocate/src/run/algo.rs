//! The RL math of the cycle, as the frameworks implement it (../shared/reference/colocate.md):
//! group-normalized and GAE advantages, the clipped surrogate with asymmetric and dual clip, the
//! KL estimators, entropy and the loss aggregations. Every function returns the value and its
//! derivative, because the built-in trainer back-propagates through them by hand.

use serde::{Deserialize, Serialize};

/// log-ratio clamp before exp, as verl and slime do, so one stale token cannot overflow.
pub const LOG_RATIO_CLAMP: f64 = 20.0;
/// k3 (low_var_kl) is clamped to this magnitude.
pub const K3_CLAMP: f64 = 10.0;
/// Added to the group standard deviation so a group with equal rewards divides by non-zero.
pub const GROUP_STD_EPS: f64 = 1e-6;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlKind {
    /// log r
    K1,
    /// ½ (log r)²
    K2,
    /// exp(−log r) − 1 + log r (low_var_kl), clamped to ±10
    K3,
}

/// KL estimate for one token, log r = logp − ref_logp, and its derivative with respect to logp.
pub fn kl(logp: f64, ref_logp: f64, kind: KlKind) -> (f64, f64) {
    let x = logp - ref_logp;
    match kind {
        KlKind::K1 => (x, 1.0),
        KlKind::K2 => (0.5 * x * x, x),
        KlKind::K3 => {
            let v = (-x).exp() - 1.0 + x;
            if v > K3_CLAMP { (K3_CLAMP, 0.0) } else { (v, 1.0 - (-x).exp()) }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Clip {
    pub eps_low: f64,
    pub eps_high: f64,
    /// Dual-clip constant c > 1, applied where the advantage is negative; None disables it.
    pub dual: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PgToken {
    pub loss: f64,
    /// d loss / d logp
    pub grad: f64,
    /// The clipped branch was the larger one (verl's pg_clipfrac counts these).
    pub clipped: bool,
    /// The dual clip bound the loss.
    pub dual_clipped: bool,
}

/// Clipped surrogate for one token: −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), and for A < 0 the
/// dual clip min(that, −c·A).
pub fn policy_loss(logp: f64, old_logp: f64, adv: f64, clip: &Clip) -> PgToken {
    let log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP);
    let ratio = log_ratio.exp();
    let ratio_clamped = ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high);
    let unclipped = -adv * ratio;
    let clipped_loss = -adv * ratio_clamped;
    // d(ratio)/d(logp) = ratio where the log-ratio clamp is inactive.
    let dratio = if (logp - old_logp).abs() < LOG_RATIO_CLAMP { ratio } else { 0.0 };
    let clipped = clipped_loss > unclipped;
    let (mut loss, mut grad) = if clipped {
        let inside = ratio > 1.0 - clip.eps_low && ratio < 1.0 + clip.eps_high;
        (clipped_loss, if inside { -adv * dratio } else { 0.0 })
    } else {
        (unclipped, -adv * dratio)
    };
    let mut dual_clipped = false;
    if let Some(c) = clip.dual
        && adv < 0.0
        && loss > -c * adv
    {
        loss = -c * adv;
        grad = 0.0;
        dual_clipped = true;
    }
    PgToken { loss, grad, clipped, dual_clipped }
}

/// GRPO advantages: rewards laid out as consecutive groups of `group`; A = (r − mean)/(std + ε)
/// with the unbiased standard deviation (torch.std), or Dr.GRPO's A = r − mean.
pub fn grpo_advantages(rewards: &[f64], group: usize, dr_grpo: bool) -> Vec<f64> {
    assert!(group > 0 && rewards.len().is_multiple_of(group), "rewards must be whole groups");
    let mut out = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group) {
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        let std = if g.len() > 1 {
            (g.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (g.len() - 1) as f64).sqrt()
        } else {
            0.0
        };
        out.extend(g.iter().map(|r| if dr_grpo { r - mean } else { (r - mean) / (std + GROUP_STD_EPS) }));
    }
    out
}

/// Generalized advantage estimation over one response: δ_t = r_t + γ V_{t+1} − V_t (V after the
/// last token is 0), A_t = δ_t + γλ A_{t+1}; returns A and the value targets A + V.
pub fn gae(token_rewards: &[f64], values: &[f64], gamma: f64, lambda: f64) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(token_rewards.len(), values.len());
    let n = values.len();
    let mut adv = vec![0.0; n];
    let mut next_adv = 0.0;
    for t in (0..n).rev() {
        let next_value = if t + 1 < n { values[t + 1] } else { 0.0 };
        let delta = token_rewards[t] + gamma * next_value - values[t];
        next_adv = delta + gamma * lambda * next_adv;
        adv[t] = next_adv;
    }
    let returns = adv.iter().zip(values).map(|(a, v)| a + v).collect();
    (adv, returns)
}

/// PPO token rewards: −kl_coef·KL on every token and the scalar reward on the last one.
pub fn ppo_token_rewards(reward: f64, kl_per_token: &[f64], kl_coef: f64) -> Vec<f64> {
    let mut r: Vec<f64> = kl_per_token.iter().map(|k| -kl_coef * k).collect();
    if let Some(last) = r.last_mut() {
        *last += reward;
    }
    r
}

/// Normalizes to zero mean and unit variance over every token of the batch (masked_whiten).
pub fn whiten(values: &mut [Vec<f64>]) {
    let n: usize = values.iter().map(Vec::len).sum();
    if n < 2 {
        return;
    }
    let mean = values.iter().flatten().sum::<f64>() / n as f64;
    let var = values.iter().flatten().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let scale = 1.0 / (var.sqrt() + 1e-8);
    for v in values.iter_mut().flatten() {
        *v = (*v - mean) * scale;
    }
}

/// Clipped value loss ½·max((v − R)², (v_clip − R)²), v_clip = old + clip(v − old, ±ε); with d/dv.
pub fn value_loss(value: f64, old_value: f64, ret: f64, eps: f64) -> (f64, f64, bool) {
    let v_clip = old_value + (value - old_value).clamp(-eps, eps);
    let a = (value - ret).powi(2);
    let b = (v_clip - ret).powi(2);
    if b > a {
        let inside = (value - old_value).abs() < eps;
        (0.5 * b, if inside { v_clip - ret } else { 0.0 }, true)
    } else {
        (0.5 * a, value - ret, false)
    }
}

/// Entropy of softmax(logits) and its gradient with respect to the logits.
pub fn entropy(logits: &[f64]) -> (f64, Vec<f64>) {
    let (logp, p) = log_softmax(logits);
    let h = -p.iter().zip(&logp).map(|(p, l)| p * l).sum::<f64>();
    let grad = p.iter().zip(&logp).map(|(p, l)| -p * (l + h)).collect();
    (h, grad)
}

/// log softmax and softmax, shifted by the max for stability.
pub fn log_softmax(logits: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + logits.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
    let logp: Vec<f64> = logits.iter().map(|z| z - lse).collect();
    let p = logp.iter().map(|l| l.exp()).collect();
    (logp, p)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// Σ over all tokens / number of tokens
    TokenMean,
    /// mean over sequences of the per-sequence token mean
    SeqMeanTokenMean,
    /// mean over sequences of the per-sequence token sum
    SeqMeanTokenSum,
}

/// The weight each token's loss gets in the aggregate, for sequences of the given lengths.
pub fn token_weights(lengths: &[usize], agg: Aggregation) -> Vec<f64> {
    let tokens: usize = lengths.iter().sum();
    let seqs = lengths.iter().filter(|l| **l > 0).count().max(1) as f64;
    lengths
        .iter()
        .map(|&len| match agg {
            Aggregation::TokenMean => 1.0 / tokens.max(1) as f64,
            Aggregation::SeqMeanTokenMean => 1.0 / (seqs * len.max(1) as f64),
            Aggregation::SeqMeanTokenSum => 1.0 / seqs,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-9, "{a} != {b}");
    }

    #[test]
    fn grpo_group_normalization_matches_hand_values() {
        // Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735.
        let a = grpo_advantages(&[1.0, 0.0, 0.0, 1.0, 2.0, 2.0], 2, false);
        // second group [0,1]: mean .5, std sqrt(.5)=.70711; third [2,2]: zeros
        close(a[0], 0.5 / (0.5f64.sqrt() + GROUP_STD_EPS));
        close(a[1], -0.5 / (0.5f64.sqrt() + GROUP_STD_EPS));
        close(a[2], -0.5 / (0.5f64.sqrt() + GROUP_STD_EPS));
        close(a[4], 0.0);
        close(a[5], 0.0);
        let g4 = grpo_advantages(&[1.0, 0.0, 0.0, 1.0], 4, false);
        close(g4[0], 0.5 / ((1.0f64 / 3.0).sqrt() + GROUP_STD_EPS));
        let dr = grpo_advantages(&[1.0, 0.0, 0.0, 1.0], 4, true);
        assert_eq!(dr, vec![0.5, -0.5, -0.5, 0.5]);
    }

    #[test]
    fn gae_matches_hand_values() {
        // rewards [0, 0, 1], values [0.5, 0.6, 0.7], γ=0.9, λ=0.8:
        // δ2 = 1 − 0.7 = 0.3;            A2 = 0.3
        // δ1 = 0 + 0.9·0.7 − 0.6 = 0.03;  A1 = 0.03 + 0.72·0.3 = 0.246
        // δ0 = 0 + 0.9·0.6 − 0.5 = 0.04;  A0 = 0.04 + 0.72·0.246 = 0.21712
        let (a, r) = gae(&[0.0, 0.0, 1.0], &[0.5, 0.6, 0.7], 0.9, 0.8);
        close(a[2], 0.3);
        close(a[1], 0.246);
        close(a[0], 0.21712);
        close(r[0], 0.71712);
        close(r[2], 1.0);
        // γ = λ = 1 with zero values: every advantage is the return to go.
        let (a, _) = gae(&[1.0, 2.0, 3.0], &[0.0; 3], 1.0, 1.0);
        assert_eq!(a, vec![6.0, 5.0, 3.0]);
    }

    #[test]
    fn ppo_token_rewards_put_the_score_on_the_last_token() {
        assert_eq!(ppo_token_rewards(1.0, &[0.5, 1.0], 0.1), vec![-0.05, -0.1 + 1.0]);
    }

    #[test]
    fn kl_estimators_match_hand_values() {
        let (logp, reference) = (-1.0, -1.5); // log r = 0.5
        let (k1, d1) = kl(logp, reference, KlKind::K1);
        close(k1, 0.5);
        close(d1, 1.0);
        let (k2, d2) = kl(logp, reference, KlKind::K2);
        close(k2, 0.125);
        close(d2, 0.5);
        let (k3, d3) = kl(logp, reference, KlKind::K3);
        close(k3, (-0.5f64).exp() - 1.0 + 0.5);
        close(d3, 1.0 - (-0.5f64).exp());
        // k3 is never negative and is clamped far from the reference.
        assert!(kl(-3.0, -1.0, KlKind::K3).0 >= 0.0);
        assert_eq!(kl(-20.0, 0.0, KlKind::K3), (K3_CLAMP, 0.0));
    }

    #[test]
    fn clipped_surrogate_and_dual_clip() {
        let clip = Clip { eps_low: 0.2, eps_high: 0.28, dual: Some(3.0) };
        // ratio 1: unclipped, loss −A, gradient −A.
        let t = policy_loss(-1.0, -1.0, 2.0, &clip);
        close(t.loss, -2.0);
        close(t.grad, -2.0);
        assert!(!t.clipped);
        // A > 0, ratio 1.5 > 1.28: clipped at 1.28, no gradient.
        let t = policy_loss(1.5f64.ln(), 0.0, 1.0, &clip);
        close(t.loss, -1.28);
        close(t.grad, 0.0);
        assert!(t.clipped);
        // A < 0, ratio 0.5 < 0.8: the clipped branch −A·0.8 = 0.8 is the larger, no gradient.
        let t = policy_loss(0.5f64.ln(), 0.0, -1.0, &clip);
        close(t.loss, 0.8);
        assert!(t.clipped && !t.dual_clipped);
        close(t.grad, 0.0);
        // A < 0, ratio 5: −A·r = 5 exceeds c·|A| = 3, so the dual clip binds at 3.
        let t = policy_loss(5f64.ln(), 0.0, -1.0, &clip);
        close(t.loss, 3.0);
        assert!(t.dual_clipped);
        close(t.grad, 0.0);
        // Without dual clip the same token costs 5 and keeps its gradient −A·r = 5.
        let t = policy_loss(5f64.ln(), 0.0, -1.0, &Clip { dual: None, ..clip });
        close(t.loss, 5.0);
        close(t.grad, 5.0);
        // Asymmetric: ratio 1.25 is inside (1 + 0.28) for A > 0.
        assert!(!policy_loss(1.25f64.ln(), 0.0, 1.0, &clip).clipped);
    }

    #[test]
    fn value_loss_is_clipped_around_the_old_value() {
        // v=1.0, old=0.0, R=0.0, ε=0.2: unclipped 0.5, clipped (0.2)²/2 = 0.02; max is unclipped.
        let (l, d, c) = value_loss(1.0, 0.0, 0.0, 0.2);
        close(l, 0.5);
        close(d, 1.0);
        assert!(!c);
        // v=1.0, old=0.0, R=2.0: unclipped ½·1 = .5, clipped ½·(1.8)² = 1.62 → clipped, no gradient.
        let (l, d, c) = value_loss(1.0, 0.0, 2.0, 0.2);
        close(l, 1.62);
        close(d, 0.0);
        assert!(c);
    }

    #[test]
    fn entropy_gradient_matches_finite_differences() {
        let z = [0.3, -1.2, 2.0, 0.0];
        let (h, g) = entropy(&z);
        close(entropy(&[0.0; 4]).0, 4f64.ln());
        for i in 0..z.len() {
            let mut zp = z;
            zp[i] += 1e-6;
            let num = (entropy(&zp).0 - h) / 1e-6;
            assert!((num - g[i]).abs() < 1e-5, "{i}: {num} vs {}", g[i]);
        }
    }

    #[test]
    fn aggregation_weights() {
        // Two sequences of 1 and 3 tokens.
        assert_eq!(token_weights(&[1, 3], Aggregation::TokenMean), vec![0.25, 0.25]);
        let w = token_weights(&[1, 3], Aggregation::SeqMeanTokenMean);
        close(w[0], 0.5);
        close(w[1], 0.5 / 3.0);
        assert_eq!(token_weights(&[1, 3], Aggregation::SeqMeanTokenSum), vec![0.5, 0.5]);
    }

    #[test]
    fn whitening_gives_zero_mean_unit_variance() {
        let mut v = vec![vec![1.0, 2.0], vec![3.0, 4.0]];
        whiten(&mut v);
        let flat: Vec<f64> = v.into_iter().flatten().collect();
        close(flat.iter().sum::<f64>(), 0.0);
        let var = flat.iter().map(|x| x * x).sum::<f64>() / 3.0;
        assert!((var - 1.0).abs() < 1e-6);
    }
}
