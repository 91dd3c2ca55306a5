//! The IPC weight transport (docs/worker-protocol.md), as slime's colocated
//! `update_weights_from_tensor` moves weights: the trainer exports a device buffer
//! (CUDA IPC handle, or an Ascend IPC key whose whitelist names the rollout on its device), the
//! rollout opens it, and each bucket goes trainer → buffer → rollout weights without crossing the
//! host between them.
//!
//! The buffer is plain memory outside every region: the vendors export no virtual-memory (region)
//! allocation this way, and a pause must not take it away while the rollout reads it. It lives for
//! one update: the rollout closes its import first, then the trainer ends the export and frees it,
//! so no update leaves device memory or an open handle behind.

use super::WeightTransport;
use super::buckets::{Piece, bucket_count, bucket_pieces};
use super::{Moved, Transport, Weights, WorkerHalf};
use crate::collective::{from_hex, to_hex};
use crate::run::answer::{Failure, answer, bad, dev_err};
use crate::run::clock::Instant;
use crate::run::device::Device;
use crate::run::fleet::Fleet;
use crate::run::protocol::{Ack, BucketParams, BucketReply, Method, Step};
use crate::run::{Cursor, FailKind, R, Role};
use crate::vendor::ApiKind;
use serde::{Deserialize, Serialize};
use serde_json::Value;

// Both roles (colocate mode): per update every trainer exports a transfer buffer, the rollout on
// its device opens it, each bucket is packed into it by the trainer and copied out device to
// device by the rollout; then the rollouts close their imports and the trainers end their
// exports.
crate::run::protocol::methods! {
    IpcClose = "ipc_close": Step => Ack;
    // The rollout's.
    IpcPid = "ipc_pid": Step => IpcPidReply;
    IpcImport = "ipc_import": IpcImportParams => Ack;
    IpcCopy = "ipc_copy": BucketParams => BucketReply;
    // The trainer's.
    IpcExport = "ipc_export": IpcExportParams => IpcExportReply;
    IpcPack = "ipc_pack": BucketParams => BucketReply;
}

