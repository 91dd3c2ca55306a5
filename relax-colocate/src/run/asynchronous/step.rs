//! The trainer's side of a step: its stages over one batch (reference and actor log-probs, values,
//! advantages, the train request), a request at a time so the engines keep generating, and the
//! step's metrics row.

use super::queue::Group;
use super::{Async, Window};
use crate::run::config::AlgoName;
use crate::run::fleet::InFlight;
use crate::run::learn::{self, Advantages, Sample, Scores};
use crate::run::metrics::{self, mean};
use crate::run::protocol::{
    LogProbs, LogProbsParams, LogProbsReply, Model, Pair, SamplesParams, Train, TrainParams, TrainReply, Values,
    ValuesReply,
};
use crate::run::recorder::Span;
use crate::run::{FailKind, R, Role};
use std::time::Instant;

/// The trainer's passes over one batch, a request at a time so the engines keep generating.
pub(super) struct Job {
    pub(super) samples: Vec<Sample>,
    pub(super) staleness: Vec<u64>,
    pub(super) spans: Vec<u64>,
    /// The modelled tokens per task token of the batch (compute.token_scale_final): each sample's
    /// by the weight versions that generated it, weighted by its tokens. None: init's.
    pub(super) token_scale: Option<f64>,
    pub(super) stage: Stage,
    pub(super) span: Option<Span>,
    pub(super) requests: Vec<InFlight>,
    pub(super) reference: Option<LogProbsReply>,
    pub(super) actor: Option<LogProbsReply>,
    pub(super) values: Option<ValuesReply>,
    pub(super) adv: Option<Advantages>,
    pub(super) train: Option<TrainReply>,
    /// The step ends with a weight update (elastic.lend_rollout lends only then).
    pub(super) publishes: bool,
    /// The trainers (and lent trainers) the train stage went to.
    pub(super) replicas: usize,
}

/// A trained batch, for its metrics row.
pub(super) struct Finished {
    pub(super) samples: Vec<Sample>,
    pub(super) scored: Vec<(f64, bool)>,
    pub(super) scores: Scores,
    pub(super) adv: Advantages,
    pub(super) train: TrainReply,
    pub(super) staleness: Vec<u64>,
    pub(super) spans: Vec<u64>,
    pub(super) token_scale: Option<f64>,
}

