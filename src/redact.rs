//! Credentials never leave the process in text: every error lapse prints, every log
//! line and every panic message passes through [`redact`], which masks the password of
//! any URL (`scheme://user:password@host`) and of any `password=...` connection
//! parameter, whatever key or library produced the text.
//!
//! This is the last line of defence; the first is [`Secret`], whose `Debug` never
//! shows its value. A leaf module: it imports nothing from lapse, so that every layer
//! (configuration, broker, management client) can hold a secret.

use std::borrow::Cow;
use std::fmt;
use std::io::{self, Write};

use serde::{Deserialize, Serialize};

/// A string that is never printed: URLs with credentials.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// What a masked password reads as.
pub const MASK: &str = "***";

/// `text` with the password of every URL and every `password=` parameter masked.
pub fn redact(text: &str) -> Cow<'_, str> {
    let urls = mask_url_passwords(text);
    match mask_password_params(&urls) {
        Cow::Borrowed(_) => urls,
        Cow::Owned(s) => Cow::Owned(s),
    }
}

/// Masks `:password@` in the authority of every `scheme://user:password@host`.
fn mask_url_passwords(text: &str) -> Cow<'_, str> {
    let mut out = String::new();
    let mut copied = 0;
    let mut search = 0;
    while let Some(found) = text[search..].find("://") {
        let authority_start = search + found + 3;
        // The credentials end at the LAST '@' before the next quote or white space: a
        // password may itself hold '@', '/', '?' or '#' when it was not percent-encoded.
        // (An '@' further on, in a path or query, masks more than the password: the safe
        // side.)
        let rest = &text[authority_start..];
        let end = rest
            .find(|c: char| matches!(c, '"' | '\'' | '`') || c.is_whitespace())
            .unwrap_or(rest.len());
        let authority = &rest[..end];
        if let Some(at) = authority.rfind('@')
            && let Some(colon) = authority[..at].find(':')
        {
            let pass_start = authority_start + colon + 1;
            let pass_end = authority_start + at;
            out.push_str(&text[copied..pass_start]);
            out.push_str(MASK);
            copied = pass_end;
        }
        search = authority_start + end;
    }
    if copied == 0 {
        return Cow::Borrowed(text);
    }
    out.push_str(&text[copied..]);
    Cow::Owned(out)
}

/// Masks the value of `password=value` (libpq key=value strings, URL query parameters).
fn mask_password_params(text: &str) -> Cow<'_, str> {
    let lower = text.to_ascii_lowercase();
    let mut out = String::new();
    let mut copied = 0;
    let mut search = 0;
    while let Some(found) = lower[search..].find("password") {
        let key_end = search + found + "password".len();
        let after = &text[key_end..];
        let spaces = after.len() - after.trim_start().len();
        let mut value_start = key_end + spaces;
        if !text[value_start..].starts_with('=') {
            search = key_end;
            continue;
        }
        value_start += 1;
        let value = &text[value_start..];
        value_start += value.len() - value.trim_start().len();
        let value = &text[value_start..];
        let len = match value.chars().next() {
            Some(q @ ('\'' | '"')) => value[1..].find(q).map_or(value.len(), |i| i + 2),
            _ => value
                .find(|c: char| c.is_whitespace() || matches!(c, '&' | '"' | '\'' | ','))
                .unwrap_or(value.len()),
        };
        if len > 0 {
            out.push_str(&text[copied..value_start]);
            out.push_str(MASK);
            copied = value_start + len;
        }
        search = value_start + len.max(1).min(text.len() - value_start);
        if search >= text.len() {
            break;
        }
    }
    if copied == 0 {
        return Cow::Borrowed(text);
    }
    out.push_str(&text[copied..]);
    Cow::Owned(out)
}

/// Standard error with every write redacted: the writer of the log subscriber. The
/// formatter writes one whole event per call, so a URL is never split across writes.
pub struct RedactingStderr;

impl Write for RedactingStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        io::stderr().write_all(redact(&text).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

/// Replaces the panic message printer with one that redacts (a panic message may
/// quote a value that holds a URL).
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let payload = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".to_string());
        let location = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        eprintln!("thread '{name}' panicked{location}: {}", redact(&payload));
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_url_passwords_wherever_they_stand() {
        let cases = [
            (
                "amqp://guest:s3cret@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            (
                "found string \"postgres://u:s3cret@x/y\", expected u16",
                "found string \"postgres://u:***@x/y\", expected u16",
            ),
            ("amqps://u:p@ss:w@rd@h", "amqps://u:***@h"),
            (
                "found string \"postgres://u:ab#c/d?e@h/db\", expected u16",
                "found string \"postgres://u:***@h/db\", expected u16",
            ),
            (
                "a http://a:1@h and https://b:2@k?x",
                "a http://a:***@h and https://b:***@k?x",
            ),
            (
                "no credentials: amqp://h:5672/",
                "no credentials: amqp://h:5672/",
            ),
            ("user only: amqp://guest@h/", "user only: amqp://guest@h/"),
        ];
        for (input, want) in cases {
            assert_eq!(redact(input), want, "{input}");
        }
    }

    #[test]
    fn masks_password_parameters() {
        let cases = [
            (
                "host=h user=u password=s3cret dbname=d",
                "host=h user=u password=*** dbname=d",
            ),
            ("password = 's3 cret' x", "password = *** x"),
            (
                "postgres://h/d?password=s3cret&x=1",
                "postgres://h/d?password=***&x=1",
            ),
            ("PASSWORD=s3cret", "PASSWORD=***"),
            ("the password was refused", "the password was refused"),
            ("password=", "password="),
        ];
        for (input, want) in cases {
            assert_eq!(redact(input), want, "{input}");
        }
    }

    #[test]
    fn text_without_secrets_is_not_copied() {
        assert!(matches!(redact("plain words"), Cow::Borrowed(_)));
    }
}
