//! `lapse worker`: run the consumer, relay, releaser and sweeper until SIGINT/SIGTERM.
//!
//! Exit status: 0 only for a SIGINT/SIGTERM shutdown that drained within
//! `worker.drain_timeout`; 1 when a component failed fatally (e.g. the broker refused
//! the credentials) or the drain limit was reached; 2 for bad configuration.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Args;

use super::ExitStatus;
use crate::config::Config;
use crate::http;
use crate::service::Service;
use crate::shutdown;
use crate::stats::Stats;
use crate::supervisor::Stop;

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Do not consume the due queue.
    #[arg(long)]
    no_consumer: bool,
    /// Do not run the outbox relay.
    #[arg(long)]
    no_relay: bool,
    /// Do not run the stock releaser.
    #[arg(long)]
    no_releaser: bool,
    /// Do not run the backstop sweeper.
    #[arg(long)]
    no_sweeper: bool,
    /// Serve GET /metrics (Prometheus), GET /livez, GET /readyz and GET /health on this address (e.g.
    /// 127.0.0.1:9464); an address that cannot be bound is a startup error.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
}

pub async fn run(mut config: Config, args: WorkerArgs) -> anyhow::Result<ExitStatus> {
    let w = &mut config.worker;
    w.consumer &= !args.no_consumer;
    w.relay &= !args.no_relay;
    w.releaser &= !args.no_releaser;
    w.sweeper &= !args.no_sweeper;
    // Bind before anything starts: an address that cannot be bound is a startup error.
    let endpoint = match args.metrics_listen {
        Some(addr) => {
            let listener = http::bind(addr)
                .await
                .with_context(|| format!("cannot listen on --metrics-listen {addr}"))?;
            Some((listener, http::install_recorder()?))
        }
        None => None,
    };
    let token = shutdown::on_signal();
    let stats = Stats::default();
    let mut service = Service::start(&config, stats.clone(), token.clone()).await?;
    if let Some((listener, metrics)) = endpoint {
        let health = service.health();
        let readiness = crate::readiness::Readiness::from_config(&config);
        service.supervise(
            "http",
            Box::new(move |t| {
                Box::pin(http::serve(
                    listener.clone(),
                    metrics.clone(),
                    health.clone(),
                    readiness.clone(),
                    t,
                ))
            }),
        );
    }
    tracing::info!(prefix = %config.broker.prefix, "worker running; SIGINT or SIGTERM stops it");
    let stopped = service.wait().await;
    let summary: Vec<String> = stats
        .summary()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    tracing::info!(summary = %summary.join(" "), "worker stopped");
    if !stopped.abandoned.is_empty() {
        tracing::warn!(abandoned = ?stopped.abandoned, "stopped at the drain limit");
    }
    match stopped.stop {
        Stop::Fatal { component, reason } => Err(anyhow::anyhow!(
            "{component} failed: {reason}; the worker stopped"
        )),
        Stop::Requested if stopped.clean() => Ok(ExitStatus::Ok),
        Stop::Requested => {
            eprintln!(
                "error: the drain limit (worker.drain_timeout) was reached; abandoned: {}",
                stopped.abandoned.join(", ")
            );
            Ok(ExitStatus::Failed)
        }
    }
}
