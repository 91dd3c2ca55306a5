//! The switch's device time (compute.model): what a pause, a resume and a weight update of the
//! memory profile's full-scale bytes would take on compute.device. On the simulator the profile's
//! allocations are shrunk by memory.scale and moved by host memcpy on a busy machine, so the
//! measured switch is neither the device's nor steady; each phase of it is still executed and
//! checked, then lasts at least the modelled time, as a worker's request lasts at least its
//! modelled compute (worker/mod.rs, `pace`). Both times are recorded (the recorder's switch
//! block), so that the charge hides nothing.

use super::config::{Config, WeightTransport};
use super::profile::{self, Profile};
use super::recorder::Recorder;
use super::{NCCL_TAG, Role};
use crate::run::clock::Instant;

const GIB: f64 = (1u64 << 30) as f64;

/// The device's figures the switch is charged at, in bytes per second and seconds per byte
/// (0: that part not charged).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rates {
    d2h: f64,
    h2d: f64,
    hbm: f64,
    collective: f64,
    pin: f64,
    map_s_per_byte: f64,
    unmap_s_per_byte: f64,
}

/// The modelled switch of one run: the device's figures and the bytes each role's tags hold on
/// one device at full scale.
pub(crate) struct SwitchModel {
    rates: Rates,
    full: Profile,
    /// The trainer's memory is paused with a host backup (memory.backup).
    trainer_backup: bool,
    /// The hook pins a backup's host buffers at every pause (TMS_KEEP_PINNED_BUFFERS=0). By
    /// default it keeps them for the next, so a steady switch pins nothing; the first pause's
    /// pinning, once per worker, is left out: it would fall in elastic's calibration lend and hold
    /// the lending threshold at a cost no later lend pays.
    repins: bool,
}

/// Whether the workers' hook frees pinned buffers at a resume (the runner's environment is
/// theirs): TMS_KEEP_PINNED_BUFFERS read as the hook reads a flag.
fn hook_repins() -> bool {
    let v = std::env::var("TMS_KEEP_PINNED_BUFFERS").unwrap_or_default();
    matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "no" | "off")
}

fn seconds(bytes: u64, gbps: f64) -> f64 {
    if gbps > 0.0 { bytes as f64 / (gbps * 1e9) } else { 0.0 }
}

impl SwitchModel {
    /// None without compute.model, or without a profile whose bytes to charge.
    pub(crate) fn new(cfg: &Config) -> Option<SwitchModel> {
        if !cfg.compute.model {
            return None;
        }
        let m = &cfg.memory;
        let full = profile::build(&m.profile, m.tp, 1.0, m.kv_cache_gib).ok()?;
        if full.trainer.tags.is_empty() {
            return None;
        }
        let c = &cfg.compute;
        let rates = Rates {
            d2h: c.d2h_gbps,
            h2d: c.h2d_gbps,
            hbm: c.hbm_gbps,
            collective: c.collective_gbps,
            pin: c.pin_gbps,
            map_s_per_byte: c.map_ms_per_gib / 1e3 / GIB,
            unmap_s_per_byte: c.unmap_ms_per_gib / 1e3 / GIB,
        };
        Some(SwitchModel { rates, full, trainer_backup: m.backup, repins: hook_repins() })
    }

    /// Bytes of `tag` (None: every tag) one worker of `role` holds at full scale. The runner's
    /// own small policy tensors and communicators are not the profile's and are left out.
    fn bytes(&self, role: Role, tag: Option<&str>) -> u64 {
        let memory = if role == Role::Trainer { &self.full.trainer } else { &self.full.rollout };
        match tag {
            None => memory.bytes(),
            Some(t) => memory.tag_bytes(t),
        }
    }

    fn backed_up(&self, role: Role) -> bool {
        role == Role::Trainer && self.trainer_backup
    }

    /// Seconds a worker of `role` takes to pause `tag` (None: every tag): its backup copied to the
    /// host (pinned first when the hook does not keep its buffers), then its memory unmapped.
    pub(crate) fn pause_s(&self, role: Role, tag: Option<&str>) -> f64 {
        self.phase_s(role, tag, self.rates.unmap_s_per_byte, |bytes| {
            let pin = if self.repins { seconds(bytes, self.rates.pin) } else { 0.0 };
            pin + seconds(bytes, self.rates.d2h)
        })
    }

