//! The host weight transport, the one every worker speaks: update_weights through the run's shared
//! bucket file. The first trainer packs each bucket once (its weights through a device buffer into
//! the file) and every rollout engine unpacks it (the file through a device buffer into its
//! weights); the trainers are replicas, so one packs for all.

use super::WeightTransport;
use super::buckets::{Piece, bucket_count, bucket_pieces};
use super::{Moved, Transport, Weights, WorkerHalf, stream_size};
use crate::run::answer::{Failure, answer, bad, dev_err};
use crate::run::clock::Instant;
use crate::run::fleet::Fleet;
use crate::run::protocol::{
    Ack, BucketParams, BucketReply, Method, Step, UpdateBegin, UpdateBeginParams, UpdateBeginReply, UpdateEnd,
};
use crate::run::{Cursor, R, Role};
use serde_json::Value;

// The rollout's and the trainer's methods of the host transport: the first trainer packs each
// bucket into the run's bucket file, every rollout unpacks it.
crate::run::protocol::methods! {
    Unpack = "unpack": BucketParams => BucketReply;
    Pack = "pack": BucketParams => BucketReply;
}

/// The runner's half.
pub(super) struct Host;

impl Transport for Host {
    fn kind(&self) -> WeightTransport {
        WeightTransport::Host
    }

    fn transfer(&mut self, fleet: &mut Fleet, at: &Cursor, bucket_bytes: u64, _version: u64) -> R<Moved> {
        let (trainers, rollouts) = (fleet.indices(Role::Trainer), fleet.indices(Role::Rollout));
        transfer_to(fleet, at, bucket_bytes, &trainers, &rollouts)
    }

    fn describe(&self) -> String {
        "host (staged in host memory)".into()
    }
}

/// An update from `trainers` (the first packs) to `receivers`: every one maps the bucket file,
/// then per bucket the first trainer packs it and every receiver unpacks it.
pub(super) fn transfer_to(
    fleet: &mut Fleet,
    at: &Cursor,
    bucket_bytes: u64,
    trainers: &[usize],
    receivers: &[usize],
) -> R<Moved> {
    let t0 = Instant::now();
    let step = at.step();
    let p = UpdateBeginParams { shm: fleet.shm().to_path_buf(), bucket_bytes, step };
    let t = fleet.call_each::<UpdateBegin>(trainers, vec![p.clone(); trainers.len()])?;
    fleet.call_each::<UpdateBegin>(receivers, vec![p; receivers.len()])?;
    let (buckets, bytes) = stream_size(fleet, at, trainers[0], &t)?;
    for b in 0..buckets {
        let q = BucketParams { bucket: b, step };
        fleet.call_each::<Pack>(&trainers[..1], vec![q])?;
        fleet.call_each::<Unpack>(receivers, vec![q; receivers.len()])?;
    }
    fleet.call_each::<UpdateEnd>(trainers, vec![Step { step }; trainers.len()])?;
    fleet.call_each::<UpdateEnd>(receivers, vec![Step { step }; receivers.len()])?;
    Ok(Moved { bytes, buckets, seconds: t0.elapsed().as_secs_f64(), host_bytes: bytes })
}

/// The worker's half: the bucket file mapped and a device buffer of one bucket, for one update.
#[derive(Default)]
pub(super) struct HostWorker {
    update: Option<Update>,
}

struct Update {
    map: *mut u8,
    map_len: usize,
    bucket_bytes: u64,
    /// Device memory outside every region: it must not be paused, and on GPUs it is what CUDA
    /// IPC would export (VMM memory cannot be).
    buffer: u64,
}

impl WorkerHalf for HostWorker {
    fn answer(&mut self, method: &str, p: &Value, w: &Weights) -> Option<Result<Value, Failure>> {
        Some(match method {
            UpdateBegin::NAME => answer::<UpdateBegin>(p, |p| self.begin(w, p)),
            UpdateEnd::NAME => answer::<UpdateEnd>(p, |_| self.end(w)),
            Pack::NAME if w.trainer => answer::<Pack>(p, |p| self.pack(w, p)),
            Unpack::NAME if !w.trainer => answer::<Unpack>(p, |p| self.unpack(w, p)),
            _ => return None,
        })
    }

