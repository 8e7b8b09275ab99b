//! One hardened HTTP server for every listener of the workspace: the Edge's API, the Control
//! Plane's admin API, the proxy-pool controller's admin endpoints and the OrbitMesh control
//! plane.
//!
//! [`serve_with`] serves an axum `Router` on a `TcpListener` with what a bare `axum::serve`
//! leaves out, each bounded: a cap on open connections (more are closed at once), a deadline
//! for the first byte and then for each request's headers (slowloris; also the HTTP/1.1
//! keep-alive idle limit), HTTP/2 keep-alive pings and a stream cap, `TCP_NODELAY`, accept
//! errors (an exhausted fd table) backed off instead of spun on, every repeated refusal or
//! error logged at most once per 10 s with the count of what it stands for ([`RateLimited`]),
//! and a graceful stop that finishes open requests. A request body deadline belongs to the
//! router (the Edge's reads the whole body within its own limit).
//!
//! [`admin`] is the guard of the operators' pages (an admin token, a strict
//! Content-Security-Policy and the headers that go with it).
//!
//! With feature `redis`, `redis::Connection` is one Redis server or a Redis Cluster behind
//! one connection type with bounded calls (the Edge's shared rate limits and the proxy-pool
//! controller's store use it).
//!
//! With feature `tls`, `tls::TlsAccept` is the one bounded TLS accept loop of the workspace's
//! mTLS listeners (the Edge's Node listener, the Control Plane's Edge listener, the proxy-pool
//! controller's worker listener): handshake caps in total and per address, a handshake
//! deadline, backed-off accept errors and rate-limited refusal logs.
//!
//! ```no_run
//! # async fn example() -> std::io::Result<()> {
//! let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! bounded_http::serve_with(listener, app, bounded_http::ServeLimits::default(), None, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;

pub mod admin;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "tls")]
pub mod tls;

/// What a server reports to its owner's metrics. Every method defaults to nothing.
pub trait ServeEvents: Send + Sync {
    /// `accept` failed (for example, out of file descriptors).
    fn accept_error(&self) {}
    /// A connection was closed at once: [`ServeLimits::max_connections`] were open.
    fn connection_refused(&self) {}
}

/// Connection-level limits of [`serve_with`].
#[derive(Clone, Copy, Debug)]
pub struct ServeLimits {
    /// Open connections at most; more are closed at once (and reported to
    /// [`ServeEvents::connection_refused`]).
    pub max_connections: usize,
    /// Time to receive a request's headers, counted from when the connection starts waiting
    /// for them: a slowloris client is cut off, and it is also the idle keep-alive timeout of an
    /// HTTP/1.1 connection between requests.
    pub header_timeout: Duration,
    /// HTTP/2: a connection whose peer does not answer a ping within this is closed.
    pub h2_keep_alive: Duration,
    /// HTTP/2: concurrent streams per connection.
    pub h2_max_streams: u32,
    /// After `shutdown`, how long the requests in flight (a streamed answer included) may
    /// take to finish; then [`serve_with`] returns, and the connections still open end with
    /// their tasks (at the latest when the runtime stops).
    pub drain_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            header_timeout: Duration::from_secs(30),
            h2_keep_alive: Duration::from_secs(30),
            h2_max_streams: 256,
            drain_timeout: Duration::from_secs(30),
        }
    }
}

/// Serves `router` on `listener` until `shutdown` completes (then finishes in-flight
/// requests), with `TCP_NODELAY` on every accepted connection.
///
/// Use this rather than a bare `axum::serve`: a passthrough stream writes each provider chunk
/// as it arrives, and with Nagle's algorithm on, the second small write of a response waits for
/// the client's delayed ACK — measured here as +44 ms at p99 and 1.3k instead of 3.4k+ requests/s
/// (the workspace's `benches/README.md`, `http_load`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, router, ServeLimits::default(), None, shutdown).await
}

/// [`serve`] with explicit connection limits; `events` counts refusals and accept errors.
///
/// HTTP/1.1 and HTTP/2 (prior knowledge) on one listener (hyper-util's auto server): every
/// connection is counted against [`ServeLimits::max_connections`] (over it: closed at once),
/// has [`ServeLimits::header_timeout`] to send its first byte and then each request's headers,
/// and gets `TCP_NODELAY`. An `accept` error (e.g. out of file descriptors) backs off 50 ms and is
/// logged at most once per 10 s. On `shutdown` no new connection is accepted and the ones
/// open finish their requests, for at most [`ServeLimits::drain_timeout`] (HTTP/1.1
/// connections close after their request in flight; HTTP/2 ones get a GOAWAY).
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ServeLimits,
    events: Option<Arc<dyn ServeEvents>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto;
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.h2_keep_alive)
        .keep_alive_timeout(limits.h2_keep_alive)
        .max_concurrent_streams(limits.h2_max_streams);
    let mut errors = RateLimited::new(Duration::from_secs(10));
    let mut refusals = RateLimited::new(Duration::from_secs(10));
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    if let Some(e) = &events {
                        e.accept_error();
                    }
                    if let Some(suppressed) = errors.hit() {
                        tracing::warn!(error = %e, suppressed, "http listener: accept failed; backing off");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            drop(tcp);
            if let Some(e) = &events {
                e.connection_refused();
            }
            if let Some(suppressed) = refusals.hit() {
                tracing::warn!(%peer, suppressed, max = limits.max_connections, "http connection cap reached; closing new connections");
            }
            continue;
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection failed");
        }
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let header_timeout = limits.header_timeout;
        tokio::spawn(async move {
            // The first bytes decide HTTP/1 or HTTP/2 before hyper's header timeout runs: a
            // connection that sends nothing must not wait there forever.
            let mut first = [0u8; 1];
            if !matches!(
                tokio::time::timeout(header_timeout, tcp.peek(&mut first)).await,
                Ok(Ok(1..))
            ) {
                return;
            }
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(tcp), service);
            let _ = watcher.watch(conn.into_owned()).await;
            drop(permit);
        });
    }
    let open = limits.max_connections - permits.available_permits();
    if tokio::time::timeout(limits.drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        let left = limits.max_connections - permits.available_permits();
        tracing::warn!(
            open_at_shutdown = open,
            left,
            drain_timeout_ms = u64::try_from(limits.drain_timeout.as_millis()).unwrap_or(u64::MAX),
            "http: the drain bound was reached with connections still open; they end now"
        );
    } else {
        tracing::info!(open_at_shutdown = open, "http: drained");
    }
    Ok(())
}

// === rate-limited logging ===

/// One repeated event's logging state.
#[derive(Debug)]
pub struct RateLimited {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimited {
    /// At most one line per `every`.
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// An occurrence: `Some(n)` when it should be logged (`n` occurrences were suppressed since
    /// the last line), `None` when it is counted only.
    pub fn hit(&mut self) -> Option<u64> {
        let now = Instant::now();
        match self.last {
            Some(last) if now.duration_since(last) < self.every => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_period_with_the_count() {
        let mut r = RateLimited::new(Duration::from_secs(3600));
        assert_eq!(r.hit(), Some(0));
        for _ in 0..5 {
            assert_eq!(r.hit(), None);
        }
        let mut r = RateLimited::new(Duration::ZERO);
        assert_eq!(r.hit(), Some(0));
        assert_eq!(r.hit(), Some(0));
    }
}
