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
//!
//! Here: the driver's loop, setup and the weight updates; feed.rs feeds the engines and takes
//! their segments in; step.rs runs the trainer's stages over a batch and writes the step's row.

mod accounts;
mod elastic;
mod engine;
mod feed;
mod queue;
mod step;

use super::config::{Config, Mode};
use super::fleet::{Fleet, InFlight};
use super::handover;
use super::launch::Plan;
use super::protocol::{self, Init};
use super::recorder::{Recorder, Span};
use super::rig::Rig;
use super::summary::{AsyncSummary, ElasticSummary};
use super::task::Rng;
use super::{FailKind, R, Role, RunError, weights};
use accounts::Accounts;
use elastic::{lend, reverse};
use engine::Engine;
use queue::{Group, Queue};
use std::time::Instant;
use step::{Finished, Training};

pub(super) struct Async {
    pub(super) rig: Rig,
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
    /// The step's window and the run's totals (time waited, idle, lent, switched; samples).
    accounts: Accounts,
    /// Elastic mode's lending (None in async mode).
    lending: Option<lend::Lending>,
    /// elastic.lend_rollout: the reverse, the engines' devices lent to the trainer.
    rollout_lending: Option<reverse::RolloutLending>,
    /// Unfinished groups a reclaimed lent engine left: any engine continues them, before new ones.
    orphans: Vec<Group>,
}

/// Which kind of request answered, by its position among those waited on.
enum Answer {
    Engine(usize),
    Trainer(usize),
}

impl Async {
    pub(super) fn new(cfg: &Config, plan: Plan, fleet: Fleet, rec: Recorder) -> Async {
        let rollouts = fleet.indices(Role::Rollout);
        let lent = fleet.lent_engines();
        let own = rollouts.iter().map(|&w| Engine::new(w, false));
        let engines = own.chain(lent.iter().map(|&w| Engine::new(w, true)));
        let lending = (cfg.run.mode == Mode::Elastic).then(|| lend::Lending::new(&fleet));
        let rollout_lending =
            (cfg.run.mode == Mode::Elastic && cfg.elastic.lend_rollout).then(|| reverse::RolloutLending::new(&fleet));
        let groups_per_request = cfg.rollout.prompts_per_step / rollouts.len();
        Async {
            engines: engines.collect(),
            rig: Rig::new(cfg, plan, fleet, rec),
            version: 0,
            queue: Queue::default(),
            groups_per_request,
            training_groups: 0,
            rng: Rng::new(cfg.run.seed ^ 0xDA7A),
            requests: 0,
            groups_started: 0,
            accounts: Accounts::new(),
            lending,
            rollout_lending,
            orphans: Vec::new(),
        }
    }

    fn step(&self) -> u64 {
        self.rig.at.step()
    }

    fn fail(&self, kind: FailKind, worker: Option<&str>, cause: impl Into<String>) -> RunError {
        self.rig.at.fail(kind, worker, cause)
    }

    fn max_staleness(&self) -> u64 {
        self.rig.cfg.asynchronous.max_staleness.max(0) as u64
    }

    /// Groups queued and being generated before an engine waits (back-pressure): Relax's
    /// batch x (max_staleness + 1) unless async.queue_groups says otherwise.
    fn capacity(&self) -> usize {
        match self.rig.cfg.asynchronous.queue_groups {
            0 => self.rig.cfg.rollout.prompts_per_step * (self.max_staleness() as usize + 1),
            n => n as usize,
        }
    }

    fn segment(&self) -> Option<usize> {
        Some(self.rig.cfg.asynchronous.segment_tokens as usize).filter(|s| *s > 0)
    }

    /// Whether generation runs in segments (of tokens, of modelled time, or both), or each
    /// request runs its sequences to the end.
    fn partial(&self) -> bool {
        self.segment().is_some() || self.rig.cfg.segment_budget().is_some()
    }

