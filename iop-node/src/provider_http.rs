//! The Node's HTTP client to its providers (the `openai_compat` tunnel, the `ollama` run, the
//! health probes): hyper's connections over hyper-rustls's connector, pooled here, without
//! reqwest's client layers or hyper-util's pool.
//!
//! Why not reqwest: a tunnel is a proxy, and reqwest is a user agent. It follows redirects (a
//! provider's `3xx` must reach the caller as it came; following it would also carry a
//! credential header reqwest does not strip, such as `x-api-key`, wherever the provider
//! points), it retries, and per request it re-parses the URL and wraps the response; those
//! layers were about a tenth of the Node's CPU per tunnel (`benches/README.md`, proc_load).
//!
//! Why not hyper-util's pooled client (used until issue #33's fifteenth stop): it runs every
//! HTTP/1.1 connection in a task of its own, so each exchange crossed between tasks twice (the
//! request to the connection's task, the response head and each body piece back), and a
//! wake-up on this kind of machine costs more than the work it carries. Here an HTTP/1.1
//! connection is polled by the task of the exchange that uses it, for the response's head and
//! the first [`INLINE_BODY`] bytes of its body (an ordinary JSON answer, or a whole chat
//! stream of a few KiB): the provider's bytes wake that task directly, and the connection
//! goes back to the pool when the response was read to the end. Past those bytes a long body
//! is handed to a task of the connection's, as hyper-util did, which puts the connection back
//! once hyper wants the next request: reading the socket then overlaps with framing on the
//! other core, and reads stay as small as what arrived (read in the exchange's task to the
//! end, a bulk body ran 15 % slower, and a stalled tunnel's reads grew to hyper's 400 KB
//! buffer and pinned it: a memory test's peak rose from 2.3–2.6 to 2.6–3.3 MiB; handed off
//! from the head on, a small chunked stream took 0.09 ms longer through the mesh). A response
//! dropped before its end, `connection: close`, or a connection that ended is not reused.
//! Before an idle connection is reused it is polled once with a waker that does nothing,
//! which reads a close the provider sent while it sat idle; a request the connection gives
//! back unsent is sent again on a new one, as hyper-util retried it. HTTP/2 (an `https`
//! origin that chose it by ALPN) keeps one shared connection per origin, driven by its own
//! task as before: its streams belong to many exchanges at once. The Node's CPU per request
//! fell by a tenth to a quarter in interleaved open-loop runs, and its instructions per
//! request by 11 % (`benches/README.md`, fifteenth stop).
//!
//! What is kept: connection pooling and keep-alive (idle connections closed after
//! [`POOL_IDLE`], at most [`MAX_IDLE`] per origin), HTTP/2 by ALPN on `https` upstreams,
//! TCP_NODELAY, TLS with the platform's verifier (ring provider), the `Host` header and the
//! origin-form request line as hyper-util wrote them, and a deadline over the whole exchange
//! (connecting, headers and body), as reqwest's `timeout` was. A base URL is parsed once; a
//! request only parses its path. An idle connection the provider closed is closed on the
//! Node's side when the next exchange looks at it or at the pool's next sweep (every
//! [`SWEEP_EVERY`], by a task the first released connection starts), so its socket waits in
//! `CLOSE_WAIT` for seconds, not until traffic resumes.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use http::uri::{Authority, PathAndQuery, Scheme};
use http_body_util::Full;
use hyper::body::Body as _;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::{Connection as _, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower_service::Service as _;

use crate::adapter::AdapterError;

/// Idle keep-alive connections to a provider are closed after this long.
pub(crate) const POOL_IDLE: Duration = Duration::from_secs(90);

/// Why an exchange with a provider failed; the stable text goes on the wire (never the
/// provider's own error text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HttpFailure {
    /// The deadline passed.
    Timeout,
    /// No connection (refused, DNS, TLS).
    Connect,
    /// The response body broke off.
    Body,
    /// The request could not be sent or the response was not HTTP.
    Request,
}

impl HttpFailure {
    pub(crate) fn text(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Connect => "connect failed",
            Self::Body => "response body failed",
            Self::Request => "request failed",
        }
    }
}

impl From<HttpFailure> for AdapterError {
    fn from(f: HttpFailure) -> Self {
        Self::Provider(f.text().to_owned())
    }
}

/// A provider's base URL, parsed once.
#[derive(Clone, Debug)]
pub(crate) struct BaseUrl {
    scheme: Scheme,
    authority: Authority,
    /// The base path without a trailing `/` (`/v1`, or empty).
    path: String,
}

