//! Elastic mode's room: lending a device to the other side while its own side has nothing to do,
//! in either direction. Both directions are one policy, `Lend`: a pair of workers per device (a
//! trainer and an engine), a lend that puts one side to sleep and wakes the other, a reclaim that
//! undoes it, the switch they cost measured once at setup and after every reclaim, and the
//! counts the summary reports. lend.rs lends a waiting trainer's devices to the rollout (a lent
//! engine on each); reverse.rs, with elastic.lend_rollout, lends the engines' devices to a
//! trainer-bound step's train stage (a lent trainer on each).
//!
//! The async driver takes no lending decision itself: at each of its events it calls one of
//! `Elastic`'s hooks, which do nothing outside elastic mode. The hooks act on the rollouter and
//! the accounts only through their methods.

pub(super) mod lend;
pub(super) mod reverse;

use super::accounts::Accounts;
use super::queue::Group;
use super::rollouter::{Finished, LendView, Rollouter};
use crate::run::R;
use crate::run::clock::Instant;
use crate::run::config::{Config, Mode};
use crate::run::fleet::Fleet;
use crate::run::metrics::Row;
use crate::run::rig::Rig;
use crate::run::summary::ElasticSummary;
use serde_json::{Value, json};

/// What a hook may act on: the rig, the rollouter and the accounts (the driver's other parts).
pub(super) struct Cx<'a> {
    pub(super) rig: &'a mut Rig,
    pub(super) roll: &'a mut Rollouter,
    pub(super) accounts: &'a mut Accounts,
}

/// Which way a lend goes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Direction {
    /// The trainer's devices to the rollout: a lent engine wakes on each.
    ToRollout,
    /// The engines' devices to the trainer: a lent trainer wakes on each.
    ToTrainer,
}

impl Direction {
    /// The phase and lending.jsonl action of a lend, of its reclaim, and of a lend decided
    /// against.
    fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Direction::ToRollout => ("lend", "reclaim", "skip"),
            Direction::ToTrainer => ("lend_rollout", "reclaim_rollout", "skip_rollout"),
        }
    }
}

/// What both directions keep: the pairs, the switch, the counts.
pub(super) struct Lend {
    direction: Direction,
    /// (trainer, engine) fleet indices, one pair per lent device: on the trainer's devices the
    /// trainer and the lent engine, on the engines' devices the lent trainer and the engine.
    pairs: Vec<(usize, usize)>,
    /// The last switch measured: a lend and its reclaim, seconds.
    switch_s: Option<f64>,
    /// The switch measured at setup.
    calibration_s: Option<f64>,
    last_lend_s: f64,
    counts: Counts,
}

/// The lends' counts since setup's calibration.
#[derive(Default)]
struct Counts {
    lends: u64,
    skipped: u64,
    lend_s: f64,
    reclaim_s: f64,
    /// Of the lends' and reclaims' time, the saver's own pauses and resumes (its reports).
    saver_s: f64,
}

impl Lend {
    fn new(direction: Direction, pairs: Vec<(usize, usize)>) -> Lend {
        Lend { direction, pairs, switch_s: None, calibration_s: None, last_lend_s: 0.0, counts: Counts::default() }
    }

