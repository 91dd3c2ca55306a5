//! elastic.lend_rollout: the reverse of lend.rs, for a trainer-bound job. Beside every rollout
//! engine a lent trainer sleeps; at a step's train stage, when the engines have nothing they may
//! start (the queue holds the next batch and is at its capacity) and the stage's expected saving
//! exceeds the measured switch, the engines sleep, the lent trainers wake and load the trainer's
//! state (a file in the run directory, through the host, as a checkpoint), and the train request
//! goes to every trainer and lent trainer, each paced at its share of the batch. Once the stage is
//! done the lent trainers must hold the trainers' weights; they sleep, the engines wake, and the
//! weight update that follows every such step refills the engines' weights, checked on each.
//!
//! Why only on a step that publishes: the built-in engine allocates without a host backup (as
//! vLLM's sleep level 2 discards its weights), so what it held is not kept across the sleep, and
//! only the update that follows gives it weights again. Its queue being full, it would not have
//! generated anything during the step.

use super::super::Async;
use super::super::accounts::Window;
use super::super::engine::State;
use crate::run::fleet::Fleet;
use crate::run::handover::{self, Handover, Sleep, Wake};
use crate::run::metrics::Row;
use crate::run::protocol::{ExportState, ImportState, Init, StateFile};
use crate::run::recorder::Recorder;
use crate::run::summary::RolloutLendSummary;
use crate::run::{FailKind, NCCL_TAG, R, Role, RunError, weights};
use serde_json::{Value, json};
use std::time::Instant;

#[derive(Default)]
struct Stats {
    lends: u64,
    skipped: u64,
    lend_s: f64,
    reclaim_s: f64,
    /// Seconds the engines' devices trained, each lent device counted.
    lent_device_s: f64,
    saver_s: f64,
    state_bytes: u64,
}

/// What a lend leaves for its reclaim.
struct Lent {
    /// When the lent trainers were ready.
    since: Instant,
    /// Whether the engines' communicators were suspended.
    comms: bool,
    /// Each engine's tagged memory when it went to sleep.
    engines_held: Vec<(String, Held)>,
}

/// A worker's tagged device memory (communicators left out): per tag, its allocations and bytes.
type Held = Vec<(String, u64, u64)>;

pub(in crate::run::asynchronous) struct RolloutLending {
    /// (lent trainer, engine) fleet indices, one pair per rollout device.
    pairs: Vec<(usize, usize)>,
    lent: Option<Lent>,
    switch_s: Option<f64>,
    calibration_s: Option<f64>,
    last_lend_s: f64,
    /// The last train stage's seconds as the trainers alone would have taken it.
    last_train_s: Option<f64>,
    stats: Stats,
}

impl RolloutLending {
    pub(in crate::run::asynchronous) fn new(fleet: &Fleet) -> RolloutLending {
        RolloutLending::of_pairs(fleet.paired_by_device(&fleet.lent_trainers(), &fleet.indices(Role::Rollout)))
    }

    fn of_pairs(pairs: Vec<(usize, usize)>) -> RolloutLending {
        RolloutLending {
            pairs,
            lent: None,
            switch_s: None,
            calibration_s: None,
            last_lend_s: 0.0,
            last_train_s: None,
            stats: Stats::default(),
        }
    }

    pub(in crate::run::asynchronous) fn lent(&self) -> bool {
        self.lent.is_some()
    }

    /// The lent trainers while lent (none otherwise).
    pub(in crate::run::asynchronous) fn lent_trainers(&self) -> Vec<usize> {
        if self.lent() { self.pairs.iter().map(|p| p.0).collect() } else { Vec::new() }
    }

    /// What a lend would save of a train stage of `train_s` seconds with `own` trainers.
    fn gain(&self, train_s: f64, own: usize) -> f64 {
        let own = own as f64;
        train_s * (1.0 - own / (own + self.pairs.len() as f64))
    }

