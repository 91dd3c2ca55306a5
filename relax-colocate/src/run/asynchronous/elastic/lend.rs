//! Elastic mode's lending: a trainer that has waited for samples past a threshold sleeps (its
//! memory paused with its backup, through the control plane), and the lent engine on its device
//! wakes with the trainer's weights and generates; once the trainer's batch is ready the device is
//! reclaimed: the engine's memory paused, its unfinished groups left for the other engines, the
//! trainer woken with exactly the bytes it slept with. An engine that does not finish its segment
//! within `elastic.reclaim_timeout_s` is paused from outside and retired; the run goes on.
//!
//! The threshold defaults to the measured cost of a switch (a lend and its reclaim, measured once
//! at setup and after every reclaim): waiting that long before lending bounds what a lend that
//! proves too short can waste to the cost of the switch itself, as a ski-rental rule does; and a
//! lend is skipped when the groups' completion rate says the batch will be ready sooner than a
//! switch would take.

use super::super::accounts::Window;
use super::super::queue::Group;
use super::super::rollouter::{Finished, LendView, Rollouter};
use super::{Cx, Direction, Lend};
use crate::run::clock::Instant;
use crate::run::config::{Config, WeightTransport};
use crate::run::fleet::Fleet;
use crate::run::handover::{self, Handover, Sleep, Wake};
use crate::run::metrics::Row;
use crate::run::rig::Rig;
use crate::run::summary::ElasticSummary;
use crate::run::{R, Role, switch, transport, weights};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::time::Duration;

enum State {
    /// The trainers hold their devices.
    Home,
    /// The trainers sleep; the lent engines generate.
    Lent { since: Instant },
    /// The trainer's batch is ready: the lent engines finish their segments, then sleep.
    Reclaiming { since: Instant, batch: Vec<Group> },
}

/// What this direction counts beyond `Lend`'s counts.
#[derive(Default)]
struct Stats {
    lent_s: f64,
    /// Seconds the lent engines had no request while lent, all of them together.
    lent_idle_s: f64,
    forced: u64,
    retired: Vec<String>,
    lent_tokens: u64,
    lent_groups: u64,
}

pub(in crate::run::asynchronous) struct Lending {
    /// The pairs are (trainer, lent engine).
    lend: Lend,
    state: State,
    /// The trainers' weights checksum when they went to sleep.
    trainer_sum: Option<String>,
    comms_suspended: bool,
    /// When the engines of their own devices finished their last groups (the completion rate).
    finished_at: VecDeque<Instant>,
    /// The idle period whose skipped lend was logged already.
    skip_logged: Option<Instant>,
    stats: Stats,
}

impl Lending {
    pub(in crate::run::asynchronous) fn new(fleet: &Fleet) -> Lending {
        let pairs = fleet.paired_by_device(&fleet.lent_engines(), &fleet.indices(Role::Trainer));
        Lending::of_pairs(pairs.into_iter().map(|(engine, trainer)| (trainer, engine)).collect())
    }

    fn of_pairs(pairs: Vec<(usize, usize)>) -> Lending {
        Lending {
            lend: Lend::new(Direction::ToRollout, pairs),
            state: State::Home,
            trainer_sum: None,
            comms_suspended: false,
            finished_at: VecDeque::new(),
            skip_logged: None,
            stats: Stats::default(),
        }
    }

    /// Where the lend stands, as feeding the engines needs it.
    pub(in crate::run::asynchronous) fn view(&self) -> LendView {
        match &self.state {
            State::Home => LendView::default(),
            State::Lent { .. } => LendView { lent: true, ..LendView::default() },
            State::Reclaiming { batch, .. } => LendView { reclaiming: true, reclaim_batch: batch.len(), lent: false },
        }
    }

    /// Seconds the trainer waits before lending: elastic.lend_after_s, or the switch measured.
    fn threshold(&self, cfg: &Config) -> f64 {
        match cfg.elastic.lend_after_s {
            t if t > 0.0 => t,
            _ => self.lend.switch_s.unwrap_or(0.0),
        }
    }

