//! The built-in worker's half of the IPC weight transport (docs/worker-protocol.md), as slime's
//! colocated `update_weights_from_tensor` moves weights: the trainer exports a device buffer
//! (CUDA IPC handle, or an Ascend IPC key whose whitelist names the rollout on its device), the
//! rollout opens it, and each bucket goes trainer → buffer → rollout weights without crossing the
//! host between them.
//!
//! The buffer is plain memory outside every region: the vendors export no virtual-memory (region)
//! allocation this way, and a pause must not take it away while the rollout reads it. It lives for
//! one update: the rollout closes its import first, then the trainer ends the export and frees it,
//! so no update leaves device memory or an open handle behind.

use super::broadcast::{bucket_count, bucket_pieces};
use super::device::Device;
use super::protocol::{Ack, BucketParams, BucketReply, IpcExportParams, IpcExportReply, IpcImportParams};
use super::worker::{Failure, dev_err};
use crate::collective::{from_hex, to_hex};

fn bad(msg: String) -> Failure {
    ("bad_request".into(), msg)
}

/// One update's shared buffer, on either side.
pub(super) struct Shared {
    handle: Vec<u8>,
    ptr: u64,
    bytes: u64,
    bucket_bytes: u64,
    /// The trainer's own buffer (freed at close) rather than an import (closed).
    exported: bool,
}

/// The trainer: a buffer of one bucket (or the whole stream when smaller), exported to
/// `importers`. `sizes` are the weights stream's entries in bytes.
pub(super) fn export(
    dev: &Device,
    sizes: &[u64],
    p: IpcExportParams,
    slot: &mut Option<Shared>,
) -> Result<IpcExportReply, Failure> {
    if slot.is_some() {
        return Err(bad("ipc_export while the last export is still open (ipc_close first)".into()));
    }
    let bucket_bytes =
        Some(p.bucket_bytes).filter(|b| *b > 0).ok_or_else(|| bad("bucket_bytes must be positive".into()))?;
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
pub(super) fn import(dev: &Device, p: IpcImportParams, slot: &mut Option<Shared>) -> Result<Ack, Failure> {
    if slot.is_some() {
        return Err(bad("ipc_import while the last import is still open (ipc_close first)".into()));
    }
    if p.bucket_bytes == 0 || p.buffer_bytes == 0 {
        return Err(bad("bucket_bytes and buffer_bytes must be positive".into()));
    }
    let handle = from_hex(&p.handle).map_err(|e| bad(format!("ipc_import: handle: {e}")))?;
    let ptr = dev.ipc_open(&handle).map_err(dev_err)?;
    *slot = Some(Shared { handle, ptr, bytes: p.buffer_bytes, bucket_bytes: p.bucket_bytes, exported: false });
    Ok(Ack {})
}

/// A stretch of a bucket: (entry, offset in the entry, offset in the bucket, length).
type Piece = (usize, u64, u64, u64);

/// Bucket `i`'s pieces over entries of `sizes` bytes, checked against the shared buffer.
fn pieces<'a>(slot: &'a Option<Shared>, sizes: &[u64], i: u64) -> Result<(&'a Shared, Vec<Piece>), Failure> {
    let s = slot.as_ref().ok_or_else(|| bad("no ipc_export or ipc_import before this bucket".into()))?;
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
pub(super) fn pack(
    dev: &Device,
    slot: &Option<Shared>,
    snapshot: &[Vec<u8>],
    p: BucketParams,
) -> Result<BucketReply, Failure> {
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
pub(super) fn copy(
    dev: &Device,
    slot: &Option<Shared>,
    entries: &[(u64, u64)],
    p: BucketParams,
) -> Result<BucketReply, Failure> {
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
pub(super) fn close(dev: &Device, slot: &mut Option<Shared>) -> Result<Ack, Failure> {
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
