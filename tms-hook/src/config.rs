//! Every environment variable the hook reads, parsed once, in one place. Unparseable values are
//! one warning line and the default, never an exit (torch_memory_saver exits on them). Two rules
//! protect data: a `TMS_*` name nobody reads (a typo such as `TMS_INIT_ENABLE_CPU_BAKUP`) is
//! named in a warning with the variable it most resembles, and a backup flag that cannot be read
//! keeps the backup on, since pausing without one loses the contents.

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
    /// Pauses take checksums of their backups and resumes check the restored bytes
    /// (`TMS_VERIFY_RESTORE`, default off: it reads every restored byte back).
    pub verify_restore: bool,
    /// Who pauses and resumes this process (`TMS_MANAGED_BY`): control requests from anyone
    /// else are refused unless forced.
    pub managed_by: Option<String>,
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

/// The variables the hook reads (this module, control.rs, disk.rs, log.rs).
pub const HOOK_VARIABLES: &[&str] = &[
    "TMS_INIT_ENABLE",
    "TMS_INIT_ENABLE_CPU_BACKUP",
    "TMS_INIT_TAG",
    "TMS_INIT_CPU_BACKUP_BACKEND",
    "TMS_INIT_ENABLE_DISK_BACKUP",
    "TMS_DISK_BACKUP_DIR",
    "TMS_RETAIN_CPU_BACKUP",
    "TMS_KEEP_PINNED_BUFFERS",
    "TMS_PINNED_POOL_MAX_MB",
    "TMS_PINNED_POOL_HOST_RESERVE_PERCENT",
    "TMS_MEMORY_MARGIN_BYTES",
    "TMS_RESUME_KEEPS_MARGIN",
    "TMS_VERIFY_RESTORE",
    "TMS_MANAGED_BY",
    "TMS_BACKUP_STREAMS",
    "TMS_BACKUP_CHUNK_MB",
    "TMS_PHYSICAL_CHUNK_MB",
    "TMS_LOG",
    "TMS_CONTROL",
    "TMS_CONTROL_DIR",
    "TMS_CONTROL_TIMEOUT_MS",
    "TMS_NAME",
];

/// `TMS_*` names that other parts of tms read (simulator, tools, scripts, tests, the Python
/// package): not typos. `TMS_HOOK_MODE` is the Ascend build of torch_memory_saver's default hook
/// mode, which our torch_memory_saver package honours too.
const OTHER_VARIABLES: &[&str] = &[
    "TMS_HOOK_MODE",
    "TMS_BACKUP_LIVE_ONLY",
    "TMS_NCCL_REREGISTER",
    "TMS_LIBRARY",
    "TMS_HOOK",
    "TMS_PREFIX",
    "TMS_PROFILE",
    "TMS_CUDA_MAJOR",
    "TMS_CUDART_SONAME",
    "TMS_BUILD_VENV",
    "TMS_WHEEL_TARGET_DIR",
    "TMS_UPSTREAM_WHEEL",
];
const OTHER_PREFIXES: &[&str] = &["TMS_SIM_", "TMS_TEST_", "TMS_TORCH", "TMS_RAY_"];

/// One warning per `TMS_*` name in `names` that no part of tms reads, naming the closest
/// variable the hook reads.
pub fn unknown_variables<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    names
        .into_iter()
        .filter(|n| n.starts_with("TMS_"))
        .filter(|n| !HOOK_VARIABLES.contains(n) && !OTHER_VARIABLES.contains(n))
        .filter(|n| !OTHER_PREFIXES.iter().any(|p| n.starts_with(p)))
        .map(|n| {
            let closest = HOOK_VARIABLES.iter().min_by_key(|k| edit_distance(n, k)).copied().unwrap_or("TMS_LOG");
            format!("{n} is not a variable tms reads (ignored); did you mean {closest}?")
        })
        .collect()
}

/// Levenshtein distance over bytes (variable names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitution = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// Boolean spellings: 1/0, true/false, yes/no, on/off in any case (torch_memory_saver's are a subset).
pub fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" | "" => Some(false),
        _ => None,
    }
}

/// The levels `TMS_LOG` takes alone; anything else must be a directive list (`target=level,...`).
const LOG_LEVELS: &[&str] = &["off", "error", "warn", "info", "debug", "trace"];