/// The trainer's per-token numbers for the job so far.
pub(super) fn job_scores(job: &Job) -> Scores {
    let actor = job.actor.as_ref();
    Scores {
        old_lp: actor.map(|a| a.logprobs.clone()).unwrap_or_default(),
        ref_lp: job.reference.as_ref().map(|r| r.logprobs.clone()).unwrap_or_default(),
        entropy: actor.map(|a| a.entropy.clone()).unwrap_or_default(),
        values: job.values.as_ref().map(|v| v.values.clone()).unwrap_or_default(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    RefLogProbs,
    LogProbs,
    Values,
    Train,
}

impl Stage {
    fn phase(self) -> &'static str {
        match self {
            Stage::RefLogProbs => "ref_log_probs",
            Stage::LogProbs => "log_probs",
            Stage::Values => "values",
            Stage::Train => "actor_train",
        }
    }
}

impl Async {
    /// The trainer's first pass over a batch begins.
    pub(super) fn start_job(&mut self, groups: Vec<Group>, publishes: bool) -> R<Job> {
        let now = self.version;
        let mut samples = Vec::new();
        let (mut staleness, mut spans, mut scaled) = (Vec::new(), Vec::new(), Vec::new());
        for g in &groups {
            for s in &g.seqs {
                let versions = s.versions.iter().map(|v| *v as f64);
                let version = versions.clone().sum::<f64>() / s.versions.len().max(1) as f64;
                scaled.push((g.prompt.len() + s.response.len(), version));
                samples.push(Sample {
                    prompt: g.prompt.clone(),
                    response: s.response.clone(),
                    logprobs: s.logprobs.clone(),
                });
                staleness.push(now - s.oldest(now).min(now));
                spans.push(s.span());
            }
        }
        if let Some(worst) = staleness.iter().max().filter(|w| **w > self.max_staleness()) {
            return Err(self.fail(
                FailKind::Check,
                None,
                format!(
                    "a sample {worst} versions old reached the trainer (async.max_staleness = {})",
                    self.max_staleness()
                ),
            ));
        }
        self.rec.count_check();
        self.training_groups = groups.len();
        let mut job = Job {
            samples,
            staleness,
            spans,
            token_scale: learn::batch_token_scale(&self.cfg, &scaled),
            stage: Stage::RefLogProbs,
            span: None,
            requests: Vec::new(),
            reference: None,
            actor: None,
            values: None,
            adv: None,
            train: None,
            publishes,
            replicas: 0,
        };
        self.submit_stage(&mut job)?;
        Ok(job)
    }

    pub(super) fn pairs(job: &Job) -> Vec<Pair> {
        job.samples.iter().map(|s| Pair { prompt: s.prompt.clone(), response: s.response.clone() }).collect()
    }

    /// Sends the job's current stage to every trainer (replicas get the same request).
    pub(super) fn submit_stage(&mut self, job: &mut Job) -> R<()> {
        let mut targets = self.fleet.indices(Role::Trainer);
        if job.stage == Stage::Train && self.rollout_lending.is_some() {
            self.consider_lending_rollout(job.publishes)?;
            targets.extend(self.rollout_lending.as_ref().map(|l| l.lent_trainers()).unwrap_or_default());
        }
        // With elastic.lend_rollout every train request says its replicas, lent or not.
        let replicas = self.rollout_lending.is_some().then_some(targets.len() as f64);
        job.replicas = targets.len();
        job.span = Some(self.rec.begin(job.stage.phase()));
        let (step, token_scale) = (self.step(), job.token_scale);
        let mut requests = Vec::new();
        for i in targets {
            let r = match job.stage {
                Stage::RefLogProbs | Stage::LogProbs => {
                    let model = if job.stage == Stage::RefLogProbs { Model::Ref } else { Model::Actor };
                    self.fleet
                        .submit::<LogProbs>(i, LogProbsParams { model, samples: Self::pairs(job), step, token_scale })?
                }
                Stage::Values => {
                    self.fleet.submit::<Values>(i, SamplesParams { samples: Self::pairs(job), step, token_scale })?
                }
                Stage::Train => {
                    let scores = job_scores(job);
                    let adv = job.adv.as_ref().expect("advantages before train");
                    let params = learn::train_params(&self.cfg, &job.samples, &scores, adv, step, token_scale);
                    self.fleet.submit::<Train>(i, TrainParams { replicas, ..params })?
                }
            };
            requests.push(r);
        }
        job.requests = requests;
        Ok(())
    }

    /// The `nth` of the job's requests answered: read it; when every trainer has, the stage ends
    /// and the next begins. Returns the finished batch after training.
    pub(super) fn advance(&mut self, job: &mut Job, nth: usize) -> R<Option<Finished>> {
        let request = job.requests.remove(nth);
        let n = job.samples.len();
        let wrong = |what: &str| format!("{what} returned the wrong number of sequences");
        match job.stage {
            Stage::RefLogProbs | Stage::LogProbs => {
                let r = self.fleet.collect::<LogProbs>(request)?;
                if r.logprobs.len() != n {
                    return Err(self.fail(FailKind::Worker, None, wrong("log_probs")));
                }
                let slot = if job.stage == Stage::RefLogProbs { &mut job.reference } else { &mut job.actor };
                slot.get_or_insert(r);
            }
            Stage::Values => {
                let r = self.fleet.collect::<Values>(request)?;
                job.values.get_or_insert(r);
            }
            Stage::Train => {
                let r = self.fleet.collect::<Train>(request)?;
                job.train.get_or_insert(r);
            }
        }
        if !job.requests.is_empty() {
            return Ok(None);
        }
        let span = job.span.take().expect("a stage under way");
        self.rec.end(span, &self.fleet)?;
        if job.stage == Stage::Train {
            let seconds = self.rec.step_times().get("actor_train").copied().unwrap_or(0.0);
            self.train_stage_done(seconds, job.replicas);
            self.reclaim_rollout()?;
        }
        job.stage = match job.stage {
            Stage::RefLogProbs => Stage::LogProbs,
            Stage::LogProbs if self.cfg.algo.name == AlgoName::Ppo => Stage::Values,
            Stage::LogProbs | Stage::Values => {
                let span = self.rec.begin("advantages");
                let rewards: Vec<f64> = job
                    .samples
                    .iter()
                    .map(|s| self.task.score(&s.prompt, &s.response, self.cfg.task.reward).0)
                    .collect();
                let scores = job_scores(job);
                let adv = learn::advantages(&self.cfg, &job.samples, &rewards, &scores)
                    .map_err(|e| self.fail(FailKind::Worker, None, e))?;
                job.adv = Some(adv);
                self.rec.end(span, &self.fleet)?;
                Stage::Train
            }
            Stage::Train => {
                self.training_groups = 0;
                return Ok(Some(self.finished(job)));
            }
        };
        self.submit_stage(job)?;
        Ok(None)
    }

    /// The trained batch's numbers, taken out of the job.
    pub(super) fn finished(&self, job: &mut Job) -> Finished {
        let scores = job_scores(job);
        let samples = std::mem::take(&mut job.samples);
        let reward = self.cfg.task.reward;
        let scored = samples.iter().map(|s| self.task.score(&s.prompt, &s.response, reward)).collect();
        Finished {
            samples,
            scored,
            scores,
            adv: job.adv.take().expect("advantages before train"),
            train: job.train.take().unwrap_or_default(),
            staleness: std::mem::take(&mut job.staleness),
            spans: std::mem::take(&mut job.spans),
            token_scale: job.token_scale,
        }
    }

    /// The step's row: the trainer's phases, both sides' idle shares, staleness and partial
    /// rollouts (verl's names), and the batch's rollout and training metrics.
    pub(super) fn write_row(&mut self, d: Finished) {
        let wall = self.window.start.elapsed().as_secs_f64();
        let now = Instant::now();
        for e in self.engines.iter_mut() {
            // An idle engine's time so far counts in this window; the next starts now.
            if let Some(t) = e.idle_since.as_mut() {
                let idle = now.duration_since(*t).as_secs_f64();
                *t = now;
                if e.lent {
                    self.window.lent_idle_s += idle;
                } else {
                    self.window.rollout_idle_s += idle;
                }
            }
        }
        let mut row = metrics::Row::new(self.step());
        let times = self.rec.step_times();
        let t = |k: &str| times.get(k).copied().unwrap_or(0.0);
        let train_time = t("ref_log_probs") + t("log_probs") + t("values") + t("advantages") + t("actor_train");
        for (k, v) in times {
            row.set(&metrics::phase_time(k), *v);
        }
        let (trainer_idle, rollout_idle) = (self.window.trainer_idle_s, self.window.rollout_idle_s);
        let flush = self.window.flush_s;
        row.set("perf/train_time", train_time);
        row.set("perf/train_wait_time", trainer_idle);
        row.set("perf/flush_time", flush);
        row.set("perf/step_time", wall);
        row.set("perf/wall_step_time", wall);
        if wall > 0.0 {
            row.set("perf/wait_time_ratio", trainer_idle / wall);
            // The flush idles the trainer's devices as surely as waiting for a batch does.
            row.set("trainer/idle_ratio", (trainer_idle + flush) / wall);
            row.set("trainer/flush_ratio", flush / wall);
            row.set("rollouter/idle_ratio", rollout_idle / (wall * self.own_engines() as f64));
        }
        if self.lending.is_some() {
            self.lending_row(&mut row, wall);
        }
        if self.rollout_lending.is_some() {
            self.rollout_lending_row(&mut row, wall, rollout_idle);
        }
        if let Some(scale) = d.token_scale {
            row.set("compute/token_scale", scale);
        }
        let stale = d.staleness.iter().filter(|s| **s > 0).count();
        row.set("fully_async/count/stale_samples_processed", stale as f64);
        row.set("fully_async/count/dropped_stale_samples", self.queue.dropped_samples as f64);
        row.set("fully_async/staleness_mean", mean(d.staleness.iter().map(|s| *s as f64)));
        row.set("fully_async/staleness_max", d.staleness.iter().copied().max().unwrap_or(0) as f64);
        let partial = d.spans.iter().filter(|s| **s > 0).count();
        row.set("partial/partial_ratio", partial as f64 / d.spans.len().max(1) as f64);
        row.set("partial/max_partial_span", d.spans.iter().copied().max().unwrap_or(0) as f64);
        row.set("fully_async/weight_version", self.version as f64);
        row.set("fully_async/queue_groups", self.queue.len() as f64);
        let outcome =
            learn::Outcome { samples: &d.samples, scored: &d.scored, scores: &d.scores, adv: &d.adv, train: &d.train };
        learn::sample_metrics(&mut row, &self.cfg, &self.task, &outcome);
        for s in self.rec.step_memory() {
            metrics::add_memory(&mut row, s);
        }
        self.rec.record_step(&row);
        let tot = &mut self.totals;
        tot.samples_trained += d.samples.len() as u64;
        tot.tokens_trained += d.samples.iter().map(|s| s.response.len() as u64).sum::<u64>();
        for s in &d.staleness {
            *tot.staleness.entry(*s).or_default() += 1;
        }
        tot.partial_samples += partial as u64;
        tot.trainer_idle_s += trainer_idle;
        tot.flush_total_s += flush;
        tot.rollout_idle_s += rollout_idle;
        let lent_idle = self.window.lent_idle_s;
        if let Some(l) = self.lending.as_mut() {
            l.add_lent_idle(lent_idle);
        }
        self.window = Window::new();
    }
}