    /// Seconds a worker of `role` takes to resume `tag` (None: every tag): its memory mapped, then
    /// its backup copied back when it has one.
    pub(crate) fn resume_s(&self, role: Role, tag: Option<&str>) -> f64 {
        self.phase_s(role, tag, self.rates.map_s_per_byte, |bytes| seconds(bytes, self.rates.h2d))
    }

    /// A pause's or a resume's seconds: the driver's (un)mapping of `tag`'s bytes at
    /// `driver_s_per_byte`, plus `backup_s` of them where `role` keeps a host backup. A
    /// communicator's buffers (tag nccl) are not the profile's: not charged.
    fn phase_s(&self, role: Role, tag: Option<&str>, driver_s_per_byte: f64, backup_s: impl Fn(u64) -> f64) -> f64 {
        if tag == Some(NCCL_TAG) {
            return 0.0;
        }
        let bytes = self.bytes(role, tag);
        let driver = bytes as f64 * driver_s_per_byte;
        if !self.backed_up(role) {
            return driver;
        }
        // IEEE addition commutes, so for a pause this is bit for bit its copy plus its unmap.
        driver + backup_s(bytes)
    }

    /// The weights' bytes on one device at full scale.
    pub(super) fn weights_bytes(&self) -> u64 {
        self.full.rollout.tag_bytes("weights")
    }

    /// Seconds one update of the full-scale weights takes over `transport`: IPC copies them on the
    /// device (each byte read and written: half the HBM bandwidth), host copies them out and back
    /// in, a broadcast moves them at the collective's bus bandwidth. Producing them (gathering
    /// shards, converting) is not modelled.
    pub(crate) fn update_s(&self, transport: WeightTransport) -> f64 {
        let w = self.weights_bytes();
        match transport {
            WeightTransport::Ipc => seconds(w, self.rates.hbm / 2.0),
            WeightTransport::Host => seconds(w, self.rates.d2h) + seconds(w, self.rates.h2d),
            WeightTransport::Broadcast | WeightTransport::Auto => seconds(w, self.rates.collective),
        }
    }
}

/// A switch stage that began at `t0` lasts at least `modelled` seconds; the recorder keeps both
/// its measured and its modelled time under `stage`.
pub(super) fn charge(rec: &mut Recorder, stage: &str, t0: Instant, modelled: f64) {
    let measured = t0.elapsed().as_secs_f64();
    if modelled > measured {
        crate::run::clock::sleep(std::time::Duration::from_secs_f64(modelled - measured));
    }
    rec.record_switch(stage, measured, modelled);
}

