//! The built-in trainer: log-probs, values and training on its device buffers, its weights packed
//! for the rollout, and its whole state saved, exported and imported.

use super::*;

/// The first bytes of an `export_state` file.
const STATE_MAGIC: &[u8; 16] = b"tms-trainer-st1\n";

pub(super) struct Trainer {
    pub(super) c: Common,
    pub(super) grads: Vec<Buf>,
    pub(super) adam_m: Vec<Buf>,
    pub(super) adam_v: Vec<Buf>,
    pub(super) reference: Vec<Buf>,
    pub(super) loss: LossConfig,
    pub(super) adam: Adam,
    pub(super) optimizer_steps: u64,
    /// Host copy of the weights taken after each train (slime's weight backuper): what
    /// update_weights sends while the trainer sleeps.
    pub(super) snapshot: Vec<Vec<u8>>,
    /// backup = false: the trainer's own copy of its state across a sleep.
    pub(super) saved: Option<Vec<Vec<u8>>>,
}

impl Trainer {
    fn all_state(&self) -> Vec<Buf> {
        let mut v = self.c.weights.clone();
        v.extend(&self.grads);
        v.extend(&self.adam_m);
        v.extend(&self.adam_v);
        v.extend(&self.reference);
        v.extend(self.c.pads.iter().map(|p| p.buf));
        v
    }

    pub(super) fn take_snapshot(&mut self) -> Result<(), Failure> {
        self.snapshot = self.c.weight_entries().iter().map(|e| read_all(&self.c.dev, *e)).collect::<Result<_, _>>()?;
        Ok(())
    }

