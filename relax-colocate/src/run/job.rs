//! The trainer's work on one batch, declared once for every layout: its stages (reference and
//! actor log-probs unless algo.reference = false or algo.rollout_log_probs skip them, PPO's
//! values, the advantages, the train request) with their checks, and the step's metrics row.
//! Colocate drives a job to its end (`run_to_end`); async submits a stage, keeps the engines
//! generating, and hands each answer to `take_reply`.

use super::config::{AlgoName, Config};
use super::fleet::{Fleet, InFlight};
use super::learn::{self, Advantages, Sample, Scores};
use super::metrics::{self, Row};
use super::protocol::{
    LogProbs, LogProbsParams, LogProbsReply, Model, Pair, SamplesParams, Train, TrainParams, TrainReply, Values,
    ValuesReply,
};
use super::recorder::{Recorder, Span};
use super::task::Addition;
use super::{FailKind, R};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    RefLogProbs,
    LogProbs,
    Values,
    Train,
}

impl Stage {
    /// The recorder's phase, under slime's name.
    fn phase(self) -> &'static str {
        match self {
            Stage::RefLogProbs => "ref_log_probs",
            Stage::LogProbs => "log_probs",
            Stage::Values => "values",
            Stage::Train => "actor_train",
        }
    }

    /// Whether the run takes this stage: the reference's pass unless the run has none, the
    /// actor's unless the rollout's log-probs stand for it, the critic's for PPO.
    fn taken(self, cfg: &Config) -> bool {
        match self {
            Stage::RefLogProbs => cfg.algo.reference,
            Stage::LogProbs => !cfg.algo.rollout_log_probs,
            Stage::Values => cfg.algo.name == AlgoName::Ppo,
            Stage::Train => true,
        }
    }

    /// The stage the run takes after `from` (None: its first).
    fn after(from: Option<Stage>, cfg: &Config) -> Stage {
        const ORDER: [Stage; 4] = [Stage::RefLogProbs, Stage::LogProbs, Stage::Values, Stage::Train];
        let start = from.map_or(0, |f| ORDER.iter().position(|s| *s == f).map_or(ORDER.len(), |i| i + 1));
        ORDER.iter().skip(start).copied().find(|s| s.taken(cfg)).unwrap_or(Stage::Train)
    }
}

/// The trainer's passes over one batch; every trainer (replicas) gets the same request.
pub(super) struct Job {
    samples: Vec<Sample>,
    /// The modelled tokens per task token of the batch (compute.token_scale_final); None: init's.
    pub(super) token_scale: Option<f64>,
    /// The batch's modelled tokens with the job's own response lengths (compute.lengths); None:
    /// task tokens x the scale.
    modelled_tokens: Option<f64>,
    /// Of them, the samples' drawn response tokens (for the step's row).
    drawn_response_tokens: Option<f64>,
    stage: Stage,
    span: Option<Span>,
    requests: Vec<InFlight>,
    reference: Option<LogProbsReply>,
    actor: Option<LogProbsReply>,
    values: Option<ValuesReply>,
    adv: Option<Advantages>,
    train: Option<TrainReply>,
    /// The trainers the current stage went to.
    replicas: usize,
    /// algo.rollout_log_probs: the samples' own log-probs are the old ones.
    rollout_old: bool,
}

/// A trained batch: what its metrics row reads.
pub(super) struct Trained {
    pub(super) samples: Vec<Sample>,
    /// (reward, exact) per sample.
    pub(super) scored: Vec<(f64, bool)>,
    pub(super) scores: Scores,
    pub(super) adv: Advantages,
    pub(super) train: TrainReply,
    pub(super) token_scale: Option<f64>,
    /// With compute.lengths: the samples' drawn response tokens.
    pub(super) drawn_response_tokens: Option<f64>,
}

impl Trained {
    pub(super) fn outcome(&self) -> learn::Outcome<'_> {
        learn::Outcome {
            samples: &self.samples,
            scored: &self.scored,
            scores: &self.scores,
            adv: &self.adv,
            train: &self.train,
        }
    }
}

