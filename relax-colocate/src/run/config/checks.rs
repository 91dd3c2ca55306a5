//! The checks a configuration must pass before anything starts: each refusal names the key, the
//! value and what to set instead (exit 2).

use super::*;

/// The messages of the `checks` that fail, in their order.
fn failed(checks: &[(bool, &str)]) -> Vec<String> {
    checks.iter().filter(|(ok, _)| !ok).map(|(_, msg)| msg.to_string()).collect()
}

impl Config {
    /// Every section's checks, in the order their errors are reported; Err: all of them, joined
    /// by "; " (one refusal names all that a job must fix).
    pub fn validate(&self) -> Result<(), String> {
        let errors = [
            self.run_errors(),
            self.task_errors(),
            self.rollout_errors(),
            self.algo_errors(),
            self.model_and_memory_errors(),
            self.sim_errors(),
            self.compute_errors(),
            self.lengths_errors(),
            self.clock_errors(),
            self.weight_update_errors(),
            self.text_value_errors(),
            self.layout_errors(),
            self.correction_errors(),
            self.pass_errors(),
        ]
        .concat();
        if errors.is_empty() { Ok(()) } else { Err(errors.join("; ")) }
    }

    /// run.*: the steps, the devices and nodes, the launcher that reaches them, the phase timeout.
    fn run_errors(&self) -> Vec<String> {
        let r = &self.run;
        failed(&[
            (r.steps >= 1, "run.steps must be at least 1"),
            ((1..=64).contains(&r.devices), "run.devices must be 1..64"),
            ((1..=64).contains(&r.nodes), "run.nodes must be 1..64"),
            (
                r.nodes == 1 || r.launcher == Launcher::Ray,
                "run.nodes > 1 needs run.launcher = \"ray\" (--launcher ray)",
            ),
            (
                r.launcher == Launcher::Local || !r.ray_address.trim().is_empty(),
                "run.ray_address must be local, auto or a Ray address (host:port)",
            ),
            (r.phase_timeout_s > 0.0, "run.phase_timeout_s must be > 0"),
        ])
    }

    /// task.*: the operands' digits, and room in max_new_tokens for the longest answer and EOS.
    fn task_errors(&self) -> Vec<String> {
        let t = &self.task;
        let answer = t.digits as usize + 2;
        let max_new = format!(
            "task.max_new_tokens must be 0 (the longest answer) or {answer}..4096 (room for the answer and EOS)"
        );
        failed(&[
            ((1..=6).contains(&t.digits), "task.digits must be 1..6"),
            (t.max_new_tokens == 0 || (answer..=4096).contains(&t.max_new_tokens), &max_new),
        ])
    }

    /// rollout.*: a batch of prompts, groups of at least two samples, a positive temperature.
    fn rollout_errors(&self) -> Vec<String> {
        let r = &self.rollout;
        failed(&[
            (r.prompts_per_step >= 1, "rollout.prompts_per_step must be at least 1"),
            (r.samples_per_prompt >= 2, "rollout.samples_per_prompt must be at least 2 (groups)"),
            (r.temperature > 0.0, "rollout.temperature must be > 0"),
        ])
    }

    /// algo.*'s ranges: the learning rate, the passes over a batch, the clip bounds, gamma and
    /// lambda.
    fn algo_errors(&self) -> Vec<String> {
        let a = &self.algo;
        failed(&[
            (a.lr > 0.0 && a.lr.is_finite(), "algo.lr must be > 0"),
            (a.minibatches >= 1 && a.epochs >= 1, "algo.minibatches and algo.epochs must be >= 1"),
            (
                a.clip_eps_low > 0.0 && a.clip_eps_low < 1.0 && a.clip_eps_high > 0.0,
                "algo.clip_eps_low must be in (0, 1) and algo.clip_eps_high > 0",
            ),
            (a.dual_clip == 0.0 || a.dual_clip > 1.0, "algo.dual_clip must be 0 (off) or > 1"),
            ((0.0..=1.0).contains(&a.gamma) && (0.0..=1.0).contains(&a.lambda), "gamma, lambda in [0, 1]"),
        ])
    }

