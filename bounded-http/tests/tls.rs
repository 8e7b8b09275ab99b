//! `bounded_http::tls::TlsAccept` over real sockets and real TLS: the global slot cap pauses
//! accepting (a second handshake waits for the first connection's slot), the per-address cap
//! closes at once, a silent client is cut at the handshake deadline, `try_serve` refuses at the
//! cap, and every refusal is reported by reason. No assertion depends on a wall-clock window:
//! each waits for the event it names (with a generous outer limit).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bounded_http::tls::{TlsAccept, TlsEvents, TlsLimits, TlsRefusal};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const LIMIT: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Counts(Mutex<HashMap<TlsRefusal, usize>>);

impl TlsEvents for Counts {
    fn refused(&self, reason: TlsRefusal) {
        *self.0.lock().unwrap().entry(reason).or_default() += 1;
    }
}

impl Counts {
    fn get(&self, reason: TlsRefusal) -> usize {
        self.0.lock().unwrap().get(&reason).copied().unwrap_or(0)
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn configs() -> (tokio_rustls::TlsAcceptor, tokio_rustls::TlsConnector) {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["server.test".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let der = CertificateDer::from(cert.der().to_vec());
    let server = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![der.clone()],
            PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
        )
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(der).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    (
        tokio_rustls::TlsAcceptor::from(Arc::new(server)),
        tokio_rustls::TlsConnector::from(Arc::new(client)),
    )
}

/// A listener whose handler reports each connection and holds its slot until told to let go.
async fn listener(
    limits: TlsLimits,
) -> (
    SocketAddr,
    Arc<TlsAccept>,
    Arc<Counts>,
    mpsc::UnboundedReceiver<tokio::sync::oneshot::Sender<()>>,
    tokio_rustls::TlsConnector,
) {
    let (acceptor, connector) = configs();
    let counts = Arc::new(Counts::default());
    let accept = TlsAccept::new(acceptor, limits, Some(counts.clone()), "test");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (served_tx, served) = mpsc::unbounded_channel();
    tokio::spawn(accept.clone().run(
        listener,
        std::future::pending(),
        move |mut tls, _peer, slot| {
            let served_tx = served_tx.clone();
            async move {
                let (release, released) = tokio::sync::oneshot::channel::<()>();
                served_tx.send(release).unwrap();
                let _ = released.await;
                drop(slot);
                let _ = tls.write_all(b"served").await;
                let _ = tls.shutdown().await;
            }
        },
    ));
    (addr, accept, counts, served, connector)
}

async fn client(
    connector: &tokio_rustls::TlsConnector,
    addr: SocketAddr,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    connector
        .connect(ServerName::try_from("server.test").unwrap(), tcp)
        .await
        .unwrap()
}

/// Waits (up to [`LIMIT`]) until the server closes `tcp`.
async fn closed(tcp: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    loop {
        match tokio::time::timeout(LIMIT, tcp.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

async fn eventually(what: &str, f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn at_the_cap_the_next_handshake_waits_for_a_slot() {
    let limits = TlsLimits {
        max_handshakes: 1,
        ..TlsLimits::default()
    };
    let (addr, accept, counts, mut served, connector) = listener(limits).await;
    let _first = client(&connector, addr).await;
    let release_first = served.recv().await.unwrap();
    assert_eq!(accept.available(), 0);
    // The second connection is not accepted while the first holds the only slot: its handshake
    // cannot finish and its handler does not run.
    let second = {
        let connector = connector.clone();
        tokio::spawn(async move { client(&connector, addr).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "the second handshake waited");
    assert!(served.try_recv().is_err(), "no second handler yet");
    release_first.send(()).unwrap();
    let mut second = tokio::time::timeout(LIMIT, second).await.unwrap().unwrap();
    served.recv().await.unwrap().send(()).unwrap();
    let mut got = Vec::new();
    second.read_to_end(&mut got).await.unwrap_or_default();
    assert_eq!(got, b"served");
    assert_eq!(
        counts.get(TlsRefusal::Capacity),
        0,
        "waiting is not refusing"
    );
    // Both slots came back: a third connection is served (the loop holds the one slot while
    // it waits in `accept`, so `available` is 0 here).
    let _third = client(&connector, addr).await;
    served.recv().await.unwrap().send(()).unwrap();
    assert_eq!(accept.available(), 0);
}

#[tokio::test]
async fn one_address_over_its_share_is_closed_at_once() {
    let limits = TlsLimits {
        max_handshakes: 8,
        max_handshakes_per_ip: 1,
        ..TlsLimits::default()
    };
    let (addr, accept, counts, mut served, connector) = listener(limits).await;
    let _first = client(&connector, addr).await;
    let release = served.recv().await.unwrap();
    let mut second = TcpStream::connect(addr).await.unwrap();
    assert!(closed(&mut second).await, "closed without a handshake");
    assert_eq!(counts.get(TlsRefusal::PerIp), 1);
    release.send(()).unwrap();
    // Its share is back once the slot is dropped: the next connection is served.
    // (The accept loop holds one slot while it waits for the next connection.)
    eventually("the slot is free", || accept.available() == 7).await;
    let _third = client(&connector, addr).await;
    served.recv().await.unwrap().send(()).unwrap();
    assert_eq!(counts.get(TlsRefusal::PerIp), 1);
}

#[tokio::test]
async fn a_silent_client_is_cut_at_the_handshake_deadline() {
    let limits = TlsLimits {
        handshake_timeout: Duration::from_millis(200),
        ..TlsLimits::default()
    };
    let (addr, accept, counts, _served, _connector) = listener(limits).await;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    assert!(closed(&mut silent).await);
    eventually("the timeout is counted", || {
        counts.get(TlsRefusal::HandshakeTimeout) == 1
    })
    .await;
    eventually("the slot is free", || accept.available() == 255).await;
    // Plain HTTP instead of a ClientHello fails the handshake.
    let mut garbage = TcpStream::connect(addr).await.unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    assert!(closed(&mut garbage).await);
    eventually("the failure is counted", || {
        counts.get(TlsRefusal::HandshakeFailed) == 1
    })
    .await;
}

#[tokio::test]
async fn try_serve_refuses_at_the_cap_and_serve_waits() {
    let (acceptor, connector) = configs();
    let counts = Arc::new(Counts::default());
    let limits = TlsLimits {
        max_handshakes: 1,
        ..TlsLimits::default()
    };
    let accept = TlsAccept::new(acceptor, limits, Some(counts.clone()), "test");
    let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let (held_tx, mut held) = mpsc::unbounded_channel();
    let (ours, theirs) = tokio::io::duplex(16 * 1024);
    let handshake = {
        let connector = connector.clone();
        tokio::spawn(async move {
            connector
                .connect(ServerName::try_from("server.test").unwrap(), ours)
                .await
                .unwrap()
        })
    };
    accept
        .serve(theirs, peer, move |_tls, _peer, slot| async move {
            held_tx.send(slot).unwrap();
        })
        .await;
    let _client = handshake.await.unwrap();
    let slot = held.recv().await.unwrap();
    // Every slot taken: `try_serve` closes the stream at once.
    let (mut ours, theirs) = tokio::io::duplex(1024);
    accept.try_serve(theirs, peer, |_tls, _peer, _slot| async {});
    let mut buf = [0u8; 1];
    assert_eq!(ours.read(&mut buf).await.unwrap(), 0, "closed at once");
    assert_eq!(counts.get(TlsRefusal::Capacity), 1);
    drop(slot);
    assert_eq!(accept.available(), 1);
}