    /// Nothing to release at shutdown: an update still open ends with the process.
    fn close(&mut self, _w: &Weights) -> Result<(), Failure> {
        Ok(())
    }
}

impl HostWorker {
    fn begin(&mut self, w: &Weights, p: UpdateBeginParams) -> Result<UpdateBeginReply, Failure> {
        let path = p.shm.display();
        let bucket_bytes =
            Some(p.bucket_bytes).filter(|b| *b > 0).ok_or_else(|| bad("bucket_bytes must be positive"))?;
        let total: u64 = w.entries.iter().map(|e| e.1).sum();
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
        // SAFETY: a shared mapping of a regular file we opened read/write, unmapped in `end`.
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
        let buffer = match w.dev.malloc(span, None, false) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the mapping made above.
                unsafe { libc::munmap(map, map_len) };
                return Err(dev_err(e));
            }
        };
        self.update = Some(Update { map: map.cast(), map_len, bucket_bytes, buffer });
        Ok(UpdateBeginReply { buckets: Some(bucket_count(total, bucket_bytes)), bytes: Some(total) })
    }

    fn end(&mut self, w: &Weights) -> Result<Ack, Failure> {
        if let Some(u) = self.update.take() {
            // SAFETY: the mapping made in `begin`.
            unsafe { libc::munmap(u.map.cast(), u.map_len) };
            w.dev.free(u.buffer).map_err(dev_err)?;
        }
        Ok(Ack {})
    }

    /// The pieces of bucket `i` over entries of `sizes` bytes: (entry, offset in entry, offset
    /// in bucket, length), and the update they belong to.
    fn pieces(&self, i: u64, sizes: &[u64]) -> Result<(&Update, Vec<Piece>), Failure> {
        let u = self.update.as_ref().ok_or_else(|| bad("no update_begin"))?;
        let pieces = bucket_pieces(sizes, u.bucket_bytes, i);
        if pieces.is_empty() {
            return Err(bad(format!("bucket {i} is past the end of the weights")));
        }
        Ok((u, pieces))
    }

    #[allow(clippy::mut_from_ref)]
    fn file(u: &Update, len: u64) -> &mut [u8] {
        // SAFETY: the mapping is map_len bytes and len ≤ the bucket span ≤ map_len; the runner
        // lets one side touch it at a time.
        unsafe { std::slice::from_raw_parts_mut(u.map, len as usize) }
    }

    /// The trainer: bucket `p.bucket` of its weights (its host snapshot) into the file.
    fn pack(&mut self, w: &Weights, p: BucketParams) -> Result<BucketReply, Failure> {
        let sizes: Vec<u64> = w.entries.iter().map(|e| e.1).collect();
        let (u, pieces) = self.pieces(p.bucket, &sizes)?;
        let mut len = 0;
        for (idx, off, boff, n) in pieces {
            let src = &w.snapshot[idx][off as usize..(off + n) as usize];
            w.dev.write(u.buffer + boff, src).map_err(dev_err)?;
            len = boff + n;
        }
        w.dev.read(Self::file(u, len), u.buffer).map_err(dev_err)?;
        Ok(BucketReply { bytes: Some(len) })
    }

    /// The rollout: bucket `p.bucket` from the file into its weights.
    fn unpack(&mut self, w: &Weights, p: BucketParams) -> Result<BucketReply, Failure> {
        let sizes: Vec<u64> = w.entries.iter().map(|e| e.1).collect();
        let (u, pieces) = self.pieces(p.bucket, &sizes)?;
        let len = pieces.last().map(|(_, _, boff, n)| boff + n).unwrap_or(0);
        w.dev.write(u.buffer, Self::file(u, len)).map_err(dev_err)?;
        for (idx, off, boff, n) in pieces {
            w.dev.copy(w.entries[idx].0 + off, u.buffer + boff, n as usize).map_err(dev_err)?;
        }
        Ok(BucketReply { bytes: Some(len) })
    }
}
