//! The built-in trainer and rollout workers (`relax-colocate worker`), speaking the worker
//! protocol. Their state lives in device memory allocated through the vendor runtime under the
//! preloaded hook: the trainer's weights, gradients, Adam moments and reference copy, the rollout's
//! weights, KV cache and logits workspace, plus the memory profile's allocations. Compute runs on
//! the CPU, staged through memcpy, so the same code runs on a GPU, an NPU and the simulator.

use super::broadcast;
use super::device::{DevError, Device, Hasher};
use super::ipc;
use super::model::{self, Adam, LossConfig, Policy, Shape, TrainSample};
use super::pacer::Pacer;
use super::protocol::{
    self, Ack, BroadcastWeights, BucketParams, BucketReply, Checksum, ChecksumReply, ComputeModel, Generate,
    GenerateParams, GenerateReply, Generated, GroupDestroy, GroupId, GroupInit, Init, InitParams, InitReply, IpcClose,
    IpcCopy, IpcExport, IpcImport, IpcPack, IpcPid, IpcPidReply, LogProbs, LogProbsParams, LogProbsReply, Method,
    Model, Pack, SamplesParams, Shutdown, Train, TrainParams, TrainReply, Unpack, UpdateBegin, UpdateBeginParams,
    UpdateBeginReply, UpdateEnd, Values, ValuesReply,
};
use super::task::Rng;
use super::wire;
use serde_json::Value;

const CHUNK: usize = 16 << 20;

pub(super) type Failure = (String, String);

pub(super) fn dev_err(e: DevError) -> Failure {
    match e {
        DevError::OutOfMemory(m) => ("oom".into(), m),
        DevError::Other(m) => ("device".into(), m),
    }
}

fn bad(msg: impl Into<String>) -> Failure {
    ("bad_request".into(), msg.into())
}

/// Reads a request's params as `M`'s.
fn params<M: Method>(p: &Value) -> Result<M::Params, Failure> {
    protocol::decode(p.clone()).map_err(|e| bad(format!("{}: {e}", M::NAME)))
}

/// Answers a request with `M`'s params and reply types.
fn answer<M: Method>(p: &Value, f: impl FnOnce(M::Params) -> Result<M::Reply, Failure>) -> Result<Value, Failure> {
    let reply = f(params::<M>(p)?)?;
    Ok(serde_json::to_value(reply).expect("replies serialize"))
}

/// A device allocation and what it is for.
#[derive(Clone, Copy)]
struct Buf {
    ptr: u64,
    bytes: u64,
}

struct Pad {
    tag: String,
    buf: Buf,
}

struct Common {
    dev: Device,
    shape: Shape,
    /// Policy tensors (layout order) of the weights the other side must match.
    weights: Vec<Buf>,
    pads: Vec<Pad>,
    transfer: Option<Transfer>,
    hog: Vec<u64>,
    compute: Option<ComputeModel>,
    /// The weight-sync group of the broadcast transport, once joined.
    group: Option<crate::collective::Group>,
    /// The IPC transport's buffer while an update is under way.
    ipc: Option<ipc::Shared>,
}

struct Transfer {
    map: *mut u8,
    map_len: usize,
    bucket_bytes: u64,
    device_buf: Buf,
}

impl Common {
    fn alloc(&mut self, bytes: u64, tag: &str, backup: bool) -> Result<Buf, Failure> {
        let ptr = self.dev.malloc(bytes, Some(tag), backup).map_err(dev_err)?;
        Ok(Buf { ptr, bytes })
    }

    fn alloc_tensors(&mut self, tag: &str, backup: bool) -> Result<Vec<Buf>, Failure> {
        model::layout(&self.shape).iter().map(|(_, n)| self.alloc((*n * 4) as u64, tag, backup)).collect()
    }

