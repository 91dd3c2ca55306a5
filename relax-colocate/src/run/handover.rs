//! The device hand-over every layout performs, written once: one side gives its devices up (its
//! state saved when memory keeps no backup, every tag paused, its communicators suspended), the
//! other takes them (a serving engine's weights first, then what moves them, then its KV cache and
//! graphs; a trainer whole, its communicators and state back), and what it needs is moved and
//! checked. Colocate's sleep and wake-up, elastic's lend and reclaim and their reverse are each one
//! `Handover`; they differ only in who, what moves, and how the time is split into phases.

use super::config::Config;
use super::fleet::Fleet;
use super::protocol::{Checksum, LoadState, SaveState, Step};
use super::recorder::Recorder;
use super::switch::{self, SwitchModel};
use super::{NCCL_TAG, R};
use crate::run::clock::Instant;

/// How the side giving its devices up goes to sleep.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Sleep {
    /// Its state (optimizer, step) goes to host files first: memory paused without a backup
    /// (memory.backup = false) loses its bytes.
    pub(super) save_state: bool,
    /// memory.suspend_communicators: its NCCL communicators' buffers sleep too, when it holds any.
    pub(super) suspend_comms: bool,
}

impl Sleep {
    /// A trainer's: its state saved when memory keeps no backup, its communicators suspended when
    /// memory.suspend_communicators says so.
    pub(super) fn of_trainer(cfg: &Config) -> Sleep {
        Sleep { save_state: !cfg.memory.backup, suspend_comms: cfg.memory.suspend_communicators }
    }
}

/// How the side taking the devices wakes.
#[derive(Debug, Clone, Copy)]
pub(super) enum Wake {
    /// A serving engine: its weights wake before the cargo fills them; its KV cache and graphs
    /// after the check, so that the peak stays low.
    Serving,
    /// A trainer (or an engine the update refills later): every tag, then its communicators
    /// when its sleep suspended them, then its state from the host when it saved it.
    Whole { comms: bool, load_state: bool },
}

/// The recorder's phases for a hand-over's stages; None: the caller's own phase spans it all.
#[derive(Debug, Clone, Copy)]
pub(super) struct Phases {
    pub(super) sleep: &'static str,
    pub(super) wake: &'static str,
    /// The cargo's phase (None: between the wake and the check, in no phase of its own).
    pub(super) cargo: Option<&'static str>,
    /// A serving engine's KV cache and graphs.
    pub(super) finish: &'static str,
}

/// One hand-over: `from` sleeps, `to` wakes, the cargo moves what `to` needs, and `to` must then
/// hold the weights `expect` names.
pub(super) struct Handover<'a> {
    pub(super) from: &'a [usize],
    pub(super) sleep: Sleep,
    pub(super) to: &'a [usize],
    pub(super) wake: Wake,
    /// The weights checksum `to` must hold at the end, and when that is (for the failure).
    pub(super) expect: Option<(&'a str, &'a str)>,
    pub(super) phases: Option<Phases>,
    /// With compute.model: the sleep and the wakes last at least their modelled device time
    /// (the cargo charges its own: weights.rs, the lend's transfer).
    pub(super) model: Option<&'a SwitchModel>,
}

/// What a hand-over did.
pub(super) struct Handed<T> {
    /// The sleepers' communicators were suspended: the wake that gives them the devices back
    /// resumes them.
    pub(super) comms_suspended: bool,
    /// The saver's own seconds, every pause and resume (each the slowest worker's report).
    pub(super) saver_s: f64,
    pub(super) cargo: T,
}

