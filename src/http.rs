//! The operator endpoint of `lapse worker --metrics-listen ADDR`:
//! `GET /metrics` (Prometheus text format) and `GET /health` (JSON; 200 when every
//! component is up, 503 otherwise).

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::health::Health;

/// Installs the process-wide Prometheus recorder; call before any work is counted.
pub fn install_recorder() -> std::io::Result<PrometheusHandle> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(std::io::Error::other)
}

/// Serves `/metrics` and `/health` until `token` is cancelled.
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    health: Health,
    token: CancellationToken,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics and /health");
    loop {
        let (stream, _) = tokio::select! {
            _ = token.cancelled() => return Ok(()),
            accepted = listener.accept() => accepted?,
        };
        let (metrics, health) = (metrics.clone(), health.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                respond(req, metrics.clone(), health.clone())
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
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, content_type, body) = match req.uri().path() {
        "/metrics" => (
            StatusCode::OK,
            "text/plain; version=0.0.4",
            metrics.render(),
        ),
        "/health" => {
            let healthy = health.healthy();
            let body = serde_json::json!({
                "status": if healthy { "ok" } else { "degraded" },
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
            "try /metrics or /health\n".to_string(),
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
