//! `sslmode` and `sslrootcert` of a PostgreSQL URL, taken out of it: tokio-postgres
//! reads `sslmode` only as `disable`, `prefer` or `require`, and refuses `sslrootcert`.
//! [`crate::db::tls`] builds the connector that honours them.
//!
//! The rest of the URL is left byte for byte as it was (tokio-postgres parses it):
//! in the URL form only the query's `sslmode=` and `sslrootcert=` segments are taken
//! out; in the key=value form only those pairs, read with libpq's grammar (spaces
//! around `=`, single quotes, backslash escapes).

use std::path::PathBuf;

/// How a connection to PostgreSQL uses TLS (libpq's `sslmode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    /// What tokio-postgres is told: whether to ask for TLS at all.
    pub fn driver(self) -> tokio_postgres::config::SslMode {
        match self {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        }
    }
}

/// Which certificates are trusted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Roots {
    /// No `sslrootcert`: none for `prefer` and `require` (nothing is checked), the
    /// system's for `verify-full`.
    Unset,
    /// `sslrootcert=system`: the system's roots (only with `verify-full`, as libpq).
    System,
    /// `sslrootcert=<file>`: only the certificates in that PEM file.
    File(PathBuf),
}

/// What a database URL asks of TLS, taken out of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgTls {
    pub mode: SslMode,
    pub roots: Roots,
}

/// The URL without `sslmode` and `sslrootcert` (what tokio-postgres parses; its TLS
/// mode is then set with [`SslMode::driver`]), and what they asked for. Both URL
/// (`postgres://...?sslmode=verify-full`) and key=value (`host=... sslmode=verify-full`)
/// forms; the error names the problem, never the URL.
pub fn split(url: &str) -> Result<(String, PgTls), String> {
    let (rest, pairs) = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        split_url(url)
    } else {
        split_key_values(url)
    };
    let mut mode = SslMode::Disable;
    let mut roots = Roots::Unset;
    for (key, value) in pairs {
        if key == "sslmode" {
            mode = match value.as_str() {
                "disable" => SslMode::Disable,
                "allow" | "prefer" => SslMode::Prefer,
                "require" => SslMode::Require,
                "verify-ca" => SslMode::VerifyCa,
                "verify-full" => SslMode::VerifyFull,
                other => {
                    return Err(format!(
                        "sslmode={other} is not one of disable, allow, prefer, require, \
                         verify-ca, verify-full"
                    ));
                }
            };
        } else if value == "system" {
            roots = Roots::System;
        } else {
            roots = Roots::File(PathBuf::from(value));
        }
    }
    match (&roots, mode) {
        (Roots::System, m) if m != SslMode::VerifyFull => Err(
            "sslrootcert=system needs sslmode=verify-full (any public CA can sign a \
             certificate: only the host name makes it the database's)"
                .into(),
        ),
        (Roots::Unset, SslMode::VerifyCa) => Err(
            "sslmode=verify-ca needs sslrootcert=<file>: checking the chain against every \
             public CA without the host name proves nothing; name the CA file, or use \
             verify-full"
                .into(),
        ),
        _ => Ok((rest, PgTls { mode, roots })),
    }
}

/// Whether `key` is one of lapse's TLS keys.
fn ours(key: &str) -> bool {
    key == "sslmode" || key == "sslrootcert"
}

/// URL form: the query is what follows the first `?` after the credentials (which end
/// at the first `@`, as tokio-postgres reads them); its other segments stay as written.
fn split_url(url: &str) -> (String, Vec<(String, String)>) {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let host_from = url[after_scheme..]
        .find('@')
        .map_or(after_scheme, |i| after_scheme + i + 1);
    let Some(q) = url[host_from..].find('?').map(|i| host_from + i) else {
        return (url.to_string(), Vec::new());
    };
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let mut kept = Vec::new();
    let mut pairs = Vec::new();
    for segment in url[q + 1..].split('&') {
        let (key, value) = segment.split_once('=').unwrap_or((segment, ""));
        let key = decode(key);
        if ours(&key) {
            pairs.push((key, decode(value)));
        } else if !segment.is_empty() {
            kept.push(segment);
        }
    }
    let mut rest = url[..q].to_string();
    if !kept.is_empty() {
        rest.push('?');
        rest.push_str(&kept.join("&"));
    }
    (rest, pairs)
}

