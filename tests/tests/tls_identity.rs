//! Edge ↔ Node mutual-TLS workload identity, end to end over loopback TCP.
//!
//! Each scenario runs a real Edge-side TLS server and Node-side TLS client built from
//! `workload_identity`, and asserts the exact failure on the side that detects it. A rejected
//! peer must fail inside `accept`, so the server never gets a stream to read application bytes
//! from; the client writes its "registration" bytes anyway (in TLS 1.3 a client finishes its
//! handshake before the server has judged the client certificate) to show they go nowhere.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use iop_tests::pki::{Ca, Leaf, TRUST_DOMAIN, spiffe};
use rustls::client::danger::ServerCertVerifier;
use rustls::{AlertDescription, CertificateError, ClientConfig, ServerConfig};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use workload_identity::{
    ExpectedPeer, IdentityError, WorkloadId, client_cert_verifier, peer_identity, role,
    server_cert_verifier,
};

const PAYLOAD: &[u8] = b"register node-1";
/// Guards against a hung handshake; no scenario depends on it elapsing.
const SCENARIO_LIMIT: Duration = Duration::from_secs(10);

// === config helpers ===

/// The Edge: presents `leaf`, accepts any Node of this trust domain signed by `ca`.
fn edge_config(ca: &Ca, leaf: &Leaf) -> Arc<ServerConfig> {
    let expected = ExpectedPeer::any_name(TRUST_DOMAIN, role::NODE).expect("valid expected peer");
    let verifier = client_cert_verifier(ca.roots(), expected).expect("CA roots are non-empty");
    Arc::new(
        workload_identity::server_config(leaf.chain.clone(), leaf.key(), verifier)
            .expect("edge leaf carries an identity and matches its key"),
    )
}

/// The Node's verifier of the Edge named `edge_name`.
fn edge_verifier(ca: &Ca, edge_name: &str) -> Arc<dyn ServerCertVerifier> {
    let expected =
        ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, edge_name).expect("valid expected peer");
    server_cert_verifier(ca.roots(), expected).expect("CA roots are non-empty")
}

/// The Node: presents `leaf`, expects the Edge named `edge_name`.
fn node_config(ca: &Ca, leaf: &Leaf, edge_name: &str) -> Arc<ClientConfig> {
    let verifier = edge_verifier(ca, edge_name);
    Arc::new(
        workload_identity::client_config(leaf.chain.clone(), leaf.key(), verifier)
            .expect("node leaf carries an identity and matches its key"),
    )
}

/// A client config built directly with rustls, bypassing `workload_identity::client_config`'s own-cert
/// check, to impersonate a misconfigured or hostile client.
fn raw_client_config(
    verifier: Arc<dyn ServerCertVerifier>,
    leaf: Option<&Leaf>,
) -> Arc<ClientConfig> {
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("ring supports TLS 1.3")
            .dangerous()
            .with_custom_certificate_verifier(verifier);
    let config = match leaf {
        Some(leaf) => builder
            .with_client_auth_cert(leaf.chain.clone(), leaf.key())
            .expect("leaf matches its key"),
        None => builder.with_no_client_auth(),
    };
    Arc::new(config)
}

// === harness ===

/// What the Edge side saw.
#[derive(Debug)]
enum ServerSide {
    /// Handshake completed: the authenticated peer and the application bytes it sent.
    Accepted { peer: WorkloadId, received: Vec<u8> },
    /// `accept` failed: no stream existed, so nothing was read from the peer.
    Rejected(io::Error),
}

/// What the Node side saw.
#[derive(Debug)]
enum ClientSide {
    /// Handshake completed and the payload echoed back.
    Echoed { peer: WorkloadId, echoed: Vec<u8> },
    /// `connect` failed.
    HandshakeFailed(io::Error),
    /// `connect` returned (TLS 1.3 clients finish first), but the exchange then failed.
    ExchangeFailed(io::Error),
}

