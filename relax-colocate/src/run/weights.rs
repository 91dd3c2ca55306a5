//! The trainer's weights as both drivers move and check them: the checksums the roles report, and
//! the host transport (`update_weights` through the run's shared bucket file: the first trainer
//! packs each bucket once, every rollout engine unpacks it).

use super::fleet::Fleet;
use super::protocol::{
    BucketParams, Checksum, Pack, Step, Unpack, UpdateBegin, UpdateBeginParams, UpdateBeginReply, UpdateEnd,
};
use super::recorder::Recorder;
use super::{Cursor, FailKind, R, Role};

/// Every worker of `role`'s weights checksum, in the fleet's order.
pub(super) fn checksums(fleet: &mut Fleet, role: Role, step: u64) -> R<Vec<String>> {
    let replies = fleet.call_all::<Checksum>(role, Step { step })?;
    Ok(replies.into_iter().map(|r| r.weights).collect())
}

/// The trainer's checksum; its replicas must agree.
pub(super) fn trainer_checksum(fleet: &mut Fleet, at: &Cursor) -> R<String> {
    let sums = checksums(fleet, Role::Trainer, at.step())?;
    if sums.windows(2).any(|w| w[0] != w[1]) {
        return Err(at.fail(FailKind::Check, None, format!("trainer replicas disagree on their weights: {sums:?}")));
    }
    Ok(sums[0].clone())
}

/// Every worker of `role` must hold `expected` (when checks are on).
pub(super) fn expect_checksum(fleet: &mut Fleet, rec: &mut Recorder, role: Role, expected: &str, when: &str) -> R<()> {
    if !rec.checks_enabled() {
        return Ok(());
    }
    let step = rec.cursor().step();
    let got = checksums(fleet, role, step)?;
    let named: Vec<(String, String)> =
        fleet.indices(role).into_iter().map(|i| fleet.worker(i).name.clone()).zip(got).collect();
    rec.check_weights(&named, expected, when)
}

/// update_weights through the host: the trainers and the rollouts map the bucket file; per bucket
/// the first trainer packs it and every rollout unpacks it (the trainers are replicas). Returns
/// the bytes moved to each rollout.
pub(super) fn host_transfer(fleet: &mut Fleet, at: &Cursor, bucket_bytes: u64) -> R<u64> {
    let step = at.step();
    let p = UpdateBeginParams { shm: fleet.shm().to_path_buf(), bucket_bytes, step };
    let t = fleet.call_all::<UpdateBegin>(Role::Trainer, p.clone())?;
    fleet.call_all::<UpdateBegin>(Role::Rollout, p)?;
    let (buckets, bytes) = stream_size(fleet, at, &t)?;
    let packer = fleet.indices(Role::Trainer)[0];
    let rollouts = fleet.indices(Role::Rollout);
    for b in 0..buckets {
        let q = BucketParams { bucket: b, step };
        fleet.call_each::<Pack>(&[packer], vec![q])?;
        fleet.call_each::<Unpack>(&rollouts, vec![q; rollouts.len()])?;
    }
    fleet.call_all::<UpdateEnd>(Role::Trainer, Step { step })?;
    fleet.call_all::<UpdateEnd>(Role::Rollout, Step { step })?;
    Ok(bytes)
}

/// How many buckets the weights stream has and its bytes, as the first trainer says.
fn stream_size(fleet: &Fleet, at: &Cursor, trainers: &[UpdateBeginReply]) -> R<(u64, u64)> {
    trainers[0].buckets.map(|b| (b, trainers[0].bytes.unwrap_or(0))).ok_or_else(|| {
        let name = &fleet.worker(fleet.indices(Role::Trainer)[0]).name;
        at.fail(FailKind::Worker, Some(name), "malformed update_begin reply: missing field `buckets`")
    })
}
