//! The built-in worker's half of the broadcast weight transport (docs/async.md): the weight-sync
//! group (the first trainer as rank 0, every rollout engine a rank after it) over NCCL or HCCL,
//! and each update broadcast from rank 0 in buckets, device memory to device memory.
//!
//! Per bucket the trainer copies the bucket's stretch of its weights into a device buffer and
//! broadcasts it; each engine receives into a buffer of its own and copies it into its weights.
//! The group's stream is synchronized after every bucket, so one buffer serves them all: a
//! bucket costs its size once on each side, not the 2-3x verl #7041 measured with buckets in flight.

use super::device::Device;
use super::protocol::{
    BroadcastWeightsParams, BroadcastWeightsReply, GroupIdParams, GroupIdReply, GroupInitParams, GroupInitReply,
};
use super::worker::{Failure, dev_err};
use crate::collective::{self, CollError, Group, Library};
use std::time::Instant;

/// A library's failure; "timeout" when a rank never came, which the runner reads to name that
/// rank's worker rather than this one.
fn coll_err(e: CollError) -> Failure {
    let kind = if e.timed_out { "timeout" } else { "collective" };
    (kind.into(), e.message)
}

fn bad(msg: String) -> Failure {
    ("bad_request".into(), msg)
}

/// The library the params name, which must be the one of this worker's device API.
fn library(api: &str, name: &str) -> Result<Library, Failure> {
    let kind = crate::vendor::ApiKind::parse(api).ok_or_else(|| bad(format!("unknown device API {api:?}")))?;
    let wanted = Library::of(kind);
    match Library::parse(name) {
        Some(l) if l == wanted => Ok(l),
        Some(_) => {
            let msg = format!("library {name:?} on the {api} API: it takes {:?}", wanted.name());
            Err(("unsupported".into(), msg))
        }
        None => Err(bad(format!("unknown library {name:?} (nccl or hccl)"))),
    }
}

/// How many buckets of `bucket_bytes` carry `total` bytes of weights (the last may be short).
pub(super) fn bucket_count(total: u64, bucket_bytes: u64) -> u64 {
    total.div_ceil(bucket_bytes)
}

/// The pieces of bucket `i` when entries of `sizes` bytes, laid end to end, are cut every
/// `bucket_bytes`: (entry, offset in the entry, offset in the bucket, length). Empty past the end.
pub(super) fn bucket_pieces(sizes: &[u64], bucket_bytes: u64, i: u64) -> Vec<(usize, u64, u64, u64)> {
    let (start, end) = (i * bucket_bytes, (i + 1) * bucket_bytes);
    let mut pieces = Vec::new();
    let mut at = 0u64;
    for (idx, &n) in sizes.iter().enumerate() {
        let (lo, hi) = (at.max(start), (at + n).min(end));
        if lo < hi {
            pieces.push((idx, lo - at, lo - start, hi - lo));
        }
        at += n;
    }
    pieces
}

/// Rank 0 makes the group's id; the library's bootstrap root then lives in this process.
pub(super) fn group_id(api: &str, p: GroupIdParams) -> Result<GroupIdReply, Failure> {
    let lib = library(api, &p.library)?;
    let id = collective::unique_id(lib).map_err(coll_err)?;
    Ok(GroupIdReply { id: collective::to_hex(&id) })
}

/// Joins the group; returns when every member has, or the library's connect timeout passed.
pub(super) fn group_init(
    api: &str,
    p: GroupInitParams,
    current: &mut Option<Group>,
) -> Result<GroupInitReply, Failure> {
    if current.is_some() {
        return Err(bad("group_init: this worker is already in a weight-sync group".into()));
    }
    let lib = library(api, &p.library)?;
    let id = collective::from_hex(&p.id).map_err(|e| bad(format!("group_init: id: {e}")))?;
    let t = Instant::now();
    let group = Group::join(lib, &id, p.rank as usize, p.world as usize).map_err(coll_err)?;
    *current = Some(group);
    Ok(GroupInitReply { seconds: Some(t.elapsed().as_secs_f64()) })
}

/// One update: rank 0 sends `entries` (device address, bytes) bucket by bucket, every other rank
/// receives them into its own `entries`, which must have the same sizes.
pub(super) fn broadcast_weights(
    dev: &Device,
    group: Option<&Group>,
    entries: &[(u64, u64)],
    p: BroadcastWeightsParams,
) -> Result<BroadcastWeightsReply, Failure> {
    let group = group.ok_or_else(|| bad("broadcast_weights before group_init".into()))?;
    if p.bucket_bytes == 0 {
        return Err(bad("bucket_bytes must be positive".into()));
    }
    let sizes: Vec<u64> = entries.iter().map(|e| e.1).collect();
    let total: u64 = sizes.iter().sum();
    let buckets = bucket_count(total, p.bucket_bytes);
    // Outside every region: the buffer must not be paused under the library, and (as the host
    // transport's) it is what a real framework would register with the library. One buffer:
    // the copies in and out of it go through cudaMemcpy on the legacy default stream, which
    // waits for the group's (blocking) stream anyway, so a second buffer would cost a bucket of
    // device memory without overlapping anything on CUDA.
    let buf = dev.malloc(p.bucket_bytes.min(total).max(1), None, false).map_err(dev_err)?;
    let t = Instant::now();
    let moved = (0..buckets).try_for_each(|b| {
        let pieces = bucket_pieces(&sizes, p.bucket_bytes, b);
        let len = pieces.last().map_or(0, |&(_, _, at, n)| at + n);
        if group.rank == 0 {
            for &(idx, off, at, n) in &pieces {
                dev.copy(buf + at, entries[idx].0 + off, n as usize).map_err(dev_err)?;
            }
        }
        group.broadcast(buf, len as usize, 0).map_err(coll_err)?;
        group.synchronize().map_err(coll_err)?;
        if group.rank != 0 {
            for &(idx, off, at, n) in &pieces {
                dev.copy(entries[idx].0 + off, buf + at, n as usize).map_err(dev_err)?;
            }
        }
        Ok(())
    });
    let seconds = t.elapsed().as_secs_f64();
    let freed = dev.free(buf).map_err(dev_err);
    moved.and(freed)?;
    Ok(BroadcastWeightsReply { bytes: total, buckets, seconds })
}

pub(super) fn group_destroy(current: &mut Option<Group>) -> Result<(), Failure> {
    match current.take() {
        Some(g) => g.destroy().map_err(coll_err),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cut_across_entries_and_cover_every_byte_once() {
        let sizes = [10, 3, 7];
        let pieces: Vec<_> = (0..3).map(|b| bucket_pieces(&sizes, 8, b)).collect();
        assert_eq!(pieces[0], vec![(0, 0, 0, 8)]);
        assert_eq!(pieces[1], vec![(0, 8, 0, 2), (1, 0, 2, 3), (2, 0, 5, 3)]);
        assert_eq!(pieces[2], vec![(2, 3, 0, 4)]);
        assert!(bucket_pieces(&sizes, 8, 3).is_empty());
        let covered: u64 = pieces.iter().flatten().map(|p| p.3).sum();
        assert_eq!(covered, 20);
    }
}
