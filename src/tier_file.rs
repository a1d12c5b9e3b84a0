//! The tier file (`topology/*.toml`): which delay tiers exist and the queue policy
//! knobs that go with them. Parsed and validated whole before anything talks to the
//! broker; every error names the key it is about.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::tier::{Tier, TierSet};

/// A tier file as written by an operator.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTierFile {
    tiers: Vec<String>,
    #[serde(default = "default_delivery_limit")]
    delivery_limit: u32,
    #[serde(default)]
    max_length: Option<u64>,
}

fn default_delivery_limit() -> u32 {
    10
}

/// A validated tier file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierFile {
    pub tiers: TierSet,
    /// `x-delivery-limit` of the due and stock-release queues.
    pub delivery_limit: u32,
    /// `x-max-length` of each wait queue; publishes beyond it are rejected.
    pub max_length: Option<u64>,
}

/// A problem with a tier file, naming the file and the key.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {key}: {problem}")]
pub struct TierFileError {
    pub file: PathBuf,
    pub key: String,
    pub problem: String,
}

impl TierFile {
    pub fn load(path: &Path) -> Result<Self, TierFileError> {
        let text = std::fs::read_to_string(path).map_err(|e| TierFileError {
            file: path.to_path_buf(),
            key: "topology.file".into(),
            problem: format!("cannot read the tier file: {e}"),
        })?;
        Self::parse(&text).map_err(|(key, problem)| TierFileError {
            file: path.to_path_buf(),
            key,
            problem,
        })
    }

    /// Parses tier-file text; the error is `(key, problem)`.
    pub fn parse(text: &str) -> Result<Self, (String, String)> {
        let raw: RawTierFile = toml::from_str(text).map_err(|e| {
            let message = e.message().to_string();
            let key = unknown_field(&message).unwrap_or_else(|| "tiers".to_string());
            (key, message)
        })?;
        if raw.tiers.is_empty() {
            return Err(("tiers".into(), "the tier list is empty".into()));
        }
        let mut seen: HashMap<Tier, usize> = HashMap::new();
        let mut tiers = Vec::with_capacity(raw.tiers.len());
        for (i, text) in raw.tiers.iter().enumerate() {
            let key = format!("tiers[{i}]");
            let tier = Tier::parse(text).map_err(|e| (key.clone(), e.to_string()))?;
            if let Some(first) = seen.insert(tier, i) {
                return Err((
                    key,
                    format!(
                        "duplicate tier `{text}`: tiers[{first}] is already {}",
                        tier.name()
                    ),
                ));
            }
            tiers.push(tier);
        }
        if raw.delivery_limit == 0 {
            return Err((
                "delivery_limit".into(),
                "must be at least 1 (0 would park every message on its first delivery)".into(),
            ));
        }
        if raw.max_length == Some(0) {
            return Err((
                "max_length".into(),
                "must be at least 1, or left out for no limit".into(),
            ));
        }
        Ok(Self {
            tiers: TierSet::new(tiers),
            delivery_limit: raw.delivery_limit,
            max_length: raw.max_length,
        })
    }
}

/// Extracts the field name from serde's "unknown field `x`, expected ..." message.
fn unknown_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    Some(rest.split('`').next()?.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_sorts() {
        let f =
            TierFile::parse("tiers = [\"30m\", \"1s\", \"1h30m\"]\ndelivery_limit = 3").unwrap();
        let names: Vec<_> = f.tiers.iter().map(|t| t.name()).collect();
        assert_eq!(names, ["1s", "30m", "1h30m"]);
        assert_eq!(f.delivery_limit, 3);
        assert_eq!(f.max_length, None);
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            ("tiers = []", "tiers"),
            ("tiers = [\"1s\", \"0s\"]", "tiers[1]"),
            ("tiers = [\"1s\", \"1000ms\"]", "tiers[1]"),
            ("tiers = [\"60days\"]", "tiers[0]"),
            ("tiers = [\"1s\"]\ncolour = 1", "colour"),
            ("tiers = [\"1s\"]\ndelivery_limit = 0", "delivery_limit"),
        ];
        for (text, key) in cases {
            let (got, problem) = TierFile::parse(text).unwrap_err();
            assert_eq!(got, key, "{text}: {problem}");
        }
    }
}
