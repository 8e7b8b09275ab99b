//! Bootstrap: the gRPC server with its limits, gRPC health and reflection, the admin HTTP
//! endpoints (`/healthz`, `/readyz`, `/metrics`) and the shutdown sequence, as one lifecycle
//! group: if either server fails, both stop.
//!
//! Only started when `controlPlane.enabled`; Redis is then required and part of readiness.
//! Shutdown: readiness and gRPC health go not-serving, new RPCs are refused, in-flight ones get
//! `shutdownTimeout` to finish (graceful stop), then every connection is dropped (hard stop).
//!
//! gRPC health (`grpc.health.v1`) follows readiness: the store is probed every
//! [`HEALTH_PROBE_INTERVAL`] (answer within one second), and both the server (`""`) and
//! `controlplane.v1.WorkerControlPlane` go `NOT_SERVING` while it does not answer or after
//! shutdown began, `SERVING` again once it does; `Watch` streams each change. Reflection is
//! served as `grpc.reflection.v1` and `grpc.reflection.v1alpha` (older grpcurl/grpcui, Postman
//! and Python's `grpcio-reflection` speak only the latter), and lists the health service too.
//! A request over `maxMessageBytes` is refused with `RESOURCE_EXHAUSTED` — the gRPC status table's
//! code for a message larger than the configured limit (tonic itself answers `OUT_OF_RANGE`;
//! [`OversizeStatus`] corrects the status of exactly that refusal).
//!
//! Limits set explicitly: receive and send message size (`maxMessageBytes`), concurrent streams
//! per connection (`maxConcurrentStreams`), HTTP/2 keepalive pings (every 30 s, 10 s timeout:
//! dead peers are dropped), pending-accept and local-error reset-stream limits (HTTP/2 reset
//! floods, RUSTSEC-2024-0003 / CVE-2023-44487), header list size 16 KiB, TCP_NODELAY on every
//! accepted socket, a 30 s per-RPC timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::{Config, TlsMode};
use crate::domain::{ControlStore, Service};
use crate::grpc::Controller;
use crate::metrics::Metrics;
use crate::proto::controlplane::worker_control_plane_server::WorkerControlPlaneServer;
use crate::redis_store::RedisStore;

/// HTTP/2 keepalive ping interval.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// HTTP/2 keepalive ping timeout.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Remotely reset streams allowed in the pending-accept queue before GOAWAY.
pub const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Locally reset (errored) streams allowed before GOAWAY.
pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 256;
/// Per-RPC timeout.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(30);
/// How often gRPC health probes the store.
pub const HEALTH_PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// How long one health probe of the store may take.
const HEALTH_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Why the controller did not start.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    /// `controlPlane.enabled` is false.
    #[error("controlPlane.enabled is false: the worker control plane is disabled")]
    Disabled,
    /// Redis did not answer.
    #[error("redis unavailable at startup")]
    RedisUnavailable,
    /// A listener could not be bound.
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, String),
    /// A TLS file or setting is wrong (names the key).
    #[error("{0}")]
    Tls(String),
}

/// A running controller.
#[derive(Debug)]
pub struct Running {
    /// The gRPC listener's address.
    pub grpc_addr: SocketAddr,
    /// The admin listener's address.
    pub admin_addr: Option<SocketAddr>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    ready: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<Result<(), String>>,
}

impl Running {
    /// Whether the controller reports ready (serving, Redis reachable at the last check).
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Waits until the lifecycle group ends (after shutdown, or a server failure).
    pub async fn wait(self) -> Result<(), String> {
        self.task.await.map_err(|e| e.to_string())?
    }
}

