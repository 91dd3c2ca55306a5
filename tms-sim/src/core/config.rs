//! Every tunable of the simulator, read once from the environment.

use std::path::PathBuf;

/// Most devices one simulated node can have (fixed so the shared state file has a fixed layout):
/// enough for a published multi-node job's devices on one simulated node (32 H20s, 64 in all).
pub const MAX_DEVICES: usize = 64;
/// Devices `tms_sim_stats` reports: the C struct's arrays (include/tms_sim.h,
/// TMS_SIM_MAX_DEVICES), kept at their published size so no caller's layout changes.
pub const STATS_DEVICES: usize = 16;
/// Granularity of physical allocations and reservations: what current GPUs and the 910B's huge
/// pages report.
pub const GRANULARITY: usize = 2 << 20;

pub const DEFAULT_DEVICES: u32 = 1;
pub const DEFAULT_MEMORY: u64 = 16 << 30;
/// An H100's pinned host<->device copy rate (cuda.md: copy engines reach about 50-57 GB/s), so
/// copies take time by default and a missing synchronize shows.
pub const DEFAULT_COPY_GBPS: f64 = 50.0;
/// Plain allocations from this size up take whole granules; smaller ones share granules, as the
/// driver sub-allocates them (since Pascal: 2 MiB pages, allocations over 1 MB page-aligned).
pub const SMALL_ALLOCATION_LIMIT: usize = 1 << 20;
/// Alignment of small plain allocations inside shared granules (cudaMalloc aligns to 256 bytes at
/// least; 512 is what GPUs give).
pub const SMALL_ALLOCATION_ALIGN: usize = 512;

#[derive(Clone, Debug)]
pub struct Config {
    /// Name of the simulated node: processes naming the same node share its devices.
    pub node: String,
    /// Folder that holds node state files.
    pub dir: PathBuf,
    pub devices: u32,
    /// Capacity of each device in bytes.
    pub memory: u64,
    /// Host<->device copy bandwidth per direction per device, bytes per second (0 = copies take
    /// no modelled time).
    pub copy_bytes_per_sec: f64,
    /// Cost of allocating pinned host memory, bytes per second (0 = free).
    pub pin_bytes_per_sec: f64,
    /// Fault-injection rules, see `fault.rs`.
    pub fail: String,
    /// Device memory a context takes (`TMS_SIM_CONTEXT_MEMORY`); None: the API's default.
    pub context_bytes: Option<u64>,
    /// Commit host pages when physical memory is created (as a device does), instead of on first
    /// touch. Costs real host memory for every byte created.
    pub commit: bool,
    /// Keep the simulator's view of device memory mapped after each access, so that device bytes
    /// count in the process's VmRSS (`TMS_SIM_DEVICE_IN_RSS=1`; the default with `commit`). Else,
    /// as on a GPU, they do not: after each copy, memset or CPU-layer op the view's page-table
    /// entries are dropped (the bytes stay in the device pool).
    pub device_in_rss: bool,
    /// Bytes per second a rank's link carries for collectives between devices of one simulated
    /// node, and between nodes (`TMS_SIM_LINK_GBPS=INTRA[,INTER]`; 0: no modelled time).
    pub link_intra_bytes_per_sec: f64,
    pub link_inter_bytes_per_sec: f64,
}

impl Config {
    pub fn from_env() -> Config {
        let node = env_str("TMS_SIM_NODE").unwrap_or_else(|| "default".to_string());
        let devices = match env_str("TMS_SIM_DEVICES") {
            Some(v) => match v.parse::<u32>() {
                Ok(n) if (1..=MAX_DEVICES as u32).contains(&n) => n,
                _ => {
                    warn(&format!(
                        "TMS_SIM_DEVICES={v:?} is not a number from 1 to {MAX_DEVICES}; using {DEFAULT_DEVICES}"
                    ));
                    DEFAULT_DEVICES
                }
            },
            None => DEFAULT_DEVICES,
        };
        let memory = match env_str("TMS_SIM_MEMORY") {
            Some(v) => match parse_size(&v) {
                Some(n) if n >= GRANULARITY as u64 => n,
                _ => {
                    warn(&format!("TMS_SIM_MEMORY={v:?} is not a size of at least 2MiB (e.g. 16GiB); using 16GiB"));
                    DEFAULT_MEMORY
                }
            },
            None => DEFAULT_MEMORY,
        };
        let link = link_rates();
        let commit = env_str("TMS_SIM_COMMIT").is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        Config {
            node,
            dir: state_dir(),
            devices,
            memory,
            copy_bytes_per_sec: gbps("TMS_SIM_COPY_GBPS", DEFAULT_COPY_GBPS),
            pin_bytes_per_sec: gbps("TMS_SIM_PIN_GBPS", 0.0),
            fail: env_str("TMS_SIM_FAIL").unwrap_or_default(),
            context_bytes: context_bytes_from_env(),
            commit,
            // Committed memory keeps its page tables (no host page faults inside timed copies),
            // so it stays resident unless asked otherwise.
            device_in_rss: env_str("TMS_SIM_DEVICE_IN_RSS")
                .map_or(commit, |v| v == "1" || v.eq_ignore_ascii_case("true")),
            link_intra_bytes_per_sec: link.0,
            link_inter_bytes_per_sec: link.1,
        }
    }

