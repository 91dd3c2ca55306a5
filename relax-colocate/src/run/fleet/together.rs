//! Requests the workers can only finish together (a collective's members: the weight-sync group's
//! creation, a broadcast): sent to every member before any answer is read, so no member waits on
//! one the runner has not asked yet (verl 5043's review found engines joining a group before its
//! root had made it), then read in the order they come, and a failure blamed on its cause.

use super::{Fleet, InFlight};
use crate::run::protocol::Method;
use crate::run::{FailKind, R};
use std::time::{Duration, Instant};

/// After a member's error, how long the others get to show whether it was their doing (a crash
/// reaches the runner as fast as the error it causes in a peer, but not always first).
const GRACE: Duration = Duration::from_secs(2);
/// After a member timed out waiting for the others: those that joined hear it from the library
/// at the same moment, so what has not answered by then never joined.
const TIMEOUT_GRACE: Duration = Duration::from_secs(1);

/// Sends `M` to each worker in `targets` with its own params, then reads every answer, through
/// the fleet's `submit`, `wait_any_until` and `collect`. A member that crashes, or does not answer
/// by the phase timeout, is the failure whatever the others said. A member that timed out waiting
/// for the others (a "timeout" error) while some have not answered names those: they are what it
/// waited for. Otherwise the first error. `what` names the collective in the failure.
pub(in crate::run) fn call_together<M: Method>(
    fleet: &mut Fleet,
    targets: &[usize],
    params: Vec<M::Params>,
    what: &str,
) -> R<Vec<M::Reply>> {
    let mut pending: Vec<(usize, InFlight)> = Vec::new();
    for (pos, (&i, p)) in targets.iter().zip(params).enumerate() {
        pending.push((pos, fleet.submit::<M>(i, p)?));
    }
    let mut replies: Vec<Option<M::Reply>> = targets.iter().map(|_| None).collect();
    let mut first = None;
    let mut grace = None;
    while !pending.is_empty() {
        let waiting: Vec<&InFlight> = pending.iter().map(|(_, r)| r).collect();
        let Some(k) = fleet.wait_any_until(&waiting, grace)? else { break };
        let (pos, request) = pending.remove(k);
        let overdue = request.overdue();
        let worker = request.worker;
        match fleet.collect::<M>(request) {
            Ok(r) => replies[pos] = Some(r),
            // Every member still in it ran out of time at once: one that stopped holds up the
            // rest inside the library, and from here they all look alike.
            Err(e) if overdue && e.kind == FailKind::Timeout && !pending.is_empty() => {
                let mut names = vec![fleet.workers[worker].name.clone()];
                names.extend(pending.iter().map(|(_, r)| fleet.workers[r.worker].name.clone()));
                let cause = format!(
                    "timed out: {} did not finish {what} within {}s (run.phase_timeout_s); the members wait for \
                         each other, so one that stopped holds up the rest: their logs say which",
                    names.join(", "),
                    fleet.timeout_s,
                );
                return Err(fleet.fail(FailKind::Timeout, Some(&names[0]), cause));
            }
            Err(e) if overdue || matches!(e.kind, FailKind::Crash | FailKind::Interrupted) => return Err(e),
            Err(e) => {
                if first.is_none() {
                    let wait = if e.kind == FailKind::Timeout { TIMEOUT_GRACE } else { GRACE };
                    grace = Some(Instant::now() + wait);
                    first = Some(e);
                }
            }
        }
    }
    let Some(e) = first else {
        return Ok(replies.into_iter().map(|r| r.expect("every member answered")).collect());
    };
    if e.kind != FailKind::Timeout || pending.is_empty() {
        return Err(e);
    }
    let absent: Vec<&str> = pending.iter().map(|(_, r)| fleet.workers[r.worker].name.as_str()).collect();
    let reporter = e.worker.as_deref().unwrap_or("a member");
    let cause = format!(
        "{} never took part in {what}: {reporter} gave up waiting for {} ({}){}",
        absent.join(", "),
        if absent.len() == 1 { "it" } else { "them" },
        e.cause,
        fleet.state_note(pending[0].1.worker),
    );
    Err(fleet.fail(FailKind::Timeout, Some(absent[0]), cause))
}