/// Starts the controller with the Redis store of `config`.
pub async fn start(
    config: &Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Running, StartError> {
    if !config.enabled {
        return Err(StartError::Disabled);
    }
    let redis = config.redis.clone().ok_or(StartError::RedisUnavailable)?;
    let store = RedisStore::connect_to(&redis.target, &redis.namespace)
        .await
        .map_err(|_| StartError::RedisUnavailable)?
        .with_durability(redis.durability);
    start_with(config, Arc::new(store), shutdown).await
}

/// Starts the controller over any store (tests use the in-memory one).
pub async fn start_with(
    config: &Config,
    store: Arc<dyn ControlStore>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Running, StartError> {
    if !config.enabled {
        return Err(StartError::Disabled);
    }
    // Redis (or the store) must answer before we call ourselves started.
    store
        .current_ownership_epoch()
        .await
        .map_err(|_| StartError::RedisUnavailable)?;
    let metrics = Arc::new(Metrics::default());
    let service = Arc::new(Service::new(store.clone(), config.service));
    let mtls = matches!(config.tls, TlsMode::Mtls { .. });
    let controller = Controller::new(service, metrics.clone(), mtls);
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| StartError::Listen(config.listen, e.to_string()))?;
    let grpc_addr = listener
        .local_addr()
        .map_err(|e| StartError::Listen(config.listen, e.to_string()))?;

    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, true).await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| StartError::Tls(format!("reflection: {e}")))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| StartError::Tls(format!("reflection: {e}")))?;
    // ReportRuntime decodes straight into canonical counters; every other RPC is the
    // generated server's (`grpc::report`).
    let svc =
        crate::grpc::report::WorkerControlPlaneService::new(controller, config.max_message_bytes);
    let mut builder = tonic::transport::Server::builder()
        .max_concurrent_streams(config.max_concurrent_streams)
        .concurrency_limit_per_connection(config.max_concurrent_streams as usize)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESET_STREAMS))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .http2_max_header_list_size(16 * 1024)
        // Full reports are up to maxMessageBytes: windows that fit several in flight.
        .initial_stream_window_size(u32::try_from(config.max_message_bytes).unwrap_or(u32::MAX))
        .initial_connection_window_size(
            u32::try_from(config.max_message_bytes.saturating_mul(4)).unwrap_or(u32::MAX),
        )
        .tcp_nodelay(true)
        .timeout(RPC_TIMEOUT)
        .layer(tower_layer::layer_fn(OversizeStatus));
    let router = builder
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(svc);

    let (ready_tx, ready_rx) = watch::channel(true);
    let monitor = tokio::spawn(health_monitor(
        health.clone(),
        store.clone(),
        ready_rx.clone(),
    ));
    let (graceful_tx, graceful_rx) = tokio::sync::oneshot::channel::<()>();
    // The hard stop: every accepted connection fails its next read or write once this is
    // cancelled (tonic's graceful stop has no hard counterpart: its connection tasks would
    // outlive the server future, holding open streams, in a process that embeds the
    // controller).
    let hard_stop = tokio_util::sync::CancellationToken::new();
    let graceful = async move {
        let _ = graceful_rx.await;
    };
    let pings = config
        .min_ping_interval
        .map(crate::keepalive::PingPolicy::new);
    let server: std::pin::Pin<
        Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>,
    > = match &config.tls {
        TlsMode::Disabled => {
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            let incoming = stoppable(incoming, hard_stop.clone(), pings);
            Box::pin(router.serve_with_incoming_shutdown(incoming, graceful))
        }
        TlsMode::Mtls {
            server_cert,
            server_key,
            client_ca,
            trust_domain,
            environment,
            reload,
        } => {
            let read = |key: &'static str, path: &std::path::Path| {
                std::fs::read(path)
                    .map_err(|e| StartError::Tls(format!("{key}: {}: {e}", path.display())))
            };
            let files = workload_identity::reload::TlsPaths {
                ca: client_ca.clone(),
                cert: server_cert.clone(),
                key: server_key.clone(),
            };
            let material = workload_identity::HostTls::from_pem(
                &read("controlPlane.tls.clientCA", client_ca)?,
                &read("controlPlane.tls.serverCert", server_cert)?,
                &read("controlPlane.tls.serverKey", server_key)?,
            )
            .map_err(|e| {
                StartError::Tls(match e {
                    workload_identity::MaterialError::Ca(why) => {
                        format!("controlPlane.tls.clientCA: {why}")
                    }
                    workload_identity::MaterialError::Key(why) => {
                        format!("controlPlane.tls.serverKey: {why}")
                    }
                    other => format!("controlPlane.tls.serverCert: {other}"),
                })
            })?;
            let tls = material
                .server_config(&[b"h2"])
                .map_err(|e| StartError::Tls(format!("controlPlane.tls: {e}")))?;
            if let Some(every) = reload {
                // New handshakes use rewritten files; the task ends with the lifecycle.
                workload_identity::reload::spawn(
                    material,
                    files,
                    *every,
                    "proxypool-controller",
                    hard_stop.child_token(),
                );
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
            let incoming = crate::tls::incoming(
                listener,
                acceptor,
                trust_domain.clone(),
                environment.clone(),
            );
            let incoming = stoppable(incoming, hard_stop.clone(), pings);
            Box::pin(router.serve_with_incoming_shutdown(incoming, graceful))
        }
    };

    // Admin endpoints.
    let admin_addr;
    let admin: std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send>> =
        match config.admin {
            Some(addr) => {
                let l = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| StartError::Listen(addr, e.to_string()))?;
                admin_addr = l.local_addr().ok();
                Box::pin(crate::admin::serve(
                    l,
                    store,
                    metrics.clone(),
                    ready_rx.clone(),
                ))
            }
            None => {
                admin_addr = None;
                Box::pin(std::future::pending())
            }
        };

    let shutdown_timeout = config.shutdown_timeout;
    let task = tokio::spawn(async move {
        let _monitor = AbortOnDrop(monitor);
        // However the lifecycle ends, no connection outlives it.
        let _hard_stop_on_exit = hard_stop.clone().drop_guard();
        let mut server = server;
        let mut admin = admin;
        tokio::select! {
            r = &mut server => {
                let _ = ready_tx.send(false);
                return r.map_err(|e| format!("grpc server: {e}"));
            }
            r = &mut admin => {
                let _ = ready_tx.send(false);
                return r;
            }
            () = shutdown => {}
        }
        // Not ready, not serving; stop accepting; bounded graceful stop; then hard stop.
        let _ = ready_tx.send(false);
        set_health(&health, false).await;
        let _ = graceful_tx.send(());
        match tokio::time::timeout(shutdown_timeout, &mut server).await {
            Ok(r) => r.map_err(|e| format!("grpc server: {e}")),
            Err(_) => {
                tracing::warn!("graceful stop timed out; dropping connections");
                hard_stop.cancel();
                Ok(())
            }
        }
    });
    Ok(Running {
        grpc_addr,
        admin_addr,
        metrics,
        ready: ready_rx,
        task,
    })
}

