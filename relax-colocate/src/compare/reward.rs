//! Reward against wall time: how soon each layout reaches a reward level every layout reached.
//!
//! Throughput counts samples; a layout that trains on stale samples may need more of them to
//! learn as much. Published async-against-colocated comparisons report reward (or accuracy)
//! against wall-clock time for that reason, so for a job whose policy learns the comparison
//! measures the same: each run's reward curve, smoothed over a few steps, and the wall time at
//! which it first reaches the target. A job whose reward does not rise (a policy held still) has
//! no such measure, and says so.

use serde_json::{Value, json};

/// Steps in the trailing mean that smooths a reward curve: one step's mean reward over a batch
/// moves by a few hundredths from noise alone.
pub(super) const SMOOTH_STEPS: usize = 3;

/// The least rise of the smoothed reward, from the highest start of any run to the lowest best of
/// any run, for the job to count as learning: below it the target would sit inside the noise.
pub(super) const MIN_RISE: f64 = 0.05;

/// Where the automatic target sits between that start and that best: close to the best, so that
/// the time measures most of the learning, yet below it, so that every run crosses it before its
/// last step.
pub(super) const TARGET_SHARE: f64 = 0.9;

/// A run's reward curve: (wall time at the end of each step, the mean reward of the last
/// `SMOOTH_STEPS` steps).
pub(super) fn curve(steps: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut t = 0.0;
    let mut out = Vec::with_capacity(steps.len());
    for (i, (dt, _)) in steps.iter().enumerate() {
        t += dt;
        let window = &steps[i.saturating_sub(SMOOTH_STEPS - 1)..=i];
        out.push((t, window.iter().map(|(_, r)| r).sum::<f64>() / window.len() as f64));
    }
    out
}

/// The level every run is timed to, with where it came from.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Target {
    pub level: f64,
    /// The highest smoothed reward any run started from, and the lowest best any run reached
    /// (both NaN for a level the user gave).
    pub start: f64,
    pub top: f64,
}

/// The target for these runs' curves: `given`, or `TARGET_SHARE` of the way from the highest
/// start to the lowest best. Err: why there is none (the job did not learn enough).
pub(super) fn target(curves: &[Vec<(f64, f64)>], given: Option<f64>) -> Result<Target, String> {
    if let Some(level) = given {
        return Ok(Target { level, start: f64::NAN, top: f64::NAN });
    }
    let firsts = curves.iter().map(|c| c.first().map_or(f64::NAN, |p| p.1));
    let bests = curves.iter().map(|c| c.iter().map(|p| p.1).fold(f64::NAN, f64::max));
    let start = firsts.fold(f64::NAN, f64::max);
    let top = bests.fold(f64::INFINITY, f64::min);
    // A NaN rise (a run without rewards) does not count as learning either.
    let learned = (top - start).partial_cmp(&MIN_RISE).is_some_and(|o| o.is_ge());
    if curves.iter().any(|c| c.len() <= SMOOTH_STEPS) || !learned {
        return Err(format!(
            "the reward did not rise by {MIN_RISE} in every run (from at most {start:.3} to at least {top:.3}, \
             smoothed over {SMOOTH_STEPS} steps): this job's layouts are judged by throughput alone"
        ));
    }
    Ok(Target { level: start + TARGET_SHARE * (top - start), start, top })
}

/// The wall time at which `curve` first reaches `level`, if it does.
pub(super) fn time_to(curve: &[(f64, f64)], level: f64) -> Option<f64> {
    curve.iter().find(|(_, r)| *r >= level).map(|(t, _)| *t)
}

