//! The built-in trainer and rollout workers (`relax-colocate worker`), speaking the worker
//! protocol. Their state lives in device memory allocated through the vendor runtime under the
//! preloaded hook: the trainer's weights, gradients, Adam moments and reference copy, the rollout's
//! weights, KV cache and logits workspace, plus the memory profile's allocations. Compute runs on
//! the CPU, staged through memcpy, so the same code runs on a GPU, an NPU and the simulator.

use super::answer::{Failure, answer, bad, dev_err};
use super::compute::{FIGURES, Stage};
use super::device::{Device, Hasher};
use super::model::{self, Adam, LossConfig, Policy, Shape, TrainSample};
use super::pacer::Pacer;
use super::protocol::{
    self, Ack, Checksum, ChecksumReply, ComputeModel, Generate, GenerateParams, GenerateReply, Generated, Init,
    InitParams, InitReply, LogProbs, LogProbsParams, LogProbsReply, Method, Model, SamplesParams, Shutdown, Train,
    TrainParams, TrainReply, Values, ValuesReply,
};
use super::task::Rng;
use super::transport::{self, Weights, WorkerHalf};
use super::wire;
use serde_json::Value;

const CHUNK: usize = 16 << 20;

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
    hog: Vec<u64>,
    compute: Option<ComputeModel>,
    /// Every weight transport's worker half (transport/), with what each holds between requests.
    transports: Vec<Box<dyn WorkerHalf>>,
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

    /// Answers a request every role answers alike: the weights' checksum, or a weight
    /// transport's method (`snapshot`: the trainer's host copy of its weights; empty on a
    /// rollout). None: not one of these.
    fn handle(
        &mut self,
        method: &str,
        p: &Value,
        trainer: bool,
        snapshot: &[Vec<u8>],
    ) -> Option<Result<Value, Failure>> {
        if method == Checksum::NAME {
            return Some(answer::<Checksum>(p, |_| self.checksum()));
        }
        let entries: Vec<(u64, u64)> = self.weight_entries().iter().map(|e| (e.ptr, e.bytes)).collect();
        let w = Weights { dev: &self.dev, trainer, entries: &entries, snapshot };
        self.transports.iter_mut().find_map(|t| t.answer(method, p, &w))
    }

    /// Modelled compute: a request that began at `t0` lasts at least what `modelled` says the
    /// device would take (nothing without a compute model).
    /// `token_scale`: the request's own, when responses grow over the run.
    fn pace(
        &self,
        t0: crate::run::clock::Instant,
        token_scale: Option<f64>,
        modelled: impl FnOnce(&ComputeModel) -> f64,
    ) {
        let Some(m) = &self.compute else { return };
        let modelled = std::time::Duration::from_secs_f64(modelled(&m.scaled(token_scale)));
        if let Some(rest) = modelled.checked_sub(t0.elapsed()) {
            crate::run::clock::sleep(rest);
        }
    }

    /// The trainer's passes: `tokens` through `stage`, the batch shared by the trainer replicas;
    /// `modelled`, when the request gives it (compute.lengths), the batch's modelled tokens in
    /// place of `tokens` x the scale.
    fn pace_trainer(
        &self,
        t0: crate::run::clock::Instant,
        token_scale: Option<f64>,
        tokens: usize,
        modelled: Option<f64>,
        stage: &Stage,
    ) {
        self.pace(t0, token_scale, |m| match modelled {
            Some(t) => m.stage_modelled_seconds(stage, t, m.trainers),
            None => m.stage_seconds(stage, tokens, m.trainers),
        });
    }

    /// Every transport releases what it holds, whatever the first says: a failed IPC close
    /// must not leave the communicator open.
    fn leave(&mut self) -> Result<Ack, Failure> {
        let w = Weights { dev: &self.dev, trainer: false, entries: &[], snapshot: &[] };
        let closed: Vec<Result<(), Failure>> = self.transports.iter_mut().map(|t| t.close(&w)).collect();
        closed.into_iter().collect::<Result<(), Failure>>().map(|()| Ack {})
    }

    fn hog(&mut self, bytes: u64) -> Result<(), Failure> {
        let p = self.dev.malloc(bytes, None, false).map_err(dev_err)?;
        self.hog.push(p);
        Ok(())
    }
}

mod rollout;
pub(crate) use rollout::{sample as sample_token, token_rng};
mod trainer;

use rollout::Rollout;
use trainer::Trainer;

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
    // The runner's clock (compute.time_scale): paced before anything is timed.
    crate::run::clock::set_scale(ip.time_scale);
    let mut c = Common {
        dev,
        shape: ip.shape,
        weights: Vec::new(),
        pads: Vec::new(),
        hog: Vec::new(),
        compute: ip.compute,
        transports: transport::worker_halves(),
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
            (m, Some(Role::Trainer(t))) => t.c.handle(m, p, true, &t.snapshot).unwrap_or_else(|| t.handle(m, p)),
            (m, Some(Role::Rollout(r))) => r.c.handle(m, p, false, &[]).unwrap_or_else(|| r.handle(m, p)),
        }
    });
    Ok(())
}
