//! `lapse migrate`: applies the schema to the order database, or to every shard.

use super::{ExitStatus, print_json};
use crate::config::Config;
use crate::db;
use crate::redact::redact;

/// `lapse migrate`'s options.
#[derive(Debug, clap::Args)]
pub struct MigrateArgs {
    /// Print {"applied": N} as JSON on stdout (with database.shards:
    /// {"shards": [{"shard": 0, "applied": N}, {"shard": 1, "error": "..."}]}).
    #[arg(long)]
    json: bool,
}

pub async fn run(config: &Config, args: MigrateArgs) -> anyhow::Result<ExitStatus> {
    let settings = db::Settings::from_config(config);
    if !config.database.sharded() {
        let applied = db::migrate_with_settings(&config.database.url, &settings).await?;
        if args.json {
            print_json(&serde_json::json!({ "applied": applied }))?;
        } else {
            println!("{applied} migration(s) applied; the schema is up to date");
        }
        return Ok(ExitStatus::Ok);
    }
    // Every shard is tried, whatever another one answers; one that fails is named and
    // makes the exit status 1 (2 when the list was reordered: a configuration error).
    let results = db::migrate_shards(&config.database, &settings).await;
    let (mut failed, mut moved) = (0, false);
    let mut shown = Vec::new();
    for (shard, result) in &results {
        match result {
            Ok(applied) => {
                if !args.json {
                    println!(
                        "shard {}: {applied} migration(s) applied; the schema is up to date",
                        shard.index
                    );
                }
                shown.push(serde_json::json!({ "shard": shard.index, "applied": applied }));
            }
            Err(e) => {
                failed += 1;
                moved |= e.is_reordered_list();
                let why = redact(&e.detail()).into_owned();
                if !args.json {
                    eprintln!(
                        "error: shard {} (database.shards[{}]): {why}",
                        shard.index, shard.index
                    );
                }
                shown.push(serde_json::json!({ "shard": shard.index, "error": why }));
            }
        }
    }
    if args.json {
        print_json(&serde_json::json!({ "shards": shown }))?;
    } else if failed > 0 {
        eprintln!("error: {failed} of {} shard(s) not migrated", results.len());
    }
    // A reordered list is a configuration error (exit 2), whatever else failed.
    Ok(match (failed, moved) {
        (0, _) => ExitStatus::Ok,
        (_, true) => ExitStatus::Usage,
        (_, false) => ExitStatus::Failed,
    })
}