/// Which layout reaches the target soonest, judged as the throughput verdict is: a winner only
/// when it is at least `tie_margin` sooner than the runner-up and its slowest run beats the
/// runner-up's fastest (with more than one run each). `figs` hold `time_to_reward_s` (a mean) and
/// `time_to_reward_s_runs`; `left_out` names a layout not ranked (an elastic run that lent nothing).
pub(super) fn verdict(
    names: &[&str],
    figs: &[Value],
    target: &Target,
    tie_margin: f64,
    left_out: Option<&str>,
    throughput_winner: &str,
) -> Value {
    let time = |f: &Value| f["time_to_reward_s"].as_f64().unwrap_or(f64::INFINITY);
    let (mut ranked, same_layout_twice) = super::rankable(names, figs, left_out);
    ranked.sort_by(|a, b| time(a.1).total_cmp(&time(b.1)));
    let ((best, first), (runner_up, next)) = (ranked[0], ranked[1]);
    // How many times longer the runner-up takes.
    let margin = time(next) / time(first) - 1.0;
    let runs = |f: &Value| -> Vec<f64> {
        let each = f["time_to_reward_s_runs"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_f64().unwrap_or(f64::INFINITY)).collect());
        each.unwrap_or_else(|| vec![time(f)])
    };
    let (best_runs, next_runs) = (runs(first), runs(next));
    let repeats = best_runs.len().min(next_runs.len());
    let slowest = best_runs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let fastest = next_runs.iter().copied().fold(f64::INFINITY, f64::min);
    let within_spread = repeats > 1 && slowest >= fastest;
    // Neither reached it: margin NaN, a tie. Only the winner reached it: margin infinite, no tie.
    let tie = margin.is_nan() || margin < tie_margin || within_spread || same_layout_twice;
    let finite = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
    json!({
        "target": target.level,
        "start": finite(target.start),
        "top": finite(target.top),
        "layout": best,
        "runner_up": runner_up,
        "seconds": finite(time(first)),
        "runner_up_seconds": finite(time(next)),
        "margin": finite(margin),
        "winner_slowest": finite(slowest),
        "runner_up_fastest": finite(fastest),
        "within_spread": within_spread,
        "tie": tie,
        "clear": !tie && repeats > 1 && time(first).is_finite(),
        "agrees_with_throughput": best == throughput_winner,
    })
}

