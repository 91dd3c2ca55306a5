//! The async driver's time and throughput accounts: the metrics window of the step being
//! written and the run's totals for the summary. Every figure moves through one of the event
//! methods here (a wait, a flush, an engine's idle time, a lend, a reclaim, a trained batch), so
//! each is counted in one place; the rows and the summary only read them.

use crate::run::clock::Instant;
use std::collections::BTreeMap;

pub(super) struct Accounts {
    /// Since the last metrics row.
    pub(super) window: Window,
    pub(super) totals: Totals,
}

/// Over the whole run, for the summary.
#[derive(Default)]
pub(super) struct Totals {
    pub(super) samples_trained: u64,
    pub(super) tokens_trained: u64,
    /// Trained samples per staleness (versions between their oldest token and the weights then).
    pub(super) staleness: BTreeMap<u64, u64>,
    pub(super) partial_samples: u64,
    pub(super) updates: u64,
    pub(super) update_s: f64,
    pub(super) update_bytes: u64,
    pub(super) trainer_idle_s: f64,
    /// The flushes that ended a written step's window (the rows' `perf/flush_time`).
    pub(super) flush_total_s: f64,
    pub(super) rollout_idle_s: f64,
    /// Generate replies that came after the trainer took its last batch: the segments then in
    /// flight, none started since.
    pub(super) replies_after_last_batch: u64,
    /// Segments async.segment_s ended part-way through a token of at least one sequence.
    pub(super) segments_mid_token: u64,
    /// Each update's flush: the trainer's step done, the engines finishing their segments.
    pub(super) flush_s: Vec<f64>,
    pub(super) started: Option<Instant>,
}

pub(super) struct Window {
    pub(super) start: Instant,
    pub(super) trainer_idle_s: f64,
    pub(super) rollout_idle_s: f64,
    /// The update's flush (Relax's pause): the trainer's devices wait for the engines' segments.
    pub(super) flush_s: f64,
    /// Elastic mode: of the trainer's idle time, what its devices spent lent (generating) and
    /// switching (lends and reclaims).
    pub(super) lent_s: f64,
    /// Elastic mode: seconds the lent engines, awake and lent, had no request (all of them).
    pub(super) lent_idle_s: f64,
    pub(super) switch_s: f64,
    pub(super) lends: u64,
    /// elastic.lend_rollout: the engines' devices' lends, their switches (lends and reclaims),
    /// and the seconds they trained, each device counted.
    pub(super) rollout_lends: u64,
    pub(super) rollout_switch_s: f64,
    pub(super) rollout_lent_s: f64,
}

impl Window {
    /// An engine's idle seconds, in the share of its kind: an engine of its own device, or a
    /// lent one (whose idle time counts only while lent).
    pub(super) fn add_engine_idle(&mut self, lent: bool, seconds: f64) {
        if lent {
            self.lent_idle_s += seconds;
        } else {
            self.rollout_idle_s += seconds;
        }
    }

    pub(super) fn new() -> Window {
        Window {
            start: Instant::now(),
            trainer_idle_s: 0.0,
            rollout_idle_s: 0.0,
            flush_s: 0.0,
            lent_s: 0.0,
            lent_idle_s: 0.0,
            switch_s: 0.0,
            lends: 0,
            rollout_lends: 0,
            rollout_switch_s: 0.0,
            rollout_lent_s: 0.0,
        }
    }
}

/// A trained batch, as the totals count it.
pub(super) struct Batch<'a> {
    pub(super) samples: u64,
    pub(super) tokens: u64,
    pub(super) staleness: &'a [u64],
    pub(super) partial: u64,
}

impl Accounts {
    pub(super) fn new() -> Accounts {
        Accounts { window: Window::new(), totals: Totals::default() }
    }

    /// The run's steps begin: the totals' clock and the first window start.
    pub(super) fn start(&mut self) {
        self.totals.started = Some(Instant::now());
        self.window = Window::new();
    }

    /// The trainer waited `seconds` for a batch.
    pub(super) fn trainer_waited(&mut self, seconds: f64) {
        self.window.trainer_idle_s += seconds;
    }

    /// An update's flush: the trainer's devices waited `seconds` for the engines' segments.
    pub(super) fn flushed(&mut self, seconds: f64) {
        self.window.flush_s += seconds;
        self.totals.flush_s.push(seconds);
    }

    /// An engine had nothing to do for `seconds` (`lent`: a lent engine, while lent).
    pub(super) fn engine_idle(&mut self, lent: bool, seconds: f64) {
        self.window.add_engine_idle(lent, seconds);
    }

    /// The weights reached the engines: `seconds` for the update, `bytes` moved.
    pub(super) fn weights_moved(&mut self, seconds: f64, bytes: u64) {
        self.totals.update_s += seconds;
        self.totals.update_bytes += bytes;
    }

    /// A new weight version reached the engines.
    pub(super) fn published(&mut self) {
        self.totals.updates += 1;
    }

    /// A generate reply came after the trainer took its last batch.
    pub(super) fn reply_after_last_batch(&mut self) {
        self.totals.replies_after_last_batch += 1;
    }

    /// A segment ended; `mid_token`: part-way through a token of at least one sequence.
    pub(super) fn segment_ended(&mut self, mid_token: bool) {
        self.totals.segments_mid_token += u64::from(mid_token);
    }

    /// A lend of the trainer's devices took `seconds`.
    pub(super) fn lent(&mut self, seconds: f64) {
        let w = &mut self.window;
        w.switch_s += seconds;
        w.lends += 1;
    }

    /// The trainer's devices were lent for `seconds` before their reclaim began.
    pub(super) fn lend_lasted(&mut self, seconds: f64) {
        self.window.lent_s += seconds;
    }

    /// A reclaim of the trainer's devices took `seconds`.
    pub(super) fn reclaimed(&mut self, seconds: f64) {
        self.window.switch_s += seconds;
    }

    /// A lend of the engines' devices to the trainer took `seconds`.
    pub(super) fn rollout_lent(&mut self, seconds: f64) {
        let w = &mut self.window;
        w.rollout_switch_s += seconds;
        w.rollout_lends += 1;
    }

    /// Its reclaim took `seconds`, after `device_s` device-seconds of training.
    pub(super) fn rollout_reclaimed(&mut self, seconds: f64, device_s: f64) {
        let w = &mut self.window;
        w.rollout_switch_s += seconds;
        w.rollout_lent_s += device_s;
    }

    /// A step's row is written: the batch and the window go into the totals, and the next
    /// window starts. Returns the closed window.
    pub(super) fn close_window(&mut self, batch: Batch) -> Window {
        let w = std::mem::replace(&mut self.window, Window::new());
        let t = &mut self.totals;
        t.samples_trained += batch.samples;
        t.tokens_trained += batch.tokens;
        for s in batch.staleness {
            *t.staleness.entry(*s).or_default() += 1;
        }
        t.partial_samples += batch.partial;
        t.trainer_idle_s += w.trainer_idle_s;
        t.flush_total_s += w.flush_s;
        t.rollout_idle_s += w.rollout_idle_s;
        w
    }
}
