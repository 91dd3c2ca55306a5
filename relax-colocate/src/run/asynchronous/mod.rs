//! The async driver (run.mode = "async"): the trainer and the rollout engines on devices of their
//! own, working at once, as verl's fully-async policy and Relax's `--fully-async` run them.
//!
//! The rollout engines generate prompt groups into a bounded queue (queue.rs) while the trainer
//! trains on the batches it takes out; every `async.train_iters_per_update` trainer steps the new
//! weights go to every engine. Generation runs in segments of `async.segment_tokens` tokens: an
//! update waits only for the segments in flight, and the sequences it interrupted continue under
//! the new weights (partial rollouts), every token keeping the version that generated it. A group
//! whose oldest token is more than `async.max_staleness` versions old when the trainer reaches it
//! is dropped and counted. One request is in flight per worker at a time; the fleet says which
//! answered first.
//!
//! Elastic mode (run.mode = "elastic") is this driver with lending (lend.rs): a trainer that waits
//! for samples past `elastic.lend_after_s` sleeps, and the lent engine on its device generates
//! until the trainer's batch is ready.

mod lend;
mod queue;

use super::config::{AlgoName, Config, Mode};
use super::fleet::{Fleet, InFlight};
use super::launch::Plan;
use super::learn::{self, Advantages, Sample, Scores};
use super::metrics::{self, mean};
use super::profile::Profile;
use super::protocol::{
    self, Generate, GenerateParams, GenerateReply, Init, LogProbs, LogProbsParams, LogProbsReply, Model, Pair,
    SamplesParams, Train, TrainReply, Values, ValuesReply,
};
use super::recorder::{Recorder, Span};
use super::task::{self, Addition, Rng};
use super::{Cursor, FailKind, R, Role, RunError, model, weights};
use queue::{Group, Queue, Seq};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Instant;

pub(super) struct Async {
    pub(super) cfg: Config,
    pub(super) at: Rc<Cursor>,
    task: Addition,
    shape: model::Shape,
    pub(super) profile: Profile,
    api: &'static str,
    pub(super) fleet: Fleet,
    pub(super) rec: Recorder,
    pub(super) sync: weights::WeightSync,
    /// The weights the rollout engines hold: how many updates reached them (0: the initial ones).
    version: u64,
    queue: Queue,
    engines: Vec<Engine>,
    /// Prompt groups one generate request starts on an engine.
    groups_per_request: usize,
    /// Groups in the batch the trainer is working on (0 while it waits).
    training_groups: usize,
    rng: Rng,
    requests: u64,
    /// Groups started so far: the next one's place in the start order.
    groups_started: u64,
    totals: Totals,
    /// Since the last metrics row: time the trainer waited for a batch, and the engines' idle time.
    window: Window,
    /// Elastic mode's lending (None in async mode).
    lending: Option<lend::Lending>,
    /// Unfinished groups a reclaimed lent engine left: any engine continues them, before new ones.
    orphans: Vec<Group>,
}

/// A rollout engine and the groups it is generating.
struct Engine {
    worker: usize,
    groups: Vec<Group>,
    /// The request in flight, and where each of its replies belongs.
    request: Option<(InFlight, Vec<Slot>)>,
    /// When it last became idle (no request in flight).
    idle_since: Option<Instant>,
    /// The weight version its last segment ran under.
    version: u64,
    /// Elastic mode's lent engine: generates only while its trainer's device is lent.
    lent: bool,
    /// Whether it may generate: always for an engine of its own device; for a lent one, while lent.
    awake: bool,
    /// A lent engine that did not give its device back in time: paused from outside, never used again.
    retired: bool,
    /// It took over groups another engine began: its cache holds none of their prefixes.
    adopted: bool,
    /// When its request in flight was sent.
    sent_at: Option<Instant>,
}

/// Where a generated sample belongs: its group and sequence, and the `prompt_index` the reply
/// must give it (a new group's prompt, or the position of a continued sequence).
struct Slot {
    group: usize,
    seq: usize,
    prompt_index: usize,
}

/// Over the whole run, for the summary.
#[derive(Default)]
struct Totals {
    samples_trained: u64,
    tokens_trained: u64,
    /// Trained samples per staleness (versions between their oldest token and the weights then).
    staleness: BTreeMap<u64, u64>,
    partial_samples: u64,
    updates: u64,
    update_s: f64,
    update_bytes: u64,
    trainer_idle_s: f64,
    /// The flushes that ended a written step's window (the rows' `perf/flush_time`).
    flush_total_s: f64,
    rollout_idle_s: f64,
    /// Generate replies that came after the trainer took its last batch: the segments then in
    /// flight, none started since.
    replies_after_last_batch: u64,
    /// Segments async.segment_s ended part-way through a token of at least one sequence.
    segments_mid_token: u64,
    /// Each update's flush: the trainer's step done, the engines finishing their segments.
    flush_s: Vec<f64>,
    started: Option<Instant>,
}