/// key=value form, read with libpq's grammar; the other pairs stay as written. A
/// string it cannot read is left whole for tokio-postgres to refuse.
fn split_key_values(text: &str) -> (String, Vec<(String, String)>) {
    let Some(tokens) = key_values(text) else {
        return (text.to_string(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut pairs = Vec::new();
    for (key, value, span) in tokens {
        if ours(&key) {
            pairs.push((key, value));
        } else {
            kept.push(&text[span]);
        }
    }
    (kept.join(" "), pairs)
}

/// Each `key = value` of `text` with its span; `None` when it does not parse.
fn key_values(text: &str) -> Option<Vec<(String, String, std::ops::Range<usize>)>> {
    let bytes: Vec<(usize, char)> = text.char_indices().collect();
    let mut i = 0;
    let mut out = Vec::new();
    let skip_ws = |i: &mut usize| {
        while *i < bytes.len() && bytes[*i].1.is_whitespace() {
            *i += 1;
        }
    };
    loop {
        skip_ws(&mut i);
        if i >= bytes.len() {
            return Some(out);
        }
        let start = bytes[i].0;
        let mut key = String::new();
        while i < bytes.len() && !bytes[i].1.is_whitespace() && bytes[i].1 != '=' {
            key.push(bytes[i].1);
            i += 1;
        }
        skip_ws(&mut i);
        if key.is_empty() || i >= bytes.len() || bytes[i].1 != '=' {
            return None;
        }
        i += 1;
        skip_ws(&mut i);
        let mut value = String::new();
        if i < bytes.len() && bytes[i].1 == '\'' {
            i += 1;
            loop {
                let (_, c) = *bytes.get(i)?;
                i += 1;
                match c {
                    '\'' => break,
                    '\\' => {
                        value.push(bytes.get(i)?.1);
                        i += 1;
                    }
                    c => value.push(c),
                }
            }
        } else {
            while i < bytes.len() && !bytes[i].1.is_whitespace() {
                if bytes[i].1 == '\\' {
                    i += 1;
                    value.push(bytes.get(i)?.1);
                } else {
                    value.push(bytes[i].1);
                }
                i += 1;
            }
        }
        let end = bytes.get(i).map_or(text.len(), |(at, _)| *at);
        out.push((key, value, start..end));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_form_loses_only_lapses_keys_and_keeps_the_rest_byte_for_byte() {
        let (rest, tls) = split(
            "postgres://u:p%2Bq@db:5432/app?options=-c%20search_path%3Dapp&sslmode=verify-full\
             &sslrootcert=/etc/ca%2B1.pem&application_name=a+b",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgres://u:p%2Bq@db:5432/app?options=-c%20search_path%3Dapp&application_name=a+b"
        );
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.roots, Roots::File(PathBuf::from("/etc/ca+1.pem")));
        // Several hosts, and a password holding characters a URL parser chokes on.
        let (rest, tls) =
            split("postgresql://u:2024#P?w@h1:5432,h2:5433/db?sslmode=require").unwrap();
        assert_eq!(rest, "postgresql://u:2024#P?w@h1:5432,h2:5433/db");
        assert_eq!((tls.mode, tls.roots), (SslMode::Require, Roots::Unset));
        let (rest, tls) = split("postgres://u@db/app").unwrap();
        assert_eq!(rest, "postgres://u@db/app");
        assert_eq!(tls.mode, SslMode::Disable);
    }

    #[test]
    fn the_key_value_form_is_read_with_libpqs_grammar() {
        let (rest, tls) =
            split("host=db  sslmode = verify-ca password='a b\\'c' sslrootcert='/ca 1.pem'")
                .unwrap();
        assert_eq!(rest, "host=db password='a b\\'c'");
        assert_eq!(tls.mode, SslMode::VerifyCa);
        assert_eq!(tls.roots, Roots::File(PathBuf::from("/ca 1.pem")));
        // A pair that only looks like ours inside a quoted value stays in it.
        let (rest, tls) = split("host=db password='x sslmode=disable' sslmode=require").unwrap();
        assert_eq!(rest, "host=db password='x sslmode=disable'");
        assert_eq!(tls.mode, SslMode::Require);
        // Not key=value at all: left to the driver to refuse.
        let (rest, _) = split("host=db nonsense").unwrap();
        assert_eq!(rest, "host=db nonsense");
    }

    #[test]
    fn modes_that_would_trust_any_public_ca_without_the_name_are_refused() {
        assert!(
            split("postgres://db/app?sslmode=sometimes")
                .unwrap_err()
                .contains("sometimes")
        );
        assert!(
            split("postgres://db/app?sslmode=verify-ca")
                .unwrap_err()
                .contains("sslrootcert")
        );
        assert!(
            split("postgres://db/app?sslmode=require&sslrootcert=system")
                .unwrap_err()
                .contains("verify-full")
        );
        let (_, tls) = split("postgres://db/app?sslmode=verify-full&sslrootcert=system").unwrap();
        assert_eq!(tls.roots, Roots::System);
    }
}
