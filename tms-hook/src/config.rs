//! Every environment variable the hook reads, parsed once, in one place. Unparseable values are
//! one warning line and the default, never an exit (torch_memory_saver exits on them).

use std::sync::OnceLock;

#[derive(Debug, Clone)]
pub struct Config {
    /// `TMS_INIT_ENABLE`: the region flag of threads that never set one (whole process tracked).
    pub init_enable: bool,
    /// `TMS_INIT_ENABLE_CPU_BACKUP`: the default backup flag.
    pub init_backup: bool,
    /// `TMS_INIT_TAG`: the default tag.
    pub init_tag: String,
    /// `TMS_INIT_CPU_BACKUP_BACKEND`: "pinned" (default) or "mmap".
    pub backup_backend: String,
    /// `TMS_RETAIN_CPU_BACKUP`: after resume, keep handing out the last pause's backup
    /// (`tms_get_cpu_backup_pointer`), as torch_memory_saver does when it retains. Off by default,
    /// as upstream: callers such as slime use the backup whenever one is returned.
    pub retain_backup: bool,
    /// `TMS_KEEP_PINNED_BUFFERS`: keep the pinned buffers of a resumed allocation for its next
    /// pause (their contents are not handed out unless retained), so pinning is paid once.
    pub keep_pinned: bool,
    /// `TMS_MEMORY_MARGIN_BYTES`: free memory to keep when allocating in a region or resuming.
    pub margin: u64,
    /// Most bytes of pinned buffers kept pooled for the next pause (`TMS_PINNED_POOL_MAX_MB`;
    /// None: no limit).
    pub pinned_pool_max: Option<u64>,
    /// Share of the host's memory (percent of MemTotal) that must stay available while pinned
    /// buffers are pooled (`TMS_PINNED_POOL_HOST_RESERVE_PERCENT`): a resume that would leave
    /// less frees pooled buffers until it does.
    pub pinned_pool_host_reserve_percent: u64,
    /// Resume refuses unless the margin stays free too (`TMS_RESUME_KEEPS_MARGIN`, default off).
    pub resume_keeps_margin: bool,
    /// `TMS_BACKUP_STREAMS`: concurrent copy streams per device for backup/restore.
    pub backup_streams: usize,
    /// `TMS_BACKUP_CHUNK_MB`: size of one backup copy.
    pub backup_chunk: usize,
    /// `TMS_PHYSICAL_CHUNK_MB`: allocations with CPU backup larger than this are backed by several
    /// physical handles of this size (0: one handle per allocation).
    pub physical_chunk: usize,
    /// `TMS_INIT_ENABLE_DISK_BACKUP`: the default disk-backup flag (files in
    /// `TMS_DISK_BACKUP_DIR`, see disk.rs).
    pub disk_backup: bool,
    /// `TMS_CONTROL`: None = serve the control socket from the first region allocation on;
    /// Some(true) = from the first hooked call; Some(false) = never.
    pub control: Option<bool>,
    pub warnings: Vec<String>,
}

pub const DEFAULT_TAG: &str = "default";

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// torch_memory_saver's boolean spellings.
pub fn parse_bool(text: &str) -> Option<bool> {
    match text.trim() {
        "1" | "true" | "TRUE" | "True" | "yes" | "YES" | "Yes" => Some(true),
        "0" | "false" | "FALSE" | "False" | "no" | "NO" | "No" | "" => Some(false),
        _ => None,
    }
}

impl Config {
    pub fn from_env() -> Config {
        let mut warnings = Vec::new();
        let mut flag = |name: &str, default: bool| match var(name) {
            None => default,
            Some(v) => parse_bool(&v).unwrap_or_else(|| {
                warnings.push(format!("{name}={v:?} is not a boolean (1/0, true/false, yes/no); using {default}"));
                default
            }),
        };
        let init_enable = flag("TMS_INIT_ENABLE", false);
        let init_backup = flag("TMS_INIT_ENABLE_CPU_BACKUP", false);
        let retain_backup = flag("TMS_RETAIN_CPU_BACKUP", false);
        let keep_pinned = flag("TMS_KEEP_PINNED_BUFFERS", true);
        // torch_memory_saver checks the margin at allocation only; a resume that kept it too
        // would leave a waking trainer's weights unmapped where upstream's succeeds.
        let resume_keeps_margin = flag("TMS_RESUME_KEEPS_MARGIN", false);
        let disk_backup = flag("TMS_INIT_ENABLE_DISK_BACKUP", false);
        let control = var("TMS_CONTROL").filter(|v| !v.is_empty()).map(|_| flag("TMS_CONTROL", true));
        let mut number = |name: &str, default: u64, min: u64| match var(name) {
            None => default,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(n) if n >= min => n,
                _ => {
                    warnings.push(format!("{name}={v:?} is not a whole number >= {min}; using {default}"));
                    default
                }
            },
        };
        let margin = number("TMS_MEMORY_MARGIN_BYTES", 0, 0);
        let pinned_pool_max = var("TMS_PINNED_POOL_MAX_MB")
            .filter(|v| !v.trim().is_empty())
            .map(|_| number("TMS_PINNED_POOL_MAX_MB", u64::MAX >> 20, 0) << 20);
        let pinned_pool_host_reserve_percent = number("TMS_PINNED_POOL_HOST_RESERVE_PERCENT", 25, 0).min(100);
        let backup_streams = number("TMS_BACKUP_STREAMS", 4, 1).min(64) as usize;
        let backup_chunk = (number("TMS_BACKUP_CHUNK_MB", 16, 1).min(4096) as usize) << 20;
        let physical_chunk = (number("TMS_PHYSICAL_CHUNK_MB", 16, 0).min(1 << 20) as usize) << 20;
        let init_tag = var("TMS_INIT_TAG").filter(|t| !t.is_empty()).unwrap_or_else(|| DEFAULT_TAG.to_string());
        let backup_backend = match var("TMS_INIT_CPU_BACKUP_BACKEND").as_deref() {
            None | Some("") | Some("pinned") => "pinned".to_string(),
            Some("mmap") => "mmap".to_string(),
            Some(other) => {
                warnings.push(format!("TMS_INIT_CPU_BACKUP_BACKEND={other:?} is not pinned or mmap; using pinned"));
                "pinned".to_string()
            }
        };
        Config {
            init_enable,
            init_backup,
            init_tag,
            backup_backend,
            retain_backup,
            keep_pinned,
            margin,
            resume_keeps_margin,
            pinned_pool_max,
            pinned_pool_host_reserve_percent,
            backup_streams,
            backup_chunk,
            physical_chunk,
            disk_backup,
            control,
            warnings,
        }
    }
}

pub fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(Config::from_env)
}

/// Allocator settings under which hooked memory cannot be paused (they allocate through driver
/// entry points LD_PRELOAD never sees). Returns the variable and its value if one is set.
pub fn expandable_segments() -> Option<(&'static str, String)> {
    ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF"].into_iter().find_map(|name| {
        let v = var(name)?;
        let on = v.split(',').any(|kv| {
            let mut it = kv.splitn(2, ':');
            it.next().map(str::trim) == Some("expandable_segments")
                && it.next().map(|b| b.trim().eq_ignore_ascii_case("true")) == Some(true)
        });
        on.then_some((name, v))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booleans_follow_torch_memory_saver() {
        for t in ["1", "true", "TRUE", "yes", "YES"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["0", "false", "FALSE", "no", "NO"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        assert_eq!(parse_bool("maybe"), None);
    }
}