async fn run(server: Arc<ServerConfig>, client: Arc<ClientConfig>) -> (ServerSide, ClientSide) {
    let scenario = async {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("bound socket has an address");

        let server_task = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.expect("accept loopback connection");
            tcp.set_nodelay(true).expect("set TCP_NODELAY");
            let mut tls = match TlsAcceptor::from(server).accept(tcp).await {
                Ok(tls) => tls,
                Err(err) => return ServerSide::Rejected(err),
            };
            let peer =
                peer_identity(tls.get_ref().1).expect("accepted peer was verified by our verifier");
            let mut received = vec![0; PAYLOAD.len()];
            tls.read_exact(&mut received)
                .await
                .expect("read payload from accepted node");
            tls.write_all(&received).await.expect("echo payload");
            tls.flush().await.expect("flush echo");
            // Wait for the client to close so the echo is not cut off by a reset.
            let _ = tls.read(&mut [0; 1]).await;
            ServerSide::Accepted { peer, received }
        });

        let tcp = TcpStream::connect(addr)
            .await
            .expect("connect to loopback listener");
        tcp.set_nodelay(true).expect("set TCP_NODELAY");
        let name = ServerName::try_from("localhost").expect("valid DNS name");
        let client_side = match TlsConnector::from(client).connect(name, tcp).await {
            Err(err) => ClientSide::HandshakeFailed(err),
            Ok(mut tls) => {
                let peer =
                    peer_identity(tls.get_ref().1).expect("server was verified by our verifier");
                let mut echoed = vec![0; PAYLOAD.len()];
                let exchange = async {
                    tls.write_all(PAYLOAD).await?;
                    tls.flush().await?;
                    tls.read_exact(&mut echoed).await?;
                    tls.shutdown().await
                };
                match exchange.await {
                    Ok(()) => ClientSide::Echoed { peer, echoed },
                    Err(err) => ClientSide::ExchangeFailed(err),
                }
            }
        };
        (
            server_task.await.expect("server task did not panic"),
            client_side,
        )
    };
    tokio::time::timeout(SCENARIO_LIMIT, scenario)
        .await
        .expect("scenario finished in time")
}

fn tls_error(err: &io::Error) -> &rustls::Error {
    err.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .unwrap_or_else(|| panic!("not a rustls error: {err:?}"))
}

fn identity_error(err: &io::Error) -> &IdentityError {
    let tls = tls_error(err);
    IdentityError::from_rustls_error(tls)
        .unwrap_or_else(|| panic!("not an identity error: {tls:?}"))
}

#[track_caller]
fn rejected(server: &ServerSide) -> &io::Error {
    match server {
        ServerSide::Rejected(err) => err,
        ServerSide::Accepted { peer, received } => {
            panic!("server accepted {peer} and read {} bytes", received.len())
        }
    }
}

/// A client whose certificate the server rejected never gets its payload echoed: depending
/// on timing it reads the server's alert, or a reset/EOF if its write raced the close.
#[track_caller]
fn client_was_cut_off(client: &ClientSide) {
    if let ClientSide::Echoed { peer, .. } = client {
        panic!("rejected client completed an exchange with {peer}");
    }
}

// === scenarios ===

#[tokio::test]
async fn node_and_edge_authenticate_each_other() {
    let ca = Ca::new("iop dev CA");
    let edge = ca.workload(role::EDGE, "edge-1", true);
    let node = ca.workload(role::NODE, "node-1", false);

    let (server, client) = run(edge_config(&ca, &edge), node_config(&ca, &node, "edge-1")).await;

    match server {
        ServerSide::Accepted { peer, received } => {
            assert_eq!(
                peer,
                WorkloadId::new(TRUST_DOMAIN, role::NODE, "node-1").unwrap()
            );
            assert_eq!(peer.name(), "node-1");
            assert_eq!(received, PAYLOAD);
        }
        ServerSide::Rejected(err) => panic!("server rejected the node: {err:?}"),
    }
    match client {
        ClientSide::Echoed { peer, echoed } => {
            assert_eq!(peer.as_str(), "spiffe://iop.test/edge/edge-1");
            assert_eq!(echoed, PAYLOAD);
        }
        other => panic!("client failed: {other:?}"),
    }
}

