//! The closing part of every command's `--help`: examples, then the exit statuses.

/// Success.
pub const OK: (u8, &str) = (0, "success");
/// Bad arguments or configuration, including credentials that are refused.
pub const USAGE: (u8, &str) = (
    2,
    "bad arguments or configuration (the message names the key), including credentials \
     the broker or the database refuses",
);
/// Like [`USAGE`], for commands that need the database's schema.
pub const USAGE_DB: (u8, &str) = (
    2,
    "bad arguments or configuration (the message names the key), including refused \
     credentials and a database or schema that does not exist yet (run `lapse migrate`)",
);
/// The broker or the database did not answer.
pub const UNREACHABLE: (u8, &str) = (
    3,
    "could not reach the broker or the database (retrying later may succeed)",
);

/// `Examples:` with one command per line, then `Exit status:` with one line per code.
pub fn after(examples: &[&str], statuses: &[(u8, &str)]) -> String {
    let mut text = String::from("Examples:\n");
    for example in examples {
        text.push_str("  ");
        text.push_str(example);
        text.push('\n');
    }
    text.push_str("\nExit status:\n");
    for (code, meaning) in statuses {
        text.push_str(&format!("  {code}  {meaning}\n"));
    }
    text
}
