//! `lapse worker`: run the consumer, relay, releaser and sweeper until SIGINT/SIGTERM.

use std::net::SocketAddr;

use clap::Args;

use super::ExitStatus;
use crate::config::Config;
use crate::http;
use crate::service::Service;
use crate::shutdown;
use crate::stats::Stats;

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
    /// Serve GET /metrics (Prometheus) and GET /health on this address (e.g. 127.0.0.1:9464).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
}

pub async fn run(mut config: Config, args: WorkerArgs) -> anyhow::Result<ExitStatus> {
    let w = &mut config.worker;
    w.consumer &= !args.no_consumer;
    w.relay &= !args.no_relay;
    w.releaser &= !args.no_releaser;
    w.sweeper &= !args.no_sweeper;
    let metrics = args
        .metrics_listen
        .map(|_| http::install_recorder())
        .transpose()?;
    let token = shutdown::on_signal();
    let stats = Stats::default();
    let service = Service::start(&config, stats.clone(), token.clone()).await?;
    if let (Some(addr), Some(metrics)) = (args.metrics_listen, metrics) {
        let (health, token) = (service.health(), token.clone());
        tokio::spawn(async move {
            if let Err(e) = http::serve(addr, metrics, health, token).await {
                tracing::error!(error = %e, %addr, "cannot serve /metrics and /health");
            }
        });
    }
    tracing::info!(prefix = %config.broker.prefix, "worker running; SIGINT or SIGTERM stops it");
    let abandoned = service.wait().await;
    let summary: Vec<String> = stats
        .summary()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    tracing::info!(summary = %summary.join(" "), "worker stopped");
    if !abandoned.is_empty() {
        tracing::warn!(?abandoned, "stopped at the drain limit");
    }
    Ok(ExitStatus::Ok)
}
