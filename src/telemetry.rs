//! Structured logging: `RUST_LOG` filters (default `info`), `LAPSE_LOG_FORMAT=json`
//! switches to JSON lines. Logs go to stderr so command output stays clean on stdout,
//! through [`crate::redact`], so no log line can carry a password.

use tracing_subscriber::EnvFilter;

pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| crate::redact::RedactingStderr);
    let json = std::env::var("LAPSE_LOG_FORMAT").is_ok_and(|v| v == "json");
    // A second init (tests) is harmless: keep the first subscriber.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
