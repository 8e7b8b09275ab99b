//! Seed 000: "negative or overflowing `response_stall_timeout_ms` values are rejected before
//! any provider call", end to end. A raw Edge (the registry machine behind a minimal loop on a
//! real mTLS socket) registers the real Node (`iop_node::run_node`) and sends it a
//! `RunRequest` frame whose `response_stall_timeout_ms` is -1, then one whose value overflows.
//! The bytes are a valid frame with a second `run_request` field appended (protobuf merges
//! it, and its scalar wins): no API of ours can build them, which is the point.
//!
//! Asserted: our own decoder reports `InvalidMessage::StallTimeout` for exactly those bytes;
//! the Node closes that connection (an invalid frame is a protocol violation) without calling
//! its adapter; it registers again, and a valid run on the new connection does reach the
//! adapter (so "never called" is not vacuous).
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut as _, BytesMut};
use futures_util::{SinkExt, StreamExt};
use iop_edge::registry::{ConnId, Registry, RegistryConfig, RegistryEvent};
use iop_node::{
    Adapter, AdapterError, AdapterRegistry, NodeOptions, RunCompletion, RunEvents, run_node,
};
use iop_tests::pki::{Ca, TRUST_DOMAIN};
use iop_wire::codec::{FrameCodec, TokioCodec};
use iop_wire::error::{FrameError, InvalidMessage};
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, NodeConfigPayload, ProviderStatus, RunRequest, RuntimeFrame,
    RuntimeMessage,
};
use iop_wire::validate::{ResponseStallTimeout, StallTimeoutError};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_util::codec::{Encoder as _, Framed};
use tokio_util::sync::CancellationToken;
use workload_identity::{ExpectedPeer, client_cert_verifier, peer_identity, role};

const LIMIT: Duration = Duration::from_secs(30);

/// Counts the runs that reach it; answers each with one delta.
struct Counting(Arc<AtomicUsize>);

#[async_trait]
impl Adapter for Counting {
    async fn run(
        &self,
        _request: RunRequest,
        events: RunEvents,
    ) -> Result<RunCompletion, AdapterError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        events.delta("ok").await;
        Ok(RunCompletion::default())
    }

    async fn probe(
        &self,
        _target: &str,
        _credential: Option<&iop_node::credential::UpstreamCredential>,
    ) -> ProviderStatus {
        ProviderStatus::Available
    }
}

enum Out {
    Frame(Box<RuntimeFrame>),
    Raw(Vec<u8>),
}

enum Input {
    Accepted(
        mpsc::UnboundedSender<Out>,
        tokio::sync::oneshot::Sender<ConnId>,
    ),
    Frame(ConnId, Box<RuntimeFrame>),
    Closed(ConnId),
}

/// What the test sees of the raw Edge: registry events and connection closes.
#[derive(Debug)]
enum Seen {
    Ready(ConnId),
    Closed(ConnId),
    Frame(Box<RuntimeFrame>),
}

/// A raw Edge: the registry machine behind a minimal loop. Returns its address, the events,
/// and a way to write to a connection.
async fn raw_edge(
    ca: &Ca,
) -> (
    std::net::SocketAddr,
    mpsc::UnboundedReceiver<Seen>,
    Arc<std::sync::Mutex<HashMap<ConnId, mpsc::UnboundedSender<Out>>>>,
) {
    let leaf = ca.workload(role::EDGE, "edge-1", true);
    let verifier = client_cert_verifier(
        ca.roots(),
        ExpectedPeer::any_name(TRUST_DOMAIN, role::NODE).unwrap(),
    )
    .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(
        workload_identity::server_config(leaf.chain.clone(), leaf.key(), verifier).unwrap(),
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (input_tx, mut input_rx) = mpsc::unbounded_channel::<Input>();
    let (seen_tx, seen_rx) = mpsc::unbounded_channel();
    let outs: Arc<std::sync::Mutex<HashMap<ConnId, mpsc::UnboundedSender<Out>>>> = Arc::default();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, inputs) = (acceptor.clone(), input_tx.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                assert_eq!(peer_identity(tls.get_ref().1).unwrap().name(), "node-1");
                let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Out>();
                let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
                let _ = inputs.send(Input::Accepted(out_tx, reply_tx));
                let Ok(conn) = reply_rx.await else { return };
                let mut framed = Framed::new(tls, TokioCodec::<RuntimeFrame>::default());
                loop {
                    tokio::select! {
                        out = out_rx.recv() => match out {
                            Some(Out::Frame(f)) => { if framed.send(*f).await.is_err() { break } }
                            Some(Out::Raw(bytes)) => {
                                let io = framed.get_mut();
                                if io.write_all(&bytes).await.is_err() || io.flush().await.is_err() {
                                    break;
                                }
                            }
                            None => break,
                        },
                        frame = framed.next() => match frame {
                            Some(Ok(f)) => { let _ = inputs.send(Input::Frame(conn, Box::new(f))); }
                            _ => break,
                        },
                    }
                }
                let _ = inputs.send(Input::Closed(conn));
            });
        }
    });
    let conns = outs.clone();
    tokio::spawn(async move {
        let mut registry = Registry::new(RegistryConfig::default());
        registry.set_node_config(
            "node-1",
            Some(NodeConfigPayload {
                adapters: vec![AdapterConfig {
                    name: "count".into(),
                    adapter_type: "counting".into(),
                    enabled: true,
                    capacity: 4,
                    long_context_capacity: 0,
                    targets: vec!["m".into()],
                    settings: AdapterSettings::None,
                }],
                revision: 1,
                ..Default::default()
            }),
        );
        while let Some(input) = input_rx.recv().await {
            let now = tokio::time::Instant::now().into_std();
            match input {
                Input::Accepted(out, reply) => {
                    let conn = registry.accept(now, Some("node-1".into()));
                    conns.lock().unwrap().insert(conn, out);
                    let _ = reply.send(conn);
                }
                Input::Frame(conn, frame) => registry.handle_frame(now, conn, *frame),
                Input::Closed(conn) => {
                    registry.handle_close(conn);
                    conns.lock().unwrap().remove(&conn);
                    let _ = seen_tx.send(Seen::Closed(conn));
                }
            }
            while let Some((conn, frame)) = registry.poll_transmit() {
                if let Some(out) = conns.lock().unwrap().get(&conn) {
                    let _ = out.send(Out::Frame(Box::new(frame)));
                }
            }
            while let Some(event) = registry.poll_event() {
                match event {
                    RegistryEvent::NodeReady { conn, .. } => {
                        let _ = seen_tx.send(Seen::Ready(conn));
                    }
                    RegistryEvent::Frame { frame, .. } => {
                        let _ = seen_tx.send(Seen::Frame(Box::new(frame)));
                    }
                    _ => {}
                }
            }
        }
    });
    (addr, seen_rx, outs)
}