    /// The policy's size (model.hidden) and the memory profile's scaling (memory.*).
    fn model_and_memory_errors(&self) -> Vec<String> {
        let m = &self.memory;
        failed(&[
            (self.model.hidden >= 1 && self.model.hidden <= 4096, "model.hidden must be 1..4096"),
            (m.tp >= 1, "memory.tp must be >= 1"),
            (m.scale > 0.0, "memory.scale must be > 0"),
            (m.kv_cache_gib >= 0.0, "memory.kv_cache_gib must be >= 0"),
        ])
    }

    /// The simulated device's API and copy speed.
    fn sim_errors(&self) -> Vec<String> {
        let s = &self.sim;
        failed(&[
            (s.api == "cuda" || s.api == "acl", "sim.api must be cuda or acl"),
            (s.copy_gbps >= 0.0, "sim.copy_gbps must be >= 0"),
        ])
    }

    /// How the weights reach the rollout: the simulator's link, the transport the layout allows,
    /// and update_weights' bucket size.
    fn weight_update_errors(&self) -> Vec<String> {
        let mut errors = Vec::new();
        if let Err(e) = self.link_gbps() {
            errors.push(e);
        }
        if let Err(e) = self.check_weight_transport() {
            errors.push(e);
        }
        match parse_size(&self.memory.update_weight_buffer_size) {
            // A bucket of a few bytes turns update_weights into millions of round trips: setup
            // made no visible progress with "1".
            Ok(n) if n < 1 << 20 => errors.push(format!(
                "memory.update_weight_buffer_size={:?} is too small: at least 1MiB (slime's default is 512MiB)",
                self.memory.update_weight_buffer_size
            )),
            Ok(_) => {}
            Err(e) => errors.push(format!("memory.update_weight_buffer_size: {e}")),
        }
        errors
    }

    /// The keys given as text that must parse: the simulated device's memory size, the loggers'
    /// list, the memory profile's name.
    fn text_value_errors(&self) -> Vec<String> {
        let mut errors = Vec::new();
        if self.sim.memory != "auto"
            && let Err(e) = parse_size(&self.sim.memory)
        {
            errors.push(format!("sim.memory: {e}"));
        }
        if let Err(e) = crate::run::loggers::parse_list(&self.metrics.loggers) {
            errors.push(e);
        }
        if let Err(e) = crate::run::profile::preset(&self.memory.profile) {
            errors.push(e);
        }
        errors
    }

    /// compute.time_scale: only modelled time may run faster; what the simulator really spends
    /// would otherwise be all there is, counted k times.
    fn clock_errors(&self) -> Vec<String> {
        let k = self.compute.time_scale;
        if k == 1.0 {
            return Vec::new();
        }
        let mut errors = Vec::new();
        if !(1.0..=1000.0).contains(&k) {
            errors.push(format!(
                "compute.time_scale = {k} must be 1..1000 modelled seconds per wall-clock second (1: the wall clock)"
            ));
        }
        if !self.compute.model {
            errors.push(format!(
                "compute.time_scale = {k} needs compute.model = true (--set compute.model=true): without a model \
                 every time is what this machine spends, and a faster clock would only multiply it"
            ));
        }
        if !self.builtin_workers() {
            errors.push(format!(
                "compute.time_scale = {k} needs the built-in workers: an external worker (run.trainer_cmd, \
                 run.rollout_cmd; scripts/torch_worker.py) paces at the wall clock; drop the worker commands, \
                 or --set compute.time_scale=1"
            ));
        }
        errors
    }

    /// compute.lengths: only the built-in workers under compute.model charge a sample's drawn
    /// length, and it replaces the response's growth over the run rather than compounding it.
    fn lengths_errors(&self) -> Vec<String> {
        let c = &self.compute;
        if c.lengths.trim().is_empty() {
            return Vec::new();
        }
        let mut errors = Vec::new();
        if !c.model {
            errors.push(format!(
                "compute.lengths = {:?} needs compute.model = true (--set compute.model=true): the lengths are \
                 modelled tokens, and nothing is modelled without it",
                c.lengths
            ));
        }
        if !self.builtin_workers() {
            errors.push(
                "compute.lengths needs the built-in workers: an external worker (run.trainer_cmd, run.rollout_cmd; \
                 scripts/torch_worker.py) does not charge drawn lengths; drop --lengths, or drop the worker commands"
                    .to_string(),
            );
        }
        if c.token_scale_final > 0.0 {
            errors.push(
                "compute.lengths and compute.token_scale_final both set a response's modelled length: keep one \
                 (--set compute.token_scale_final=0 to use the file's lengths)"
                    .to_string(),
            );
        }
        errors
    }

