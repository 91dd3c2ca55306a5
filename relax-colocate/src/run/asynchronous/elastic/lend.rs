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

use super::super::Async;
use super::super::accounts::Window;
use super::super::engine::State as EngineState;
use super::super::queue::Group;
use crate::run::config::Config;
use crate::run::fleet::Fleet;
use crate::run::handover::{self, Handover, Sleep, Wake};
use crate::run::metrics::Row;
use crate::run::summary::ElasticSummary;
use crate::run::{R, Role, transport, weights};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

enum State {
    /// The trainers hold their devices.
    Home,
    /// The trainers sleep; the lent engines generate.
    Lent { since: Instant },
    /// The trainer's batch is ready: the lent engines finish their segments, then sleep.
    Reclaiming { since: Instant, batch: Vec<Group> },
}

#[derive(Default)]
struct Stats {
    lends: u64,
    lend_s: f64,
    reclaim_s: f64,
    lent_s: f64,
    /// Seconds the lent engines had no request while lent, all of them together.
    lent_idle_s: f64,
    forced: u64,
    retired: Vec<String>,
    lent_tokens: u64,
    lent_groups: u64,
    skipped: u64,
    /// Of the lends' and reclaims' time, the saver's own pauses and resumes (its reports).
    saver_s: f64,
}

pub(in crate::run::asynchronous) struct Lending {
    /// (trainer, lent engine) fleet indices, one pair per trainer device.
    pairs: Vec<(usize, usize)>,
    state: State,
    /// The last switch measured: a lend and its reclaim, seconds.
    switch_s: Option<f64>,
    calibration_s: Option<f64>,
    /// The trainers' weights checksum when they went to sleep.
    trainer_sum: Option<String>,
    comms_suspended: bool,
    /// When the engines of their own devices finished their last groups (the completion rate).
    finished_at: VecDeque<Instant>,
    /// The idle period whose skipped lend was logged already.
    skip_logged: Option<Instant>,
    stats: Stats,
    last_lend_s: f64,
}

impl Lending {
    pub(in crate::run::asynchronous) fn new(fleet: &Fleet) -> Lending {
        let pairs = fleet.paired_by_device(&fleet.lent_engines(), &fleet.indices(Role::Trainer));
        Lending::of_pairs(pairs.into_iter().map(|(engine, trainer)| (trainer, engine)).collect())
    }

    fn of_pairs(pairs: Vec<(usize, usize)>) -> Lending {
        Lending {
            pairs,
            state: State::Home,
            switch_s: None,
            calibration_s: None,
            trainer_sum: None,
            comms_suspended: false,
            finished_at: VecDeque::new(),
            skip_logged: None,
            stats: Stats::default(),
            last_lend_s: 0.0,
        }
    }

    pub(in crate::run::asynchronous) fn reclaiming(&self) -> bool {
        matches!(self.state, State::Reclaiming { .. })
    }

    pub(in crate::run::asynchronous) fn lent(&self) -> bool {
        matches!(self.state, State::Lent { .. })
    }

    /// Groups of the trainer's next batch, out of the queue and waiting for the reclaim.
    pub(in crate::run::asynchronous) fn batch_groups(&self) -> usize {
        match &self.state {
            State::Reclaiming { batch, .. } => batch.len(),
            _ => 0,
        }
    }

    /// Seconds the trainer waits before lending: elastic.lend_after_s, or the switch measured.
    fn threshold(&self, cfg: &Config) -> f64 {
        match cfg.elastic.lend_after_s {
            t if t > 0.0 => t,
            _ => self.switch_s.unwrap_or(0.0),
        }
    }