/// The compute line's words on the switch (learn.rs, `compute_label`).
pub(super) fn describe(cfg: &Config) -> Option<String> {
    let model = SwitchModel::new(cfg)?;
    let c = &cfg.compute;
    let rate = |key: &str, v: f64| if v > 0.0 { format!("{key} {v:.3} GB/s") } else { format!("{key} not charged") };
    let driver = |key: &str, v: f64| {
        if v > 0.0 { format!("{key} {v} ms/GiB") } else { format!("{key} not charged (no sourced figure)") }
    };
    let pin = if model.repins && c.pin_gbps > 0.0 {
        format!("pinning {:.2} GB/s at every sleep (TMS_KEEP_PINNED_BUFFERS=0)", c.pin_gbps)
    } else {
        "no pinning (the hook keeps its pinned buffers)".into()
    };
    let gb = |b: u64| format!("{:.1} GB", b as f64 / 1e9);
    Some(format!(
        "the switch charged from the profile's full-scale bytes per device (trainer {}, rollout {}, weights {}) \
         on the {}: {}, {}, IPC update at half the HBM's {} GB/s, {}, {pin}, {}, {}; each switch phase lasts at \
         least that (summary.json's switch block has the measured times beside)",
        gb(model.full.trainer.bytes()),
        gb(model.full.rollout.bytes()),
        gb(model.weights_bytes()),
        c.device,
        rate("D2H", c.d2h_gbps),
        rate("H2D", c.h2d_gbps),
        c.hbm_gbps,
        rate("broadcast", c.collective_gbps),
        driver("map", c.map_ms_per_gib),
        driver("unmap", c.unmap_ms_per_gib),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::config;

    fn model(sets: &[&str]) -> SwitchModel {
        let base = ["compute.model=true", "memory.profile=qwen3-4b", "memory.scale=0.002"];
        let all: Vec<String> = base.iter().chain(sets).map(|s| s.to_string()).collect();
        SwitchModel::new(&config::load(None, &all).unwrap()).expect("a modelled profile")
    }

    fn close(got: f64, want: f64) -> bool {
        (got - want).abs() <= 1e-12 * want.abs().max(1e-9)
    }

    /// Sleep and wake are the trainer's full-scale state over the preset's host link, whatever
    /// memory.scale shrank the simulated allocations to; pinning only where the hook re-pins.
    #[test]
    fn the_trainer_s_sleep_and_wake_are_its_full_scale_bytes_over_the_host_link() {
        let mut m = model(&[]);
        let full = profile::build("qwen3-4b", 1, 1.0, 0.0).unwrap();
        let bytes = full.trainer.bytes() as f64;
        assert!((7.0e10..7.5e10).contains(&bytes), "Qwen3-4B's trainer state is about 72 GB: {bytes}");
        assert!(close(m.pause_s(Role::Trainer, None), bytes / 52.8e9));
        assert!(close(m.resume_s(Role::Trainer, None), bytes / 35.0e9));
        // No preset has a sourced map or unmap cost: the rollout's offload and onload are free.
        assert_eq!(m.pause_s(Role::Rollout, None), 0.0);
        assert_eq!(m.resume_s(Role::Rollout, Some("kv_cache")), 0.0);
        assert_eq!(m.pause_s(Role::Trainer, Some(NCCL_TAG)), 0.0);
        m.repins = true;
        let pin = 8.0 * 1.073_741_824 / 2.84;
        assert!(close(m.pause_s(Role::Trainer, None), bytes / 52.8e9 + bytes / (pin * 1e9)));
    }

    /// The driver's costs and the figures a job sets itself are charged per full-scale GiB.
    #[test]
    fn explicit_figures_and_driver_costs_are_charged_per_full_scale_byte() {
        let m = model(&[
            "compute.d2h_gbps=10",
            "compute.pin_gbps=0",
            "compute.unmap_ms_per_gib=4",
            "compute.map_ms_per_gib=2",
        ]);
        let full = profile::build("qwen3-4b", 1, 1.0, 0.0).unwrap();
        let t = full.trainer.bytes() as f64;
        assert!(close(m.pause_s(Role::Trainer, None), t / 10e9 + t / GIB * 0.004));
        let kv = full.rollout.tag_bytes("kv_cache") as f64;
        assert!(close(m.resume_s(Role::Rollout, Some("kv_cache")), kv / GIB * 0.002));
        let backupless = model(&["memory.backup=false", "compute.unmap_ms_per_gib=4"]);
        assert!(close(backupless.pause_s(Role::Trainer, None), t / GIB * 0.004), "no copy without a backup");
    }

    /// An update moves the full-scale weights at the transport's rate on the device.
    #[test]
    fn a_weight_update_is_the_weights_at_the_transport_s_rate() {
        let m = model(&[]);
        let w = m.weights_bytes() as f64;
        assert!((7.8e9..8.6e9).contains(&w), "{w}");
        assert!(close(m.update_s(WeightTransport::Ipc), w / (3350e9 / 2.0)));
        assert!(close(m.update_s(WeightTransport::Host), w / 52.8e9 + w / 35.0e9));
        assert!(close(m.update_s(WeightTransport::Broadcast), w / 365e9));
        let h800 = model(&["compute.device=h800", "run.mode=async", "run.devices=2"]);
        assert!(close(h800.update_s(WeightTransport::Broadcast), w / 215e9));
    }

    #[test]
    fn nothing_is_modelled_without_compute_model() {
        let cfg = config::load(None, &["memory.profile=qwen3-4b".into()]).unwrap();
        assert!(SwitchModel::new(&cfg).is_none() && describe(&cfg).is_none());
    }
}