    /// compute.model's settings, when it is on.
    fn compute_errors(&self) -> Vec<String> {
        let c = &self.compute;
        if !c.model {
            return Vec::new();
        }
        let mfu = |m: f64| m > 0.0 && m <= 1.0;
        let mut errors = failed(&[
            (c.tflops > 0.0 && c.tflops.is_finite(), "compute.tflops must be > 0"),
            (mfu(c.train_mfu) && mfu(c.rollout_mfu), "compute.train_mfu and compute.rollout_mfu must be in (0, 1]"),
            (c.token_scale > 0.0 && c.token_scale.is_finite(), "compute.token_scale must be > 0"),
            (
                c.token_scale_final >= 0.0 && c.token_scale_final.is_finite(),
                "compute.token_scale_final must be >= 0 (0: every step at compute.token_scale)",
            ),
            (c.hbm_gbps >= 0.0 && c.hbm_gbps.is_finite(), "compute.hbm_gbps must be >= 0 (0: no memory floor)"),
            (
                c.decode_step_ms >= 0.0 && c.decode_step_ms.is_finite(),
                "compute.decode_step_ms must be >= 0 (0: decode steps cost their roofline alone)",
            ),
            (
                self.memory.profile != "none",
                "compute.model = true needs a memory profile (memory.profile): its parameter count sets the FLOPs \
                 per token",
            ),
        ]);
        errors.extend(self.figure_errors());
        errors
    }

    /// The device's figures: each >= 0, and each the run needs given by the job or its preset.
    fn figure_errors(&self) -> Vec<String> {
        let c = &self.compute;
        let mut errors = Vec::new();
        let figures = [
            ("h2d_gbps", c.h2d_gbps),
            ("d2h_gbps", c.d2h_gbps),
            ("collective_gbps", c.collective_gbps),
            ("pin_gbps", c.pin_gbps),
            ("map_ms_per_gib", c.map_ms_per_gib),
            ("unmap_ms_per_gib", c.unmap_ms_per_gib),
        ];
        for (key, v) in figures {
            if !(v >= 0.0 && v.is_finite()) {
                errors.push(format!("compute.{key} must be >= 0 (0: not charged)"));
            }
        }
        let Ok(preset) = devices::find(&c.device) else { return errors };
        for (key, why) in self.figures_needed() {
            if c.unset.iter().any(|k| k == key) {
                errors.push(format!(
                    "compute.{key} is unset: compute.device = \"{}\" ({}) has no sourced figure for it \
                     (docs/device-figures.md), and this run needs one ({why}); set it in the job's [compute] or \
                     with --set compute.{key}=VALUE, or choose another compute.device",
                    preset.name, preset.what
                ));
            }
        }
        errors
    }

    /// The figures this run's model charges, each with what it is for. The driver's costs
    /// (devices::OPTIONAL_KEYS) are never required: no preset has them.
    fn figures_needed(&self) -> Vec<(&'static str, &'static str)> {
        let mut needed = vec![
            ("tflops", "every stage's FLOPs run at it"),
            ("hbm_gbps", "decode steps read the weights and KV cache at it; 0 turns that floor off"),
        ];
        let host = self.weight_transport() == WeightTransport::Host;
        let switches = (self.run.mode == Mode::Colocate && self.run.offload) || self.run.mode == Mode::Elastic;
        if switches || host {
            needed.push(("d2h_gbps", "a trainer's sleep backs its state up to the host at it"));
            needed.push(("h2d_gbps", "a trainer's wake-up restores its state from the host at it"));
        }
        if matches!(self.weight_transport(), WeightTransport::Broadcast | WeightTransport::Auto) {
            needed.push(("collective_gbps", "the weight update broadcasts at it"));
        }
        needed
    }

