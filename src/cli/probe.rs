//! `lapse probe`: asks a running worker's `/livez` (or `/readyz`) and turns the answer
//! into an exit status, for a container's HEALTHCHECK or any supervisor that runs a
//! command rather than an HTTP request (the image carries no HTTP client).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use clap::Args;

use super::ExitStatus;
use crate::config::Config;
use crate::runtime::http;

#[derive(Debug, Args)]
pub struct ProbeArgs {
    /// Ask /readyz (broker and database reachable) instead of /livez (every component
    /// making progress).
    #[arg(long)]
    ready: bool,
    /// The worker's metrics address, HOST:PORT (default: worker.metrics_listen; an
    /// unspecified address such as 0.0.0.0 is asked on loopback).
    #[arg(long, value_name = "HOST:PORT", value_parser = super::listen_address)]
    address: Option<String>,
    /// How long to wait for the answer.
    #[arg(long, value_name = "DURATION", default_value = "3s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

pub async fn run(config: &Config, args: ProbeArgs) -> anyhow::Result<ExitStatus> {
    let Some(address) = args
        .address
        .clone()
        .or_else(|| config.worker.metrics_listen.clone())
    else {
        eprintln!(
            "error: worker.metrics_listen is not set; give the worker's address with --address HOST:PORT"
        );
        return Ok(ExitStatus::Usage);
    };
    let path = if args.ready { "readyz" } else { "livez" };
    let target = match http::resolve(&address).await {
        Ok(addr) => loopback_if_unspecified(addr),
        Err(e) => {
            eprintln!("error: cannot resolve {address}: {e}");
            return Ok(ExitStatus::Unreachable);
        }
    };
    let url = format!("http://{target}/{path}");
    let client = crate::tls::TlsFiles::default()
        .http_client()?
        .timeout(args.timeout)
        .build()?;
    match client.get(&url).send().await {
        Ok(response) => {
            let ok = response.status().is_success();
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            let body = body.trim();
            if ok {
                println!("{path}: {body}");
                Ok(ExitStatus::Ok)
            } else {
                eprintln!("{path}: HTTP {status}: {body}");
                Ok(ExitStatus::Failed)
            }
        }
        Err(e) => {
            eprintln!("error: no answer from {url}: {e}");
            Ok(ExitStatus::Unreachable)
        }
    }
}

/// A worker listening on every address (0.0.0.0, ::) is asked on loopback.
fn loopback_if_unspecified(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port())
        }
        _ => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unspecified_addresses_are_asked_on_loopback() {
        let any: SocketAddr = "0.0.0.0:9464".parse().unwrap();
        assert_eq!(
            loopback_if_unspecified(any),
            "127.0.0.1:9464".parse().unwrap()
        );
        let any6: SocketAddr = "[::]:9464".parse().unwrap();
        assert_eq!(loopback_if_unspecified(any6), "[::1]:9464".parse().unwrap());
        let named: SocketAddr = "10.1.2.3:9464".parse().unwrap();
        assert_eq!(loopback_if_unspecified(named), named);
    }
}