    fn lend_phase(&self) -> &'static str {
        self.direction.names().0
    }

    fn reclaim_phase(&self) -> &'static str {
        self.direction.names().1
    }

    /// A lend took `seconds`, `saver` of them the saver's.
    fn lent(&mut self, seconds: f64, saver: f64) {
        let c = &mut self.counts;
        (c.lends, c.lend_s, c.saver_s) = (c.lends + 1, c.lend_s + seconds, c.saver_s + saver);
        self.last_lend_s = seconds;
    }

    /// The saver took `seconds` outside a lend or reclaim (a retirement's pause).
    fn saver(&mut self, seconds: f64) {
        self.counts.saver_s += seconds;
    }

    /// Its reclaim took `seconds`, `saver` of them the saver's: the switch is measured again.
    fn reclaimed(&mut self, seconds: f64, saver: f64) {
        self.counts.reclaim_s += seconds;
        self.counts.saver_s += saver;
        self.switch_s = Some(self.last_lend_s + seconds);
    }

    /// Setup's lend and reclaim are done: their switch is the calibration, and the counts start
    /// from zero.
    fn calibrated(&mut self) {
        self.calibration_s = self.switch_s;
        self.counts = Counts::default();
    }

    /// A lend decided against, logged with `why` (an object).
    fn skip(&mut self, rig: &mut Rig, why: Value) {
        self.counts.skipped += 1;
        self.log(rig, self.direction.names().2, why);
    }

    /// A decision line in lending.jsonl: `action` and the fields of `what` (an object).
    fn log(&self, rig: &mut Rig, action: &str, what: Value) {
        let mut d = json!({ "action": action });
        if let (Some(d), Value::Object(w)) = (d.as_object_mut(), what) {
            d.extend(w);
        }
        rig.rec.log_decision(d);
    }

    /// The mean of `total` over the lends (None before the first).
    fn per_lend(&self, total: f64) -> Option<f64> {
        (self.counts.lends > 0).then(|| total / self.counts.lends as f64)
    }

    /// Each lend's mean seconds, its reclaim's, and the saver's share of both (None before the
    /// first lend).
    fn means(&self) -> (Option<f64>, Option<f64>, Option<f64>) {
        let c = &self.counts;
        (self.per_lend(c.lend_s), self.per_lend(c.reclaim_s), self.per_lend(c.saver_s))
    }
}

/// Elastic mode's lending, each direction when asked for.
pub(super) struct Elastic {
    /// The trainer's devices to the rollout (elastic mode).
    to_rollout: Option<lend::Lending>,
    /// The engines' devices to the trainer (elastic.lend_rollout).
    to_trainer: Option<reverse::RolloutLending>,
}

impl Elastic {
    pub(super) fn new(cfg: &Config, fleet: &Fleet) -> Elastic {
        let elastic = cfg.run.mode == Mode::Elastic;
        Elastic {
            to_rollout: elastic.then(|| lend::Lending::new(fleet)),
            to_trainer: (elastic && cfg.elastic.lend_rollout).then(|| reverse::RolloutLending::new(fleet)),
        }
    }

    /// Whether train requests say their replicas (elastic.lend_rollout).
    pub(super) fn lends_to_trainer(&self) -> bool {
        self.to_trainer.is_some()
    }

    /// Where the lend of the trainer's devices stands, for feeding the engines.
    pub(super) fn view(&self) -> LendView {
        self.to_rollout.as_ref().map(lend::Lending::view).unwrap_or_default()
    }

    /// Setup, before the engines start: the reverse lend's lent trainers start and sleep.
    pub(super) fn before_engines(&mut self, cx: &mut Cx, max_batch: usize) -> R<()> {
        self.to_trainer.as_mut().map_or(Ok(()), |l| l.setup(cx, max_batch))
    }

    /// Setup, once the engines started: the lent engines sleep before the trainers start on
    /// their devices.
    pub(super) fn engines_started(&mut self, cx: &mut Cx) -> R<()> {
        self.to_rollout.as_mut().map_or(Ok(()), |l| l.offload(cx))
    }

    /// Setup, before the initial weights reach the engines: one reverse lend and its reclaim
    /// measure that switch.
    pub(super) fn before_initial_weights(&mut self, cx: &mut Cx) -> R<()> {
        self.to_trainer.as_mut().map_or(Ok(()), |l| l.calibrate(cx))
    }

    /// Setup, once the engines hold the initial weights: one lend and its reclaim measure that
    /// switch.
    pub(super) fn after_initial_weights(&mut self, cx: &mut Cx) -> R<()> {
        self.to_rollout.as_mut().map_or(Ok(()), |l| l.calibrate(cx))
    }

