//! The composed Edge: what an embedder starts, and what the `iop-edge` binary runs.
//!
//! [`Edge::start`] takes an [`EdgeConfig`] (from a TOML file with
//! [`EdgeConfigFile::load`](crate::config::EdgeConfigFile::load), or from TOML text and TLS
//! material in code with [`EdgeConfigFile::build_with_tls`](crate::config::EdgeConfigFile::build_with_tls))
//! and starts every part the config asks for: the Node listener (mTLS, its connection caps and
//! deadlines), the provider pool, the Control Plane connector (and with it managed mode), and
//! the reload of the TLS files every `tls.reload_sec`. The HTTP surface is yours to place:
//!
//! - [`Edge::api`]: the model API (`/v1/...`) as an `axum::Router` with no fallback, to
//!   `merge` into an application that has its own routes and fallback, or `nest` under a
//!   prefix; your own middleware (authentication, tracing, CORS) wraps it like any route;
//! - [`Edge::ops`]: `/metrics`, `/healthz`, `/readyz`, wherever your operators want them;
//! - [`Edge::router`]: both, with the Edge's own fallback: what the standalone binary serves;
//! - [`Edge::serve`]: serves any router (yours with the Edge's routes inside) on a listener
//!   with the configured connection limits (`[limits] http_max_connections`,
//!   `http_header_timeout_sec`), `TCP_NODELAY`, and graceful shutdown.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use iop_edge::Edge;
//! use iop_edge::config::EdgeConfigFile;
//!
//! let config = EdgeConfigFile::load("edge.toml".as_ref())?.build()?;
//! let http_listen = config.http_listen;
//! let edge = Edge::start(config).await?;
//! let app = axum::Router::new()
//!     .route("/", axum::routing::get(|| async { "my service" }))
//!     .nest("/llm", edge.api())
//!     .merge(edge.ops());
//! let listener = tokio::net::TcpListener::bind(http_listen).await?;
//! edge.serve(listener, app, async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! edge.shutdown().await;
//! # Ok(())
//! # }
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::EdgeConfig;
use crate::control::{ControlConfigError, ControlConnector};
use crate::http::{self, HttpConfig, ServeLimits};
use crate::transport::{EdgeHandle, bind, start_unbound};

