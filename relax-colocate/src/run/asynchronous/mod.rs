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
mod queue;
mod rollouter;
mod step;

use super::config::Config;
use super::fleet::{Fleet, InFlight};
use super::handover;
use super::launch::Plan;
use super::protocol::{self, Init};
use super::recorder::{Recorder, Span};
use super::rig::Rig;
use super::summary::AsyncSummary;
use super::{FailKind, R, Role, RunError, weights};
use crate::run::clock::Instant;
use accounts::Accounts;
use elastic::{Cx, Elastic};
use rollouter::{Rollouter, capacity, max_staleness};
use step::{Finished, Training};

/// The async driver: what every driver works with, the rollouter (engines, groups, queue), the
/// accounts of time and samples, and elastic mode's lending. The trainer's side is a `Training`
/// job the loop holds while it runs.
pub(super) struct Async {
    pub(super) rig: Rig,
    roll: Rollouter,
    /// The step's window and the run's totals (time waited, idle, lent, switched; samples).
    accounts: Accounts,
    elastic: Elastic,
}

/// Which kind of request answered, by its position among those waited on.
enum Answer {
    Engine(usize),
    Trainer(usize),
}

impl Async {
    pub(super) fn new(cfg: &Config, plan: Plan, fleet: Fleet, rec: Recorder) -> Async {
        Async {
            roll: Rollouter::new(cfg, &fleet),
            elastic: Elastic::new(cfg, &fleet),
            rig: Rig::new(cfg, plan, fleet, rec),
            accounts: Accounts::new(),
        }
    }

    fn step(&self) -> u64 {
        self.rig.at.step()
    }

    /// Elastic mode's hooks, and the parts they act on.
    fn parts(&mut self) -> (&mut Elastic, Cx<'_>) {
        (&mut self.elastic, Cx { rig: &mut self.rig, roll: &mut self.roll, accounts: &mut self.accounts })
    }

