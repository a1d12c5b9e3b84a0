//! The arguments of `lapse parked`: its subcommands and how a replay or purge selects.

use std::collections::BTreeSet;

use clap::{Args, Subcommand};

use crate::parked::{Item, Selection};

/// Exit statuses shared by every `lapse parked` command.
const EXIT_CODES: &[(u8, &str)] = &[
    crate::cli::help::OK,
    (1, "a message was not found or not replayed"),
    (
        2,
        "bad arguments or configuration (also: purge without --yes when stdin is not a \
         terminal)",
    ),
    (
        3,
        "the broker or the database could not be reached, or stopped answering",
    ),
];

#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// List parked messages in the order they reached the parked book, a page at a
    /// time: ID, kind, order, deadline, version, attempts, when parked, cause and
    /// reason. Reads the parked book, never the queue again: listing spends no delivery.
    #[command(after_help = crate::cli::help::after(
        &[
            "lapse parked list",
            "lapse parked list --after 1200 --limit 50",
            "lapse parked list --reason undecodable --json",
        ],
        EXIT_CODES,
    ))]
    List {
        /// Only rows after this sequence number (the SEQ column; the last page's
        /// footer names the next one).
        #[arg(long, value_name = "SEQ", default_value_t = 0)]
        after: i64,
        /// Rows per page (1 to 10,000).
        #[arg(long, value_name = "N", default_value_t = 100,
              value_parser = clap::value_parser!(i64).range(1..=10_000))]
        limit: i64,
        /// Only messages whose reason contains this text or whose cause is it
        /// (case-insensitive).
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// How many messages are parked, by cause, with the oldest and newest of each and
    /// an example reason.
    #[command(after_help = crate::cli::help::after(
        &["lapse parked counts", "lapse parked counts --json"],
        EXIT_CODES,
    ))]
    Counts {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show every copy of one parked message: its fields, headers and body.
    #[command(after_help = crate::cli::help::after(
        &["lapse parked show timeout-42-v1", "lapse parked show release-42 --json"],
        EXIT_CODES,
    ))]
    Show {
        /// The message ID from `lapse parked list` (e.g. timeout-42-v1, release-42, raw-…).
        #[arg(value_name = "ID")]
        id: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Put parked messages back on their path: a timeout to its wait tier or the due
    /// queue (own deadline and version, fresh attempt budget), a release to the stock
    /// releaser. Each leaves the parked book only after the broker confirmed it at its
    /// destination.
    #[command(after_help = crate::cli::help::after(
        &["lapse parked replay timeout-42-v1", "lapse parked replay --reason unavailable --dry-run", "lapse parked replay --all --json"],
        EXIT_CODES,
    ))]
    Replay {
        #[command(flatten)]
        select: Select,
        /// Only say where each message would go; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete parked messages for good. Asks for confirmation unless --yes.
    #[command(after_help = crate::cli::help::after(
        &["lapse parked purge raw-0123456789abcdef", "lapse parked purge --reason unreadable --yes"],
        EXIT_CODES,
    ))]
    Purge {
        #[command(flatten)]
        select: Select,
        /// Do not ask; required when stdin is not a terminal.
        #[arg(long)]
        yes: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Which parked messages a replay or purge acts on.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct Select {
    /// Message IDs from `lapse parked list`; every copy of each is selected.
    #[arg(value_name = "ID")]
    pub(super) ids: Vec<String>,
    /// Every parked message.
    #[arg(long)]
    all: bool,
    /// Messages whose reason contains this text, or whose cause is it (case-insensitive).
    #[arg(long, value_name = "TEXT")]
    reason: Option<String>,
}

impl Select {
    pub(super) fn selection(&self) -> Selection {
        Selection {
            ids: self.ids.clone(),
            all: self.all,
            reason: self.reason.clone(),
        }
    }

    /// IDs asked for by name that no message has.
    pub(super) fn not_found(&self, items: &[Item]) -> Vec<String> {
        let seen: BTreeSet<&str> = items.iter().map(|i| i.row.entry.id.as_str()).collect();
        self.ids
            .iter()
            .filter(|id| !seen.contains(id.as_str()))
            .cloned()
            .collect()
    }
}
