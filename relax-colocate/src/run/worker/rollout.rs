//! The built-in rollout engine: generation through its KV cache and logits workspace, in
//! segments bounded in tokens or modelled time, and the weights it receives.

use super::*;
use crate::run::admission::Admission;

pub(super) struct Rollout {
    pub(super) c: Common,
    /// hidden_pre of every sequence in flight, f64 (the KV cache of this policy).
    pub(super) kv: Buf,
    /// Logits of every sequence at the current token (the graph workspace).
    pub(super) workspace: Buf,
    pub(super) max_batch: usize,
}

impl Rollout {
    pub(super) fn handle(&mut self, method: &str, p: &Value) -> Result<Value, Failure> {
        match method {
            Generate::NAME => answer::<Generate>(p, |p| self.generate(p)),
            _ => Err(("unknown_method".into(), format!("rollout has no method {method:?}"))),
        }
    }

    fn generate(&mut self, p: GenerateParams) -> Result<GenerateReply, Failure> {
        let GenerateParams {
            prompts,
            n,
            max_new_tokens: max_new,
            temperature,
            eos,
            seed,
            responses,
            segment_tokens,
            prefix_cached,
            cached,
            token_scale,
            segment_s,
            progress,
            sequence_seeds,
            ..
        } = p;
        let s = self.c.shape;
        let batch = prompts.len() * n;
        self.check_request(&prompts, &responses, batch, max_new)?;
        check_partial(segment_s, &progress, &sequence_seeds, batch)?;
        let segment = segment_tokens.unwrap_or(max_new).max(1);
        let t0 = std::time::Instant::now();
        let prefill = prefill_tokens(&prompts, &responses, &progress, n, Cached { all: prefix_cached, each: &cached });
        // Weights come from device memory every time: that is what update_weights wrote.
        let params = self.c.read_params(&self.c.weights)?;
        let pol = Policy { shape: s, params: &params };
        let (mut kv_host, mut seqs, before) = prefill_cache(&pol, &prompts, &responses, n);
        self.c.dev.write(self.kv.ptr, as_bytes(&kv_host)).map_err(dev_err)?;
        let mut rng = Rng::new(seed);
        let mut logits_host = vec![0f64; batch * s.vocab];
        // Decoding in modelled steps: without a compute model a task token is one free step, so
        // every live sequence samples at each step, as the budget (which only a model gives a
        // cost to) never binds.
        let model = self.c.compute.map(|m| m.scaled(token_scale));
        let mut pacer = Pacer::new(model.map_or(1.0, |m| m.token_scale), model.and(segment_s));
        let mut done = if model.is_some() && !progress.is_empty() { progress } else { vec![0.0; batch] };
        let mut emitted = vec![0usize; batch];
        let scale = model.map_or(1.0, |m| m.token_scale);
        let capacity = model.and_then(|m| m.kv_capacity_tokens).map(|c| c / scale);
        let mut admission = Admission::new(batch, self.max_batch, capacity, scale);
        let mut recomputed = 0;
        loop {
            let live: Vec<bool> = seqs.iter().zip(&emitted).map(|(q, e)| !q.3 && *e < segment).collect();
            let contexts: Vec<usize> = seqs.iter().map(|q| prompts[q.0].len() + q.1.len()).collect();
            let (live, again) = admission.schedule(&live, &contexts);
            recomputed += again;
            let (active, context) =
                contexts.iter().zip(&live).filter(|(_, l)| **l).fold((0, 0), |(a, c), (n, _)| (a + 1, c + n));
            if active == 0 {
                break;
            }
            let step_s = model.map_or(0.0, |m| m.decode_step_seconds(active, context));
            let spent_before = pacer.spent;
            let advanced = pacer.advance(&mut done, &live, step_s);
            admission.ran(pacer.last_steps, pacer.spent - spent_before, active);
            let Some(now) = advanced else { break };
            self.c.dev.read(as_bytes_mut(&mut kv_host), self.kv.ptr).map_err(dev_err)?;
            let sample_now =
                Sampling { pol: &pol, prompts: &prompts, temperature, eos, max_new, seeds: &sequence_seeds };
            sample_now.step(&now, &mut kv_host, &mut logits_host, &mut seqs, &mut rng, |logits| {
                self.c.dev.write(self.workspace.ptr, as_bytes(logits)).map_err(dev_err)?;
                self.c.dev.read(as_bytes_mut(logits), self.workspace.ptr).map_err(dev_err)
            })?;
            for &i in &now {
                emitted[i] += 1;
            }
            self.c.dev.write(self.kv.ptr, as_bytes(&kv_host)).map_err(dev_err)?;
        }
        // Prefill is compute-bound like the trainer's passes, a preempted sequence's again on its
        // readmission; decoding is charged step by step.
        let decode_s = pacer.spent;
        let prefilled = prefill + recomputed;
        self.c.pace(t0, token_scale, |m| m.stage_seconds(&FIGURES.stages.prefill, prefilled, 1.0) + decode_s);
        let samples = generated(seqs, &before, &done, max_new);
        Ok(GenerateReply { samples, decode: Some(admission.stats) })
    }