    /// An engine's segment finished groups: a lent engine's count towards what lending gave,
    /// the others' towards the completion rate.
    pub(in crate::run::asynchronous) fn groups_finished(&mut self, f: &Finished) {
        if f.lent {
            self.stats.lent_tokens += f.tokens;
            self.stats.lent_groups += f.groups as u64;
            return;
        }
        let now = Instant::now();
        for _ in 0..f.groups {
            self.finished_at.push_back(now);
        }
        while self.finished_at.len() > 64 {
            self.finished_at.pop_front();
        }
    }

    pub(in crate::run::asynchronous) fn add_lent_idle(&mut self, seconds: f64) {
        self.stats.lent_idle_s += seconds;
    }

    /// Of `lent_idle_s` engine-seconds, what one trainer device spent lent and idle: a device per
    /// lent engine.
    fn per_device(&self, lent_idle_s: f64) -> f64 {
        lent_idle_s / self.lend.pairs.len().max(1) as f64
    }

    /// Groups per second the engines of their own devices finish, over their last groups.
    fn completion_rate(&self) -> Option<f64> {
        let (first, last) = (self.finished_at.front()?, self.finished_at.back()?);
        let span = last.duration_since(*first).as_secs_f64();
        (self.finished_at.len() >= 2 && span > 0.0).then(|| (self.finished_at.len() - 1) as f64 / span)
    }

    /// The summary's `elastic` block: what lending did and cost, and the trainer devices' idle
    /// share with and without it. `trainer_idle_s`: the trainer's waits for a batch; `flush_s`:
    /// the updates' flushes, when its devices wait for the engines' segments (never lent then).
    pub(in crate::run::asynchronous) fn summary(
        &self,
        cfg: &Config,
        wall: f64,
        trainer_idle_s: f64,
        flush_s: f64,
    ) -> ElasticSummary {
        let (l, s) = (&self.lend, &self.stats);
        let (lend_s_mean, reclaim_s_mean, switch_saver_s_mean) = l.means();
        let ratio = |x: f64| if wall > 0.0 { x / wall } else { 0.0 };
        // Waiting, less the time lent, plus the time lent with nothing to generate.
        let unlent = (trainer_idle_s - s.lent_s).max(0.0) + self.per_device(s.lent_idle_s);
        let source = if cfg.elastic.lend_after_s > 0.0 { "elastic.lend_after_s" } else { "measured switch" };
        ElasticSummary {
            lend_after_s: self.threshold(cfg),
            lend_after_s_source: source.into(),
            calibration_switch_s: l.calibration_s,
            switch_s: l.switch_s,
            reclaim_timeout_s: cfg.elastic.reclaim_timeout_s,
            lends: l.counts.lends,
            lends_skipped: l.counts.skipped,
            lend_s_mean,
            reclaim_s_mean,
            switch_saver_s_mean,
            lent_s: s.lent_s,
            lent_engine_idle_s: self.per_device(s.lent_idle_s),
            lent_tokens: s.lent_tokens,
            lent_groups: s.lent_groups,
            forced_reclaims: s.forced,
            retired_engines: s.retired.clone(),
            trainer_idle_ratio_unlent: ratio(trainer_idle_s + flush_s),
            trainer_device_idle_ratio: ratio(unlent + flush_s),
            trainer_device_idle_ratio_without_flush: ratio(unlent),
            rollout_lend: None,
        }
    }

    fn reclaim_timeout(cfg: &Config) -> Duration {
        Duration::try_from_secs_f64(cfg.elastic.reclaim_timeout_s).unwrap_or(Duration::from_secs(30))
    }

    /// Pause every tag of `targets` (free memory must rise by what was paused), the saver's time
    /// counted in the lends' switch.
    fn pause_all(&mut self, rig: &mut Rig, targets: &[usize]) -> R<()> {
        let seconds = handover::pause(&mut rig.fleet, &mut rig.rec, targets, None)?;
        self.lend.saver(seconds);
        Ok(())
    }

