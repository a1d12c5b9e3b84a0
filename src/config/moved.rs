//! Keys that moved between sections, and how an old key keeps working.

use std::time::Duration;

use figment::Figment;
use figment::providers::Serialized;

/// Keys that moved to another section: `(old, new)`. An old key still works when the
/// new one is not set, with a deprecation warning; when both are set the new one wins.
pub const MOVED_KEYS: [(&str, &str); 1] = [("worker.tier_tolerance", "relay.tier_tolerance")];

/// Applies [`MOVED_KEYS`] to what the user configured (file and environment, without
/// the defaults); returns the warnings to show.
pub fn moved_keys(user: Figment) -> (Figment, Vec<String>) {
    let mut warnings = Vec::new();
    let mut user = user;
    for (old, new) in MOVED_KEYS {
        let Ok(value) = user.find_value(old) else {
            continue;
        };
        // A value that is not a duration stays where the user wrote it, so that the
        // error names the key in the file or the environment.
        let duration = value.deserialize::<humantime_serde::Serde<Duration>>();
        if duration.is_err() {
            continue;
        }
        if user.find_value(new).is_ok() {
            warnings.push(format!(
                "configuration: `{old}` is deprecated and ignored because `{new}` is set; remove it"
            ));
        } else {
            warnings.push(format!(
                "configuration: `{old}` is deprecated; use `{new}` (read this time)"
            ));
            user = user.merge(Serialized::global(new, value));
        }
    }
    (user, warnings)
}