/// Whether `TMS_LOG`'s value is a filter, not a word such as `verbose` that tracing would take
/// for a target name and so silence every warning.
pub fn valid_log_filter(text: &str) -> bool {
    text.split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .all(|d| d.contains('=') || LOG_LEVELS.contains(&d.to_ascii_lowercase().as_str()))
}

impl Config {
    pub fn from_env() -> Config {
        let names: Vec<String> = std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()).collect();
        // Warnings keep the order in which variables are read: unknown names first.
        let mut env = EnvReader { warnings: unknown_variables(names.iter().map(String::as_str)) };
        // Pausing without a backup loses the contents: an unreadable value keeps the backup on.
        let init_backup = env.flag_or(
            "TMS_INIT_ENABLE_CPU_BACKUP",
            false,
            true,
            ", the safe choice (without a backup a pause loses the contents)",
        );
        let init_enable = env.flag("TMS_INIT_ENABLE", false);
        let retain_backup = env.flag("TMS_RETAIN_CPU_BACKUP", false);
        let keep_pinned = env.flag("TMS_KEEP_PINNED_BUFFERS", true);
        // torch_memory_saver checks the margin at allocation only; a resume that kept it too
        // would leave a waking trainer's weights unmapped where upstream's succeeds.
        let resume_keeps_margin = env.flag("TMS_RESUME_KEEPS_MARGIN", false);
        let verify_restore = env.flag("TMS_VERIFY_RESTORE", false);
        let managed_by = var("TMS_MANAGED_BY").filter(|v| !v.trim().is_empty());
        let disk_backup = env.flag("TMS_INIT_ENABLE_DISK_BACKUP", false);
        let control = var("TMS_CONTROL").filter(|v| !v.is_empty()).map(|_| env.flag("TMS_CONTROL", true));
        let pinned_pool_max = env.pinned_pool_max();
        let pinned_pool_host_reserve_percent = env.number("TMS_PINNED_POOL_HOST_RESERVE_PERCENT", 25, 0, 100);
        let backup_streams = env.number("TMS_BACKUP_STREAMS", 4, 1, 64) as usize;
        let backup_chunk = (env.number("TMS_BACKUP_CHUNK_MB", 16, 1, 4096) as usize) << 20;
        let physical_chunk = (env.number("TMS_PHYSICAL_CHUNK_MB", 16, 0, 1 << 20) as usize) << 20;
        let margin = env.margin();
        env.check_log_filter();
        let init_tag = var("TMS_INIT_TAG").filter(|t| !t.is_empty()).unwrap_or_else(|| DEFAULT_TAG.to_string());
        let backup_backend = env.backup_backend();
        Config {
            init_enable,
            init_backup,
            init_tag,
            backup_backend,
            retain_backup,
            keep_pinned,
            margin,
            resume_keeps_margin,
            verify_restore,
            managed_by,
            pinned_pool_max,
            pinned_pool_host_reserve_percent,
            backup_streams,
            backup_chunk,
            physical_chunk,
            disk_backup,
            control,
            warnings: env.warnings,
        }
    }
}

/// Reads variables for `Config::from_env`: a value it cannot use becomes one warning and a
/// fallback, never an error, since the hook runs inside jobs it must not stop.
struct EnvReader {
    warnings: Vec<String>,
}

impl EnvReader {
    /// A boolean: `default` when unset, `unreadable` (with `why` after the warning) when set to
    /// something that is not a boolean.
    fn flag_or(&mut self, name: &str, default: bool, unreadable: bool, why: &str) -> bool {
        match var(name) {
            None => default,
            Some(v) => parse_bool(&v).unwrap_or_else(|| {
                self.warnings.push(format!(
                    "{name}={v:?} is not a boolean (1/0, true/false, yes/no, on/off); using {}{why}",
                    u8::from(unreadable)
                ));
                unreadable
            }),
        }
    }

    /// A boolean whose unreadable values mean the default.
    fn flag(&mut self, name: &str, default: bool) -> bool {
        self.flag_or(name, default, default, "")
    }