    pub fn state_file(&self) -> PathBuf {
        state_file_for(&self.dir, &self.node)
    }
}

/// `TMS_SIM_CONTEXT_MEMORY`: what a context takes on its device; None: the API's default
/// (each front end's `CONTEXT_BYTES`).
pub fn context_bytes_from_env() -> Option<u64> {
    let v = env_str("TMS_SIM_CONTEXT_MEMORY")?;
    let bytes = parse_size(&v);
    if bytes.is_none() {
        warn(&format!("TMS_SIM_CONTEXT_MEMORY={v:?} is not a size (e.g. 300MiB, 0); using the defaults"));
    }
    bytes
}

/// `INTRA[,INTER]` GB/s, the syntax of `TMS_SIM_LINK_GBPS`; INTER is INTRA when only one is given.
pub fn parse_link_gbps(text: &str) -> Option<(f64, f64)> {
    let parse = |s: &str| s.trim().parse::<f64>().ok().filter(|g| *g >= 0.0 && g.is_finite());
    let mut parts = text.split(',');
    let intra = parse(parts.next()?)?;
    let inter = match parts.next() {
        Some(p) => parse(p)?,
        None => intra,
    };
    parts.next().is_none().then_some((intra, inter))
}

/// Where node state files live: `$TMS_SIM_DIR`, else `/dev/shm`, else the temp dir.
pub fn state_dir() -> PathBuf {
    if let Some(d) = env_str("TMS_SIM_DIR") {
        return PathBuf::from(d);
    }
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() { shm } else { std::env::temp_dir() }
}

pub fn state_file_for(dir: &std::path::Path, node: &str) -> PathBuf {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let safe: String = node
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '_' })
        .collect();
    // The layout's version in the name: a build of another layout keeps a node file of its own
    // rather than re-initialising one a live process of the other reads.
    let version = crate::core::node::LAYOUT_VERSION;
    dir.join(format!("tms-sim-{uid}-{safe}.v{version}"))
}

fn env_str(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// An H100's NVLink 4 carries 450 GB/s each way (900 GB/s bidirectional, NVIDIA's H100
/// datasheet); between nodes a GPU has one 400 Gb/s NIC, 50 GB/s (the DGX H100 layout).
pub const DEFAULT_LINK_INTRA_GBPS: f64 = 450.0;
pub const DEFAULT_LINK_INTER_GBPS: f64 = 50.0;

/// `TMS_SIM_LINK_GBPS=INTRA[,INTER]` in GB/s, as bytes per second.
fn link_rates() -> (f64, f64) {
    let defaults = (DEFAULT_LINK_INTRA_GBPS * 1e9, DEFAULT_LINK_INTER_GBPS * 1e9);
    let Some(v) = env_str("TMS_SIM_LINK_GBPS") else { return defaults };
    match parse_link_gbps(&v) {
        Some((a, b)) => (a * 1e9, b * 1e9),
        None => {
            warn(&format!(
                "TMS_SIM_LINK_GBPS={v:?} is not INTRA[,INTER] in GB/s (e.g. 450,50); using {DEFAULT_LINK_INTRA_GBPS},{DEFAULT_LINK_INTER_GBPS}"
            ));
            defaults
        }
    }
}

fn gbps(name: &str, default: f64) -> f64 {
    match env_str(name) {
        None => default * 1e9,
        Some(v) => match v.trim().parse::<f64>() {
            Ok(g) if g >= 0.0 && g.is_finite() => g * 1e9,
            _ => {
                warn(&format!("{name}={v:?} is not a number of GB/s; using {default}"));
                default * 1e9
            }
        },
    }
}

/// Parses a size by tms's one rule (`tms_proto::size`): `16GiB`, `512MiB`, `16G` (GiB), `4096`;
/// `12GB` is 12 * 10^9 bytes, as the unit says.
pub fn parse_size(text: &str) -> Option<u64> {
    tms_proto::size::parse_size(text).ok()
}

/// One line on stderr; the simulator has no logger of its own so that it pulls nothing into the
/// processes that load it.
pub fn warn(msg: &str) {
    eprintln!("tms-sim: {msg}");
}

/// Says that an entry point the simulator does not implement was called, once per name.
pub fn warn_not_supported(name: &str, code_name: &str) {
    static SAID: std::sync::Mutex<Option<std::collections::HashSet<String>>> = std::sync::Mutex::new(None);
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if said.get_or_insert_with(Default::default).insert(name.to_string()) {
        warn(&format!("{name} is not supported by the simulator ({code_name})"));
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_by_their_units() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("2MiB"), Some(2 << 20));
        assert_eq!(parse_size("16GiB"), Some(16 << 30));
        assert_eq!(parse_size("1.5g"), Some(3 << 29));
        assert_eq!(parse_size("12 GB"), Some(12_000_000_000));
        assert_eq!(parse_size("lots"), None);
    }
}