    /// The summary's `rollout_lend` block (inside `elastic`); `rollout_idle_s`: the engines'
    /// idle time, all of them, lent time included; `engines`: how many.
    pub(in crate::run::asynchronous) fn summary(
        &self,
        wall: f64,
        rollout_idle_s: f64,
        engines: usize,
    ) -> RolloutLendSummary {
        let s = &self.stats;
        let per = |x: f64| (s.lends > 0).then(|| x / s.lends as f64);
        let ratio = |x: f64| if wall > 0.0 { x / (wall * engines.max(1) as f64) } else { 0.0 };
        RolloutLendSummary {
            lends: s.lends,
            lends_skipped: s.skipped,
            calibration_switch_s: self.calibration_s,
            switch_s: self.switch_s,
            lend_s_mean: per(s.lend_s),
            reclaim_s_mean: per(s.reclaim_s),
            switch_saver_s_mean: per(s.saver_s),
            state_bytes_mean: (s.lends > 0).then(|| s.state_bytes / s.lends),
            lent_device_s: s.lent_device_s,
            rollout_idle_ratio_unlent: ratio(rollout_idle_s),
            rollout_device_idle_ratio: ratio((rollout_idle_s - s.lent_device_s).max(0.0)),
        }
    }
}

impl Async {
    fn rl(&mut self) -> &mut RolloutLending {
        self.rollout_lending.as_mut().expect("elastic.lend_rollout")
    }

    /// Setup, before the engines start: the lent trainers initialise as trainers on the engines'
    /// devices (no data-parallel group: each computes the whole update, as a replica) and sleep,
    /// every tag paused; from here on a device's engine and lent trainer never both hold memory.
    pub(in crate::run::asynchronous) fn lent_trainers_setup(&mut self, max_batch: usize) -> R<()> {
        let lent = self.rig.fleet.lent_trainers();
        let span = self.rig.rec.begin("init_lent_trainer");
        let like = self.rig.init_params(Role::Trainer, max_batch).swap_remove(0);
        let device = |i: usize| self.rig.fleet.worker(i).device;
        let params = lent.iter().map(|&i| crate::run::protocol::InitParams {
            device: device(i),
            trainer_group: None,
            ..like.clone()
        });
        let params = params.collect();
        self.rig.fleet.call_each::<Init>(&lent, params)?;
        self.rig.fleet.find_control_sockets_of(&lent)?;
        self.rig.rec.end(span, &self.rig.fleet)?;
        let span = self.rig.rec.begin("lent_trainer_offload");
        handover::pause(&mut self.rig.fleet, &mut self.rig.rec, &lent, None)?;
        self.rig.rec.end(span, &self.rig.fleet)?;
        let pairs = self.rl().pairs.clone();
        let name = |i: usize| self.rig.fleet.worker(i).name.clone();
        let shared = pairs.into_iter().map(|(t, e)| (name(t), name(e))).collect();
        self.rig.rec.add_shared_devices(shared);
        Ok(())
    }

    /// Setup, before the initial weights reach the engines: one lend and its reclaim prove the
    /// path and measure the switch the decision weighs a step's saving against.
    pub(in crate::run::asynchronous) fn calibrate_rollout_lend(&mut self) -> R<()> {
        let lend = self.lend_rollout(json!({"reason": "calibration: one lend and reclaim measure the switch"}));
        lend.map_err(cannot_transfer_state)?;
        self.reclaim_rollout()?;
        let l = self.rl();
        l.calibration_s = l.switch_s;
        l.stats = Stats::default();
        Ok(())
    }

