//! Each layout's run in modelled time, without devices or processes: the same steps the runner
//! takes (run/cycle for colocate, run/asynchronous for async and elastic), each request and each
//! stage of the switch charged what the runner's workers and switch charge (engine.rs, the
//! compute model, run/switch.rs). What a run measures on top (the runner's round trips, the
//! checks, the built-in policy's CPU time where it exceeds the model) is not here.

use super::engine::{self, Limits, Seq};
use super::responses::Responses;
use crate::run::Role;
use crate::run::compute::{FIGURES, Stage};
use crate::run::config::{AlgoName, Config, Mode, WeightTransport};
use crate::run::protocol::ComputeModel;
use crate::run::switch::SwitchModel;
use std::collections::BTreeMap;

/// What a layout's run is predicted to take.
#[derive(Debug, Clone, Default)]
pub(super) struct Predicted {
    /// Each step's wall time, as the run's `perf/wall_step_time`.
    pub(super) step_s: Vec<f64>,
    /// Seconds per step of each phase, summed over the run (the runner's phase names).
    pub(super) phases: BTreeMap<&'static str, f64>,
    /// Modelled decode steps and the sequences they held, every engine together.
    pub(super) steps: f64,
    pub(super) slot_steps: f64,
    /// Batch slots of one engine.
    pub(super) slots: f64,
    pub(super) preemptions: u64,
    /// Elastic: lends of the trainer's devices.
    pub(super) lends: u64,
    /// Elastic with elastic.lend_rollout: lends of the engines' devices to a train stage.
    pub(super) rollout_lends: u64,
    /// Apart: prompt groups dropped as staler than async.max_staleness.
    pub(super) dropped_groups: u64,
}

impl Predicted {
    fn add(&mut self, phase: &'static str, seconds: f64) {
        *self.phases.entry(phase).or_default() += seconds;
    }

    fn request(&mut self, r: &engine::Request) {
        self.steps += r.steps;
        self.slot_steps += r.slot_steps;
        self.preemptions += r.preemptions;
    }

    /// Mean share of the batch slots the decode steps filled.
    pub(super) fn slot_occupancy(&self) -> Option<f64> {
        (self.steps > 0.0 && self.slots > 0.0).then(|| self.slot_steps / (self.steps * self.slots))
    }
}

/// One layout's job: its configuration and the models it is charged by.
pub(super) struct Job<'a> {
    pub(super) cfg: &'a Config,
    pub(super) model: ComputeModel,
    pub(super) switch: Option<SwitchModel>,
    pub(super) responses: &'a Responses,
}

impl Job<'_> {
    /// Modelled tokens per task token of a sample drawn for batch `batch` (responses that grow
    /// over the run: compute.token_scale_final).
    fn scale(&self, batch: f64) -> f64 {
        self.cfg.token_scale_at(batch).unwrap_or(self.cfg.compute.token_scale)
    }

    fn prompt_len(&self) -> usize {
        2 * self.cfg.task.digits as usize + 2
    }

    /// The sequences of prompt group `started`, none begun.
    fn group(&self, started: u64) -> Vec<Seq> {
        let batch = started as f64 / self.cfg.clock_prompts() as f64;
        let scale = self.scale(self.cfg.cost_clock(batch.floor(), started));
        (0..self.cfg.rollout.samples_per_prompt)
            .map(|j| {
                // A drawn length is modelled tokens; the engine counts task tokens of `scale` each.
                let drawn = self.cfg.drawn_length(started, j as u64);
                let length = drawn.map_or(self.responses.length(started, j) as f64, |l| l / scale);
                Seq { prompt: self.prompt_len(), length, done: 0.0, scale, drawn: drawn.is_some() }
            })
            .collect()
    }

    /// The trainer's stages over a batch of `groups`, each shared by `trainers` replicas: the
    /// reference's and the actor's log-probs (unless algo.reference = false or
    /// algo.rollout_log_probs skip them, as the runner's job.rs does), PPO's values, then
    /// training (3 passes an epoch).
    fn train_stages(&self, groups: &[Vec<Seq>], trainers: f64) -> Vec<(&'static str, f64)> {
        let seqs = || groups.iter().flatten();
        let count = seqs().count().max(1) as f64;
        let scale = seqs().map(|s| s.scale).sum::<f64>() / count;
        let tokens: f64 = seqs().map(|s| s.prompt as f64 + s.length).sum();
        let m = self.model.scaled(Some(scale));
        let charge = |stage: &Stage, times: f64| m.stage_seconds(stage, 1, trainers) * tokens * times;
        let st = &FIGURES.stages;
        let mut out = Vec::new();
        if self.cfg.algo.reference {
            out.push(("ref_log_probs", charge(&st.log_probs, 1.0)));
        }
        if !self.cfg.algo.rollout_log_probs {
            out.push(("log_probs", charge(&st.log_probs, 1.0)));
        }
        if self.cfg.algo.name == AlgoName::Ppo {
            out.push(("values", charge(&st.values, 1.0)));
        }
        out.push(("actor_train", charge(&st.train, self.cfg.algo.epochs.max(1) as f64)));
        out
    }

    fn switch_s(&self, f: impl Fn(&SwitchModel) -> f64) -> f64 {
        self.switch.as_ref().map_or(0.0, f)
    }
}

