//! `relax-colocate plan`: each layout's step time, phase times and samples per second predicted
//! from a job's configuration, without running it: the same compute model, switch model and
//! schedules `relax-colocate compare` charges its runs, played on a modelled clock in
//! milliseconds. What a run measures beyond its model (the runner's round trips and checks on
//! this machine) is left out, so a plan reads a little faster than a simulated run.

mod engine;
mod layouts;
mod responses;

use crate::compare::JobArgs;
use crate::run::config::{self, Config, Mode};
use crate::run::profile;
use layouts::{Job, Predicted};
use responses::Responses;
use serde_json::{Value, json};

#[derive(clap::Args)]
pub struct Options {
    #[command(flatten)]
    pub job: JobArgs,
    /// Print the prediction as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// What compare's runs of this layout would be given, `steps` steps and compute modelled or not:
/// its own flags, then every --set.
pub(crate) fn layout_sets(o: &JobArgs, mode: Mode, steps: u64, model: bool) -> Vec<String> {
    let mut sets = vec![
        format!("run.mode={}", mode.as_str()),
        format!("run.steps={steps}"),
        format!("run.devices={}", o.devices),
        format!("compute.model={model}"),
    ];
    if let Some(file) = &o.lengths {
        let path = std::path::absolute(file).unwrap_or_else(|_| file.clone());
        sets.push(format!("compute.lengths={:?}", path.display().to_string()));
    }
    if mode.split() {
        sets.push(format!("async.max_staleness={}", o.max_staleness));
        for (key, v) in [("run.trainer_devices", &o.trainer_devices), ("run.rollout_devices", &o.rollout_devices)] {
            if let Some(v) = v {
                sets.push(format!("{key}={v:?}"));
            }
        }
    }
    sets.extend(o.sets.iter().cloned());
    sets.extend(crate::compare::layout_overrides(mode));
    sets
}

/// One layout's prediction: its configuration and what its run would take.
fn predict(o: &JobArgs, mode: Mode) -> Result<(Config, Predicted), String> {
    let steps = crate::compare::layout_steps(o, mode, true)?;
    let cfg = config::load(o.config.as_deref(), &layout_sets(o, mode, steps, true))?;
    // The run's own checks, so that a plan refuses what the run would refuse, in its words.
    cfg.validate()?;
    let split = cfg.mode_layout()?;
    let (trainers, rollouts) = match &split {
        Some(s) => (s.trainer.len(), s.rollout.len()),
        None => (cfg.total_devices(), cfg.total_devices()),
    };
    let m = &cfg.memory;
    let prof = profile::build(&m.profile, m.tp, m.scale, m.kv_cache_gib)?;
    let model = crate::run::learn::compute_model_of(&cfg, trainers, &prof).expect("compute.model is on");
    let switch = crate::run::switch::SwitchModel::new(&cfg);
    let responses = responses_of(&cfg);
    let job = Job { cfg: &cfg, model, switch, responses: &responses };
    let predicted = match split {
        None => layouts::colocate(&job),
        Some(_) => layouts::apart(&job, trainers, rollouts),
    };
    Ok((cfg, predicted))
}

/// The responses a run of `cfg` samples: colocated, each engine's request from one stream; apart,
/// every group async engines may start (the run's batches, then as far ahead as the queue lets
/// them and a request beyond), each sequence from its own.
fn responses_of(cfg: &Config) -> Responses {
    if cfg.run.mode == Mode::Colocate {
        return Responses::sample_colocated(cfg, cfg.run.steps, cfg.total_devices());
    }
    let engines = cfg.mode_layout().ok().flatten().map_or(1, |s| s.rollout.len());
    let ahead = cfg.queue_capacity().saturating_add(engines.saturating_mul(cfg.engine_groups(engines)));
    Responses::sample(cfg, (cfg.run.steps as usize).saturating_mul(cfg.rollout.prompts_per_step).saturating_add(ahead))
}

/// Where the job's response lengths come from, and their mean, 90th percentile and longest in
/// modelled tokens.
fn responses_about(cfg: &Config) -> Value {
    if let Some((t, steps)) = cfg.lengths_drawn() {
        let mut about = json!({
            "source": cfg.compute.lengths,
            "mean_tokens": t.mean,
            "p90_tokens": t.p90,
            "max_tokens": t.max,
        });
        if let Some(steps) = steps {
            about["steps"] = json!(steps);
        }
        return about;
    }
    let (mean, p90, max) = responses_of(cfg).stats();
    let scale = cfg.compute.token_scale;
    json!({
        "source": "the built-in policy at its initial weights",
        "mean_tokens": mean * scale,
        "p90_tokens": p90 as f64 * scale,
        "max_tokens": max as f64 * scale,
    })
}

/// What the plan of this job leaves out that its runs would do, said rather than hidden.
fn notes(cfg: &Config) -> Vec<String> {
    let mut notes = Vec::new();
    // Below this the built-in policy's lengths do not move over a run (jobs/long-tail.toml holds
    // it still at 1e-9).
    if cfg.compute.lengths_table.is_none() && cfg.algo.lr > 1e-6 {
        notes.push(format!(
            "the policy learns (algo.lr = {}): the plan charges its initial responses at every step, where a run's \
             change as it learns; give your lengths with --lengths FILE, or hold the policy still (algo.lr = 1e-9)",
            cfg.algo.lr
        ));
    }
    if let Some(s) = cfg.lengths_steps().filter(|s| s.steps_past_last > 0) {
        let which = match s.steps_past_last {
            1 => "the job's last step stands for a step".to_string(),
            n => format!("the job's last {n} steps stand for steps"),
        };
        notes.push(format!(
            "{which} past the lengths file's last ({}), charged that step's lengths; plan fewer steps, or an earlier \
             compute.lengths_first_step",
            s.file_last
        ));
    }
    notes
}

/// A layout whose batch the job file's `[layouts]` section changed: what its steps are.
fn own_batch_note(cfg: &Config) -> Option<String> {
    let (own, job) = (cfg.rollout.prompts_per_step as u64, cfg.clock_prompts());
    let steps = cfg.run.steps;
    (own != job).then(|| crate::compare::own_batch_note(cfg.run.mode.as_str(), own, steps, job, steps * own / job))
}

/// A layout's figures, under compare.json's names where it has them.
fn figures(cfg: &Config, p: &Predicted) -> Value {
    let steps = p.step_s.len();
    let batch = (cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt) as f64;
    let run_s: f64 = p.step_s.iter().sum();
    // After the job's first batch: as many of this layout's steps as hold it.
    let first = cfg.steps_in_job_batch();
    let after: f64 = p.step_s.iter().skip(first).sum();
    let per_step = |s: f64| if steps > 0 { s / steps as f64 } else { 0.0 };
    let phases: serde_json::Map<String, Value> =
        p.phases.iter().map(|(k, v)| (k.to_string(), json!(per_step(*v)))).collect();
    json!({
        "steps": steps,
        "prompts_per_step": cfg.rollout.prompts_per_step,
        "samples_per_s": if run_s > 0.0 { steps as f64 * batch / run_s } else { 0.0 },
        "samples_per_s_after_first_step": (steps > first && after > 0.0).then(|| (steps - first) as f64 * batch / after),
        "step_s": if steps > first { after / (steps - first) as f64 } else { per_step(run_s) },
        "first_step_s": p.step_s.first(),
        "step_times_s": p.step_s,
        "run_s": run_s,
        "phases": phases,
        "slot_occupancy": p.slot_occupancy(),
        "kv_preemptions": p.preemptions,
        "lends": (cfg.run.mode == Mode::Elastic).then_some(p.lends),
        "rollout_lends": (cfg.run.mode == Mode::Elastic && cfg.elastic.lend_rollout).then_some(p.rollout_lends),
    })
}

/// The fastest layout by samples per second after the first step, each one's ratio to it, and
/// whether its lead over the next is under compare's tie margin (then no layout is named).
fn verdict(layouts: &serde_json::Map<String, Value>) -> Value {
    let rate = |v: &Value| v["samples_per_s_after_first_step"].as_f64().or(v["samples_per_s"].as_f64()).unwrap_or(0.0);
    let mut ranked: Vec<(&String, f64)> = layouts.iter().map(|(n, v)| (n, rate(v))).collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    let Some(&(name, best)) = ranked.first() else { return Value::Null };
    let ratios: serde_json::Map<String, Value> =
        ranked[1..].iter().map(|(n, r)| (format!("{name}_over_{n}"), json!(best / r.max(f64::MIN_POSITIVE)))).collect();
    let margin = ranked.get(1).map(|(_, r)| best / r.max(f64::MIN_POSITIVE) - 1.0);
    json!({
        "layout": name,
        "runner_up": ranked.get(1).map(|(n, _)| n),
        "margin": margin,
        "tie": margin.is_some_and(|m| m < crate::compare::TIE_MARGIN),
        "by": "samples_per_s_after_first_step",
        "ratios": ratios,
    })
}

pub fn main(o: &Options) -> u8 {
    let mut layouts = serde_json::Map::new();
    let mut about = Value::Null;
    let mut own_batches = Vec::new();
    for &mode in &o.job.layouts {
        match predict(&o.job, mode) {
            Ok((cfg, p)) => {
                own_batches.extend(own_batch_note(&cfg));
                if about.is_null() {
                    about = json!({
                        "profile": cfg.memory.profile,
                        "device": cfg.compute.device,
                        "devices": cfg.total_devices(),
                        "prompts_per_step": cfg.clock_prompts(),
                        "samples_per_prompt": cfg.rollout.samples_per_prompt,
                        "token_scale": cfg.compute.token_scale,
                    });
                    about["responses"] = responses_about(&cfg);
                    about["notes"] = json!(notes(&cfg));
                }
                layouts.insert(mode.as_str().to_string(), figures(&cfg, &p));
            }
            Err(e) => {
                eprintln!("relax-colocate plan: the {} layout: {e}", mode.as_str());
                return 2;
            }
        }
    }
    if let Some(notes) = about["notes"].as_array_mut() {
        notes.extend(own_batches.into_iter().map(Value::from));
    }
    let verdict = verdict(&layouts);
    let report = json!({"job": about, "layouts": layouts, "verdict": verdict});
    if o.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("json"));
    } else {
        let order: Vec<&str> = o.job.layouts.iter().map(|m| m.as_str()).collect();
        print!("{}", table(&report, &order));
    }
    0
}