    /// Whether the engines could use their devices during the coming train stage: any request
    /// or unfinished group, any group they may start; None: they could not (the reason to lend).
    fn engines_busy(&self) -> Option<String> {
        let own = self.engines.iter().filter(|e| !e.lent);
        if own.clone().any(|e| e.generating() || !e.groups.is_empty()) || !self.orphans.is_empty() {
            return Some("the engines are generating".into());
        }
        if self.fresh_groups_for(0, false) > 0 {
            return Some("the engines may start new groups (the queue has room)".into());
        }
        let (queued, batch) = (self.queue.len(), self.rig.cfg.rollout.prompts_per_step);
        (queued < batch).then(|| format!("the queue holds {queued} of the next batch's {batch} groups"))
    }

    /// At a step's train stage (`publishes`: the step ends with a weight update): lend the
    /// engines' devices to the trainer when the engines have nothing they may do, and the saving
    /// expected from the last train stage exceeds the measured switch. Logs the decision.
    pub(in crate::run::asynchronous) fn consider_lending_rollout(&mut self, publishes: bool) -> R<()> {
        let Some(l) = self.rollout_lending.as_ref() else { return Ok(()) };
        let own = self.rig.fleet.indices(Role::Trainer).len();
        let switch = l.switch_s.unwrap_or(f64::INFINITY);
        let gain = l.last_train_s.map(|t| l.gain(t, own));
        let why_not = if !publishes {
            Some("the step does not end with a weight update, which the engines need after their sleep".into())
        } else if let Some(busy) = self.engines_busy() {
            Some(busy)
        } else {
            match gain {
                None => Some("no train stage measured yet".into()),
                Some(g) if g <= switch => {
                    Some(format!("the expected saving ({g:.3} s) does not exceed the switch ({switch:.3} s)"))
                }
                Some(_) => None,
            }
        };
        let figures = json!({"expected_gain_s": gain, "switch_s": l.switch_s, "last_train_s": l.last_train_s});
        let Some(reason) = why_not else {
            let why = format!(
                "the engines have nothing they may start and the queue holds the next batch; the expected saving \
                 ({:.3} s) exceeds the switch ({switch:.3} s)",
                gain.unwrap_or(0.0)
            );
            let mut d = json!({"reason": why});
            d.as_object_mut().expect("object").extend(figures.as_object().expect("object").clone());
            return self.lend_rollout(d);
        };
        self.rl().stats.skipped += 1;
        let mut d = json!({"action": "skip_rollout", "reason": reason});
        d.as_object_mut().expect("object").extend(figures.as_object().expect("object").clone());
        self.rig.rec.log_decision(d);
        Ok(())
    }

    /// The engines sleep (every tag, their communicators suspended as a trainer's are when it
    /// lends), the lent trainers wake and load the trainer's state, checked against the trainers'
    /// weights checksum.
    fn lend_rollout(&mut self, why: Value) -> R<()> {
        let t0 = Instant::now();
        let span = self.rig.rec.begin("lend_rollout");
        let pairs = self.rl().pairs.clone();
        let (lent, engines): (Vec<usize>, Vec<usize>) = pairs.into_iter().unzip();
        let trainer = self.rig.fleet.indices(Role::Trainer)[0];
        let sum = weights::trainer_checksum(&mut self.rig.fleet, &self.rig.at)?;
        let file = StateFile { path: self.rig.rec.run_dir().join("trainer-state.bin"), step: self.step() };
        self.rig.fleet.call_each::<ExportState>(&[trainer], vec![file.clone()])?;
        let state_bytes = std::fs::metadata(&file.path).map(|m| m.len()).unwrap_or(0);
        let engines_held = self.held(&engines)?;
        let import = |f: &mut Fleet, _: &mut Recorder| {
            let loaded = f.call_each::<ImportState>(&lent, vec![file.clone(); lent.len()]);
            let _ = std::fs::remove_file(&file.path);
            loaded.map(drop)
        };
        let handed = Handover {
            from: &engines,
            sleep: Sleep { save_state: false, suspend_comms: self.rig.cfg.memory.suspend_communicators },
            to: &lent,
            wake: Wake::Whole { comms: false, load_state: false },
            expect: Some((&sum, "on the lent trainers after they loaded the trainer's state")),
            phases: None,
        }
        .run(&mut self.rig.fleet, &mut self.rig.rec, import)?;
        let (comms, saver) = (handed.comms_suspended, handed.saver_s);
        self.rig.rec.end(span, &self.rig.fleet)?;
        for e in self.engines.iter_mut().filter(|e| !e.lent) {
            e.state = State::Asleep;
        }
        let seconds = t0.elapsed().as_secs_f64();
        self.accounts.rollout_lent(seconds);
        let l = self.rl();
        l.lent = Some(Lent { since: Instant::now(), comms, engines_held });
        l.last_lend_s = seconds;
        (l.stats.lends, l.stats.lend_s, l.stats.saver_s) =
            (l.stats.lends + 1, l.stats.lend_s + seconds, l.stats.saver_s + saver);
        l.stats.state_bytes += state_bytes;
        let mut d = json!({"action": "lend_rollout", "seconds": seconds, "state_bytes": state_bytes, "lent_trainers": lent.len()});
        if let (Some(d), Value::Object(w)) = (d.as_object_mut(), why) {
            d.extend(w);
        }
        self.rig.rec.log_decision(d);
        Ok(())
    }

