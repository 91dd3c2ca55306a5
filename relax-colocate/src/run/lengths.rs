//! A job's own response lengths (compute.lengths, `--lengths FILE`): the modelled length of every
//! sample drawn from a file of real ones. The draw depends on the sample's identity alone (the
//! run's seed, its prompt's place in the run's order of prompts, its place in the group), never on
//! a layout's schedule or a worker's state, so that every layout charges the same sample the same
//! length, and a predictor can draw them without running the job.
//!
//! A file whose lines each name their training step (JSON lines' `step`) gives lengths that change
//! over the run, as a learning policy's do: a sample then draws from the lines of the step its
//! batch stands for (the batch's place in the run's order, from compute.lengths_first_step), which
//! is again the sample's identity, the same in every layout.

use std::path::Path;

/// The response lengths of a file, in modelled tokens.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Lengths {
    /// As the file gives them (at least one, each >= 1).
    values: Vec<u64>,
    /// With a step on every line: each step's lengths, by step ascending. Empty: the file names no
    /// steps, and every sample draws from all of it.
    steps: Vec<(u64, Vec<u64>)>,
}

impl Lengths {
    /// Reads `path`: one response length per line (a positive whole number of tokens), blank lines
    /// and `#` comments skipped; or JSON lines, each an object with a numeric `length` (or
    /// `response_length`). The error names the file, the line and what to write instead.
    pub(crate) fn load(path: &Path) -> Result<Lengths, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Lengths::parse(&text, &path.display().to_string())
    }

    /// `load`'s parser, `name` the file as its errors call it. Either every line names its step
    /// or none does: a file that mixes them would leave some lengths at no step.
    pub(crate) fn parse(text: &str, name: &str) -> Result<Lengths, String> {
        let mut values = Vec::new();
        let mut by_step = std::collections::BTreeMap::<u64, Vec<u64>>::new();
        // The first length's line, and whether it named a step.
        let mut first: Option<(usize, bool)> = None;
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = format!("{name} line {}", i + 1);
            let (value, step) =
                if line.starts_with('{') { json_length(line, &at)? } else { (plain_length(line, &at)?, None) };
            let (first_line, stepped) = *first.get_or_insert((i + 1, step.is_some()));
            if stepped != step.is_some() {
                let (with, without) = if stepped { (first_line, i + 1) } else { (i + 1, first_line) };
                return Err(format!(
                    "{name}: line {with} names its step and line {without} does not: give every line a \"step\" \
                     (JSON lines, e.g. {{\"step\": 12, \"length\": 1834}}) or none"
                ));
            }
            if let Some(step) = step {
                by_step.entry(step).or_default().push(value);
            }
            values.push(value);
        }
        if values.is_empty() {
            return Err(format!(
                "{name} holds no response lengths: write one per line (tokens, e.g. 1834), or JSON lines with a \
                 \"length\" field"
            ));
        }
        Ok(Lengths { values, steps: by_step.into_iter().collect() })
    }

    /// The first and last step the file names; None for a file without steps.
    pub(crate) fn step_span(&self) -> Option<(u64, u64)> {
        Some((self.steps.first()?.0, self.steps.last()?.0))
    }

    /// The lengths a sample of the file's `step` draws from, and the step they were logged at:
    /// that step's, or the closest step before it the file gives (a run logged every few steps),
    /// or before the first, the first's. A file without steps gives all its lengths at any step.
    fn at_step(&self, step: u64) -> (Option<u64>, &[u64]) {
        if self.steps.is_empty() {
            return (None, &self.values);
        }
        let k = self.steps.partition_point(|(s, _)| *s <= step).max(1) - 1;
        (Some(self.steps[k].0), &self.steps[k].1)
    }

    /// The figures of what a run whose steps stand for the file's steps `from..=to` draws: the
    /// lines those steps draw from, each of the run's steps weighing the same (a step's lines
    /// share its weight, a logged step that stands for several weighs as many), as the run
    /// charges them. A file without steps: all of it, every line alike.
    pub(crate) fn figures_between(&self, from: u64, to: u64) -> Figures {
        if self.steps.is_empty() {
            return self.figures();
        }
        let to = to.max(from);
        let (mut count, mut weighted) = (0, Vec::new());
        for (k, (step, values)) in self.steps.iter().enumerate() {
            // The steps this one's lines stand for: itself up to the next logged one (the first
            // also stands for any before it, the last for any after).
            let lo = if k == 0 { 0 } else { *step };
            let hi = self.steps.get(k + 1).map_or(u64::MAX, |(next, _)| next - 1);
            let (a, b) = (lo.max(from), hi.min(to));
            if a > b {
                continue;
            }
            count += values.len();
            let weight = (b - a) as f64 + 1.0;
            weighted.extend(values.iter().map(|v| (*v, weight / values.len() as f64)));
        }
        Figures::weighted(count, weighted)
    }

    /// The figures of the whole file, every line alike.
    pub(crate) fn figures(&self) -> Figures {
        Figures::weighted(self.values.len(), self.values.iter().map(|v| (*v, 1.0)).collect())
    }

    /// The modelled response length (tokens) of sample `sample` of the group of the prompt at
    /// `prompt` in the run's order of prompts (from 0: step 1's batch first), in a run of `seed`,
    /// its batch standing for the file's `step` (of no account in a file without steps). Each of
    /// the step's lines is equally likely; the same identity always draws the same line.
    pub(crate) fn draw(&self, seed: u64, prompt: u64, sample: u64, step: u64) -> u64 {
        let values = self.at_step(step).1;
        let h = mix(mix(mix(seed ^ 0x6C65_6E67_7468_7321) ^ prompt) ^ sample);
        // The high bits of a 128-bit product: uniform over the lines without a modulo's bias.
        let k = ((u128::from(h) * values.len() as u128) >> 64) as usize;
        values[k]
    }
}