    /// A whole number from `min` to `max`: one above `max` is clamped to it, anything else
    /// unreadable means `default`.
    fn number(&mut self, name: &str, default: u64, min: u64, max: u64) -> u64 {
        match var(name) {
            None => default,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(n) if n > max => {
                    self.warnings.push(format!("{name}={n} is above the most it takes, {max}; using {max}"));
                    max
                }
                Ok(n) if n >= min => n,
                _ => {
                    self.warnings
                        .push(format!("{name}={v:?} is not a whole number from {min} to {max}; using {default}"));
                    default
                }
            },
        }
    }

    /// `TMS_PINNED_POOL_MAX_MB` in bytes; unset, empty or unreadable: no limit (None), said so.
    fn pinned_pool_max(&mut self) -> Option<u64> {
        const NAME: &str = "TMS_PINNED_POOL_MAX_MB";
        let v = var(NAME).filter(|v| !v.trim().is_empty())?;
        match v.trim().parse::<u64>() {
            Ok(mb) => Some(mb.min(u64::MAX >> 20) << 20),
            Err(_) => {
                self.warnings.push(format!("{NAME}={v:?} is not a whole number of MiB; using no limit"));
                None
            }
        }
    }

    /// `TMS_MEMORY_MARGIN_BYTES`, in the same size forms as `tms-ctl set --margin` (4096,
    /// 512MiB, 2GiB, 1GB).
    fn margin(&mut self) -> u64 {
        match var("TMS_MEMORY_MARGIN_BYTES") {
            None => 0,
            Some(v) if v.trim().is_empty() => 0,
            Some(v) => tms_proto::size::parse_size(&v).unwrap_or_else(|e| {
                self.warnings.push(format!("TMS_MEMORY_MARGIN_BYTES={v:?} cannot be read ({e}); using 0 (no margin)"));
                0
            }),
        }
    }

    /// log.rs applies `TMS_LOG`; the warning is here so that it joins the others.
    fn check_log_filter(&mut self) {
        if let Some(v) = var("TMS_LOG").filter(|v| !valid_log_filter(v)) {
            self.warnings.push(format!(
                "TMS_LOG={v:?} is not a log filter (off, error, warn, info, debug, trace, or target=level,...); using warn"
            ));
        }
    }

    /// `TMS_INIT_CPU_BACKUP_BACKEND`: pinned unless mmap is named.
    fn backup_backend(&mut self) -> String {
        match var("TMS_INIT_CPU_BACKUP_BACKEND").as_deref() {
            None | Some("") | Some("pinned") => "pinned".to_string(),
            Some("mmap") => "mmap".to_string(),
            Some(other) => {
                self.warnings
                    .push(format!("TMS_INIT_CPU_BACKUP_BACKEND={other:?} is not pinned or mmap; using pinned"));
                "pinned".to_string()
            }
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
    fn booleans_take_the_usual_spellings_in_any_case() {
        for t in ["1", "true", "TRUE", "yes", "YES", "on", "On", "ON", "Yes"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["0", "false", "FALSE", "no", "NO", "off", "Off"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        for bad in ["maybe", "Y", "2", "enabled"] {
            assert_eq!(parse_bool(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_misspelt_variable_is_named_with_the_one_meant() {
        let w = unknown_variables(["TMS_INIT_ENABLE_CPU_BAKUP", "TMS_INIT_ENABLE", "TMS_SIM_DEVICES", "PATH"]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("TMS_INIT_ENABLE_CPU_BAKUP") && w[0].contains("did you mean TMS_INIT_ENABLE_CPU_BACKUP?")
        );
        assert!(unknown_variables(["TMS_TORCH_VENV", "TMS_TEST_HOOK", "TMS_NAME", "TMS_LIBRARY"]).is_empty());
        // Set by users of torch_memory_saver's Ascend build; read by our Python package.
        assert!(unknown_variables(["TMS_HOOK_MODE"]).is_empty());
        assert!(unknown_variables(["TMS_BACKUP_STREAM"])[0].ends_with("did you mean TMS_BACKUP_STREAMS?"));
    }

    #[test]
    fn log_filters_are_levels_or_directives() {
        for ok in ["warn", "INFO", "off", "tms_hook=debug", "warn,tms_hook=trace"] {
            assert!(valid_log_filter(ok), "{ok}");
        }
        for bad in ["verbose", "loud", "warn,chatty"] {
            assert!(!valid_log_filter(bad), "{bad}");
        }
    }
}