    /// The devices' layout: colocated prompts over every device, or async mode's device sets and
    /// its [async] keys.
    fn layout_errors(&self) -> Vec<String> {
        let mut errors = Vec::new();
        if self.elastic.lend_rollout && self.run.mode != Mode::Elastic {
            errors.push(format!(
                "elastic.lend_rollout = true lends the rollout engines' devices to the trainer, which only elastic \
                 mode does, and run.mode = \"{}\": use --mode elastic, or elastic.lend_rollout = false",
                self.run.mode.as_str()
            ));
        }
        match self.mode_layout() {
            Err(e) => errors.push(e),
            Ok(None) => {
                if !self.rollout.prompts_per_step.is_multiple_of(self.total_devices()) {
                    errors.push("rollout.prompts_per_step must be a multiple of run.devices x run.nodes".into());
                }
            }
            Ok(Some(split)) => {
                if !self.rollout.prompts_per_step.is_multiple_of(split.rollout.len()) {
                    errors.push(format!(
                        "rollout.prompts_per_step must be a multiple of the {} rollout device(s) (run.rollout_devices)",
                        split.rollout.len()
                    ));
                }
                if self.asynchronous.max_staleness < 0 {
                    errors.push(format!(
                        "async.max_staleness={} is below 0: 0 trains only on samples of the current weights, 1 is \
                     one-step off-policy",
                        self.asynchronous.max_staleness
                    ));
                }
                if self.run.mode == Mode::Elastic {
                    errors.extend(self.elastic_errors());
                }
                let budget = self.asynchronous.segment_s;
                if !(budget >= 0.0 && budget.is_finite()) {
                    errors.push(format!(
                        "async.segment_s={budget} must be >= 0 modelled seconds (0: segments bounded by \
                         async.segment_tokens alone)"
                    ));
                }
                if self.asynchronous.train_iters_per_update < 1 {
                    errors.push("async.train_iters_per_update must be at least 1".into());
                }
                if self.asynchronous.queue_groups != 0
                    && (self.asynchronous.queue_groups as usize) < self.rollout.prompts_per_step
                {
                    errors.push(format!(
                        "async.queue_groups={} cannot hold one batch of {} prompt groups \
                     (rollout.prompts_per_step); give at least that, or 0 for the default",
                        self.asynchronous.queue_groups, self.rollout.prompts_per_step
                    ));
                }
            }
        }
        errors
    }

    /// Elastic mode's own keys.
    fn elastic_errors(&self) -> Vec<String> {
        let e = &self.elastic;
        let mut errors = Vec::new();
        if !(e.lend_after_s >= 0.0 && e.lend_after_s.is_finite()) {
            errors.push(format!(
                "elastic.lend_after_s={} must be >= 0 seconds (0: the measured switch time)",
                e.lend_after_s
            ));
        }
        if !(e.reclaim_timeout_s > 0.0 && e.reclaim_timeout_s.is_finite()) {
            errors.push(format!("elastic.reclaim_timeout_s={} must be > 0 seconds", e.reclaim_timeout_s));
        }
        // The runner's own local Ray cluster runs every node on this host, beside the run directory.
        let remote_cluster = self.run.launcher == Launcher::Ray && self.run.ray_address.trim() != "local";
        if e.lend_rollout && remote_cluster {
            errors.push(format!(
                "elastic.lend_rollout = true needs the run directory on every worker's host: a lent trainer reads \
                 the trainer's state from a file there, and run.ray_address = {:?} is a Ray cluster whose nodes may \
                 be other hosts: use run.ray_address = \"local\" (the runner's own cluster, on this host), \
                 --launcher local, or elastic.lend_rollout = false",
                self.run.ray_address
            ));
        }
        if !self.run.offload {
            errors.push(
                "run.mode = \"elastic\" lends a trainer's device by pausing the trainer's memory, and run.offload = \
                 false forbids pausing: set run.offload = true, or use --mode async"
                    .into(),
            );
        }
        errors
    }

