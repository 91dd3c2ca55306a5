//! Finished prompt groups between the rollout engines and the trainer, and the weight version of
//! every token in them: the trainer takes batches first in, first out, and a group whose oldest
//! token is more than `max_staleness` versions behind the rollouts' weights is dropped, counted,
//! never trained on.

use std::collections::VecDeque;

/// One sampled response, token by token with the weight version that generated each token.
#[derive(Debug, Clone, Default)]
pub(super) struct Seq {
    pub(super) response: Vec<u32>,
    pub(super) logprobs: Vec<f64>,
    pub(super) versions: Vec<u64>,
    pub(super) finished: bool,
    /// Modelled decode steps done towards its next token (async.segment_s ended a segment
    /// part-way through one): the next request, on whichever engine, continues from there.
    pub(super) progress: f64,
}

impl Seq {
    /// The oldest version among its tokens (`now` for a sequence with none yet).
    pub(super) fn oldest(&self, now: u64) -> u64 {
        self.versions.iter().copied().min().unwrap_or(now)
    }

    /// How many weight updates its generation spanned: 0 for a sequence of one version.
    pub(super) fn span(&self) -> u64 {
        let lo = self.versions.iter().min();
        let hi = self.versions.iter().max();
        lo.zip(hi).map(|(lo, hi)| hi - lo).unwrap_or(0)
    }
}

/// A prompt and its group of responses (GRPO's group: trained or dropped together).
#[derive(Debug, Clone)]
pub(super) struct Group {
    pub(super) prompt: Vec<u32>,
    pub(super) seqs: Vec<Seq>,
    /// Its place in the order groups were started in: batches are taken in that order.
    pub(super) started: u64,
    /// Moved to another engine since its last segment (a lent engine's share, a reclaimed or
    /// retired engine's orphan): the engine holding it now has none of its prefixes cached.
    pub(super) moved: bool,
}

impl Group {
    pub(super) fn oldest(&self, now: u64) -> u64 {
        self.seqs.iter().map(|s| s.oldest(now)).min().unwrap_or(now)
    }

    pub(super) fn finished(&self) -> bool {
        self.seqs.iter().all(|s| s.finished)
    }
}

#[derive(Debug, Default)]
pub(super) struct Queue {
    groups: VecDeque<Group>,
    /// Groups dropped for staleness since the run began, and their samples.
    pub(super) dropped_groups: u64,
    pub(super) dropped_samples: u64,
}

impl Queue {
    pub(super) fn push(&mut self, g: Group) {
        self.groups.push_back(g);
    }

    pub(super) fn len(&self) -> usize {
        self.groups.len()
    }

    /// Drops every queued group staler than `max_staleness` at weight version `now`, then takes
    /// the `batch` groups started first, if that many are queued and none is still being
    /// generated. Taking groups in the order they started, not the order they finished, is what
    /// keeps the queue's capacity a bound on staleness when engines start new groups beside
    /// unfinished ones: a long response is waited for, never overtaken until it is too old.
    /// `first_in_flight` is the earliest start among the groups being generated.
    pub(super) fn take_batch(
        &mut self,
        batch: usize,
        now: u64,
        max_staleness: u64,
        first_in_flight: Option<u64>,
    ) -> Option<Vec<Group>> {
        let before = self.groups.len();
        let mut kept = VecDeque::with_capacity(before);
        for g in self.groups.drain(..) {
            if now - g.oldest(now).min(now) > max_staleness {
                self.dropped_groups += 1;
                self.dropped_samples += g.seqs.len() as u64;
            } else {
                kept.push_back(g);
            }
        }
        kept.make_contiguous().sort_by_key(|g| g.started);
        self.groups = kept;
        let ready = self.groups.iter().take_while(|g| first_in_flight.is_none_or(|f| g.started < f)).count();
        if ready < batch {
            return None;
        }
        Some(self.groups.drain(..batch).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(versions: &[&[u64]]) -> Group {
        started(versions, 0)
    }

    fn started(versions: &[&[u64]], started: u64) -> Group {
        let seqs = versions
            .iter()
            .map(|v| Seq {
                response: vec![1; v.len()],
                logprobs: vec![-0.1; v.len()],
                versions: v.to_vec(),
                finished: true,
                progress: 0.0,
            })
            .collect();
        Group { prompt: vec![0], seqs, started, moved: false }
    }

    #[test]
    fn a_group_is_as_old_as_its_oldest_token_and_spans_its_versions() {
        let g = group(&[&[3, 3], &[2, 4, 4]]);
        assert_eq!(g.oldest(5), 2);
        assert_eq!(g.seqs[1].span(), 2);
        assert_eq!(g.seqs[0].span(), 0);
        assert_eq!(Seq::default().oldest(7), 7);
    }

    #[test]
    fn stale_groups_are_dropped_and_counted_and_batches_keep_their_order() {
        let mut q = Queue::default();
        q.push(group(&[&[0], &[1]])); // oldest 0: staleness 3 at version 3
        q.push(group(&[&[2], &[2]])); // staleness 1
        q.push(group(&[&[1, 3], &[3]])); // staleness 2
        q.push(group(&[&[3], &[3]])); // staleness 0
        assert!(q.take_batch(4, 3, 2, None).is_none(), "one group is too stale, three are left");
        assert_eq!((q.dropped_groups, q.dropped_samples), (1, 2));
        let b = q.take_batch(2, 3, 2, None).expect("two groups");
        assert_eq!(b[0].seqs[0].versions, vec![2]);
        assert_eq!(b[1].seqs[0].versions, vec![1, 3]);
        assert_eq!(q.len(), 1);
        // At version 4 the group of version 3 is 1 behind: with a bound of 0 it goes.
        assert!(q.take_batch(1, 4, 0, None).is_none());
        assert_eq!((q.dropped_groups, q.dropped_samples), (2, 4));
    }

    #[test]
    fn batches_go_in_start_order_and_wait_for_a_group_still_generating() {
        let mut q = Queue::default();
        q.push(started(&[&[1]], 5));
        q.push(started(&[&[1]], 3));
        q.push(started(&[&[1]], 4));
        // Group 2 is still being generated: only the ones started before it may go.
        assert!(q.take_batch(1, 1, 2, Some(2)).is_none(), "a batch overtook a group started before it");
        let b = q.take_batch(2, 1, 2, Some(5)).expect("groups 3 and 4 started before the one in flight");
        assert_eq!(b.iter().map(|g| g.started).collect::<Vec<_>>(), vec![3, 4]);
        assert_eq!(q.take_batch(1, 1, 2, None).expect("nothing in flight")[0].started, 5);
    }
}