    /// Allocates the profile's memory and fills it with a pattern that is different in every
    /// chunk of every allocation, so a lost or misplaced page changes the checksum.
    fn alloc_profile(&mut self, memory: &[(String, Vec<u64>)], backup: bool, seed: u64) -> Result<(), Failure> {
        let mut pattern = vec![0u8; CHUNK];
        let mut rng = Rng::new(seed);
        for w in pattern.chunks_exact_mut(8) {
            w.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        for (tag, sizes) in memory {
            for &size in sizes {
                let buf = self.alloc(size, tag, backup)?;
                let id = self.pads.len() as u64;
                let mut off = 0u64;
                while off < size {
                    let n = (size - off).min(CHUNK as u64) as usize;
                    pattern[..8].copy_from_slice(&((id << 32) ^ (off / CHUNK as u64) ^ seed).to_le_bytes());
                    self.dev.write(buf.ptr + off, &pattern[..n]).map_err(dev_err)?;
                    off += n as u64;
                }
                self.pads.push(Pad { tag: tag.clone(), buf });
            }
        }
        Ok(())
    }

    /// The weights as the other side must hold them: policy tensors, then the profile's weights.
    fn weight_entries(&self) -> Vec<Buf> {
        let mut v = self.weights.clone();
        v.extend(self.pads.iter().filter(|p| p.tag == "weights").map(|p| p.buf));
        v
    }

    fn checksum(&self) -> Result<ChecksumReply, Failure> {
        let mut h = Hasher::default();
        let mut host = vec![0u8; CHUNK];
        let mut total = 0u64;
        for e in self.weight_entries() {
            let mut off = 0;
            while off < e.bytes {
                let n = (e.bytes - off).min(CHUNK as u64) as usize;
                self.dev.read(&mut host[..n], e.ptr + off).map_err(dev_err)?;
                h.update(&host[..n]);
                off += n as u64;
            }
            total += e.bytes;
        }
        Ok(ChecksumReply { weights: h.hex(), bytes: Some(total) })
    }

    fn read_params(&self, bufs: &[Buf]) -> Result<Vec<f32>, Failure> {
        let mut out = vec![0f32; model::param_count(&self.shape)];
        let mut at = 0;
        for b in bufs {
            let n = b.bytes as usize / 4;
            self.dev.read_f32(&mut out[at..at + n], b.ptr).map_err(dev_err)?;
            at += n;
        }
        Ok(out)
    }

    fn write_params(&self, bufs: &[Buf], v: &[f32]) -> Result<(), Failure> {
        let mut at = 0;
        for b in bufs {
            let n = b.bytes as usize / 4;
            self.dev.write_f32(b.ptr, &v[at..at + n]).map_err(dev_err)?;
            at += n;
        }
        Ok(())
    }

    fn update_begin(&mut self, p: UpdateBeginParams) -> Result<UpdateBeginReply, Failure> {
        let path = p.shm.display();
        let bucket_bytes =
            Some(p.bucket_bytes).filter(|b| *b > 0).ok_or_else(|| bad("bucket_bytes must be positive"))?;
        let total: u64 = self.weight_entries().iter().map(|e| e.bytes).sum();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p.shm)
            .map_err(|e| bad(format!("cannot open {path}: {e}")))?;
        let map_len = file.metadata().map_err(|e| bad(e.to_string()))?.len() as usize;
        let span = bucket_bytes.min(total).max(1);
        if (map_len as u64) < span {
            return Err(bad(format!("{path} holds {map_len} bytes, a bucket needs {span}")));
        }
        // SAFETY: a shared mapping of a regular file we opened read/write, unmapped in update_end.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(("internal".into(), format!("mmap {path}: {}", std::io::Error::last_os_error())));
        }
        // The transfer buffer lives outside every region: it must not be paused, and on GPUs it
        // is what CUDA IPC would export (VMM memory cannot be).
        let ptr = match self.dev.malloc(span, None, false) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the mapping made above.
                unsafe { libc::munmap(map, map_len) };
                return Err(dev_err(e));
            }
        };
        self.transfer = Some(Transfer { map: map.cast(), map_len, bucket_bytes, device_buf: Buf { ptr, bytes: span } });
        Ok(UpdateBeginReply { buckets: Some(total.div_ceil(bucket_bytes)), bytes: Some(total) })
    }

    fn update_end(&mut self) -> Result<Ack, Failure> {
        if let Some(t) = self.transfer.take() {
            // SAFETY: the mapping made in update_begin.
            unsafe { libc::munmap(t.map.cast(), t.map_len) };
            self.dev.free(t.device_buf.ptr).map_err(dev_err)?;
        }
        Ok(Ack {})
    }

    /// The pieces of bucket `i`: (entry, offset in entry, offset in bucket, length), the entry
    /// as its index in `weight_entries`.
    fn bucket_pieces(&self, i: u64, entries: &[Buf]) -> Result<Vec<(usize, u64, u64, u64)>, Failure> {
        let t = self.transfer.as_ref().ok_or_else(|| bad("no update_begin"))?;
        let sizes: Vec<u64> = entries.iter().map(|e| e.bytes).collect();
        let pieces = broadcast::bucket_pieces(&sizes, t.bucket_bytes, i);
        if pieces.is_empty() {
            return Err(bad(format!("bucket {i} is past the end of the weights")));
        }
        Ok(pieces)
    }

    #[allow(clippy::mut_from_ref)]
    fn shm(&self, len: u64) -> &mut [u8] {
        let t = self.transfer.as_ref().expect("checked by bucket_pieces");
        // SAFETY: the mapping is map_len bytes and len ≤ the bucket span ≤ map_len; the runner
        // lets one side touch it at a time.
        unsafe { std::slice::from_raw_parts_mut(t.map, len as usize) }
    }

    /// The methods both roles answer alike (`COMMON`).
    fn handle(&mut self, method: &str, p: &Value) -> Result<Value, Failure> {
        let api = self.dev.api_name();
        match method {
            Checksum::NAME => answer::<Checksum>(p, |_| self.checksum()),
            UpdateBegin::NAME => answer::<UpdateBegin>(p, |p| self.update_begin(p)),
            GroupId::NAME => answer::<GroupId>(p, |p| broadcast::group_id(api, p)),
            GroupInit::NAME => answer::<GroupInit>(p, |p| broadcast::group_init(api, p, &mut self.group)),
            BroadcastWeights::NAME => answer::<BroadcastWeights>(p, |p| {
                let entries: Vec<(u64, u64)> = self.weight_entries().iter().map(|e| (e.ptr, e.bytes)).collect();
                broadcast::broadcast_weights(&self.dev, self.group.as_ref(), &entries, p)
            }),
            IpcClose::NAME => answer::<IpcClose>(p, |_| ipc::close(&self.dev, &mut self.ipc)),
            GroupDestroy::NAME => {
                answer::<GroupDestroy>(p, |_| broadcast::group_destroy(&mut self.group).map(|()| Ack {}))
            }
            _ => answer::<UpdateEnd>(p, |_| self.update_end()),
        }
    }

    /// Modelled compute: a request that began at `t0` lasts at least what `modelled` says the
    /// device would take (nothing without a compute model).
    /// `token_scale`: the request's own, when responses grow over the run.
    fn pace(&self, t0: std::time::Instant, token_scale: Option<f64>, modelled: impl FnOnce(&ComputeModel) -> f64) {
        let Some(m) = &self.compute else { return };
        let modelled = std::time::Duration::from_secs_f64(modelled(&m.scaled(token_scale)));
        if let Some(rest) = modelled.checked_sub(t0.elapsed()) {
            std::thread::sleep(rest);
        }
    }

    /// The trainer's passes: `tokens` through `passes` forward-pass equivalents, the batch
    /// shared by the trainer replicas.
    fn pace_trainer(&self, t0: std::time::Instant, token_scale: Option<f64>, tokens: usize, passes: f64) {
        self.pace(t0, token_scale, |m| m.seconds(tokens, passes, m.train_mfu, m.trainers));
    }

    /// Both ends run whatever the first says: a failed IPC close must not leave the
    /// communicator open.
    fn leave(&mut self) -> Result<Ack, Failure> {
        let closed = ipc::close(&self.dev, &mut self.ipc);
        let destroyed = broadcast::group_destroy(&mut self.group);
        closed.and(destroyed.map(|()| Ack {}))
    }

    fn hog(&mut self, bytes: u64) -> Result<(), Failure> {
        let p = self.dev.malloc(bytes, None, false).map_err(dev_err)?;
        self.hog.push(p);
        Ok(())
    }
}