/// Sets the health of the server (`""`) and of the worker control plane.
async fn set_health(health: &tonic_health::server::HealthReporter, serving: bool) {
    let status = if serving {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    health.set_service_status("", status).await;
    if serving {
        health
            .set_serving::<WorkerControlPlaneServer<Controller>>()
            .await;
    } else {
        health
            .set_not_serving::<WorkerControlPlaneServer<Controller>>()
            .await;
    }
}

/// Keeps gRPC health equal to readiness: serving while not shutting down and the store answers
/// a probe in time. Logs each change once.
async fn health_monitor(
    health: tonic_health::server::HealthReporter,
    store: Arc<dyn ControlStore>,
    ready: watch::Receiver<bool>,
) {
    let mut serving = true;
    let mut tick = tokio::time::interval(HEALTH_PROBE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let reachable = matches!(
            tokio::time::timeout(HEALTH_PROBE_TIMEOUT, store.current_ownership_epoch()).await,
            Ok(Ok(_))
        );
        let now = reachable && *ready.borrow();
        if now != serving {
            serving = now;
            if reachable {
                tracing::info!(target: "proxypool_controller", event = "health_serving", "store reachable again: health SERVING");
            } else {
                tracing::warn!(target: "proxypool_controller", event = "health_not_serving", "store unreachable: health NOT_SERVING");
            }
            set_health(&health, serving).await;
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Wraps the gRPC router: tonic refuses a request message over the decoding limit with
/// `OUT_OF_RANGE`; the gRPC status code table's code for "message larger than the configured
/// limit" is `RESOURCE_EXHAUSTED`. Only that one refusal (its status, in a trailers-only
/// response, with tonic's message) is changed; every other answer passes untouched.
#[derive(Clone, Debug)]
pub struct OversizeStatus<S>(S);

/// tonic's message for the refusal, percent-encoded as it is in `grpc-message`.
const TONIC_OVERSIZE: &str = "Error,%20decoded%20message%20length%20too%20large";

impl<S, ReqBody, ResBody> tower_service::Service<http::Request<ReqBody>> for OversizeStatus<S>
where
    S: tower_service::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let response = self.0.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            let headers = response.headers_mut();
            let oversize = headers.get("grpc-status").is_some_and(|v| v == "11")
                && headers
                    .get("grpc-message")
                    .is_some_and(|v| v.as_bytes().starts_with(TONIC_OVERSIZE.as_bytes()));
            if oversize {
                headers.insert(
                    "grpc-status",
                    http::HeaderValue::from(tonic::Code::ResourceExhausted as i32),
                );
            }
            Ok(response)
        })
    }
}

