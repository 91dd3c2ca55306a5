//! How much device memory each role takes, as the hook will charge it, and on the simulator
//! whether the host has that much: sizing the simulated device and refusing runs that cannot fit.

use super::config::Config;
use super::profile::Profile;
use super::recorder::report;
use super::{GRANULARITY, MIB, model};

pub(super) fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

/// Bytes each role holds on one device, as the hook will charge them.
pub(super) struct Footprint {
    pub(super) trainer: u64,
    pub(super) rollout: u64,
    pub(super) rollout_weights: u64,
    pub(super) transfer: u64,
}

/// Allocations of these sizes, each rounded up to `unit`.
fn rounded<'a>(sizes: impl IntoIterator<Item = &'a u64>, unit: u64) -> u64 {
    sizes.into_iter().map(|s| round_up(*s, unit)).sum()
}

/// What the hook charges the device for each role (every allocation rounded up to the granularity).
pub(super) fn footprint(cfg: &Config, shape: &model::Shape, profile: &Profile, bucket: u64) -> Footprint {
    footprint_in(cfg, shape, profile, bucket, GRANULARITY)
}

/// What each role costs the host on the simulator. Its device memory is a file whose pages exist
/// only once written (unless TMS_SIM_COMMIT=1 commits them at create), and the workers write the
/// bytes they asked for, not the granularity's rounding: an allocation costs its size rounded to
/// host pages. A profile scaled down has hundreds of small allocations per role, each charged a
/// whole 2 MiB on the device but holding a few pages of the host.
pub(super) fn host_footprint(cfg: &Config, shape: &model::Shape, profile: &Profile, bucket: u64) -> Footprint {
    let committed = std::env::var("TMS_SIM_COMMIT").is_ok_and(|v| v.trim() == "1");
    let unit = if committed { GRANULARITY } else { host_page_size() };
    footprint_in(cfg, shape, profile, bucket, unit)
}

fn host_page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 { n as u64 } else { 4096 }
}

fn footprint_in(cfg: &Config, shape: &model::Shape, profile: &Profile, bucket: u64, unit: u64) -> Footprint {
    let charged = |sizes: &mut dyn Iterator<Item = &u64>| rounded(sizes, unit);
    let tensors: Vec<u64> = model::layout(shape).iter().map(|(_, n)| *n as u64 * 4).collect();
    let policy = charged(&mut tensors.iter());
    // An engine's batch: its share of the colocated batch, or apart what its requests hold.
    let groups = match cfg.mode_layout() {
        Ok(Some(split)) => cfg.engine_groups(split.rollout.len()),
        _ => cfg.rollout.prompts_per_step / cfg.total_devices(),
    };
    let max_batch = (groups * cfg.rollout.samples_per_prompt) as u64;
    let weight_pads: Vec<u64> =
        profile.rollout.tags.iter().filter(|(t, _)| t == "weights").flat_map(|(_, s)| s).copied().collect();
    let weights_exact = tensors.iter().sum::<u64>() + weight_pads.iter().sum::<u64>();
    Footprint {
        trainer: 5 * policy + charged(&mut profile.trainer.tags.iter().flat_map(|(_, s)| s)),
        rollout: policy
            + round_up(max_batch * shape.hidden as u64 * 8, unit)
            + round_up(max_batch * shape.vocab as u64 * 8, unit)
            + charged(&mut profile.rollout.tags.iter().flat_map(|(_, s)| s)),
        rollout_weights: policy + charged(&mut weight_pads.iter()),
        transfer: round_up(bucket.min(weights_exact), 4096),
    }
}