fn run(stream_id: u64, run_id: &str) -> RuntimeFrame {
    RuntimeFrame {
        stream_id,
        ..RuntimeFrame::new(RuntimeMessage::RunRequest(RunRequest {
            run_id: run_id.into(),
            adapter: "count".into(),
            target: "m".into(),
            input: bytes::Bytes::new(),
            metadata: Default::default(),
            response_stall_timeout: ResponseStallTimeout::DEFAULT,
            timeout: None,
            long_context: false,
            credential: None,
            trace: None,
        }))
    }
}

/// A valid `RunRequest` frame with a second `run_request` field (envelope field 14) appended
/// that sets only `response_stall_timeout_ms` (field 6) to `ms`.
fn frame_with_stall_ms(ms: i64) -> Vec<u8> {
    let mut buf = BytesMut::new();
    TokioCodec::<RuntimeFrame>::default()
        .encode(run(7, "bad"), &mut buf)
        .unwrap();
    let mut varint = Vec::new();
    #[expect(
        clippy::cast_sign_loss,
        reason = "protobuf int64 is the two's complement varint"
    )]
    let mut v = ms as u64;
    loop {
        let byte = u8::try_from(v & 0x7f).unwrap();
        v >>= 7;
        if v == 0 {
            varint.push(byte);
            break;
        }
        varint.push(byte | 0x80);
    }
    let mut field = vec![6 << 3];
    field.extend_from_slice(&varint);
    buf.put_u8((14 << 3) | 2);
    buf.put_u8(u8::try_from(field.len()).unwrap());
    buf.put_slice(&field);
    let len = u32::try_from(buf.len() - 4).unwrap();
    buf[..4].copy_from_slice(&len.to_be_bytes());
    buf.to_vec()
}

async fn next(seen: &mut mpsc::UnboundedReceiver<Seen>) -> Seen {
    tokio::time::timeout(LIMIT, seen.recv())
        .await
        .expect("an event in time")
        .unwrap()
}

async fn ready(seen: &mut mpsc::UnboundedReceiver<Seen>) -> ConnId {
    loop {
        if let Seen::Ready(conn) = next(seen).await {
            return conn;
        }
    }
}

#[tokio::test]
async fn a_negative_or_overflowing_stall_timeout_is_refused_before_any_provider_call() {
    let ca = Ca::new("test CA");
    let (addr, mut seen, conns) = raw_edge(&ca).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let mut adapters = AdapterRegistry::new();
    let counted = calls.clone();
    adapters.register(
        "counting",
        Arc::new(move |_: &AdapterConfig| {
            Ok(Arc::new(Counting(counted.clone())) as Arc<dyn Adapter>)
        }),
    );
    let tls = iop_tests::pki::node_client_tls(&ca, role::NODE, "node-1", "edge-1");
    let options = NodeOptions::new("node-1", &addr.to_string(), "localhost", tls)
        .unwrap()
        .with_adapters(adapters);
    let shutdown = CancellationToken::new();
    tokio::spawn(run_node(options, shutdown.clone()));

    for (ms, expected) in [
        (-1, StallTimeoutError::Negative),
        (
            iop_wire::validate::MAX_RESPONSE_STALL_TIMEOUT_MS + 1,
            StallTimeoutError::Overflow,
        ),
    ] {
        let conn = ready(&mut seen).await;
        let bytes = frame_with_stall_ms(ms);
        // Our decoder refuses exactly these bytes for exactly this reason.
        let decoded = FrameCodec::default().decode::<RuntimeFrame>(&mut BytesMut::from(&bytes[..]));
        assert!(
            matches!(
                decoded,
                Err(FrameError::Invalid(InvalidMessage::StallTimeout(e))) if e == expected
            ),
            "{ms}: {decoded:?}"
        );
        let out = conns.lock().unwrap().get(&conn).cloned().unwrap();
        out.send(Out::Raw(bytes)).unwrap();
        // The Node closes the connection; no run reached its adapter.
        loop {
            match next(&mut seen).await {
                Seen::Closed(c) if c == conn => break,
                Seen::Frame(f) => panic!("the Node answered the invalid run: {f:?}"),
                _ => {}
            }
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            0,
            "{ms}: the adapter was called"
        );
    }

    // The Node registers again; a valid run reaches the adapter.
    let conn = ready(&mut seen).await;
    let out = conns.lock().unwrap().get(&conn).cloned().unwrap();
    out.send(Out::Frame(Box::new(run(9, "good")))).unwrap();
    loop {
        if let Seen::Frame(_) = next(&mut seen).await {
            break;
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    shutdown.cancel();
}
