//! The trainer's side of a step in async mode: its job (job.rs, the stages every layout shares)
//! over one batch, a request at a time so the engines keep generating, and the step's row with
//! async's account of it: the trainer's wait for a batch, the flush, staleness and partial
//! rollouts.

use super::Async;
use super::accounts::Batch;
use super::queue::Group;
use super::rollouter::max_staleness;
use crate::run::job::{self, Job, Stage, StepTimes, Trained};
use crate::run::learn::{self, Sample};
use crate::run::metrics::mean;
use crate::run::{FailKind, R, Role};

/// The trainer's job on one batch, with what the step's row keeps of its samples.
pub(super) struct Training {
    pub(super) job: Job,
    /// Per sample: versions between its oldest token and the weights then.
    staleness: Vec<u64>,
    /// Per sample: how many segments it took beyond its first (partial rollouts).
    spans: Vec<u64>,
    /// The step ends with a weight update (elastic.lend_rollout lends only then).
    publishes: bool,
}

/// A trained batch, for its metrics row.
pub(super) struct Finished {
    trained: Trained,
    staleness: Vec<u64>,
    spans: Vec<u64>,
}

impl Async {
    /// The trainer's first pass over a batch begins.
    pub(super) fn start_job(&mut self, groups: Vec<Group>, publishes: bool) -> R<Training> {
        let now = self.roll.version();
        let mut samples = Vec::new();
        let (mut staleness, mut spans, mut scaled) = (Vec::new(), Vec::new(), Vec::new());
        let mut identities = Vec::new();
        for g in &groups {
            for (j, s) in g.seqs.iter().enumerate() {
                identities.push((g.prompt.len(), g.started, j as u64));
                let versions = s.versions.iter().map(|v| *v as f64);
                let version = versions.clone().sum::<f64>() / s.versions.len().max(1) as f64;
                scaled.push((g.prompt.len() + s.response.len(), self.rig.cfg.cost_clock(version, g.started)));
                samples.push(Sample {
                    prompt: g.prompt.clone(),
                    response: s.response.clone(),
                    logprobs: s.logprobs.clone(),
                });
                staleness.push(now - s.oldest(now).min(now));
                spans.push(s.span());
            }
        }
        let bound = max_staleness(&self.rig.cfg);
        if let Some(worst) = staleness.iter().max().filter(|w| **w > bound) {
            let cause = format!("a sample {worst} versions old reached the trainer (async.max_staleness = {bound})");
            return Err(self.rig.at.fail(FailKind::Check, None, cause));
        }
        self.rig.rec.count_check();
        self.roll.set_in_training(groups.len());
        let mut job = Job::new(&self.rig.cfg, samples, learn::batch_token_scale(&self.rig.cfg, &scaled))
            .with_drawn(self.rig.cfg.drawn_tokens(identities));
        job.begin(&self.rig.cfg, &self.rig.task, &mut self.rig.fleet, &mut self.rig.rec)?;
        let mut training = Training { job, staleness, spans, publishes };
        self.submit_stage(&mut training)?;
        Ok(training)
    }

    /// Sends the job's current stage to every trainer (and, for the train stage with
    /// elastic.lend_rollout, to the lent trainers when the engines' devices are lent).
    fn submit_stage(&mut self, t: &mut Training) -> R<()> {
        let mut targets = self.rig.fleet.indices(Role::Trainer);
        if t.job.stage() == Stage::Train {
            let (elastic, mut cx) = self.parts();
            targets.extend(elastic.train_stage(&mut cx, t.publishes)?);
        }
        // With elastic.lend_rollout every train request says its replicas, lent or not.
        let replicas = self.elastic.lends_to_trainer().then_some(targets.len() as f64);
        t.job.submit(&self.rig.cfg, &mut self.rig.fleet, &mut self.rig.rec, &targets, replicas)
    }

    /// The `nth` of the job's requests answered: read it; when every trainer has, the stage ends
    /// and the next begins. Returns the finished batch after training.
    pub(super) fn advance(&mut self, t: &mut Training, nth: usize) -> R<Option<Finished>> {
        if !t.job.take_reply(&mut self.rig.fleet, &mut self.rig.rec, nth)? {
            return Ok(None);
        }
        if t.job.stage() == Stage::Train {
            let seconds = self.rig.rec.step_times().get("actor_train").copied().unwrap_or(0.0);
            let (elastic, mut cx) = self.parts();
            elastic.train_stage_done(&mut cx, seconds, t.job.replicas())?;
        }
        if t.job.next_stage(&self.rig.cfg, &self.rig.task, &mut self.rig.fleet, &mut self.rig.rec)?.is_some() {
            self.submit_stage(t)?;
            return Ok(None);
        }
        self.roll.set_in_training(0);
        let trained = t.job.finish(&self.rig.cfg, &self.rig.task);
        let (staleness, spans) = (std::mem::take(&mut t.staleness), std::mem::take(&mut t.spans));
        Ok(Some(Finished { trained, staleness, spans }))
    }

    /// The step's row: the trainer's phases, both sides' idle shares, staleness and partial
    /// rollouts (verl's names), and the batch's rollout and training metrics.
    pub(super) fn write_row(&mut self, d: Finished) {
        let wall = self.accounts.window.start.elapsed().as_secs_f64();
        self.roll.roll_idle(&mut self.accounts);
        let w = &self.accounts.window;
        let (trainer_idle, rollout_idle, flush) = (w.trainer_idle_s, w.rollout_idle_s, w.flush_s);
        let times = StepTimes { step_s: wall, wait_s: trainer_idle, wall_s: wall };
        let mut row = job::step_row(&self.rig.cfg, &self.rig.task, &self.rig.rec, &d.trained, times);
        row.set("perf/flush_time", flush);
        if wall > 0.0 {
            // The flush idles the trainer's devices as surely as waiting for a batch does.
            row.set("trainer/idle_ratio", (trainer_idle + flush) / wall);
            row.set("trainer/flush_ratio", flush / wall);
            row.set("rollouter/idle_ratio", rollout_idle / (wall * self.roll.own_engines() as f64));
        }
        self.elastic.row(&self.rig.cfg, &self.accounts, &mut row, wall, rollout_idle, self.roll.own_engines());
        let stale = d.staleness.iter().filter(|s| **s > 0).count();
        row.set("fully_async/count/stale_samples_processed", stale as f64);
        row.set("fully_async/count/dropped_stale_samples", self.roll.queue().dropped_samples as f64);
        row.set("fully_async/staleness_mean", mean(d.staleness.iter().map(|s| *s as f64)));
        row.set("fully_async/staleness_max", d.staleness.iter().copied().max().unwrap_or(0) as f64);
        let partial = d.spans.iter().filter(|s| **s > 0).count();
        row.set("partial/partial_ratio", partial as f64 / d.spans.len().max(1) as f64);
        row.set("partial/max_partial_span", d.spans.iter().copied().max().unwrap_or(0) as f64);
        row.set("fully_async/weight_version", self.roll.version() as f64);
        row.set("fully_async/queue_groups", self.roll.queue().len() as f64);
        self.rig.rec.record_step(&row);
        let samples = &d.trained.samples;
        let tokens = samples.iter().map(|s| s.response.len() as u64).sum::<u64>();
        let batch = Batch { samples: samples.len() as u64, tokens, staleness: &d.staleness, partial: partial as u64 };
        let closed = self.accounts.close_window(batch);
        self.elastic.window_closed(closed.lent_idle_s);
    }
}
