//! Feeding the rollout engines and taking their segments in: new prompt groups while the queue
//! has room (back-pressure), the rest of the sequences a segment interrupted, and each reply's
//! tokens joined to their sequences under the weight version that generated them.

use super::Async;
use super::elastic::lend;
use super::engine::State;
use super::queue::{Group, Seq};
use crate::run::FailKind;
use crate::run::R;
use crate::run::fleet::InFlight;
use crate::run::protocol::{Generate, GenerateParams, GenerateReply};
use crate::run::task::{self, Rng};

/// Where a generated sample belongs: its group and sequence, and the `prompt_index` the reply
/// must give it (a new group's prompt, or the position of a continued sequence).
pub(super) struct Slot {
    pub(super) group: usize,
    pub(super) seq: usize,
    pub(super) prompt_index: usize,
}

impl Async {
    /// Groups started and not finished: on the engines, and those a lent engine left.
    pub(super) fn generating_groups(&self) -> usize {
        self.engines.iter().map(|e| e.groups.len()).sum::<usize>() + self.orphans.len()
    }

    /// Whether engine `k` may be given work now.
    pub(super) fn may_feed(&self, k: usize) -> bool {
        let e = &self.engines[k];
        let reclaiming = e.lent && self.lending.as_ref().is_some_and(lend::Lending::reclaiming);
        matches!(e.state, State::Awake) && !reclaiming
    }

    /// Engine `k` takes over groups a lent engine left, while it has room: they are older than
    /// any it would start, and the trainer's batch may wait for them.
    pub(super) fn adopt_orphans(&mut self, k: usize) {
        let room = self.groups_per_request.saturating_sub(self.engines[k].groups.len());
        let n = room.min(self.orphans.len());
        if n > 0 {
            self.engines[k].groups.extend(self.orphans.drain(..n).map(|g| Group { moved: true, ..g }));
        }
    }

    /// Gives every idle engine work: the rest of its interrupted sequences, and new prompts in the
    /// places of the groups it finished while the queue has room (back-pressure) and the run
    /// needs more. Refilling at every segment keeps an engine's batch full, as continuous
    /// batching does, instead of waiting for its longest response before starting the next.
    pub(super) fn feed_engines(&mut self) -> R<()> {
        // The trainer has taken its last batch: whatever the engines would still generate, nobody
        // trains on, and it would hold the run's end (and its wall time) until every group under
        // way had finished.
        if self.step() >= self.rig.cfg.run.steps {
            return Ok(());
        }
        for k in 0..self.engines.len() {
            if !self.may_feed(k) {
                continue;
            }
            self.adopt_orphans(k);
            let continued = self.engines[k].groups.len();
            let fresh = self.fresh_groups_for(continued, self.engines[k].lent);
            if continued + fresh == 0 {
                continue;
            }
            let lim = self.rig.task.operand_limit();
            let n = self.rig.cfg.rollout.samples_per_prompt;
            for _ in 0..fresh {
                let prompt = self.rig.task.prompt(self.rng.below(lim), self.rng.below(lim));
                let started = self.groups_started;
                self.groups_started += 1;
                self.engines[k].groups.push(Group { prompt, seqs: vec![Seq::default(); n], started, moved: false });
            }
            self.send_generate(k, continued > 0)?;
        }
        Ok(())
    }

    /// How many new groups an engine still generating `continued` groups may start; a `lent` one
    /// takes what room there is, its device otherwise idle.
    pub(super) fn fresh_groups_for(&self, continued: usize, lent: bool) -> usize {
        let free = self.groups_per_request.saturating_sub(continued);
        if free == 0 || self.step() >= self.rig.cfg.run.steps {
            return 0;
        }
        // Counting the batch in training too: a group started now is trained on within
        // capacity / batch updates, so the default capacity keeps every group within the
        // staleness bound. With nothing else under way an engine always may start a full batch.
        // A batch waiting for the reclaim is as good as in training (else a lend lets the engines
        // run a batch ahead of the capacity, and its groups go stale in the queue).
        let reclaiming = self.lending.as_ref().map_or(0, lend::Lending::batch_groups);
        let under_way = self.generating_groups() + self.training_groups + reclaiming;
        if under_way == 0 {
            return free;
        }
        let held = self.queue.len() + under_way;
        let room = self.capacity().saturating_sub(held);
        // A top-up smaller than the batch still pays a whole prefill round trip: only a full
        // batch's worth starts an idle engine, any room tops up one already generating.
        if continued == 0 && room < free && !lent { 0 } else { free.min(room) }
    }