    fn check_tokens<'a>(&self, samples: impl IntoIterator<Item = (&'a [u32], &'a [u32])>) -> Result<(), Failure> {
        for (p, r) in samples {
            if p.len() + r.len() > self.c.shape.context + 1
                || p.iter().chain(r).any(|t| *t as usize >= self.c.shape.vocab)
            {
                return Err(bad("a sample does not fit the model's context or vocabulary"));
            }
        }
        Ok(())
    }

    /// Per token of every sample, under the actor's or the reference's weights.
    fn token_scores(&self, model: Model, samples: &[protocol::Pair]) -> Result<Vec<Vec<model::TokenScore>>, Failure> {
        self.check_tokens(samples.iter().map(|s| (&s.prompt[..], &s.response[..])))?;
        let which = if model == Model::Ref { &self.reference } else { &self.c.weights };
        let params = self.c.read_params(which)?;
        let pol = Policy { shape: self.c.shape, params: &params };
        Ok(samples.iter().map(|s| pol.score(&s.prompt, &s.response, self.loss.temperature)).collect())
    }

    fn log_probs(&self, p: LogProbsParams) -> Result<LogProbsReply, Failure> {
        let t0 = crate::run::clock::Instant::now();
        let scores = self.token_scores(p.model, &p.samples)?;
        self.c.pace_trainer(t0, p.token_scale, pair_tokens(&p.samples), p.modelled_tokens, &FIGURES.stages.log_probs);
        let pick = |f: fn(&model::TokenScore) -> f64| scores.iter().map(|s| s.iter().map(f).collect()).collect();
        Ok(LogProbsReply { logprobs: pick(|s| s.logprob), entropy: pick(|s| s.entropy) })
    }

    fn values(&self, p: SamplesParams) -> Result<ValuesReply, Failure> {
        let t0 = crate::run::clock::Instant::now();
        let scores = self.token_scores(Model::Actor, &p.samples)?;
        self.c.pace_trainer(t0, p.token_scale, pair_tokens(&p.samples), p.modelled_tokens, &FIGURES.stages.values);
        Ok(ValuesReply { values: scores.iter().map(|s| s.iter().map(|t| t.value).collect()).collect() })
    }

    fn save_state(&mut self) -> Result<Ack, Failure> {
        let state = self.all_state().iter().map(|b| read_all(&self.c.dev, *b)).collect::<Result<_, _>>()?;
        self.saved = Some(state);
        Ok(Ack {})
    }

    fn load_state(&mut self) -> Result<Ack, Failure> {
        let saved = self.saved.take().ok_or_else(|| bad("load_state without save_state"))?;
        for (b, data) in self.all_state().iter().zip(&saved) {
            self.c.dev.write(b.ptr, data).map_err(dev_err)?;
        }
        Ok(Ack {})
    }

    /// Elastic mode's reverse lend: everything train() reads (the weights, the gradients'
    /// buffers, Adam's moments, the reference, the profile's memory, the optimizer's step count)
    /// to `path`, through the host as a checkpoint would go.
    fn export_state(&self, p: &protocol::StateFile) -> Result<Ack, Failure> {
        use std::io::Write as _;
        let io = |e: std::io::Error| bad(format!("export_state {}: {e}", p.path.display()));
        let mut f = std::io::BufWriter::new(std::fs::File::create(&p.path).map_err(io)?);
        let bufs = self.all_state();
        f.write_all(STATE_MAGIC).map_err(io)?;
        f.write_all(&self.optimizer_steps.to_le_bytes()).map_err(io)?;
        f.write_all(&(bufs.len() as u64).to_le_bytes()).map_err(io)?;
        for b in bufs {
            f.write_all(&b.bytes.to_le_bytes()).map_err(io)?;
            f.write_all(&read_all(&self.c.dev, b)?).map_err(io)?;
        }
        f.flush().map_err(io)?;
        Ok(Ack {})
    }

    /// A lent trainer takes the state `export_state` wrote: after it, its train() computes what
    /// the trainer's does, byte for byte.
    fn import_state(&mut self, p: &protocol::StateFile) -> Result<Ack, Failure> {
        use std::io::Read as _;
        let io = |e: std::io::Error| bad(format!("import_state {}: {e}", p.path.display()));
        let mut f = std::io::BufReader::new(std::fs::File::open(&p.path).map_err(io)?);
        let mut magic = [0u8; STATE_MAGIC.len()];
        f.read_exact(&mut magic).map_err(io)?;
        let word = |f: &mut std::io::BufReader<std::fs::File>| -> Result<u64, Failure> {
            let mut w = [0u8; 8];
            f.read_exact(&mut w).map_err(io)?;
            Ok(u64::from_le_bytes(w))
        };
        let steps = word(&mut f)?;
        let bufs = self.all_state();
        let layout = "import_state: the file is not the state of a trainer of this layout (shape, memory profile)";
        if magic != *STATE_MAGIC || word(&mut f)? != bufs.len() as u64 {
            return Err(bad(layout));
        }
        let mut data = Vec::new();
        for b in bufs {
            if word(&mut f)? != b.bytes {
                return Err(bad(layout));
            }
            data.resize(b.bytes as usize, 0);
            f.read_exact(&mut data).map_err(io)?;
            self.c.dev.write(b.ptr, &data).map_err(dev_err)?;
        }
        self.optimizer_steps = steps;
        self.take_snapshot()?;
        Ok(Ack {})
    }

    pub(super) fn handle(&mut self, method: &str, p: &Value) -> Result<Value, Failure> {
        match method {
            LogProbs::NAME => answer::<LogProbs>(p, |p| self.log_probs(p)),
            Values::NAME => answer::<Values>(p, |p| self.values(p)),
            Train::NAME => answer::<Train>(p, |p| self.train(p)),
            protocol::SaveState::NAME => answer::<protocol::SaveState>(p, |_| self.save_state()),
            protocol::LoadState::NAME => answer::<protocol::LoadState>(p, |_| self.load_state()),
            protocol::ExportState::NAME => answer::<protocol::ExportState>(p, |p| self.export_state(&p)),
            protocol::ImportState::NAME => answer::<protocol::ImportState>(p, |p| self.import_state(&p)),
            _ => Err(("unknown_method".into(), format!("trainer has no method {method:?}"))),
        }
    }

    fn train(&mut self, p: TrainParams) -> Result<TrainReply, Failure> {
        let t0 = crate::run::clock::Instant::now();
        let samples: Vec<TrainSample> = p.samples;
        let tokens: usize = samples.iter().map(|s| s.prompt.len() + s.response.len()).sum();
        let minibatches = p.minibatches.max(1);
        let epochs = p.epochs.max(1);
        for (i, s) in samples.iter().enumerate() {
            s.check(self.loss.value_coef > 0.0).map_err(|e| bad(format!("train sample {i}: {e}")))?;
        }
        self.check_tokens(samples.iter().map(|s| (&s.prompt[..], &s.response[..])))?;
        let n = model::param_count(&self.c.shape);
        let mut params = self.c.read_params(&self.c.weights)?;
        let mut m = self.c.read_params(&self.adam_m)?;
        let mut v = self.c.read_params(&self.adam_v)?;
        let mut metrics = model::LossMetrics::default();
        let mut grad_norm = 0.0;
        let mut updates = 0;
        let per = samples.len().div_ceil(minibatches).max(1);
        for _ in 0..epochs {
            for mb in samples.chunks(per) {
                let mut grad = vec![0.0; n];
                let lm = model::loss(&Policy { shape: self.c.shape, params: &params }, mb, &self.loss, Some(&mut grad));
                // Gradients go through their device buffers, as a trainer's would.
                let g32: Vec<f32> = grad.iter().map(|g| *g as f32).collect();
                self.c.write_params(&self.grads, &g32)?;
                let mut g_back = vec![0f32; n];
                let mut at = 0;
                for b in &self.grads {
                    let k = b.bytes as usize / 4;
                    self.c.dev.read_f32(&mut g_back[at..at + k], b.ptr).map_err(dev_err)?;
                    at += k;
                }
                let grad: Vec<f64> = g_back.iter().map(|g| *g as f64).collect();
                self.optimizer_steps += 1;
                grad_norm += model::adam_step(&self.adam, self.optimizer_steps, &mut params, &grad, &mut m, &mut v);
                updates += 1;
                accumulate(&mut metrics, &lm);
            }
        }
        self.c.write_params(&self.c.weights, &params)?;
        self.c.write_params(&self.adam_m, &m)?;
        self.c.write_params(&self.adam_v, &v)?;
        // The profile's trainer state changes every step as a real one's would: stamp the step
        // into every allocation so update_weights and the checksums see new contents.
        let stamp = (p.step ^ 0x5EED_0000_0000).to_le_bytes();
        for pad in &self.c.pads {
            self.c.dev.write(pad.buf.ptr, &stamp[..(pad.buf.bytes as usize).min(8)]).map_err(dev_err)?;
        }
        self.take_snapshot()?;
        let (replicas, modelled_tokens) = (p.replicas, p.modelled_tokens);
        let share = |m: &ComputeModel| {
            let devices = replicas.unwrap_or(m.trainers);
            match modelled_tokens {
                Some(t) => m.stage_modelled_seconds(&FIGURES.stages.train, t * epochs as f64, devices),
                None => m.stage_seconds(&FIGURES.stages.train, tokens * epochs, devices),
            }
        };
        let modelled = self.c.compute.map(|m| share(&m.scaled(p.token_scale)));
        self.c.pace(t0, p.token_scale, share);
        let modelled = self.c.compute.zip(modelled).map(|(m, s)| (replicas.unwrap_or(m.trainers), s));
        Ok(train_reply(&metrics, grad_norm, updates, modelled))
    }
}

