//! The rollouter: the rollout engines, the prompt groups they generate and the queue of finished
//! ones. It feeds the engines (new prompt groups while the queue has room, which is the
//! back-pressure; the rest of the sequences a segment interrupted) and takes their segments in,
//! each token joined to its sequence under the weight version that generated it. Everything that
//! changes an engine or a group goes through a method here: the trainer's side takes batches,
//! elastic mode wakes, retires and puts lent engines to sleep, and nothing else writes them.

use super::accounts::Accounts;
use super::engine::{Engine, State};
use super::queue::{Group, Queue, Seq};
use crate::run::clock::Instant;
use crate::run::config::Config;
use crate::run::fleet::{Fleet, InFlight};
use crate::run::protocol::{Generate, GenerateParams, GenerateReply, Generated};
use crate::run::rig::Rig;
use crate::run::task::{self, Rng};
use crate::run::{FailKind, R, Role};
use std::time::Duration;

/// Where a generated sample belongs: its group and sequence, and the `prompt_index` the reply
/// must give it (a new group's prompt, or the position of a continued sequence).
pub(super) struct Slot {
    pub(super) group: usize,
    pub(super) seq: usize,
    pub(super) prompt_index: usize,
}

/// The sequences of one generate request, each with its place in the engine's groups.
struct Batch {
    prompts: Vec<Vec<u32>>,
    /// Samples a prompt: the group size for new groups, 1 when every sequence is listed.
    n: usize,
    responses: Vec<Vec<u32>>,
    order: Vec<Slot>,
    /// Modelled steps each continued sequence has carried; empty for new groups.
    progress: Vec<f64>,
    /// Whether the engine's cache still holds each continued sequence's prefix.
    cached: Vec<bool>,
}

impl Batch {
    /// New groups: each prompt once, `n` samples of it.
    fn fresh(e: &Engine, n: usize) -> Batch {
        let prompts = e.groups.iter().map(|g| g.prompt.clone()).collect();
        let slots = |g| (0..n).map(move |j| Slot { group: g, seq: j, prompt_index: g });
        let order = (0..e.groups.len()).flat_map(slots).collect();
        Batch { prompts, n, responses: Vec::new(), order, progress: Vec::new(), cached: Vec::new() }
    }

    /// The engine's unfinished sequences, one entry each (a new group's start with an empty
    /// response); a prefix is cached when the engine's cache is and the group never moved.
    fn continued(e: &Engine, same_cache: bool) -> Batch {
        let mut b = Batch {
            prompts: Vec::new(),
            n: 1,
            responses: Vec::new(),
            order: Vec::new(),
            progress: Vec::new(),
            cached: Vec::new(),
        };
        for (g, group) in e.groups.iter().enumerate() {
            for (j, s) in group.seqs.iter().enumerate().filter(|(_, s)| !s.finished) {
                b.prompts.push(group.prompt.clone());
                b.responses.push(s.response.clone());
                b.progress.push(s.progress);
                b.cached.push(same_cache && !group.moved);
                b.order.push(Slot { group: g, seq: j, prompt_index: b.order.len() });
            }
        }
        b
    }
}

/// Each sequence's own seed, from where it stands in the run: its tokens are the same however
/// segments split it and whichever engines continue it.
fn sequence_seeds(cfg: &Config, e: &Engine, order: &[Slot]) -> Vec<u64> {
    let base = cfg.run.seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
    order
        .iter()
        .map(|o| {
            let started = e.groups[o.group].started;
            Rng::new(base ^ (started << 20) ^ o.seq as u64).next_u64()
        })
        .collect()
}

/// Where elastic mode's lend of the trainer's devices stands, as feeding the engines needs to
/// know it (all false outside elastic mode).
#[derive(Clone, Copy, Default)]
pub(super) struct LendView {
    /// The lent engines are generating on the trainer's devices.
    pub(super) lent: bool,
    /// The trainer's batch is ready and waits for the lent engines' segments.
    pub(super) reclaiming: bool,
    /// The groups of that batch, out of the queue (as good as in training).
    pub(super) reclaim_batch: usize,
}

