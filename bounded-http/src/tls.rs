//! The one bounded TLS accept loop (feature `tls`): the Edge's Node listener, the Control
//! Plane's Edge listener and the proxy-pool controller's worker listener all accept through
//! [`TlsAccept`].
//!
//! What it bounds, and how:
//!
//! - **Handshakes in progress** ([`TlsLimits::max_handshakes`]): at the cap the loop stops
//!   calling `accept`, so further connections wait in the kernel's listen backlog (no
//!   descriptor, no state here) instead of being closed and retrying a whole reconnect interval
//!   later. A connection handed in by an embedder ([`TlsAccept::serve`]) waits for a slot the
//!   same way; [`TlsAccept::try_serve`] closes it at once instead.
//! - **Per source address** ([`TlsLimits::max_handshakes_per_ip`]): one address cannot take
//!   every slot; over its share a connection is closed at once.
//! - **Time**: the handshake has [`TlsLimits::handshake_timeout`].
//! - **The slot's life**: the handler receives the connection's [`Slot`] and drops it when the
//!   connection is authenticated by its own protocol (the Edge right after the handshake, since
//!   registration has its own deadline; the Control Plane after the hello), so silent peers
//!   that finished TLS still count.
//! - **Accept errors** (an exhausted fd table): backed off 50 ms, never spun on.
//! - **Logs**: every refusal is reported to [`TlsEvents`] (metrics) and logged at most once per
//!   10 s with the count of what was suppressed ([`RateLimited`]); the detail is the rustls
//!   error or the limit, never certificate or key bytes.
//!
//! `TCP_NODELAY` is set on every accepted connection: these links carry small frames.
//!
//! ```no_run
//! # async fn example(acceptor: tokio_rustls::TlsAcceptor) -> std::io::Result<()> {
//! use bounded_http::tls::{TlsAccept, TlsLimits};
//! let accept = TlsAccept::new(acceptor, TlsLimits::default(), None, "worker");
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:7443").await?;
//! accept
//!     .run(listener, std::future::pending(), |tls, peer, slot| async move {
//!         drop(slot); // authenticated by the handshake
//!         let _ = (tls, peer); // serve the connection
//!     })
//!     .await;
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::RateLimited;

/// The limits of a [`TlsAccept`].
#[derive(Clone, Copy, Debug)]
pub struct TlsLimits {
    /// Connections between accept and the handler's release of their [`Slot`], at most.
    pub max_handshakes: usize,
    /// Of those, from one source address at most (`usize::MAX`: no per-address cap).
    pub max_handshakes_per_ip: usize,
    /// Time for the TLS handshake.
    pub handshake_timeout: Duration,
}

impl Default for TlsLimits {
    fn default() -> Self {
        Self {
            max_handshakes: 256,
            max_handshakes_per_ip: usize::MAX,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a connection was closed before its handler ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TlsRefusal {
    /// Every slot was taken ([`TlsAccept::try_serve`] only; the listener waits instead).
    Capacity,
    /// The source address had its share of slots.
    PerIp,
    /// The handshake did not finish within [`TlsLimits::handshake_timeout`].
    HandshakeTimeout,
    /// The handshake failed (wrong CA, role, name or protocol, or an aborted attempt).
    HandshakeFailed,
}

impl TlsRefusal {
    /// A stable name (a metric label value).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Capacity => "capacity",
            Self::PerIp => "per_ip",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::HandshakeFailed => "handshake_failed",
        }
    }
}

/// What a [`TlsAccept`] reports to its owner's metrics. Every method defaults to nothing.
pub trait TlsEvents: Send + Sync {
    /// `accept` failed (for example, out of file descriptors).
    fn accept_error(&self) {}
    /// A connection was closed before its handler ran.
    fn refused(&self, _reason: TlsRefusal) {}
}

/// A connection's place among the handshakes in progress (and its address's share); freed
/// when dropped. See the module docs for when a handler drops it.
#[derive(Debug)]
pub struct Slot {
    accept: Arc<TlsAccept>,
    ip: IpAddr,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut per_ip = self.accept.per_ip();
        if let Some(n) = per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                per_ip.remove(&self.ip);
            }
        }
    }
}

/// A bounded TLS acceptor. See the module docs.
pub struct TlsAccept {
    acceptor: TlsAcceptor,
    limits: TlsLimits,
    events: Option<Arc<dyn TlsEvents>>,
    what: &'static str,
    permits: Arc<Semaphore>,
    per_ip: Mutex<HashMap<IpAddr, usize>>,
    refusal_log: Mutex<RateLimited>,
}

impl std::fmt::Debug for TlsAccept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsAccept")
            .field("what", &self.what)
            .field("limits", &self.limits)
            .field("available", &self.permits.available_permits())
            .finish_non_exhaustive()
    }
}