    /// One generate request for engine `k`: its groups' unfinished sequences, each continued after
    /// the tokens it has, and its new groups' prompts (every prompt with its group size when all
    /// are new).
    pub(super) fn send_generate(&mut self, k: usize, continued: bool) -> R<()> {
        self.requests += 1;
        let seed = self.rig.cfg.run.seed.wrapping_mul(1_000_003) ^ (self.requests << 8) ^ k as u64;
        let e = &self.engines[k];
        // The engine's cache holds a sequence's prefix when no update came since its last segment,
        // the engine kept its cache (a lent engine wakes with none), and the group stayed on it.
        let same_cache = e.version == self.version && !e.cold_cache;
        let mut cached = Vec::new();
        let (prompts, n, responses, order, progress) = if continued {
            // One entry per sequence; a new group's sequences start with an empty response.
            let mut prompts = Vec::new();
            let mut responses = Vec::new();
            let mut order = Vec::new();
            let mut progress = Vec::new();
            for (g, group) in e.groups.iter().enumerate() {
                for (j, s) in group.seqs.iter().enumerate().filter(|(_, s)| !s.finished) {
                    prompts.push(group.prompt.clone());
                    responses.push(s.response.clone());
                    progress.push(s.progress);
                    cached.push(same_cache && !group.moved);
                    order.push(Slot { group: g, seq: j, prompt_index: order.len() });
                }
            }
            (prompts, 1, responses, order, progress)
        } else {
            let n = self.rig.cfg.rollout.samples_per_prompt;
            let prompts = e.groups.iter().map(|g| g.prompt.clone()).collect();
            let slots = |g| (0..n).map(move |j| Slot { group: g, seq: j, prompt_index: g });
            let order = (0..e.groups.len()).flat_map(slots).collect();
            (prompts, n, Vec::new(), order, Vec::new())
        };
        let budget = self.rig.cfg.segment_budget();
        // Carried steps go only with a budget (nothing else ends a segment mid-token), and only
        // when some sequence has any.
        let progress = if budget.is_some() && progress.iter().any(|p| *p > 0.0) { progress } else { Vec::new() };
        // A sequence's own seed, from where it stands in the run: its tokens are the same however
        // segments split it and whichever engines continue it.
        let base = self.rig.cfg.run.seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let seeds = order.iter().map(|o| {
            let started = e.groups[o.group].started;
            Rng::new(base ^ (started << 20) ^ o.seq as u64).next_u64()
        });
        let sequence_seeds = seeds.collect();
        let params = GenerateParams {
            prompts,
            n,
            max_new_tokens: self.rig.task.max_new_tokens(),
            temperature: self.rig.cfg.rollout.temperature,
            eos: Some(task::EOS),
            seed,
            step: self.step(),
            responses,
            segment_tokens: self.segment(),
            // Every prefix cached, or none: the request-wide flag. Some: each sequence's, with the
            // flag false, so that a worker that predates `cached` charges every prefix.
            prefix_cached: continued && cached.iter().all(|c| *c),
            cached: if cached.iter().all(|c| *c) || cached.iter().all(|c| !*c) { Vec::new() } else { cached },
            token_scale: self.rig.cfg.token_scale_at(self.version as f64),
            segment_s: budget,
            progress,
            sequence_seeds,
        };
        let request = self.rig.fleet.submit::<Generate>(e.worker, params)?;
        self.mark_sent(k, request, order);
        Ok(())
    }

    /// Engine `k` has a request in flight: its idle time ends, and its cache now holds every
    /// group it generates, under the current weights.
    fn mark_sent(&mut self, k: usize, request: InFlight, order: Vec<Slot>) {
        let e = &mut self.engines[k];
        let idle = e.send(request, order, self.version);
        self.accounts.engine_idle(e.lent, idle);
    }

