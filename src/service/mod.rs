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
//!
//! The composition root of the worker: the one module outside `cli/` that names the
//! components. Before they start, `migrations` migrates the order databases
//! (`worker.migrate_on_start`); `error` is why a start failed.

pub mod error;
pub mod migrations;

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::amqp::broker::Endpoint;
use crate::components::consumer::Consumer;
use crate::components::relay::Relay;
use crate::components::releaser::Releaser;
use crate::components::sweeper::Sweeper;
use crate::config::{Config, Shard};
use crate::db::{self, Schemas};
use crate::observe::stats::Stats;
use crate::runtime::health::Health;
use crate::runtime::rate::RateLimiter;
use crate::runtime::supervisor::{ComponentFuture, RestartPolicy, Stop, Supervisor};
use crate::tier::TierSet;
use error::ServiceError;

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

/// Refuses to start with a kind whose action does not check on a migrated order
/// database (docs/adopting.md): the error names the kind and the key.
async fn check_kinds(config: &Config, schemas: &db::Schemas) -> Result<(), ServiceError> {
    let catalog = crate::kinds::Catalog::new(&config.kinds, &config.database.shop_search_path);
    crate::observe::metric_catalog::describe_kinds(catalog.iter().map(|k| k.name.as_str()));
    // The consumer fires kinds, and so does the backstop (with the sweeper).
    if catalog.is_empty() || !(config.worker.consumer || config.worker.sweeper) {
        return Ok(());
    }
    for shard in config.database.shard_list() {
        if !schemas.is_migrated(shard.index) {
            continue;
        }
        if let Some(problem) = crate::kinds::check::first_problem(&shard.url, &catalog).await? {
            return Err(crate::config::ConfigError {
                key: format!("kinds.{}.{}", problem.kind, problem.field),
                problem: problem.problem,
            }
            .into());
        }
    }
    Ok(())
}