    /// The trainer has waited for a batch since `idle_since`, `unpublished` steps after the last
    /// update: its devices may be lent.
    pub(super) fn trainer_waiting(&mut self, cx: &mut Cx, idle_since: Option<Instant>, unpublished: u64) -> R<()> {
        self.to_rollout.as_mut().map_or(Ok(()), |l| l.consider(cx, idle_since, unpublished))
    }

    /// The trainer's next batch from the queue: a lend under way is reclaimed first (the batch
    /// waits for it), and a lent engine stuck on the oldest group is retired.
    pub(super) fn next_batch(&mut self, cx: &mut Cx) -> R<Option<Vec<Group>>> {
        match self.to_rollout.as_mut() {
            Some(l) => l.next_batch(cx),
            None => Ok(cx.roll.take_batch(&cx.rig.cfg)),
        }
    }

    /// When the driver must look again even if no worker answers (a lend or reclaim due).
    pub(super) fn deadline(&self, rig: &Rig, roll: &Rollouter, trainer_idle_since: Option<Instant>) -> Option<Instant> {
        self.to_rollout.as_ref()?.deadline(rig, roll, trainer_idle_since)
    }

    /// A segment came in: what it finished counts for the lend's figures and completion rate.
    pub(super) fn segment_taken(&mut self, finished: &Finished) {
        if let Some(l) = self.to_rollout.as_mut() {
            l.groups_finished(finished);
        }
    }

    /// A train stage is about to go out (`publishes`: the step ends with an update): the
    /// engines' devices may be lent to it. Returns the lent trainers that join it.
    pub(super) fn train_stage(&mut self, cx: &mut Cx, publishes: bool) -> R<Vec<usize>> {
        let view = self.view();
        let Some(l) = self.to_trainer.as_mut() else { return Ok(Vec::new()) };
        l.consider(cx, publishes, view)?;
        Ok(l.lent_trainers())
    }

    /// A train stage ended after `seconds` with `replicas` trainers: the engines get their
    /// devices back before the update.
    pub(super) fn train_stage_done(&mut self, cx: &mut Cx, seconds: f64, replicas: usize) -> R<()> {
        let Some(l) = self.to_trainer.as_mut() else { return Ok(()) };
        l.train_stage_done(cx.rig, seconds, replicas);
        l.reclaim(cx)
    }

    /// A step's window closed with `lent_idle_s` of lent engines' idle time.
    pub(super) fn window_closed(&mut self, lent_idle_s: f64) {
        if let Some(l) = self.to_rollout.as_mut() {
            l.add_lent_idle(lent_idle_s);
        }
    }

    /// The step's lending figures, both directions; `rollout_idle`: the engines' idle seconds
    /// this window.
    pub(super) fn row(
        &self,
        cfg: &Config,
        accounts: &Accounts,
        row: &mut Row,
        wall: f64,
        rollout_idle: f64,
        own: usize,
    ) {
        if let Some(l) = self.to_rollout.as_ref() {
            l.row(cfg, &accounts.window, row, wall);
        }
        if self.to_trainer.is_some() {
            reverse::row(&accounts.window, row, wall, rollout_idle, own);
        }
    }

    /// The summary's `elastic` block (None in async mode). `trainer_idle_s`: the trainer's
    /// waits; `flush_s`: the updates' flushes; `rollout_idle_s`: the engines' idle time.
    pub(super) fn summary(
        &self,
        cfg: &Config,
        wall: f64,
        accounts: &Accounts,
        own_engines: usize,
    ) -> Option<ElasticSummary> {
        let t = &accounts.totals;
        let l = self.to_rollout.as_ref()?;
        Some(ElasticSummary {
            rollout_lend: self.to_trainer.as_ref().map(|r| r.summary(wall, t.rollout_idle_s, own_engines)),
            ..l.summary(cfg, wall, t.trainer_idle_s, t.flush_total_s)
        })
    }
}