    /// The whole run: setup, then trainer steps until run.steps, the engines generating meanwhile.
    pub(super) fn run(&mut self) -> R<()> {
        self.setup()?;
        self.accounts.start();
        self.roll.start();
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
                    let (elastic, mut cx) = self.parts();
                    elastic.trainer_waiting(&mut cx, trainer_idle_since, since_update)?;
                }
            }
            if before_update.is_none() {
                let lend = self.elastic.view();
                self.roll.feed(&mut self.rig, &mut self.accounts, lend)?;
            }
            // An update waits for the segments in flight (Relax's pause and flush); then nothing
            // else is under way.
            if before_update.is_some() && !self.roll.generating() {
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
            let generating = self.roll.generating();
            if job.is_none() && before_update.is_none() && self.step() >= steps && !generating {
                return self.rig.sync.leave(&mut self.rig.fleet, &mut self.rig.rec);
            }
            if job.is_none() && !generating {
                // Nothing under way and nothing to start: the queue can never fill.
                return Err(self.stalled());
            }
            let until = self.elastic.deadline(&self.rig, &self.roll, trainer_idle_since);
            if let Some(done) = self.wait_one(&mut job, until)? {
                job = None;
                since_update += 1;
                // Feeding stops until the update pending at per_update is out, and then none
                // are trained since it.
                self.roll.set_trained_since_update(since_update % per_update);
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
        self.rig.at.fail(
            FailKind::Setup,
            None,
            format!(
                "{} mode stalled: {} group(s) queued, the trainer needs {} and no engine may start more \
                 (async.queue_groups too small?)",
                self.rig.cfg.run.mode.as_str(),
                self.roll.queue().len(),
                self.rig.cfg.rollout.prompts_per_step
            ),
        )
    }

    /// The trainer's next batch, when the queue has one; in elastic mode only once its devices
    /// are back (a lend under way is reclaimed first).
    fn next_batch(&mut self) -> R<Option<Vec<queue::Group>>> {
        let (elastic, mut cx) = self.parts();
        elastic.next_batch(&mut cx)
    }

    /// The engines and the trainer start; the trainer's initial weights reach every engine. In
    /// elastic mode the lent engines start beside the regular ones and sleep before the trainers
    /// start on their devices, and one lend and reclaim measure what switching costs.
    fn setup(&mut self) -> R<()> {
        let max_batch = self.roll.max_batch(&self.rig.cfg);
        let (elastic, mut cx) = self.parts();
        elastic.before_engines(&mut cx, max_batch)?;
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
                let (elastic, mut cx) = self.parts();
                elastic.engines_started(&mut cx)?;
            }
        }
        self.rig.sync.join(&mut self.rig.fleet, &mut self.rig.rec)?;
        let (elastic, mut cx) = self.parts();
        elastic.before_initial_weights(&mut cx)?;
        self.transfer_weights("on every rollout engine after the initial update_weights")?;
        let (elastic, mut cx) = self.parts();
        elastic.after_initial_weights(&mut cx)
    }

    /// The trainer's weights to every engine, checked there.
    fn transfer_weights(&mut self, when: &str) -> R<()> {
        let span = self.rig.rec.begin("update_weights");
        let t0 = Instant::now();
        let sum = weights::trainer_checksum(&mut self.rig.fleet, &self.rig.at)?;
        let moved =
            self.rig.sync.transfer(&mut self.rig.fleet, &self.rig.at, &mut self.rig.rec, self.roll.version() + 1)?;
        self.rig.rec.end(span, &self.rig.fleet)?;
        self.accounts.weights_moved(t0.elapsed().as_secs_f64(), moved.bytes);
        let rollouts = self.rig.fleet.indices(Role::Rollout);
        handover::expect_weights(&mut self.rig.fleet, &mut self.rig.rec, &rollouts, &sum, when)
    }

    /// A new weight version: the trainer's weights after its last step reach every engine, whose
    /// interrupted sequences continue under them.
    fn update_weights(&mut self) -> R<()> {
        let next = self.roll.version() + 1;
        self.transfer_weights(&format!("on every rollout engine after update_weights (version {next})"))?;
        self.roll.published();
        self.accounts.published();
        Ok(())
    }

    /// Waits for the first answer among the engines' requests and the trainer's, and takes it in.
    /// Returns the batch the trainer finished, when that was the answer.
    /// Gives up at `until` (a lending decision or deadline due), with nothing taken in.
    fn wait_one(&mut self, job: &mut Option<Training>, until: Option<Instant>) -> R<Option<Finished>> {
        let k = {
            let mut waiting: Vec<&InFlight> = self.roll.requests();
            let engines = waiting.len();
            if let Some(j) = job.as_ref() {
                waiting.extend(j.job.requests().iter());
            }
            let Some(k) = self.rig.fleet.wait_any_until(&waiting, until.map(|u| u.wall()))? else {
                return Ok(None);
            };
            if k < engines { Answer::Engine(k) } else { Answer::Trainer(k - engines) }
        };
        match k {
            Answer::Engine(nth) => {
                let lend = self.elastic.view();
                let finished = self.roll.take_generated(&mut self.rig, &mut self.accounts, nth, lend)?;
                self.elastic.segment_taken(&finished);
                Ok(None)
            }
            Answer::Trainer(nth) => {
                let j = job.as_mut().expect("a trainer request");
                self.advance(j, nth)
            }
        }
    }

    /// The summary's `async` block: throughput, both sides' idle shares, staleness, the updates.
    pub(super) fn summary(&self) -> AsyncSummary {
        let t = &self.accounts.totals;
        let wall = t.started.map(|s| s.elapsed().as_secs_f64()).unwrap_or(0.0);
        let per_s = |x: u64| if wall > 0.0 { x as f64 / wall } else { 0.0 };
        let ratio = |x: f64| if wall > 0.0 { x / wall } else { 0.0 };
        let split = self.rig.cfg.mode_layout().ok().flatten();
        let (cfg, own) = (&self.rig.cfg, self.roll.own_engines());
        let elastic = self.elastic.summary(cfg, wall, &self.accounts, own);
        AsyncSummary {
            mode: if elastic.is_some() { "elastic" } else { "async" }.into(),
            trainer_devices: split.as_ref().map(|s| s.trainer.clone()),
            rollout_devices: split.as_ref().map(|s| s.rollout.clone()),
            max_staleness: max_staleness(cfg),
            train_iters_per_update: self.rig.cfg.asynchronous.train_iters_per_update,
            queue_capacity_groups: capacity(cfg),
            segment_tokens: self.rig.cfg.asynchronous.segment_tokens,
            samples_trained: t.samples_trained,
            samples_per_s: per_s(t.samples_trained),
            tokens_per_s: per_s(t.tokens_trained),
            dropped_stale_samples: self.roll.queue().dropped_samples,
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
            rollout_idle_ratio: if wall > 0.0 { t.rollout_idle_s / (wall * own as f64) } else { 0.0 },
            elastic,
            transport: self.rig.sync.summary(),
        }
    }
}