    /// The train stage is done: the lent trainers must hold the trainers' weights; they sleep and
    /// the engines wake, before the weight update reaches them.
    pub(in crate::run::asynchronous) fn reclaim_rollout(&mut self) -> R<()> {
        let Some(Lent { since, comms, engines_held }) = self.rollout_lending.as_mut().and_then(|l| l.lent.take())
        else {
            return Ok(());
        };
        let lent_s = since.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let span = self.rig.rec.begin("reclaim_rollout");
        let pairs = self.rl().pairs.clone();
        let (lent, engines): (Vec<usize>, Vec<usize>) = pairs.into_iter().unzip();
        let sum = weights::trainer_checksum(&mut self.rig.fleet, &self.rig.at)?;
        let after_step = "on the lent trainers after the step (their update must equal the trainers')";
        handover::expect_weights(&mut self.rig.fleet, &mut self.rig.rec, &lent, &sum, after_step)?;
        let handed = Handover {
            from: &lent,
            sleep: Sleep::default(),
            to: &engines,
            wake: Wake::Whole { comms, load_state: false },
            expect: None,
            phases: None,
        }
        .run(&mut self.rig.fleet, &mut self.rig.rec, |_, _| Ok(()))?;
        let saver = handed.saver_s;
        self.expect_held(&engines, &engines_held)?;
        self.rig.rec.end(span, &self.rig.fleet)?;
        for e in self.engines.iter_mut().filter(|e| !e.lent) {
            e.state = State::Awake;
        }
        let seconds = t0.elapsed().as_secs_f64();
        let devices = lent.len() as f64;
        self.accounts.rollout_reclaimed(seconds, lent_s * devices);
        let l = self.rl();
        l.stats.reclaim_s += seconds;
        l.stats.saver_s += saver;
        l.stats.lent_device_s += lent_s * devices;
        l.switch_s = Some(l.last_lend_s + seconds);
        self.rig.rec.log_decision(json!({
            "action": "reclaim_rollout",
            "reason": "the train stage is done: the engines get their devices back before the weight update",
            "seconds": seconds, "lent_s": lent_s,
        }));
        Ok(())
    }

    /// The tagged device memory of each of `targets`, from its control socket.
    fn held(&self, targets: &[usize]) -> R<Vec<(String, Held)>> {
        let names: Vec<&str> = targets.iter().map(|&i| self.rig.fleet.worker(i).name.as_str()).collect();
        let statuses = self.rig.fleet.statuses()?;
        let held = |s: &tms_proto::Status| -> Held {
            let tags = s.tags.iter().filter(|t| t.tag != NCCL_TAG);
            tags.map(|t| (t.tag.clone(), t.allocations_active, t.bytes_active)).collect()
        };
        let ours = statuses.into_iter().filter(|w| names.contains(&w.name.as_str()));
        Ok(ours.map(|w| (w.name, held(&w.status))).collect())
    }