impl Job {
    pub(super) fn new(cfg: &Config, samples: Vec<Sample>, token_scale: Option<f64>) -> Job {
        Job {
            samples,
            token_scale,
            modelled_tokens: None,
            drawn_response_tokens: None,
            stage: Stage::after(None, cfg),
            span: None,
            requests: Vec::new(),
            reference: None,
            actor: None,
            values: None,
            adv: None,
            train: None,
            replicas: 0,
            rollout_old: cfg.algo.rollout_log_probs,
        }
    }

    /// Before the first stage is submitted: the rollout's log-probs checked where they stand for
    /// the actor's, and the advantages computed at once when no pass precedes training.
    pub(super) fn begin(&mut self, cfg: &Config, task: &Addition, fleet: &mut Fleet, rec: &mut Recorder) -> R<()> {
        if self.rollout_old
            && let Some(s) = self.samples.iter().find(|s| s.logprobs.len() != s.response.len())
        {
            let cause = format!(
                "the rollout returned {} log-probs for a response of {} tokens, and algo.rollout_log_probs = true \
                 takes the old log-probs from the rollout, one per token",
                s.logprobs.len(),
                s.response.len()
            );
            return Err(rec.cursor().fail(FailKind::Worker, None, cause));
        }
        if self.stage == Stage::Train && self.adv.is_none() {
            self.advantages(cfg, task, fleet, rec)?;
        }
        Ok(())
    }

    /// The trainer charges the batch at its modelled tokens (compute.lengths: prompts x
    /// token_scale plus each sample's drawn response length; `drawn` gives both totals, as
    /// Config::drawn_tokens does) instead of its task tokens x the scale.
    pub(super) fn with_drawn(mut self, drawn: Option<(f64, f64)>) -> Job {
        (self.modelled_tokens, self.drawn_response_tokens) = (drawn.map(|d| d.0), drawn.map(|d| d.1));
        self
    }

    /// The stage under way, or the next to submit.
    pub(super) fn stage(&self) -> Stage {
        self.stage
    }

    /// The stage's requests not answered yet.
    pub(super) fn requests(&self) -> &[InFlight] {
        &self.requests
    }

    /// How many trainers the current stage went to.
    pub(super) fn replicas(&self) -> usize {
        self.replicas
    }

    /// The trainer's per-token numbers so far.
    fn scores(&self) -> Scores {
        let actor = self.actor.as_ref();
        let rollout = || self.samples.iter().map(|s| s.logprobs.clone()).collect();
        Scores {
            old_lp: match actor {
                Some(a) => a.logprobs.clone(),
                None if self.rollout_old => rollout(),
                None => Vec::new(),
            },
            ref_lp: self.reference.as_ref().map(|r| r.logprobs.clone()).unwrap_or_default(),
            entropy: actor.map(|a| a.entropy.clone()).unwrap_or_default(),
            values: self.values.as_ref().map(|v| v.values.clone()).unwrap_or_default(),
        }
    }

    fn pairs(&self) -> Vec<Pair> {
        self.samples.iter().map(|s| Pair { prompt: s.prompt.clone(), response: s.response.clone() }).collect()
    }

    /// Sends the current stage to `targets` (every trainer; replicas get the same request) and
    /// opens its phase. `replicas`: what the train request says of them (elastic.lend_rollout).
    pub(super) fn submit(
        &mut self,
        cfg: &Config,
        fleet: &mut Fleet,
        rec: &mut Recorder,
        targets: &[usize],
        replicas: Option<f64>,
    ) -> R<()> {
        self.replicas = targets.len();
        self.span = Some(rec.begin(self.stage.phase()));
        let (step, token_scale, modelled_tokens) = (rec.cursor().step(), self.token_scale, self.modelled_tokens);
        let mut requests = Vec::new();
        for &i in targets {
            let r = match self.stage {
                Stage::RefLogProbs | Stage::LogProbs => {
                    let model = if self.stage == Stage::RefLogProbs { Model::Ref } else { Model::Actor };
                    let p = LogProbsParams { model, samples: self.pairs(), step, token_scale, modelled_tokens };
                    fleet.submit::<LogProbs>(i, p)?
                }
                Stage::Values => {
                    let p = SamplesParams { samples: self.pairs(), step, token_scale, modelled_tokens };
                    fleet.submit::<Values>(i, p)?
                }
                Stage::Train => {
                    let adv = self.adv.as_ref().expect("advantages before train");
                    let params = learn::train_params(cfg, &self.samples, &self.scores(), adv, step, token_scale);
                    fleet.submit::<Train>(i, TrainParams { replicas, modelled_tokens, ..params })?
                }
            };
            requests.push(r);
        }
        self.requests = requests;
        Ok(())
    }