impl Handover<'_> {
    /// Runs the hand-over; `cargo` moves what the waking side needs (weights, a state file, or
    /// nothing) once its memory is back.
    pub(super) fn run<T>(
        &self,
        fleet: &mut Fleet,
        rec: &mut Recorder,
        cargo: impl FnOnce(&mut Fleet, &mut Recorder) -> R<T>,
    ) -> R<Handed<T>> {
        let mut saver_s = 0.0;
        let mut comms_suspended = false;
        let role = |f: &Fleet, i: usize| f.worker(i).role;
        if !self.from.is_empty() {
            let name = self.phases.map(|p| p.sleep);
            // The sleepers pause in parallel, each on its own device: the slowest is the stage's.
            let modelled =
                self.model.map(|m| self.from.iter().map(|&i| m.pause_s(role(fleet, i), None)).fold(0.0, f64::max));
            (saver_s, comms_suspended) =
                in_phase(fleet, rec, name, ("sleep", modelled), |f, r| self.put_to_sleep(f, r))?;
        }
        let name = self.phases.map(|p| p.wake);
        let to_role = self.to.first().map(|&i| role(fleet, i));
        let modelled = |tag: Option<&str>| self.model.zip(to_role).map(|(m, r)| m.resume_s(r, tag));
        let woken = match self.wake {
            Wake::Serving => modelled(Some("weights")),
            Wake::Whole { .. } => modelled(None),
        };
        saver_s += in_phase(fleet, rec, name, ("wake", woken), |f, r| self.wake_up(f, r))?;
        let cargo = in_phase(fleet, rec, self.phases.and_then(|p| p.cargo), ("cargo", None), cargo)?;
        if let Some((expected, when)) = self.expect {
            expect_weights(fleet, rec, self.to, expected, when)?;
        }
        if matches!(self.wake, Wake::Serving) {
            let name = self.phases.map(|p| p.finish);
            let rest = modelled(Some("kv_cache")).zip(modelled(Some("cuda_graph"))).map(|(a, b)| a + b);
            saver_s += in_phase(fleet, rec, name, ("finish", rest), |f, _| {
                Ok(resume(f, self.to, Some("kv_cache"))? + resume(f, self.to, Some("cuda_graph"))?)
            })?;
        }
        Ok(Handed { comms_suspended, saver_s, cargo })
    }

    /// The saver's seconds, and whether the communicators were suspended.
    fn put_to_sleep(&self, fleet: &mut Fleet, rec: &mut Recorder) -> R<(f64, bool)> {
        let from = self.from;
        if self.sleep.save_state {
            let step = Step { step: rec.cursor().step() };
            fleet.call_each::<SaveState>(from, vec![step; from.len()])?;
        }
        let mut saver_s = pause(fleet, rec, from, None)?;
        // Pausing every tag leaves communicators alone (a framework may sync weights over them
        // asleep); the sleepers' are idle until they wake, so their buffers sleep too. slime
        // destroys its process groups here; suspending keeps them.
        let suspend = self.sleep.suspend_comms && fleet.holds_nccl(from)?;
        if suspend {
            saver_s += pause(fleet, rec, from, Some(NCCL_TAG)).map_err(|mut e| {
                e.cause += "; memory.suspend_communicators = false leaves the communicators awake";
                e
            })?;
        }
        Ok((saver_s, suspend))
    }

    fn wake_up(&self, fleet: &mut Fleet, rec: &mut Recorder) -> R<f64> {
        let to = self.to;
        match self.wake {
            Wake::Serving => resume(fleet, to, Some("weights")),
            Wake::Whole { comms, load_state } => {
                let mut saver_s = resume(fleet, to, None)?;
                // Before any request: the first collective must find its buffers back.
                if comms {
                    saver_s += resume(fleet, to, Some(NCCL_TAG))?;
                }
                if load_state {
                    let step = Step { step: rec.cursor().step() };
                    fleet.call_each::<LoadState>(to, vec![step; to.len()])?;
                }
                Ok(saver_s)
            }
        }
    }
}

/// `f` inside the recorder's phase `name` (timed, the fleet's memory sampled at its end), or
/// plainly when None (inside the caller's phase). `charge`: the stage's name and, with
/// compute.model, its modelled seconds, which it then lasts at least (recorded under the phase's
/// name, or the caller's phase and the stage's).
fn in_phase<T>(
    fleet: &mut Fleet,
    rec: &mut Recorder,
    name: Option<&str>,
    charge: (&str, Option<f64>),
    f: impl FnOnce(&mut Fleet, &mut Recorder) -> R<T>,
) -> R<T> {
    let label = name.map_or_else(|| format!("{}:{}", rec.cursor().phase(), charge.0), String::from);
    let span = name.map(|n| rec.begin(n));
    let t0 = Instant::now();
    let out = f(fleet, rec)?;
    if let Some(modelled) = charge.1 {
        switch::charge(rec, &label, t0, modelled);
    }
    if let Some(span) = span {
        rec.end(span, fleet)?;
    }
    Ok(out)
}

/// The saver's own time for one pause or resume: its slowest worker's report (they run in
/// parallel).
fn saver_seconds(reports: &[(String, tms_proto::OpReport)]) -> f64 {
    reports.iter().map(|(_, r)| r.counts.elapsed_ns).max().unwrap_or(0) as f64 / 1e9
}

/// Pause `tag` (None: every tag) in `targets`; the recorder checks that free memory rose by what
/// was paused. Returns the saver's seconds.
pub(super) fn pause(fleet: &mut Fleet, rec: &mut Recorder, targets: &[usize], tag: Option<&str>) -> R<f64> {
    let reports = fleet.control_of(targets, true, tag)?;
    if tag == Some(NCCL_TAG) {
        rec.record_comm_suspended(&reports);
    }
    let what = tag.map(|t| format!("tag {t:?}")).unwrap_or_else(|| "every tag".into());
    rec.check_paused(&what, &reports)?;
    Ok(saver_seconds(&reports))
}

/// Resume `tag` (None: every tag) in `targets`. Returns the saver's seconds.
pub(super) fn resume(fleet: &mut Fleet, targets: &[usize], tag: Option<&str>) -> R<f64> {
    let reports = fleet.control_of(targets, false, tag)?;
    Ok(saver_seconds(&reports))
}

/// Every worker in `targets` must hold the weights `expected` (when checks are on).
pub(super) fn expect_weights(
    fleet: &mut Fleet,
    rec: &mut Recorder,
    targets: &[usize],
    expected: &str,
    when: &str,
) -> R<()> {
    if !rec.checks_enabled() {
        return Ok(());
    }
    let step = Step { step: rec.cursor().step() };
    let replies = fleet.call_each::<Checksum>(targets, vec![step; targets.len()])?;
    let names = targets.iter().map(|&i| fleet.worker(i).name.clone());
    let named: Vec<(String, String)> = names.zip(replies.into_iter().map(|r| r.weights)).collect();
    rec.check_weights(&named, expected, when)
}