/// The first bytes of an `export_state` file.
const STATE_MAGIC: &[u8; 16] = b"tms-trainer-st1\n";

struct Trainer {
    c: Common,
    grads: Vec<Buf>,
    adam_m: Vec<Buf>,
    adam_v: Vec<Buf>,
    reference: Vec<Buf>,
    loss: LossConfig,
    adam: Adam,
    optimizer_steps: u64,
    /// Host copy of the weights taken after each train (slime's weight backuper): what
    /// update_weights sends while the trainer sleeps.
    snapshot: Vec<Vec<u8>>,
    /// backup = false: the trainer's own copy of its state across a sleep.
    saved: Option<Vec<Vec<u8>>>,
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

    fn take_snapshot(&mut self) -> Result<(), Failure> {
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
        let t0 = std::time::Instant::now();
        let scores = self.token_scores(p.model, &p.samples)?;
        self.c.pace_trainer(t0, p.token_scale, pair_tokens(&p.samples), 1.0);
        let pick = |f: fn(&model::TokenScore) -> f64| scores.iter().map(|s| s.iter().map(f).collect()).collect();
        Ok(LogProbsReply { logprobs: pick(|s| s.logprob), entropy: pick(|s| s.entropy) })
    }

    fn values(&self, p: SamplesParams) -> Result<ValuesReply, Failure> {
        let t0 = std::time::Instant::now();
        let scores = self.token_scores(Model::Actor, &p.samples)?;
        self.c.pace_trainer(t0, p.token_scale, pair_tokens(&p.samples), 1.0);
        Ok(ValuesReply { values: scores.iter().map(|s| s.iter().map(|t| t.value).collect()).collect() })
    }