/// What one engine's segment finished, for elastic mode's figures.
pub(super) struct Finished {
    pub(super) groups: usize,
    /// A lent engine's segment.
    pub(super) lent: bool,
    pub(super) tokens: u64,
}

pub(super) struct Rollouter {
    engines: Vec<Engine>,
    queue: Queue,
    /// Unfinished groups a reclaimed or retired lent engine left: any engine continues them,
    /// before new ones.
    orphans: Vec<Group>,
    /// The weights the engines hold: how many updates reached them (0: the initial ones).
    version: u64,
    /// Prompt groups one generate request starts on an engine.
    groups_per_request: usize,
    /// Trainer steps finished since the last weight update: the queue's bound shrinks with them
    /// (`Config::queue_capacity_at`).
    trained_since_update: u64,
    /// Groups in the batch the trainer is working on (0 while it waits).
    in_training: usize,
    rng: Rng,
    requests: u64,
    /// Groups started so far: the next one's place in the start order.
    groups_started: u64,
}

/// Most versions a trained sample may be behind the weights (async.max_staleness, never below 0).
pub(super) fn max_staleness(cfg: &Config) -> u64 {
    cfg.asynchronous.max_staleness.max(0) as u64
}

/// Groups queued, being generated and in training before an engine waits (back-pressure):
/// `Config::queue_capacity`.
pub(super) fn capacity(cfg: &Config) -> usize {
    cfg.queue_capacity()
}

fn segment(cfg: &Config) -> Option<usize> {
    Some(cfg.asynchronous.segment_tokens as usize).filter(|s| *s > 0)
}

/// Whether generation runs in segments (of tokens, of modelled time, or both), or each request
/// runs its sequences to the end.
fn partial(cfg: &Config) -> bool {
    segment(cfg).is_some() || cfg.segment_budget().is_some()
}

/// A generate request's modelled tokens per task token: the mean of its sequences' (one request
/// charges one scale), each by the batch its group was drawn for (`started`), or with
/// compute.cost_by_version by the engines' weights `version`. None: no growth.
fn request_token_scale(cfg: &Config, version: u64, started: impl Iterator<Item = u64>) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0usize);
    for s in started {
        sum += cfg.token_scale_at(cfg.cost_clock(version as f64, s))?;
        n += 1;
    }
    if n == 0 {
        return cfg.token_scale_at(version as f64);
    }
    Some(sum / n as f64)
}

/// Waits for `request`'s reply. A failure meanwhile names the phase "generate", whatever the
/// caller was doing; the caller's phase is back once the reply is in.
fn collect_reply(rig: &mut Rig, accounts: &mut Accounts, request: InFlight) -> R<GenerateReply> {
    let phase = rig.at.phase();
    rig.at.set_phase("generate");
    let reply: GenerateReply = rig.fleet.collect::<Generate>(request)?;
    rig.at.set_phase(&phase);
    if rig.at.step() >= rig.cfg.run.steps {
        accounts.reply_after_last_batch();
    }
    Ok(reply)
}

/// Whether a sample may join the sequence in `slot`: it answers that slot, has a log-probability
/// per token, fits the segment, and carries a count of modelled steps (finite, >= 0). Err: why not.
fn check_sample(s: &Generated, slot: &Slot, segment: Option<usize>) -> Result<(), String> {
    if s.prompt_index != slot.prompt_index || s.logprobs.len() != s.response.len() {
        return Err("generate returned a malformed sample".into());
    }
    if let Some(limit) = segment
        && s.response.len() > limit
    {
        return Err(format!(
            "generate returned {} tokens for a segment of {limit} (async.segment_tokens): the worker does not \
             support partial rollouts (docs/worker-protocol.md); set async.segment_tokens=0",
            s.response.len()
        ));
    }
    if !(s.progress >= 0.0 && s.progress.is_finite()) {
        return Err(format!(
            "generate returned field `progress` = {} for a sequence: it must be the modelled decode steps \
             done towards its next token (finite, >= 0)",
            s.progress
        ));
    }
    Ok(())
}

