//! Logging: `tracing` to stderr, filtered by `TMS_LOG` (e.g. `info`, `debug`, `off`), warnings
//! only by default. Set up on first use by the hook, never in a constructor. Each line carries the
//! UTC time, the level, the pid and `TMS_NAME`, so the lines of eight scheduler processes sharing
//! one log can be told apart: `2026-11-25T00:31:02.123Z WARN [pid 4242 rollout-3] tms: ...`.

use std::fmt;
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

use std::sync::Once;

pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // A word tracing would read as a target name (`verbose`) would silence every warning,
        // the one about that word included: such a value is refused (config.rs warns).
        let filter = std::env::var("TMS_LOG")
            .ok()
            .filter(|v| crate::config::valid_log_filter(v))
            .unwrap_or_else(|| "warn".to_string());
        let filter = tracing_subscriber::EnvFilter::try_new(&filter)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .event_format(Line { who: who() })
            .try_init();
        for w in &crate::config::config().warnings {
            tracing::warn!("tms: {w}");
        }
        if let Some((name, value)) = crate::config::expandable_segments() {
            tracing::warn!(
                "tms: {name}={value} enables expandable segments, whose memory LD_PRELOAD cannot see: \
                 pause will not free it. Set expandable_segments:False in colocated jobs."
            );
        }
    });
}

/// `pid N` or `pid N NAME`, fixed at set-up (a process's name is set before it starts).
fn who() -> String {
    let pid = std::process::id();
    match std::env::var("TMS_NAME").ok().filter(|n| !n.trim().is_empty()) {
        // Control characters in a name must not forge log lines.
        Some(name) => format!("pid {pid} {}", name.chars().filter(|c| !c.is_control()).collect::<String>()),
        None => format!("pid {pid}"),
    }
}

struct Line {
    who: String,
}

impl<S, N> FormatEvent<S, N> for Line
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        write!(writer, "{} {} [{}] ", utc_now(), event.metadata().level(), self.who)?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SS.mmmZ`, without a date crate.
fn utc_now() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    utc_timestamp(now.as_secs(), now.subsec_millis())
}

fn utc_timestamp(secs: u64, millis: u32) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's days-from-civil, inverted).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_utc_civil_dates() {
        assert_eq!(utc_timestamp(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc_timestamp(951_782_400, 7), "2000-02-29T00:00:00.007Z");
        assert_eq!(utc_timestamp(1_795_566_662, 123), "2026-11-25T00:31:02.123Z");
    }
}