#[tokio::test]
async fn client_without_certificate_is_rejected() {
    let ca = Ca::new("iop dev CA");
    let edge = ca.workload(role::EDGE, "edge-1", true);
    let client = raw_client_config(edge_verifier(&ca, "edge-1"), None);

    let (server, client) = run(edge_config(&ca, &edge), client).await;

    let err = rejected(&server);
    assert_eq!(tls_error(err), &rustls::Error::NoCertificatesPresented);
    client_was_cut_off(&client);
    if let ClientSide::ExchangeFailed(err) = &client {
        // When the alert wins the race, it says exactly why.
        if let Some(tls) = err
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>())
        {
            assert_eq!(
                tls,
                &rustls::Error::AlertReceived(AlertDescription::CertificateRequired)
            );
        }
    }
}

#[tokio::test]
async fn client_from_another_ca_is_rejected() {
    let ca = Ca::new("iop dev CA");
    let rogue_ca = Ca::new("rogue CA");
    let edge = ca.workload(role::EDGE, "edge-1", true);
    // Same SPIFFE ID as a legitimate Node, but signed by a CA the Edge does not trust.
    let rogue = rogue_ca.workload(role::NODE, "node-1", false);

    let (server, client) = run(edge_config(&ca, &edge), node_config(&ca, &rogue, "edge-1")).await;

    let err = rejected(&server);
    assert_eq!(
        tls_error(err),
        &rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)
    );
    client_was_cut_off(&client);
}

#[tokio::test]
async fn client_with_wrong_role_is_rejected() {
    let ca = Ca::new("iop dev CA");
    let edge = ca.workload(role::EDGE, "edge-1", true);
    // A valid workload of this CA, but an Edge, not a Node.
    let impostor = ca.workload(role::EDGE, "edge-9", false);

    let (server, client) = run(
        edge_config(&ca, &edge),
        node_config(&ca, &impostor, "edge-1"),
    )
    .await;

    match identity_error(rejected(&server)) {
        IdentityError::WrongRole { expected, found } => {
            assert_eq!(expected, role::NODE);
            assert_eq!(found, role::EDGE);
        }
        other => panic!("unexpected identity error: {other:?}"),
    }
    client_was_cut_off(&client);
}

#[tokio::test]
async fn node_rejects_edge_with_wrong_name() {
    let ca = Ca::new("iop dev CA");
    let edge2 = ca.workload(role::EDGE, "edge-2", true);
    let node = ca.workload(role::NODE, "node-1", false);

    let (server, client) = run(edge_config(&ca, &edge2), node_config(&ca, &node, "edge-1")).await;

    let ClientSide::HandshakeFailed(err) = &client else {
        panic!("client did not fail the handshake: {client:?}");
    };
    match identity_error(err) {
        IdentityError::WrongName { expected, found } => {
            assert_eq!(expected, "edge-1");
            assert_eq!(found, "edge-2");
        }
        other => panic!("unexpected identity error: {other:?}"),
    }
    // The Edge is told only that its certificate was unacceptable, and reads nothing.
    assert_eq!(
        tls_error(rejected(&server)),
        &rustls::Error::AlertReceived(AlertDescription::CertificateUnknown)
    );
}

#[tokio::test]
async fn client_with_two_uri_sans_is_rejected() {
    let ca = Ca::new("iop dev CA");
    let edge = ca.workload(role::EDGE, "edge-1", true);
    let ambiguous = ca.leaf(
        &[spiffe(role::NODE, "node-1"), spiffe(role::NODE, "node-2")],
        false,
    );

    // Our own config builder refuses such a certificate up front...
    let own = workload_identity::client_config(
        ambiguous.chain.clone(),
        ambiguous.key(),
        edge_verifier(&ca, "edge-1"),
    );
    assert!(matches!(
        own,
        Err(IdentityError::MultipleUriSans { count: 2 })
    ));

    // ...and a client that presents it anyway fails the Edge's handshake.
    let client = raw_client_config(edge_verifier(&ca, "edge-1"), Some(&ambiguous));
    let (server, client) = run(edge_config(&ca, &edge), client).await;

    assert!(matches!(
        identity_error(rejected(&server)),
        IdentityError::MultipleUriSans { count: 2 }
    ));
    client_was_cut_off(&client);
}