/// The train request's reply: the loss terms and grad norm averaged over the optimizer's updates,
/// their count, the tokens, and (with modelled compute) the replicas the stage was shared by and
/// the seconds it was paced at.
fn train_reply(m: &model::LossMetrics, grad_norm: f64, updates: usize, modelled: Option<(f64, f64)>) -> TrainReply {
    let k = updates as f64;
    let means = [
        ("loss", m.loss),
        ("pg_loss", m.pg_loss),
        ("kl", m.kl),
        ("ppo_kl", m.ppo_kl),
        ("entropy", m.entropy),
        ("value_loss", m.value_loss),
        ("clip_frac", m.clip_frac),
        ("dual_clip_frac", m.dual_clip_frac),
        ("value_clip_frac", m.value_clip_frac),
        ("tis_weight_mean", m.is_weight),
        ("grad_norm", grad_norm),
    ];
    let mut out: std::collections::BTreeMap<String, Option<f64>> =
        means.into_iter().map(|(name, sum)| (name.to_string(), Some(sum / k))).collect();
    out.insert("optimizer_steps".into(), Some(k));
    out.insert("tokens".into(), Some(m.tokens as f64));
    // Modelled compute: what the request was paced at, and over how many replicas (elastic's
    // lent trainers add to init's).
    if let Some((replicas, seconds)) = modelled {
        out.insert("replicas".into(), Some(replicas));
        out.insert("modelled_s".into(), Some(seconds));
    }
    TrainReply(out)
}

/// Prompt and response tokens of every sequence.
fn pair_tokens(samples: &[protocol::Pair]) -> usize {
    samples.iter().map(|s| s.prompt.len() + s.response.len()).sum()
}

fn accumulate(into: &mut model::LossMetrics, m: &model::LossMetrics) {
    into.loss += m.loss;
    into.pg_loss += m.pg_loss;
    into.kl += m.kl;
    into.ppo_kl += m.ppo_kl;
    into.entropy += m.entropy;
    into.value_loss += m.value_loss;
    into.clip_frac += m.clip_frac;
    into.dual_clip_frac += m.dual_clip_frac;
    into.value_clip_frac += m.value_clip_frac;
    into.is_weight += m.is_weight;
    into.tokens += m.tokens;
}

fn read_all(dev: &Device, b: Buf) -> Result<Vec<u8>, Failure> {
    let mut v = vec![0u8; b.bytes as usize];
    for (i, chunk) in v.chunks_mut(CHUNK).enumerate() {
        dev.read(chunk, b.ptr + (i * CHUNK) as u64).map_err(dev_err)?;
    }
    Ok(v)
}
