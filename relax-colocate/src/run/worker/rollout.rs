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

    /// A generate request: checked, prefilled, decoded, paced to its modelled time, answered.
    fn generate(&mut self, p: GenerateParams) -> Result<GenerateReply, Failure> {
        let model = self.c.compute.map(|m| m.scaled(p.token_scale));
        let drawn = self.check_generate(&p, model.is_some())?;
        let t0 = crate::run::clock::Instant::now();
        let mut decoding = Decoding::new(&p, model, drawn, self.max_batch);
        let held = Cached { all: p.prefix_cached, each: &p.cached };
        let prefill = prefill_tokens(&p.prompts, &p.responses, &p.progress, p.n, held, drawn.then_some(decoding.scale));
        // Weights come from device memory every time: that is what update_weights wrote.
        let params = self.c.read_params(&self.c.weights)?;
        let pol = Policy { shape: self.c.shape, params: &params };
        let (kv_host, mut seqs, before) = prefill_cache(&pol, &p.prompts, &p.responses, p.n);
        if drawn {
            // A continued sequence whose task response already ended only decodes in the model.
            for q in &mut seqs {
                q.3 = q.1.last().is_some_and(|t| Some(*t) == p.eos) || q.1.len() >= p.max_new_tokens;
            }
        }
        self.c.dev.write(self.kv.ptr, as_bytes(&kv_host)).map_err(dev_err)?;
        self.decode(&mut decoding, &pol, &p, &mut seqs, kv_host)?;
        // Prefill is compute-bound like the trainer's passes, a preempted sequence's again on its
        // readmission; decoding is charged step by step.
        let decode_s = decoding.pacer.spent;
        let prefilled = prefill + decoding.recomputed;
        self.c.pace(t0, p.token_scale, |m| {
            m.stage_modelled_seconds(&FIGURES.stages.prefill, prefilled * m.token_scale, 1.0) + decode_s
        });
        Ok(decoding.reply(seqs, &before, p.max_new_tokens))
    }

    /// Every check a generate request must pass, in the order its refusals are reported; returns
    /// whether it carries drawn lengths.
    fn check_generate(&self, p: &GenerateParams, modelled: bool) -> Result<bool, Failure> {
        let batch = p.prompts.len() * p.n;
        // Drawn lengths (compute.lengths) are modelled steps: without a model they mean nothing.
        let drawn = check_lengths(&p.lengths, batch, modelled)?;
        self.check_request(&p.prompts, &p.responses, batch, p.max_new_tokens, drawn)?;
        check_partial(p.segment_s, &p.progress, &p.sequence_seeds, batch)?;
        Ok(drawn)
    }

    /// Decodes until no sequence has a step left in this request, or its budget runs out. The
    /// caches and logits live in the engine's device buffers (its state is device memory, as a
    /// real engine's is): every sampled token reads and writes them there.
    fn decode(
        &self,
        d: &mut Decoding,
        pol: &Policy,
        p: &GenerateParams,
        seqs: &mut [Sequence],
        mut kv_host: Vec<f64>,
    ) -> Result<(), Failure> {
        let mut rng = Rng::new(p.seed);
        let mut logits_host = vec![0f64; seqs.len() * pol.shape.vocab];
        let sampling = Sampling {
            pol,
            prompts: &p.prompts,
            temperature: p.temperature,
            eos: p.eos,
            max_new: p.max_new_tokens,
            seeds: &p.sequence_seeds,
        };
        loop {
            let (live, active, context) = d.admit(&p.prompts, seqs);
            if active == 0 {
                break;
            }
            let Some(now) = d.advance(&live, active, context, &p.lengths, seqs) else { break };
            if now.is_empty() {
                continue;
            }
            self.c.dev.read(as_bytes_mut(&mut kv_host), self.kv.ptr).map_err(dev_err)?;
            sampling.step(&now, &mut kv_host, &mut logits_host, seqs, &mut rng, |logits| {
                self.c.dev.write(self.workspace.ptr, as_bytes(logits)).map_err(dev_err)?;
                self.c.dev.read(as_bytes_mut(logits), self.workspace.ptr).map_err(dev_err)
            })?;
            self.c.dev.write(self.kv.ptr, as_bytes(&kv_host)).map_err(dev_err)?;
        }
        Ok(())
    }

    /// A generate request this engine can serve: within its batch, context and vocabulary.
    fn check_request(
        &self,
        prompts: &[Vec<u32>],
        responses: &[Vec<u32>],
        batch: usize,
        max_new: usize,
        drawn: bool,
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
        // With drawn lengths a task response that reached max_new_tokens may still be decoding.
        let full = |r: &Vec<u32>| r.len() > max_new || (r.len() == max_new && !drawn);
        if responses.iter().any(|r| full(r) || r.iter().any(|t| *t as usize >= s.vocab)) {
            return Err(bad("a response prefix is already max_new_tokens long or leaves the vocabulary"));
        }
        Ok(())
    }
}