/// Why an Edge did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The Node listener could not be bound.
    #[error("node listener: {0}")]
    Listen(#[source] std::io::Error),
    /// The Control Plane connector's settings are unusable.
    #[error("control_plane: {0}")]
    Control(#[from] ControlConfigError),
    /// Tracing could not start (`[telemetry]` or the `OTEL_*` variables).
    #[error("telemetry: {0}")]
    Telemetry(#[from] iop_telemetry::Error),
}

/// A running Edge. Dropping it leaves its tasks running until the runtime ends; call
/// [`Edge::shutdown`] to stop them.
#[derive(Debug)]
pub struct Edge {
    handle: EdgeHandle,
    http: HttpConfig,
    serve: ServeLimits,
    drain_notice: Duration,
    control: Option<ControlConnector>,
    http_listen: SocketAddr,
    stop: CancellationToken,
    accept: Option<JoinHandle<()>>,
    /// Node connections since the start, for the status page.
    nodes: crate::admin::NodeLog,
}

impl Edge {
    /// Binds the Node listener (`listen.nodes`) and starts everything `config` asks for.
    pub async fn start(config: EdgeConfig) -> Result<Self, StartError> {
        let (handle, accept) = bind(config.transport.clone())
            .await
            .map_err(StartError::Listen)?;
        Self::compose(handle, Some(accept), config)
    }

    /// Starts the Edge without a Node listener: serve Node connections you accept yourself
    /// (another listener type, a simulated network) with
    /// [`EdgeHandle::serve_connection`] on [`Edge::handle`].
    pub fn start_unbound(config: EdgeConfig) -> Result<Self, StartError> {
        let handle = start_unbound(config.transport.clone());
        Self::compose(handle, None, config)
    }

    fn compose(
        handle: EdgeHandle,
        accept: Option<JoinHandle<()>>,
        config: EdgeConfig,
    ) -> Result<Self, StartError> {
        let stop = CancellationToken::new();
        let nodes = crate::admin::NodeLog::follow(&handle);
        let EdgeConfig {
            mut http,
            serve,
            control,
            tls,
            tls_files,
            http_listen,
            telemetry,
            drain_notice,
            ..
        } = config;
        if !http.telemetry.is_on() {
            match iop_telemetry::Telemetry::start(&telemetry, "iop-edge") {
                Ok(t) => http.telemetry = t,
                Err(e) => {
                    if let Some(a) = &accept {
                        a.abort();
                    }
                    return Err(e.into());
                }
            }
        }
        let control = match control {
            Some(c) => {
                let connector = ControlConnector::start(handle.clone(), c, stop.clone());
                let connector = match connector {
                    Ok(c) => c,
                    Err(e) => {
                        if let Some(a) = &accept {
                            a.abort();
                        }
                        return Err(e.into());
                    }
                };
                http.control = Some(connector.clone());
                // Managed: the usage spool goes to the Control Plane.
                if let Some(sink) = http.usage.as_ref().filter(|_| connector.managed()) {
                    tokio::spawn(crate::usage::ship(
                        std::sync::Arc::clone(sink),
                        connector.clone(),
                        stop.clone(),
                    ));
                }
                Some(connector)
            }
            None => None,
        };
        if let Some(files) = tls_files
            && let Some(every) = files.reload
        {
            workload_identity::reload::spawn(tls, files.paths, every, "edge", stop.clone());
        }
        Ok(Self {
            handle,
            http,
            serve,
            drain_notice,
            control,
            http_listen,
            stop,
            accept,
            nodes,
        })
    }

    /// The handle: dispatch runs and tunnels, send commands and config refreshes, read the
    /// pool's snapshot and the Nodes' state.
    pub fn handle(&self) -> &EdgeHandle {
        &self.handle
    }

    /// The Node listener's address (the configured one for [`Edge::start_unbound`]).
    pub fn node_addr(&self) -> SocketAddr {
        self.handle.local_addr()
    }

    /// `listen.http` from the configuration: where the binary serves the HTTP surface. The
    /// library binds nothing there; pass your own listener to [`Edge::serve`].
    pub fn http_listen(&self) -> SocketAddr {
        self.http_listen
    }

    /// The Control Plane connector, when `[control_plane]` is configured.
    pub fn control(&self) -> Option<&ControlConnector> {
        self.control.as_ref()
    }

    /// The HTTP surface's settings (models, queue wait, gateway keys, Control Plane).
    pub fn http_config(&self) -> &HttpConfig {
        &self.http
    }

    /// The model API (`/v1/...`) with no fallback: merge or nest it into your router
    /// ([`http::api_router`]).
    pub fn api(&self) -> Router {
        http::api_router(self.handle.clone(), self.http.clone())
    }

    /// `/metrics`, `/healthz` and `/readyz` ([`http::ops_router`]).
    pub fn ops(&self) -> Router {
        http::ops_router(self.handle.clone(), self.http.clone())
    }

    /// The status page for operators ([`crate::admin`]): serve it on an admin listener, never
    /// on the public API port. Every path needs `token`.
    pub fn status_page(&self, token: crate::admin::AdminToken) -> Router {
        crate::admin::router_with(
            self.handle.clone(),
            self.control.clone(),
            self.http.limiter.clone(),
            token,
            self.nodes.clone(),
        )
    }

    /// The whole surface with the Edge's own fallback, as the `iop-edge` binary serves it
    /// ([`http::router`]).
    pub fn router(&self) -> Router {
        http::router(self.handle.clone(), self.http.clone())
    }

    /// The configured connection limits of the HTTP listener.
    pub fn serve_limits(&self) -> ServeLimits {
        self.serve
    }

    /// Serves `router` on `listener` with the configured connection limits and the Edge's
    /// metrics until `shutdown` completes; then no new connection is accepted and open ones
    /// finish their requests ([`http::serve_with`]).
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        router: Router,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let metrics = Some(self.handle.metrics().clone());
        // On a worker thread, not the one blocked in `block_on`, so a current-thread caller
        // and a multi-thread one behave alike.
        tokio::spawn(http::serve_with(
            listener, router, self.serve, metrics, shutdown,
        ))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)))
    }

    /// A shutdown future for [`Edge::serve`] that drains the Edge first: once `signal`
    /// completes, `/readyz` answers `503 draining` ([`EdgeHandle::drain`]) while the Edge
    /// still serves for the configured notice (`[limits] drain_notice_sec`, so a load
    /// balancer's health check sees it), then it completes: the listener closes and the
    /// requests and streams in flight finish within `[limits] drain_timeout_sec`. What the
    /// `iop-edge` binary does on SIGTERM or Ctrl-C.
    pub fn draining(
        &self,
        signal: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = ()> + Send + 'static {
        let handle = self.handle.clone();
        let notice = self.drain_notice;
        async move {
            signal.await;
            handle.drain();
            tracing::info!(
                target: "iop_edge",
                event = "edge_draining",
                notice_ms = u64::try_from(notice.as_millis()).unwrap_or(u64::MAX),
                "draining: /readyz answers 503; the listener closes after the notice"
            );
            tokio::time::sleep(notice).await;
        }
    }

    /// Exports the spans still queued, then stops the Node listener, the TLS reload and the
    /// Control Plane session (waiting up to 2 s for it to close cleanly). Node connections already open end with the runtime.
    pub async fn shutdown(self) {
        self.http.telemetry.flush().await;
        self.stop.cancel();
        if let Some(a) = &self.accept {
            a.abort();
        }
        if let Some(c) = &self.control {
            let _ = tokio::time::timeout(Duration::from_secs(2), c.stopped()).await;
        }
    }
}
