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

use super::super::accounts::Window;
use super::super::rollouter::LendView;
use super::{Cx, Direction, Lend};
use crate::run::clock::Instant;
use crate::run::fleet::Fleet;
use crate::run::handover::{self, Handover, Sleep, Wake};
use crate::run::metrics::Row;
use crate::run::protocol::{ExportState, ImportState, Init, StateFile};
use crate::run::recorder::Recorder;
use crate::run::rig::Rig;
use crate::run::summary::RolloutLendSummary;
use crate::run::{FailKind, NCCL_TAG, R, Role, RunError, weights};
use serde_json::{Value, json};

/// What this direction counts beyond `Lend`'s counts.
#[derive(Default)]
struct Stats {
    /// Seconds the engines' devices trained, each lent device counted.
    lent_device_s: f64,
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
    /// The pairs are (lent trainer, engine).
    lend: Lend,
    lent: Option<Lent>,
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
            lend: Lend::new(Direction::ToTrainer, pairs),
            lent: None,
            last_train_s: None,
            stats: Stats::default(),
        }
    }

    /// The lent trainers while lent (none otherwise).
    pub(in crate::run::asynchronous) fn lent_trainers(&self) -> Vec<usize> {
        if self.lent.is_some() { self.lend.pairs.iter().map(|p| p.0).collect() } else { Vec::new() }
    }

    /// What a lend would save of a train stage of `train_s` seconds with `own` trainers.
    fn gain(&self, train_s: f64, own: usize) -> f64 {
        let own = own as f64;
        train_s * (1.0 - own / (own + self.lend.pairs.len() as f64))
    }

    /// The summary's `rollout_lend` block (inside `elastic`); `rollout_idle_s`: the engines'
    /// idle time, all of them, lent time included; `engines`: how many.
    pub(in crate::run::asynchronous) fn summary(
        &self,
        wall: f64,
        rollout_idle_s: f64,
        engines: usize,
    ) -> RolloutLendSummary {
        let (l, s) = (&self.lend, &self.stats);
        let (lend_s_mean, reclaim_s_mean, switch_saver_s_mean) = l.means();
        let ratio = |x: f64| if wall > 0.0 { x / (wall * engines.max(1) as f64) } else { 0.0 };
        RolloutLendSummary {
            lends: l.counts.lends,
            lends_skipped: l.counts.skipped,
            calibration_switch_s: l.calibration_s,
            switch_s: l.switch_s,
            lend_s_mean,
            reclaim_s_mean,
            switch_saver_s_mean,
            state_bytes_mean: (l.counts.lends > 0).then(|| s.state_bytes / l.counts.lends),
            lent_device_s: s.lent_device_s,
            rollout_idle_ratio_unlent: ratio(rollout_idle_s),
            rollout_device_idle_ratio: ratio((rollout_idle_s - s.lent_device_s).max(0.0)),
        }
    }

    /// Setup, before the engines start: the lent trainers initialise as trainers on the engines'
    /// devices (no data-parallel group: each computes the whole update, as a replica) and sleep,
    /// every tag paused; from here on a device's engine and lent trainer never both hold memory.
    pub(in crate::run::asynchronous) fn setup(&mut self, cx: &mut Cx, max_batch: usize) -> R<()> {
        let rig = &mut *cx.rig;
        let lent = rig.fleet.lent_trainers();
        let span = rig.rec.begin("init_lent_trainer");
        let like = rig.init_params(Role::Trainer, max_batch).swap_remove(0);
        let device = |i: usize| rig.fleet.worker(i).device;
        let params = lent.iter().map(|&i| crate::run::protocol::InitParams {
            device: device(i),
            trainer_group: None,
            ..like.clone()
        });
        let params = params.collect();
        rig.fleet.call_each::<Init>(&lent, params)?;
        rig.fleet.find_control_sockets_of(&lent)?;
        rig.rec.end(span, &rig.fleet)?;
        let span = rig.rec.begin("lent_trainer_offload");
        handover::pause(&mut rig.fleet, &mut rig.rec, &lent, None)?;
        rig.rec.end(span, &rig.fleet)?;
        let name = |i: usize| rig.fleet.worker(i).name.clone();
        let shared = self.lend.pairs.iter().map(|&(t, e)| (name(t), name(e))).collect();
        rig.rec.add_shared_devices(shared);
        Ok(())
    }

    /// Setup, before the initial weights reach the engines: one lend and its reclaim prove the
    /// path and measure the switch the decision weighs a step's saving against.
    pub(in crate::run::asynchronous) fn calibrate(&mut self, cx: &mut Cx) -> R<()> {
        let why = json!({"reason": "calibration: one lend and reclaim measure the switch"});
        self.lend_devices(cx, why).map_err(cannot_transfer_state)?;
        self.reclaim(cx)?;
        self.lend.calibrated();
        self.stats = Stats::default();
        Ok(())
    }

    /// Whether the engines could use their devices during the coming train stage: any request
    /// or unfinished group, any group they may start; None: they could not (the reason to lend).
    fn engines_busy(cx: &Cx, lend: LendView) -> Option<String> {
        if cx.roll.own_busy() {
            return Some("the engines are generating".into());
        }
        if cx.roll.fresh_groups_for(cx.rig, 0, false, lend) > 0 {
            return Some("the engines may start new groups (the queue has room)".into());
        }
        let (queued, batch) = (cx.roll.queue().len(), cx.rig.cfg.rollout.prompts_per_step);
        (queued < batch).then(|| format!("the queue holds {queued} of the next batch's {batch} groups"))
    }

    /// At a step's train stage (`publishes`: the step ends with a weight update): lend the
    /// engines' devices to the trainer when the engines have nothing they may do, and the saving
    /// expected from the last train stage exceeds the measured switch. Logs the decision.
    /// `lend`: where the other direction's lend stands.
    pub(in crate::run::asynchronous) fn consider(&mut self, cx: &mut Cx, publishes: bool, lend: LendView) -> R<()> {
        let own = cx.rig.fleet.indices(Role::Trainer).len();
        let switch = self.lend.switch_s.unwrap_or(f64::INFINITY);
        let gain = self.last_train_s.map(|t| self.gain(t, own));
        let why_not = if !publishes {
            Some("the step does not end with a weight update, which the engines need after their sleep".into())
        } else if let Some(busy) = RolloutLending::engines_busy(cx, lend) {
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
        let figures =
            json!({"expected_gain_s": gain, "switch_s": self.lend.switch_s, "last_train_s": self.last_train_s});
        let Some(reason) = why_not else {
            let why = format!(
                "the engines have nothing they may start and the queue holds the next batch; the expected saving \
                 ({:.3} s) exceeds the switch ({switch:.3} s)",
                gain.unwrap_or(0.0)
            );
            let mut d = json!({"reason": why});
            d.as_object_mut().expect("object").extend(figures.as_object().expect("object").clone());
            return self.lend_devices(cx, d);
        };
        let mut d = json!({"reason": reason});
        d.as_object_mut().expect("object").extend(figures.as_object().expect("object").clone());
        self.lend.skip(cx.rig, d);
        Ok(())
    }

    /// The engines sleep (every tag, their communicators suspended as a trainer's are when it
    /// lends), the lent trainers wake and load the trainer's state, checked against the trainers'
    /// weights checksum.
    fn lend_devices(&mut self, cx: &mut Cx, why: Value) -> R<()> {
        let t0 = Instant::now();
        let rig = &mut *cx.rig;
        let span = rig.rec.begin(self.lend.lend_phase());
        let (lent, engines): (Vec<usize>, Vec<usize>) = self.lend.pairs.iter().copied().unzip();
        let trainer = rig.fleet.indices(Role::Trainer)[0];
        let sum = weights::trainer_checksum(&mut rig.fleet, &rig.at)?;
        let file = StateFile { path: rig.rec.run_dir().join("trainer-state.bin"), step: rig.at.step() };
        rig.fleet.call_each::<ExportState>(&[trainer], vec![file.clone()])?;
        let state_bytes = std::fs::metadata(&file.path).map(|m| m.len()).unwrap_or(0);
        let engines_held = held(rig, &engines)?;
        let import = |f: &mut Fleet, _: &mut Recorder| {
            let loaded = f.call_each::<ImportState>(&lent, vec![file.clone(); lent.len()]);
            let _ = std::fs::remove_file(&file.path);
            loaded.map(drop)
        };
        let handed = Handover {
            from: &engines,
            sleep: Sleep { save_state: false, suspend_comms: rig.cfg.memory.suspend_communicators },
            to: &lent,
            wake: Wake::Whole { comms: false, load_state: false },
            expect: Some((&sum, "on the lent trainers after they loaded the trainer's state")),
            phases: None,
            model: rig.switch.as_deref(),
        }
        .run(&mut rig.fleet, &mut rig.rec, import)?;
        rig.rec.end(span, &rig.fleet)?;
        cx.roll.set_own_awake(false);
        let seconds = t0.elapsed().as_secs_f64();
        cx.accounts.rollout_lent(seconds);
        self.lent = Some(Lent { since: Instant::now(), comms: handed.comms_suspended, engines_held });
        self.lend.lent(seconds, handed.saver_s);
        self.stats.state_bytes += state_bytes;
        let mut what = json!({"seconds": seconds, "state_bytes": state_bytes, "lent_trainers": lent.len()});
        if let (Some(d), Value::Object(w)) = (what.as_object_mut(), why) {
            d.extend(w);
        }
        self.lend.log(rig, self.lend.lend_phase(), what);
        Ok(())
    }

    /// The train stage is done: the lent trainers must hold the trainers' weights; they sleep and
    /// the engines wake, before the weight update reaches them.
    pub(in crate::run::asynchronous) fn reclaim(&mut self, cx: &mut Cx) -> R<()> {
        let Some(Lent { since, comms, engines_held }) = self.lent.take() else { return Ok(()) };
        let lent_s = since.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let rig = &mut *cx.rig;
        let span = rig.rec.begin(self.lend.reclaim_phase());
        let (lent, engines): (Vec<usize>, Vec<usize>) = self.lend.pairs.iter().copied().unzip();
        let sum = weights::trainer_checksum(&mut rig.fleet, &rig.at)?;
        let after_step = "on the lent trainers after the step (their update must equal the trainers')";
        handover::expect_weights(&mut rig.fleet, &mut rig.rec, &lent, &sum, after_step)?;
        let handed = Handover {
            from: &lent,
            sleep: Sleep::default(),
            to: &engines,
            wake: Wake::Whole { comms, load_state: false },
            expect: None,
            phases: None,
            model: rig.switch.as_deref(),
        }
        .run(&mut rig.fleet, &mut rig.rec, |_, _| Ok(()))?;
        expect_held(rig, &engines, &engines_held)?;
        rig.rec.end(span, &rig.fleet)?;
        cx.roll.set_own_awake(true);
        let seconds = t0.elapsed().as_secs_f64();
        let device_s = lent_s * lent.len() as f64;
        cx.accounts.rollout_reclaimed(seconds, device_s);
        self.lend.reclaimed(seconds, handed.saver_s);
        self.stats.lent_device_s += device_s;
        let what = json!({
            "reason": "the train stage is done: the engines get their devices back before the weight update",
            "seconds": seconds, "lent_s": lent_s,
        });
        self.lend.log(rig, self.lend.reclaim_phase(), what);
        Ok(())
    }

    /// A train stage ended after `seconds` with `replicas` trainers sharing it: what the
    /// trainers alone would have taken, for the next decision.
    pub(in crate::run::asynchronous) fn train_stage_done(&mut self, rig: &Rig, seconds: f64, replicas: usize) {
        let own = rig.fleet.indices(Role::Trainer).len().max(1);
        self.last_train_s = Some(seconds * replicas as f64 / own as f64);
    }
}