/// The reward verdict in words.
pub(super) fn line(v: &Value) -> String {
    let s = |k: &str| v[k].as_str().unwrap_or("?").to_string();
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let (best, other) = (s("layout"), s("runner_up"));
    let how = if f("start").is_nan() {
        format!("reward {:.3} (--reward-target)", f("target"))
    } else {
        format!(
            "reward {:.3}, {:.0}% of the way from {:.3} to the lowest best of any run ({:.3}), smoothed over {SMOOTH_STEPS} steps",
            f("target"),
            TARGET_SHARE * 100.0,
            f("start"),
            f("top")
        )
    };
    if f("seconds").is_nan() {
        return format!("learning: no layout reached {how} in these steps");
    }
    let reached = if f("runner_up_seconds").is_nan() {
        format!("{other} did not reach it")
    } else {
        format!("{other} in {:.1} s", f("runner_up_seconds"))
    };
    let mut out = format!("learning: time to {how}: {best} in {:.1} s, {reached}", f("seconds"));
    if v["within_spread"] == true {
        out.push_str(&format!(
            "; no clear winner: {best}'s slowest run ({:.1} s) is not sooner than {other}'s fastest ({:.1} s)",
            f("winner_slowest"),
            f("runner_up_fastest")
        ));
    } else if v["tie"] == true {
        out.push_str("; no clear winner: within the tie margin");
    } else if v["agrees_with_throughput"] == true {
        out.push_str(&format!("; {best} learns {:.2}x sooner, as its throughput says", 1.0 + f("margin")));
    } else {
        out.push_str(&format!(
            "; {best} learns {:.2}x sooner although another layout makes samples faster: for this job bet on \
             time to reward, which counts what stale samples cost",
            1.0 + f("margin")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_curve_is_the_trailing_mean_reward_at_each_steps_end() {
        let c = curve(&[(1.0, 0.0), (2.0, 0.3), (1.0, 0.6), (1.0, 0.9)]);
        let want = [(1.0, 0.0), (3.0, 0.15), (4.0, 0.3), (5.0, 0.6)];
        for ((t, r), (wt, wr)) in c.iter().zip(want) {
            assert!((t - wt).abs() < 1e-12 && (r - wr).abs() < 1e-12, "{c:?}");
        }
        assert_eq!(time_to(&c, 0.3), Some(4.0));
        assert_eq!(time_to(&c, 0.61), None);
    }

    #[test]
    fn the_target_lies_between_the_highest_start_and_the_lowest_best() {
        let rising = |k: f64| curve(&(0..10).map(|i| (1.0, k * i as f64 / 10.0)).collect::<Vec<_>>());
        let t = target(&[rising(1.0), rising(0.5)], None).unwrap();
        assert!((t.start - 0.0).abs() < 1e-12, "{t:?}");
        // The slower learner's best smoothed reward: the mean of 0.35, 0.40, 0.45.
        assert!((t.top - 0.4).abs() < 1e-12 && (t.level - 0.36).abs() < 1e-12, "{t:?}");
        // Both reach it, the faster learner sooner.
        assert!(time_to(&rising(1.0), t.level).unwrap() < time_to(&rising(0.5), t.level).unwrap());
        // A policy held still does not learn; a given level is taken as it is.
        let flat = curve(&[(1.0, 0.1); 10]);
        assert!(target(&[flat.clone(), rising(1.0)], None).unwrap_err().contains("throughput alone"));
        assert_eq!(target(&[flat], Some(0.5)).unwrap().level, 0.5);
    }

    fn fig(runs: &[f64]) -> Value {
        let mean = runs.iter().sum::<f64>() / runs.len() as f64;
        json!({"time_to_reward_s": mean, "time_to_reward_s_runs": runs})
    }

    #[test]
    fn the_layout_that_learns_soonest_wins_only_outside_the_spread() {
        let t = Target { level: 0.4, start: 0.1, top: 0.45 };
        let v = verdict(&["colocate", "async"], &[fig(&[30.0, 31.0]), fig(&[10.0, 11.0])], &t, 0.05, None, "async");
        assert_eq!((v["layout"].as_str(), v["clear"].as_bool()), (Some("async"), Some(true)), "{v}");
        assert!((v["margin"].as_f64().unwrap() - (30.5 / 10.5 - 1.0)).abs() < 1e-12);
        assert!(line(&v).contains("async learns 2.90x sooner, as its throughput says"), "{}", line(&v));
        // Faster samples, slower learning: the line says which to bet on.
        let v = verdict(&["colocate", "async"], &[fig(&[10.0, 11.0]), fig(&[30.0, 31.0])], &t, 0.05, None, "async");
        assert_eq!((v["layout"].as_str(), v["agrees_with_throughput"].as_bool()), (Some("colocate"), Some(false)));
        assert!(line(&v).contains("bet on time to reward"), "{}", line(&v));
        // Overlapping runs: no winner.
        let v = verdict(&["colocate", "async"], &[fig(&[10.0, 20.0]), fig(&[12.0, 13.0])], &t, 0.05, None, "async");
        assert_eq!((v["within_spread"].as_bool(), v["clear"].as_bool()), (Some(true), Some(false)), "{v}");
        // One run each is never clear; a layout left out is not ranked.
        let v = verdict(
            &["colocate", "async", "elastic"],
            &[fig(&[30.0]), fig(&[10.0]), fig(&[5.0])],
            &t,
            0.05,
            Some("elastic"),
            "async",
        );
        assert_eq!((v["layout"].as_str(), v["clear"].as_bool()), (Some("async"), Some(false)), "{v}");
        // Async and an elastic run left out, alone: the same layout twice, a tie.
        let v = verdict(
            &["async", "elastic"],
            &[fig(&[10.0, 11.0]), fig(&[30.0, 31.0])],
            &t,
            0.05,
            Some("elastic"),
            "async",
        );
        assert_eq!((v["tie"].as_bool(), v["clear"].as_bool()), (Some(true), Some(false)), "{v}");
    }

    #[test]
    fn a_layout_that_never_reaches_the_target_ranks_last() {
        let t = Target { level: 0.9, start: f64::NAN, top: f64::NAN };
        let never = json!({"time_to_reward_s": null, "time_to_reward_s_runs": [null, null]});
        let v = verdict(&["colocate", "async"], &[never, fig(&[10.0, 11.0])], &t, 0.05, None, "colocate");
        assert_eq!((v["layout"].as_str(), v["runner_up_seconds"].clone()), (Some("async"), Value::Null), "{v}");
        assert!(
            line(&v).contains("colocate did not reach it") && line(&v).contains("(--reward-target)"),
            "{}",
            line(&v)
        );
    }
}
