//! The operator endpoint of `lapse worker --metrics-listen ADDR`:
//! - `GET /metrics`: Prometheus text format (every metric: `docs/metrics.md`).
//! - `GET /livez`: liveness, for a supervisor. 200 while every component is making
//!   progress; 503 naming the stalled components otherwise (restart the process).
//!   It never depends on the broker or the database being reachable.
//! - `GET /readyz`: readiness. 200 when the broker and the database are reachable and
//!   every component is running; 503 with the reason of each failed check otherwise
//!   (see [`crate::runtime::readiness`]).
//! - `GET /health`: the detailed view (JSON): each component up or down with its last
//!   error, its restarts and whether it is stalled; 200 when all are up and none is
//!   stalled, 503 otherwise. A component that is down is retrying on its own: that is
//!   for alerts and dashboards, not a reason to restart.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::runtime::health::Health;
use crate::runtime::readiness::Readiness;
use crate::runtime::supervisor::Fatal;

/// Installs the process-wide Prometheus recorder; call before any work is counted.
pub fn install_recorder() -> std::io::Result<PrometheusHandle> {
    use crate::observe::metric_catalog as m;
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
    PROCESS.describe();
    Ok(handle)
}

/// The standard `process_*` metrics (CPU seconds, resident memory, open file
/// descriptors, threads, start time), read from the system at each scrape.
static PROCESS: std::sync::LazyLock<metrics_process::Collector> =
    std::sync::LazyLock::new(metrics_process::Collector::default);

/// Binds the endpoint's address; do this before starting anything, so that an address
/// that cannot be bound is a startup error.
pub async fn bind(addr: SocketAddr) -> std::io::Result<Arc<TcpListener>> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics, /livez, /readyz and /health");
    Ok(Arc::new(listener))
}

/// Serves `/metrics`, `/livez`, `/readyz` and `/health` on `listener` until `token`
/// is cancelled, then shuts down gracefully: no new connections, requests in flight
/// answered, idle keep-alive connections closed. Connections are tasks of this server
/// (axum's), which is one supervised task: the supervisor's drain limit bounds it.
pub async fn serve(
    listener: Arc<TcpListener>,
    metrics: PrometheusHandle,
    health: Health,
    readiness: Readiness,
    token: CancellationToken,
) -> Result<(), Fatal> {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/health", get(health_view))
        .fallback(not_found)
        .with_state(Endpoint {
            metrics,
            health,
            readiness,
        });
    let server =
        axum::serve(Shared(listener), app).with_graceful_shutdown(token.clone().cancelled_owned());
    // A client that sent half a request and went silent would hold the graceful
    // shutdown (and so the worker's exit) until the drain limit: after the grace, the
    // remaining connections are dropped.
    let grace = async {
        token.cancelled().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        served = std::future::IntoFuture::into_future(server) => {
            served.map_err(|e| Fatal(format!("metrics endpoint: {e}")))
        }
        () = grace => Ok(()),
    }
}

/// How long requests in flight may finish after shutdown begins.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// What the handlers read.
#[derive(Clone)]
struct Endpoint {
    metrics: PrometheusHandle,
    health: Health,
    readiness: Readiness,
}

/// The listener bound at start, shared by every (re)start of the server: a restart
/// never has to bind again.
struct Shared(Arc<TcpListener>);

impl axum::serve::Listener for Shared {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            match self.0.accept().await {
                Ok(accepted) => return accepted,
                Err(e) => {
                    // Out of file descriptors and the like: pause instead of spinning.
                    tracing::warn!(error = %e, "cannot accept a connection on the metrics endpoint");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

fn json(ok: bool, body: serde_json::Value) -> Response {
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn metrics_text(State(e): State<Endpoint>) -> Response {
    PROCESS.collect();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        e.metrics.render(),
    )
        .into_response()
}

async fn livez(State(e): State<Endpoint>) -> Response {
    let stalled: Vec<_> = e
        .health
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
        "stall_limit_ms": u64::try_from(e.health.stall_limit().as_millis()).unwrap_or(u64::MAX),
        "stalled": stalled,
    });
    json(live, body)
}

async fn readyz(State(e): State<Endpoint>) -> Response {
    let (ready, body) = e.readiness.check(&e.health).await;
    json(ready, body)
}

async fn health_view(State(e): State<Endpoint>) -> Response {
    let healthy = e.health.healthy();
    let status = if healthy {
        "ok"
    } else if e.health.live() {
        "degraded"
    } else {
        "stalled"
    };
    let body = serde_json::json!({
        "status": status,
        "components": e.health.snapshot(),
    });
    json(healthy, body)
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "text/plain")],
        "try /metrics, /livez, /readyz or /health\n",
    )
        .into_response()
}

/// The address `HOST:PORT` resolves to: its first IPv4 address, else its first (so
/// `localhost` is 127.0.0.1, where scrapers look, even where the system lists ::1
/// first).
pub async fn resolve(address: &str) -> std::io::Result<SocketAddr> {
    let all: Vec<SocketAddr> = tokio::net::lookup_host(address.trim()).await?.collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{address} resolves to no address"),
            )
        })
}