    /// A generate request this engine can serve: within its batch, context and vocabulary.
    fn check_request(
        &self,
        prompts: &[Vec<u32>],
        responses: &[Vec<u32>],
        batch: usize,
        max_new: usize,
    ) -> Result<(), Failure> {
        let s = self.c.shape;
        if batch > self.max_batch {
            return Err(bad(format!("{batch} sequences exceed the max_batch {} given at init", self.max_batch)));
        }
        if prompts.iter().any(|pr| pr.len() + max_new > s.context + 1 || pr.iter().any(|t| *t as usize >= s.vocab)) {
            return Err(bad("a prompt does not fit the model's context or vocabulary"));
        }
        if !responses.is_empty() && responses.len() != batch {
            return Err(bad(format!("responses has {} entries for {batch} sequences", responses.len())));
        }
        if responses.iter().any(|r| r.len() >= max_new || r.iter().any(|t| *t as usize >= s.vocab)) {
            return Err(bad("a response prefix is already max_new_tokens long or leaves the vocabulary"));
        }
        Ok(())
    }
}

/// What a segmented request may carry: a budget of positive seconds; carried steps and seeds one
/// per sequence, each step count finite and >= 0.
fn check_partial(segment_s: Option<f64>, progress: &[f64], seeds: &[u64], batch: usize) -> Result<(), Failure> {
    if segment_s.is_some_and(|b| !(b > 0.0 && b.is_finite())) {
        return Err(bad(format!("segment_s must be a positive number of seconds, not {}", segment_s.unwrap_or(0.0))));
    }
    for (name, n) in [("progress", progress.len()), ("sequence_seeds", seeds.len())] {
        if n != 0 && n != batch {
            return Err(bad(format!("{name} has {n} entries for {batch} sequences")));
        }
    }
    if let Some(p) = progress.iter().find(|p| !(**p >= 0.0 && p.is_finite())) {
        return Err(bad(format!("progress {p} is not a count of modelled decode steps (finite, >= 0)")));
    }
    Ok(())
}

/// What sampling a decode step needs besides the engine's buffers.
struct Sampling<'a> {
    pol: &'a Policy<'a>,
    prompts: &'a [Vec<u32>],
    temperature: f64,
    eos: Option<u32>,
    max_new: usize,
    /// Per sequence, when the request gives them: its own stream, keyed by token position.
    seeds: &'a [u64],
}