    /// Setup: the lent engines sleep before the trainers start on their devices; from here on the
    /// recorder checks that a device's two sides never both hold their memory.
    pub(in crate::run::asynchronous) fn offload(&mut self, cx: &mut Cx) -> R<()> {
        let rig = &mut *cx.rig;
        let span = rig.rec.begin("lent_offload");
        let engines = rig.fleet.lent_engines();
        self.pause_all(rig, &engines)?;
        rig.rec.end(span, &rig.fleet)?;
        let name = |i: usize| rig.fleet.worker(i).name.clone();
        let shared = self.lend.pairs.iter().map(|&(t, e)| (name(t), name(e))).collect();
        rig.rec.add_shared_devices(shared);
        Ok(())
    }

    /// Setup: one lend and its reclaim, which proves the path before the run depends on it and
    /// measures the switch the default threshold waits for.
    pub(in crate::run::asynchronous) fn calibrate(&mut self, cx: &mut Cx) -> R<()> {
        self.lend_devices(cx, json!({"reason": "calibration: one lend and reclaim measure the switch"}))?;
        self.state = State::Reclaiming { since: Instant::now(), batch: Vec::new() };
        self.reclaim(cx)?;
        self.lend.calibrated();
        self.stats = Stats::default();
        Ok(())
    }

    /// When the driver must look again even if no worker answers: at the end of the trainer's
    /// wait before a lend, or at the reclaim deadline.
    pub(in crate::run::asynchronous) fn deadline(
        &self,
        rig: &Rig,
        roll: &Rollouter,
        trainer_idle_since: Option<Instant>,
    ) -> Option<Instant> {
        let timeout = Lending::reclaim_timeout(&rig.cfg);
        match &self.state {
            State::Reclaiming { since, .. } => Some(*since + timeout),
            State::Home => {
                let at = trainer_idle_since? + Duration::try_from_secs_f64(self.threshold(&rig.cfg)).ok()?;
                (at > Instant::now()).then_some(at)
            }
            // The earliest moment a lent engine's segment may count as stuck.
            State::Lent { .. } => roll.lent_due(timeout),
        }
    }

    /// Seconds until the trainer's batch is ready, from the groups missing and the rate the
    /// engines of their own devices finish them (None before there is a rate).
    fn expected_wait(&self, cfg: &Config, roll: &Rollouter) -> Option<f64> {
        let rate = self.completion_rate()?;
        let missing = cfg.rollout.prompts_per_step.saturating_sub(roll.queue().len()).max(1);
        Some(missing as f64 / rate)
    }

    /// The trainer is waiting for its batch (since `idle_since`): lend its devices when it has
    /// waited past the threshold, the lent engines would have work, and the batch is not expected
    /// sooner than a switch takes. `unpublished`: the trainer's steps since the last update
    /// (async.train_iters_per_update above 1). The lent engines then get the trainer's weights,
    /// newer than the engines' by those steps, and their tokens count as the engines' version:
    /// older than they are, so the staleness bound still holds for them; the off-policy correction
    /// reads the log-probs the lent engine computed, whatever weights it had.
    pub(in crate::run::asynchronous) fn consider(
        &mut self,
        cx: &mut Cx,
        idle_since: Option<Instant>,
        unpublished: u64,
    ) -> R<()> {
        let Some(since) = idle_since else { return Ok(()) };
        if !matches!(self.state, State::Home) || cx.roll.lent_slots().is_empty() {
            return Ok(());
        }
        let idle = since.elapsed().as_secs_f64();
        let threshold = self.threshold(&cx.rig.cfg);
        // Work for the lent engines: groups to continue or to share, or room for new ones.
        let fresh = cx.roll.fresh_groups_for(cx.rig, 0, true, self.view());
        let work = cx.roll.has_orphans() || cx.roll.generating_groups() > 0 || fresh > 0;
        if idle < threshold || !work {
            return Ok(());
        }
        let switch = self.lend.switch_s.unwrap_or(0.0);
        let wait = self.expected_wait(&cx.rig.cfg, cx.roll);
        if let Some(w) = wait.filter(|w| *w < switch) {
            if self.skip_logged != Some(since) {
                self.skip_logged = Some(since);
                let why = format!("the batch is expected in {w:.3} s, sooner than a switch ({switch:.3} s)");
                self.lend.skip(cx.rig, json!({"reason": why, "idle_s": idle, "expected_wait_s": w}));
            }
            return Ok(());
        }
        let reason = format!(
            "the trainer waited {idle:.3} s, past {threshold:.3} s ({}), and its batch is {}",
            if cx.rig.cfg.elastic.lend_after_s > 0.0 { "elastic.lend_after_s" } else { "the measured switch" },
            wait.map_or_else(|| "not yet timed".into(), |w| format!("expected in {w:.3} s"))
        );
        self.lend_devices(
            cx,
            json!({
                "reason": reason,
                "idle_s": idle,
                "expected_wait_s": wait,
                "trainer_steps_unpublished": unpublished,
            }),
        )
    }