    /// algo.tis_cap's range, and the refusal to train on stale samples uncorrected: async RL
    /// without a correction collapses (NeMo-RL #1098), and miles (#1829) refuses to run that way.
    fn correction_errors(&self) -> Vec<String> {
        let mut errors = Vec::new();
        let cap = self.algo.tis_cap;
        if !(cap.is_finite() && cap >= 1.0) {
            errors.push(format!(
                "algo.tis_cap={cap} must be a number >= 1: a cap below 1 would shrink even on-policy tokens' weight \
                 (slime's --tis-clip and verl's rollout_is_threshold default to 2.0)"
            ));
        }
        let a = &self.asynchronous;
        let stale = a.max_staleness > 0 || a.train_iters_per_update > 1;
        // With rollout log-probs as the old ones, the clipped PPO ratio is the correction.
        let uncorrected = self.off_policy_correction() == OffPolicyCorrection::None && !self.algo.rollout_log_probs;
        if self.run.mode != Mode::Colocate && stale && uncorrected && !self.algo.allow_uncorrected_stale {
            errors.push(format!(
                "algo.off_policy_correction = \"none\" in {mode} mode with async.max_staleness = {} and \
                 async.train_iters_per_update = {} trains on samples generated by older weights without correcting \
                 for them, which makes async RL collapse: set algo.off_policy_correction = \"tis\" (or \"auto\", \
                 the default), or async.max_staleness = 0 with async.train_iters_per_update = 1 (on-policy), or \
                 algo.allow_uncorrected_stale = true to run it anyway",
                a.max_staleness,
                a.train_iters_per_update,
                mode = self.run.mode.as_str()
            ));
        }
        errors
    }

    /// The trainer's passes the run skips: nothing may need what a skipped pass would give.
    fn pass_errors(&self) -> Vec<String> {
        let a = &self.algo;
        let mut errors = Vec::new();
        if !a.reference && a.kl_coef > 0.0 {
            errors.push(format!(
                "algo.reference = false runs no reference pass, and algo.kl_coef = {} needs the reference's \
                 log-probs (GRPO's KL loss, PPO's KL penalty): set algo.kl_coef = 0 (no KL, as DAPO), or \
                 algo.reference = true",
                a.kl_coef
            ));
        }
        if a.rollout_log_probs && a.off_policy_correction == OffPolicyCorrection::Tis {
            errors.push(
                "algo.off_policy_correction = \"tis\" weights each token by exp(old log-prob - rollout log-prob), \
                 and algo.rollout_log_probs = true makes the old log-probs the rollout's, so every weight would be \
                 1: the PPO ratio to the rollout's log-probs, clipped, is then the correction; set \
                 algo.off_policy_correction = \"auto\" (or \"none\"), or algo.rollout_log_probs = false"
                    .into(),
            );
        }
        errors
    }

    /// Refuses a transport the layout cannot run.
    fn check_weight_transport(&self) -> Result<(), String> {
        if self.run.weight_transport == WeightTransport::Broadcast && self.run.mode == Mode::Colocate {
            return Err("run.weight_transport = \"broadcast\" needs run.mode = \"async\" (--mode async): colocated, \
                        the trainer and the rollout share every device, and NCCL and HCCL refuse two ranks of one \
                        communicator on one device (colocated frameworks hand weights over by CUDA IPC there); use \
                        --weight-transport ipc (the colocated default) or host"
                .into());
        }
        if self.run.weight_transport == WeightTransport::Ipc && self.run.mode.split() {
            let remote = self.run.launcher == Launcher::Ray && self.run.ray_address.trim() != "local";
            let nodes = if remote { " (and on a Ray cluster possibly on other nodes)" } else { "" };
            return Err(format!(
                "run.weight_transport = \"ipc\" shares a device buffer between the trainer and the rollout on one \
                 device of one node, and async mode puts them on devices of their own{nodes}: use --weight-transport \
                 broadcast (the async default) or host, or --mode colocate for ipc"
            ));
        }
        if self.weight_transport() == WeightTransport::Host {
            return self.check_host_on_one_host();
        }
        Ok(())
    }

    /// The host transport crosses through one file on one host. A local Ray cluster's nodes share
    /// this host; a real cluster's may not.
    pub(super) fn check_host_on_one_host(&self) -> Result<(), String> {
        let remote_cluster = self.run.launcher == Launcher::Ray && self.run.ray_address.trim() != "local";
        if !self.run.mode.split() || !remote_cluster {
            return Ok(());
        }
        let node = |d: &u32| d / self.run.devices.max(1);
        if let Ok(Some(split)) = self.mode_layout() {
            let first = node(&split.trainer[0]);
            if let Some(d) = split.rollout.iter().chain(&split.trainer).find(|d| node(d) != first) {
                return Err(format!(
                    "run.weight_transport = \"host\" moves the weights through a file on one host, and device {d} \
                     is on node {} while the first trainer is on node {first} of a Ray cluster whose nodes may be \
                     other hosts: use --weight-transport broadcast (with workers that speak it), or put every \
                     device on one node",
                    node(d)
                ));
            }
        }
        Ok(())
    }
}
