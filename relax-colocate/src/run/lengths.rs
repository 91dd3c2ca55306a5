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
    /// The same, sorted, for the percentiles.
    sorted: Vec<u64>,
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
        Ok(Lengths::of(values, by_step.into_iter().collect()))
    }

    fn of(values: Vec<u64>, steps: Vec<(u64, Vec<u64>)>) -> Lengths {
        let mut sorted = values.clone();
        sorted.sort_unstable();
        Lengths { values, sorted, steps }
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

    /// The lengths the file's steps `from..=to` draw from (each step the file gives once), as a
    /// file of their own: what a run over those steps charges. A file without steps: itself.
    pub(crate) fn between(&self, from: u64, to: u64) -> Lengths {
        if self.steps.is_empty() {
            return self.clone();
        }
        let mut logged: Vec<u64> = (from..=to.max(from)).filter_map(|s| self.at_step(s).0).collect();
        logged.dedup();
        let values = logged.iter().flat_map(|s| self.at_step(*s).1.iter().copied()).collect();
        Lengths::of(values, Vec::new())
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

    /// How many lengths the file gives.
    pub(crate) fn count(&self) -> usize {
        self.values.len()
    }

    pub(crate) fn mean(&self) -> f64 {
        self.values.iter().map(|v| *v as f64).sum::<f64>() / self.values.len() as f64
    }

    /// The `q`-quantile (0..=1) by nearest rank: a length the file gives.
    pub(crate) fn quantile(&self, q: f64) -> u64 {
        let n = self.sorted.len();
        let rank = (q.clamp(0.0, 1.0) * n as f64).ceil() as usize;
        self.sorted[rank.clamp(1, n) - 1]
    }

    pub(crate) fn p50(&self) -> u64 {
        self.quantile(0.5)
    }

    pub(crate) fn p90(&self) -> u64 {
        self.quantile(0.9)
    }

    pub(crate) fn max(&self) -> u64 {
        *self.sorted.last().expect("at least one length")
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
            _ => return Err(format!("{at}: \"step\": {s} is not a training step (a whole number, 0 or more)")),
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
        assert_eq!((l.count(), l.p50(), l.p90(), l.max()), (3, 1834, 9000, 9000));
        assert!((l.mean() - 3782.0).abs() < 1e-9);
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
        assert!((sum / n as f64 - l.mean()).abs() < 0.02 * l.mean(), "{} against {}", sum / n as f64, l.mean());
    }

    #[test]
    fn a_file_with_steps_draws_each_step_from_its_own_lines() {
        let text = "{\"step\": 1, \"length\": 500}\n{\"step\": 1, \"length\": 700}\n\
                    {\"step\": 5, \"response_length\": 3000}\n# logged every few steps\n{\"step\": 3, \"length\": 900}\n";
        let l = Lengths::parse(text, "l.jsonl").unwrap();
        assert_eq!(l.step_span(), Some((1, 5)));
        assert_eq!(l.count(), 4, "the file's figures cover every line");
        let drawn = |step: u64| -> Vec<u64> { (0..64).map(|p| l.draw(9, p, 0, step)).collect() };
        // Step 1 draws both of its lines and nothing else.
        let first = drawn(1);
        assert!(first.contains(&500) && first.contains(&700) && first.iter().all(|v| [500, 700].contains(v)));
        // Step 4 was not logged: it draws step 3's; past the last, the last's; before the first, the first's.
        assert!(drawn(3).iter().chain(&drawn(4)).all(|v| *v == 900));
        assert!(drawn(5).iter().chain(&drawn(400)).all(|v| *v == 3000));
        assert!(drawn(0).iter().all(|v| [500, 700].contains(v)));
        // What steps 2..=4 draw from: step 1's lines (step 2) and step 3's (steps 3 and 4), once each.
        let window = l.between(2, 4);
        assert_eq!((window.count(), window.max(), window.step_span()), (3, 900, None));
        assert!((window.mean() - 700.0).abs() < 1e-9);
        // A file without steps draws from all its lines at any step.
        let plain = Lengths::parse("10\n20\n", "p").unwrap();
        assert_eq!((plain.step_span(), plain.between(7, 9).count()), (None, 2));
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