/// The id an exporter must allow this rollout by (Ascend's whitelist: aclrtDeviceGetBareTgid).
#[derive(Debug, Serialize, Deserialize)]
pub struct IpcPidReply {
    pub pid: i32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IpcExportParams {
    pub bucket_bytes: u64,
    /// The processes that may open the export (the rollout on the trainer's device), by ipc_pid.
    pub importers: Vec<i32>,
    #[serde(default)]
    pub step: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct IpcExportReply {
    /// The transfer buffer's handle in hex: a cudaIpcMemHandle_t (64 bytes), or an Ascend key.
    pub handle: String,
    /// The buffer's size: one bucket, or the whole stream when it is smaller.
    pub buffer_bytes: u64,
    /// The weights stream: its buckets and bytes.
    pub buckets: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IpcImportParams {
    /// ipc_export's answer from the trainer on this rollout's device.
    pub handle: String,
    pub buffer_bytes: u64,
    pub bucket_bytes: u64,
    #[serde(default)]
    pub step: u64,
}

/// The runner's half (colocate mode: every rollout shares its device with a trainer).
pub(super) struct Ipc {
    pub(super) api: ApiKind,
    /// Each rollout's id for the exporters' whitelists, asked at the first update.
    pids: Option<Vec<(usize, i32)>>,
}

impl Ipc {
    pub(super) fn new(api: ApiKind) -> Ipc {
        Ipc { api, pids: None }
    }
}

impl Transport for Ipc {
    fn kind(&self) -> WeightTransport {
        WeightTransport::Ipc
    }

    fn transfer(&mut self, fleet: &mut Fleet, at: &Cursor, bucket_bytes: u64, _version: u64) -> R<Moved> {
        if self.pids.is_none() {
            self.pids = Some(ready(fleet, at)?);
        }
        let pairs = device_pairs(fleet, at)?;
        transfer_pairs(fleet, at, bucket_bytes, &pairs, self.pids.as_deref().unwrap_or_default())
    }

    fn describe(&self) -> String {
        match self.api {
            ApiKind::Acl => "ipc (Ascend IPC keys, device to device)".into(),
            ApiKind::Cuda => "ipc (CUDA IPC handles, device to device)".into(),
        }
    }
}

/// Each trainer and the rollout on its device (colocate mode: the same rank), in the fleet's
/// order of the trainers.
fn device_pairs(fleet: &Fleet, at: &Cursor) -> R<Vec<(usize, usize)>> {
    let rollouts = fleet.indices(Role::Rollout);
    let pairs = fleet.paired_by_device(&fleet.indices(Role::Trainer), &rollouts);
    if pairs.len() != rollouts.len() {
        let cause = "run.weight_transport = \"ipc\": every rollout needs a trainer on its own device (colocate mode)";
        return Err(at.fail(FailKind::Config, None, cause));
    }
    Ok(pairs)
}

/// An update between the (trainer, rollout) pairs given, each on one device (`pids`: each
/// rollout's id for the exporter's whitelist, by fleet index): every trainer exports a buffer to
/// its rollout, which opens it; per bucket the trainers pack it and the rollouts copy it into
/// their weights, device to device; then the rollouts close their imports before the trainers
/// end their exports.
pub(super) fn transfer_pairs(
    fleet: &mut Fleet,
    at: &Cursor,
    bucket_bytes: u64,
    pairs: &[(usize, usize)],
    pids: &[(usize, i32)],
) -> R<Moved> {
    let t0 = Instant::now();
    let step = at.step();
    let (trainers, rollouts): (Vec<usize>, Vec<usize>) = pairs.iter().copied().unzip();
    let pid_of = |r: usize| pids.iter().find(|p| p.0 == r).map_or(0, |p| p.1);
    let params = rollouts.iter().map(|&r| IpcExportParams { bucket_bytes, importers: vec![pid_of(r)], step }).collect();
    let exports = fleet.call_each::<IpcExport>(&trainers, params)?;
    let (buckets, bytes) = (exports[0].buckets, exports[0].bytes);
    if let Some(k) = exports.iter().position(|e| (e.buckets, e.bytes) != (buckets, bytes)) {
        let name = &fleet.worker(trainers[k]).name;
        let cause =
            format!("ipc_export: a weights stream of {} bytes, the first trainer's has {bytes}", exports[k].bytes);
        return Err(at.fail(FailKind::Check, Some(name), cause));
    }
    let params = exports
        .iter()
        .map(|e| IpcImportParams { handle: e.handle.clone(), buffer_bytes: e.buffer_bytes, bucket_bytes, step })
        .collect();
    fleet.call_each::<IpcImport>(&rollouts, params)?;
    for b in 0..buckets {
        let q = BucketParams { bucket: b, step };
        fleet.call_each::<IpcPack>(&trainers, vec![q; trainers.len()])?;
        fleet.call_each::<IpcCopy>(&rollouts, vec![q; rollouts.len()])?;
    }
    fleet.call_each::<IpcClose>(&rollouts, vec![Step { step }; rollouts.len()])?;
    fleet.call_each::<IpcClose>(&trainers, vec![Step { step }; trainers.len()])?;
    Ok(Moved { bytes, buckets, seconds: t0.elapsed().as_secs_f64(), host_bytes: 0 })
}

/// The IPC transport needs workers that said so in their hello (the built-in ones do); each
/// rollout's id for the exporters' whitelists, by fleet index.
fn ready(fleet: &mut Fleet, at: &Cursor) -> R<Vec<(usize, i32)>> {
    let all = [fleet.indices(Role::Trainer), fleet.indices(Role::Rollout)].concat();
    if let Some(&i) = all.iter().find(|&&i| !speaks(fleet, i)) {
        let name = fleet.worker(i).name.clone();
        let cause = format!(
            "run.weight_transport = \"ipc\": {name} does not speak the IPC transport (its hello names no \"ipc\" in \
             `transports`, docs/worker-protocol.md): use --weight-transport host"
        );
        return Err(at.fail(FailKind::Config, Some(&name), cause));
    }
    let rollouts = fleet.indices(Role::Rollout);
    pids(fleet, at, &rollouts)
}

pub(super) fn speaks(fleet: &Fleet, i: usize) -> bool {
    fleet.worker(i).transports.iter().any(|t| t == "ipc")
}

/// Each of `rollouts`' process id, for an exporter's whitelist.
pub(super) fn pids(fleet: &mut Fleet, at: &Cursor, rollouts: &[usize]) -> R<Vec<(usize, i32)>> {
    let replies = fleet.call_each::<IpcPid>(rollouts, vec![Step { step: at.step() }; rollouts.len()])?;
    Ok(rollouts.iter().copied().zip(replies.into_iter().map(|r| r.pid)).collect())
}

/// The worker's half: one update's shared buffer, exported (trainer) or imported (rollout).
#[derive(Default)]
pub(super) struct IpcWorker {
    slot: Option<Shared>,
}

impl WorkerHalf for IpcWorker {
    fn answer(&mut self, method: &str, p: &Value, w: &Weights) -> Option<Result<Value, Failure>> {
        let dev = w.dev;
        Some(match method {
            IpcClose::NAME => answer::<IpcClose>(p, |_| close(dev, &mut self.slot)),
            IpcExport::NAME if w.trainer => answer::<IpcExport>(p, |p| {
                let sizes: Vec<u64> = w.entries.iter().map(|e| e.1).collect();
                export(dev, &sizes, p, &mut self.slot)
            }),
            IpcPack::NAME if w.trainer => answer::<IpcPack>(p, |p| pack(dev, &self.slot, w.snapshot, p)),
            IpcPid::NAME if !w.trainer => {
                answer::<IpcPid>(p, |_| Ok(IpcPidReply { pid: dev.ipc_pid().map_err(dev_err)? }))
            }
            IpcImport::NAME if !w.trainer => answer::<IpcImport>(p, |p| import(dev, p, &mut self.slot)),
            IpcCopy::NAME if !w.trainer => answer::<IpcCopy>(p, |p| copy(dev, &self.slot, w.entries, p)),
            _ => return None,
        })
    }

    fn close(&mut self, w: &Weights) -> Result<(), Failure> {
        close(w.dev, &mut self.slot).map(drop)
    }
}

/// One update's shared buffer, on either side.
struct Shared {
    handle: Vec<u8>,
    ptr: u64,
    bytes: u64,
    bucket_bytes: u64,
    /// The trainer's own buffer (freed at close) rather than an import (closed).
    exported: bool,
}

/// The trainer: a buffer of one bucket (or the whole stream when smaller), exported to
/// `importers`. `sizes` are the weights stream's entries in bytes.
fn export(
    dev: &Device,
    sizes: &[u64],
    p: IpcExportParams,
    slot: &mut Option<Shared>,
) -> Result<IpcExportReply, Failure> {
    if slot.is_some() {
        return Err(bad("ipc_export while the last export is still open (ipc_close first)"));
    }
    let bucket_bytes = Some(p.bucket_bytes).filter(|b| *b > 0).ok_or_else(|| bad("bucket_bytes must be positive"))?;
    let total: u64 = sizes.iter().sum();
    let bytes = bucket_bytes.min(total).max(1);
    let ptr = dev.malloc(bytes, None, false).map_err(dev_err)?;
    let handle = match dev.ipc_export(ptr, bytes, &p.importers) {
        Ok(h) => h,
        Err(e) => {
            let _ = dev.free(ptr);
            return Err(dev_err(e));
        }
    };
    let reply = IpcExportReply {
        handle: to_hex(&handle),
        buffer_bytes: bytes,
        buckets: bucket_count(total, bucket_bytes),
        bytes: total,
    };
    *slot = Some(Shared { handle, ptr, bytes, bucket_bytes, exported: true });
    Ok(reply)
}

/// The rollout: opens the export of the trainer on its device.
fn import(dev: &Device, p: IpcImportParams, slot: &mut Option<Shared>) -> Result<Ack, Failure> {
    if slot.is_some() {
        return Err(bad("ipc_import while the last import is still open (ipc_close first)"));
    }
    if p.bucket_bytes == 0 || p.buffer_bytes == 0 {
        return Err(bad("bucket_bytes and buffer_bytes must be positive"));
    }
    let handle = from_hex(&p.handle).map_err(|e| bad(format!("ipc_import: handle: {e}")))?;
    let ptr = dev.ipc_open(&handle).map_err(dev_err)?;
    *slot = Some(Shared { handle, ptr, bytes: p.buffer_bytes, bucket_bytes: p.bucket_bytes, exported: false });
    Ok(Ack {})
}

/// Bucket `i`'s pieces over entries of `sizes` bytes, checked against the shared buffer.
fn pieces<'a>(slot: &'a Option<Shared>, sizes: &[u64], i: u64) -> Result<(&'a Shared, Vec<Piece>), Failure> {
    let s = slot.as_ref().ok_or_else(|| bad("no ipc_export or ipc_import before this bucket"))?;
    let pieces = bucket_pieces(sizes, s.bucket_bytes, i);
    match pieces.last() {
        None => Err(bad(format!("bucket {i} is past the end of the weights"))),
        Some((_, _, boff, n)) if boff + n > s.bytes => {
            Err(bad(format!("bucket {i} needs {} bytes, the shared buffer has {}", boff + n, s.bytes)))
        }
        Some(_) => Ok((s, pieces)),
    }
}

/// The trainer: bucket `p.bucket` of its weights (the host snapshot it takes after each train,
/// what it has while its regions sleep) into the exported buffer.
fn pack(dev: &Device, slot: &Option<Shared>, snapshot: &[Vec<u8>], p: BucketParams) -> Result<BucketReply, Failure> {
    let sizes: Vec<u64> = snapshot.iter().map(|s| s.len() as u64).collect();
    let (s, pieces) = pieces(slot, &sizes, p.bucket)?;
    let mut len = 0;
    for (idx, off, boff, n) in pieces {
        dev.write(s.ptr + boff, &snapshot[idx][off as usize..(off + n) as usize]).map_err(dev_err)?;
        len = boff + n;
    }
    Ok(BucketReply { bytes: Some(len) })
}

/// The rollout: bucket `p.bucket` from the imported buffer into its weights, device to device.
/// `entries` are its weights stream's (pointer, bytes).
fn copy(dev: &Device, slot: &Option<Shared>, entries: &[(u64, u64)], p: BucketParams) -> Result<BucketReply, Failure> {
    let sizes: Vec<u64> = entries.iter().map(|e| e.1).collect();
    let (s, pieces) = pieces(slot, &sizes, p.bucket)?;
    let mut len = 0;
    for (idx, off, boff, n) in pieces {
        dev.copy(entries[idx].0 + off, s.ptr + boff, n as usize).map_err(dev_err)?;
        len = boff + n;
    }
    Ok(BucketReply { bytes: Some(len) })
}

/// Either side's end of the update: the rollout closes its import, the trainer ends its export
/// and frees the buffer. Nothing open is not an error (a shutdown after a failed update).
fn close(dev: &Device, slot: &mut Option<Shared>) -> Result<Ack, Failure> {
    let Some(s) = slot.take() else { return Ok(Ack {}) };
    if s.exported {
        // The buffer is freed even when ending the export fails: nothing could free it later.
        let ended = dev.ipc_end_export(&s.handle);
        let freed = dev.free(s.ptr);
        ended.and(freed).map_err(dev_err)?;
    } else {
        dev.ipc_close(s.ptr, &s.handle).map_err(dev_err)?;
    }
    Ok(Ack {})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::protocol::decode;
    use serde_json::json;

    #[test]
    fn ipc_messages_carry_the_documented_fields() {
        let p = IpcExportParams { bucket_bytes: 1 << 20, importers: vec![42], step: 2 };
        assert_eq!(serde_json::to_value(p).unwrap(), json!({"bucket_bytes": 1048576, "importers": [42], "step": 2}));
        let e = decode::<IpcExportReply>(json!({"handle": "ab", "buffer_bytes": 8, "buckets": 1})).unwrap_err();
        assert_eq!(e, "missing field `bytes`");
    }
}