    /// The `nth` of the stage's requests answered: read and check it. Returns whether the stage
    /// is done (every trainer answered; its phase closed).
    pub(super) fn take_reply(&mut self, fleet: &mut Fleet, rec: &mut Recorder, nth: usize) -> R<bool> {
        let request = self.requests.remove(nth);
        match self.stage {
            Stage::RefLogProbs | Stage::LogProbs => {
                let r = fleet.collect::<LogProbs>(request)?;
                if r.logprobs.len() != self.samples.len() {
                    let cause = "log_probs returned the wrong number of sequences";
                    return Err(rec.cursor().fail(FailKind::Worker, None, cause));
                }
                let slot = if self.stage == Stage::RefLogProbs { &mut self.reference } else { &mut self.actor };
                slot.get_or_insert(r);
            }
            Stage::Values => {
                let r = fleet.collect::<Values>(request)?;
                self.values.get_or_insert(r);
            }
            Stage::Train => {
                let r = fleet.collect::<Train>(request)?;
                self.train.get_or_insert(r);
            }
        }
        if !self.requests.is_empty() {
            return Ok(false);
        }
        let span = self.span.take().expect("a stage under way");
        rec.end(span, fleet)?;
        Ok(true)
    }

    /// After a stage is done: the next to submit (the advantages computed, in a phase of their
    /// own, before the train stage), or None when the batch is trained.
    pub(super) fn next_stage(
        &mut self,
        cfg: &Config,
        task: &Addition,
        fleet: &mut Fleet,
        rec: &mut Recorder,
    ) -> R<Option<Stage>> {
        if self.stage == Stage::Train {
            return Ok(None);
        }
        self.stage = Stage::after(Some(self.stage), cfg);
        if self.stage == Stage::Train {
            self.advantages(cfg, task, fleet, rec)?;
        }
        Ok(Some(self.stage))
    }

    /// The advantages, in a phase of their own.
    fn advantages(&mut self, cfg: &Config, task: &Addition, fleet: &mut Fleet, rec: &mut Recorder) -> R<()> {
        let span = rec.begin("advantages");
        let reward = cfg.task.reward;
        let rewards: Vec<f64> = self.samples.iter().map(|s| task.score(&s.prompt, &s.response, reward).0).collect();
        let adv = learn::advantages(cfg, &self.samples, &rewards, &self.scores())
            .map_err(|e| rec.cursor().fail(FailKind::Worker, None, e))?;
        self.adv = Some(adv);
        rec.end(span, fleet)
    }

    /// The trained batch's numbers, taken out of the job.
    pub(super) fn finish(&mut self, cfg: &Config, task: &Addition) -> Trained {
        let scores = self.scores();
        let samples = std::mem::take(&mut self.samples);
        let reward = cfg.task.reward;
        let scored = samples.iter().map(|s| task.score(&s.prompt, &s.response, reward)).collect();
        Trained {
            samples,
            scored,
            scores,
            adv: self.adv.take().expect("advantages before train"),
            train: self.train.take().unwrap_or_default(),
            token_scale: self.token_scale,
            drawn_response_tokens: self.drawn_response_tokens,
        }
    }

    /// Every stage on `targets`, one after the other (colocate: the trainer has its devices to
    /// itself, nothing to overlap).
    pub(super) fn run_to_end(
        mut self,
        cfg: &Config,
        task: &Addition,
        fleet: &mut Fleet,
        rec: &mut Recorder,
        targets: &[usize],
    ) -> R<Trained> {
        self.begin(cfg, task, fleet, rec)?;
        loop {
            self.submit(cfg, fleet, rec, targets, None)?;
            while !self.take_reply(fleet, rec, 0)? {}
            if self.next_stage(cfg, task, fleet, rec)?.is_none() {
                return Ok(self.finish(cfg, task));
            }
        }
    }
}

