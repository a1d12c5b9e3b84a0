//! The tier file (`topology/*.toml`): which delay tiers exist and the queue policy
//! knobs that go with them. Parsed and validated whole before anything talks to the
//! broker; every error names the key it is about.
//!
//! The default tiers (`topology/default.toml`) are built into the binary, so lapse
//! runs from any directory with no tier file configured; a configured file is read
//! from its path, relative to the working directory.

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

/// The text of `topology/default.toml`, compiled into the binary: the tiers lapse uses
/// when `topology.file` is not set. The file in the repository is the one source.
pub const BUILT_IN_DEFAULT: &str = include_str!("../topology/default.toml");

/// Where a tier file's tiers came from, as `lapse topology plan` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TierSource {
    /// The default tiers built into the binary (`topology.file` not set).
    BuiltIn,
    /// A file, by the path as configured and as resolved against the working directory.
    File { given: PathBuf, resolved: PathBuf },
    /// Text handed over directly (tests, benchmarks that declare their own tiers).
    Inline,
}

impl std::fmt::Display for TierSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TierSource::BuiltIn => f.write_str("built-in default (topology.file not set)"),
            TierSource::File { resolved, .. } => write!(f, "{}", resolved.display()),
            TierSource::Inline => f.write_str("inline"),
        }
    }
}

/// A validated tier file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierFile {
    pub tiers: TierSet,
    /// `x-delivery-limit` of the due and stock-release queues.
    pub delivery_limit: u32,
    /// `x-max-length` of each wait queue; publishes beyond it are rejected.
    pub max_length: Option<u64>,
    /// Where the tiers came from.
    pub source: TierSource,
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
    /// The default tiers built into the binary.
    pub fn built_in() -> Self {
        let mut file = Self::parse(BUILT_IN_DEFAULT)
            .unwrap_or_else(|(key, problem)| unreachable!("built-in tiers: {key}: {problem}"));
        file.source = TierSource::BuiltIn;
        file
    }

    /// Reads and validates the file at `path`; a relative path is resolved against the
    /// working directory, and an error names the path both as given and as resolved.
    pub fn load(path: &Path) -> Result<Self, TierFileError> {
        let resolved = resolve(path);
        let text = std::fs::read_to_string(&resolved).map_err(|e| TierFileError {
            file: path.to_path_buf(),
            key: "topology.file".into(),
            problem: if resolved.as_path() == path {
                format!("cannot read the tier file {}: {e}", path.display())
            } else {
                format!(
                    "cannot read the tier file {} (resolved against the working directory \
                     as {}): {e}; relative paths are resolved against the working \
                     directory, or leave topology.file out to use the built-in default tiers",
                    path.display(),
                    resolved.display()
                )
            },
        })?;
        let mut file = Self::parse(&text).map_err(|(key, problem)| TierFileError {
            file: path.to_path_buf(),
            key,
            problem,
        })?;
        file.source = TierSource::File {
            given: path.to_path_buf(),
            resolved,
        };
        Ok(file)
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
            source: TierSource::Inline,
        })
    }
}

/// `path` made absolute against the working directory (unchanged if that is unknown).
fn resolve(path: &Path) -> PathBuf {
    if path.is_absolute() {
        return path.to_path_buf();
    }
    std::env::current_dir()
        .map(|dir| dir.join(path))
        .unwrap_or_else(|_| path.to_path_buf())
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
    fn the_built_in_default_is_the_repository_default_file() {
        let built_in = TierFile::built_in();
        assert_eq!(built_in.source, TierSource::BuiltIn);
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("topology/default.toml"),
        )
        .unwrap();
        let from_file = TierFile::parse(&text).unwrap();
        assert_eq!(built_in.tiers, from_file.tiers);
        assert_eq!(built_in.delivery_limit, from_file.delivery_limit);
        assert_eq!(built_in.max_length, from_file.max_length);
    }

    #[test]
    fn a_missing_relative_file_names_the_path_as_given_and_as_resolved() {
        let e = TierFile::load(Path::new("no/such/tiers.toml")).unwrap_err();
        assert_eq!(e.key, "topology.file");
        // As given, and as resolved: an absolute path ending in it. (The working
        // directory itself is not read here: other tests of this binary change it.)
        assert!(e.problem.contains("no/such/tiers.toml"), "{}", e.problem);
        assert!(e.problem.contains("/no/such/tiers.toml"), "{}", e.problem);
        assert!(e.problem.contains("working directory"), "{}", e.problem);
    }

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