impl Sampling<'_> {
    /// The sequences `now` complete a token: their logits (through the engine's workspace, by
    /// `stage`), a token each in order, their caches grown by it.
    fn step(
        &self,
        now: &[usize],
        kv_host: &mut [f64],
        logits_host: &mut [f64],
        seqs: &mut [Sequence],
        rng: &mut Rng,
        stage: impl FnOnce(&mut [f64]) -> Result<(), Failure>,
    ) -> Result<(), Failure> {
        let (h, vocab) = (self.pol.shape.hidden, self.pol.shape.vocab);
        for &i in now {
            let e = self.pol.head(&kv_host[i * h..(i + 1) * h]);
            logits_host[i * vocab..(i + 1) * vocab].copy_from_slice(&e.logits);
        }
        stage(logits_host)?;
        for &i in now {
            let q = &mut seqs[i];
            let logits = &logits_host[i * vocab..(i + 1) * vocab];
            let (tok, logp) = match self.seeds.get(i) {
                Some(seed) => sample(logits, self.temperature, &mut token_rng(*seed, q.1.len())),
                None => sample(logits, self.temperature, rng),
            };
            let pos = self.prompts[q.0].len() + q.1.len();
            q.1.push(tok as u32);
            q.2.push(logp);
            q.3 = Some(tok as u32) == self.eos || q.1.len() == self.max_new;
            if !q.3 {
                for (a, w) in kv_host[i * h..(i + 1) * h].iter_mut().zip(self.pol.embed_row(pos, tok as u32)) {
                    *a += *w as f64;
                }
            }
        }
        Ok(())
    }
}

/// Which continued sequences' prefixes the engine holds: `each` (the request's `cached`) when
/// given, else `all` (its `prefix_cached`) for every one.
#[derive(Clone, Copy)]
struct Cached<'a> {
    all: bool,
    each: &'a [bool],
}

/// Tokens a request prefills: the prompts and prefixes, a continued sequence's only when its
/// cache is gone (`cached` says it is not), a new sequence's (no response yet, and no steps
/// towards its first token: one with steps was prefilled by the segment that made them) always.
/// This engine recomputes its small cache anyway; the model charges what one that keeps it would.
fn prefill_tokens(prompts: &[Vec<u32>], responses: &[Vec<u32>], progress: &[f64], n: usize, held: Cached) -> usize {
    if responses.is_empty() {
        return n * prompts.iter().map(Vec::len).sum::<usize>();
    }
    let begun = |k: usize| !responses[k].is_empty() || progress.get(k).is_some_and(|p| *p > 0.0);
    let kept = |k: usize| if held.each.is_empty() { held.all } else { held.each.get(k).copied().unwrap_or(false) };
    let cached = |k: usize| kept(k) && begun(k);
    (0..responses.len()).filter(|k| !cached(*k)).map(|k| prompts[k].len() + responses[k].len()).sum()
}

/// One sequence of a request: its prompt's index, its response so far, the log-probabilities of
/// the tokens this request generated, and whether it has finished.
type Sequence = (usize, Vec<u32>, Vec<f64>, bool);

/// The reply's samples: each sequence's new tokens (after the `before` it came with), and for one
/// still unfinished the modelled steps it has done towards its next token.
fn generated(seqs: Vec<Sequence>, before: &[usize], done: &[f64], max_new: usize) -> Vec<Generated> {
    seqs.into_iter()
        .zip(before)
        .zip(done)
        .map(|(((prompt_index, response, logprobs, finished), &k), &steps)| {
            let finished = finished || response.len() >= max_new;
            Generated {
                prompt_index,
                response: response[k..].to_vec(),
                logprobs,
                finished,
                progress: if finished { 0.0 } else { steps },
            }
        })
        .collect()
}