    /// An engine finished `groups` groups with a segment of `tokens` tokens.
    pub(in crate::run::asynchronous) fn groups_finished(&mut self, groups: usize, lent: bool, tokens: u64) {
        if lent {
            self.stats.lent_tokens += tokens;
            self.stats.lent_groups += groups as u64;
            return;
        }
        let now = Instant::now();
        for _ in 0..groups {
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
        lent_idle_s / self.pairs.len().max(1) as f64
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
        let s = &self.stats;
        let per = |x: f64| (s.lends > 0).then(|| x / s.lends as f64);
        let ratio = |x: f64| if wall > 0.0 { x / wall } else { 0.0 };
        // Waiting, less the time lent, plus the time lent with nothing to generate.
        let unlent = (trainer_idle_s - s.lent_s).max(0.0) + self.per_device(s.lent_idle_s);
        let source = if cfg.elastic.lend_after_s > 0.0 { "elastic.lend_after_s" } else { "measured switch" };
        ElasticSummary {
            lend_after_s: self.threshold(cfg),
            lend_after_s_source: source.into(),
            calibration_switch_s: self.calibration_s,
            switch_s: self.switch_s,
            reclaim_timeout_s: cfg.elastic.reclaim_timeout_s,
            lends: s.lends,
            lends_skipped: s.skipped,
            lend_s_mean: per(s.lend_s),
            reclaim_s_mean: per(s.reclaim_s),
            switch_saver_s_mean: per(s.saver_s),
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
}

impl Async {
    fn lending_mut(&mut self) -> &mut Lending {
        self.lending.as_mut().expect("elastic mode")
    }

    fn reclaim_timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.rig.cfg.elastic.reclaim_timeout_s).unwrap_or(Duration::from_secs(30))
    }

    /// The lent engines' slots in `engines` that may still be lent (not retired).
    fn lent_slots(&self) -> Vec<usize> {
        (0..self.engines.len()).filter(|&k| self.engines[k].lent && !self.engines[k].retired()).collect()
    }

    /// Pause every tag of `targets` (free memory must rise by what was paused), the saver's time
    /// counted in the lends' switch.
    fn pause_all(&mut self, targets: &[usize]) -> R<()> {
        let saver = handover::pause(&mut self.rig.fleet, &mut self.rig.rec, targets, None)?;
        self.lending_mut().stats.saver_s += saver;
        Ok(())
    }

    /// Setup: the lent engines sleep before the trainers start on their devices; from here on the
    /// recorder checks that a device's two sides never both hold their memory.
    pub(in crate::run::asynchronous) fn lent_offload(&mut self) -> R<()> {
        let span = self.rig.rec.begin("lent_offload");
        let engines = self.rig.fleet.lent_engines();
        self.pause_all(&engines)?;
        self.rig.rec.end(span, &self.rig.fleet)?;
        let pairs = self.lending_mut().pairs.clone();
        let name = |i: usize| self.rig.fleet.worker(i).name.clone();
        let shared = pairs.iter().map(|&(t, e)| (name(t), name(e))).collect();
        self.rig.rec.add_shared_devices(shared);
        Ok(())
    }

    /// Setup: one lend and its reclaim, which proves the path before the run depends on it and
    /// measures the switch the default threshold waits for.
    pub(in crate::run::asynchronous) fn calibrate(&mut self) -> R<()> {
        self.lend(json!({"reason": "calibration: one lend and reclaim measure the switch"}))?;
        self.lending_mut().state = State::Reclaiming { since: Instant::now(), batch: Vec::new() };
        self.reclaim()?;
        let l = self.lending_mut();
        l.calibration_s = l.switch_s;
        l.stats = Stats::default();
        Ok(())
    }

    /// When the driver must look again even if no worker answers: at the end of the trainer's
    /// wait before a lend, or at the reclaim deadline.
    pub(in crate::run::asynchronous) fn lending_deadline(
        &self,
        trainer_idle_since: Option<Instant>,
    ) -> Option<Instant> {
        let l = self.lending.as_ref()?;
        match &l.state {
            State::Reclaiming { since, .. } => Some(*since + self.reclaim_timeout()),
            State::Home => {
                let at = trainer_idle_since? + Duration::try_from_secs_f64(l.threshold(&self.rig.cfg)).ok()?;
                (at > Instant::now()).then_some(at)
            }
            // The earliest moment a lent engine's segment may count as stuck.
            State::Lent { .. } => {
                let now = Instant::now();
                let sent = self.lent_slots().into_iter().filter_map(|k| self.engines[k].sent());
                let due = sent.map(|t| t + self.reclaim_timeout());
                due.filter(|at| *at > now).min()
            }
        }
    }

    /// Seconds until the trainer's batch is ready, from the groups missing and the rate the
    /// engines of their own devices finish them (None before there is a rate).
    fn expected_wait(&self) -> Option<f64> {
        let rate = self.lending.as_ref()?.completion_rate()?;
        let missing = self.rig.cfg.rollout.prompts_per_step.saturating_sub(self.queue.len()).max(1);
        Some(missing as f64 / rate)
    }

    /// The trainer is waiting for its batch (since `idle_since`): lend its devices when it has
    /// waited past the threshold, the lent engines would have work, and the batch is not expected
    /// sooner than a switch takes. `unpublished`: the trainer's steps since the last update
    /// (async.train_iters_per_update above 1). The lent engines then get the trainer's weights,
    /// newer than the engines' by those steps, and their tokens count as the engines' version:
    /// older than they are, so the staleness bound still holds for them; the off-policy correction
    /// reads the log-probs the lent engine computed, whatever weights it had.
    pub(in crate::run::asynchronous) fn consider_lending(
        &mut self,
        idle_since: Option<Instant>,
        unpublished: u64,
    ) -> R<()> {
        let (Some(l), Some(since)) = (self.lending.as_ref(), idle_since) else {
            return Ok(());
        };
        if !matches!(l.state, State::Home) || self.lent_slots().is_empty() {
            return Ok(());
        }
        let idle = since.elapsed().as_secs_f64();
        let threshold = l.threshold(&self.rig.cfg);
        // Work for the lent engines: groups to continue or to share, or room for new ones.
        let work = !self.orphans.is_empty() || self.generating_groups() > 0 || self.fresh_groups_for(0, true) > 0;
        if idle < threshold || !work {
            return Ok(());
        }
        let switch = l.switch_s.unwrap_or(0.0);
        let wait = self.expected_wait();
        if let Some(w) = wait.filter(|w| *w < switch) {
            if l.skip_logged != Some(since) {
                let l = self.lending_mut();
                l.skip_logged = Some(since);
                l.stats.skipped += 1;
                let why = format!("the batch is expected in {w:.3} s, sooner than a switch ({switch:.3} s)");
                self.rig
                    .rec
                    .log_decision(json!({"action": "skip", "reason": why, "idle_s": idle, "expected_wait_s": w}));
            }
            return Ok(());
        }
        let reason = format!(
            "the trainer waited {idle:.3} s, past {threshold:.3} s ({}), and its batch is {}",
            if self.rig.cfg.elastic.lend_after_s > 0.0 { "elastic.lend_after_s" } else { "the measured switch" },
            wait.map_or_else(|| "not yet timed".into(), |w| format!("expected in {w:.3} s"))
        );
        self.lend(json!({
            "reason": reason,
            "idle_s": idle,
            "expected_wait_s": wait,
            "trainer_steps_unpublished": unpublished,
        }))
    }

    /// The trainers sleep (their weights' checksum kept to check them at reclaim), and the lent
    /// engines wake with the engines' weights from the trainers on their devices.
    fn lend(&mut self, why: Value) -> R<()> {
        let t0 = Instant::now();
        let span = self.rig.rec.begin("lend");
        let slots = self.lent_slots();
        let live: Vec<usize> = slots.iter().map(|&k| self.engines[k].worker).collect();
        let pairs: Vec<(usize, usize)> =
            self.lending_mut().pairs.iter().copied().filter(|(_, e)| live.contains(e)).collect();
        let trainers = self.rig.fleet.indices(Role::Trainer);
        let sum = weights::trainer_checksum(&mut self.rig.fleet, &self.rig.at)?;
        let (at, bucket_bytes) = (self.rig.at.clone(), self.rig.sync.bucket_bytes());
        let handed = Handover {
            from: &trainers,
            sleep: Sleep::of_trainer(&self.rig.cfg),
            to: &live,
            wake: Wake::Serving,
            expect: Some((&sum, "on the lent engines after their weights arrived")),
            phases: None,
        }
        .run(&mut self.rig.fleet, &mut self.rig.rec, |f, _| transport::lend_transfer(f, &at, bucket_bytes, &pairs))?;
        let moved = handed.cargo;
        let l = self.lending_mut();
        l.comms_suspended = handed.comms_suspended;
        l.stats.saver_s += handed.saver_s;
        self.rig.rec.end(span, &self.rig.fleet)?;
        let version = self.version;
        for &k in &slots {
            let e = &mut self.engines[k];
            (e.state, e.version, e.cold_cache) = (EngineState::Awake, version, true);
            // Idle until its first request (the lent engines' share of the work, while lent).
            e.start_idle();
        }
        let seconds = t0.elapsed().as_secs_f64();
        self.accounts.lent(seconds);
        let l = self.lending_mut();
        l.trainer_sum = Some(sum);
        l.state = State::Lent { since: Instant::now() };
        l.stats.lends += 1;
        l.stats.lend_s += seconds;
        l.last_lend_s = seconds;
        // Host when a worker of the pair lacks ipc (lend_transfer's fallback): say which it was.
        let transport = if moved.host_bytes > 0 { "host" } else { "ipc" };
        let mut decision =
            json!({"action": "lend", "seconds": seconds, "weights_bytes": moved.bytes, "weights_transport": transport});
        if let (Some(d), Value::Object(w)) = (decision.as_object_mut(), why) {
            d.extend(w);
        }
        self.rig.rec.log_decision(decision);
        Ok(())
    }

    /// The trainer's batch is ready: the lent engines stop taking work; their segments in flight
    /// finish (within elastic.reclaim_timeout_s) before the trainers wake.
    pub(in crate::run::asynchronous) fn begin_reclaim(&mut self, batch: Vec<Group>) {
        self.close_lent_idle();
        let l = self.lending_mut();
        if let State::Lent { since } = l.state {
            let lent = since.elapsed().as_secs_f64();
            l.stats.lent_s += lent;
            self.accounts.lend_lasted(lent);
        }
        self.lending_mut().state = State::Reclaiming { since: Instant::now(), batch };
    }

    /// The lent engines take no more work from here (a reclaim, a retirement): their idle time
    /// while lent ends.
    fn close_lent_idle(&mut self) {
        for k in self.lent_slots() {
            let idle = self.engines[k].stop_idle();
            self.accounts.engine_idle(true, idle);
        }
    }

    /// The batch the reclaim waits to hand the trainer, once its devices are back: when every lent
    /// engine's segment is in, or at the deadline, after pausing those still generating.
    pub(in crate::run::asynchronous) fn try_reclaim(&mut self) -> R<Option<Vec<Group>>> {
        let Some(State::Reclaiming { since, .. }) = self.lending.as_ref().map(|l| &l.state) else {
            return Ok(None);
        };
        let busy: Vec<usize> = self.lent_slots().into_iter().filter(|&k| self.engines[k].generating()).collect();
        if !busy.is_empty() {
            if since.elapsed() < self.reclaim_timeout() {
                return Ok(None);
            }
            self.retire(&busy, "of the reclaim")?;
        }
        self.reclaim().map(Some)
    }

    /// Lent engines past the reclaim deadline: paused from outside through their control sockets
    /// (their answer is never read), named, never lent again; their groups' tokens so far are kept
    /// for the other engines.
    fn retire(&mut self, slots: &[usize], when: &str) -> R<()> {
        for &k in slots {
            let worker = self.engines[k].worker;
            let name = self.rig.fleet.worker(worker).name.clone();
            self.pause_all(&[worker])?;
            let e = &mut self.engines[k];
            // Its request's answer is never read.
            e.state = EngineState::Retired;
            let idle = e.stop_idle();
            self.accounts.engine_idle(true, idle);
            let groups = std::mem::take(&mut e.groups);
            self.orphans.extend(groups);
            self.orphans.sort_by_key(|g| g.started);
            let timeout = self.rig.cfg.elastic.reclaim_timeout_s;
            let why = format!(
                "{name} did not finish its segment within {timeout} s (elastic.reclaim_timeout_s) {when}: its memory \
                 was paused from outside and it is retired; the run goes on without it"
            );
            eprintln!("relax-colocate run: step {}: {why}", self.step());
            self.rig.rec.log_decision(json!({"action": "forced_reclaim", "engine": name, "reason": why}));
            let l = self.lending_mut();
            l.stats.forced += 1;
            l.stats.retired.push(name);
        }
        Ok(())
    }

    /// While lent: a lent engine whose segment has run past elastic.reclaim_timeout_s while it
    /// holds the oldest group under way (the one the trainer's batch waits for) is retired as a
    /// reclaim would retire it, so that the others can finish its groups.
    pub(in crate::run::asynchronous) fn retire_stuck(&mut self) -> R<()> {
        if !self.lending.as_ref().is_some_and(Lending::lent) {
            return Ok(());
        }
        let Some(oldest) = self.first_in_flight() else { return Ok(()) };
        let timeout = self.reclaim_timeout();
        let stuck: Vec<usize> = self
            .lent_slots()
            .into_iter()
            .filter(|&k| {
                let e = &self.engines[k];
                let late = e.sent().is_some_and(|t| t.elapsed() >= timeout);
                late && e.groups.iter().any(|g| g.started == oldest)
            })
            .collect();
        if stuck.is_empty() {
            return Ok(());
        }
        self.retire(&stuck, "while it held the trainer's oldest group")
    }

    /// The lent engines sleep (their groups left to the others), the trainers wake and must hold
    /// exactly the weights they slept with. Returns the batch the reclaim was for.
    fn reclaim(&mut self) -> R<Vec<Group>> {
        // Calibration's reclaim comes without begin_reclaim.
        self.close_lent_idle();
        let t0 = Instant::now();
        let span = self.rig.rec.begin("reclaim");
        let slots: Vec<usize> = self.lent_slots().into_iter().filter(|&k| self.engines[k].awake()).collect();
        let engines: Vec<usize> = slots.iter().map(|&k| self.engines[k].worker).collect();
        let mut tokens = 0;
        for &k in &slots {
            let e = &mut self.engines[k];
            e.state = EngineState::Asleep;
            for g in std::mem::take(&mut e.groups) {
                tokens += g.seqs.iter().map(|s| s.response.len()).sum::<usize>();
                self.orphans.push(g);
            }
        }
        self.orphans.sort_by_key(|g| g.started);
        let trainers = self.rig.fleet.indices(Role::Trainer);
        let comms = std::mem::take(&mut self.lending_mut().comms_suspended);
        let sum = self.lending_mut().trainer_sum.take().unwrap_or_default();
        let handed = Handover {
            from: &engines,
            sleep: Sleep::default(),
            to: &trainers,
            wake: Wake::Whole { comms, load_state: !self.rig.cfg.memory.backup },
            expect: Some((&sum, "after the reclaim (the lent device's memory back to the trainer's bytes)")),
            phases: None,
        }
        .run(&mut self.rig.fleet, &mut self.rig.rec, |_, _| Ok(()))?;
        self.lending_mut().stats.saver_s += handed.saver_s;
        self.rig.rec.end(span, &self.rig.fleet)?;
        let seconds = t0.elapsed().as_secs_f64();
        self.accounts.reclaimed(seconds);
        let l = self.lending_mut();
        let batch = match std::mem::replace(&mut l.state, State::Home) {
            State::Reclaiming { batch, .. } => batch,
            _ => Vec::new(),
        };
        l.stats.reclaim_s += seconds;
        l.switch_s = Some(l.last_lend_s + seconds);
        let orphans = self.orphans.len();
        self.rig.rec.log_decision(json!({
            "action": "reclaim", "reason": "the trainer's batch is ready", "seconds": seconds,
            "groups_left": orphans, "tokens_left": tokens,
        }));
        Ok(batch)
    }

    /// The step's lending figures (elastic mode).
    pub(in crate::run::asynchronous) fn lending_row(&self, row: &mut Row, wall: f64) {
        let w: &Window = &self.accounts.window;
        row.set("elastic/lends", w.lends as f64);
        row.set("elastic/lent_time", w.lent_s);
        row.set("elastic/switch_time", w.switch_s);
        let Some(l) = self.lending.as_ref() else { return };
        let lent_idle = l.per_device(w.lent_idle_s);
        row.set("elastic/lent_idle_time", lent_idle);
        if wall > 0.0 {
            let unlent = (w.trainer_idle_s - w.lent_s).max(0.0) + lent_idle;
            row.set("elastic/trainer_device_idle_ratio", (unlent + w.flush_s) / wall);
            row.set("elastic/trainer_device_idle_ratio_without_flush", unlent / wall);
        }
        row.set("elastic/lend_after_s", l.threshold(&self.rig.cfg));
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
        l.switch_s = Some(0.7);
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
        l.groups_finished(5, true, 40);
        assert_eq!(l.finished_at.len(), 3);
        assert_eq!((l.stats.lent_groups, l.stats.lent_tokens), (5, 40));
        // The window keeps the last 64 completions.
        for _ in 0..100 {
            l.groups_finished(1, false, 2);
        }
        assert_eq!(l.finished_at.len(), 64);
    }
}
