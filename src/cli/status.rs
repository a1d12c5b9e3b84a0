//! `lapse status [--check | --watch]`.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use clap::Args;

use super::{ExitStatus, print_json};
use crate::amqp::broker::{self, BrokerError, Endpoint};
use crate::amqp::topology::{Topology, VerifyReport};
use crate::config::{Config, Shard};
use crate::db::DbError;
use crate::redact::redact;
use crate::status::check::{Problem, Thresholds, problems};
use crate::status::watch::Drain;
use crate::status::{Status, StatusError};

#[derive(Debug, Args)]
#[command(after_help = super::help::after(
    &[
        "lapse status",
        "lapse status --check",
        "lapse status --check --json --max-overdue 5m",
        "lapse status --watch --interval 5s",
    ],
    &[
        (0, "shown; with --check: no problem found; with --watch: stopped by Ctrl-C"),
        (1, "--check found a problem (one line each on stdout), or a query failed"),
        super::help::USAGE_DB,
        (3, "the broker or the database could not be reached; the line says which and why"),
    ],
))]
pub struct StatusArgs {
    /// Print JSON: the status; with --check `{ok, problems}`; with --watch one object
    /// per refresh, one per line.
    #[arg(long)]
    json: bool,
    /// Print one line per problem (a due queue without consumer, parked messages,
    /// overdue orders, an old outbox row, topology drift, missing stock releases) and
    /// exit 1 if there is any, 0 otherwise.
    #[arg(long, conflicts_with = "watch")]
    check: bool,
    /// Redraw the view every --interval until Ctrl-C, with the backlog's drain rate and
    /// an estimate of when it is empty.
    #[arg(long)]
    watch: bool,
    /// Time between two refreshes of --watch (e.g. 2s, 1m).
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = positive_duration, requires = "watch")]
    interval: Duration,
    /// With --check: an UNPAID order overdue for longer than this is a problem.
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = humantime::parse_duration, requires = "check")]
    max_overdue: Duration,
    /// With --check: an outbox row older than this is a problem.
    #[arg(long, value_name = "DURATION", default_value = "1m", value_parser = humantime::parse_duration, requires = "check")]
    max_outbox_age: Duration,
    /// With --check: more parked messages than this is a problem.
    #[arg(long, value_name = "COUNT", default_value_t = 0, requires = "check")]
    max_parked: u32,
}

fn positive_duration(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if d.is_zero() => Err("must be more than 0 (e.g. 2s)".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

/// Why a status could not be taken.
enum Failure {
    /// The broker and/or the database could not be reached (exit 3).
    Unreachable(Vec<Problem>),
    Other(anyhow::Error),
}

/// The broker connection (kept across refreshes) and a database pool per shard.
struct Sources<'a> {
    config: &'a Config,
    topology: Topology,
    endpoint: Endpoint,
    pools: Vec<(Shard, crate::db::Pool)>,
    conn: Option<lapin::Connection>,
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        next = cause.source();
    }
    text
}

