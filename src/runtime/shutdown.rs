//! The one owner of shutdown: a root [`CancellationToken`] cancelled by SIGINT or
//! SIGTERM. Components receive a child token and `select!` on it, never on signals.

use tokio_util::sync::CancellationToken;

/// Returns a token cancelled on the first SIGINT or SIGTERM.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install the SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received, shutting down"),
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
        }
        cancel.cancel();
    });
    token
}