struct Window {
    start: Instant,
    trainer_idle_s: f64,
    rollout_idle_s: f64,
    /// The update's flush (Relax's pause): the trainer's devices wait for the engines' segments.
    flush_s: f64,
    /// Elastic mode: of the trainer's idle time, what its devices spent lent (generating) and
    /// switching (lends and reclaims).
    lent_s: f64,
    /// Elastic mode: seconds the lent engines, awake and lent, had no request (all of them).
    lent_idle_s: f64,
    switch_s: f64,
    lends: u64,
}

impl Window {
    fn new() -> Window {
        Window {
            start: Instant::now(),
            trainer_idle_s: 0.0,
            rollout_idle_s: 0.0,
            flush_s: 0.0,
            lent_s: 0.0,
            lent_idle_s: 0.0,
            switch_s: 0.0,
            lends: 0,
        }
    }
}

/// The trainer's passes over one batch, a request at a time so the engines keep generating.
struct Job {
    samples: Vec<Sample>,
    staleness: Vec<u64>,
    spans: Vec<u64>,
    /// The modelled tokens per task token of the batch (compute.token_scale_final): each sample's
    /// by the weight versions that generated it, weighted by its tokens. None: init's.
    token_scale: Option<f64>,
    stage: Stage,
    span: Option<Span>,
    requests: Vec<InFlight>,
    reference: Option<LogProbsReply>,
    actor: Option<LogProbsReply>,
    values: Option<ValuesReply>,
    adv: Option<Advantages>,
    train: Option<TrainReply>,
}

/// A trained batch, for its metrics row.
struct Finished {
    samples: Vec<Sample>,
    scored: Vec<(f64, bool)>,
    scores: Scores,
    adv: Advantages,
    train: TrainReply,
    staleness: Vec<u64>,
    spans: Vec<u64>,
    token_scale: Option<f64>,
}

/// Which kind of request answered, by its position among those waited on.
enum Answer {
    Engine(usize),
    Trainer(usize),
}