    /// The trainers sleep (their weights' checksum kept to check them at reclaim), and the lent
    /// engines wake with the engines' weights from the trainers on their devices.
    fn lend_devices(&mut self, cx: &mut Cx, why: Value) -> R<()> {
        let t0 = Instant::now();
        let rig = &mut *cx.rig;
        let span = rig.rec.begin(self.lend.lend_phase());
        let slots = cx.roll.lent_slots();
        let live: Vec<usize> = slots.iter().map(|&k| cx.roll.worker(k)).collect();
        let pairs: Vec<(usize, usize)> = self.lend.pairs.iter().copied().filter(|(_, e)| live.contains(e)).collect();
        let trainers = rig.fleet.indices(Role::Trainer);
        let sum = weights::trainer_checksum(&mut rig.fleet, &rig.at)?;
        let (at, bucket_bytes) = (rig.at.clone(), rig.sync.bucket_bytes());
        let (switch, phase) = (rig.switch.clone(), self.lend.lend_phase());
        let handed = Handover {
            from: &trainers,
            sleep: Sleep::of_trainer(&rig.cfg),
            to: &live,
            wake: Wake::Serving,
            expect: Some((&sum, "on the lent engines after their weights arrived")),
            phases: None,
            model: rig.switch.as_deref(),
        }
        .run(&mut rig.fleet, &mut rig.rec, |f, r| {
            let t0 = Instant::now();
            let moved = transport::lend_transfer(f, &at, bucket_bytes, &pairs)?;
            if let Some(m) = switch.as_deref() {
                let kind = if moved.host_bytes > 0 { WeightTransport::Host } else { WeightTransport::Ipc };
                switch::charge(r, &format!("{phase}:update_weights"), t0, m.update_s(kind));
            }
            Ok(moved)
        })?;
        let moved = handed.cargo;
        self.comms_suspended = handed.comms_suspended;
        rig.rec.end(span, &rig.fleet)?;
        cx.roll.wake_lent(&slots);
        let seconds = t0.elapsed().as_secs_f64();
        cx.accounts.lent(seconds);
        self.trainer_sum = Some(sum);
        self.state = State::Lent { since: Instant::now() };
        self.lend.lent(seconds, handed.saver_s);
        // Host when a worker of the pair lacks ipc (lend_transfer's fallback): say which it was.
        let transport = if moved.host_bytes > 0 { "host" } else { "ipc" };
        let mut what = json!({"seconds": seconds, "weights_bytes": moved.bytes, "weights_transport": transport});
        if let (Some(d), Value::Object(w)) = (what.as_object_mut(), why) {
            d.extend(w);
        }
        self.lend.log(rig, self.lend.lend_phase(), what);
        Ok(())
    }

