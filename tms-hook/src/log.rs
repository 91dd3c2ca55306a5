//! Logging: `tracing` to stderr, filtered by `TMS_LOG` (e.g. `info`, `debug`, `off`), warnings
//! only by default. Set up on first use by the hook, never in a constructor.

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
            .with_target(false)
            .without_time()
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