/// The trainer's per-token numbers for the job so far.
fn job_scores(job: &Job) -> Scores {
    let actor = job.actor.as_ref();
    Scores {
        old_lp: actor.map(|a| a.logprobs.clone()).unwrap_or_default(),
        ref_lp: job.reference.as_ref().map(|r| r.logprobs.clone()).unwrap_or_default(),
        entropy: actor.map(|a| a.entropy.clone()).unwrap_or_default(),
        values: job.values.as_ref().map(|v| v.values.clone()).unwrap_or_default(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    RefLogProbs,
    LogProbs,
    Values,
    Train,
}

impl Stage {
    fn phase(self) -> &'static str {
        match self {
            Stage::RefLogProbs => "ref_log_probs",
            Stage::LogProbs => "log_probs",
            Stage::Values => "values",
            Stage::Train => "actor_train",
        }
    }
}

impl Async {
    pub(super) fn new(cfg: &Config, plan: Plan, fleet: Fleet, rec: Recorder) -> Async {
        let rollouts = fleet.indices(Role::Rollout);
        let lent = fleet.lent_engines();
        let engine = |(worker, lent): (usize, bool)| Engine {
            worker,
            groups: Vec::new(),
            request: None,
            idle_since: None,
            version: 0,
            lent,
            awake: !lent,
            retired: false,
            adopted: false,
            sent_at: None,
        };
        let engines = rollouts.iter().map(|&w| (w, false)).chain(lent.iter().map(|&w| (w, true))).map(engine);
        let lending = (cfg.run.mode == Mode::Elastic).then(|| lend::Lending::new(&fleet));
        let groups_per_request = cfg.rollout.prompts_per_step / rollouts.len();
        let sync = weights::WeightSync::new(cfg, &plan, &fleet);
        Async {
            sync,
            cfg: cfg.clone(),
            at: rec.cursor(),
            task: plan.task,
            shape: plan.shape,
            profile: plan.profile,
            api: plan.api,
            engines: engines.collect(),
            fleet,
            rec,
            version: 0,
            queue: Queue::default(),
            groups_per_request,
            training_groups: 0,
            rng: Rng::new(cfg.run.seed ^ 0xDA7A),
            requests: 0,
            groups_started: 0,
            totals: Totals::default(),
            window: Window::new(),
            lending,
            orphans: Vec::new(),
        }
    }

    fn step(&self) -> u64 {
        self.at.step()
    }

    fn fail(&self, kind: FailKind, worker: Option<&str>, cause: impl Into<String>) -> RunError {
        self.at.fail(kind, worker, cause)
    }

    fn max_staleness(&self) -> u64 {
        self.cfg.asynchronous.max_staleness.max(0) as u64
    }

    /// Groups queued and being generated before an engine waits (back-pressure): Relax's
    /// batch x (max_staleness + 1) unless async.queue_groups says otherwise.
    fn capacity(&self) -> usize {
        match self.cfg.asynchronous.queue_groups {
            0 => self.cfg.rollout.prompts_per_step * (self.max_staleness() as usize + 1),
            n => n as usize,
        }
    }

    fn segment(&self) -> Option<usize> {
        Some(self.cfg.asynchronous.segment_tokens as usize).filter(|s| *s > 0)
    }

    /// Whether generation runs in segments (of tokens, of modelled time, or both), or each
    /// request runs its sequences to the end.
    fn partial(&self) -> bool {
        self.segment().is_some() || self.cfg.segment_budget().is_some()
    }

    /// The whole run: setup, then trainer steps until run.steps, the engines generating meanwhile.
    pub(super) fn run(&mut self) -> R<()> {
        self.setup()?;
        self.totals.started = Some(Instant::now());
        self.window = Window::new();
        let now = Instant::now();
        for e in self.engines.iter_mut().filter(|e| !e.lent) {
            e.idle_since = Some(now);
        }
        let steps = self.cfg.run.steps;
        let per_update = self.cfg.asynchronous.train_iters_per_update;
        let mut job: Option<Job> = None;
        let mut trainer_idle_since = Some(Instant::now());
        let mut since_update = 0;
        // A finished step whose row waits for the weight update it triggered.
        let mut before_update: Option<Finished> = None;
        let mut pausing: Option<(Span, Instant)> = None;
        loop {
            if job.is_none() && before_update.is_none() && self.step() < steps {
                if let Some(batch) = self.next_batch()? {
                    if let Some(t) = trainer_idle_since.take() {
                        self.window.trainer_idle_s += t.elapsed().as_secs_f64();
                    }
                    self.at.set_step(self.step() + 1);
                    self.rec.new_step();
                    job = Some(self.start_job(batch)?);
                } else {
                    self.consider_lending(trainer_idle_since, since_update)?;
                }
            }
            if before_update.is_none() {
                self.feed_engines()?;
            }
            // An update waits for the segments in flight (Relax's pause and flush); then nothing
            // else is under way.
            if before_update.is_some() && self.engines.iter().all(|e| e.request.is_none()) {
                if let Some((span, t0)) = pausing.take() {
                    self.rec.end(span, &self.fleet)?;
                    let flush = t0.elapsed().as_secs_f64();
                    self.window.flush_s += flush;
                    self.totals.flush_s.push(flush);
                }
                self.update_weights()?;
                let done = before_update.take().expect("checked");
                self.write_row(done);
                trainer_idle_since = Some(Instant::now());
                continue;
            }
            let generating = self.engines.iter().any(|e| e.request.is_some());
            if job.is_none() && before_update.is_none() && self.step() >= steps && !generating {
                return self.sync.leave(&mut self.fleet, &mut self.rec);
            }
            if job.is_none() && !generating {
                // Nothing under way and nothing to start: the queue can never fill.
                return Err(self.stalled());
            }
            let until = self.lending_deadline(trainer_idle_since);
            if let Some(done) = self.wait_one(&mut job, until)? {
                job = None;
                since_update += 1;
                if since_update == per_update {
                    since_update = 0;
                    before_update = Some(done);
                    pausing = Some((self.rec.begin("pause_generation"), Instant::now()));
                } else {
                    self.write_row(done);
                    trainer_idle_since = Some(Instant::now());
                }
            }
        }
    }

    fn stalled(&self) -> RunError {
        self.fail(
            FailKind::Setup,
            None,
            format!(
                "{} mode stalled: {} group(s) queued, the trainer needs {} and no engine may start more \
                 (async.queue_groups too small?)",
                self.cfg.run.mode.as_str(),
                self.queue.len(),
                self.cfg.rollout.prompts_per_step
            ),
        )
    }

    /// The earliest start among the groups not yet finished: being generated or left by a lent
    /// engine.
    fn first_in_flight(&self) -> Option<u64> {
        let generating = self.engines.iter().flat_map(|e| &e.groups);
        generating.chain(&self.orphans).map(|g| g.started).min()
    }

    /// The trainer's next batch, when the queue has one; in elastic mode only once its devices
    /// are back (a lend under way is reclaimed first).
    fn next_batch(&mut self) -> R<Option<Vec<Group>>> {
        if self.lending.as_ref().is_some_and(lend::Lending::reclaiming) {
            return self.try_reclaim();
        }
        self.retire_stuck()?;
        let first_in_flight = self.first_in_flight();
        let batch = self.queue.take_batch(
            self.cfg.rollout.prompts_per_step,
            self.version,
            self.max_staleness(),
            first_in_flight,
        );
        match batch {
            Some(b) if self.lending.as_ref().is_some_and(lend::Lending::lent) => {
                self.begin_reclaim(b);
                self.try_reclaim()
            }
            b => Ok(b),
        }
    }

    /// The engines and the trainer start; the trainer's initial weights reach every engine. In
    /// elastic mode the lent engines start beside the regular ones and sleep before the trainers
    /// start on their devices, and one lend and reclaim measure what switching costs.
    fn setup(&mut self) -> R<()> {
        let max_batch = self.groups_per_request * self.cfg.rollout.samples_per_prompt;
        for (role, phase) in [(Role::Rollout, "init_rollout"), (Role::Trainer, "init_trainer")] {
            let span = self.rec.begin(phase);
            let mut targets = self.fleet.indices(role);
            let mut params =
                learn::init_params(&self.cfg, &self.fleet, role, self.api, self.shape, &self.profile, max_batch);
            if role == Role::Rollout {
                let lent = self.fleet.lent_engines();
                let device = |i: usize| self.fleet.worker(i).device;
                let like = params[0].clone();
                params.extend(lent.iter().map(|&i| protocol::InitParams { device: device(i), ..like.clone() }));
                targets.extend(lent);
            }
            self.fleet.call_each::<Init>(&targets, params)?;
            self.fleet.find_control_sockets_of(&targets)?;
            self.rec.end(span, &self.fleet)?;
            if role == Role::Rollout && self.lending.is_some() {
                self.lent_offload()?;
            }
        }
        self.sync.join(&mut self.fleet, &mut self.rec)?;
        self.transfer_weights("on every rollout engine after the initial update_weights")?;
        if self.lending.is_some() {
            self.calibrate()?;
        }
        Ok(())
    }

    /// The trainer's weights to every engine, checked there.
    fn transfer_weights(&mut self, when: &str) -> R<()> {
        let span = self.rec.begin("update_weights");
        let t0 = Instant::now();
        let sum = weights::trainer_checksum(&mut self.fleet, &self.at)?;
        let moved = self.sync.transfer(&mut self.fleet, &self.at, &mut self.rec, self.version + 1)?;
        self.rec.end(span, &self.fleet)?;
        self.totals.update_s += t0.elapsed().as_secs_f64();
        self.totals.update_bytes += moved.bytes;
        weights::expect_checksum(&mut self.fleet, &mut self.rec, Role::Rollout, &sum, when)
    }

    /// A new weight version: the trainer's weights after its last step reach every engine, whose
    /// interrupted sequences continue under them.
    fn update_weights(&mut self) -> R<()> {
        let next = self.version + 1;
        self.transfer_weights(&format!("on every rollout engine after update_weights (version {next})"))?;
        self.version = next;
        self.totals.updates += 1;
        Ok(())
    }

    /// Groups started and not finished: on the engines, and those a lent engine left.
    fn generating_groups(&self) -> usize {
        self.engines.iter().map(|e| e.groups.len()).sum::<usize>() + self.orphans.len()
    }

    /// Whether engine `k` may be given work now.
    fn may_feed(&self, k: usize) -> bool {
        let e = &self.engines[k];
        let reclaiming = e.lent && self.lending.as_ref().is_some_and(lend::Lending::reclaiming);
        e.request.is_none() && e.awake && !e.retired && !reclaiming
    }

    /// Engine `k` takes over groups a lent engine left, while it has room: they are older than
    /// any it would start, and the trainer's batch may wait for them.
    fn adopt_orphans(&mut self, k: usize) {
        let room = self.groups_per_request.saturating_sub(self.engines[k].groups.len());
        let n = room.min(self.orphans.len());
        if n > 0 {
            let e = &mut self.engines[k];
            e.groups.extend(self.orphans.drain(..n));
            e.adopted = true;
        }
    }

    /// Gives every idle engine work: the rest of its interrupted sequences, and new prompts in the
    /// places of the groups it finished while the queue has room (back-pressure) and the run
    /// needs more. Refilling at every segment keeps an engine's batch full, as continuous
    /// batching does, instead of waiting for its longest response before starting the next.
    fn feed_engines(&mut self) -> R<()> {
        // The trainer has taken its last batch: whatever the engines would still generate, nobody
        // trains on, and it would hold the run's end (and its wall time) until every group under
        // way had finished.
        if self.step() >= self.cfg.run.steps {
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
            let lim = self.task.operand_limit();
            let n = self.cfg.rollout.samples_per_prompt;
            for _ in 0..fresh {
                let prompt = self.task.prompt(self.rng.below(lim), self.rng.below(lim));
                let started = self.groups_started;
                self.groups_started += 1;
                self.engines[k].groups.push(Group { prompt, seqs: vec![Seq::default(); n], started });
            }
            self.send_generate(k, continued > 0)?;
        }
        Ok(())
    }

    /// How many new groups an engine still generating `continued` groups may start; a `lent` one
    /// takes what room there is, its device otherwise idle.
    fn fresh_groups_for(&self, continued: usize, lent: bool) -> usize {
        let free = self.groups_per_request.saturating_sub(continued);
        if free == 0 || self.step() >= self.cfg.run.steps {
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
    fn send_generate(&mut self, k: usize, continued: bool) -> R<()> {
        self.requests += 1;
        let seed = self.cfg.run.seed.wrapping_mul(1_000_003) ^ (self.requests << 8) ^ k as u64;
        let e = &self.engines[k];
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
                    order.push(Slot { group: g, seq: j, prompt_index: order.len() });
                }
            }
            (prompts, 1, responses, order, progress)
        } else {
            let n = self.cfg.rollout.samples_per_prompt;
            let prompts = e.groups.iter().map(|g| g.prompt.clone()).collect();
            let slots = |g| (0..n).map(move |j| Slot { group: g, seq: j, prompt_index: g });
            let order = (0..e.groups.len()).flat_map(slots).collect();
            (prompts, n, Vec::new(), order, Vec::new())
        };
        let budget = self.cfg.segment_budget();
        // Carried steps go only with a budget (nothing else ends a segment mid-token), and only
        // when some sequence has any.
        let progress = if budget.is_some() && progress.iter().any(|p| *p > 0.0) { progress } else { Vec::new() };
        // A sequence's own seed, from where it stands in the run: its tokens are the same however
        // segments split it and whichever engines continue it.
        let base = self.cfg.run.seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let seeds = order.iter().map(|o| {
            let started = e.groups[o.group].started;
            Rng::new(base ^ (started << 20) ^ o.seq as u64).next_u64()
        });
        let sequence_seeds = seeds.collect();
        let params = GenerateParams {
            prompts,
            n,
            max_new_tokens: self.task.max_new_tokens(),
            temperature: self.cfg.rollout.temperature,
            eos: Some(task::EOS),
            seed,
            step: self.step(),
            responses,
            segment_tokens: self.segment(),
            prefix_cached: continued && self.engines[k].version == self.version && !self.engines[k].adopted,
            token_scale: self.cfg.token_scale_at(self.version as f64),
            segment_s: budget,
            progress,
            sequence_seeds,
        };
        let worker = e.worker;
        let request = self.fleet.submit::<Generate>(worker, params)?;
        let e = &mut self.engines[k];
        if let Some(t) = e.idle_since.take() {
            let idle = t.elapsed().as_secs_f64();
            if e.lent {
                self.window.lent_idle_s += idle;
            } else {
                self.window.rollout_idle_s += idle;
            }
        }
        e.request = Some((request, order));
        e.version = self.version;
        e.adopted = false;
        e.sent_at = Some(Instant::now());
        Ok(())
    }

    /// Waits for the first answer among the engines' requests and the trainer's, and takes it in.
    /// Returns the batch the trainer finished, when that was the answer.
    /// Gives up at `until` (a lending decision or deadline due), with nothing taken in.
    fn wait_one(&mut self, job: &mut Option<Job>, until: Option<Instant>) -> R<Option<Finished>> {
        let k = {
            let mut waiting: Vec<&InFlight> =
                self.engines.iter().filter_map(|e| e.request.as_ref().map(|r| &r.0)).collect();
            let engines = waiting.len();
            if let Some(j) = job.as_ref() {
                waiting.extend(j.requests.iter());
            }
            let Some(k) = self.fleet.wait_any_until(&waiting, until)? else {
                return Ok(None);
            };
            if k < engines { Answer::Engine(k) } else { Answer::Trainer(k - engines) }
        };
        match k {
            Answer::Engine(nth) => {
                let e = self.engines.iter().enumerate().filter(|(_, e)| e.request.is_some()).nth(nth).map(|(i, _)| i);
                self.take_generated(e.expect("an engine in flight"))?;
                Ok(None)
            }
            Answer::Trainer(nth) => {
                let j = job.as_mut().expect("a trainer request");
                self.advance(j, nth)
            }
        }
    }

    /// Engine `k`'s segment: its tokens join their sequences under the current version; finished
    /// groups go to the queue.
    fn take_generated(&mut self, k: usize) -> R<()> {
        let (request, order) = self.engines[k].request.take().expect("in flight");
        let worker = request.worker;
        let name = self.fleet.worker(worker).name.clone();
        let phase = self.at.phase();
        self.at.set_phase("generate");
        let reply: GenerateReply = self.fleet.collect::<Generate>(request)?;
        self.at.set_phase(&phase);
        if self.step() >= self.cfg.run.steps {
            self.totals.replies_after_last_batch += 1;
        }
        let at = self.at.clone();
        let bad = |cause: String| at.fail(FailKind::Worker, Some(&name), cause);
        if reply.samples.len() != order.len() {
            return Err(bad(format!("generate returned {} samples, expected {}", reply.samples.len(), order.len())));
        }
        let max_new = self.task.max_new_tokens();
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
        self.totals.segments_mid_token += u64::from(mid_token);
        // A lent engine idles only while lent: once the reclaim begins it takes no more work.
        let lent_now = self.lending.as_ref().is_some_and(lend::Lending::lent);
        let e = &mut self.engines[k];
        if !e.lent || lent_now {
            e.idle_since = Some(Instant::now());
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
    fn share_with_lent(&mut self, k: usize) {
        let awake: Vec<usize> =
            (0..self.engines.len()).filter(|&j| self.engines[j].awake && !self.engines[j].retired).collect();
        let total: usize = awake.iter().map(|&j| self.engines[j].groups.len()).sum();
        let share = total.div_ceil(awake.len().max(1));
        let mut lent: Vec<usize> = awake.into_iter().filter(|&j| self.engines[j].lent).collect();
        self.engines[k].groups.sort_by_key(|g| g.started);
        while self.engines[k].groups.len() > share {
            lent.sort_by_key(|&j| self.engines[j].groups.len());
            let Some(&j) = lent.first().filter(|&&j| self.engines[j].groups.len() < share) else { break };
            let g = self.engines[k].groups.remove(0);
            self.engines[j].groups.push(g);
            self.engines[j].adopted = true;
        }
    }

    /// The trainer's first pass over a batch begins.
    fn start_job(&mut self, groups: Vec<Group>) -> R<Job> {
        let now = self.version;
        let mut samples = Vec::new();
        let (mut staleness, mut spans, mut scaled) = (Vec::new(), Vec::new(), Vec::new());
        for g in &groups {
            for s in &g.seqs {
                let versions = s.versions.iter().map(|v| *v as f64);
                let version = versions.clone().sum::<f64>() / s.versions.len().max(1) as f64;
                scaled.push((g.prompt.len() + s.response.len(), version));
                samples.push(Sample {
                    prompt: g.prompt.clone(),
                    response: s.response.clone(),
                    logprobs: s.logprobs.clone(),
                });
                staleness.push(now - s.oldest(now).min(now));
                spans.push(s.span());
            }
        }
        if let Some(worst) = staleness.iter().max().filter(|w| **w > self.max_staleness()) {
            return Err(self.fail(
                FailKind::Check,
                None,
                format!(
                    "a sample {worst} versions old reached the trainer (async.max_staleness = {})",
                    self.max_staleness()
                ),
            ));
        }
        self.rec.count_check();
        self.training_groups = groups.len();
        let mut job = Job {
            samples,
            staleness,
            spans,
            token_scale: learn::batch_token_scale(&self.cfg, &scaled),
            stage: Stage::RefLogProbs,
            span: None,
            requests: Vec::new(),
            reference: None,
            actor: None,
            values: None,
            adv: None,
            train: None,
        };
        self.submit_stage(&mut job)?;
        Ok(job)
    }

    fn pairs(job: &Job) -> Vec<Pair> {
        job.samples.iter().map(|s| Pair { prompt: s.prompt.clone(), response: s.response.clone() }).collect()
    }

    /// Sends the job's current stage to every trainer (replicas get the same request).
    fn submit_stage(&mut self, job: &mut Job) -> R<()> {
        job.span = Some(self.rec.begin(job.stage.phase()));
        let (step, token_scale) = (self.step(), job.token_scale);
        let mut requests = Vec::new();
        for i in self.fleet.indices(Role::Trainer) {
            let r = match job.stage {
                Stage::RefLogProbs | Stage::LogProbs => {
                    let model = if job.stage == Stage::RefLogProbs { Model::Ref } else { Model::Actor };
                    self.fleet
                        .submit::<LogProbs>(i, LogProbsParams { model, samples: Self::pairs(job), step, token_scale })?
                }
                Stage::Values => {
                    self.fleet.submit::<Values>(i, SamplesParams { samples: Self::pairs(job), step, token_scale })?
                }
                Stage::Train => {
                    let scores = job_scores(job);
                    let adv = job.adv.as_ref().expect("advantages before train");
                    self.fleet.submit::<Train>(
                        i,
                        learn::train_params(&self.cfg, &job.samples, &scores, adv, step, token_scale),
                    )?
                }
            };
            requests.push(r);
        }
        job.requests = requests;
        Ok(())
    }

    /// The `nth` of the job's requests answered: read it; when every trainer has, the stage ends
    /// and the next begins. Returns the finished batch after training.
    fn advance(&mut self, job: &mut Job, nth: usize) -> R<Option<Finished>> {
        let request = job.requests.remove(nth);
        let n = job.samples.len();
        let wrong = |what: &str| format!("{what} returned the wrong number of sequences");
        match job.stage {
            Stage::RefLogProbs | Stage::LogProbs => {
                let r = self.fleet.collect::<LogProbs>(request)?;
                if r.logprobs.len() != n {
                    return Err(self.fail(FailKind::Worker, None, wrong("log_probs")));
                }
                let slot = if job.stage == Stage::RefLogProbs { &mut job.reference } else { &mut job.actor };
                slot.get_or_insert(r);
            }
            Stage::Values => {
                let r = self.fleet.collect::<Values>(request)?;
                job.values.get_or_insert(r);
            }
            Stage::Train => {
                let r = self.fleet.collect::<Train>(request)?;
                job.train.get_or_insert(r);
            }
        }
        if !job.requests.is_empty() {
            return Ok(None);
        }
        let span = job.span.take().expect("a stage under way");
        self.rec.end(span, &self.fleet)?;
        job.stage = match job.stage {
            Stage::RefLogProbs => Stage::LogProbs,
            Stage::LogProbs if self.cfg.algo.name == AlgoName::Ppo => Stage::Values,
            Stage::LogProbs | Stage::Values => {
                let span = self.rec.begin("advantages");
                let rewards: Vec<f64> = job
                    .samples
                    .iter()
                    .map(|s| self.task.score(&s.prompt, &s.response, self.cfg.task.reward).0)
                    .collect();
                let scores = job_scores(job);
                let adv = learn::advantages(&self.cfg, &job.samples, &rewards, &scores)
                    .map_err(|e| self.fail(FailKind::Worker, None, e))?;
                job.adv = Some(adv);
                self.rec.end(span, &self.fleet)?;
                Stage::Train
            }
            Stage::Train => {
                self.training_groups = 0;
                return Ok(Some(self.finished(job)));
            }
        };
        self.submit_stage(job)?;
        Ok(None)
    }

    /// The trained batch's numbers, taken out of the job.
    fn finished(&self, job: &mut Job) -> Finished {
        let scores = job_scores(job);
        let samples = std::mem::take(&mut job.samples);
        let reward = self.cfg.task.reward;
        let scored = samples.iter().map(|s| self.task.score(&s.prompt, &s.response, reward)).collect();
        Finished {
            samples,
            scored,
            scores,
            adv: job.adv.take().expect("advantages before train"),
            train: job.train.take().unwrap_or_default(),
            staleness: std::mem::take(&mut job.staleness),
            spans: std::mem::take(&mut job.spans),
            token_scale: job.token_scale,
        }
    }

    /// The step's row: the trainer's phases, both sides' idle shares, staleness and partial
    /// rollouts (verl's names), and the batch's rollout and training metrics.
    fn write_row(&mut self, d: Finished) {
        let wall = self.window.start.elapsed().as_secs_f64();
        let now = Instant::now();
        for e in self.engines.iter_mut() {
            // An idle engine's time so far counts in this window; the next starts now.
            if let Some(t) = e.idle_since.as_mut() {
                let idle = now.duration_since(*t).as_secs_f64();
                *t = now;
                if e.lent {
                    self.window.lent_idle_s += idle;
                } else {
                    self.window.rollout_idle_s += idle;
                }
            }
        }
        let mut row = metrics::Row::new(self.step());
        let times = self.rec.step_times();
        let t = |k: &str| times.get(k).copied().unwrap_or(0.0);
        let train_time = t("ref_log_probs") + t("log_probs") + t("values") + t("advantages") + t("actor_train");
        for (k, v) in times {
            row.set(&metrics::phase_time(k), *v);
        }
        let (trainer_idle, rollout_idle) = (self.window.trainer_idle_s, self.window.rollout_idle_s);
        let flush = self.window.flush_s;
        row.set("perf/train_time", train_time);
        row.set("perf/train_wait_time", trainer_idle);
        row.set("perf/flush_time", flush);
        row.set("perf/step_time", wall);
        row.set("perf/wall_step_time", wall);
        if wall > 0.0 {
            row.set("perf/wait_time_ratio", trainer_idle / wall);
            // The flush idles the trainer's devices as surely as waiting for a batch does.
            row.set("trainer/idle_ratio", (trainer_idle + flush) / wall);
            row.set("trainer/flush_ratio", flush / wall);
            row.set("rollouter/idle_ratio", rollout_idle / (wall * self.own_engines() as f64));
        }
        if self.lending.is_some() {
            self.lending_row(&mut row, wall);
        }
        if let Some(scale) = d.token_scale {
            row.set("compute/token_scale", scale);
        }
        let stale = d.staleness.iter().filter(|s| **s > 0).count();
        row.set("fully_async/count/stale_samples_processed", stale as f64);
        row.set("fully_async/count/dropped_stale_samples", self.queue.dropped_samples as f64);
        row.set("fully_async/staleness_mean", mean(d.staleness.iter().map(|s| *s as f64)));
        row.set("fully_async/staleness_max", d.staleness.iter().copied().max().unwrap_or(0) as f64);
        let partial = d.spans.iter().filter(|s| **s > 0).count();
        row.set("partial/partial_ratio", partial as f64 / d.spans.len().max(1) as f64);
        row.set("partial/max_partial_span", d.spans.iter().copied().max().unwrap_or(0) as f64);
        row.set("fully_async/weight_version", self.version as f64);
        row.set("fully_async/queue_groups", self.queue.len() as f64);
        let outcome =
            learn::Outcome { samples: &d.samples, scored: &d.scored, scores: &d.scores, adv: &d.adv, train: &d.train };
        learn::sample_metrics(&mut row, &self.cfg, &self.task, &outcome);
        for s in self.rec.step_memory() {
            metrics::add_memory(&mut row, s);
        }
        self.rec.record_step(&row);
        let tot = &mut self.totals;
        tot.samples_trained += d.samples.len() as u64;
        tot.tokens_trained += d.samples.iter().map(|s| s.response.len() as u64).sum::<u64>();
        for s in &d.staleness {
            *tot.staleness.entry(*s).or_default() += 1;
        }
        tot.partial_samples += partial as u64;
        tot.trainer_idle_s += trainer_idle;
        tot.flush_total_s += flush;
        tot.rollout_idle_s += rollout_idle;
        let lent_idle = self.window.lent_idle_s;
        if let Some(l) = self.lending.as_mut() {
            l.add_lent_idle(lent_idle);
        }
        self.window = Window::new();
    }

    /// The engines on devices of their own (not elastic mode's lent ones).
    fn own_engines(&self) -> usize {
        self.engines.iter().filter(|e| !e.lent).count().max(1)
    }

    /// The summary's `async` block: throughput, both sides' idle shares, staleness, the updates.
    pub(super) fn summary(&self) -> Value {
        let t = &self.totals;
        let wall = t.started.map(|s| s.elapsed().as_secs_f64()).unwrap_or(0.0);
        let per_s = |x: u64| if wall > 0.0 { x as f64 / wall } else { 0.0 };
        let ratio = |x: f64| if wall > 0.0 { x / wall } else { 0.0 };
        let split = self.cfg.mode_layout().ok().flatten();
        let mut block = json!({
            "mode": "async",
            "trainer_devices": split.as_ref().map(|s| s.trainer.clone()),
            "rollout_devices": split.as_ref().map(|s| s.rollout.clone()),
            "max_staleness": self.max_staleness(),
            "train_iters_per_update": self.cfg.asynchronous.train_iters_per_update,
            "queue_capacity_groups": self.capacity(),
            "segment_tokens": self.cfg.asynchronous.segment_tokens,
            "samples_trained": t.samples_trained,
            "samples_per_s": per_s(t.samples_trained),
            "tokens_per_s": per_s(t.tokens_trained),
            "dropped_stale_samples": self.queue.dropped_samples,
            "staleness_histogram": t.staleness.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "partial_samples": t.partial_samples,
            "generate_replies_after_last_batch": t.replies_after_last_batch,
            "weight_updates": t.updates,
            "update_weights_s": t.update_s,
            "update_weights_bytes": t.update_bytes,
            "segment_s": self.cfg.segment_budget(),
            "segments_ended_mid_token": t.segments_mid_token,
            "trainer_idle_ratio": ratio(t.trainer_idle_s + t.flush_total_s),
            "trainer_wait_ratio": ratio(t.trainer_idle_s),
            "flush_ratio": ratio(t.flush_total_s),
            "flush_s_mean": (!t.flush_s.is_empty()).then(|| t.flush_s.iter().sum::<f64>() / t.flush_s.len() as f64),
            "flush_s_max": t.flush_s.iter().copied().reduce(f64::max),
            "rollout_idle_ratio": if wall > 0.0 { t.rollout_idle_s / (wall * self.own_engines() as f64) } else { 0.0 },
        });
        if let (Some(block), Some(l)) = (block.as_object_mut(), self.lending.as_ref()) {
            block.insert("mode".into(), json!("elastic"));
            block.insert("elastic".into(), l.summary(&self.cfg, wall, t.trainer_idle_s, t.flush_total_s));
        }
        if let (Some(block), Value::Object(sync)) = (block.as_object_mut(), self.sync.summary()) {
            block.extend(sync);
        }
        block
    }
}