impl Service {
    /// Starts every component the configuration enables, after the migrations of
    /// `worker.migrate_on_start` (a shard that does not answer is migrated in the
    /// background, its components waiting for it: [`migrations`]).
    pub async fn start(
        config: &Config,
        stats: Stats,
        token: CancellationToken,
    ) -> Result<Self, ServiceError> {
        let migrations = migrations::at_start(config, &token).await?;
        check_kinds(config, &migrations.schemas).await?;
        let tiers = config.tier_file()?.tiers;
        // The worker's connections carry the AMQP heartbeat, so that the broker takes
        // back a frozen worker's deliveries.
        let broker =
            crate::amqp::endpoint(&config.broker)?.with_url(config.broker.url_with_heartbeat());
        let w = &config.worker;
        let health = Health::new(w.stall_limit);
        let mut supervisor = Supervisor::new(health.clone(), token, RestartPolicy::default());
        let mut start = Starter {
            supervisor: &mut supervisor,
            broker,
            health: health.clone(),
            schemas: migrations.schemas,
        };
        start.components(config, tiers, stats)?;
        start.migrations(config, migrations.pending);
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
    pub fn supervise(&mut self, name: &'static str, factory: crate::runtime::supervisor::Factory) {
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

/// Adds components to the supervisor: each one a factory that starts a fresh instance
/// (with the broker endpoint and the health registry) for every (re)start.
struct Starter<'a> {
    supervisor: &'a mut Supervisor,
    broker: Endpoint,
    health: Health,
    /// Which shards are migrated; the components of one that is not wait for it.
    schemas: Schemas,
}

impl Starter<'_> {
    /// Supervises `run` under `name`; each start gets clones of the endpoint and the
    /// health registry and its own token.
    fn add<F, Fut>(&mut self, name: &'static str, run: F)
    where
        F: Fn(Endpoint, Health, CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), crate::runtime::supervisor::Fatal>>
            + Send
            + 'static,
    {
        let (broker, health) = (self.broker.clone(), self.health.clone());
        self.supervisor.add(
            name,
            Box::new(move |t| boxed(run(broker.clone(), health.clone(), t))),
        );
    }

    /// The components `config` enables, each with its own connection pool(s): one
    /// consumer and one releaser holding a pool per shard, a relay and a sweeper per
    /// shard (named `relay.s<i>`, `sweeper.s<i>` with shards).
    fn components(
        &mut self,
        config: &Config,
        tiers: TierSet,
        stats: Stats,
    ) -> Result<(), ServiceError> {
        let w = &config.worker;
        let database = &config.database;
        let schemas = self.schemas.clone();
        let pools = || db::Pools::open(database, database.pool_size, &schemas);
        // Shared by the consumer and the sweepers: together they stay under the limit.
        let limiter = RateLimiter::new(w.closes_per_second);
        if w.consumer {
            let consumer = Consumer::new(
                config,
                pools()?,
                tiers.clone(),
                stats.clone(),
                limiter.clone(),
            );
            self.add("consumer", move |b, h, t| consumer.clone().run(b, h, t));
        }
        if w.relay {
            for shard in database.shard_list() {
                self.relay(config, &shard, &tiers, &stats)?;
            }
        }
        if w.releaser {
            let releaser = Releaser {
                pools: pools()?,
                names: config.names(),
                stats: stats.clone(),
                batching: crate::amqp::batch::Batching::for_releaser(w),
            };
            self.add("releaser", move |b, h, t| releaser.clone().run(b, h, t));
        }
        if w.sweeper {
            for shard in database.shard_list() {
                self.sweeper(config, &shard, &stats, &limiter)?;
            }
        }
        // Every worker that knows kinds may promote (a relay-only or consumer-only
        // fleet still hands far deadlines over); the backstop only with the sweeper.
        if !config.kinds.is_empty() && (w.consumer || w.relay || w.sweeper) {
            for shard in database.shard_list() {
                self.promoter(config, &shard, &stats)?;
            }
        }
        if w.parked_archive && (w.consumer || w.relay || w.releaser || w.sweeper) {
            // The parked book lives in the first order database.
            let home = database.for_shard(&database.shard_list()[0]);
            let pool = db::pool(&home, 2)?;
            let names = config.names();
            let (schemas, index) = (self.schemas.clone(), database.shard_list()[0].index);
            let name = crate::parked::archiver::COMPONENT;
            self.add(name, move |b, h, t| {
                let (names, pool, schemas) = (names.clone(), pool.clone(), schemas.clone());
                async move {
                    // Nothing is taken from the queue before the book's table exists.
                    if !migrations::wait_migrated(&schemas, index, name, &h, &t).await {
                        return Ok(());
                    }
                    crate::parked::archiver::run(b, names, pool, h, t).await
                }
            });
        }
        if w.consumer || w.relay || w.releaser {
            let names = config.names();
            self.add(
                crate::components::queue_gauges::COMPONENT,
                move |b, h, t| {
                    crate::components::queue_gauges::run(b, names.clone(), tiers.clone(), h, t)
                },
            );
        }
        Ok(())
    }
}

impl Starter<'_> {
    /// The relay of one shard's outbox (`relay`, or `relay.s<i>` with shards).
    fn relay(
        &mut self,
        config: &Config,
        shard: &Shard,
        tiers: &TierSet,
        stats: &Stats,
    ) -> Result<(), ServiceError> {
        let database = config.database.for_shard(shard);
        let pool = db::pool(&database, database.pool_size)?;
        let mut relay = Relay::new(config, pool, tiers.clone(), stats.clone());
        relay.shard = shard.index;
        relay.component = leak(config.database.per_shard("relay", shard.index));
        relay.shard_label = config.database.sharded().then(|| shard.index.to_string());
        let db_url = crate::config::listen_url(config.relay.listen_url.as_ref(), shard);
        let poll = config.relay.poll_interval;
        let (schemas, index) = (self.schemas.clone(), shard.index);
        self.add(relay.component, move |b, h, t| {
            let (relay, db_url, schemas) = (relay.clone(), db_url.clone(), schemas.clone());
            async move {
                if !migrations::wait_migrated(&schemas, index, relay.component, &h, &t).await {
                    return Ok(());
                }
                relay.run(b, db_url, poll, h, t).await
            }
        });
        Ok(())
    }

    /// The sweeper of one shard (`sweeper`, or `sweeper.s<i>` with shards), with its
    /// own leader election and reconciler in that database.
    fn sweeper(
        &mut self,
        config: &Config,
        shard: &Shard,
        stats: &Stats,
        limiter: &RateLimiter,
    ) -> Result<(), ServiceError> {
        let database = config.database.for_shard(shard);
        let sweeper = Sweeper {
            pool: db::pool(&database, database.pool_size)?,
            stats: stats.clone(),
            config: config.sweeper.clone(),
            retention: config.retention.clone(),
            limiter: limiter.clone(),
            lock_timeout: database.lock_timeout,
            stock_release: config.worker.stock_release,
        };
        let name = leak(config.database.per_shard("sweeper", shard.index));
        let label = config.database.sharded().then(|| shard.index.to_string());
        let (schemas, index) = (self.schemas.clone(), shard.index);
        self.add(name, move |_, h, t| {
            let (sweeper, label, schemas) = (sweeper.clone(), label.clone(), schemas.clone());
            async move {
                if migrations::wait_migrated(&schemas, index, name, &h, &t).await {
                    sweeper.run_as(name, label, h, t).await;
                }
                Ok(())
            }
        });
        Ok(())
    }

    /// The promoter of one shard (`promoter`, or `promoter.s<i>`): far deadlines of
    /// kinds to the broker when within range, and their backstop.
    fn promoter(
        &mut self,
        config: &Config,
        shard: &Shard,
        stats: &Stats,
    ) -> Result<(), ServiceError> {
        let database = config.database.for_shard(shard);
        let promoter =
            crate::kinds::promote::Promoter::new(config, db::pool(&database, 2)?, stats.clone());
        let name = leak(config.database.per_shard("promoter", shard.index));
        let (schemas, index) = (self.schemas.clone(), shard.index);
        self.add(name, move |_, h, t| {
            let (promoter, schemas) = (promoter.clone(), schemas.clone());
            async move {
                if migrations::wait_migrated(&schemas, index, name, &h, &t).await {
                    promoter.run(name, h, t).await;
                }
                Ok(())
            }
        });
        Ok(())
    }

    /// A `migrate.s<i>` component for each shard that did not answer at start: it
    /// migrates that shard in the background, which lets its components start.
    fn migrations(&mut self, config: &Config, pending: Vec<Shard>) {
        let settings = db::Settings::from_config(config);
        for shard in pending {
            let name = leak(config.database.per_shard("migrate", shard.index));
            let schemas = self.schemas.clone();
            let settings = settings.clone();
            self.add(name, move |_, h, t| {
                migrations::migrate_later(
                    shard.clone(),
                    settings.clone(),
                    schemas.clone(),
                    name,
                    h,
                    t,
                )
            });
        }
    }
}

/// A component's name for the supervisor, which keeps `&'static str` names: a few
/// per-shard names leak once at start-up.
fn leak(name: String) -> &'static str {
    Box::leak(name.into_boxed_str())
}

fn boxed<F>(future: F) -> ComponentFuture
where
    F: std::future::Future<Output = Result<(), crate::runtime::supervisor::Fatal>> + Send + 'static,
{
    Box::pin(future)
}