    /// The engines woke with every allocation and byte of device memory they slept with. (Their
    /// contents are the update's to check: the built-in engine keeps no host backup.)
    fn expect_held(&mut self, engines: &[usize], before: &[(String, Held)]) -> R<()> {
        if !self.rig.rec.checks_enabled() {
            return Ok(());
        }
        for ((name, now), (_, then)) in self.held(engines)?.into_iter().zip(before) {
            if now != *then {
                let cause = format!(
                    "{name} woke from the reverse lend holding {now:?} (tag, allocations, bytes), not the {then:?} it \
                     slept with"
                );
                return Err(self.fail(crate::run::FailKind::Check, Some(&name), cause));
            }
            self.rig.rec.count_check();
        }
        Ok(())
    }

    /// A train stage ended after `seconds` with `replicas` trainers sharing it: what the
    /// trainers alone would have taken, for the next decision.
    pub(in crate::run::asynchronous) fn train_stage_done(&mut self, seconds: f64, replicas: usize) {
        let own = self.rig.fleet.indices(Role::Trainer).len().max(1);
        if let Some(l) = self.rollout_lending.as_mut() {
            l.last_train_s = Some(seconds * replicas as f64 / own as f64);
        }
    }

    /// The step's reverse-lending figures; `rollout_idle`: the engines' idle seconds this
    /// window, all of them, lent time included.
    pub(in crate::run::asynchronous) fn rollout_lending_row(&self, row: &mut Row, wall: f64, rollout_idle: f64) {
        let w: &Window = &self.accounts.window;
        row.set("elastic/rollout_lends", w.rollout_lends as f64);
        row.set("elastic/rollout_lent_time", w.rollout_lent_s);
        row.set("elastic/rollout_switch_time", w.rollout_switch_s);
        if wall > 0.0 {
            let idle = (rollout_idle - w.rollout_lent_s).max(0.0);
            row.set("elastic/rollout_device_idle_ratio", idle / (wall * self.own_engines() as f64));
        }
    }
}

/// A trainer that does not answer export_state or import_state (an external one that predates
/// them, or one that refuses, as scripts/torch_worker.py does in a data-parallel group) fails the
/// first lend, at setup: a configuration this run cannot serve, said with the key to change.
fn cannot_transfer_state(mut e: RunError) -> RunError {
    let refused = ["\"unknown_method\"", "\"unsupported\""].iter().any(|k| e.cause.contains(k));
    let state_method = e.cause.starts_with("export_state failed") || e.cause.starts_with("import_state failed");
    if refused && state_method {
        e.kind = FailKind::Config;
        e.cause = format!(
            "elastic.lend_rollout = true needs every trainer to answer export_state and import_state \
             (docs/worker-protocol.md), and {} did not: {}; use a trainer that does (the built-in one, \
             scripts/torch_worker.py with one trainer device), or elastic.lend_rollout = false",
            e.worker.as_deref().unwrap_or("a trainer"),
            e.cause
        );
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lending(lent: usize) -> RolloutLending {
        RolloutLending::of_pairs((0..lent).map(|i| (10 + i, i)).collect())
    }

    #[test]
    fn the_saving_is_the_share_the_lent_trainers_take_off_the_stage() {
        assert_eq!(lending(1).gain(10.0, 1), 5.0, "one trainer, one lent: half the stage");
        assert!((lending(2).gain(9.0, 1) - 6.0).abs() < 1e-12, "one trainer, two lent: two thirds");
        assert!((lending(2).gain(8.0, 2) - 4.0).abs() < 1e-12);
        assert_eq!(lending(0).gain(8.0, 2), 0.0, "nothing lent, nothing saved");
    }
}