/// Whether `seq`'s segment stopped it part-way through a token. With drawn lengths its progress
/// counts its steps since its start, so part-way is between two of its tokens (every
/// token_scale steps); otherwise any steps towards its next token are.
fn stopped_mid_token(cfg: &Config, seq: &Seq) -> bool {
    match cfg.compute.lengths_table {
        Some(_) => {
            let tokens = seq.progress / cfg.compute.token_scale;
            (tokens - tokens.round()).abs() > 1e-9
        }
        None => seq.progress > 0.0,
    }
}

impl Rollouter {
    /// The engines of their own devices start awake, elastic mode's lent ones asleep.
    pub(super) fn new(cfg: &Config, fleet: &Fleet) -> Rollouter {
        let rollouts = fleet.indices(Role::Rollout);
        let own = rollouts.iter().map(|&w| Engine::new(w, false));
        let engines = own.chain(fleet.lent_engines().into_iter().map(|w| Engine::new(w, true)));
        Rollouter {
            engines: engines.collect(),
            queue: Queue::default(),
            orphans: Vec::new(),
            version: 0,
            groups_per_request: cfg.engine_groups(rollouts.len()),
            trained_since_update: 0,
            in_training: 0,
            rng: Rng::new(cfg.run.seed ^ 0xDA7A),
            requests: 0,
            groups_started: 0,
        }
    }

    /// The trainer has finished `steps` steps since the last weight update.
    pub(super) fn set_trained_since_update(&mut self, steps: u64) {
        self.trained_since_update = steps;
    }

    pub(super) fn version(&self) -> u64 {
        self.version
    }

    pub(super) fn queue(&self) -> &Queue {
        &self.queue
    }

    pub(super) fn has_orphans(&self) -> bool {
        !self.orphans.is_empty()
    }

    pub(super) fn orphans(&self) -> usize {
        self.orphans.len()
    }

    /// The most sequences one generate request holds.
    pub(super) fn max_batch(&self, cfg: &Config) -> usize {
        self.groups_per_request * cfg.rollout.samples_per_prompt
    }

    /// The engines on devices of their own (not elastic mode's lent ones).
    pub(super) fn own_engines(&self) -> usize {
        self.engines.iter().filter(|e| !e.lent).count().max(1)
    }

    pub(super) fn generating(&self) -> bool {
        self.engines.iter().any(Engine::generating)
    }

    /// A new weight version reached every engine.
    pub(super) fn published(&mut self) {
        self.version += 1;
    }

    /// The run's steps begin: the engines of their own devices count idle time from now.
    pub(super) fn start(&mut self) {
        for e in self.engines.iter_mut().filter(|e| !e.lent) {
            e.start_idle();
        }
    }

    /// The requests in flight, in engine order.
    pub(super) fn requests(&self) -> Vec<&InFlight> {
        self.engines.iter().filter_map(Engine::request).collect()
    }

    /// The engine whose request was the `nth` of `requests()`.
    fn nth_generating(&self, nth: usize) -> usize {
        let mut generating = self.engines.iter().enumerate().filter(|(_, e)| e.generating());
        generating.nth(nth).map(|(k, _)| k).expect("an engine in flight")
    }

    /// The earliest start among the groups not yet finished: being generated or left by a lent
    /// engine.
    pub(super) fn first_in_flight(&self) -> Option<u64> {
        let generating = self.engines.iter().flat_map(|e| &e.groups);
        generating.chain(&self.orphans).map(|g| g.started).min()
    }

    /// The trainer's next batch, if the queue holds one: stale groups dropped, those started
    /// first taken, none overtaking a group still generating.
    pub(super) fn take_batch(&mut self, cfg: &Config) -> Option<Vec<Group>> {
        let first = self.first_in_flight();
        let batch = cfg.rollout.prompts_per_step;
        self.queue.take_batch(batch, self.version, max_staleness(cfg), first)
    }

    /// The trainer works on `groups` groups (0: it is done with them).
    pub(super) fn set_in_training(&mut self, groups: usize) {
        self.in_training = groups;
    }

