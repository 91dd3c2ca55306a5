//! What `relax-colocate bench` is asked to do.

use crate::vendor::ApiKind;
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// The real CUDA driver if libcuda.so.1 loads, else CANN if libascendcl.so loads, else the
    /// simulator.
    Auto,
    /// tms-sim, through the API `--api` names (CUDA by default).
    Sim,
    /// The real CUDA driver (libcudart + libcuda).
    Cuda,
    /// An Ascend NPU through CANN's ACL (libascendcl.so, found by CANN's set_env.sh).
    Npu,
}

pub struct Options {
    pub device: DeviceKind,
    /// None: the device's own (CUDA on the simulator).
    pub api: Option<ApiKind>,
    pub quick: bool,
    pub out: PathBuf,
    pub hook: Option<PathBuf>,
    pub sim_memory: String,
    pub sim_copy_gbps: f64,
    /// Simulator: the modelled link of the collective row (`TMS_SIM_LINK_GBPS`), GB/s.
    pub sim_link_gbps: f64,
    /// The collective row's broadcast sizes; None: the defaults (fewer and smaller with --quick).
    pub broadcast_sizes: Option<Vec<usize>>,
    /// torch_memory_saver's library to compare with, side by side (CUDA only).
    pub upstream_lib: UpstreamLib,
}

/// Which torch_memory_saver library to compare with (`--upstream-lib`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamLib {
    /// Look for the torch_memory_saver package of `python3` on PATH.
    Auto,
    /// No comparison.
    Off,
    Path(PathBuf),
}

impl std::str::FromStr for UpstreamLib {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "auto" => UpstreamLib::Auto,
            "none" | "off" => UpstreamLib::Off,
            path => UpstreamLib::Path(PathBuf::from(path)),
        })
    }
}
