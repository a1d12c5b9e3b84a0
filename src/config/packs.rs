//! `[packs]`: how many deadlines one timeout message may carry (docs/pipeline.md,
//! "Packs").

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// The most entries a pack may hold: about 1.6 MB of body, far under RabbitMQ's
/// smallest default message size limit (16 MiB on 4.x).
pub const MAX_PACK_ENTRIES: usize = 10_000;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PacksConfig {
    /// The most deadlines one timeout message carries. 1 turns packs off: every
    /// deadline travels alone, as before packs (set it while workers of a version
    /// without packs still consume the same prefix, docs/pipeline.md "Packs").
    pub max_entries: usize,
    /// The relay packs deadlines whose first hop is the same tier and whose deadlines
    /// lie within this of the pack's earliest. Wider packs carry more deadlines per
    /// message; at their last hops the entries of a wide pack part more often (each
    /// takes its own next route, so none is early).
    #[serde(with = "humantime_serde")]
    pub window: Duration,
}

impl Default for PacksConfig {
    fn default() -> Self {
        Self {
            max_entries: 1000,
            window: Duration::from_millis(250),
        }
    }
}

pub(super) fn validate(p: &PacksConfig) -> Result<(), ConfigError> {
    if p.max_entries == 0 || p.max_entries > MAX_PACK_ENTRIES {
        return Err(ConfigError::new(
            "packs.max_entries",
            format!("must be 1 (no packs) to {MAX_PACK_ENTRIES}"),
        ));
    }
    if p.window > Duration::from_secs(60) {
        return Err(ConfigError::new(
            "packs.window",
            "must be at most 60s (wider packs only part again at their last hops)",
        ));
    }
    Ok(())
}