    /// Groups started and not finished: on the engines, and those a lent engine left.
    pub(super) fn generating_groups(&self) -> usize {
        self.engines.iter().map(|e| e.groups.len()).sum::<usize>() + self.orphans.len()
    }

    /// A metrics window closes: every engine's idle time so far counts in it, the next window's
    /// from now.
    pub(super) fn roll_idle(&mut self, accounts: &mut Accounts) {
        let now = Instant::now();
        for e in self.engines.iter_mut() {
            let idle = e.roll_idle(now);
            accounts.engine_idle(e.lent, idle);
        }
    }

    /// Whether engine `k` may be given work now.
    fn may_feed(&self, k: usize, lend: LendView) -> bool {
        let e = &self.engines[k];
        matches!(e.state, State::Awake) && !(e.lent && lend.reclaiming)
    }

    /// Engine `k` takes over groups a lent engine left, while it has room: they are older than
    /// any it would start, and the trainer's batch may wait for them.
    fn adopt_orphans(&mut self, k: usize) {
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
    pub(super) fn feed(&mut self, rig: &mut Rig, accounts: &mut Accounts, lend: LendView) -> R<()> {
        // The trainer has taken its last batch: whatever the engines would still generate, nobody
        // trains on, and it would hold the run's end (and its wall time) until every group under
        // way had finished.
        if rig.at.step() >= rig.cfg.run.steps {
            return Ok(());
        }
        for k in 0..self.engines.len() {
            if !self.may_feed(k, lend) {
                continue;
            }
            self.adopt_orphans(k);
            let continued = self.engines[k].groups.len();
            let fresh = self.fresh_groups_for(rig, continued, self.engines[k].lent, lend);
            if continued + fresh == 0 {
                continue;
            }
            let lim = rig.task.operand_limit();
            let n = rig.cfg.rollout.samples_per_prompt;
            for _ in 0..fresh {
                let prompt = rig.task.prompt(self.rng.below(lim), self.rng.below(lim));
                let started = self.groups_started;
                self.groups_started += 1;
                self.engines[k].groups.push(Group { prompt, seqs: vec![Seq::default(); n], started, moved: false });
            }
            self.send_generate(rig, accounts, k, continued > 0)?;
        }
        Ok(())
    }

    /// How many new groups an engine still generating `continued` groups may start; a `lent` one
    /// takes what room there is, its device otherwise idle.
    pub(super) fn fresh_groups_for(&self, rig: &Rig, continued: usize, lent: bool, lend: LendView) -> usize {
        let free = self.groups_per_request.saturating_sub(continued);
        if free == 0 || rig.at.step() >= rig.cfg.run.steps {
            return 0;
        }
        // Counting the batch in training too: a group started now is trained on before the
        // staleness bound's updates have gone out (Config::queue_capacity_at), so the default
        // capacity keeps every group within the bound. With nothing else under way an engine
        // may start a full request within the capacity, and at least one group: the trainer
        // then waits for fewer than a batch, never more than the capacity. A batch waiting for
        // the reclaim is as good as in training (else a lend lets the engines run a batch ahead
        // of the capacity, and its groups go stale in the queue).
        let capacity = rig.cfg.queue_capacity_at(self.trained_since_update);
        let under_way = self.generating_groups() + self.in_training + lend.reclaim_batch;
        if under_way == 0 {
            return free.min(capacity.saturating_sub(self.queue.len()).max(1));
        }
        let held = self.queue.len() + under_way;
        let room = capacity.saturating_sub(held);
        // A top-up smaller than the batch still pays a whole prefill round trip: only a full
        // batch's worth starts an idle engine, any room tops up one already generating.
        if continued == 0 && room < free && !lent { 0 } else { free.min(room) }
    }

    /// One generate request for engine `k`: its groups' unfinished sequences, each continued after
    /// the tokens it has, and its new groups' prompts (every prompt with its group size when all
    /// are new).
    fn send_generate(&mut self, rig: &mut Rig, accounts: &mut Accounts, k: usize, continued: bool) -> R<()> {
        self.requests += 1;
        let cfg = &rig.cfg;
        let seed = cfg.run.seed.wrapping_mul(1_000_003) ^ (self.requests << 8) ^ k as u64;
        let e = &self.engines[k];
        // The engine's cache holds a sequence's prefix when no update came since its last segment,
        // the engine kept its cache (a lent engine wakes with none), and the group stayed on it.
        let same_cache = e.version == self.version && !e.cold_cache;
        let batch =
            if continued { Batch::continued(e, same_cache) } else { Batch::fresh(e, cfg.rollout.samples_per_prompt) };
        let Batch { prompts, n, responses, order, progress, cached } = batch;
        let budget = cfg.segment_budget();
        // A sequence's drawn length (compute.lengths), by its group's place in the run's order of
        // prompts and its own in the group: the same whichever engine continues it.
        let lengths: Vec<f64> =
            order.iter().filter_map(|o| cfg.drawn_length(e.groups[o.group].started, o.seq as u64)).collect();
        // Carried steps go only with a budget (nothing else ends a segment mid-token), or with
        // drawn lengths (they count a sequence's steps since its start), and only when some
        // sequence has any.
        let carry = budget.is_some() || !lengths.is_empty();
        let progress = if carry && progress.iter().any(|p| *p > 0.0) { progress } else { Vec::new() };
        let params = GenerateParams {
            prompts,
            n,
            max_new_tokens: rig.task.max_new_tokens(),
            temperature: cfg.rollout.temperature,
            eos: Some(task::EOS),
            seed,
            step: rig.at.step(),
            responses,
            segment_tokens: segment(cfg),
            // Every prefix cached, or none: the request-wide flag. Some: each sequence's, with the
            // flag false, so that a worker that predates `cached` charges every prefix.
            prefix_cached: continued && cached.iter().all(|c| *c),
            cached: if cached.iter().all(|c| *c) || cached.iter().all(|c| !*c) { Vec::new() } else { cached },
            token_scale: request_token_scale(cfg, self.version, order.iter().map(|o| e.groups[o.group].started)),
            segment_s: budget,
            progress,
            sequence_seeds: sequence_seeds(cfg, e, &order),
            lengths,
        };
        let request = rig.fleet.submit::<Generate>(e.worker, params)?;
        // Its idle time ends, and its cache now holds every group it generates, under the
        // current weights.
        let e = &mut self.engines[k];
        let idle = e.send(request, order, self.version);
        accounts.engine_idle(e.lent, idle);
        Ok(())
    }

    /// The `nth` request in flight answered: its tokens join their sequences under the current
    /// version; finished groups go to the queue; while lent, the engine shares its oldest groups
    /// with the lent engines.
    pub(super) fn take_generated(
        &mut self,
        rig: &mut Rig,
        accounts: &mut Accounts,
        nth: usize,
        lend: LendView,
    ) -> R<Finished> {
        let k = self.nth_generating(nth);
        let (request, order) = self.engines[k].answered();
        let name = rig.fleet.worker(request.worker).name.clone();
        let reply = collect_reply(rig, accounts, request)?;
        let at = rig.at.clone();
        let bad = |cause: String| at.fail(FailKind::Worker, Some(&name), cause);
        if reply.samples.len() != order.len() {
            return Err(bad(format!("generate returned {} samples, expected {}", reply.samples.len(), order.len())));
        }
        let tokens: u64 = reply.samples.iter().map(|s| s.response.len() as u64).sum();
        let role = if self.engines[k].lent { "lent" } else { "rollout" };
        rig.rec.record_decode(role, &name, tokens, reply.decode.as_ref());
        let mid_token = self.join_samples(rig, k, reply.samples, &order).map_err(bad)?;
        accounts.segment_ended(mid_token);
        Ok(self.settle(k, lend, tokens))
    }

    /// Joins a reply's samples to engine `k`'s sequences in `order`, under the current version,
    /// each checked before it joins; returns whether any sequence stopped part-way through a
    /// token. Err: what is wrong with the reply.
    fn join_samples(&mut self, rig: &Rig, k: usize, samples: Vec<Generated>, order: &[Slot]) -> Result<bool, String> {
        let cfg = &rig.cfg;
        let max_new = rig.task.max_new_tokens();
        let (segment, partial, version) = (segment(cfg), partial(cfg), self.version);
        let mut mid_token = false;
        for (s, slot) in samples.into_iter().zip(order) {
            check_sample(&s, slot, segment)?;
            let seq = &mut self.engines[k].groups[slot.group].seqs[slot.seq];
            seq.versions.extend(std::iter::repeat_n(version, s.response.len()));
            seq.response.extend(s.response);
            seq.logprobs.extend(s.logprobs);
            // With drawn lengths a task response at max_new_tokens may still be decoding: the
            // worker says when its length is done.
            let full = seq.response.len() >= max_new && cfg.compute.lengths_table.is_none();
            seq.finished = s.finished || full || !partial;
            seq.progress = if seq.finished { 0.0 } else { s.progress };
            mid_token |= stopped_mid_token(cfg, seq);
            if seq.response.is_empty() && seq.finished {
                return Err("generate returned an empty response".into());
            }
        }
        Ok(mid_token)
    }

    /// Engine `k`'s segment is in: the engine idles until its next request, its finished groups
    /// go to the queue, and while lent one of its own shares its oldest groups.
    fn settle(&mut self, k: usize, lend: LendView, tokens: u64) -> Finished {
        // A lent engine idles only while lent: once the reclaim begins it takes no more work.
        let e = &mut self.engines[k];
        if !e.lent || lend.lent {
            e.start_idle();
        }
        // A finished group leaves at once: the trainer may take it while the rest go on.
        let (done, going): (Vec<Group>, Vec<Group>) =
            std::mem::take(&mut e.groups).into_iter().partition(Group::finished);
        e.groups = going;
        let finished = Finished { groups: done.len(), lent: e.lent, tokens };
        for g in done {
            self.queue.push(g);
        }
        if !finished.lent && lend.lent {
            self.share_with_lent(k);
        }
        finished
    }

    /// Elastic mode, while lent: engine `k`, between segments, hands its oldest unfinished groups
    /// to the lent engines until no engine holds more than its share. Decoding is bound by each
    /// sequence's cache reads, so fewer sequences per engine decode faster; and the oldest groups
    /// are those the trainer's batch waits for. A lent engine takes them even mid-segment: its
    /// request's slots name only the groups it had.
    fn share_with_lent(&mut self, k: usize) {
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

    // Elastic mode's lent engines, and the engines of their own devices lent the other way.

    /// The lent engines that may still be lent (not retired), by their place among the engines.
    pub(super) fn lent_slots(&self) -> Vec<usize> {
        (0..self.engines.len()).filter(|&k| self.engines[k].lent && !self.engines[k].retired()).collect()
    }

    /// The fleet index of the engine in `slot`.
    pub(super) fn worker(&self, slot: usize) -> usize {
        self.engines[slot].worker
    }

    /// The lent engines in `slots` woke on the trainer's devices with the current weights and an
    /// empty cache; idle until their first request (their share of the work, while lent).
    pub(super) fn wake_lent(&mut self, slots: &[usize]) {
        for &k in slots {
            let e = &mut self.engines[k];
            (e.state, e.version, e.cold_cache) = (State::Awake, self.version, true);
            e.start_idle();
        }
    }

    /// The lent engines take no more work from here (a reclaim, a retirement): their idle time
    /// while lent ends.
    pub(super) fn stop_lent_idle(&mut self, accounts: &mut Accounts) {
        for k in self.lent_slots() {
            let idle = self.engines[k].stop_idle();
            accounts.engine_idle(true, idle);
        }
    }

    /// Of the lent slots, those with a request in flight.
    pub(super) fn lent_generating(&self) -> Vec<usize> {
        self.lent_slots().into_iter().filter(|&k| self.engines[k].generating()).collect()
    }

    /// The earliest moment a lent engine's segment in flight runs past `timeout`.
    pub(super) fn lent_due(&self, timeout: Duration) -> Option<Instant> {
        let now = Instant::now();
        let sent = self.lent_slots().into_iter().filter_map(|k| self.engines[k].sent());
        sent.map(|t| t + timeout).filter(|at| *at > now).min()
    }

    /// Lent engines whose segment has run past `timeout` while they hold the oldest group under
    /// way (the one the trainer's batch waits for).
    pub(super) fn lent_stuck(&self, timeout: Duration) -> Vec<usize> {
        let Some(oldest) = self.first_in_flight() else { return Vec::new() };
        let stuck = |&k: &usize| {
            let e = &self.engines[k];
            e.sent().is_some_and(|t| t.elapsed() >= timeout) && e.groups.iter().any(|g| g.started == oldest)
        };
        self.lent_slots().into_iter().filter(stuck).collect()
    }

    /// The lent engine in `slot` is retired (its request's answer never read); its groups' tokens
    /// so far are kept for the other engines.
    pub(super) fn retire(&mut self, slot: usize, accounts: &mut Accounts) {
        let e = &mut self.engines[slot];
        e.state = State::Retired;
        accounts.engine_idle(true, e.stop_idle());
        let groups = std::mem::take(&mut e.groups);
        self.orphans.extend(groups);
        self.orphans.sort_by_key(|g| g.started);
    }

    /// The awake lent engines go to sleep, their groups left to the others. Returns their fleet
    /// indices and the tokens they left.
    pub(super) fn put_lent_to_sleep(&mut self) -> (Vec<usize>, usize) {
        let slots: Vec<usize> = self.lent_slots().into_iter().filter(|&k| self.engines[k].awake()).collect();
        let mut tokens = 0;
        for &k in &slots {
            let e = &mut self.engines[k];
            e.state = State::Asleep;
            for g in std::mem::take(&mut e.groups) {
                tokens += g.seqs.iter().map(|s| s.response.len()).sum::<usize>();
                self.orphans.push(g);
            }
        }
        self.orphans.sort_by_key(|g| g.started);
        (slots.iter().map(|&k| self.engines[k].worker).collect(), tokens)
    }

    /// Whether the engines of their own devices have a request or an unfinished group, or there
    /// are groups a lent engine left.
    pub(super) fn own_busy(&self) -> bool {
        let mut own = self.engines.iter().filter(|e| !e.lent);
        own.any(|e| e.generating() || !e.groups.is_empty()) || !self.orphans.is_empty()
    }

    /// The engines of their own devices sleep (`false`) or wake (`true`): their devices lent to
    /// the trainer, or back.
    pub(super) fn set_own_awake(&mut self, awake: bool) {
        for e in self.engines.iter_mut().filter(|e| !e.lent) {
            e.state = if awake { State::Awake } else { State::Asleep };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(by_version: bool) -> Config {
        let sets = [
            "compute.model=true".to_string(),
            "memory.profile=qwen3-4b".into(),
            "run.mode=async".into(),
            "run.devices=2".into(),
            "run.steps=10".into(),
            "rollout.prompts_per_step=24".into(),
            "compute.token_scale=150".into(),
            "compute.token_scale_final=600".into(),
            format!("compute.cost_by_version={by_version}"),
        ];
        crate::run::config::load(None, &sets).unwrap()
    }

    /// The engines' weights may be any version behind; the request costs what its groups' batches
    /// cost unless the job asks for the version's discount.
    #[test]
    fn a_request_costs_by_its_groups_not_by_the_engines_weights() {
        let c = cfg(false);
        let groups = [48, 48, 49, 60];
        let by_group: Vec<_> = (0..4).map(|v| request_token_scale(&c, v, groups.iter().copied())).collect();
        assert!(by_group.iter().all(|s| *s == Some(250.0)), "{by_group:?}");
        let c = cfg(true);
        let by_version: Vec<_> = (0..3).map(|v| request_token_scale(&c, v, groups.iter().copied())).collect();
        assert_eq!(by_version, vec![Some(150.0), Some(200.0), Some(250.0)]);
    }
}
