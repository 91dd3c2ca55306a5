//! A job's own response lengths (compute.lengths, `--lengths FILE`): the modelled length of every
//! sample drawn from a file of real ones. The draw depends on the sample's identity alone (the
//! run's seed, its prompt's place in the run's order of prompts, its place in the group), never on
//! a layout's schedule or a worker's state, so that every layout charges the same sample the same
//! length, and a predictor can draw them without running the job.

use std::path::Path;

/// The response lengths of a file, in modelled tokens.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Lengths {
    /// As the file gives them (at least one, each >= 1).
    values: Vec<u64>,
    /// The same, sorted, for the percentiles.
    sorted: Vec<u64>,
}

impl Lengths {
    /// Reads `path`: one response length per line (a positive whole number of tokens), blank lines
    /// and `#` comments skipped; or JSON lines, each an object with a numeric `length` (or
    /// `response_length`). The error names the file, the line and what to write instead.
    pub(crate) fn load(path: &Path) -> Result<Lengths, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Lengths::parse(&text, &path.display().to_string())
    }

    /// `load`'s parser, `name` the file as its errors call it.
    pub(crate) fn parse(text: &str, name: &str) -> Result<Lengths, String> {
        let mut values = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = format!("{name} line {}", i + 1);
            let value = if line.starts_with('{') { json_length(line, &at)? } else { plain_length(line, &at)? };
            values.push(value);
        }
        if values.is_empty() {
            return Err(format!(
                "{name} holds no response lengths: write one per line (tokens, e.g. 1834), or JSON lines with a \
                 \"length\" field"
            ));
        }
        let mut sorted = values.clone();
        sorted.sort_unstable();
        Ok(Lengths { values, sorted })
    }

    /// The modelled response length (tokens) of sample `sample` of the group of the prompt at
    /// `prompt` in the run's order of prompts (from 0: step 1's batch first), in a run of `seed`.
    /// Each of the file's lines is equally likely; the same identity always draws the same line.
    pub(crate) fn draw(&self, seed: u64, prompt: u64, sample: u64) -> u64 {
        let h = mix(mix(mix(seed ^ 0x6C65_6E67_7468_7321) ^ prompt) ^ sample);
        // The high bits of a 128-bit product: uniform over the lines without a modulo's bias.
        let k = ((u128::from(h) * self.values.len() as u128) >> 64) as usize;
        self.values[k]
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

/// A JSON line's `length` (or `response_length`).
fn json_length(line: &str, at: &str) -> Result<u64, String> {
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("{at}: not a JSON object ({e}); one object per line"))?;
    let field = ["length", "response_length"].into_iter().find_map(|k| v.get(k).map(|x| (k, x)));
    let Some((key, x)) = field else {
        return Err(format!(
            "{at}: the object has no \"length\" (or \"response_length\") field, e.g. {{\"length\": 1834}}"
        ));
    };
    match x.as_f64() {
        Some(f) if f.fract() == 0.0 && f >= 1.0 && f <= f64::from(u32::MAX) => Ok(f as u64),
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
        assert_eq!(l.draw(7, 123, 4), l.draw(7, 123, 4));
        assert_eq!(l.clone().draw(7, 123, 4), l.draw(7, 123, 4), "no state between draws");
        // Any part of the identity changes the draw (1000 lines: a repeat is a 1-in-1000 chance).
        let base = l.draw(7, 123, 4);
        let others = [l.draw(8, 123, 4), l.draw(7, 124, 4), l.draw(7, 123, 5), l.draw(7, 4, 123)];
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
                let v = l.draw(1, p, j);
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
}
