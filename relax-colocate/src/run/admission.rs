//! Which of a generate request's sequences an engine decodes at each step when its KV cache is
//! bounded (docs/async.md, "KV capacity"), as vLLM v1 and SGLang schedule: a waiting sequence is
//! admitted while the running sequences' tokens plus its own fit the capacity; when a decode
//! step's growth (a token per running sequence) does not fit, the most recently admitted running
//! sequence is preempted, its KV freed, and it goes back to the front of the queue, to be
//! prefilled again (prompt and tokens so far) when readmitted. Without a capacity every live
//! sequence runs. Either way it tallies the batch slots the steps filled.

use super::protocol::DecodeStats;
use std::collections::VecDeque;

pub(crate) struct Admission {
    /// Task tokens of KV the engine holds (its modelled capacity over token_scale); None: no bound.
    capacity: Option<f64>,
    /// Modelled tokens per task token, to report recomputed tokens in modelled tokens.
    scale: f64,
    /// Running sequences, in the order they were admitted.
    running: Vec<usize>,
    waiting: VecDeque<usize>,
    /// Sequences preempted in this request: their next admission prefills them again.
    preempted: Vec<bool>,
    pub(crate) stats: DecodeStats,
}

impl Admission {
    pub(crate) fn new(sequences: usize, slots: usize, capacity: Option<f64>, scale: f64) -> Admission {
        Admission {
            capacity: capacity.filter(|c| c.is_finite() && *c > 0.0),
            scale,
            running: Vec::new(),
            waiting: (0..sequences).collect(),
            preempted: vec![false; sequences],
            stats: DecodeStats { slots, kv_peak_share: capacity.map(|_| 0.0), ..DecodeStats::default() },
        }
    }

    /// The sequences that decode this step, given which are `live` (not finished, segment not
    /// spent) and each one's `context` (prompt and response in task tokens; with drawn lengths,
    /// compute.lengths, the prompt's task tokens plus the modelled steps done over token_scale,
    /// not whole). Returns the task tokens prefilled again for readmitted sequences.
    pub(crate) fn schedule(&mut self, live: &[bool], context: &[f64]) -> (Vec<bool>, f64) {
        // A sequence that stopped frees its KV; one waiting that stopped leaves the queue.
        self.running.retain(|&i| live[i]);
        self.waiting.retain(|&i| live[i]);
        let used = |running: &[usize]| running.iter().map(|&i| context[i]).sum::<f64>();
        let mut recomputed = 0.0;
        match self.capacity {
            None => self.running.extend(self.waiting.drain(..)),
            Some(cap) => {
                // The running sequences' growth first (a token each this step), as vLLM v1
                // schedules them before any waiting one.
                while self.running.len() > 1 && used(&self.running) + self.running.len() as f64 > cap {
                    let last = self.running.pop().expect("more than one running");
                    self.preempted[last] = true;
                    self.stats.preemptions += 1;
                    self.waiting.push_front(last);
                }
                // Then the queue's head while its tokens, and the token it decodes this step, fit
                // beside them. An empty engine takes the head whatever its size: nothing else
                // would run.
                while let Some(&next) = self.waiting.front() {
                    let need = used(&self.running) + self.running.len() as f64 + context[next] + 1.0;
                    if !self.running.is_empty() && need > cap {
                        break;
                    }
                    self.waiting.pop_front();
                    if self.preempted[next] {
                        recomputed += context[next];
                    }
                    self.running.push(next);
                }
                let held = (used(&self.running) + self.running.len() as f64) / cap;
                self.stats.kv_peak_share = Some(self.stats.kv_peak_share.unwrap_or(0.0).max(held));
            }
        }
        self.stats.recomputed_tokens += recomputed * self.scale;
        let mut now = vec![false; live.len()];
        for &i in &self.running {
            now[i] = true;
        }
        (now, recomputed)
    }

