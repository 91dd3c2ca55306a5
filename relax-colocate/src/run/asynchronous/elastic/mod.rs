//! Elastic mode's room: lending a device to the other side while its own side has nothing to do,
//! in either direction. lend.rs lends a waiting trainer's devices to the rollout (a lent engine
//! on each); reverse.rs, with elastic.lend_rollout, lends the engines' devices to a trainer-bound
//! step's train stage (a lent trainer on each). The async driver takes no lending decision
//! itself: at each of its events it calls one of the hooks here, which do nothing outside
//! elastic mode.

pub(super) mod lend;
pub(super) mod reverse;

use super::Async;
use super::queue::Group;
use crate::run::R;
use crate::run::metrics::Row;
use std::time::Instant;

impl Async {
    /// Setup, before the engines start: the reverse lend's lent trainers start and sleep.
    pub(super) fn elastic_before_engines(&mut self, max_batch: usize) -> R<()> {
        if self.rollout_lending.is_none() {
            return Ok(());
        }
        self.lent_trainers_setup(max_batch)
    }

    /// Setup, once the engines started: the lent engines sleep before the trainers start on
    /// their devices.
    pub(super) fn elastic_engines_started(&mut self) -> R<()> {
        if self.lending.is_none() {
            return Ok(());
        }
        self.lent_offload()
    }

    /// Setup, before the initial weights reach the engines: one reverse lend and its reclaim
    /// measure that switch.
    pub(super) fn elastic_before_initial_weights(&mut self) -> R<()> {
        if self.rollout_lending.is_none() {
            return Ok(());
        }
        self.calibrate_rollout_lend()
    }

    /// Setup, once the engines hold the initial weights: one lend and its reclaim measure that
    /// switch.
    pub(super) fn elastic_after_initial_weights(&mut self) -> R<()> {
        if self.lending.is_none() {
            return Ok(());
        }
        self.calibrate()
    }

    /// The trainer has waited for a batch since `idle_since`, `unpublished` steps after the last
    /// update: its devices may be lent.
    pub(super) fn elastic_trainer_waiting(&mut self, idle_since: Option<Instant>, unpublished: u64) -> R<()> {
        self.consider_lending(idle_since, unpublished)
    }

    /// The trainer's next batch: a lend under way is reclaimed first (the batch waits for it),
    /// and a lent engine stuck on the oldest group is retired. `take`: the queue's batch, if any.
    pub(super) fn elastic_next_batch(
        &mut self,
        take: impl FnOnce(&mut Async) -> Option<Vec<Group>>,
    ) -> R<Option<Vec<Group>>> {
        if self.lending.as_ref().is_some_and(lend::Lending::reclaiming) {
            return self.try_reclaim();
        }
        self.retire_stuck()?;
        match take(self) {
            Some(b) if self.lending.as_ref().is_some_and(lend::Lending::lent) => {
                self.begin_reclaim(b);
                self.try_reclaim()
            }
            b => Ok(b),
        }
    }

    /// When the driver must look again even if no worker answers (a lend or reclaim due).
    pub(super) fn elastic_deadline(&self, trainer_idle_since: Option<Instant>) -> Option<Instant> {
        self.lending_deadline(trainer_idle_since)
    }

    /// A train stage is about to go out (`publishes`: the step ends with an update): the
    /// engines' devices may be lent to it. Returns the lent trainers that join it.
    pub(super) fn elastic_train_stage(&mut self, publishes: bool) -> R<Vec<usize>> {
        if self.rollout_lending.is_none() {
            return Ok(Vec::new());
        }
        self.consider_lending_rollout(publishes)?;
        Ok(self.rollout_lending.as_ref().map(|l| l.lent_trainers()).unwrap_or_default())
    }

    /// A train stage ended after `seconds` with `replicas` trainers: the engines get their
    /// devices back before the update.
    pub(super) fn elastic_train_stage_done(&mut self, seconds: f64, replicas: usize) -> R<()> {
        if self.rollout_lending.is_none() {
            return Ok(());
        }
        self.train_stage_done(seconds, replicas);
        self.reclaim_rollout()
    }

    /// The step's lending figures, both directions; `rollout_idle`: the engines' idle seconds
    /// this window.
    pub(super) fn elastic_row(&self, row: &mut Row, wall: f64, rollout_idle: f64) {
        if self.lending.is_some() {
            self.lending_row(row, wall);
        }
        if self.rollout_lending.is_some() {
            self.rollout_lending_row(row, wall, rollout_idle);
        }
    }
}
