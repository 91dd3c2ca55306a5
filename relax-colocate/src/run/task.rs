//! The verifiable task shipped with the runner: addition of two numbers written digit by digit.
//! A prompt is `a + b =` with each operand zero-padded to `digits` digits; the answer is the sum
//! without leading zeros followed by EOS. The verifier compares the response with the answer.

use serde::{Deserialize, Serialize};

pub const PLUS: u32 = 10;
pub const EQUALS: u32 = 11;
pub const EOS: u32 = 12;
pub const VOCAB: usize = 13;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RewardKind {
    /// 1 for the exact answer, else 0.
    Exact,
    /// The share of answer positions the response gets right (the exact answer scores 1), so a
    /// policy learns from near misses; the pass rate still counts exact answers only.
    Partial,
}

#[derive(Debug, Clone, Copy)]
pub struct Addition {
    pub digits: u32,
    /// A response's token limit; 0: the longest answer and its EOS.
    pub max_new: usize,
}

impl Addition {
    pub fn new(digits: u32, max_new: usize) -> Addition {
        Addition { digits, max_new }
    }

    pub fn prompt_len(&self) -> usize {
        2 * self.digits as usize + 2
    }

    /// Longest answer (digits + 1 for the carry) plus EOS, or the configured limit: a longer one
    /// leaves a policy room to ramble, which gives its responses the long tail of real RL jobs.
    pub fn max_new_tokens(&self) -> usize {
        if self.max_new > 0 { self.max_new } else { self.answer_limit() }
    }

    pub fn answer_limit(&self) -> usize {
        self.digits as usize + 2
    }

    pub fn operand_limit(&self) -> u64 {
        10u64.pow(self.digits)
    }

    pub fn prompt(&self, a: u64, b: u64) -> Vec<u32> {
        let mut p = digits_of(a, self.digits as usize);
        p.push(PLUS);
        p.extend(digits_of(b, self.digits as usize));
        p.push(EQUALS);
        p
    }

    pub fn operands(&self, prompt: &[u32]) -> (u64, u64) {
        let d = self.digits as usize;
        let num = |s: &[u32]| s.iter().fold(0u64, |acc, t| acc * 10 + *t as u64);
        (num(&prompt[..d]), num(&prompt[d + 1..2 * d + 1]))
    }

    pub fn answer(&self, a: u64, b: u64) -> Vec<u32> {
        let mut s: Vec<u32> = (a + b).to_string().bytes().map(|c| (c - b'0') as u32).collect();
        s.push(EOS);
        s
    }

    /// (reward, exact match) for a response to `prompt`.
    pub fn score(&self, prompt: &[u32], response: &[u32], kind: RewardKind) -> (f64, bool) {
        let (a, b) = self.operands(prompt);
        let answer = self.answer(a, b);
        let exact = response == answer.as_slice();
        let reward = match kind {
            RewardKind::Exact => f64::from(u8::from(exact)),
            RewardKind::Partial => {
                let hits = answer.iter().zip(response).filter(|(x, y)| x == y).count();
                hits as f64 / answer.len().max(response.len()) as f64
            }
        };
        (reward, exact)
    }
}

fn digits_of(v: u64, width: usize) -> Vec<u32> {
    format!("{v:0width$}").bytes().map(|c| (c - b'0') as u32).collect()
}

/// SplitMix64: small, seedable and good enough for sampling prompts and tokens reproducibly.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_answers_and_scores() {
        let t = Addition::new(1, 0);
        let p = t.prompt(7, 8);
        assert_eq!(p, vec![7, PLUS, 8, EQUALS]);
        assert_eq!(t.operands(&p), (7, 8));
        assert_eq!(t.answer(7, 8), vec![1, 5, EOS]);
        assert_eq!(t.score(&p, &[1, 5, EOS], RewardKind::Exact), (1.0, true));
        assert_eq!(t.score(&p, &[1, 5], RewardKind::Exact), (0.0, false));
        assert_eq!(t.score(&p, &[1, 4, EOS], RewardKind::Partial), (2.0 / 3.0, false));
        assert_eq!(t.score(&p, &[1, 5, EOS], RewardKind::Partial), (1.0, true));
        assert_eq!(t.score(&p, &[5, EOS], RewardKind::Partial), (0.0, false));
        let t2 = Addition::new(2, 0);
        assert_eq!(t2.prompt(7, 45), vec![0, 7, PLUS, 4, 5, EQUALS]);
        assert_eq!(t2.operands(&t2.prompt(7, 45)), (7, 45));
        assert_eq!(t2.max_new_tokens(), 4);
        assert_eq!(Addition::new(2, 32).max_new_tokens(), 32);
    }

    #[test]
    fn rng_is_reproducible_and_uniform_enough() {
        let mut a = Rng::new(5);
        let mut b = Rng::new(5);
        assert_eq!(a.next_u64(), b.next_u64());
        let mean = (0..10_000).map(|_| a.uniform()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }
}