    /// The trainer's next batch: a lend under way is reclaimed first (the batch waits for it),
    /// and a lent engine stuck on the oldest group is retired.
    pub(in crate::run::asynchronous) fn next_batch(&mut self, cx: &mut Cx) -> R<Option<Vec<Group>>> {
        if matches!(self.state, State::Reclaiming { .. }) {
            return self.try_reclaim(cx);
        }
        self.retire_stuck(cx)?;
        match cx.roll.take_batch(&cx.rig.cfg) {
            Some(b) if matches!(self.state, State::Lent { .. }) => {
                self.begin_reclaim(cx, b);
                self.try_reclaim(cx)
            }
            b => Ok(b),
        }
    }

    /// The trainer's batch is ready: the lent engines stop taking work; their segments in flight
    /// finish (within elastic.reclaim_timeout_s) before the trainers wake.
    fn begin_reclaim(&mut self, cx: &mut Cx, batch: Vec<Group>) {
        cx.roll.stop_lent_idle(cx.accounts);
        if let State::Lent { since } = self.state {
            let lent = since.elapsed().as_secs_f64();
            self.stats.lent_s += lent;
            cx.accounts.lend_lasted(lent);
        }
        self.state = State::Reclaiming { since: Instant::now(), batch };
    }

    /// The batch the reclaim waits to hand the trainer, once its devices are back: when every lent
    /// engine's segment is in, or at the deadline, after pausing those still generating.
    fn try_reclaim(&mut self, cx: &mut Cx) -> R<Option<Vec<Group>>> {
        let State::Reclaiming { since, .. } = &self.state else { return Ok(None) };
        let busy = cx.roll.lent_generating();
        if !busy.is_empty() {
            if since.elapsed() < Lending::reclaim_timeout(&cx.rig.cfg) {
                return Ok(None);
            }
            self.retire(cx, &busy, "of the reclaim")?;
        }
        self.reclaim(cx).map(Some)
    }

    /// Lent engines past the reclaim deadline: paused from outside through their control sockets
    /// (their answer is never read), named, never lent again; their groups' tokens so far are kept
    /// for the other engines.
    fn retire(&mut self, cx: &mut Cx, slots: &[usize], when: &str) -> R<()> {
        for &k in slots {
            let worker = cx.roll.worker(k);
            let name = cx.rig.fleet.worker(worker).name.clone();
            self.pause_all(cx.rig, &[worker])?;
            cx.roll.retire(k, cx.accounts);
            let timeout = cx.rig.cfg.elastic.reclaim_timeout_s;
            let why = format!(
                "{name} did not finish its segment within {timeout} s (elastic.reclaim_timeout_s) {when}: its memory \
                 was paused from outside and it is retired; the run goes on without it"
            );
            eprintln!("relax-colocate run: step {}: {why}", cx.rig.at.step());
            self.lend.log(cx.rig, "forced_reclaim", json!({"engine": name, "reason": why}));
            self.stats.forced += 1;
            self.stats.retired.push(name);
        }
        Ok(())
    }

    /// While lent: a lent engine whose segment has run past elastic.reclaim_timeout_s while it
    /// holds the oldest group under way (the one the trainer's batch waits for) is retired as a
    /// reclaim would retire it, so that the others can finish its groups.
    fn retire_stuck(&mut self, cx: &mut Cx) -> R<()> {
        if !matches!(self.state, State::Lent { .. }) {
            return Ok(());
        }
        let stuck = cx.roll.lent_stuck(Lending::reclaim_timeout(&cx.rig.cfg));
        if stuck.is_empty() {
            return Ok(());
        }
        self.retire(cx, &stuck, "while it held the trainer's oldest group")
    }