impl Sources<'_> {
    fn broker_down(&self, e: &BrokerError) -> Problem {
        Problem::new(
            "unreachable",
            format!(
                "cannot reach the broker at {}: {}",
                broker::shown_address(&self.config.broker.url),
                chain(e)
            ),
        )
    }

    fn database_down(&self, shard: &Shard, e: &(dyn std::error::Error + 'static)) -> Problem {
        let why = redact(&chain(e)).into_owned();
        let hint = if why.contains("does not exist") {
            "; `lapse migrate` creates it, or check database.url"
        } else {
            ""
        };
        Problem::new(
            "unreachable",
            format!(
                "cannot reach the database {}: {why}{hint}",
                shown_database(self.config, shard)
            ),
        )
    }

    /// The status, and with `drift` the AMQP-only topology check.
    async fn snapshot(&mut self, drift: bool) -> Result<(Status, Option<VerifyReport>), Failure> {
        let mut down = Vec::new();
        if !self.conn.as_ref().is_some_and(|c| c.status().connected()) {
            match self.endpoint.connect("lapse status").await {
                Ok(conn) => self.conn = Some(conn),
                // Refused credentials are a configuration error (exit 2), not an outage.
                Err(e) if super::failure::is_usage(&e) => return Err(Failure::Other(e.into())),
                Err(e) => down.push(self.broker_down(&e)),
            }
        }
        let mut clients = Vec::new();
        for (shard, pool) in &self.pools {
            match pool.get().await {
                Ok(client) => clients.push((shard.index, client)),
                Err(e) if super::failure::is_usage(&e) => return Err(Failure::Other(e.into())),
                Err(e) => down.push(self.database_down(shard, &e)),
            }
        }
        let Some(conn) = self.conn.take().filter(|_| down.is_empty()) else {
            return Err(Failure::Unreachable(down));
        };
        let outcome = self.measure(&conn, &mut clients, drift).await;
        // A connection the broker dropped, or one that left a question unanswered
        // (it may stay open and silent), is opened again on the next refresh.
        if outcome.is_ok() && conn.status().connected() {
            self.conn = Some(conn);
        }
        outcome
    }

    async fn measure(
        &self,
        conn: &lapin::Connection,
        clients: &mut [(u16, deadpool_postgres::Client)],
        drift: bool,
    ) -> Result<(Status, Option<VerifyReport>), Failure> {
        let grace = self.config.sweeper.release_grace;
        let reply_timeout = self.config.broker.confirm_timeout;
        let queues = match crate::status::queue_depths(conn, &self.topology, reply_timeout).await {
            Ok(queues) => queues,
            Err(e) => return Err(self.failed(e, None)),
        };
        let mut shards = Vec::new();
        let limits = crate::db::Limits::of(&self.config.database);
        for (index, client) in clients.iter_mut() {
            // Read in a transaction of its own, under the pool's limits.
            let figures = match crate::db::begin(client, limits).await {
                Ok(tx) => {
                    crate::status::order_figures(&tx, &self.topology.prefix, *index, grace).await
                }
                Err(e) => Err(e.into()),
            };
            match figures {
                Ok(figures) => shards.push(figures),
                Err(e) => return Err(self.failed(e, Some(*index))),
            }
        }
        let status = Status::new(queues, shards, grace, self.config.database.sharded());
        let report = if drift {
            let vhost = broker::vhost(&self.config.broker.url);
            match crate::amqp::topology::verify(conn, None, &vhost, &self.topology).await {
                Ok(report) => Some(report),
                Err(e) => return Err(Failure::Unreachable(vec![self.broker_down(&e)])),
            }
        } else {
            None
        };
        Ok((status, report))
    }

    /// What a failed collection means: a source gone (exit 3) or anything else.
    fn failed(&self, e: StatusError, shard: Option<u16>) -> Failure {
        let shard = shard.and_then(|i| self.pools.iter().find(|(s, _)| s.index == i));
        match (e, shard) {
            (StatusError::Broker(e), _) => Failure::Unreachable(vec![self.broker_down(&e)]),
            (StatusError::Db(e), Some((shard, _))) if lost_database(&e) => {
                Failure::Unreachable(vec![self.database_down(shard, &e)])
            }
            (StatusError::Db(e), _) => Failure::Other(anyhow::anyhow!(
                "{}; has `lapse migrate` run on this database?",
                e.detail()
            )),
        }
    }

    /// The shards whose relay would not hear the outbox's notifications: a probe sent
    /// through the pool does not arrive on a LISTEN connection to `relay.listen_url`
    /// (or the database's URL). A shard that cannot be asked is left out (the
    /// status itself reports what is unreachable).
    /// All shards at once: a status waits at most one probe's time for them.
    async fn deaf_shards(&self) -> Vec<u16> {
        let probes = self.pools.iter().map(|(shard, pool)| async move {
            let url = crate::config::listen_url(self.config.relay.listen_url.as_ref(), shard);
            let heard = crate::components::relay::notifications::arrive(&url, pool).await;
            matches!(heard, Ok(false)).then_some(shard.index)
        });
        futures_util::future::join_all(probes)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    fn deaf_problem(&self, shard: u16) -> Problem {
        let which = match self.config.database.sharded() {
            true => format!("shard {shard}: "),
            false => String::new(),
        };
        Problem::new(
            "relay_notifications",
            format!(
                "{which}{}",
                crate::components::relay::notifications::LOST_ADVICE
            ),
        )
    }

    async fn close(&mut self) {
        if let Some(conn) = self.conn.take() {
            broker::close_quietly(&conn, "done").await;
        }
    }
}

/// A database error that means the connection, not the query, failed.
fn lost_database(e: &DbError) -> bool {
    match e {
        DbError::Pool(_) => true,
        DbError::Postgres(pg) => match pg.code() {
            None => {
                pg.is_closed()
                    || std::error::Error::source(pg).is_some_and(|s| s.is::<std::io::Error>())
            }
            Some(code) => ["08", "57P"].iter().any(|c| code.code().starts_with(c)),
        },
        _ => false,
    }
}

/// `host:port/dbname` of a shard's URL, without credentials (and the shard, with
/// shards).
fn shown_database(config: &Config, shard: &Shard) -> String {
    let Ok(pg) = crate::db::pg_config(&shard.url) else {
        return "(database.url)".into();
    };
    let host = match pg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    let port = pg.get_ports().first().copied().unwrap_or(5432);
    let shown = format!(
        "`{}` at {host}:{port}",
        pg.get_dbname().unwrap_or("(default)")
    );
    match config.database.sharded() {
        true => format!("of shard {} ({shown})", shard.index),
        false => shown,
    }
}

pub async fn run(config: &Config, args: StatusArgs) -> anyhow::Result<ExitStatus> {
    let mut sources = Sources {
        config,
        topology: Topology::new(&config.names(), &config.tier_file()?),
        endpoint: crate::amqp::endpoint(&config.broker)?,
        pools: config
            .database
            .shard_list()
            .into_iter()
            .map(|shard| {
                let pool = crate::db::pool(&config.database.for_shard(&shard), 1)?;
                Ok((shard, pool))
            })
            .collect::<Result<_, crate::db::DbError>>()?,
        conn: None,
    };
    let result = if args.watch {
        watch(&mut sources, &args).await
    } else {
        once(&mut sources, &args).await
    };
    sources.close().await;
    result
}

async fn once(sources: &mut Sources<'_>, args: &StatusArgs) -> anyhow::Result<ExitStatus> {
    let (status, drift) = match sources.snapshot(args.check).await {
        Ok(found) => found,
        Err(Failure::Other(e)) => return Err(e),
        Err(Failure::Unreachable(down)) => {
            if args.check && args.json {
                print_json(&serde_json::json!({ "ok": false, "problems": down }))?;
            } else if args.check {
                for p in &down {
                    println!("{}", p.line());
                }
            }
            if !args.check {
                for p in &down {
                    eprintln!("error: {}", p.message);
                }
            }
            return Ok(ExitStatus::Unreachable);
        }
    };
    let deaf = sources.deaf_shards().await;
    if !args.check {
        if args.json {
            let mut shown = serde_json::to_value(&status)?;
            if let Some(fields) = shown.as_object_mut() {
                fields.insert("relay_notifications_lost".into(), serde_json::json!(deaf));
            }
            print_json(&shown)?;
        } else {
            print!("{}", status.render());
            for shard in &deaf {
                println!("warning: {}", sources.deaf_problem(*shard).message);
            }
        }
        return Ok(ExitStatus::Ok);
    }
    let limits = Thresholds {
        overdue: args.max_overdue,
        outbox: args.max_outbox_age,
        parked: args.max_parked,
    };
    let mut found = problems(&status, drift.as_ref(), &limits);
    found.extend(deaf.iter().map(|shard| sources.deaf_problem(*shard)));
    if args.json {
        print_json(&serde_json::json!({ "ok": found.is_empty(), "problems": found }))?;
    } else {
        for p in &found {
            println!("{}", p.line());
        }
    }
    Ok(if found.is_empty() {
        ExitStatus::Ok
    } else {
        ExitStatus::Failed
    })
}

/// Refreshes until SIGINT/SIGTERM; a refresh that cannot reach a source says so and
/// the next one tries again.
async fn watch(sources: &mut Sources<'_>, args: &StatusArgs) -> anyhow::Result<ExitStatus> {
    let token = crate::runtime::shutdown::on_signal();
    let terminal = std::io::stdout().is_terminal();
    let mut drain = Drain::default();
    let mut ticker = tokio::time::interval(args.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let every = humantime::format_duration(args.interval);
    loop {
        tokio::select! {
            _ = token.cancelled() => break,
            _ = ticker.tick() => {}
        }
        let snapshot = tokio::select! {
            _ = token.cancelled() => break,
            s = sources.snapshot(false) => s,
        };
        let now = chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC");
        let mut out = std::io::stdout().lock();
        if args.json {
            let line = match snapshot {
                Ok((status, _)) => {
                    let rate = drain.sample(Instant::now(), status.backlog());
                    serde_json::json!({ "at": now.to_string(), "status": status, "drain": rate })
                }
                Err(Failure::Unreachable(down)) => {
                    serde_json::json!({ "at": now.to_string(), "problems": down })
                }
                Err(Failure::Other(e)) => {
                    serde_json::json!({ "at": now.to_string(), "error": redact(&format!("{e:#}")) })
                }
            };
            writeln!(out, "{}", serde_json::to_string(&line)?)?;
        } else {
            let body = match snapshot {
                Ok((status, _)) => {
                    let rate = drain.sample(Instant::now(), status.backlog());
                    format!("{}{}\n", status.render(), rate.line())
                }
                Err(Failure::Unreachable(down)) => down.iter().map(|p| p.line() + "\n").collect(),
                Err(Failure::Other(e)) => format!("error: {}\n", redact(&format!("{e:#}"))),
            };
            if terminal {
                write!(out, "\x1b[2J\x1b[H")?;
            }
            writeln!(
                out,
                "lapse status, prefix {} — {now} (every {every}; Ctrl-C stops)",
                sources.config.broker.prefix
            )?;
            write!(out, "{body}")?;
            if !terminal {
                writeln!(out)?;
            }
        }
        out.flush()?;
    }
    Ok(ExitStatus::Ok)
}
