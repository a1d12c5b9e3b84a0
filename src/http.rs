//! The operator endpoint of `lapse worker --metrics-listen ADDR`:
//! - `GET /metrics`: Prometheus text format (every metric: `docs/metrics.md`).
//! - `GET /livez`: liveness, for a supervisor. 200 while every component is making
//!   progress; 503 naming the stalled components otherwise (restart the process).
//!   It never depends on the broker or the database being reachable.
//! - `GET /readyz`: readiness. 200 when the broker and the database are reachable and
//!   every component is running; 503 with the reason of each failed check otherwise
//!   (see [`crate::readiness`]).
//! - `GET /health`: the detailed view (JSON): each component up or down with its last
//!   error, its restarts and whether it is stalled; 200 when all are up and none is
//!   stalled, 503 otherwise. A component that is down is retrying on its own: that is
//!   for alerts and dashboards, not a reason to restart.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::health::Health;
use crate::readiness::Readiness;
use crate::supervisor::Fatal;

/// Installs the process-wide Prometheus recorder; call before any work is counted.
pub fn install_recorder() -> std::io::Result<PrometheusHandle> {
    use crate::metric_catalog as m;
    use metrics_exporter_prometheus::Matcher;
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(m::CLOSE_LATENESS.into()),
            &m::LATENESS_BUCKETS,
        )
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full(m::LIMITER_WAIT.into()), &m::LATENESS_BUCKETS)
        })
        .map_err(std::io::Error::other)?
        .install_recorder()
        .map_err(std::io::Error::other)?;
    m::describe();
    Ok(handle)
}

/// Binds the endpoint's address; do this before starting anything, so that an address
/// that cannot be bound is a startup error.
pub async fn bind(addr: SocketAddr) -> std::io::Result<Arc<TcpListener>> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics, /livez, /readyz and /health");
    Ok(Arc::new(listener))
}

/// Serves `/metrics`, `/livez`, `/readyz` and `/health` on `listener` until `token`
/// is cancelled. Connections are tasks of this server and end with it.
pub async fn serve(
    listener: Arc<TcpListener>,
    metrics: PrometheusHandle,
    health: Health,
    readiness: Readiness,
    token: CancellationToken,
) -> Result<(), Fatal> {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = token.cancelled() => return Ok(()),
            Some(_) = connections.join_next() => continue,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: pause instead of spinning.
                tracing::warn!(error = %e, "cannot accept a connection on the metrics endpoint");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (metrics, health, readiness) = (metrics.clone(), health.clone(), readiness.clone());
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                respond(req, metrics.clone(), health.clone(), readiness.clone())
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn respond(
    req: Request<Incoming>,
    metrics: PrometheusHandle,
    health: Health,
    readiness: Readiness,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, content_type, body) = match req.uri().path() {
        "/metrics" => (
            StatusCode::OK,
            "text/plain; version=0.0.4",
            metrics.render(),
        ),
        "/livez" => {
            let stalled: Vec<_> = health
                .stalled()
                .into_iter()
                .map(|(component, busy)| {
                    serde_json::json!({
                        "component": component,
                        "busy_ms": u64::try_from(busy.as_millis()).unwrap_or(u64::MAX),
                    })
                })
                .collect();
            let live = stalled.is_empty();
            let body = serde_json::json!({
                "status": if live { "live" } else { "stalled" },
                "stall_limit_ms": u64::try_from(health.stall_limit().as_millis()).unwrap_or(u64::MAX),
                "stalled": stalled,
            });
            let status = if live {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, "application/json", body.to_string())
        }
        "/readyz" => {
            let (ready, body) = readiness.check(&health).await;
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, "application/json", body.to_string())
        }
        "/health" => {
            let healthy = health.healthy();
            let status = if healthy {
                "ok"
            } else if health.live() {
                "degraded"
            } else {
                "stalled"
            };
            let body = serde_json::json!({
                "status": status,
                "components": health.snapshot(),
            });
            let status = if healthy {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, "application/json", body.to_string())
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "try /metrics, /livez, /readyz or /health\n".to_string(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    Ok(response)
}