/// The tagged device memory of each of `targets`, from its control socket.
fn held(rig: &Rig, targets: &[usize]) -> R<Vec<(String, Held)>> {
    let names: Vec<&str> = targets.iter().map(|&i| rig.fleet.worker(i).name.as_str()).collect();
    let statuses = rig.fleet.statuses()?;
    let held = |s: &tms_proto::Status| -> Held {
        let tags = s.tags.iter().filter(|t| t.tag != NCCL_TAG);
        tags.map(|t| (t.tag.clone(), t.allocations_active, t.bytes_active)).collect()
    };
    let ours = statuses.into_iter().filter(|w| names.contains(&w.name.as_str()));
    Ok(ours.map(|w| (w.name, held(&w.status))).collect())
}

/// The engines woke with every allocation and byte of device memory they slept with. (Their
/// contents are the update's to check: the built-in engine keeps no host backup.)
fn expect_held(rig: &mut Rig, engines: &[usize], before: &[(String, Held)]) -> R<()> {
    if !rig.rec.checks_enabled() {
        return Ok(());
    }
    for ((name, now), (_, then)) in held(rig, engines)?.into_iter().zip(before) {
        if now != *then {
            let cause = format!(
                "{name} woke from the reverse lend holding {now:?} (tag, allocations, bytes), not the {then:?} it \
                 slept with"
            );
            return Err(rig.at.fail(FailKind::Check, Some(&name), cause));
        }
        rig.rec.count_check();
    }
    Ok(())
}

/// The step's reverse-lending figures; `rollout_idle`: the engines' idle seconds this window,
/// all of them, lent time included; `own`: the engines of their own devices.
pub(in crate::run::asynchronous) fn row(w: &Window, row: &mut Row, wall: f64, rollout_idle: f64, own: usize) {
    row.set("elastic/rollout_lends", w.rollout_lends as f64);
    row.set("elastic/rollout_lent_time", w.rollout_lent_s);
    row.set("elastic/rollout_switch_time", w.rollout_switch_s);
    if wall > 0.0 {
        let idle = (rollout_idle - w.rollout_lent_s).max(0.0);
        row.set("elastic/rollout_device_idle_ratio", idle / (wall * own as f64));
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