/// The train stage's seconds among a batch's stages (`Job::train_stages`).
fn train_stage_s(stages: &[(&'static str, f64)]) -> f64 {
    stages.iter().find(|(name, _)| *name == "actor_train").map_or(0.0, |(_, s)| *s)
}

/// Colocated (run/cycle): each device's engine generates its shard of the step's prompts, the
/// rollout offloads, the trainer wakes, trains, sleeps, and the new weights reach the rollout.
pub(super) fn colocate(job: &Job) -> Predicted {
    let cfg = job.cfg;
    let engines = cfg.total_devices().max(1);
    let per_step = cfg.rollout.prompts_per_step;
    let shard = per_step / engines;
    let n = cfg.rollout.samples_per_prompt;
    let trainers = engines as f64;
    let mut p = Predicted { slots: (shard * n) as f64, ..Predicted::default() };
    let transport = cfg.weight_transport();
    for step in 0..cfg.run.steps {
        let first = step * per_step as u64;
        let mut groups: Vec<Vec<Seq>> = (first..first + per_step as u64).map(|g| job.group(g)).collect();
        let mut generate: f64 = 0.0;
        for k in 0..engines {
            let mut seqs: Vec<&mut Seq> = groups[k * shard..(k + 1) * shard].iter_mut().flatten().collect();
            let limits = Limits { slots: shard * n, budget_s: None, segment_tokens: None };
            let r = engine::request(&job.model, &mut seqs, &[], limits);
            p.request(&r);
            generate = generate.max(r.seconds);
        }
        let mut phases = vec![("generate", generate)];
        if cfg.run.offload {
            phases.push(("rollout_offload", job.switch_s(|s| s.pause_s(Role::Rollout, None))));
            phases.push(("wake_up", job.switch_s(|s| s.resume_s(Role::Trainer, None))));
        }
        phases.extend(job.train_stages(&groups[..shard * engines], trainers));
        if cfg.run.offload {
            phases.push(("sleep", job.switch_s(|s| s.pause_s(Role::Trainer, None))));
            phases.push(("onload_weights", job.switch_s(|s| s.resume_s(Role::Rollout, Some("weights")))));
        }
        phases.push(("update_weights", job.switch_s(|s| s.update_s(transport))));
        if cfg.run.offload {
            let kv = |s: &SwitchModel| {
                s.resume_s(Role::Rollout, Some("kv_cache")) + s.resume_s(Role::Rollout, Some("cuda_graph"))
            };
            phases.push(("onload_kv", job.switch_s(kv)));
        }
        for (name, s) in &phases {
            p.add(name, *s);
        }
        p.step_s.push(phases.iter().map(|(_, s)| s).sum());
    }
    p
}

/// A prompt group of an async run.
struct Group {
    started: u64,
    seqs: Vec<Seq>,
    /// The oldest weight version that generated any of its tokens.
    oldest: Option<u64>,
}

impl Group {
    fn finished(&self) -> bool {
        self.seqs.iter().all(Seq::finished)
    }
}

/// An async run's engine: the groups it generates, and its request in flight.
struct Engine {
    groups: Vec<Group>,
    /// When its request in flight ends.
    busy_until: Option<f64>,
    /// The weight version its cache holds prefixes under.
    version: u64,
    /// Elastic mode's engine on a trainer's device.
    lent: bool,
}

/// Where the trainer stands.
enum Trainer {
    Idle {
        since: f64,
    },
    /// Its passes before training (log-probs, values); the train stage begins at `until`.
    Passes {
        until: f64,
    },
    /// Its train stage, shared with the lent trainers while the engines' devices are lent.
    Training {
        until: f64,
    },
    /// Its batch is trained; the weights go out once the segments in flight end.
    Publishing,
    /// Elastic: its devices generate.
    Lent,
    /// Elastic: its batch is ready; the lent engines finish their segments first.
    Reclaiming {
        batch: Vec<Vec<Seq>>,
    },
}

/// The async and elastic runs' shared state, on a modelled clock.
struct Apart<'a> {
    job: &'a Job<'a>,
    engines: Vec<Engine>,
    queue: Vec<Group>,
    /// Groups a reclaimed lent engine left: the others continue them first.
    orphans: Vec<Group>,
    /// When the engines of their own devices finished their last groups (elastic's completion
    /// rate).
    finished_at: std::collections::VecDeque<f64>,
    trainer: Trainer,
    now: f64,
    last_row: f64,
    version: u64,
    started: u64,
    step: u64,
    since_update: u64,
    /// Groups the trainer holds (training, or waiting for a reclaim).
    in_training: usize,
    stages: Vec<(&'static str, f64)>,
    /// elastic.lend_rollout: the batch's train stage shared with the lent trainers.
    shared_train_s: f64,
    /// The last train stage as the trainers alone would take it (the reverse lend's guide).
    last_train_s: Option<f64>,
    /// The engines' devices are lent to the train stage: the engines sleep.
    rollout_lent: bool,
    limits: Limits,
    per_request: usize,
    p: Predicted,
}

/// Async and elastic (run/asynchronous): the engines generate in segments into a bounded queue,
/// the trainer trains on the oldest batch the queue holds, and every
/// `async.train_iters_per_update` steps the weights go out once the segments in flight end.
/// Elastic: a trainer that has waited `elastic.lend_after_s` (0: a lend and a reclaim's modelled
/// switch) sleeps and an engine on each of its devices generates until its batch is ready; with
/// elastic.lend_rollout, the engines' devices go the other way, to a trainer-bound step's train
/// stage.
pub(super) fn apart(job: &Job, trainers: usize, rollouts: usize) -> Predicted {
    let cfg = job.cfg;
    let n = cfg.rollout.samples_per_prompt;
    let per_request = cfg.engine_groups(rollouts);
    let elastic = cfg.run.mode == Mode::Elastic;
    let limits = Limits {
        slots: per_request * n,
        budget_s: cfg.segment_budget(),
        segment_tokens: Some(cfg.asynchronous.segment_tokens as usize).filter(|s| *s > 0),
    };
    let engine = |lent| Engine { groups: Vec::new(), busy_until: None, version: 0, lent };
    let lent = if elastic { trainers } else { 0 };
    let mut a = Apart {
        job,
        engines: (0..rollouts).map(|_| engine(false)).chain((0..lent).map(|_| engine(true))).collect(),
        queue: Vec::new(),
        orphans: Vec::new(),
        finished_at: std::collections::VecDeque::new(),
        trainer: Trainer::Idle { since: 0.0 },
        now: 0.0,
        last_row: 0.0,
        version: 0,
        started: 0,
        step: 0,
        since_update: 0,
        in_training: 0,
        stages: Vec::new(),
        shared_train_s: 0.0,
        last_train_s: None,
        rollout_lent: false,
        limits,
        per_request,
        p: Predicted { slots: (per_request * n) as f64, ..Predicted::default() },
    };
    a.run(trainers as f64, rollouts as f64, elastic);
    a.p
}

/// What an async or elastic run's trainer side costs and when it lends, fixed for the run.
struct Costs {
    trainers: f64,
    elastic: bool,
    per_update: u64,
    update_s: f64,
    lend_s: f64,
    reclaim_s: f64,
    /// How long an idle elastic trainer waits before lending.
    lend_after: f64,
    /// elastic.lend_rollout: the engines' devices lent the other way.
    rollout_lending: Option<RolloutLending>,
}

/// The reverse lend's figures (reverse.rs): a lent trainer on each engine's device.
struct RolloutLending {
    lent_trainers: f64,
    /// The engines sleep and the lent trainers wake whole.
    lend_s: f64,
    /// The lent trainers sleep and the engines wake whole.
    reclaim_s: f64,
}

impl Apart<'_> {
    fn run(&mut self, trainers: f64, rollouts: f64, elastic: bool) {
        let cfg = self.job.cfg;
        let to_engines = self.job.switch_s(|s| s.pause_s(Role::Trainer, None) + s.resume_s(Role::Rollout, None));
        let to_trainers = self.job.switch_s(|s| s.pause_s(Role::Rollout, None) + s.resume_s(Role::Trainer, None));
        // A lend of the trainer's devices also copies the trainer's weights into the lent
        // engines (lend.rs: device to device with the built-in workers, charged as an IPC update).
        let lend_s = to_engines + self.job.switch_s(|s| s.update_s(WeightTransport::Ipc));
        let reclaim_s = to_trainers;
        // The reverse hand-overs are this direction's with the sides swapped: what the runner
        // charges of them is each side's sleep and wake (run/handover.rs). The trainer's state
        // file, exported and imported through the host, is measured by a run but charged by no
        // model, so it is not here either.
        let rollout_lending = (elastic && cfg.elastic.lend_rollout).then_some(RolloutLending {
            lent_trainers: rollouts,
            lend_s: to_trainers,
            reclaim_s: to_engines,
        });
        let c = Costs {
            trainers,
            elastic,
            per_update: cfg.asynchronous.train_iters_per_update.max(1),
            update_s: self.job.switch_s(|s| s.update_s(cfg.weight_transport())),
            lend_s,
            reclaim_s,
            lend_after: if cfg.elastic.lend_after_s > 0.0 { cfg.elastic.lend_after_s } else { lend_s + reclaim_s },
            rollout_lending,
        };
        loop {
            if self.trainer_turn(&c) || self.reclaim_when_lent_engines_rest(&c) || self.publish_when_flushed(&c) {
                continue;
            }
            if !matches!(self.trainer, Trainer::Publishing) {
                self.feed();
            }
            let busy = matches!(
                self.trainer,
                Trainer::Passes { .. } | Trainer::Training { .. } | Trainer::Publishing | Trainer::Reclaiming { .. }
            );
            if !busy && self.step >= cfg.run.steps {
                break;
            }
            let next_trainer = match self.trainer {
                Trainer::Passes { until } | Trainer::Training { until } => until,
                _ => f64::INFINITY,
            };
            let next = self.next_event(&c).min(next_trainer);
            if !next.is_finite() {
                if matches!(self.trainer, Trainer::Lent) {
                    // Lent with nothing left to generate: the devices go back.
                    self.p.add("reclaim", c.reclaim_s);
                    self.now += c.reclaim_s;
                    self.trainer = Trainer::Idle { since: self.now };
                    continue;
                }
                // Nothing under way and nothing can start: the queue can never fill.
                break;
            }
            self.now = next;
            self.settle();
            if next_trainer <= self.now {
                if matches!(self.trainer, Trainer::Passes { .. }) {
                    self.train_stage(&c);
                } else {
                    self.trained(&c);
                }
            }
        }
    }

    /// An idle (or lent) trainer takes the next batch when the queue holds one (a lent one then
    /// reclaims its devices first); an idle elastic one that has waited the threshold out lends
    /// them when that pays. Returns whether anything changed.
    fn trainer_turn(&mut self, c: &Costs) -> bool {
        if self.step >= self.job.cfg.run.steps || !matches!(self.trainer, Trainer::Idle { .. } | Trainer::Lent) {
            return false;
        }
        if let Some(batch) = self.take_batch() {
            self.in_training = batch.len();
            if matches!(self.trainer, Trainer::Lent) {
                self.trainer = Trainer::Reclaiming { batch };
            } else {
                self.train(batch, c);
            }
            return true;
        }
        let Trainer::Idle { since } = self.trainer else { return false };
        if !(c.elastic && self.now - since >= c.lend_after && self.lend_pays(c.lend_s + c.reclaim_s)) {
            return false;
        }
        self.p.add("lend", c.lend_s);
        self.now += c.lend_s;
        for e in self.engines.iter_mut().filter(|e| e.lent) {
            e.version = u64::MAX;
        }
        self.p.lends += 1;
        self.trainer = Trainer::Lent;
        true
    }

    /// Once the lent engines' segments have ended: their unfinished groups go to the others, the
    /// devices come back, and the trainer trains the batch it was waiting with.
    fn reclaim_when_lent_engines_rest(&mut self, c: &Costs) -> bool {
        if !matches!(self.trainer, Trainer::Reclaiming { .. })
            || self.engines.iter().any(|e| e.lent && e.busy_until.is_some())
        {
            return false;
        }
        for e in self.engines.iter_mut().filter(|e| e.lent) {
            self.orphans.append(&mut e.groups);
        }
        self.p.add("reclaim", c.reclaim_s);
        self.now += c.reclaim_s;
        if let Trainer::Reclaiming { batch } = std::mem::replace(&mut self.trainer, Trainer::Lent) {
            self.train(batch, c);
        }
        true
    }

    /// Once every segment in flight has ended, the new weights go out and the step's row closes.
    fn publish_when_flushed(&mut self, c: &Costs) -> bool {
        if !matches!(self.trainer, Trainer::Publishing) || self.engines.iter().any(|e| e.busy_until.is_some()) {
            return false;
        }
        self.now += c.update_s;
        self.p.add("update_weights", c.update_s);
        self.version += 1;
        self.row();
        true
    }

    /// The next engine's segment end, or the moment an idle elastic trainer has waited the
    /// threshold out (it reconsiders lending then); infinite when neither comes.
    fn next_event(&self, c: &Costs) -> f64 {
        let next_engine = self.engines.iter().filter_map(|e| e.busy_until).fold(f64::INFINITY, f64::min);
        let threshold = match self.trainer {
            Trainer::Idle { since } if c.elastic && since + c.lend_after > self.now => since + c.lend_after,
            _ => f64::INFINITY,
        };
        next_engine.min(threshold)
    }

    /// The passes are done and the train stage begins: with elastic.lend_rollout, shared with
    /// the lent trainers when the engines' devices are lent to it (reverse.rs, `consider`).
    fn train_stage(&mut self, c: &Costs) {
        let alone = train_stage_s(&self.stages);
        let mut seconds = alone;
        if let Some(r) = c.rollout_lending.as_ref().filter(|r| self.rollout_lend_pays(r, c)) {
            self.p.add("lend_rollout", r.lend_s);
            self.now += r.lend_s;
            self.p.rollout_lends += 1;
            self.rollout_lent = true;
            seconds = self.shared_train_s;
            for stage in self.stages.iter_mut().filter(|(name, _)| *name == "actor_train") {
                stage.1 = seconds;
            }
        }
        self.last_train_s = Some(alone);
        self.trainer = Trainer::Training { until: self.now + seconds };
    }

    /// Whether the engines' devices go to this train stage (reverse.rs, `consider`): the step
    /// ends with a weight update (the only thing that gives the slept engines weights again),
    /// the engines have nothing they may do (no request, no unfinished group, no room for a
    /// request's groups, the next batch already queued), and the share of the last train stage
    /// the lent trainers would take off exceeds the switch.
    ///
    /// A run weighs the switch it measured (setup's calibration lend and reclaim, then each
    /// reclaim's); each stage of that switch lasts at least its modelled time, which is what a
    /// plan charges, so the modelled switch stands in for the measured one here.
    fn rollout_lend_pays(&self, r: &RolloutLending, c: &Costs) -> bool {
        let publishes = self.since_update + 1 == c.per_update;
        let own = || self.engines.iter().enumerate().filter(|(_, e)| !e.lent);
        let generating = own().any(|(_, e)| e.busy_until.is_some() || !e.groups.is_empty()) || !self.orphans.is_empty();
        let may_start = own().next().is_some_and(|(k, _)| self.fresh_groups_for(k) > 0);
        let next_batch_queued = self.queue.len() >= self.job.cfg.rollout.prompts_per_step;
        let saving = self.last_train_s.map(|t| t * (1.0 - c.trainers / (c.trainers + r.lent_trainers)));
        publishes
            && !generating
            && !may_start
            && next_batch_queued
            && saving.is_some_and(|s| s > r.lend_s + r.reclaim_s)
    }

    /// The trainer's batch is trained: the engines get back any devices lent to it, its stages
    /// are counted, then the weights go out every `async.train_iters_per_update` steps, else the
    /// step's row closes now.
    fn trained(&mut self, c: &Costs) {
        if let Some(r) = c.rollout_lending.as_ref().filter(|_| self.rollout_lent) {
            self.p.add("reclaim_rollout", r.reclaim_s);
            self.now += r.reclaim_s;
            self.rollout_lent = false;
        }
        for (name, s) in self.stages.drain(..) {
            self.p.add(name, s);
        }
        self.in_training = 0;
        self.since_update += 1;
        if self.since_update == c.per_update {
            self.since_update = 0;
            self.trainer = Trainer::Publishing;
        } else {
            self.row();
        }
    }

    /// Whether a lend is worth its `switch` (lend.rs, `consider`): the lent engines would have
    /// work, and the batch is not expected sooner than a switch takes at the rate the engines of
    /// their own devices have been finishing groups (their last 64).
    fn lend_pays(&self, switch: f64) -> bool {
        let lent = self.engines.iter().position(|e| e.lent);
        let fresh = lent.map_or(0, |k| self.fresh_groups_for(k));
        let generating = self.engines.iter().any(|e| !e.groups.is_empty());
        if self.orphans.is_empty() && !generating && fresh == 0 {
            return false;
        }
        let (Some(first), Some(last)) = (self.finished_at.front(), self.finished_at.back()) else { return true };
        if self.finished_at.len() < 2 || last <= first {
            return true;
        }
        let rate = (self.finished_at.len() - 1) as f64 / (last - first);
        let missing = self.job.cfg.rollout.prompts_per_step.saturating_sub(self.queue.len()).max(1);
        missing as f64 / rate >= switch
    }

    /// The trainer begins its passes over `batch`.
    fn train(&mut self, batch: Vec<Vec<Seq>>, c: &Costs) {
        self.stages = self.job.train_stages(&batch, c.trainers);
        if let Some(r) = &c.rollout_lending {
            let shared = self.job.train_stages(&batch, c.trainers + r.lent_trainers);
            self.shared_train_s = train_stage_s(&shared);
        }
        self.step += 1;
        let passes: f64 = self.stages.iter().filter(|(name, _)| *name != "actor_train").map(|(_, s)| s).sum();
        self.trainer = Trainer::Passes { until: self.now + passes };
    }

    /// A step's row: its window closes.
    fn row(&mut self) {
        self.p.step_s.push(self.now - self.last_row);
        self.last_row = self.now;
        self.trainer = Trainer::Idle { since: self.now };
    }

    /// The oldest batch the queue holds, none overtaking a group still generating; groups too
    /// stale are dropped first (queue.rs).
    fn take_batch(&mut self) -> Option<Vec<Vec<Seq>>> {
        let staleness = self.job.cfg.asynchronous.max_staleness.max(0) as u64;
        let version = self.version;
        let before = self.queue.len();
        self.queue.retain(|g| g.oldest.is_none_or(|o| version - o.min(version) <= staleness));
        self.p.dropped_groups += (before - self.queue.len()) as u64;
        self.queue.sort_by_key(|g| g.started);
        let first = self.engines.iter().flat_map(|e| &e.groups).chain(&self.orphans).map(|g| g.started).min();
        let ready = self.queue.iter().take_while(|g| first.is_none_or(|f| g.started < f)).count();
        let per_step = self.job.cfg.rollout.prompts_per_step;
        (ready >= per_step).then(|| self.queue.drain(..per_step).map(|g| g.seqs).collect())
    }

    /// Every idle engine continues its groups and starts new ones while the queue has room
    /// (rollouter.rs, `fresh_groups_for`); lent engines only while lent.
    fn feed(&mut self) {
        if self.step >= self.job.cfg.run.steps {
            return;
        }
        let lent_now = matches!(self.trainer, Trainer::Lent);
        for k in 0..self.engines.len() {
            let asleep = if self.engines[k].lent { !lent_now } else { self.rollout_lent };
            if self.engines[k].busy_until.is_some() || asleep {
                continue;
            }
            let room = self.per_request.saturating_sub(self.engines[k].groups.len()).min(self.orphans.len());
            let adopted: Vec<Group> = self.orphans.drain(..room).collect();
            self.engines[k].groups.extend(adopted);
            let fresh = self.fresh_groups_for(k);
            for _ in 0..fresh {
                let seqs = self.job.group(self.started);
                self.engines[k].groups.push(Group { started: self.started, seqs, oldest: None });
                self.started += 1;
            }
            if self.engines[k].groups.is_empty() {
                continue;
            }
            let version = self.version;
            let e = &mut self.engines[k];
            let held = vec![e.version == version; e.groups.iter().map(|g| g.seqs.len()).sum()];
            let mut seqs: Vec<&mut Seq> = e.groups.iter_mut().flat_map(|g| g.seqs.iter_mut()).collect();
            let r = engine::request(&self.job.model, &mut seqs, &held, self.limits);
            for g in e.groups.iter_mut() {
                g.oldest = Some(g.oldest.map_or(version, |o| o.min(version)));
            }
            e.version = version;
            e.busy_until = Some(self.now + r.seconds);
            self.p.request(&r);
        }
    }

    fn fresh_groups_for(&self, k: usize) -> usize {
        let e = &self.engines[k];
        let continued = e.groups.len();
        let free = self.per_request.saturating_sub(continued);
        let generating: usize = self.engines.iter().map(|e| e.groups.len()).sum::<usize>() + self.orphans.len();
        let under_way = generating + self.in_training;
        if free == 0 {
            return 0;
        }
        let capacity = self.job.cfg.queue_capacity_at(self.since_update);
        if under_way == 0 {
            return free.min(capacity.saturating_sub(self.queue.len()).max(1));
        }
        let room = capacity.saturating_sub(self.queue.len() + under_way);
        if continued == 0 && room < free && !e.lent { 0 } else { free.min(room) }
    }

    /// Engines whose requests have ended hand their finished groups to the queue.
    fn settle(&mut self) {
        let now = self.now;
        let finished_at = &mut self.finished_at;
        for e in self.engines.iter_mut() {
            if e.busy_until.is_some_and(|t| t <= now + 1e-12) {
                e.busy_until = None;
                let (done, left): (Vec<Group>, Vec<Group>) = e.groups.drain(..).partition(Group::finished);
                e.groups = left;
                if !e.lent {
                    finished_at.extend(std::iter::repeat_n(now, done.len()));
                }
                self.queue.extend(done);
            }
        }
        while finished_at.len() > 64 {
            finished_at.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::config;

    /// A job on `devices` devices of Qwen3-4B's profile, the long-tail job's responses.
    fn predict(mode: &str, devices: u32, extra: &[&str]) -> (Config, Predicted) {
        let mut sets: Vec<String> = [
            "compute.model=true",
            "memory.profile=qwen3-4b",
            "memory.scale=0.002",
            "compute.token_scale=40",
            "task.max_new_tokens=96",
            "rollout.prompts_per_step=8",
            "run.steps=4",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        sets.push(format!("run.mode={mode}"));
        sets.push(format!("run.devices={devices}"));
        sets.extend(extra.iter().map(|s| s.to_string()));
        let cfg = config::load(None, &sets).unwrap();
        let prof = crate::run::profile::build("qwen3-4b", 1, 0.002, 0.0).unwrap();
        let split = cfg.mode_layout().unwrap();
        let (t, r) =
            split.as_ref().map_or((devices as usize, devices as usize), |s| (s.trainer.len(), s.rollout.len()));
        let model = crate::run::learn::compute_model_of(&cfg, t, &prof).unwrap();
        let responses = Responses::sample(&cfg, 64);
        let job = Job { cfg: &cfg, model, switch: SwitchModel::new(&cfg), responses: &responses };
        let p = if split.is_some() { apart(&job, t, r) } else { colocate(&job) };
        (cfg, p)
    }

    /// Every colocated step is its phases end to end, the switch's the switch model's own.
    #[test]
    fn a_colocated_step_is_its_phases_end_to_end_with_the_switch_models_charges() {
        let (cfg, p) = predict("colocate", 2, &[]);
        assert_eq!(p.step_s.len(), 4);
        let total: f64 = p.phases.values().sum();
        assert!((p.step_s.iter().sum::<f64>() - total).abs() < 1e-9);
        let s = SwitchModel::new(&cfg).unwrap();
        assert!((p.phases["wake_up"] - 4.0 * s.resume_s(Role::Trainer, None)).abs() < 1e-9);
        assert!((p.phases["sleep"] - 4.0 * s.pause_s(Role::Trainer, None)).abs() < 1e-9);
        assert!(p.phases["generate"] > p.phases["actor_train"], "a rollout-heavy job: {:?}", p.phases);
    }

    /// A trainer that takes its batch in parts (2 prompts a step, a weight update every 4): the
    /// engines' batches shrink with the parts unless async.engine_groups keeps them, and the
    /// default queue lets them run ahead by whole updates; the same prompts go through faster
    /// with both, and none are dropped.
    #[test]
    fn a_batch_in_parts_keeps_its_engines_full_with_engine_groups() {
        let parts = ["rollout.prompts_per_step=2", "async.train_iters_per_update=4", "run.steps=16"];
        let (_, small) = predict("async", 2, &parts);
        let (_, full) = predict("async", 2, &[&parts[..], &["async.engine_groups=8"]].concat());
        assert_eq!((small.slots, full.slots), (2.0 * 8.0, 8.0 * 8.0), "groups x 8 samples");
        let (small_s, full_s): (f64, f64) = (small.step_s.iter().sum(), full.step_s.iter().sum());
        assert!(full_s < 0.8 * small_s, "parts with full engines {full_s:.1} s against {small_s:.1} s");
        assert_eq!((small.dropped_groups, full.dropped_groups), (0, 0));
    }

    /// The default queue drops nothing at any staleness bound and update period, even where an
    /// engine's request holds more groups than the bound (async.engine_groups), or the bound
    /// lets one batch in (staleness 0, a weight update every 2 steps, as in the review's trace).
    #[test]
    fn the_default_queue_drops_no_group() {
        for sets in [
            &["async.max_staleness=0", "async.train_iters_per_update=2", "rollout.prompts_per_step=2"][..],
            &["async.max_staleness=0", "async.train_iters_per_update=3", "async.engine_groups=8"],
            &["async.max_staleness=2", "async.engine_groups=40"],
            &["async.max_staleness=1", "async.train_iters_per_update=4", "rollout.prompts_per_step=4"],
        ] {
            let every = [sets, &["run.steps=12", "algo.off_policy_correction=\"tis\""]].concat();
            let (_, p) = predict("async", 2, &every);
            assert_eq!(p.dropped_groups, 0, "{sets:?}");
            assert_eq!(p.step_s.len(), 12, "{sets:?}");
        }
    }

    /// Apart, the engines keep generating while the trainer trains: a step is shorter than
    /// generating and training its batch one after the other, and a staleness bound of 0 (the
    /// engines may not run ahead) costs throughput.
    #[test]
    fn async_overlaps_generation_with_training_within_the_staleness_bound() {
        let (_, ahead) = predict("async", 2, &["async.max_staleness=2", "algo.off_policy_correction=\"tis\""]);
        let (_, lockstep) = predict("async", 2, &["async.max_staleness=0"]);
        assert_eq!(ahead.step_s.len(), 4);
        let steady = |p: &Predicted| p.step_s[1..].iter().sum::<f64>() / 3.0;
        let train = ahead.phases["actor_train"] / 4.0;
        assert!(steady(&ahead) >= train, "a step holds its training at least");
        assert!(steady(&ahead) < steady(&lockstep), "{} vs {}", steady(&ahead), steady(&lockstep));
        assert!(ahead.phases.contains_key("update_weights") && !ahead.phases.contains_key("wake_up"));
    }

    /// A job without a reference model has no ref_log_probs phase, and each colocated step is
    /// shorter by exactly that pass; rollout log-probs drop the actor's pass the same way.
    #[test]
    fn skipped_passes_are_not_charged() {
        let (_, full) = predict("colocate", 2, &[]);
        let (_, no_ref) = predict("colocate", 2, &["algo.reference=false", "algo.kl_coef=0"]);
        assert!(!no_ref.phases.contains_key("ref_log_probs") && no_ref.phases.contains_key("log_probs"));
        // The phases are the run's sums; each step's pass is its own (its lengths).
        assert!(full.step_s.iter().zip(&no_ref.step_s).all(|(a, b)| a > b), "{:?} {:?}", full.step_s, no_ref.step_s);
        let total = |p: &Predicted| p.step_s.iter().sum::<f64>();
        let pass = full.phases["ref_log_probs"];
        assert!((total(&full) - total(&no_ref) - pass).abs() < 1e-9, "{} - {} != {pass}", total(&full), total(&no_ref));
        let (_, rollout) = predict("colocate", 2, &["algo.rollout_log_probs=true"]);
        assert!(!rollout.phases.contains_key("log_probs") && rollout.phases.contains_key("ref_log_probs"));
        assert!((total(&full) - total(&rollout) - full.phases["log_probs"]).abs() < 1e-9);
    }

    /// A waiting elastic trainer lends its devices, each lend paid at the switch's rates (the
    /// trainer's sleep, the engine's wake and the weights' device-to-device copy, as lend.rs
    /// charges them); a threshold nobody reaches leaves it async's layout, step for step.
    #[test]
    fn an_elastic_trainer_that_waits_lends_and_one_that_never_waits_long_enough_is_async() {
        let tis = "algo.off_policy_correction=\"tis\"";
        let (cfg, lending) = predict("elastic", 2, &[tis]);
        assert!(lending.lends > 0 && lending.phases["lend"] > 0.0, "{:?}", lending.phases);
        let s = SwitchModel::new(&cfg).unwrap();
        let each = s.pause_s(Role::Trainer, None) + s.resume_s(Role::Rollout, None) + s.update_s(WeightTransport::Ipc);
        assert!(s.update_s(WeightTransport::Ipc) > 0.0);
        let charged = lending.phases["lend"] / lending.lends as f64;
        assert!((charged - each).abs() < 1e-9, "a lend charged {charged}, its stages {each}");
        let (_, never) = predict("elastic", 2, &[tis, "elastic.lend_after_s=1e9"]);
        let (_, plain) = predict("async", 2, &[tis]);
        assert_eq!(never.lends, 0);
        assert_eq!(never.step_s, plain.step_s);
    }

    /// A trainer-bound job: the trainer's passes at 3% of the peak, one version of staleness,
    /// so the engines fill the queue early in each step and then have nothing they may start.
    const TRAINER_BOUND: [&str; 2] = ["compute.train_mfu=0.03", "async.max_staleness=1"];

    fn trainer_bound(mode: &str, extra: &[&str]) -> Predicted {
        predict(mode, 2, &[&TRAINER_BOUND[..], extra].concat()).1
    }

    /// The engines' devices go to the train stages of steps 2 and 3 (step 1 has no train stage
    /// to go by, step 4 no next batch queued: the run ends), each lend and reclaim charged the
    /// switch model's sleep and wake, each lent stage half the trainer's alone: the steps after
    /// the first are shorter than async's and than elastic's without the key.
    #[test]
    fn lend_rollout_gives_a_trainer_bound_step_the_engines_devices_and_beats_async() {
        let lending = trainer_bound("elastic", &["elastic.lend_rollout=true"]);
        let unlent = trainer_bound("elastic", &[]);
        let plain = trainer_bound("async", &[]);
        assert_eq!(lending.rollout_lends, 2, "{:?}", lending.phases);
        assert_eq!((unlent.rollout_lends, plain.rollout_lends), (0, 0));
        let (cfg, _) = predict("elastic", 2, &TRAINER_BOUND);
        let s = SwitchModel::new(&cfg).unwrap();
        let lend = s.pause_s(Role::Rollout, None) + s.resume_s(Role::Trainer, None);
        let reclaim = s.pause_s(Role::Trainer, None) + s.resume_s(Role::Rollout, None);
        assert!(lend > 0.0 && reclaim > 0.0, "the host link is charged: {lend} + {reclaim}");
        assert!((lending.phases["lend_rollout"] - 2.0 * lend).abs() < 1e-9, "{:?}", lending.phases);
        assert!((lending.phases["reclaim_rollout"] - 2.0 * reclaim).abs() < 1e-9, "{:?}", lending.phases);
        // Two of four train stages taken at half: three quarters of the whole.
        let ratio = lending.phases["actor_train"] / unlent.phases["actor_train"];
        assert!((ratio - 0.75).abs() < 0.05, "{ratio}");
        let after_first = |p: &Predicted| p.step_s[1..].iter().sum::<f64>();
        assert!(after_first(&lending) < after_first(&unlent), "{:?} vs {:?}", lending.step_s, unlent.step_s);
        assert!(after_first(&lending) < after_first(&plain), "{:?} vs {:?}", lending.step_s, plain.step_s);
        assert_eq!(lending.step_s[0], unlent.step_s[0], "step 1 does not lend");
    }

    /// A switch dearer than the train stage's expected saving (a host link of 0.5 GB/s: minutes
    /// to wake the lent trainer's state) is not paid: the key changes nothing.
    #[test]
    fn lend_rollout_does_not_lend_when_the_switch_exceeds_the_saving() {
        let slow_link = "compute.h2d_gbps=0.5";
        let asked = trainer_bound("elastic", &[slow_link, "elastic.lend_rollout=true"]);
        let unasked = trainer_bound("elastic", &[slow_link]);
        assert_eq!(asked.rollout_lends, 0);
        assert!(!asked.phases.contains_key("lend_rollout"), "{:?}", asked.phases);
        assert_eq!(asked.step_s, unasked.step_s);
    }
}
