//! mTLS for the worker listener (seed 004 §6).
//!
//! The client certificate must chain to the configured client CA (rustls' WebPKI verifier,
//! *ring* provider, TLS 1.3, from `workload_identity::HostTls`, whose files the controller
//! re-reads every `controlPlane.tls.reloadInterval`) and carry exactly one URI SAN of the form
//! `spiffe://TRUST_DOMAIN/ENVIRONMENT/worker/WORKER_ID`, with this listener's trust domain and
//! environment and a valid worker id. That worker id is the connection's identity
//! ([`PeerInfo`], in every request's extensions); each RPC's `worker_id` must equal it. A
//! connection without a certificate, or with another identity shape, is closed after the
//! handshake without being served.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bounded_http::tls::{TlsAccept, TlsLimits};
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::domain::valid_id;

/// How long a client has for the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most handshakes in progress at once.
pub const MAX_PENDING_HANDSHAKES: usize = 256;

/// The verified peer of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The worker id from the certificate's SPIFFE URI.
    pub worker_id: String,
    /// Remote address (never a metric label).
    pub remote: SocketAddr,
}

/// Why a certificate identity was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// Not a parseable X.509 certificate.
    #[error("certificate does not parse")]
    Parse,
    /// Not exactly one URI SAN.
    #[error("certificate must carry exactly one URI SAN")]
    UriCount,
    /// The URI is not `spiffe://TD/ENV/worker/ID` for this trust domain and environment.
    #[error("certificate URI is not this environment's worker identity")]
    Shape,
}

/// The worker id of a client certificate for `trust_domain` / `environment`. The SPIFFE ID is
/// read by `workload_identity::SpiffeId` (the one parser of the workspace; the SPIFFE syntax
/// checks are its), then held to this controller's shape.
pub fn worker_id(
    cert: &CertificateDer<'_>,
    trust_domain: &str,
    environment: &str,
) -> Result<String, IdentityError> {
    use workload_identity::IdentityError as Spiffe;
    let id = workload_identity::SpiffeId::from_certificate(cert).map_err(|e| match e {
        Spiffe::BadCertificate => IdentityError::Parse,
        Spiffe::NoUriSan | Spiffe::MultipleUriSans { .. } => IdentityError::UriCount,
        _ => IdentityError::Shape,
    })?;
    if id.trust_domain() != trust_domain {
        return Err(IdentityError::Shape);
    }
    let segments: Vec<&str> = id.segments().collect();
    match segments.as_slice() {
        [env, "worker", worker] if *env == environment && valid_id(worker) => {
            Ok((*worker).to_owned())
        }
        _ => Err(IdentityError::Shape),
    }
}

/// A verified TLS connection (tonic's `Connected` exposes its [`PeerInfo`]).
#[derive(Debug)]
pub struct TlsConn {
    inner: TlsStream<TcpStream>,
    info: PeerInfo,
}

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Accepts on `listener` through the workspace's one bounded TLS accept loop
/// (`bounded_http::tls`: at most [`MAX_PENDING_HANDSHAKES`] handshakes at once, each within
/// [`HANDSHAKE_TIMEOUT`], `TCP_NODELAY`, accept errors backed off, refusals logged at most once
/// per 10 s) and yields only connections with a valid worker identity. Stops when the stream is
/// dropped.
pub fn incoming(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    trust_domain: String,
    environment: String,
) -> tokio_stream::wrappers::ReceiverStream<Result<TlsConn, std::io::Error>> {
    let (tx, rx) = mpsc::channel(MAX_PENDING_HANDSHAKES);
    let accept = TlsAccept::new(
        acceptor,
        TlsLimits {
            max_handshakes: MAX_PENDING_HANDSHAKES,
            max_handshakes_per_ip: usize::MAX,
            handshake_timeout: HANDSHAKE_TIMEOUT,
        },
        None,
        "worker",
    );
    let closed = tx.clone();
    let refusals = Arc::new(std::sync::Mutex::new(bounded_http::RateLimited::new(
        Duration::from_secs(10),
    )));
    let (trust_domain, environment) = (
        Arc::<str>::from(trust_domain),
        Arc::<str>::from(environment),
    );
    tokio::spawn(accept.run(
        listener,
        async move { closed.closed().await },
        move |tls: TlsStream<TcpStream>, remote, slot| {
            let (tx, td, env) = (tx.clone(), trust_domain.clone(), environment.clone());
            let refusals = refusals.clone();
            async move {
                drop(slot);
                let identity = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|leaf| worker_id(leaf, &td, &env));
                match identity {
                    Some(Ok(worker_id)) => {
                        let _ = tx
                            .send(Ok(TlsConn {
                                inner: tls,
                                info: PeerInfo { worker_id, remote },
                            }))
                            .await;
                    }
                    refused => {
                        let hit = refusals
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .hit();
                        if let Some(suppressed) = hit {
                            match refused {
                                Some(Err(e)) => tracing::info!(error = %e, %remote, suppressed, "worker certificate refused (at most one line per 10 s)"),
                                _ => tracing::info!(%remote, suppressed, "connection without a client certificate refused (at most one line per 10 s)"),
                            }
                        }
                    }
                }
            }
        },
    ));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use rcgen::{CertificateParams, KeyPair, SanType};

    use super::*;

    fn cert(uris: &[&str]) -> CertificateDer<'static> {
        let mut params = CertificateParams::default();
        for uri in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*uri).try_into().unwrap()));
        }
        params
            .subject_alt_names
            .push(SanType::DnsName("worker.example".try_into().unwrap()));
        let key = KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().clone()
    }

    #[test]
    fn the_worker_id_is_the_one_uri_san_of_this_environment() {
        let id = |uris: &[&str]| worker_id(&cert(uris), "proxypool.test", "staging");
        assert_eq!(
            id(&["spiffe://proxypool.test/staging/worker/w-1"]),
            Ok("w-1".into())
        );
        assert_eq!(id(&[]), Err(IdentityError::UriCount));
        assert_eq!(
            id(&[
                "spiffe://proxypool.test/staging/worker/w-1",
                "spiffe://proxypool.test/staging/worker/w-2",
            ]),
            Err(IdentityError::UriCount)
        );
        for wrong in [
            "spiffe://proxypool.test/prod/worker/w-1",
            "spiffe://other.test/staging/worker/w-1",
            "spiffe://proxypool.test/staging/gateway/w-1",
            "spiffe://proxypool.test/staging/worker/",
            "spiffe://proxypool.test/staging/worker/w 1",
            "https://proxypool.test/staging/worker/w-1",
        ] {
            assert_eq!(id(&[wrong]), Err(IdentityError::Shape), "{wrong}");
        }
        assert_eq!(
            worker_id(
                &CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01]),
                "proxypool.test",
                "staging"
            ),
            Err(IdentityError::Parse)
        );
    }
}