    /// The step ran `steps` decode steps over `seconds` of modelled time with `active` sequences.
    pub(crate) fn ran(&mut self, steps: f64, seconds: f64, active: usize) {
        self.stats.steps += steps;
        self.stats.slot_steps += steps * active as f64;
        self.stats.kv_queued_s += seconds * self.waiting.len() as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes sequences of prompt `prompt` task tokens wanting `lengths[i]` tokens each, a step a
    /// token, one step costing 1 s. Returns the stats, the tokens each got and the task tokens
    /// prefilled again.
    fn run(prompt: usize, lengths: &[usize], slots: usize, capacity: Option<f64>) -> (DecodeStats, Vec<usize>, f64) {
        let mut a = Admission::new(lengths.len(), slots, capacity, 1.0);
        let mut got = vec![0; lengths.len()];
        let mut again = 0.0;
        loop {
            let live: Vec<bool> = got.iter().zip(lengths).map(|(g, l)| g < l).collect();
            if !live.iter().any(|l| *l) {
                break;
            }
            let context: Vec<f64> = got.iter().map(|g| (prompt + g) as f64).collect();
            let (now, recomputed) = a.schedule(&live, &context);
            again += recomputed;
            let active = now.iter().filter(|n| **n).count();
            assert!(active > 0, "a step with live sequences decodes one at least");
            a.ran(1.0, 1.0, active);
            for (i, _) in now.iter().enumerate().filter(|(_, n)| **n) {
                got[i] += 1;
            }
        }
        (a.stats, got, again)
    }

    #[test]
    fn occupancy_of_a_known_schedule_is_its_hand_computed_share() {
        // 4 slots, sequences of 1, 2, 3 and 4 tokens, all admitted: steps of 4, 3, 2 and 1
        // sequences, 10 of 16 slot-steps filled.
        let (s, got, again) = run(2, &[1, 2, 3, 4], 4, None);
        assert_eq!((s.steps, s.slot_steps, s.slots), (4.0, 10.0, 4));
        assert_eq!(s.slot_steps / (s.steps * s.slots as f64), 0.625);
        assert_eq!((got, again, s.preemptions, s.kv_peak_share), (vec![1, 2, 3, 4], 0.0, 0, None));
        // A colocated engine decoding its last 3 sequences of 48 fills 3/48 of its slots.
        let (s, ..) = run(2, &[5, 5, 5], 48, None);
        assert_eq!(s.slot_steps / (s.steps * s.slots as f64), 0.0625);
    }

    #[test]
    fn ample_capacity_never_queues_or_preempts() {
        let (s, got, again) = run(4, &[3, 6, 2, 5], 4, Some(1000.0));
        assert_eq!((s.preemptions, s.recomputed_tokens, s.kv_queued_s, again), (0, 0.0, 0.0, 0.0));
        assert_eq!(got, vec![3, 6, 2, 5]);
        // Peak: the second step, all four still running, each holding 4 + 1 and growing one more:
        // 24 of 1000.
        assert_eq!(s.kv_peak_share, Some(0.024));
    }

    #[test]
    fn a_capacity_under_the_batch_queues_then_preempts_and_recomputes() {
        let lengths = [4, 4, 4, 4, 4, 4];
        let (s, got, again) = run(2, &lengths, 6, Some(10.0));
        assert_eq!(got, lengths.to_vec(), "every sequence generates all its tokens");
        assert!(s.preemptions > 0, "{s:?}");
        assert!(again > 0.0 && s.recomputed_tokens == again, "{s:?}");
        assert!(s.kv_queued_s > 0.0);
        assert!(s.kv_peak_share.unwrap() <= 1.0, "{s:?}");
        // By hand, capacity 10 task tokens, prompts of 2: three are admitted (6 + 3 tokens of
        // growth, and a fourth's 2 + 1 would make 12).
        let mut a = Admission::new(6, 6, Some(10.0), 100.0);
        let (now, _) = a.schedule(&[true; 6], &[2.0; 6]);
        assert_eq!(now, [true, true, true, false, false, false]);
        assert_eq!((a.stats.preemptions, a.stats.kv_peak_share), (0, Some(0.9)));
        a.ran(100.0, 2.0, 3);
        assert_eq!(a.stats.kv_queued_s, 6.0, "three sequences waited 2 s each");
        // Next step their growth (9 + 3) does not fit: the latest admitted goes back to the front.
        let (now, _) = a.schedule(&[true; 6], &[3.0, 3.0, 3.0, 2.0, 2.0, 2.0]);
        assert_eq!(now, [true, true, false, false, false, false]);
        assert_eq!((a.stats.preemptions, a.waiting.front()), (1, Some(&2)));
        // Once the first two end it is readmitted first, its prompt and token prefilled again,
        // charged in modelled tokens.
        let (now, again) = a.schedule(&[false, false, true, true, true, true], &[4.0, 4.0, 3.0, 2.0, 2.0, 2.0]);
        assert_eq!(now, [false, false, true, true, true, false]);
        assert_eq!((again, a.stats.recomputed_tokens), (3.0, 300.0));
    }
}