/// How many lengths a run draws from, and their mean, median, 90th percentile and longest.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Figures {
    pub(crate) count: usize,
    pub(crate) mean: f64,
    pub(crate) p50: u64,
    pub(crate) p90: u64,
    pub(crate) max: u64,
}

impl Figures {
    /// From lengths with their weights (at least one, every weight above 0); the percentiles
    /// by nearest rank: the least length whose share of the weight at or below it reaches q.
    fn weighted(count: usize, mut values: Vec<(u64, f64)>) -> Figures {
        values.sort_by_key(|(v, _)| *v);
        let total: f64 = values.iter().map(|(_, w)| w).sum();
        let mean = values.iter().map(|(v, w)| *v as f64 * w).sum::<f64>() / total;
        // The slack keeps a rank that is a whole number (q = 0.5 of 10 lines) from missing it by
        // a rounding error.
        let quantile = |q: f64| {
            let target = q * total * (1.0 - 1e-12);
            let mut seen = 0.0;
            values.iter().find(|(_, w)| {
                seen += w;
                seen >= target
            })
        };
        let at = |q: f64| quantile(q).or(values.last()).map_or(0, |(v, _)| *v);
        Figures { count, mean, p50: at(0.5), p90: at(0.9), max: values.last().map_or(0, |(v, _)| *v) }
    }
}

/// splitmix64's finalizer: every input bit reaches every output bit.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A line that is a length alone.
fn plain_length(line: &str, at: &str) -> Result<u64, String> {
    match line.parse::<i128>() {
        Ok(v) if v >= 1 && v <= i128::from(u32::MAX) => Ok(v as u64),
        Ok(v) if v < 1 => Err(format!("{at}: {v} is not a response length: lengths are at least 1 token")),
        Ok(v) => Err(format!("{at}: {v} tokens is past any response length this model handles (at most {})", u32::MAX)),
        Err(_) => Err(format!(
            "{at}: {line:?} is not a response length (a positive whole number of tokens, or a JSON object with a \
             \"length\" field)"
        )),
    }
}