/// Device memory one weight-sync communicator takes on tms-sim (docs/simulator.md) with `peers`
/// other ranks: NCCL's buffers (2 channels x send and receive x NCCL_BUFFSIZE, 4 MiB by default)
/// per peer and the 1 MiB that stays; HCCL's two buffers of HCCL_BUFFSIZE MB (200 by default).
pub(super) fn sim_communicator_bytes(api: crate::vendor::ApiKind, peers: u64) -> u64 {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.trim().parse::<u64>().ok()).filter(|v| *v > 0);
    match api {
        crate::vendor::ApiKind::Acl => 2 * env("HCCL_BUFFSIZE").unwrap_or(200) * MIB,
        crate::vendor::ApiKind::Cuda => peers * 2 * 2 * env("NCCL_BUFFSIZE").unwrap_or(4 * MIB) + MIB,
    }
}

/// The simulator keeps device memory in host memory: a run whose trainer and rollout bytes do not
/// fit in what the host has available would end with the kernel's OOM killer (possibly another
/// process), a minute in. Refuse it up front and say how to scale it down.
pub(super) fn check_host_memory_for_sim(
    cfg: &Config,
    per_device: u64,
    per_device_at_scale: impl Fn(f64) -> Option<u64>,
) -> Result<(), String> {
    let Some(available) = host_memory_available() else { return Ok(()) };
    let devices = cfg.total_devices() as u64;
    let needed = per_device.saturating_mul(devices);
    // Leave room for the processes themselves, backups in flight and the rest of the machine.
    let usable = available / 10 * 8;
    if needed <= usable {
        return Ok(());
    }
    // Parts of a profile do not scale, so look for a scale that fits rather than divide.
    let mut fits = (cfg.memory.scale * usable as f64 / needed as f64 * 100.0).floor() / 100.0;
    while fits > 0.01 && per_device_at_scale(fits).is_none_or(|b| b.saturating_mul(devices) > usable) {
        fits = ((fits * 0.9) * 100.0).floor() / 100.0;
    }
    let m = &cfg.memory;
    // Name the key that made the run this large: an explicit KV cache size, else the profile.
    let what = if m.kv_cache_gib > 0.0 {
        format!("memory.kv_cache_gib = {} sizes a {} GiB KV cache per device", m.kv_cache_gib, m.kv_cache_gib)
    } else {
        format!("memory.profile = {:?} with memory.tp = {} at memory.scale = {}", m.profile, m.tp, m.scale)
    };
    let kv = if m.kv_cache_gib > 0.0 { "lower memory.kv_cache_gib, or " } else { "" };
    let fewer = if devices > 1 { ", or use fewer --devices" } else { "" };
    Err(format!(
        "{what}: on the simulator device memory is host memory, and this run needs about {} ({} device(s) \
         x trainer + rollout) while the host has {} available. Fix: {kv}scale the profile down with \
         --set memory.scale={:.2}{fewer}",
        report::human(needed),
        devices,
        report::human(available),
        fits.max(0.01),
    ))
}

/// `MemAvailable` from /proc/meminfo, in bytes.
fn host_memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scaled_profile_costs_the_host_its_bytes_not_the_devices_rounding() {
        let cfg = super::super::config::load(None, &["memory.profile=qwen3-4b".into(), "memory.scale=0.002".into()])
            .expect("config");
        let shape = model::Shape { vocab: 64, context: 32, hidden: cfg.model.hidden };
        let p = super::super::profile::build("qwen3-4b", 1, 0.002, 0.0).expect("profile");
        let device = footprint(&cfg, &shape, &p, 4 << 20);
        let host = footprint_in(&cfg, &shape, &p, 4 << 20, 4096);
        let (device, host) = (device.trainer + device.rollout, host.trainer + host.rollout);
        // Hundreds of allocations of a few pages each: the device charges 2 MiB apiece.
        assert!(host * 4 < device, "host {host} vs device {device}");
        // Eight devices of the seeds' Qwen3-4B job fit a 24 GiB host (they did not when the
        // check counted the device's rounding: about 23 GiB).
        assert!(8 * host < 8 << 30, "8 devices need {host} x 8");
        // Nothing is rounded below what the workers write.
        let exact = footprint_in(&cfg, &shape, &p, 4 << 20, 1);
        assert!(host >= exact.trainer + exact.rollout);
    }
}
