//! `lapse worker` as a library: starts the enabled components — due-queue consumer,
//! relay, stock releaser, sweeper — each with its own connection pool, and
//! supervises them. Shutdown: cancel the token; components stop taking work and
//! finish what is in flight; whatever has not finished within the drain limit is
//! abandoned (unacknowledged deliveries return to their queue).

use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::broker::Endpoint;
use crate::config::Config;
use crate::db::{self, DbError};
use crate::health::Health;
use crate::rate::RateLimiter;
use crate::relay::Relay;
use crate::releaser::Releaser;
use crate::stats::Stats;
use crate::sweeper::Sweeper;
use crate::worker::Consumer;

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("invalid configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("invalid configuration: broker.tls: {0}")]
    Tls(#[from] crate::tls::TlsError),
}

pub struct Service {
    tasks: JoinSet<&'static str>,
    health: Health,
    token: CancellationToken,
    drain: Duration,
}

impl Service {
    /// Starts every component the configuration enables.
    pub async fn start(
        config: &Config,
        stats: Stats,
        token: CancellationToken,
    ) -> Result<Self, ServiceError> {
        if config.worker.migrate_on_start {
            db::migrate(&config.database.url).await?;
        }
        let tiers = config.tier_file()?.tiers;
        let broker = Endpoint::from_config(&config.broker)?;
        let w = &config.worker;
        let pool = || db::pool(&config.database.url, config.database.pool_size);
        let mut tasks = JoinSet::new();
        let health = Health::default();
        let limiter = RateLimiter::new(w.closes_per_second);
        if w.consumer {
            let consumer = Consumer::new(
                config,
                pool()?,
                tiers.clone(),
                stats.clone(),
                limiter.clone(),
            );
            let (url, h, t) = (broker.clone(), health.clone(), token.child_token());
            tasks.spawn(async move {
                consumer.run(url, h, t).await;
                "consumer"
            });
        }
        if w.relay {
            let relay = Relay::new(config, pool()?, tiers.clone(), stats.clone());
            let (url, db_url, poll, t) = (
                broker.clone(),
                config.database.url.clone(),
                config.relay.poll_interval,
                token.child_token(),
            );
            let h = health.clone();
            tasks.spawn(async move {
                relay.run(url, db_url, poll, h, t).await;
                "relay"
            });
        }
        if w.releaser {
            let releaser = Releaser {
                pool: pool()?,
                names: config.names(),
                stats: stats.clone(),
                prefetch: w.prefetch,
                batch_size: w.batch_size.min(usize::from(w.prefetch)),
                batch_window: w.batch_window,
            };
            let (url, h, t) = (broker.clone(), health.clone(), token.child_token());
            tasks.spawn(async move {
                releaser.run(url, h, t).await;
                "releaser"
            });
        }
        if w.sweeper {
            let sweeper = Sweeper {
                pool: pool()?,
                stats: stats.clone(),
                config: config.sweeper.clone(),
                limiter,
            };
            let (h, t) = (health.clone(), token.child_token());
            tasks.spawn(async move {
                sweeper.run(h, t).await;
                "sweeper"
            });
        }
        Ok(Self {
            tasks,
            health,
            token,
            drain: w.drain_timeout,
        })
    }

    /// The components' health, for `GET /health`.
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// Waits until the token is cancelled (or a component stops on its own, which
    /// cancels the rest), then drains within the limit. Returns the components that
    /// had to be abandoned.
    pub async fn wait(mut self) -> Vec<String> {
        tokio::select! {
            // A component that stops because of the shutdown is not a failure.
            biased;
            _ = self.token.cancelled() => {}
            Some(done) = self.tasks.join_next() => {
                if !self.token.is_cancelled() {
                    tracing::error!(component = ?done, "a component stopped unexpectedly; stopping the others");
                    self.token.cancel();
                }
            }
        }
        let deadline = tokio::time::Instant::now() + self.drain;
        while !self.tasks.is_empty() {
            match tokio::time::timeout_at(deadline, self.tasks.join_next()).await {
                Ok(Some(Ok(name))) => tracing::info!(component = name, "stopped"),
                Ok(Some(Err(e))) => tracing::error!(error = %e, "a component panicked"),
                Ok(None) => break,
                Err(_) => {
                    let left = self.tasks.len();
                    tracing::warn!(
                        left,
                        "drain limit reached; abandoning in-flight work (unacknowledged deliveries return to their queues)"
                    );
                    self.tasks.abort_all();
                    return vec![format!("{left} component(s)")];
                }
            }
        }
        Vec::new()
    }
}
