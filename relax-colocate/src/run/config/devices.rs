//! `compute.device`: the accelerators the compute model knows, each figure from a source that
//! docs/device-figures.md names (a vendor sheet, a paper, or a measured public run). A figure
//! nobody has published is `None`: the preset leaves it unset, and a job that needs it must give
//! it itself (`Config::validate` names the key), because a preset that filled the hole would
//! present a guess as the device's figure.

/// One device's figures, as the `[compute]` keys of the same names take them.
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    pub name: &'static str,
    pub what: &'static str,
    pub tflops: Option<f64>,
    pub hbm_gbps: Option<f64>,
    pub h2d_gbps: Option<f64>,
    pub d2h_gbps: Option<f64>,
    pub collective_gbps: Option<f64>,
    pub pin_gbps: Option<f64>,
    pub map_ms_per_gib: Option<f64>,
    pub unmap_ms_per_gib: Option<f64>,
}

/// 8 GiB pinned by cuMemHostAlloc in 2.74 to 2.84 s on an 8 x H100 host (the slower taken).
const H100_PIN_GBPS: f64 = 8.0 * 1.073_741_824 / 2.84;

/// The presets, `compute.device`'s values. Where docs/device-figures.md gives a range, the figure
/// is its slower end: the switch must not look cheaper than a measured run found it.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "h100",
        what: "NVIDIA H100 SXM5 80 GB",
        tflops: Some(989.0),
        hbm_gbps: Some(3350.0),
        h2d_gbps: Some(35.0),
        d2h_gbps: Some(52.8),
        collective_gbps: Some(365.0),
        pin_gbps: Some(H100_PIN_GBPS),
        map_ms_per_gib: None,
        unmap_ms_per_gib: None,
    },
    Preset {
        name: "h800",
        what: "NVIDIA H800 SXM5 80 GB",
        tflops: Some(989.0),
        hbm_gbps: Some(3350.0),
        h2d_gbps: None,
        d2h_gbps: None,
        collective_gbps: Some(215.0),
        pin_gbps: None,
        map_ms_per_gib: None,
        unmap_ms_per_gib: None,
    },
    Preset {
        name: "h20",
        what: "NVIDIA H20 96 GB",
        tflops: Some(148.0),
        hbm_gbps: Some(4000.0),
        h2d_gbps: None,
        d2h_gbps: None,
        collective_gbps: None,
        pin_gbps: None,
        map_ms_per_gib: None,
        unmap_ms_per_gib: None,
    },
    Preset {
        name: "910b",
        what: "Huawei Ascend 910B",
        tflops: Some(328.0),
        hbm_gbps: None,
        h2d_gbps: None,
        d2h_gbps: None,
        collective_gbps: Some(72.0),
        pin_gbps: None,
        map_ms_per_gib: None,
        unmap_ms_per_gib: None,
    },
    Preset {
        name: "910c",
        what: "Huawei Ascend 910C",
        tflops: Some(752.0),
        hbm_gbps: Some(3200.0),
        h2d_gbps: Some(33.9),
        d2h_gbps: Some(29.5),
        collective_gbps: None,
        pin_gbps: None,
        map_ms_per_gib: None,
        unmap_ms_per_gib: None,
    },
];

/// A preset's figure for one key.
type Figure = fn(&Preset) -> Option<f64>;

/// The `[compute]` keys a preset fills, each with its figure in a preset.
pub const FIGURE_KEYS: &[(&str, Figure)] = &[
    ("tflops", |p| p.tflops),
    ("hbm_gbps", |p| p.hbm_gbps),
    ("h2d_gbps", |p| p.h2d_gbps),
    ("d2h_gbps", |p| p.d2h_gbps),
    ("collective_gbps", |p| p.collective_gbps),
    ("pin_gbps", |p| p.pin_gbps),
    ("map_ms_per_gib", |p| p.map_ms_per_gib),
    ("unmap_ms_per_gib", |p| p.unmap_ms_per_gib),
];

pub fn names() -> String {
    let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
    names.join(", ")
}

pub fn find(name: &str) -> Result<&'static Preset, String> {
    PRESETS.iter().find(|p| p.name == name.trim()).ok_or_else(|| {
        format!("compute.device {name:?} is not a preset; choose one of {} (docs/device-figures.md)", names())
    })
}

/// Fills each figure key of `compute` that the job did not set (`explicit`) from the preset it
/// names. Returns the keys neither gives: set to 0 in the table (nothing charged), and listed so
/// that a job that needs one is refused by name.
pub fn apply(compute: &mut toml::Table, explicit: &[String]) -> Result<Vec<String>, String> {
    let name = compute.get("device").and_then(toml::Value::as_str).unwrap_or("h100").to_string();
    let preset = find(&name)?;
    let mut unset = Vec::new();
    for (key, figure) in FIGURE_KEYS {
        if explicit.iter().any(|k| k == key) {
            continue;
        }
        let value = figure(preset).unwrap_or_else(|| {
            unset.push(key.to_string());
            0.0
        });
        compute.insert(key.to_string(), toml::Value::Float(value));
    }
    Ok(unset)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every preset's name is unique and every figure it gives is a positive number: a zero would
    /// silently turn a part of the model off.
    #[test]
    fn presets_are_unique_and_their_figures_positive() {
        for (i, p) in PRESETS.iter().enumerate() {
            assert!(PRESETS[..i].iter().all(|q| q.name != p.name), "{} twice", p.name);
            for (key, figure) in FIGURE_KEYS {
                assert!(figure(p).is_none_or(|v| v > 0.0 && v.is_finite()), "{}.{key}", p.name);
            }
            assert!(p.tflops.is_some(), "{}: every preset has a peak", p.name);
        }
        assert!((H100_PIN_GBPS - 3.0246).abs() < 1e-3, "{H100_PIN_GBPS}");
    }

    /// `run --help` names every preset, and the default configuration the first.
    #[test]
    fn run_s_help_and_the_defaults_list_the_presets() {
        let help = crate::RUN_HELP.split("Device presets").nth(1).expect("a presets paragraph");
        let defaults = crate::run::config::DEFAULT_TOML;
        for p in PRESETS {
            assert!(help.contains(&format!(" {}", p.name)), "run --help lacks {}", p.name);
            assert!(defaults.contains(&format!(" {} ", p.name)), "default.toml lacks {}", p.name);
        }
        assert!(defaults.contains("device = \"h100\""));
    }
}