/// Whether a request carries drawn lengths (compute.lengths), and that they are one per sequence,
/// each a finite number of modelled steps >= 1, under a compute model.
fn check_lengths(lengths: &[f64], batch: usize, modelled: bool) -> Result<bool, Failure> {
    if lengths.is_empty() {
        return Ok(false);
    }
    if !modelled {
        return Err(bad("lengths are modelled decode steps: they need init's `compute` (compute.model)"));
    }
    if lengths.len() != batch {
        return Err(bad(format!("lengths has {} entries for {batch} sequences", lengths.len())));
    }
    if let Some(l) = lengths.iter().find(|l| !(**l >= 1.0 && l.is_finite())) {
        return Err(bad(format!("length {l} is not a response length in modelled decode steps (finite, >= 1)")));
    }
    Ok(true)
}

/// With drawn lengths: a sequence `done` steps into its decode stops next at its next task token
/// (every `scale` steps from its start) or at its `length`, whichever comes first.
fn next_event(done: f64, length: f64, scale: f64) -> f64 {
    let tolerance = FIGURES.token_tolerance * scale;
    let token = ((done + tolerance) / scale).floor() + 1.0;
    (token * scale).min(length)
}

/// With drawn lengths: runs the `live` batch to its next event, a sequence's next task token or
/// its length (`next_event`), one task step costing `step_s`; `done` counts each sequence's
/// modelled steps since its start. Marks the sequences whose length is decoded `ended` and counts
/// each task token's steps in `emitted` (what segment_tokens bounds); returns the sequences that
/// sample a task token now: those at a token whose task response (`seqs`) is still open, and one
/// whose length ended before its first token (a sample has a response to score). None: the
/// budget ran out first.
#[allow(clippy::too_many_arguments)]
fn advance_drawn(
    pacer: &mut Pacer,
    done: &mut [f64],
    live: &[bool],
    step_s: f64,
    lengths: &[f64],
    ended: &mut [bool],
    emitted: &mut [usize],
    seqs: &[Sequence],
) -> Option<Vec<usize>> {
    let scale = pacer.scale();
    let targets: Vec<f64> = (0..done.len()).map(|i| next_event(done[i], lengths[i], scale)).collect();
    let reached = pacer.advance_to(done, live, &targets, step_s)?;
    let tolerance = pacer.tolerance_steps();
    let mut sample = Vec::new();
    for i in reached {
        done[i] = targets[i];
        ended[i] = done[i] >= lengths[i] - tolerance;
        let first = ended[i] && seqs[i].1.is_empty();
        if on_token(done[i], scale, tolerance) || first {
            emitted[i] += 1;
            // A task response that ended (EOS, max_new_tokens) decodes on in the model, unsampled.
            if !seqs[i].3 {
                sample.push(i);
            }
        }
    }
    Some(sample)
}