impl BaseUrl {
    /// `key` names the setting in errors.
    pub(crate) fn parse(key: &str, base_url: &str) -> Result<Self, String> {
        let invalid = || format!("{key} is not a valid URL");
        let uri: http::Uri = base_url
            .trim_end_matches('/')
            .parse()
            .map_err(|_| invalid())?;
        let scheme = uri.scheme().cloned().ok_or_else(invalid)?;
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(format!("{key} must be http or https"));
        }
        let authority = uri.authority().cloned().ok_or_else(invalid)?;
        if uri.query().is_some() {
            return Err(format!("{key} must not have a query"));
        }
        Ok(Self {
            scheme,
            authority,
            path: uri.path().trim_end_matches('/').to_owned(),
        })
    }

    /// The URI of `path` (which may carry a `?query`) under this base.
    pub(crate) fn join(&self, path: &str) -> Result<http::Uri, AdapterError> {
        let invalid = || AdapterError::InvalidInput("path");
        if !path.starts_with('/') {
            return Err(invalid());
        }
        let pq = PathAndQuery::from_maybe_shared(format!("{}{path}", self.path))
            .map_err(|_| invalid())?;
        http::Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
            .map_err(|_| invalid())
    }
}

/// A pooled client for one adapter instance.
#[derive(Clone, Debug)]
pub(crate) struct ProviderHttp {
    connector: HttpsConnector<HttpConnector>,
    pool: Arc<Pool>,
    /// The deadline of an exchange unless the request names its own.
    timeout: Option<Duration>,
}

/// The connection an HTTP/1.1 exchange drives itself.
type Io = MaybeHttpsStream<TokioIo<TcpStream>>;
/// Boxed once when it is made: the connection (1.7 KB of hyper's state) then moves between
/// the pool and an exchange as a pointer, and the futures that hold it stay small.
type H1Conn = Box<http1::Connection<Io, Full<Bytes>>>;
type H1Send = http1::SendRequest<Full<Bytes>>;
type H2Send = http2::SendRequest<Full<Bytes>>;

/// Idle connections by origin (a Node's adapter talks to one origin, its base URL's; the
/// list is scanned, not hashed).
#[derive(Debug, Default)]
struct Pool {
    origins: Mutex<Vec<Origin>>,
    /// Whether the sweeping task runs (the first connection released starts it).
    sweeping: AtomicBool,
}

/// How often idle connections are looked at while no exchange does: those the provider
/// closed (their sockets would wait in `CLOSE_WAIT`) and those idle past [`POOL_IDLE`] are
/// closed.
const SWEEP_EVERY: Duration = Duration::from_secs(15);

#[derive(Debug)]
struct Origin {
    scheme: Scheme,
    authority: Authority,
    /// The `Host` header of an HTTP/1.1 request to this origin.
    host: HeaderValue,
    /// Idle HTTP/1.1 connections, the most recently used last.
    idle: Vec<Idle>,
    /// The HTTP/2 connection, when the origin chose HTTP/2 by ALPN (shared by all exchanges).
    h2: Option<H2Send>,
}

#[derive(Debug)]
struct Idle {
    conn: H1Conn,
    send: H1Send,
    since: Instant,
}

/// An HTTP/1.1 connection driven by the exchange that uses it: its socket wakes the task that
/// reads the response, with no connection task between them.
#[derive(Debug)]
struct Driven {
    conn: H1Conn,
    send: H1Send,
    /// The connection future finished (closed or failed); it is not polled again.
    finished: bool,
    pool: Arc<Pool>,
    origin: (Scheme, Authority),
}

impl Driven {
    /// Polls the connection unless it finished.
    fn drive(&mut self, cx: &mut Context<'_>) {
        if !self.finished && Pin::new(&mut self.conn).poll(cx).is_ready() {
            self.finished = true;
        }
    }

    /// The rest of the exchange to a task of the connection's: it polls the connection while
    /// the body is read elsewhere, and puts it back in the pool once hyper wants the next
    /// request (the body was read to its end); a body dropped before its end closes it.
    fn hand_off(mut self) {
        tokio::spawn(async move {
            let idle = std::future::poll_fn(|cx| {
                if Pin::new(&mut *self.conn).poll(cx).is_ready() {
                    return Poll::Ready(false);
                }
                self.send.poll_ready(cx).map(|r| r.is_ok())
            })
            .await;
            if idle {
                self.release();
            }
        });
    }