    /// Engine `k`'s segment: its tokens join their sequences under the current version; finished
    /// groups go to the queue.
    pub(super) fn take_generated(&mut self, k: usize) -> R<()> {
        let (request, order) = self.engines[k].answered();
        let worker = request.worker;
        let name = self.rig.fleet.worker(worker).name.clone();
        let phase = self.rig.at.phase();
        self.rig.at.set_phase("generate");
        let reply: GenerateReply = self.rig.fleet.collect::<Generate>(request)?;
        self.rig.at.set_phase(&phase);
        if self.step() >= self.rig.cfg.run.steps {
            self.accounts.reply_after_last_batch();
        }
        let at = self.rig.at.clone();
        let bad = |cause: String| at.fail(FailKind::Worker, Some(&name), cause);
        if reply.samples.len() != order.len() {
            return Err(bad(format!("generate returned {} samples, expected {}", reply.samples.len(), order.len())));
        }
        let max_new = self.rig.task.max_new_tokens();
        let segment = self.segment();
        let partial = self.partial();
        let version = self.version;
        let mut mid_token = false;
        let tokens: u64 = reply.samples.iter().map(|s| s.response.len() as u64).sum();
        for (s, slot) in reply.samples.into_iter().zip(&order) {
            if s.prompt_index != slot.prompt_index || s.logprobs.len() != s.response.len() {
                return Err(bad("generate returned a malformed sample".into()));
            }
            if let Some(limit) = segment
                && s.response.len() > limit
            {
                return Err(bad(format!(
                    "generate returned {} tokens for a segment of {limit} (async.segment_tokens): the worker does not \
                     support partial rollouts (docs/worker-protocol.md); set async.segment_tokens=0",
                    s.response.len()
                )));
            }
            if !(s.progress >= 0.0 && s.progress.is_finite()) {
                return Err(bad(format!(
                    "generate returned field `progress` = {} for a sequence: it must be the modelled decode steps \
                     done towards its next token (finite, >= 0)",
                    s.progress
                )));
            }
            let seq = &mut self.engines[k].groups[slot.group].seqs[slot.seq];
            seq.versions.extend(std::iter::repeat_n(version, s.response.len()));
            seq.response.extend(s.response);
            seq.logprobs.extend(s.logprobs);
            seq.finished = s.finished || seq.response.len() >= max_new || !partial;
            seq.progress = if seq.finished { 0.0 } else { s.progress };
            mid_token |= seq.progress > 0.0;
            if seq.response.is_empty() && seq.finished {
                return Err(bad("generate returned an empty response".into()));
            }
        }
        self.accounts.segment_ended(mid_token);
        // A lent engine idles only while lent: once the reclaim begins it takes no more work.
        let lent_now = self.lending.as_ref().is_some_and(lend::Lending::lent);
        let e = &mut self.engines[k];
        if !e.lent || lent_now {
            e.start_idle();
        }
        // A finished group leaves at once: the trainer may take it while the rest go on.
        let (done, going): (Vec<Group>, Vec<Group>) =
            std::mem::take(&mut e.groups).into_iter().partition(Group::finished);
        e.groups = going;
        let lent = e.lent;
        if let Some(l) = self.lending.as_mut() {
            l.groups_finished(done.len(), lent, tokens);
        }
        for g in done {
            self.queue.push(g);
        }
        if !lent && self.lending.as_ref().is_some_and(lend::Lending::lent) {
            self.share_with_lent(k);
        }
        Ok(())
    }

    /// Elastic mode, while lent: engine `k`, between segments, hands its oldest unfinished groups
    /// to the lent engines until no engine holds more than its share. Decoding is bound by each
    /// sequence's cache reads, so fewer sequences per engine decode faster; and the oldest groups
    /// are those the trainer's batch waits for. A lent engine takes them even mid-segment: its
    /// request's slots name only the groups it had.
    pub(super) fn share_with_lent(&mut self, k: usize) {
        let awake: Vec<usize> = (0..self.engines.len()).filter(|&j| self.engines[j].awake()).collect();
        let total: usize = awake.iter().map(|&j| self.engines[j].groups.len()).sum();
        let share = total.div_ceil(awake.len().max(1));
        let mut lent: Vec<usize> = awake.into_iter().filter(|&j| self.engines[j].lent).collect();
        self.engines[k].groups.sort_by_key(|g| g.started);
        while self.engines[k].groups.len() > share {
            lent.sort_by_key(|&j| self.engines[j].groups.len());
            let Some(&j) = lent.first().filter(|&&j| self.engines[j].groups.len() < share) else { break };
            let g = self.engines[k].groups.remove(0);
            self.engines[j].groups.push(Group { moved: true, ..g });
        }
    }
}