/// Whether `done` steps from a sequence's start fall on a task token (within `tolerance`).
fn on_token(done: f64, scale: f64, tolerance: f64) -> bool {
    let r = done - (done / scale).round() * scale;
    done > 0.0 && r.abs() <= tolerance
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

/// Where a generate request's decoding stands, in modelled steps. Without a compute model a task
/// token is one free step, so every live sequence samples at each step, as the budget (which only
/// a model gives a cost to) never binds.
struct Decoding {
    model: Option<ComputeModel>,
    /// The request carries drawn lengths (compute.lengths).
    drawn: bool,
    /// Modelled steps per task token (1 without a model).
    scale: f64,
    /// Task tokens a sequence may complete in this request.
    segment: usize,
    pacer: Pacer,
    /// With drawn lengths each sequence's steps since its start, otherwise its steps towards its
    /// next task token.
    done: Vec<f64>,
    /// Task tokens each sequence completed in this request (what `segment` bounds).
    emitted: Vec<usize>,
    /// With drawn lengths: the sequences whose modelled length is decoded.
    ended: Vec<bool>,
    admission: Admission,
    /// Task tokens prefilled again: preempted sequences' contexts on their readmission.
    recomputed: f64,
}

impl Decoding {
    fn new(p: &GenerateParams, model: Option<ComputeModel>, drawn: bool, max_batch: usize) -> Decoding {
        let batch = p.prompts.len() * p.n;
        let scale = model.map_or(1.0, |m| m.token_scale);
        // With drawn lengths a sequence decodes past its task response, so only a segment bounds it.
        let segment = match p.segment_tokens {
            Some(t) => t.max(1),
            None if drawn => usize::MAX,
            None => p.max_new_tokens.max(1),
        };
        let carried = model.is_some() && !p.progress.is_empty();
        let capacity = model.and_then(|m| m.kv_capacity_tokens).map(|c| c / scale);
        Decoding {
            model,
            drawn,
            scale,
            segment,
            pacer: Pacer::new(scale, model.and(p.segment_s)),
            done: if carried { p.progress.clone() } else { vec![0.0; batch] },
            emitted: vec![0; batch],
            ended: vec![false; batch],
            admission: Admission::new(batch, max_batch, capacity, scale),
            recomputed: 0.0,
        }
    }

    /// The sequences the next step runs (those with a step left in this request, as far as the
    /// engine's slots and KV capacity admit them), how many, and their contexts in all.
    fn admit(&mut self, prompts: &[Vec<u32>], seqs: &[Sequence]) -> (Vec<bool>, usize, f64) {
        let batch = seqs.len();
        let open = |i: usize| if self.drawn { !self.ended[i] } else { !seqs[i].3 };
        let live: Vec<bool> = (0..batch).map(|i| open(i) && self.emitted[i] < self.segment).collect();
        // KV in task-token units, as the capacity is: a drawn length's steps over the scale.
        let held = |i: usize| if self.drawn { self.done[i] / self.scale } else { seqs[i].1.len() as f64 };
        let contexts: Vec<f64> = (0..batch).map(|i| prompts[seqs[i].0].len() as f64 + held(i)).collect();
        let (live, again) = self.admission.schedule(&live, &contexts);
        self.recomputed += again;
        let (active, context) =
            contexts.iter().zip(&live).filter(|(_, l)| **l).fold((0, 0.0), |(a, c), (n, _)| (a + 1, c + n));
        (live, active, context)
    }

    /// Runs the `live` batch of `active` sequences to its next event; returns the sequences that
    /// sample a task token now (None: the budget ran out first).
    fn advance(
        &mut self,
        live: &[bool],
        active: usize,
        context: f64,
        lengths: &[f64],
        seqs: &[Sequence],
    ) -> Option<Vec<usize>> {
        let step_s = self.model.map_or(0.0, |m| m.decode_step_seconds(active, context));
        let spent_before = self.pacer.spent;
        let advanced = if self.drawn {
            let emitted = &mut self.emitted;
            advance_drawn(&mut self.pacer, &mut self.done, live, step_s, lengths, &mut self.ended, emitted, seqs)
        } else {
            self.pacer.advance(&mut self.done, live, step_s).inspect(|now| {
                for &i in now {
                    self.emitted[i] += 1;
                }
            })
        };
        // Whether or not the budget ran out: the steps it paid for ran.
        self.admission.ran(self.pacer.last_steps, self.pacer.spent - spent_before, active);
        advanced
    }

    /// The reply: each sequence's new tokens, whether it finished, the steps an unfinished one
    /// carries on, and the engine's decode figures.
    fn reply(self, seqs: Vec<Sequence>, before: &[usize], max_new: usize) -> GenerateReply {
        let finished: Vec<bool> =
            if self.drawn { self.ended } else { seqs.iter().map(|q| q.3 || q.1.len() >= max_new).collect() };
        let samples = generated(seqs, before, &self.done, &finished);
        GenerateReply { samples, decode: Some(self.admission.stats) }
    }
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
/// With drawn lengths (`scale` given) a prefix is its modelled steps over the scale, in task-token
/// units like the rest: a response that ended keeps growing in the model.
/// This engine recomputes its small cache anyway; the model charges what one that keeps it would.
fn prefill_tokens(
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    progress: &[f64],
    n: usize,
    held: Cached,
    scale: Option<f64>,
) -> f64 {
    if responses.is_empty() {
        return (n * prompts.iter().map(Vec::len).sum::<usize>()) as f64;
    }
    let begun = |k: usize| !responses[k].is_empty() || progress.get(k).is_some_and(|p| *p > 0.0);
    let kept = |k: usize| if held.each.is_empty() { held.all } else { held.each.get(k).copied().unwrap_or(false) };
    let cached = |k: usize| kept(k) && begun(k);
    let prefix = |k: usize| match scale {
        Some(s) => progress.get(k).copied().unwrap_or(0.0) / s,
        None => responses[k].len() as f64,
    };
    (0..responses.len()).filter(|k| !cached(*k)).map(|k| prompts[k].len() as f64 + prefix(k)).sum()
}

/// One sequence of a request: its prompt's index, its response so far, the log-probabilities of
/// the tokens this request generated, and whether it has finished.
type Sequence = (usize, Vec<u32>, Vec<f64>, bool);

/// The reply's samples: each sequence's new tokens (after the `before` it came with), and for one
/// still unfinished the modelled steps it carries to the request that continues it.
fn generated(seqs: Vec<Sequence>, before: &[usize], done: &[f64], finished: &[bool]) -> Vec<Generated> {
    seqs.into_iter()
        .zip(before)
        .zip(done)
        .zip(finished)
        .map(|((((prompt_index, response, logprobs, _), &k), &steps), &finished)| Generated {
            prompt_index,
            response: response[k..].to_vec(),
            logprobs,
            finished,
            progress: if finished { 0.0 } else { steps },
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

    use crate::run::protocol::ComputeModel;

    /// A 4B model at 300 modelled steps per task token, no memory floor: a decode step's cost
    /// depends on the active sequences alone, so sums are easy to state.
    fn flops_only() -> ComputeModel {
        ComputeModel {
            forward_flops_per_token: 8.0e9,
            tflops: 989.0,
            train_mfu: 0.4,
            rollout_mfu: 0.3,
            token_scale: 100.0,
            trainers: 1.0,
            hbm_gbps: None,
            weight_bytes: 8.0e9,
            kv_bytes_per_token: 147_456.0,
            decode_step_ms: 2.0,
            kv_capacity_tokens: None,
        }
    }

    /// Decodes sequences whose task responses end after `task[i]` tokens to drawn `lengths` (as
    /// generate's loop does, sampling a dummy token for each sequence it is told to), in requests
    /// of `budget` modelled seconds. Returns the seconds charged, each sequence's task tokens and
    /// its steps at the end.
    fn decode_drawn(
        m: &ComputeModel,
        task: &[usize],
        lengths: &[f64],
        budget: Option<f64>,
    ) -> (f64, Vec<usize>, Vec<f64>) {
        let n = task.len();
        let mut seqs: Vec<Sequence> = (0..n).map(|i| (i, Vec::new(), Vec::new(), false)).collect();
        let (mut done, mut ended, mut charged) = (vec![0.0; n], vec![false; n], 0.0);
        let mut requests = 0;
        while ended.iter().any(|e| !e) {
            requests += 1;
            assert!(requests < 1000, "no progress");
            let mut pacer = Pacer::new(m.token_scale, budget);
            let mut emitted = vec![0; n];
            loop {
                let live: Vec<bool> = ended.iter().map(|e| !e).collect();
                let active = live.iter().filter(|l| **l).count();
                if active == 0 {
                    break;
                }
                let step_s = m.decode_step_seconds(active, 0.0);
                let advanced =
                    advance_drawn(&mut pacer, &mut done, &live, step_s, lengths, &mut ended, &mut emitted, &seqs);
                let Some(now) = advanced else { break };
                for i in now {
                    seqs[i].1.push(1);
                    seqs[i].3 = seqs[i].1.len() == task[i];
                }
            }
            charged += pacer.spent;
        }
        (charged, seqs.iter().map(|q| q.1.len()).collect(), done)
    }

    #[test]
    fn a_sequence_decodes_to_its_drawn_length_whatever_its_task_response() {
        let m = flops_only();
        // A long length with a short task response (2 tokens) decodes on; a short length cuts a
        // long response (9 tokens wanted, 250 steps give 2); one under a token still gets one.
        let (seconds, tokens, steps) = decode_drawn(&m, &[2, 9, 9], &[1000.0, 250.0, 40.0], None);
        assert_eq!(tokens, vec![2, 2, 1]);
        assert_eq!(steps, vec![1000.0, 250.0, 40.0], "each ends exactly at its length");
        // Three sequences for 40 steps, two to 250, one to 1000; each modelled step costs its
        // batch's FLOPs and the fixed latency.
        let per_step = |active: usize| m.decode_step_seconds(active, 0.0) / m.token_scale;
        let want = 40.0 * per_step(3) + 210.0 * per_step(2) + 750.0 * per_step(1);
        assert!((seconds - want).abs() < 1e-9 * want, "{seconds} s, by hand {want} s");
    }

    #[test]
    fn segments_split_a_drawn_length_without_losing_or_repeating_steps() {
        let m = flops_only();
        let (whole_s, whole_tokens, _) = decode_drawn(&m, &[3, 9], &[1000.0, 650.0], None);
        for budget in [0.05, 0.3, 1.7] {
            let (split_s, tokens, steps) = decode_drawn(&m, &[3, 9], &[1000.0, 650.0], Some(budget));
            assert_eq!(tokens, whole_tokens, "budget {budget}");
            assert_eq!(steps, vec![1000.0, 650.0], "budget {budget}");
            assert!((split_s - whole_s).abs() < 1e-9 * whole_s, "budget {budget}: {split_s} s against {whole_s} s");
        }
    }

    #[test]
    fn drawn_lengths_are_one_per_sequence_under_a_model() {
        assert_eq!(check_lengths(&[], 3, false).map_err(|e| e.1), Ok(false));
        assert_eq!(check_lengths(&[5.0, 7.0], 2, true).map_err(|e| e.1), Ok(true));
        assert!(check_lengths(&[5.0], 1, false).unwrap_err().1.contains("need init's `compute`"));
        assert!(check_lengths(&[5.0], 2, true).unwrap_err().1.contains("lengths has 1 entries for 2 sequences"));
        assert!(check_lengths(&[0.0], 1, true).unwrap_err().1.contains("length 0 is not a response length"));
        // A continued sequence's prefix counts its modelled steps, not its task tokens.
        let prompts = vec![vec![1, 2], vec![3]];
        let responses = vec![vec![4], vec![5]];
        assert_eq!(prefill_tokens(&prompts, &responses, &[350.0, 50.0], 1, NONE, Some(100.0)), 2.0 + 3.5 + 1.0 + 0.5);
    }

    #[test]
    fn a_sequence_with_steps_towards_its_first_token_is_not_prefilled_again() {
        let prompts = vec![vec![1, 2, 3], vec![4, 5], vec![6]];
        let responses = vec![vec![7], vec![], vec![]];
        // Cached: only the new sequence (no tokens, no steps) is prefilled; the second sequence's
        // steps came from a segment that prefilled its prompt.
        assert_eq!(prefill_tokens(&prompts, &responses, &[0.0, 40.0, 0.0], 1, ALL, None), (1) as f64);
        assert_eq!(prefill_tokens(&prompts, &responses, &[], 1, ALL, None), (2 + 1) as f64);
        // After an update every continued sequence is prefilled again, with its prefix.
        assert_eq!(prefill_tokens(&prompts, &responses, &[0.0, 40.0, 0.0], 1, NONE, None), (4 + 2 + 1) as f64);
        // A fresh request: every prompt, n times.
        assert_eq!(prefill_tokens(&prompts, &[], &[], 2, ALL, None), (2 * 6) as f64);
    }

    #[test]
    fn only_the_sequences_whose_prefix_moved_to_this_engine_are_prefilled_again() {
        let prompts = vec![vec![1, 2, 3], vec![4, 5], vec![6]];
        let responses = vec![vec![7], vec![8, 9], vec![10]];
        // The second sequence's group came from another engine: its prompt and prefix only. The
        // request-wide flag is false then (a worker that predates `cached` prefills all three).
        let each = [true, false, true];
        assert_eq!(
            prefill_tokens(&prompts, &responses, &[], 1, Cached { all: false, each: &each }, None),
            (2 + 2) as f64
        );
        assert_eq!(prefill_tokens(&prompts, &responses, &[], 1, NONE, None), (4 + 4 + 2) as f64);
        // A new sequence is prefilled whatever its flag says.
        let fresh = vec![vec![7], vec![], vec![10]];
        assert_eq!(
            prefill_tokens(&prompts, &fresh, &[], 1, Cached { all: false, each: &[true, true, true] }, None),
            (2) as f64
        );
    }
}