    /// Back to the pool, after a response read to its end.
    fn release(self) {
        if self.finished {
            return;
        }
        // Connections idle too long or closed by the provider go at the pool's sweep.
        self.pool.sweep_from_now_on();
        let mut origins = self.pool.lock();
        if let Some(o) = origins
            .iter_mut()
            .find(|o| o.scheme == self.origin.0 && o.authority == self.origin.1)
            && o.idle.len() < MAX_IDLE
        {
            o.idle.push(Idle {
                conn: self.conn,
                send: self.send,
                since: Instant::now(),
            });
        }
    }
}

impl Idle {
    /// Not idle past [`POOL_IDLE`] and not closed by the provider: one poll with a waker that
    /// does nothing reads a close that arrived (and moves the connection to idle if it was not
    /// yet).
    fn usable(&mut self, now: Instant) -> bool {
        now.saturating_duration_since(self.since) < POOL_IDLE
            && Pin::new(&mut *self.conn)
                .poll(&mut Context::from_waker(std::task::Waker::noop()))
                .is_pending()
    }
}

/// Idle HTTP/1.1 connections kept per origin; more are closed when released.
const MAX_IDLE: usize = 256;

/// The first this many bytes of a response body are read by the exchange's own task; the
/// rest of a longer body by a task of the connection's.
const INLINE_BODY: u64 = 64 << 10;