/// The table, its rows in the order the layouts were asked for.
fn table(report: &Value, order: &[&str]) -> String {
    let j = &report["job"];
    let r = &j["responses"];
    let tokens = |k: &str| r[k].as_f64().unwrap_or(0.0);
    let steps = serde_json::from_value::<crate::run::summary::LengthsSteps>(r["steps"].clone())
        .map(|s| s.describe())
        .unwrap_or_default();
    let mut out = format!(
        "job: {} on {} {} device(s), {} prompts x {} samples a step; responses ({}{steps}): mean {:.0}, p90 {:.0}, \
         longest {:.0} tokens\npredicted from the compute and switch models, without running (the runner's own \
         overhead on this machine is not in it):\n\n",
        j["profile"].as_str().unwrap_or("?"),
        j["devices"],
        j["device"].as_str().unwrap_or("?"),
        j["prompts_per_step"],
        j["samples_per_prompt"],
        r["source"].as_str().unwrap_or("?"),
        tokens("mean_tokens"),
        tokens("p90_tokens"),
        tokens("max_tokens"),
    );
    // The reverse lend's column only where a layout was asked for it (elastic.lend_rollout).
    let reverse = order.iter().any(|name| report["layouts"][name]["rollout_lends"].is_number());
    let reverse_column = |s: &str| if reverse { format!(" {s:>13}") } else { String::new() };
    out += &format!(
        "{:<10} {:>12} {:>12} {:>16} {:>10} {:>10} {:>10} {:>6}{}\n",
        "layout",
        "step (s)",
        "samples/s",
        "after step 1",
        "generate",
        "train",
        "occupancy",
        "lends",
        reverse_column("rollout lends"),
    );
    for name in order {
        let f = &report["layouts"][name];
        let ph = |k: &str| f["phases"][k].as_f64().unwrap_or(0.0);
        let train = ph("ref_log_probs") + ph("log_probs") + ph("values") + ph("actor_train");
        let num = |v: &Value, d: usize| v.as_f64().map_or("-".to_string(), |x| format!("{x:.d$}"));
        out += &format!(
            "{:<10} {:>12} {:>12} {:>16} {:>10} {:>10} {:>10} {:>6}{}\n",
            name,
            num(&f["step_s"], 2),
            num(&f["samples_per_s"], 1),
            num(&f["samples_per_s_after_first_step"], 1),
            num(&f["phases"]["generate"], 2),
            format!("{train:.2}"),
            num(&f["slot_occupancy"], 2),
            num(&f["lends"], 0),
            reverse_column(&num(&f["rollout_lends"], 0)),
        );
    }
    for note in report["job"]["notes"].as_array().into_iter().flatten() {
        out += &format!("note: {}\n", note.as_str().unwrap_or_default());
    }
    let v = &report["verdict"];
    if let Some(best) = v["layout"].as_str() {
        let margin = 100.0 * v["margin"].as_f64().unwrap_or(0.0);
        out += &if v["tie"] == true {
            format!(
                "\nno clear winner: {best} leads {} by {margin:.1}%, under the {:.0}% compare calls a tie",
                v["runner_up"].as_str().unwrap_or("?"),
                100.0 * crate::compare::TIE_MARGIN
            )
        } else {
            format!("\nfastest: {best} (samples/s after step 1)")
        };
        for (k, v) in report["verdict"]["ratios"].as_object().into_iter().flatten() {
            out += &format!("; {k} {:.2}x", v.as_f64().unwrap_or(0.0));
        }
        out += "\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layouts(rates: &[(&str, f64)]) -> serde_json::Map<String, Value> {
        rates.iter().map(|(n, r)| (n.to_string(), json!({"samples_per_s_after_first_step": r}))).collect()
    }

    /// A learning policy without a lengths file is said; lending the rollout's devices is
    /// modelled, so it needs no note.
    #[test]
    fn a_plan_says_what_it_leaves_out() {
        let cfg = |sets: &[&str]| config::load(None, &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        assert!(notes(&cfg(&["algo.lr=1e-9"])).is_empty());
        let learning = notes(&cfg(&["algo.lr=0.05"]));
        assert!(learning.len() == 1 && learning[0].contains("--lengths FILE"), "{learning:?}");
        let lending =
            notes(&cfg(&["algo.lr=1e-9", "run.mode=\"elastic\"", "run.devices=2", "elastic.lend_rollout=true"]));
        assert!(lending.is_empty(), "{lending:?}");
    }

    /// Figures after step 1 count the same samples in every layout: a layout in parts of a
    /// quarter of the job's batch leaves out its first four steps, not its first one.
    #[test]
    fn after_step_1_leaves_out_the_jobs_first_batch_in_every_layout() {
        let sets = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mut parts = config::load(None, &sets(&["rollout.prompts_per_step=8", "run.steps=8"])).unwrap();
        parts.rollout.job_prompts_per_step = 32;
        let predicted = Predicted { step_s: vec![10.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0], ..Default::default() };
        let f = figures(&parts, &predicted);
        let batch = 8.0 * parts.rollout.samples_per_prompt as f64;
        assert_eq!(f["samples_per_s_after_first_step"].as_f64(), Some(4.0 * batch / 8.0), "{f}");
        assert_eq!(f["step_s"].as_f64(), Some(2.0), "{f}");
        parts.rollout.job_prompts_per_step = 0;
        let whole = figures(&parts, &predicted);
        assert_eq!(whole["samples_per_s_after_first_step"].as_f64(), Some(7.0 * batch / 11.0), "{whole}");
    }

    /// The fastest is named with its lead; a lead under compare's tie margin is a tie.
    #[test]
    fn the_verdict_names_the_fastest_and_calls_a_lead_under_5_percent_a_tie() {
        let v = verdict(&layouts(&[("colocate", 9.0), ("async", 21.0), ("elastic", 21.3)]));
        assert_eq!(
            (v["layout"].as_str(), v["runner_up"].as_str(), v["tie"].as_bool()),
            (Some("elastic"), Some("async"), Some(true))
        );
        assert!((v["ratios"]["elastic_over_colocate"].as_f64().unwrap() - 21.3 / 9.0).abs() < 1e-12);
        let v = verdict(&layouts(&[("colocate", 9.0), ("async", 21.0)]));
        assert_eq!((v["layout"].as_str(), v["tie"].as_bool()), (Some("async"), Some(false)));
        assert!((v["margin"].as_f64().unwrap() - (21.0 / 9.0 - 1.0)).abs() < 1e-12);
    }
}