/// `incoming` with every connection tied to `stop` (see [`Stoppable`]).
fn stoppable<S, T, E>(
    incoming: S,
    stop: tokio_util::sync::CancellationToken,
    pings: Option<crate::keepalive::PingPolicy>,
) -> impl tokio_stream::Stream<Item = Result<Stoppable<T>, E>>
where
    S: tokio_stream::Stream<Item = Result<T, E>>,
{
    tokio_stream::StreamExt::map(incoming, move |r| {
        r.map(|io| Stoppable {
            io,
            stop: Box::pin(stop.clone().cancelled_owned()),
            pings: pings.map(crate::keepalive::PingScanner::new),
        })
    })
}

/// A connection that fails its next read or write once the hard stop is cancelled. The stop
/// future is polled on every read and write, so the connection task is woken by the stop itself
/// even while idle; hyper then closes the connection and resets its streams. Its reads also
/// go through the keepalive enforcement ([`crate::keepalive`]): a read that completes a
/// PING too many fails, and hyper closes the connection.
struct Stoppable<T> {
    io: T,
    stop: std::pin::Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    pings: Option<crate::keepalive::PingScanner>,
}

impl<T> Stoppable<T> {
    fn stopped(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        self.stop.as_mut().poll(cx).is_ready()
    }
}

fn hard_stopped() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "controller stopped")
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Stoppable<T> {
    type ConnectInfo = T::ConnectInfo;
    fn connect_info(&self) -> T::ConnectInfo {
        self.io.connect_info()
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Stoppable<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.stopped(cx) {
            return std::task::Poll::Ready(Err(hard_stopped()));
        }
        let before = buf.filled().len();
        let read = std::pin::Pin::new(&mut self.io).poll_read(cx, buf);
        if let (std::task::Poll::Ready(Ok(())), Some(pings)) = (&read, self.pings.as_mut())
            && pings
                .feed(&buf.filled()[before..], std::time::Instant::now())
                .is_err()
        {
            tracing::info!(
                target: "proxypool_controller",
                event = "too_many_pings",
                "a client pinged more often than controlPlane.minPingInterval; connection closed"
            );
            return std::task::Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                crate::keepalive::TooManyPings,
            )));
        }
        read
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Stoppable<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.stopped(cx) {
            return std::task::Poll::Ready(Err(hard_stopped()));
        }
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.stopped(cx) {
            return std::task::Poll::Ready(Err(hard_stopped()));
        }
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