/// A JSON line's `length` (or `response_length`), and its `step` if it names one.
fn json_length(line: &str, at: &str) -> Result<(u64, Option<u64>), String> {
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("{at}: not a JSON object ({e}); one object per line"))?;
    let field = ["length", "response_length"].into_iter().find_map(|k| v.get(k).map(|x| (k, x)));
    let Some((key, x)) = field else {
        return Err(format!(
            "{at}: the object has no \"length\" (or \"response_length\") field, e.g. {{\"length\": 1834}}"
        ));
    };
    let step = match v.get("step") {
        None => None,
        Some(s) => match s.as_f64() {
            Some(f) if f.fract() == 0.0 && (0.0..=1e12).contains(&f) => Some(f as u64),
            _ => return Err(format!("{at}: \"step\": {s} is not a training step (a whole number from 0 to 10^12)")),
        },
    };
    match x.as_f64() {
        Some(f) if f.fract() == 0.0 && f >= 1.0 && f <= f64::from(u32::MAX) => Ok((f as u64, step)),
        Some(f) if f < 1.0 => {
            Err(format!("{at}: \"{key}\": {x} is not a response length: lengths are at least 1 token"))
        }
        _ => Err(format!("{at}: \"{key}\": {x} is not a response length (a positive whole number of tokens)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_skip_blanks_and_comments() {
        let l = Lengths::parse("# from last week's run\n1834\n\n  512  \n# tail\n9000\n", "l.txt").unwrap();
        assert_eq!(l.values, vec![1834, 512, 9000]);
        let f = l.figures();
        assert_eq!((f.count, f.p50, f.p90, f.max), (3, 1834, 9000, 9000));
        assert!((f.mean - 3782.0).abs() < 1e-9);
    }

    #[test]
    fn json_lines_read_length_or_response_length() {
        let text = "{\"length\": 100, \"prompt\": \"x\"}\n{\"response_length\": 300.0}\n200\n";
        assert_eq!(Lengths::parse(text, "l.jsonl").unwrap().values, vec![100, 300, 200]);
    }

    #[test]
    fn each_bad_line_is_named_with_its_fix() {
        let err = |text: &str| Lengths::parse(text, "lengths.txt").unwrap_err();
        assert_eq!(
            err("1\n2\n3\n4\n5\n6\nabc\n"),
            "lengths.txt line 7: \"abc\" is not a response length (a positive whole number of tokens, or a JSON \
             object with a \"length\" field)"
        );
        assert!(err("12.5\n").starts_with("lengths.txt line 1: \"12.5\" is not a response length"));
        assert!(err("0\n").contains("line 1: 0 is not a response length: lengths are at least 1 token"));
        assert!(err("5\n-3\n").contains("line 2: -3 is not a response length"));
        assert!(err("99999999999\n").contains("past any response length"));
        assert!(err("").contains("lengths.txt holds no response lengths"));
        assert!(err("# only a comment\n\n").contains("holds no response lengths"));
        assert!(err("{\"tokens\": 5}\n").contains("line 1: the object has no \"length\""));
        assert!(err("{\"length\": \"long\"}\n").contains("line 1: \"length\": \"long\" is not a response length"));
        assert!(err("{\"length\": 0}\n").contains("lengths are at least 1 token"));
        assert!(err("{\"length\": 2.5}\n").contains("is not a response length"));
        assert!(err("{\"length\": 5\n").contains("line 1: not a JSON object"));
        let missing = Lengths::load(Path::new("/nonexistent/lengths.txt")).unwrap_err();
        assert!(missing.starts_with("cannot read /nonexistent/lengths.txt"), "{missing}");
    }

    #[test]
    fn a_sample_draws_the_same_length_whoever_asks_and_others_vary() {
        let l = Lengths::parse(&(1..=1000).map(|v| format!("{v}\n")).collect::<String>(), "l").unwrap();
        assert_eq!(l.draw(7, 123, 4, 0), l.draw(7, 123, 4, 0));
        assert_eq!(l.clone().draw(7, 123, 4, 0), l.draw(7, 123, 4, 0), "no state between draws");
        // Any part of the identity changes the draw (1000 lines: a repeat is a 1-in-1000 chance).
        let base = l.draw(7, 123, 4, 0);
        let others = [l.draw(8, 123, 4, 0), l.draw(7, 124, 4, 0), l.draw(7, 123, 5, 0), l.draw(7, 4, 123, 0)];
        assert!(others.iter().filter(|o| **o == base).count() <= 1, "{base} {others:?}");
    }

    #[test]
    fn draws_follow_the_file_s_distribution() {
        // A long tail: 80% short, 15% medium, 5% long.
        let text = "500\n".repeat(16) + &"4000\n".repeat(3) + "16000\n";
        let l = Lengths::parse(&text, "l").unwrap();
        let n = 200_000u64;
        let mut counts = [0u64; 3];
        let mut sum = 0.0;
        for p in 0..n / 8 {
            for j in 0..8 {
                let v = l.draw(1, p, j, 0);
                counts[[500, 4000, 16000].iter().position(|x| *x == v).expect("a file value")] += 1;
                sum += v as f64;
            }
        }
        let share = |c: u64| c as f64 / n as f64;
        for (got, want) in counts.iter().zip([0.8, 0.15, 0.05]) {
            assert!((share(*got) - want).abs() < 0.005, "{counts:?}");
        }
        let mean = l.figures().mean;
        assert!((sum / n as f64 - mean).abs() < 0.02 * mean, "{} against {mean}", sum / n as f64);
    }

    #[test]
    fn a_file_with_steps_draws_each_step_from_its_own_lines() {
        let text = "{\"step\": 1, \"length\": 500}\n{\"step\": 1, \"length\": 700}\n\
                    {\"step\": 5, \"response_length\": 3000}\n# logged every few steps\n{\"step\": 3, \"length\": 900}\n";
        let l = Lengths::parse(text, "l.jsonl").unwrap();
        assert_eq!(l.step_span(), Some((1, 5)));
        assert_eq!(l.figures().count, 4, "the file's figures cover every line");
        let drawn = |step: u64| -> Vec<u64> { (0..64).map(|p| l.draw(9, p, 0, step)).collect() };
        // Step 1 draws both of its lines and nothing else.
        let first = drawn(1);
        assert!(first.contains(&500) && first.contains(&700) && first.iter().all(|v| [500, 700].contains(v)));
        // Step 4 was not logged: it draws step 3's; past the last, the last's; before the first, the first's.
        assert!(drawn(3).iter().chain(&drawn(4)).all(|v| *v == 900));
        assert!(drawn(5).iter().chain(&drawn(400)).all(|v| *v == 3000));
        assert!(drawn(0).iter().all(|v| [500, 700].contains(v)));
        // What steps 2..=4 draw from: step 1's two lines (for step 2) and step 3's one (for steps 3
        // and 4), each run step weighing the same: 600 once, 900 twice.
        let window = l.figures_between(2, 4);
        assert_eq!((window.count, window.p50, window.p90, window.max), (3, 900, 900, 900));
        assert!((window.mean - 800.0).abs() < 1e-9, "{window:?}");
        // Steps 5 to 10: step 5's line alone, whichever of them.
        assert_eq!(l.figures_between(5, 10), Figures { count: 1, mean: 3000.0, p50: 3000, p90: 3000, max: 3000 });
        // Steps 1 to 2: step 1's lines stand for both; the median is the lower (nearest rank).
        let early = l.figures_between(1, 2);
        assert_eq!((early.count, early.p50, early.p90, early.max), (2, 500, 700, 700));
        // A file without steps draws from all its lines at any step.
        let plain = Lengths::parse("10\n20\n", "p").unwrap();
        assert_eq!((plain.step_span(), plain.figures_between(7, 9)), (None, plain.figures()));
        assert_eq!(plain.draw(1, 2, 3, 0), plain.draw(1, 2, 3, 99));
    }

    #[test]
    fn a_file_that_mixes_lines_with_and_without_steps_is_refused() {
        let err = |text: &str| Lengths::parse(text, "l.jsonl").unwrap_err();
        assert_eq!(
            err("{\"step\": 1, \"length\": 5}\n\n{\"length\": 6}\n"),
            "l.jsonl: line 1 names its step and line 3 does not: give every line a \"step\" (JSON lines, e.g. \
             {\"step\": 12, \"length\": 1834}) or none"
        );
        assert!(
            err("7\n{\"step\": 2, \"length\": 5}\n").starts_with("l.jsonl: line 2 names its step and line 1 does not")
        );
        assert!(err("{\"step\": -1, \"length\": 5}\n").contains("line 1: \"step\": -1 is not a training step"));
        assert!(err("{\"step\": \"x\", \"length\": 5}\n").contains("is not a training step"));
    }
}