    /// The whole run: setup, then trainer steps until run.steps, the engines generating meanwhile.
    pub(super) fn run(&mut self) -> R<()> {
        self.setup()?;
        self.accounts.start();
        for e in self.engines.iter_mut().filter(|e| !e.lent) {
            e.start_idle();
        }
        let steps = self.rig.cfg.run.steps;
        let per_update = self.rig.cfg.asynchronous.train_iters_per_update;
        let mut job: Option<Training> = None;
        let mut trainer_idle_since = Some(Instant::now());
        let mut since_update = 0;
        // A finished step whose row waits for the weight update it triggered.
        let mut before_update: Option<Finished> = None;
        let mut pausing: Option<(Span, Instant)> = None;
        loop {
            if job.is_none() && before_update.is_none() && self.step() < steps {
                if let Some(batch) = self.next_batch()? {
                    if let Some(t) = trainer_idle_since.take() {
                        self.accounts.trainer_waited(t.elapsed().as_secs_f64());
                    }
                    self.rig.at.set_step(self.step() + 1);
                    self.rig.rec.new_step();
                    job = Some(self.start_job(batch, since_update + 1 == per_update)?);
                } else {
                    self.elastic_trainer_waiting(trainer_idle_since, since_update)?;
                }
            }
            if before_update.is_none() {
                self.feed_engines()?;
            }
            // An update waits for the segments in flight (Relax's pause and flush); then nothing
            // else is under way.
            if before_update.is_some() && self.engines.iter().all(|e| !e.generating()) {
                if let Some((span, t0)) = pausing.take() {
                    self.rig.rec.end(span, &self.rig.fleet)?;
                    let flush = t0.elapsed().as_secs_f64();
                    self.accounts.flushed(flush);
                }
                self.update_weights()?;
                let done = before_update.take().expect("checked");
                self.write_row(done);
                trainer_idle_since = Some(Instant::now());
                continue;
            }
            let generating = self.engines.iter().any(Engine::generating);
            if job.is_none() && before_update.is_none() && self.step() >= steps && !generating {
                return self.rig.sync.leave(&mut self.rig.fleet, &mut self.rig.rec);
            }
            if job.is_none() && !generating {
                // Nothing under way and nothing to start: the queue can never fill.
                return Err(self.stalled());
            }
            let until = self.elastic_deadline(trainer_idle_since);
            if let Some(done) = self.wait_one(&mut job, until)? {
                job = None;
                since_update += 1;
                if since_update == per_update {
                    since_update = 0;
                    before_update = Some(done);
                    pausing = Some((self.rig.rec.begin("pause_generation"), Instant::now()));
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
                self.rig.cfg.run.mode.as_str(),
                self.queue.len(),
                self.rig.cfg.rollout.prompts_per_step
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
        self.elastic_next_batch(|a| {
            let first_in_flight = a.first_in_flight();
            let batch = a.rig.cfg.rollout.prompts_per_step;
            a.queue.take_batch(batch, a.version, a.max_staleness(), first_in_flight)
        })
    }

    /// The engines and the trainer start; the trainer's initial weights reach every engine. In
    /// elastic mode the lent engines start beside the regular ones and sleep before the trainers
    /// start on their devices, and one lend and reclaim measure what switching costs.
    fn setup(&mut self) -> R<()> {
        let max_batch = self.groups_per_request * self.rig.cfg.rollout.samples_per_prompt;
        self.elastic_before_engines(max_batch)?;
        for (role, phase) in [(Role::Rollout, "init_rollout"), (Role::Trainer, "init_trainer")] {
            let span = self.rig.rec.begin(phase);
            let mut targets = self.rig.fleet.indices(role);
            let mut params = self.rig.init_params(role, max_batch);
            if role == Role::Rollout {
                let lent = self.rig.fleet.lent_engines();
                let device = |i: usize| self.rig.fleet.worker(i).device;
                let like = params[0].clone();
                params.extend(lent.iter().map(|&i| protocol::InitParams { device: device(i), ..like.clone() }));
                targets.extend(lent);
            }
            self.rig.fleet.call_each::<Init>(&targets, params)?;
            self.rig.fleet.find_control_sockets_of(&targets)?;
            self.rig.rec.end(span, &self.rig.fleet)?;
            if role == Role::Rollout {
                self.elastic_engines_started()?;
            }
        }
        self.rig.sync.join(&mut self.rig.fleet, &mut self.rig.rec)?;
        self.elastic_before_initial_weights()?;
        self.transfer_weights("on every rollout engine after the initial update_weights")?;
        self.elastic_after_initial_weights()?;
        Ok(())
    }

    /// The trainer's weights to every engine, checked there.
    fn transfer_weights(&mut self, when: &str) -> R<()> {
        let span = self.rig.rec.begin("update_weights");
        let t0 = Instant::now();
        let sum = weights::trainer_checksum(&mut self.rig.fleet, &self.rig.at)?;
        let moved = self.rig.sync.transfer(&mut self.rig.fleet, &self.rig.at, &mut self.rig.rec, self.version + 1)?;
        self.rig.rec.end(span, &self.rig.fleet)?;
        self.accounts.weights_moved(t0.elapsed().as_secs_f64(), moved.bytes);
        let rollouts = self.rig.fleet.indices(Role::Rollout);
        handover::expect_weights(&mut self.rig.fleet, &mut self.rig.rec, &rollouts, &sum, when)
    }

    /// A new weight version: the trainer's weights after its last step reach every engine, whose
    /// interrupted sequences continue under them.
    fn update_weights(&mut self) -> R<()> {
        let next = self.version + 1;
        self.transfer_weights(&format!("on every rollout engine after update_weights (version {next})"))?;
        self.version = next;
        self.accounts.published();
        Ok(())
    }

    /// Waits for the first answer among the engines' requests and the trainer's, and takes it in.
    /// Returns the batch the trainer finished, when that was the answer.
    /// Gives up at `until` (a lending decision or deadline due), with nothing taken in.
    fn wait_one(&mut self, job: &mut Option<Training>, until: Option<Instant>) -> R<Option<Finished>> {
        let k = {
            let mut waiting: Vec<&InFlight> = self.engines.iter().filter_map(Engine::request).collect();
            let engines = waiting.len();
            if let Some(j) = job.as_ref() {
                waiting.extend(j.job.requests().iter());
            }
            let Some(k) = self.rig.fleet.wait_any_until(&waiting, until)? else {
                return Ok(None);
            };
            if k < engines { Answer::Engine(k) } else { Answer::Trainer(k - engines) }
        };
        match k {
            Answer::Engine(nth) => {
                let e = self.engines.iter().enumerate().filter(|(_, e)| e.generating()).nth(nth).map(|(i, _)| i);
                self.take_generated(e.expect("an engine in flight"))?;
                Ok(None)
            }
            Answer::Trainer(nth) => {
                let j = job.as_mut().expect("a trainer request");
                self.advance(j, nth)
            }
        }
    }

    /// The engines on devices of their own (not elastic mode's lent ones).
    fn own_engines(&self) -> usize {
        self.engines.iter().filter(|e| !e.lent).count().max(1)
    }

    /// The summary's `async` block: throughput, both sides' idle shares, staleness, the updates.
    pub(super) fn summary(&self) -> AsyncSummary {
        let t = &self.accounts.totals;
        let wall = t.started.map(|s| s.elapsed().as_secs_f64()).unwrap_or(0.0);
        let per_s = |x: u64| if wall > 0.0 { x as f64 / wall } else { 0.0 };
        let ratio = |x: f64| if wall > 0.0 { x / wall } else { 0.0 };
        let split = self.rig.cfg.mode_layout().ok().flatten();
        let elastic = self.lending.as_ref().map(|l| ElasticSummary {
            rollout_lend: self.rollout_lending.as_ref().map(|r| r.summary(wall, t.rollout_idle_s, self.own_engines())),
            ..l.summary(&self.rig.cfg, wall, t.trainer_idle_s, t.flush_total_s)
        });
        AsyncSummary {
            mode: if elastic.is_some() { "elastic" } else { "async" }.into(),
            trainer_devices: split.as_ref().map(|s| s.trainer.clone()),
            rollout_devices: split.as_ref().map(|s| s.rollout.clone()),
            max_staleness: self.max_staleness(),
            train_iters_per_update: self.rig.cfg.asynchronous.train_iters_per_update,
            queue_capacity_groups: self.capacity(),
            segment_tokens: self.rig.cfg.asynchronous.segment_tokens,
            samples_trained: t.samples_trained,
            samples_per_s: per_s(t.samples_trained),
            tokens_per_s: per_s(t.tokens_trained),
            dropped_stale_samples: self.queue.dropped_samples,
            staleness_histogram: t.staleness.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            partial_samples: t.partial_samples,
            generate_replies_after_last_batch: t.replies_after_last_batch,
            weight_updates: t.updates,
            update_weights_s: t.update_s,
            update_weights_bytes: t.update_bytes,
            segment_s: self.rig.cfg.segment_budget(),
            segments_ended_mid_token: t.segments_mid_token,
            trainer_idle_ratio: ratio(t.trainer_idle_s + t.flush_total_s),
            trainer_wait_ratio: ratio(t.trainer_idle_s),
            flush_ratio: ratio(t.flush_total_s),
            flush_s_mean: (!t.flush_s.is_empty()).then(|| t.flush_s.iter().sum::<f64>() / t.flush_s.len() as f64),
            flush_s_max: t.flush_s.iter().copied().reduce(f64::max),
            rollout_idle_ratio: if wall > 0.0 { t.rollout_idle_s / (wall * self.own_engines() as f64) } else { 0.0 },
            elastic,
            transport: self.rig.sync.summary(),
        }
    }
}
