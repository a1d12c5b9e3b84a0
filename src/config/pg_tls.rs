//! `sslmode` and `sslrootcert` of a PostgreSQL URL, taken out of it: tokio-postgres
//! reads `sslmode` only as `disable`, `prefer` or `require`, and refuses `sslrootcert`.
//! [`crate::db::tls`] builds the connector that honours them.

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

/// What a database URL asks of TLS, taken out of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgTls {
    pub mode: SslMode,
    pub root_cert: Option<PathBuf>,
}

/// The URL without lapse's TLS parameters (what tokio-postgres is given), and those
/// parameters. Both URL (`postgres://...?sslmode=verify-full`) and key=value
/// (`host=... sslmode=verify-full`) forms; the error names the problem.
pub fn split(url: &str) -> Result<(String, PgTls), String> {
    let mut mode = None;
    let mut root_cert = None;
    let mut take = |key: &str, value: &str| -> Result<bool, String> {
        match key {
            "sslmode" => {
                mode = Some(match value {
                    "disable" => SslMode::Disable,
                    "allow" | "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    other => {
                        return Err(format!(
                            "sslmode={other} is not one of disable, prefer, require, verify-ca, verify-full"
                        ));
                    }
                });
                Ok(true)
            }
            "sslrootcert" => {
                root_cert = Some(PathBuf::from(value));
                Ok(true)
            }
            _ => Ok(false),
        }
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let mut parsed = url::Url::parse(url).map_err(|e| format!("not a valid URL ({e})"))?;
        let mut kept = Vec::new();
        for (key, value) in parsed.query_pairs() {
            if !take(&key, &value)? {
                kept.push((key.into_owned(), value.into_owned()));
            }
        }
        if kept.is_empty() {
            parsed.set_query(None);
        } else {
            parsed.query_pairs_mut().clear().extend_pairs(kept);
        }
        String::from(parsed)
    } else {
        let mut kept = Vec::new();
        for token in url.split_whitespace() {
            let taken = match token.split_once('=') {
                Some((key, value)) => take(key.trim(), value.trim_matches('\''))?,
                None => false,
            };
            if !taken {
                kept.push(token);
            }
        }
        kept.join(" ")
    };
    let mode = mode.unwrap_or(SslMode::Disable);
    let driver_mode = match mode {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        _ => "require",
    };
    let rest = if rest.starts_with("postgres://") || rest.starts_with("postgresql://") {
        let mut parsed = url::Url::parse(&rest).map_err(|e| e.to_string())?;
        parsed.query_pairs_mut().append_pair("sslmode", driver_mode);
        String::from(parsed)
    } else {
        format!("{rest} sslmode={driver_mode}")
    };
    Ok((rest, PgTls { mode, root_cert }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lapses_tls_parameters_are_taken_out_of_both_url_forms() {
        let (rest, tls) = split(
            "postgres://u:p@db:5432/app?sslmode=verify-full&sslrootcert=/ca.pem&application_name=x",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgres://u:p@db:5432/app?application_name=x&sslmode=require"
        );
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.root_cert, Some(PathBuf::from("/ca.pem")));
        let (rest, tls) = split("postgres://u@db/app").unwrap();
        assert_eq!(rest, "postgres://u@db/app?sslmode=disable");
        assert_eq!(tls.mode, SslMode::Disable);
        let (rest, tls) = split("host=db user=u sslmode=verify-ca sslrootcert='/ca.pem'").unwrap();
        assert_eq!(rest, "host=db user=u sslmode=require");
        assert_eq!(tls.mode, SslMode::VerifyCa);
        assert_eq!(tls.root_cert, Some(PathBuf::from("/ca.pem")));
        assert!(
            split("postgres://db/app?sslmode=sometimes")
                .unwrap_err()
                .contains("sslmode=sometimes")
        );
    }
}
