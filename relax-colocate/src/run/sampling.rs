//! Phases and the memory at their boundaries: each phase is timed, then every worker's tms status
//! is sampled (memory.jsonl, the leak check, the step's metrics row).

use super::{FailKind, MIB, MemSample, R, Runner, report};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::Instant;

impl Runner {
    /// Runs one timed phase; records its span and the memory at its end.
    pub(super) fn phase<T>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> R<T>) -> R<T> {
        self.phase = name.to_string();
        let start = self.elapsed();
        let t0 = Instant::now();
        let out = f(self)?;
        let secs = t0.elapsed().as_secs_f64();
        *self.step_times.entry(name.to_string()).or_default() += secs;
        self.sample_memory(start)?;
        Ok(out)
    }

    fn sample_memory(&mut self, start_s: f64) -> R<()> {
        let devices = self.cfg.total_devices();
        let mut s = MemSample {
            t_s: self.elapsed(),
            start_s,
            step: self.step,
            phase: self.phase.clone(),
            device_used: vec![0; devices],
            device_total: vec![0; devices],
            workers: BTreeMap::new(),
            paused: BTreeMap::new(),
        };
        let targets: Vec<usize> = (0..self.workers.len()).filter(|&i| self.workers[i].control.is_some()).collect();
        let statuses = self.control_calls(&targets, "a control status request", tms_proto::status)?;
        for (&i, st) in targets.iter().zip(statuses) {
            let w = &self.workers[i];
            let tags = st.tags.iter().map(|t| (t.tag.clone(), t.bytes_active)).collect();
            s.workers.insert(w.name.clone(), tags);
            s.paused.insert(w.name.clone(), st.tags.iter().map(|t| t.bytes_paused).sum());
            if let Some(d) = st.devices.first() {
                s.device_used[w.rank as usize] = d.total.saturating_sub(d.free);
                s.device_total[w.rank as usize] = d.total;
            }
        }
        let _ = writeln!(self.memory_file, "{}", serde_json::to_string(&s).expect("serializes"));
        self.leak_check(&s)?;
        for (peak, used) in self.peak_used.iter_mut().zip(&s.device_used) {
            *peak = (*peak).max(*used);
        }
        if self.step_memory.first().is_some_and(|f| f.step != s.step) {
            self.step_memory.clear();
        }
        self.step_memory.push(s);
        Ok(())
    }

    fn leak_check(&mut self, s: &MemSample) -> R<()> {
        if !self.cfg.run.checks || s.step == 0 {
            return Ok(());
        }
        let baseline_step = if self.cfg.run.steps >= 2 { 2 } else { 1 };
        if s.step == baseline_step {
            self.leak_baseline.insert(s.phase.clone(), s.device_used.clone());
            return Ok(());
        }
        let tolerance = (self.cfg.run.leak_tolerance_mib * MIB as f64) as u64;
        if let Some(base) = self.leak_baseline.get(&s.phase) {
            for (d, (now, was)) in s.device_used.iter().zip(base).enumerate() {
                if *now > was + tolerance {
                    return Err(self.fail(
                        FailKind::Check,
                        None,
                        format!(
                            "leak check: device {d} uses {} after {} at step {}, {} more than at step {baseline_step} \
                             (tolerance run.leak_tolerance_mib = {})",
                            report::human(*now),
                            s.phase,
                            s.step,
                            report::human(now - was),
                            self.cfg.run.leak_tolerance_mib
                        ),
                    ));
                }
            }
            self.checks_passed += 1;
        }
        Ok(())
    }
}