/// The step's times, as each layout accounts them.
pub(super) struct StepTimes {
    /// The step as slime counts it: train_wait + train.
    pub(super) step_s: f64,
    /// Of it, the trainer's wait (colocate: everything but its own stages; async: for a batch).
    pub(super) wait_s: f64,
    /// Wall-clock seconds of the step.
    pub(super) wall_s: f64,
}

/// The trainer's own stages' seconds this step.
pub(super) fn train_seconds(rec: &Recorder) -> f64 {
    let times = rec.step_times();
    let t = |k: &str| times.get(k).copied().unwrap_or(0.0);
    t("ref_log_probs") + t("log_probs") + t("values") + t("advantages") + t("actor_train")
}

/// The step's metrics row under slime's names (metrics.rs renames it for verl), every layout's
/// part: phase times, the step's and its wait, the batch's rollout and training metrics and the
/// fleet's memory. Each layout adds its own figures before the recorder writes it.
pub(super) fn step_row(cfg: &Config, task: &Addition, rec: &Recorder, trained: &Trained, times: StepTimes) -> Row {
    let mut row = Row::new(rec.cursor().step());
    for (k, v) in rec.step_times() {
        row.set(&metrics::phase_time(k), *v);
    }
    row.set("perf/train_time", train_seconds(rec));
    row.set("perf/train_wait_time", times.wait_s);
    row.set("perf/step_time", times.step_s);
    row.set("perf/wall_step_time", times.wall_s);
    if times.step_s > 0.0 {
        row.set("perf/wait_time_ratio", times.wait_s / times.step_s);
    }
    if let Some(scale) = trained.token_scale {
        row.set("compute/token_scale", scale);
    }
    if let Some(tokens) = trained.drawn_response_tokens {
        row.set("compute/drawn_samples", trained.samples.len() as f64);
        row.set("compute/drawn_response_tokens", tokens);
    }
    learn::sample_metrics(&mut row, cfg, task, &trained.outcome());
    for s in rec.step_memory() {
        metrics::add_memory(&mut row, s);
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::config;

    fn cfg(sets: &[&str]) -> Config {
        config::load(None, &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    fn stages(cfg: &Config) -> Vec<Stage> {
        let mut out = vec![Stage::after(None, cfg)];
        while *out.last().unwrap() != Stage::Train {
            out.push(Stage::after(out.last().copied(), cfg));
        }
        out
    }

    /// Each skipped pass is left out of the batch's stages, and the rest keep their order.
    #[test]
    fn skipped_passes_leave_the_stages_in_order() {
        use Stage::*;
        assert_eq!(stages(&cfg(&[])), [RefLogProbs, LogProbs, Train]);
        assert_eq!(stages(&cfg(&["algo.name=ppo"])), [RefLogProbs, LogProbs, Values, Train]);
        let no_ref = ["algo.reference=false", "algo.kl_coef=0"];
        assert_eq!(stages(&cfg(&no_ref)), [LogProbs, Train]);
        assert_eq!(stages(&cfg(&["algo.rollout_log_probs=true"])), [RefLogProbs, Train]);
        let neither = [&no_ref[..], &["algo.rollout_log_probs=true"]].concat();
        assert_eq!(stages(&cfg(&neither)), [Train]);
        assert_eq!(stages(&cfg(&[&neither[..], &["algo.name=ppo"]].concat())), [Values, Train]);
    }

    /// With algo.rollout_log_probs the old log-probs are the samples' own, and there is no entropy
    /// (the actor's pass measured it); otherwise they wait for the actor's pass.
    #[test]
    fn the_old_log_probs_come_from_the_rollout_only_when_asked() {
        let samples = || vec![Sample { prompt: vec![1], response: vec![2, 3], logprobs: vec![-0.5, -1.5] }];
        let rollout = Job::new(&cfg(&["algo.rollout_log_probs=true"]), samples(), None);
        let s = rollout.scores();
        assert_eq!(s.old_lp, vec![vec![-0.5, -1.5]]);
        assert!(s.entropy.is_empty() && s.ref_lp.is_empty());
        assert!(Job::new(&cfg(&[]), samples(), None).scores().old_lp.is_empty());
    }
}