/// The KV cache of every sequence (the prompt's hidden_pre, plus its prefix for a continued one,
/// as re-prefilling it under the new weights after an interruption would: SGLang and verl drop the
/// old cache), the sequences, and the tokens each had before this request.
fn prefill_cache(
    pol: &Policy,
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    n: usize,
) -> (Vec<f64>, Vec<Sequence>, Vec<usize>) {
    let h = pol.shape.hidden;
    let batch = prompts.len() * n;
    let mut kv_host = vec![0f64; batch * h];
    let mut seqs: Vec<Sequence> = Vec::with_capacity(batch);
    let mut before: Vec<usize> = Vec::with_capacity(batch);
    for (pi, pr) in prompts.iter().enumerate() {
        let pre = pol.hidden_pre(pr);
        for _ in 0..n {
            let k = seqs.len();
            let row = &mut kv_host[k * h..(k + 1) * h];
            row.copy_from_slice(&pre);
            let prefix = responses.get(k).map(Vec::as_slice).unwrap_or(&[]);
            for (j, tok) in prefix.iter().enumerate() {
                for (a, w) in row.iter_mut().zip(pol.embed_row(pr.len() + j, *tok)) {
                    *a += *w as f64;
                }
            }
            before.push(prefix.len());
            seqs.push((pi, prefix.to_vec(), Vec::new(), false));
        }
    }
    (kv_host, seqs, before)
}

/// The stream a sequence of seed `seed` draws its `position`-th response token from.
pub(crate) fn token_rng(seed: u64, position: usize) -> Rng {
    Rng::new(Rng::new(seed ^ (position as u64).rotate_left(32)).next_u64())
}

/// Draws a token from `logits` at `temperature`: the token and its log-probability.
pub(crate) fn sample(logits: &[f64], temperature: f64, rng: &mut Rng) -> (usize, f64) {
    let scaled: Vec<f64> = logits.iter().map(|z| z / temperature).collect();
    let (logp, probs) = crate::run::algo::log_softmax(&scaled);
    let mut u = rng.uniform();
    let mut tok = probs.len() - 1;
    for (j, pj) in probs.iter().enumerate() {
        if u < *pj {
            tok = j;
            break;
        }
        u -= pj;
    }
    (tok, logp[tok])
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Cached = Cached { all: true, each: &[] };
    const NONE: Cached = Cached { all: false, each: &[] };

    #[test]
    fn a_sequence_with_steps_towards_its_first_token_is_not_prefilled_again() {
        let prompts = vec![vec![1, 2, 3], vec![4, 5], vec![6]];
        let responses = vec![vec![7], vec![], vec![]];
        // Cached: only the new sequence (no tokens, no steps) is prefilled; the second sequence's
        // steps came from a segment that prefilled its prompt.
        assert_eq!(prefill_tokens(&prompts, &responses, &[0.0, 40.0, 0.0], 1, ALL), 1);
        assert_eq!(prefill_tokens(&prompts, &responses, &[], 1, ALL), 2 + 1);
        // After an update every continued sequence is prefilled again, with its prefix.
        assert_eq!(prefill_tokens(&prompts, &responses, &[0.0, 40.0, 0.0], 1, NONE), 4 + 2 + 1);
        // A fresh request: every prompt, n times.
        assert_eq!(prefill_tokens(&prompts, &[], &[], 2, ALL), 2 * 6);
    }

    #[test]
    fn only_the_sequences_whose_prefix_moved_to_this_engine_are_prefilled_again() {
        let prompts = vec![vec![1, 2, 3], vec![4, 5], vec![6]];
        let responses = vec![vec![7], vec![8, 9], vec![10]];
        // The second sequence's group came from another engine: its prompt and prefix only. The
        // request-wide flag is false then (a worker that predates `cached` prefills all three).
        let each = [true, false, true];
        assert_eq!(prefill_tokens(&prompts, &responses, &[], 1, Cached { all: false, each: &each }), 2 + 2);
        assert_eq!(prefill_tokens(&prompts, &responses, &[], 1, NONE), 4 + 4 + 2);
        // A new sequence is prefilled whatever its flag says.
        let fresh = vec![vec![7], vec![], vec![10]];
        assert_eq!(prefill_tokens(&prompts, &fresh, &[], 1, Cached { all: false, each: &[true, true, true] }), 2);
    }
}