impl TlsAccept {
    /// An acceptor handing out at most `limits` slots. `what` names the peers in log lines
    /// ("node" logs "node connection refused"); `events` counts refusals and accept errors.
    pub fn new(
        acceptor: TlsAcceptor,
        limits: TlsLimits,
        events: Option<Arc<dyn TlsEvents>>,
        what: &'static str,
    ) -> Arc<Self> {
        Arc::new(Self {
            acceptor,
            limits: TlsLimits {
                max_handshakes: limits.max_handshakes.max(1),
                max_handshakes_per_ip: limits.max_handshakes_per_ip.max(1),
                ..limits
            },
            events,
            what,
            permits: Arc::new(Semaphore::new(limits.max_handshakes.max(1))),
            per_ip: Mutex::new(HashMap::new()),
            refusal_log: Mutex::new(RateLimited::new(Duration::from_secs(10))),
        })
    }

    /// The limits in force.
    pub fn limits(&self) -> TlsLimits {
        self.limits
    }

    /// Slots free now ([`TlsAccept::run`] holds one while it waits in `accept`).
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }

    /// Accepts on `listener` until `stop` completes: waits for a slot before each `accept`,
    /// applies the per-address cap, sets `TCP_NODELAY`, and runs the handshake and then
    /// `handler` on a task of the connection's own.
    pub async fn run<F, Fut>(
        self: Arc<Self>,
        listener: TcpListener,
        stop: impl Future<Output = ()>,
        handler: F,
    ) where
        F: Fn(TlsStream<TcpStream>, SocketAddr, Slot) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let mut errors = RateLimited::new(Duration::from_secs(10));
        tokio::pin!(stop);
        loop {
            let permit = tokio::select! {
                permit = self.permits.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
                () = &mut stop => return,
            };
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        if let Some(events) = &self.events {
                            events.accept_error();
                        }
                        if let Some(suppressed) = errors.hit() {
                            tracing::warn!(error = %e, suppressed, "{} listener: accept failed; backing off", self.what);
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = &mut stop => return,
            };
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection failed");
            }
            self.start(permit, tcp, peer, handler.clone());
        }
    }

    /// Serves one connection accepted elsewhere (another kind of listener, socket activation,
    /// a simulated network) exactly as [`TlsAccept::run`] does: waits for a slot, then applies
    /// the per-address cap, the handshake and its timeout, and runs `handler` (spawned; this
    /// returns once the connection has its slot or was refused).
    pub async fn serve<S, F, Fut>(self: &Arc<Self>, stream: S, peer: SocketAddr, handler: F)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        F: FnOnce(TlsStream<S>, SocketAddr, Slot) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Ok(permit) = self.permits.clone().acquire_owned().await else {
            return;
        };
        self.start(permit, stream, peer, handler);
    }

    /// [`TlsAccept::serve`] without waiting: with every slot taken the connection is closed at
    /// once ([`TlsRefusal::Capacity`]).
    pub fn try_serve<S, F, Fut>(self: &Arc<Self>, stream: S, peer: SocketAddr, handler: F)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        F: FnOnce(TlsStream<S>, SocketAddr, Slot) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => self.start(permit, stream, peer, handler),
            Err(_) => {
                drop(stream);
                self.refused(TlsRefusal::Capacity, peer, "every handshake slot is taken");
            }
        }
    }

    fn start<S, F, Fut>(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
        stream: S,
        peer: SocketAddr,
        handler: F,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        F: FnOnce(TlsStream<S>, SocketAddr, Slot) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let slot = match self.admit(permit, peer.ip()) {
            Ok(slot) => slot,
            Err(reason) => {
                // Closed at once: a flood from one address costs no handshake state.
                drop(stream);
                self.refused(reason, peer, "per-address handshake cap reached");
                return;
            }
        };
        let this = self.clone();
        tokio::spawn(async move {
            let timeout = this.limits.handshake_timeout;
            let tls = match tokio::time::timeout(timeout, this.acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    this.refused(TlsRefusal::HandshakeFailed, peer, &e.to_string());
                    return;
                }
                Err(_) => {
                    this.refused(
                        TlsRefusal::HandshakeTimeout,
                        peer,
                        "tls handshake timed out",
                    );
                    return;
                }
            };
            handler(tls, peer, slot).await;
        });
    }

    fn per_ip(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.per_ip
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn admit(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
        ip: IpAddr,
    ) -> Result<Slot, TlsRefusal> {
        let mut per_ip = self.per_ip();
        let n = per_ip.entry(ip).or_insert(0);
        if *n >= self.limits.max_handshakes_per_ip {
            return Err(TlsRefusal::PerIp);
        }
        *n += 1;
        Ok(Slot {
            accept: self.clone(),
            ip,
            _permit: permit,
        })
    }

    /// Counts a refusal; logs one line per 10 s at most.
    fn refused(&self, reason: TlsRefusal, peer: SocketAddr, detail: &str) {
        if let Some(events) = &self.events {
            events.refused(reason);
        }
        let hit = self
            .refusal_log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .hit();
        if let Some(suppressed) = hit {
            tracing::info!(
                %peer,
                reason = reason.as_str(),
                detail,
                suppressed,
                "{} connection refused (at most one line per 10 s)",
                self.what
            );
        }
    }
}
