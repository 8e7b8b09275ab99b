//! Admin HTTP endpoints (axum): `/healthz` (process up), `/readyz` (serving and the store —
//! Redis — answering within a second), `/metrics` (Prometheus text, bounded labels).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::sync::watch;

use crate::domain::ControlStore;
use crate::metrics::Metrics;

#[derive(Clone)]
struct AdminState {
    store: Arc<dyn ControlStore>,
    metrics: Arc<Metrics>,
    ready: watch::Receiver<bool>,
}

async fn readyz(State(s): State<AdminState>) -> (StatusCode, &'static str) {
    if !*s.ready.borrow() {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down");
    }
    match tokio::time::timeout(Duration::from_secs(1), s.store.current_ownership_epoch()).await {
        Ok(Ok(_)) => (StatusCode::OK, "ready"),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "redis unavailable"),
    }
}

/// Serves the admin endpoints on `listener` until the process group stops.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    store: Arc<dyn ControlStore>,
    metrics: Arc<Metrics>,
    ready: watch::Receiver<bool>,
) -> Result<(), String> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route(
            "/metrics",
            get(|State(s): State<AdminState>| async move {
                (
                    [(http::header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
                    s.metrics.render(),
                )
            }),
        )
        .with_state(AdminState {
            store,
            metrics,
            ready,
        });
    bounded_http::serve_with(
        listener,
        app,
        bounded_http::ServeLimits::default(),
        None,
        std::future::pending(),
    )
    .await
    .map_err(|e| format!("admin server: {e}"))
}