    fn pack(&mut self, p: BucketParams) -> Result<BucketReply, Failure> {
        let pieces = self.c.bucket_pieces(p.bucket, &self.c.weight_entries())?;
        let dbuf = self.c.transfer.as_ref().expect("checked").device_buf.ptr;
        let mut len = 0;
        for (idx, off, boff, n) in pieces {
            let src = &self.snapshot[idx][off as usize..(off + n) as usize];
            self.c.dev.write(dbuf + boff, src).map_err(dev_err)?;
            len = boff + n;
        }
        let shm = self.c.shm(len);
        self.c.dev.read(shm, dbuf).map_err(dev_err)?;
        Ok(BucketReply { bytes: Some(len) })
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

    fn handle(&mut self, method: &str, p: &Value) -> Result<Value, Failure> {
        match method {
            LogProbs::NAME => answer::<LogProbs>(p, |p| self.log_probs(p)),
            Values::NAME => answer::<Values>(p, |p| self.values(p)),
            Train::NAME => answer::<Train>(p, |p| self.train(p)),
            Pack::NAME => answer::<Pack>(p, |p| self.pack(p)),
            IpcExport::NAME => answer::<IpcExport>(p, |p| {
                let sizes: Vec<u64> = self.c.weight_entries().iter().map(|e| e.bytes).collect();
                ipc::export(&self.c.dev, &sizes, p, &mut self.c.ipc)
            }),
            IpcPack::NAME => answer::<IpcPack>(p, |p| ipc::pack(&self.c.dev, &self.c.ipc, &self.snapshot, p)),
            protocol::SaveState::NAME => answer::<protocol::SaveState>(p, |_| self.save_state()),
            protocol::LoadState::NAME => answer::<protocol::LoadState>(p, |_| self.load_state()),
            protocol::ExportState::NAME => answer::<protocol::ExportState>(p, |p| self.export_state(&p)),
            protocol::ImportState::NAME => answer::<protocol::ImportState>(p, |p| self.import_state(&p)),
            _ => Err(("unknown_method".into(), format!("trainer has no method {method:?}"))),
        }
    }

    fn train(&mut self, p: TrainParams) -> Result<TrainReply, Failure> {
        let t0 = std::time::Instant::now();
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
        let replicas = p.replicas;
        let share = |m: &ComputeModel| m.seconds(tokens * epochs, 3.0, m.train_mfu, replicas.unwrap_or(m.trainers));
        let modelled = self.c.compute.map(|m| share(&m.scaled(p.token_scale)));
        self.c.pace(t0, p.token_scale, share);
        let k = updates as f64;
        let m = &metrics;
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
        if let (Some(m), Some(s)) = (self.c.compute, modelled) {
            out.insert("replicas".into(), Some(replicas.unwrap_or(m.trainers)));
            out.insert("modelled_s".into(), Some(s));
        }
        Ok(TrainReply(out))
    }
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

struct Rollout {
    c: Common,
    /// hidden_pre of every sequence in flight, f64 (the KV cache of this policy).
    kv: Buf,
    /// Logits of every sequence at the current token (the graph workspace).
    workspace: Buf,
    max_batch: usize,
}

impl Rollout {
    fn handle(&mut self, method: &str, p: &Value) -> Result<Value, Failure> {
        match method {
            Generate::NAME => answer::<Generate>(p, |p| self.generate(p)),
            Unpack::NAME => answer::<Unpack>(p, |p| self.unpack(p)),
            IpcPid::NAME => answer::<IpcPid>(p, |_| Ok(IpcPidReply { pid: self.c.dev.ipc_pid().map_err(dev_err)? })),
            IpcImport::NAME => answer::<IpcImport>(p, |p| ipc::import(&self.c.dev, p, &mut self.c.ipc)),
            IpcCopy::NAME => answer::<IpcCopy>(p, |p| {
                let entries: Vec<(u64, u64)> = self.c.weight_entries().iter().map(|e| (e.ptr, e.bytes)).collect();
                ipc::copy(&self.c.dev, &self.c.ipc, &entries, p)
            }),
            _ => Err(("unknown_method".into(), format!("rollout has no method {method:?}"))),
        }
    }

    fn unpack(&mut self, p: BucketParams) -> Result<BucketReply, Failure> {
        let entries = self.c.weight_entries();
        let pieces = self.c.bucket_pieces(p.bucket, &entries)?;
        let len = pieces.last().map(|(_, _, boff, n)| boff + n).unwrap_or(0);
        let dbuf = self.c.transfer.as_ref().expect("checked").device_buf.ptr;
        let shm = self.c.shm(len);
        self.c.dev.write(dbuf, shm).map_err(dev_err)?;
        for (idx, off, boff, n) in pieces {
            self.c.dev.copy(entries[idx].ptr + off, dbuf + boff, n as usize).map_err(dev_err)?;
        }
        Ok(BucketReply { bytes: Some(len) })
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
        let prefill = prefill_tokens(&prompts, &responses, &progress, n, prefix_cached);
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
        loop {
            let live: Vec<bool> = seqs.iter().zip(&emitted).map(|(q, e)| !q.3 && *e < segment).collect();
            let (active, context) = seqs
                .iter()
                .zip(&live)
                .filter(|(_, l)| **l)
                .fold((0, 0), |(a, c), (q, _)| (a + 1, c + prompts[q.0].len() + q.1.len()));
            if active == 0 {
                break;
            }
            let step_s = model.map_or(0.0, |m| m.decode_step_seconds(active, context));
            let Some(now) = pacer.advance(&mut done, &live, step_s) else { break };
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
        // Prefill is compute-bound like the trainer's passes; decoding is charged step by step.
        let decode_s = pacer.spent;
        self.c.pace(t0, token_scale, |m| m.seconds(prefill, 1.0, m.train_mfu, 1.0) + decode_s);
        Ok(GenerateReply { samples: generated(seqs, &before, &done, max_new) })
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

/// Tokens a request prefills: the prompts and prefixes, a continued sequence's only when its
/// cache is gone (prefix_cached says it is not), a new sequence's (no response yet, and no steps
/// towards its first token: one with steps was prefilled by the segment that made them) always.
/// This engine recomputes its small cache anyway; the model charges what one that keeps it would.
fn prefill_tokens(
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    progress: &[f64],
    n: usize,
    prefix_cached: bool,
) -> usize {
    if responses.is_empty() {
        return n * prompts.iter().map(Vec::len).sum::<usize>();
    }
    let begun = |k: usize| !responses[k].is_empty() || progress.get(k).is_some_and(|p| *p > 0.0);
    let cached = |k: usize| prefix_cached && begun(k);
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
fn token_rng(seed: u64, position: usize) -> Rng {
    Rng::new(Rng::new(seed ^ (position as u64).rotate_left(32)).next_u64())
}

/// Draws a token from `logits` at `temperature`: the token and its log-probability.
fn sample(logits: &[f64], temperature: f64, rng: &mut Rng) -> (usize, f64) {
    let scaled: Vec<f64> = logits.iter().map(|z| z / temperature).collect();
    let (logp, probs) = super::algo::log_softmax(&scaled);
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

fn as_bytes(v: &[f64]) -> &[u8] {
    // SAFETY: f64 has no padding.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn as_bytes_mut(v: &mut [f64]) -> &mut [u8] {
    // SAFETY: f64 has no padding and every bit pattern is valid.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

enum Role {
    Trainer(Box<Trainer>),
    Rollout(Box<Rollout>),
}

fn init(role: &str, ip: InitParams) -> Result<(Role, InitReply), Failure> {
    if ip.shape.vocab == 0 || ip.shape.hidden == 0 || ip.shape.context == 0 {
        return Err(bad("shape must be non-zero"));
    }
    let device = i32::try_from(ip.device).map_err(|_| bad(format!("device {} is out of range", ip.device)))?;
    let dev = Device::open(&ip.api, device).map_err(|e| ("device".to_string(), e))?;
    let mut c = Common {
        dev,
        shape: ip.shape,
        weights: Vec::new(),
        pads: Vec::new(),
        transfer: None,
        hog: Vec::new(),
        compute: ip.compute,
        group: None,
        ipc: None,
    };
    let role = if role == "trainer" {
        let b = ip.backup;
        c.weights = c.alloc_tensors("weights", b)?;
        let params = model::init(&ip.shape, ip.seed);
        c.write_params(&c.weights, &params)?;
        let reference = c.alloc_tensors("ref", b)?;
        c.write_params(&reference, &params)?;
        let grads = c.alloc_tensors("grads", b)?;
        let adam_m = c.alloc_tensors("optimizer", b)?;
        let adam_v = c.alloc_tensors("optimizer", b)?;
        let zeros = vec![0f32; params.len()];
        for bufs in [&grads, &adam_m, &adam_v] {
            c.write_params(bufs, &zeros)?;
        }
        c.alloc_profile(&ip.memory, b, ip.seed)?;
        let mut t = Trainer {
            c,
            grads,
            adam_m,
            adam_v,
            reference,
            loss: ip.loss.ok_or_else(|| bad("trainer init needs loss"))?,
            adam: ip.adam.ok_or_else(|| bad("trainer init needs adam"))?,
            optimizer_steps: 0,
            snapshot: Vec::new(),
            saved: None,
        };
        t.take_snapshot()?;
        Role::Trainer(Box::new(t))
    } else {
        c.weights = c.alloc_tensors("weights", false)?;
        let max_batch = ip.max_batch.max(1);
        let kv = c.alloc((max_batch * ip.shape.hidden * 8) as u64, "kv_cache", false)?;
        let workspace = c.alloc((max_batch * ip.shape.vocab * 8) as u64, "cuda_graph", false)?;
        c.alloc_profile(&ip.memory, false, ip.seed)?;
        Role::Rollout(Box::new(Rollout { c, kv, workspace, max_batch }))
    };
    let common = match &role {
        Role::Trainer(t) => &t.c,
        Role::Rollout(r) => &r.c,
    };
    let (free, total) = common.dev.mem_info().map_err(dev_err)?;
    let params = model::param_count(&ip.shape) as u64;
    Ok((role, InitReply { params: Some(params), device_free: Some(free), device_total: Some(total) }))
}

/// Test hook (RELAX_WORKER_FAULT=METHOD:STEP:ACTION[:WHO], ACTION = crash | hang | hog; WHO
/// limits it to the trainers or the rollouts (a role), or to one worker (its TMS_NAME, e.g.
/// lent-rollout-0)): makes the failure paths of the runner testable. Never set in normal runs.
fn fault(role: &str, method: &str, p: &Value) -> Option<String> {
    let spec = std::env::var("RELAX_WORKER_FAULT").ok()?;
    let mut it = spec.split(':');
    let (m, step, action) = (it.next()?, it.next()?.parse::<u64>().ok()?, it.next()?);
    let name = std::env::var("TMS_NAME").unwrap_or_default();
    let for_me = it.next().is_none_or(|who| who == role || who == name);
    (m == method && p["step"].as_u64() == Some(step) && for_me).then(|| action.to_string())
}

/// The methods `Common::handle` answers for both roles.
const COMMON: [&str; 8] = [
    Checksum::NAME,
    UpdateBegin::NAME,
    UpdateEnd::NAME,
    GroupId::NAME,
    GroupInit::NAME,
    BroadcastWeights::NAME,
    GroupDestroy::NAME,
    IpcClose::NAME,
];

pub fn main(role: &str) -> Result<(), String> {
    if role != "trainer" && role != "rollout" {
        return Err(format!("worker role must be trainer or rollout, not {role:?}"));
    }
    let mut conn = wire::connect(role, "relax-colocate built-in")?;
    let mut state: Option<Role> = None;
    wire::serve(&mut conn, |method, p| {
        match fault(role, method, p).as_deref() {
            Some("crash") => std::process::abort(),
            Some("hang") => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
            Some("hog") => {
                let c = match state.as_mut() {
                    Some(Role::Trainer(t)) => &mut t.c,
                    Some(Role::Rollout(r)) => &mut r.c,
                    None => return Err(bad("hog before init")),
                };
                let (free, _) = c.dev.mem_info().map_err(dev_err)?;
                c.hog(free / 2)?;
            }
            _ => {}
        }
        match (method, state.as_mut()) {
            (Init::NAME, None) => answer::<Init>(p, |ip| {
                let (r, reply) = init(role, ip)?;
                state = Some(r);
                Ok(reply)
            }),
            (Init::NAME, Some(_)) => Err(bad("init was already called")),
            // A group still joined is left here, so that the other members' libraries see a
            // clean end rather than a vanished peer.
            (Shutdown::NAME, Some(Role::Trainer(t))) => answer::<Shutdown>(p, |_| t.c.leave()),
            (Shutdown::NAME, Some(Role::Rollout(r))) => answer::<Shutdown>(p, |_| r.c.leave()),
            (Shutdown::NAME, None) => answer::<Shutdown>(p, |_| Ok(Ack {})),
            (_, None) => Err(bad(format!("{method} before init"))),
            (m, Some(Role::Trainer(t))) if COMMON.contains(&m) => t.c.handle(method, p),
            (m, Some(Role::Rollout(r))) if COMMON.contains(&m) => r.c.handle(method, p),
            (m, Some(Role::Trainer(t))) => t.handle(m, p),
            (m, Some(Role::Rollout(r))) => r.handle(m, p),
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_with_steps_towards_its_first_token_is_not_prefilled_again() {
        let prompts = vec![vec![1, 2, 3], vec![4, 5], vec![6]];
        let responses = vec![vec![7], vec![], vec![]];
        // Cached: only the new sequence (no tokens, no steps) is prefilled; the second sequence's
        // steps came from a segment that prefilled its prompt.
        assert_eq!(prefill_tokens(&prompts, &responses, &[0.0, 40.0, 0.0], 1, true), 1);
        assert_eq!(prefill_tokens(&prompts, &responses, &[], 1, true), 2 + 1);
        // After an update every continued sequence is prefilled again, with its prefix.
        assert_eq!(prefill_tokens(&prompts, &responses, &[0.0, 40.0, 0.0], 1, false), 4 + 2 + 1);
        // A fresh request: every prompt, n times.
        assert_eq!(prefill_tokens(&prompts, &[], &[], 2, true), 2 * 6);
    }
}