impl Pool {
    /// Starts the task that sweeps this pool every [`SWEEP_EVERY`] (once; it ends when the
    /// pool is dropped).
    fn sweep_from_now_on(self: &Arc<Self>) {
        if self.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let pool = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut every = tokio::time::interval_at(Instant::now() + SWEEP_EVERY, SWEEP_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(pool) = pool.upgrade() else { return };
                pool.sweep();
            }
        });
    }

    /// Closes the idle connections the provider closed or that idled past [`POOL_IDLE`]:
    /// one poll each with a waker that does nothing reads a close that arrived.
    fn sweep(&self) {
        let now = Instant::now();
        for o in self.lock().iter_mut() {
            o.idle.retain_mut(|i| i.usable(now));
            if o.h2.as_ref().is_some_and(H2Send::is_closed) {
                o.h2 = None;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Origin>> {
        self.origins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An idle HTTP/1.1 connection to the origin that is still open and ready, or the shared
    /// HTTP/2 one.
    fn checkout(&self, scheme: &Scheme, authority: &Authority) -> Option<Checkout> {
        let now = Instant::now();
        loop {
            let mut idle = {
                let mut origins = self.lock();
                let o = origins
                    .iter_mut()
                    .find(|o| &o.scheme == scheme && &o.authority == authority)?;
                if let Some(h2) = &o.h2 {
                    if !h2.is_closed() {
                        return Some(Checkout::H2(h2.clone()));
                    }
                    o.h2 = None;
                }
                o.idle.pop()?
            };
            if idle.usable(now) && idle.send.is_ready() {
                // This exchange's task polls it from here on.
                return Some(Checkout::H1(idle.conn, idle.send));
            }
        }
    }

    /// Records the origin (once) and, for HTTP/2, its connection.
    fn register(&self, scheme: &Scheme, authority: &Authority, h2: Option<H2Send>) -> HeaderValue {
        let mut origins = self.lock();
        let i = match origins
            .iter()
            .position(|o| &o.scheme == scheme && &o.authority == authority)
        {
            Some(i) => i,
            None => {
                origins.push(Origin {
                    scheme: scheme.clone(),
                    authority: authority.clone(),
                    host: host_header(scheme, authority),
                    idle: Vec::new(),
                    h2: None,
                });
                origins.len() - 1
            }
        };
        if h2.is_some() {
            origins[i].h2 = h2;
        }
        origins[i].host.clone()
    }
}

enum Checkout {
    H1(H1Conn, H1Send),
    H2(H2Send),
}

/// `Host` as hyper-util's client writes it: the port only when it is not the scheme's.
fn host_header(scheme: &Scheme, authority: &Authority) -> HeaderValue {
    let default = if *scheme == Scheme::HTTPS { 443 } else { 80 };
    let value = match authority.port_u16() {
        Some(p) if p != default => format!("{}:{p}", authority.host()),
        _ => authority.host().to_owned(),
    };
    HeaderValue::from_str(&value).unwrap_or_else(|_| HeaderValue::from_static(""))
}

impl ProviderHttp {
    /// A client verifying servers with the platform's verifier.
    pub(crate) fn new(timeout: Option<Duration>) -> Result<Self, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls_platform_verifier::Verifier::new(provider.clone())
            .map_err(|_| "platform certificate verifier unavailable".to_owned())?;
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|_| "TLS configuration failed".to_owned())?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        Ok(Self::with_tls(tls, timeout))
    }

    /// A client verifying servers with `tls` (ALPN is set here).
    fn with_tls(tls: rustls::ClientConfig, timeout: Option<Duration>) -> Self {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(http);
        Self {
            connector,
            pool: Arc::default(),
            timeout,
        }
    }

    /// Sends `request`; the response once its head arrived. The deadline (`timeout`, else the
    /// client's) covers the body too: read it with [`Exchange::chunk`].
    pub(crate) async fn send(
        &self,
        request: http::Request<Full<Bytes>>,
        timeout: Option<Duration>,
    ) -> Result<Exchange, HttpFailure> {
        let deadline = timeout.or(self.timeout).map(|t| Instant::now() + t);
        let sent = self.exchange(request, deadline);
        match deadline {
            Some(d) => tokio::time::timeout_at(d, sent)
                .await
                .map_err(|_| HttpFailure::Timeout)?,
            None => sent.await,
        }
    }

    async fn exchange(
        &self,
        mut request: http::Request<Full<Bytes>>,
        deadline: Option<Instant>,
    ) -> Result<Exchange, HttpFailure> {
        let uri = request.uri().clone();
        let (Some(scheme), Some(authority)) = (uri.scheme(), uri.authority()) else {
            return Err(HttpFailure::Request);
        };
        // A reused HTTP/1.1 connection the provider closed before it read the request gives
        // the request back; it is sent once more on a new connection (as hyper-util's client
        // retries an unstarted request).
        let mut reuse = true;
        loop {
            let checkout = if reuse {
                self.pool.checkout(scheme, authority)
            } else {
                None
            };
            let reused = checkout.is_some();
            let (conn, send) = match checkout {
                // Boxed, as hyper-util boxed its exchanges: an HTTP/1.1 exchange's future
                // need not carry HTTP/2's.
                Some(Checkout::H2(mut h2)) => {
                    return Box::pin(h2_exchange(&mut h2, request, deadline)).await;
                }
                Some(Checkout::H1(conn, send)) => (conn, send),
                // Boxed: connecting (HTTP/2's handshake above all) takes 6.5 KB of state that
                // the common path, a pooled connection, would otherwise carry in its future.
                None => match Box::pin(self.connect(&uri)).await? {
                    Checkout::H2(mut h2) => {
                        self.pool.register(scheme, authority, Some(h2.clone()));
                        return Box::pin(h2_exchange(&mut h2, request, deadline)).await;
                    }
                    Checkout::H1(conn, send) => (conn, send),
                },
            };
            let host = self.pool.register(scheme, authority, None);
            let mut driven = Driven {
                conn,
                send,
                finished: false,
                pool: self.pool.clone(),
                origin: (scheme.clone(), authority.clone()),
            };
            let mut r = request;
            if !r.headers().contains_key(http::header::HOST) {
                r.headers_mut().insert(http::header::HOST, host);
            }
            // HTTP/1.1 sends the origin form: the path and query only.
            *r.uri_mut() = uri.path_and_query().map_or_else(
                || http::Uri::from_static("/"),
                |pq| http::Uri::from(pq.clone()),
            );
            let mut response = std::pin::pin!(driven.send.try_send_request(r));
            let outcome = std::future::poll_fn(|cx| {
                driven.drive(cx);
                match response.as_mut().poll(cx) {
                    Poll::Ready(r) => Poll::Ready(Some(r)),
                    // The connection ended and hyper had no answer for the request: not sent.
                    Poll::Pending if driven.finished => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match outcome {
                Some(Ok(response)) => {
                    return Ok(Exchange {
                        response,
                        deadline,
                        driven: Some(driven),
                        inline_left: INLINE_BODY,
                    });
                }
                Some(Err(mut e)) => match e.take_message() {
                    Some(back) if reused => {
                        request = back;
                        *request.uri_mut() = uri.clone();
                        reuse = false;
                    }
                    _ => return Err(HttpFailure::Request),
                },
                None => return Err(HttpFailure::Request),
            }
        }
    }

    /// A new connection: HTTP/2 when the origin chose it by ALPN (its connection task spawned,
    /// as hyper-util's client does), else HTTP/1.1 driven by the exchange.
    async fn connect(&self, uri: &http::Uri) -> Result<Checkout, HttpFailure> {
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(|_| HttpFailure::Connect)?;
        let io = connector
            .call(uri.clone())
            .await
            .map_err(|_| HttpFailure::Connect)?;
        if io.connected().is_negotiated_h2() {
            let (send, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .handshake(io)
                .await
                .map_err(|_| HttpFailure::Connect)?;
            tokio::spawn(conn);
            return Ok(Checkout::H2(send));
        }
        let (send, conn) = http1::handshake(io)
            .await
            .map_err(|_| HttpFailure::Connect)?;
        Ok(Checkout::H1(Box::new(conn), send))
    }
}

/// One exchange on the shared HTTP/2 connection (absolute-form URI, as hyper-util sends).
async fn h2_exchange(
    h2: &mut H2Send,
    request: http::Request<Full<Bytes>>,
    deadline: Option<Instant>,
) -> Result<Exchange, HttpFailure> {
    h2.ready().await.map_err(|_| HttpFailure::Request)?;
    let response = h2
        .send_request(request)
        .await
        .map_err(|_| HttpFailure::Request)?;
    Ok(Exchange {
        response,
        deadline,
        driven: None,
        inline_left: 0,
    })
}

/// A response being read.
#[derive(Debug)]
pub(crate) struct Exchange {
    response: http::Response<Incoming>,
    deadline: Option<Instant>,
    /// The HTTP/1.1 connection this exchange drives; back to the pool when the body ended.
    driven: Option<Driven>,
    /// Body bytes this task still reads itself before it hands the connection off.
    inline_left: u64,
}

impl Exchange {
    pub(crate) fn status(&self) -> http::StatusCode {
        self.response.status()
    }

    pub(crate) fn headers(&self) -> &http::HeaderMap {
        self.response.headers()
    }

    /// The next piece of the body, `None` at its end.
    pub(crate) async fn chunk(&mut self) -> Option<Result<Bytes, HttpFailure>> {
        loop {
            // A body of known length that has all arrived ends here, without another poll.
            if self.response.body().is_end_stream() {
                self.release();
                return None;
            }
            let frame = std::future::poll_fn(|cx| {
                if let Some(d) = &mut self.driven {
                    d.drive(cx);
                }
                match Pin::new(self.response.body_mut()).poll_frame(cx) {
                    Poll::Pending if self.driven.as_ref().is_some_and(|d| d.finished) => {
                        // The connection ended without ending the body.
                        Poll::Ready(Some(Err(())))
                    }
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(f) => Poll::Ready(f.map(|f| f.map_err(|_| ()))),
                }
            });
            let frame = match self.deadline {
                Some(d) => match tokio::time::timeout_at(d, frame).await {
                    Ok(f) => f,
                    Err(_) => return Some(Err(HttpFailure::Timeout)),
                },
                None => frame.await,
            };
            let Some(frame) = frame else {
                self.release();
                return None;
            };
            match frame {
                Ok(frame) => {
                    // Trailers are not relayed.
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        self.inline_left = self
                            .inline_left
                            .saturating_sub(u64::try_from(data.len()).unwrap_or(u64::MAX));
                        if self.inline_left == 0
                            && let Some(d) = self.driven.take()
                        {
                            d.hand_off();
                        }
                        return Some(Ok(data));
                    }
                }
                Err(()) => return Some(Err(HttpFailure::Body)),
            }
        }
    }

    /// The connection back to the pool (the body was read to its end).
    fn release(&mut self) {
        if let Some(d) = self.driven.take() {
            d.release();
        }
    }

    /// The whole body, at most `limit` bytes (more is a [`HttpFailure::Body`]).
    pub(crate) async fn bytes(mut self, limit: usize) -> Result<Bytes, HttpFailure> {
        let mut out = Vec::new();
        while let Some(chunk) = self.chunk().await {
            let chunk = chunk?;
            if out.len() + chunk.len() > limit {
                return Err(HttpFailure::Body);
            }
            out.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(out))
    }
}

/// A request with `headers` and a complete body.
pub(crate) fn request(
    method: http::Method,
    uri: http::Uri,
    headers: http::HeaderMap,
    body: Bytes,
) -> http::Request<Full<Bytes>> {
    let mut r = http::Request::new(Full::new(body));
    *r.method_mut() = method;
    *r.uri_mut() = uri;
    *r.headers_mut() = headers;
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpListener;

    /// How the raw provider answers.
    #[derive(Clone, Copy)]
    enum Answer {
        /// `content-length`, kept alive.
        Length,
        /// Chunked, kept alive.
        Chunked,
        /// `connection: close`, then closed.
        Close,
        /// 1 MiB with `content-length`.
        Big,
    }

    /// An HTTP/1.1 provider over a raw socket: counts the connections it accepted and the
    /// requests it read, records each request head, and closes a connection without notice
    /// after `close_after` requests on it, once told to ([`Raw::close`]).
    struct Raw {
        addr: std::net::SocketAddr,
        accepted: Arc<AtomicUsize>,
        heads: Arc<Mutex<Vec<String>>>,
        /// Each connection's end (its count of requests), once the provider closed it or the
        /// client did.
        ended: tokio::sync::mpsc::UnboundedReceiver<usize>,
        /// Lets a connection that served `close_after` requests close.
        close: Arc<tokio::sync::Notify>,
    }

    async fn raw(answer: Answer, close_after: usize) -> Raw {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (ended_tx, ended) = tokio::sync::mpsc::unbounded_channel();
        let close = Arc::new(tokio::sync::Notify::new());
        let (a, h, c) = (accepted.clone(), heads.clone(), close.clone());
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                let (h, ended_tx, c) = (h.clone(), ended_tx.clone(), c.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut served = 0;
                    'conn: loop {
                        let head_end = loop {
                            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break p + 4;
                            }
                            let mut chunk = [0u8; 4096];
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => break 'conn,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        };
                        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                        let len: usize = head
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse().unwrap())
                            })
                            .unwrap_or(0);
                        while buf.len() < head_end + len {
                            let mut chunk = [0u8; 4096];
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => break 'conn,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.drain(..head_end + len);
                        h.lock().unwrap().push(head);
                        served += 1;
                        let out: Vec<u8> = match answer {
                            Answer::Length => b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec(),
                            Answer::Chunked => b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n".to_vec(),
                            Answer::Close => b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok".to_vec(),
                            Answer::Big => {
                                let mut v = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", 1 << 20).into_bytes();
                                v.resize(v.len() + (1 << 20), b'x');
                                v
                            }
                        };
                        if s.write_all(&out).await.is_err() {
                            break;
                        }
                        if matches!(answer, Answer::Close) {
                            break;
                        }
                        if served == close_after {
                            c.notified().await;
                            break;
                        }
                    }
                    drop(s);
                    let _ = ended_tx.send(served);
                });
            }
        });
        Raw {
            addr,
            accepted,
            heads,
            ended,
            close,
        }
    }

    fn post(addr: std::net::SocketAddr) -> http::Request<Full<Bytes>> {
        request(
            http::Method::POST,
            format!("http://{addr}/v1/x?y=1").parse().unwrap(),
            http::HeaderMap::new(),
            Bytes::from_static(b"{\"a\":1}"),
        )
    }

    async fn body(client: &ProviderHttp, addr: std::net::SocketAddr) -> Bytes {
        let ex = client.send(post(addr), None).await.unwrap();
        assert_eq!(ex.status(), 200);
        ex.bytes(4 << 20).await.unwrap()
    }

    #[tokio::test]
    async fn exchanges_one_after_another_share_one_connection() {
        for answer in [Answer::Length, Answer::Chunked] {
            let p = raw(answer, usize::MAX).await;
            let client = ProviderHttp::new(Some(Duration::from_secs(30))).unwrap();
            for _ in 0..3 {
                assert_eq!(body(&client, p.addr).await, "ok");
                // Back in the pool once the body was read to its end (a body longer than
                // `INLINE_BODY` goes back from its hand-off task, a moment later).
                back_in_the_pool(&client).await;
            }
            assert_eq!(p.accepted.load(Ordering::SeqCst), 1);
            let heads = p.heads.lock().unwrap().clone();
            assert_eq!(heads.len(), 3);
            for head in heads {
                // The origin form and the Host hyper-util's client wrote.
                assert!(head.starts_with("POST /v1/x?y=1 HTTP/1.1\r\n"), "{head}");
                assert!(
                    head.to_ascii_lowercase()
                        .contains(&format!("\r\nhost: {}\r\n", p.addr)),
                    "{head}"
                );
            }
        }
    }

    /// The exchange's future and what it returns stay small: they live inside every tunnel's
    /// future, which is moved whole into its box (connecting, with HTTP/2's handshake, made it
    /// 9.4 KB and cost the Node 15k instructions of `memcpy` per request until it was boxed).
    #[test]
    fn an_exchange_carries_little_state() {
        let client = ProviderHttp::new(None).unwrap();
        let addr: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
        let send = client.send(post(addr), None);
        assert!(size_of_val(&send) <= 2048, "{}", size_of_val(&send));
        assert!(size_of::<Exchange>() <= 512, "{}", size_of::<Exchange>());
    }

    #[tokio::test]
    async fn exchanges_at_once_each_get_a_connection_and_keep_it() {
        let p = raw(Answer::Length, usize::MAX).await;
        let client = ProviderHttp::new(Some(Duration::from_secs(30))).unwrap();
        let round = || async {
            let all: Vec<_> = (0..4).map(|_| body(&client, p.addr)).collect();
            for b in futures_util::future::join_all(all).await {
                assert_eq!(b, "ok");
            }
        };
        round().await;
        let first = p.accepted.load(Ordering::SeqCst);
        assert!((1..=4).contains(&first), "{first}");
        round().await;
        round().await;
        assert_eq!(
            p.accepted.load(Ordering::SeqCst),
            first,
            "the pool kept them"
        );
    }

    #[tokio::test]
    async fn a_connection_the_provider_closed_while_idle_is_not_reused() {
        // The provider closes each connection after one answer, without `connection: close`,
        // once the client holds it idle in its pool.
        let mut p = raw(Answer::Length, 1).await;
        let client = ProviderHttp::new(Some(Duration::from_secs(30))).unwrap();
        for round in 1..=3 {
            assert_eq!(body(&client, p.addr).await, "ok");
            p.close.notify_one();
            assert_eq!(p.ended.recv().await, Some(1));
            // The close is in the kernel now; a timer lets the runtime read it off the socket.
            tokio::time::sleep(Duration::from_millis(5)).await;
            assert_eq!(p.accepted.load(Ordering::SeqCst), round);
        }
    }

    fn idle(client: &ProviderHttp) -> usize {
        client.pool.lock().iter().map(|o| o.idle.len()).sum()
    }

    /// Waits until the pool holds an idle connection.
    async fn back_in_the_pool(client: &ProviderHttp) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while idle(client) == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the connection went back to the pool");
    }

    /// With no traffic, the sweep closes an idle connection the provider closed (it would
    /// wait in `CLOSE_WAIT`) and one idle past [`POOL_IDLE`]. Virtual time: the sweeps run as
    /// the clock jumps; the sockets are real.
    #[tokio::test(start_paused = true)]
    async fn the_sweep_closes_connections_the_provider_closed_or_idle_too_long() {
        let mut p = raw(Answer::Length, 1).await;
        let client = ProviderHttp::new(None).unwrap();
        assert_eq!(body(&client, p.addr).await, "ok");
        assert_eq!(idle(&client), 1);
        p.close.notify_one();
        assert_eq!(p.ended.recv().await, Some(1));
        tokio::time::sleep(SWEEP_EVERY * 2).await;
        assert_eq!(idle(&client), 0, "closed by the provider");

        let mut p = raw(Answer::Length, usize::MAX).await;
        assert_eq!(body(&client, p.addr).await, "ok");
        assert_eq!(idle(&client), 1);
        tokio::time::sleep(SWEEP_EVERY * 2).await;
        assert_eq!(idle(&client), 1, "open and young: kept");
        tokio::time::sleep(POOL_IDLE).await;
        assert_eq!(idle(&client), 0, "idle too long");
        // Closed on the Node's side: the provider reads the end of the connection.
        assert_eq!(p.ended.recv().await, Some(1));
    }

    #[tokio::test]
    async fn connection_close_and_an_unread_body_close_the_connection() {
        let mut p = raw(Answer::Close, usize::MAX).await;
        let client = ProviderHttp::new(Some(Duration::from_secs(30))).unwrap();
        assert_eq!(body(&client, p.addr).await, "ok");
        assert_eq!(p.ended.recv().await, Some(1));
        assert_eq!(body(&client, p.addr).await, "ok");
        assert_eq!(p.accepted.load(Ordering::SeqCst), 2);

        // A response dropped before its end: the client closes that connection, and the next
        // exchange opens another.
        let mut p = raw(Answer::Big, usize::MAX).await;
        let mut ex = client.send(post(p.addr), None).await.unwrap();
        assert!(!ex.chunk().await.unwrap().unwrap().is_empty());
        drop(ex);
        assert_eq!(p.ended.recv().await, Some(1));
        // Past its first `INLINE_BODY` bytes a long body is read beside the connection's task.
        let mut ex = client.send(post(p.addr), None).await.unwrap();
        let mut read = 0;
        while read <= INLINE_BODY {
            assert!(ex.driven.is_some());
            read += u64::try_from(ex.chunk().await.unwrap().unwrap().len()).unwrap();
        }
        assert!(ex.driven.is_none(), "handed off");
        assert_eq!(
            u64::try_from(ex.bytes(4 << 20).await.unwrap().len()).unwrap() + read,
            1 << 20
        );
        back_in_the_pool(&client).await;
        assert_eq!(body(&client, p.addr).await.len(), 1 << 20);
        assert_eq!(p.accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_silent_provider_times_out_and_a_refused_one_fails_to_connect() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _held = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            std::future::pending::<()>().await;
            drop(s);
        });
        let client = ProviderHttp::new(None).unwrap();
        let e = client
            .send(post(addr), Some(Duration::from_millis(200)))
            .await
            .unwrap_err();
        assert_eq!(e, HttpFailure::Timeout);
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gone = closed.local_addr().unwrap();
        drop(closed);
        let e = client.send(post(gone), None).await.unwrap_err();
        assert_eq!(e, HttpFailure::Connect);
    }

    /// An `https` provider that offers one protocol by ALPN: HTTP/2 (every exchange shares one
    /// connection, at once too) or HTTP/1.1 (one after another share one connection, the
    /// exchange polling it through TLS).
    #[tokio::test]
    async fn https_origins_speak_what_they_chose_by_alpn() {
        for h2 in [true, false] {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let key = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
            let cert = key.cert.der().clone();
            let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    vec![cert.clone()],
                    rustls_pki_types::PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into()),
                )
                .unwrap();
            server.alpn_protocols = vec![if h2 {
                b"h2".to_vec()
            } else {
                b"http/1.1".to_vec()
            }];
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let accepted = Arc::new(AtomicUsize::new(0));
            let a = accepted.clone();
            tokio::spawn(async move {
                loop {
                    let (tcp, _) = listener.accept().await.unwrap();
                    a.fetch_add(1, Ordering::SeqCst);
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        let tls = TokioIo::new(acceptor.accept(tcp).await.unwrap());
                        let service =
                            hyper::service::service_fn(|r: http::Request<Incoming>| async move {
                                let text = format!("{:?} {}", r.version(), r.uri());
                                Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                                    Bytes::from(text),
                                )))
                            });
                        let _ = if h2 {
                            hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                                .serve_connection(tls, service)
                                .await
                        } else {
                            hyper::server::conn::http1::Builder::new()
                                .serve_connection(tls, service)
                                .await
                        };
                    });
                }
            });
            let mut roots = rustls::RootCertStore::empty();
            roots.add(cert).unwrap();
            let tls = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
            let client = ProviderHttp::with_tls(tls, Some(Duration::from_secs(30)));
            let uri: http::Uri = format!("https://localhost:{port}/v1/x").parse().unwrap();
            let get = || async {
                let r = request(
                    http::Method::GET,
                    uri.clone(),
                    http::HeaderMap::new(),
                    Bytes::new(),
                );
                client
                    .send(r, None)
                    .await
                    .unwrap()
                    .bytes(1024)
                    .await
                    .unwrap()
            };
            // HTTP/2 carries the absolute form; HTTP/1.1 the origin form.
            let expected = if h2 {
                format!("HTTP/2.0 https://localhost:{port}/v1/x")
            } else {
                "HTTP/1.1 /v1/x".to_owned()
            };
            for _ in 0..3 {
                assert_eq!(get().await, expected);
            }
            assert_eq!(accepted.load(Ordering::SeqCst), 1, "h2: {h2}");
            if h2 {
                let all: Vec<_> = (0..4).map(|_| get()).collect();
                for b in futures_util::future::join_all(all).await {
                    assert_eq!(b, expected);
                }
                assert_eq!(accepted.load(Ordering::SeqCst), 1);
            }
        }
    }

    #[test]
    fn base_urls_join_paths_and_queries() {
        let b = BaseUrl::parse("k", "http://127.0.0.1:8080/v1/").unwrap();
        assert_eq!(
            b.join("/chat/completions").unwrap().to_string(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            b.join("/models?limit=5").unwrap().to_string(),
            "http://127.0.0.1:8080/v1/models?limit=5"
        );
        let root = BaseUrl::parse("k", "https://api.example.com").unwrap();
        assert_eq!(
            root.join("/v1/messages").unwrap().to_string(),
            "https://api.example.com/v1/messages"
        );
        assert!(b.join("no-slash").is_err());
        assert!(b.join("/bad path").is_err());
        for bad in ["ftp://x/y", "not a url", "/relative", "http://h/p?q=1"] {
            assert!(BaseUrl::parse("base_url", bad).is_err(), "{bad}");
        }
        assert_eq!(
            BaseUrl::parse("openai_compat.base_url", "ftp://x").unwrap_err(),
            "openai_compat.base_url must be http or https"
        );
    }
}