    /// The lent engines sleep (their groups left to the others), the trainers wake and must hold
    /// exactly the weights they slept with. Returns the batch the reclaim was for.
    fn reclaim(&mut self, cx: &mut Cx) -> R<Vec<Group>> {
        // Calibration's reclaim comes without begin_reclaim.
        cx.roll.stop_lent_idle(cx.accounts);
        let t0 = Instant::now();
        let rig = &mut *cx.rig;
        let span = rig.rec.begin(self.lend.reclaim_phase());
        let (engines, tokens) = cx.roll.put_lent_to_sleep();
        let trainers = rig.fleet.indices(Role::Trainer);
        let comms = std::mem::take(&mut self.comms_suspended);
        let sum = self.trainer_sum.take().unwrap_or_default();
        let handed = Handover {
            from: &engines,
            sleep: Sleep::default(),
            to: &trainers,
            wake: Wake::Whole { comms, load_state: !rig.cfg.memory.backup },
            expect: Some((&sum, "after the reclaim (the lent device's memory back to the trainer's bytes)")),
            phases: None,
            model: rig.switch.as_deref(),
        }
        .run(&mut rig.fleet, &mut rig.rec, |_, _| Ok(()))?;
        rig.rec.end(span, &rig.fleet)?;
        let seconds = t0.elapsed().as_secs_f64();
        cx.accounts.reclaimed(seconds);
        let batch = match std::mem::replace(&mut self.state, State::Home) {
            State::Reclaiming { batch, .. } => batch,
            _ => Vec::new(),
        };
        self.lend.reclaimed(seconds, handed.saver_s);
        let what = json!({
            "reason": "the trainer's batch is ready", "seconds": seconds,
            "groups_left": cx.roll.orphans(), "tokens_left": tokens,
        });
        self.lend.log(rig, self.lend.reclaim_phase(), what);
        Ok(batch)
    }

    /// The step's lending figures (elastic mode).
    pub(in crate::run::asynchronous) fn row(&self, cfg: &Config, w: &Window, row: &mut Row, wall: f64) {
        row.set("elastic/lends", w.lends as f64);
        row.set("elastic/lent_time", w.lent_s);
        row.set("elastic/switch_time", w.switch_s);
        let lent_idle = self.per_device(w.lent_idle_s);
        row.set("elastic/lent_idle_time", lent_idle);
        if wall > 0.0 {
            let unlent = (w.trainer_idle_s - w.lent_s).max(0.0) + lent_idle;
            row.set("elastic/trainer_device_idle_ratio", (unlent + w.flush_s) / wall);
            row.set("elastic/trainer_device_idle_ratio_without_flush", unlent / wall);
        }
        row.set("elastic/lend_after_s", self.threshold(cfg));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(lend_after_s: f64) -> Config {
        let mut cfg = crate::run::config::load(None, &[]).expect("the defaults load");
        cfg.elastic.lend_after_s = lend_after_s;
        cfg
    }

    #[test]
    fn the_threshold_is_the_measured_switch_unless_configured() {
        let mut l = Lending::of_pairs(vec![(1, 0)]);
        assert_eq!(l.threshold(&config(0.0)), 0.0, "nothing measured yet: lend at once");
        l.lend.switch_s = Some(0.7);
        assert_eq!(l.threshold(&config(0.0)), 0.7);
        assert_eq!(l.threshold(&config(2.5)), 2.5);
    }

    #[test]
    fn the_completion_rate_counts_only_engines_of_their_own_devices() {
        let mut l = Lending::of_pairs(Vec::new());
        assert_eq!(l.completion_rate(), None);
        let t0 = Instant::now();
        l.finished_at.extend([t0, t0 + Duration::from_secs(1), t0 + Duration::from_secs(2)]);
        assert!((l.completion_rate().unwrap() - 1.0).abs() < 1e-9);
        // A lent engine's groups add to what lending gave, not to the rate it is judged by.
        l.groups_finished(&Finished { groups: 5, lent: true, tokens: 40 });
        assert_eq!(l.finished_at.len(), 3);
        assert_eq!((l.stats.lent_groups, l.stats.lent_tokens), (5, 40));
        // The window keeps the last 64 completions.
        for _ in 0..100 {
            l.groups_finished(&Finished { groups: 1, lent: false, tokens: 2 });
        }
        assert_eq!(l.finished_at.len(), 64);
    }
}
