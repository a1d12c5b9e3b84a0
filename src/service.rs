//! `lapse worker` as a library: starts the enabled components — due-queue consumer,
//! relay, stock releaser, sweeper — each with its own connection pool, under one
//! [`Supervisor`]: a component that panics or stops on its own is restarted with
//! back-off and shown as down on `/health`, without stopping the others.
//!
//! Shutdown: cancel the token; components stop taking work and finish what is in
//! flight; whatever has not finished within the drain limit is abandoned
//! (unacknowledged deliveries return to their queue). A fatal failure (the broker
//! refuses the credentials) stops the service the same way and is reported, so the
//! process exits non-zero.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::broker::Endpoint;
use crate::config::Config;
use crate::db::{self, DbError};
use crate::health::Health;
use crate::rate::RateLimiter;
use crate::relay::Relay;
use crate::releaser::Releaser;
use crate::stats::Stats;
use crate::supervisor::{ComponentFuture, RestartPolicy, Stop, Supervisor};
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
    supervisor: Supervisor,
    health: Health,
    drain: Duration,
}

/// How the service ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stopped {
    pub stop: Stop,
    /// Components still running at the drain limit, abandoned.
    pub abandoned: Vec<&'static str>,
}

impl Stopped {
    /// True only for a requested shutdown that drained everything: the one ending
    /// that deserves exit status 0.
    pub fn clean(&self) -> bool {
        self.stop == Stop::Requested && self.abandoned.is_empty()
    }
}

impl Service {
    /// Starts every component the configuration enables.
    pub async fn start(
        config: &Config,
        stats: Stats,
        token: CancellationToken,
    ) -> Result<Self, ServiceError> {
        if config.worker.migrate_on_start {
            db::migrate_with_settings(&config.database.url, &db::Settings::from_config(config))
                .await?;
        }
        let tiers = config.tier_file()?.tiers;
        // The worker's connections carry the AMQP heartbeat, so that the broker takes
        // back a frozen worker's deliveries.
        let broker =
            Endpoint::from_config(&config.broker)?.with_url(config.broker.url_with_heartbeat());
        let w = &config.worker;
        let pool = || db::pool(&config.database, config.database.pool_size);
        let health = Health::new(w.stall_limit);
        let mut supervisor = Supervisor::new(health.clone(), token, RestartPolicy::default());
        let limiter = RateLimiter::new(w.closes_per_second);
        if w.consumer {
            let consumer = Consumer::new(
                config,
                pool()?,
                tiers.clone(),
                stats.clone(),
                limiter.clone(),
            );
            let (url, h) = (broker.clone(), health.clone());
            supervisor.add(
                "consumer",
                Box::new(move |t| boxed(consumer.clone().run(url.clone(), h.clone(), t))),
            );
        }
        if w.relay {
            let relay = Relay::new(config, pool()?, tiers.clone(), stats.clone());
            let (url, db_url, poll, h) = (
                broker.clone(),
                config.database.url.clone(),
                config.relay.poll_interval,
                health.clone(),
            );
            supervisor.add(
                "relay",
                Box::new(move |t| {
                    boxed(
                        relay
                            .clone()
                            .run(url.clone(), db_url.clone(), poll, h.clone(), t),
                    )
                }),
            );
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
            let (url, h) = (broker.clone(), health.clone());
            supervisor.add(
                "releaser",
                Box::new(move |t| boxed(releaser.clone().run(url.clone(), h.clone(), t))),
            );
        }
        if w.sweeper {
            let sweeper = Sweeper {
                pool: pool()?,
                stats: stats.clone(),
                config: config.sweeper.clone(),
                limiter,
                lock_timeout: config.database.lock_timeout,
            };
            let h = health.clone();
            supervisor.add(
                "sweeper",
                Box::new(move |t| {
                    let (sweeper, h) = (sweeper.clone(), h.clone());
                    Box::pin(async move {
                        sweeper.run(h, t).await;
                        Ok(())
                    })
                }),
            );
        }
        if w.consumer || w.relay || w.releaser {
            let (url, names, h) = (broker.clone(), config.names(), health.clone());
            supervisor.add(
                crate::queue_gauges::COMPONENT,
                Box::new(move |t| {
                    boxed(crate::queue_gauges::run(
                        url.clone(),
                        names.clone(),
                        tiers.clone(),
                        h.clone(),
                        t,
                    ))
                }),
            );
        }
        Ok(Self {
            supervisor,
            health,
            drain: w.drain_timeout,
        })
    }

    /// The components' health, for `GET /health` and `GET /livez`.
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// Supervises one more task with the components (e.g. the metrics endpoint): it is
    /// restarted on failure and stopped and drained with them.
    pub fn supervise(&mut self, name: &'static str, factory: crate::supervisor::Factory) {
        self.supervisor.add(name, factory);
    }

    /// Runs until the token is cancelled or a component fails fatally, then drains
    /// within the limit.
    pub async fn wait(mut self) -> Stopped {
        let stop = self.supervisor.run().await;
        let abandoned = self.supervisor.drain(self.drain).await;
        Stopped { stop, abandoned }
    }
}

fn boxed<F>(future: F) -> ComponentFuture
where
    F: std::future::Future<Output = Result<(), crate::supervisor::Fatal>> + Send + 'static,
{
    Box::pin(future)
}
