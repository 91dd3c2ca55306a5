//! A rollout engine as the async driver sees it: the groups it generates, where it stands (one
//! state, not a set of flags whose legal combinations live in comments), its cache, and the
//! idle time it has run up, measured in one place.

use super::queue::Group;
use super::rollouter::Slot;
use crate::run::clock::Instant;
use crate::run::fleet::InFlight;

/// Where an engine stands.
pub(super) enum State {
    /// It may be given work.
    Awake,
    /// A generate request in flight since `sent`, and where each of its replies belongs.
    Generating { request: InFlight, slots: Vec<Slot>, sent: Instant },
    /// Its device is the trainer's: a lent engine between lends, or an engine of its own device
    /// while elastic.lend_rollout lends that device to the trainer.
    Asleep,
    /// A lent engine that did not give its device back in time: paused from outside, never used
    /// again.
    Retired,
}

pub(super) struct Engine {
    pub(super) worker: usize,
    /// Elastic mode's lent engine, on a trainer's device, rather than one of its own device.
    pub(super) lent: bool,
    pub(super) groups: Vec<Group>,
    pub(super) state: State,
    /// The weight version its last segment ran under.
    pub(super) version: u64,
    /// Its cache holds none of its groups' prefixes: it took them over from another engine, or
    /// woke for a lend with an empty cache.
    pub(super) cold_cache: bool,
    /// Since when its idle time counts (None: it does not count now).
    idle_since: Option<Instant>,
}

impl Engine {
    /// An engine of its own device starts awake; a lent one asleep, until its first lend.
    pub(super) fn new(worker: usize, lent: bool) -> Engine {
        let state = if lent { State::Asleep } else { State::Awake };
        Engine { worker, lent, groups: Vec::new(), state, version: 0, cold_cache: false, idle_since: None }
    }

    /// Awake, generating or not: its device is its own (or lent to it) now.
    pub(super) fn awake(&self) -> bool {
        matches!(self.state, State::Awake | State::Generating { .. })
    }

    pub(super) fn generating(&self) -> bool {
        matches!(self.state, State::Generating { .. })
    }

    pub(super) fn retired(&self) -> bool {
        matches!(self.state, State::Retired)
    }

    /// The request in flight, if any.
    pub(super) fn request(&self) -> Option<&InFlight> {
        match &self.state {
            State::Generating { request, .. } => Some(request),
            _ => None,
        }
    }

    /// When its request in flight was sent.
    pub(super) fn sent(&self) -> Option<Instant> {
        match &self.state {
            State::Generating { sent, .. } => Some(*sent),
            _ => None,
        }
    }

    /// A request goes out: returns the idle seconds that ended.
    pub(super) fn send(&mut self, request: InFlight, slots: Vec<Slot>, version: u64) -> f64 {
        self.state = State::Generating { request, slots, sent: Instant::now() };
        self.version = version;
        self.cold_cache = false;
        for g in &mut self.groups {
            g.moved = false;
        }
        self.stop_idle()
    }

    /// Its request's answer is being read: it is awake again, with the request and its slots.
    pub(super) fn answered(&mut self) -> (InFlight, Vec<Slot>) {
        match std::mem::replace(&mut self.state, State::Awake) {
            State::Generating { request, slots, .. } => (request, slots),
            _ => panic!("an engine's answer read with no request in flight"),
        }
    }

    /// Its idle time counts from now.
    pub(super) fn start_idle(&mut self) {
        self.idle_since = Some(Instant::now());
    }

    /// Its idle time stops counting: the seconds since it began (0 when it was not counting).
    pub(super) fn stop_idle(&mut self) -> f64 {
        self.idle_since.take().map_or(0.0, |t| t.elapsed().as_secs_f64())
    }

    /// A metrics window closes: the idle seconds it holds so far, counting on from now.
    pub(super) fn roll_idle(&mut self, now: Instant) -> f64 {
        let Some(t) = self.idle_since.as_mut() else { return 0.0 };
        let idle = now.duration_since(*t).as_secs_f64();
        *t = now;
        idle
    }
}
