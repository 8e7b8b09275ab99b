//! The controller's HTTP/2 surface as a raw client sees it (the `h2` crate, no gRPC library):
//! seed 004 §6's concurrent-stream limit, and §2's rule that duplicate label keys on the wire
//! are normalised to the last value before the Service validates the unique key set.
//!
//! - With `maxConcurrentStreams = 2`, a third request on the connection cannot start while
//!   two are open (the server's SETTINGS hold the client to two); it runs once one ends.
//! - Keepalive enforcement: pings between calls are answered; a client that keeps pinging
//!   faster than `controlPlane.minPingInterval` with no call between is disconnected.
//! - A `RegisterWorker` whose `labels` map carries 33 entries with one key twice (32 unique
//!   keys) is accepted, and the same with 33 unique keys is refused `INVALID_ARGUMENT` (at most
//!   32 labels): the limit counts decoded keys, not wire entries.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use prost::Message as _;
use proxypool_controller::config::{Config, File};
use proxypool_controller::memory::MemoryStore;
use proxypool_controller::proto::controlplane as pb;
use proxypool_controller::server::{Running, start_with};
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(30);
const REGISTER: &str = "/controlplane.v1.WorkerControlPlane/RegisterWorker";

fn config() -> Config {
    let text = "[controlPlane]\nenabled = true\nlisten = \"127.0.0.1:0\"\nmaxConcurrentStreams = 2\nshutdownTimeout = \"2s\"\n[redis]\nurl = \"redis://unused\"\n";
    File::parse(text).unwrap().validate().unwrap()
}

async fn controller() -> (Running, CancellationToken) {
    let stop = CancellationToken::new();
    let s = stop.clone();
    let running = start_with(&config(), Arc::new(MemoryStore::default()), async move {
        s.cancelled().await
    })
    .await
    .unwrap();
    (running, stop)
}

async fn connect(running: &Running) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(running.grpc_addr)
        .await
        .unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    send
}

fn grpc_request(path: &str) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// One unary call: the message framed (no compression), the grpc-status answered.
async fn unary(send: &mut h2::client::SendRequest<Bytes>, path: &str, message: &[u8]) -> String {
    let mut send = send.clone().ready().await.unwrap();
    let (response, mut body) = send.send_request(grpc_request(path), false).unwrap();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(message);
    body.send_data(Bytes::from(framed), true).unwrap();
    let response = response.await.unwrap();
    let (head, mut body) = response.into_parts();
    if let Some(status) = head.headers.get("grpc-status") {
        return status.to_str().unwrap().to_owned(); // trailers-only answer
    }
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let trailers = body.trailers().await.unwrap().unwrap();
    trailers["grpc-status"].to_str().unwrap().to_owned()
}

/// A `RegisterWorkerRequest` with `labels` written entry by entry, as a peer may put them on
/// the wire (field 4, one length-delimited map entry each: key = 1, value = 2).
fn register_with_labels(entries: &[(String, String)]) -> Vec<u8> {
    let mut bytes = pb::RegisterWorkerRequest {
        worker_id: "w-1".into(),
        instance_id: "inst-1".into(),
        zone: String::new(),
        labels: Default::default(),
        supported_protocol_version: 1,
    }
    .encode_to_vec();
    for (k, v) in entries {
        let mut entry = vec![0x0a, u8::try_from(k.len()).unwrap()];
        entry.extend_from_slice(k.as_bytes());
        entry.extend_from_slice(&[0x12, u8::try_from(v.len()).unwrap()]);
        entry.extend_from_slice(v.as_bytes());
        bytes.extend_from_slice(&[(4 << 3) | 2, u8::try_from(entry.len()).unwrap()]);
        bytes.extend_from_slice(&entry);
    }
    bytes
}

#[tokio::test]
async fn a_third_stream_waits_for_the_concurrent_stream_limit() {
    tokio::time::timeout(LIMIT, async {
        let (running, stop) = controller().await;
        let mut send = connect(&running).await;
        // One whole call first: the server's SETTINGS (its stream limit) have arrived.
        assert_eq!(
            unary(&mut send, REGISTER, &register_with_labels(&[])).await,
            "0"
        );
        // Two requests whose bodies never end hold both streams.
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut ready = send.clone().ready().await.unwrap();
            let (response, body) = ready.send_request(grpc_request(REGISTER), false).unwrap();
            held.push((response, body));
        }
        // A third cannot start while two are open (the client waits for a stream slot, as the
        // server's SETTINGS demand)...
        let third = {
            let send = send.clone();
            tokio::spawn(async move {
                let mut send = send;
                unary(&mut send, REGISTER, &register_with_labels(&[])).await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !third.is_finished(),
            "a third stream ran beside two open ones"
        );
        // ...and runs once one of them ends (reset by the client).
        let (_, mut body) = held.pop().unwrap();
        body.send_reset(h2::Reason::CANCEL);
        assert_eq!(third.await.unwrap(), "0", "the third call succeeded");
        drop(held);
        stop.cancel();
        running.wait().await.unwrap();
    })
    .await
    .expect("in time");
}

#[tokio::test]
async fn duplicate_label_keys_count_once() {
    tokio::time::timeout(LIMIT, async {
        let (running, stop) = controller().await;
        let mut send = connect(&running).await;
        let unique: Vec<(String, String)> = (0..33)
            .map(|i| (format!("k{i}"), format!("v{i}")))
            .collect();
        // 33 unique keys: over the limit of 32.
        assert_eq!(
            unary(&mut send, REGISTER, &register_with_labels(&unique)).await,
            "3",
            "INVALID_ARGUMENT"
        );
        // 33 wire entries, one key twice: 32 unique keys, accepted.
        let mut duplicated = unique[..32].to_vec();
        duplicated.push(("k0".into(), "last".into()));
        assert_eq!(
            unary(&mut send, REGISTER, &register_with_labels(&duplicated)).await,
            "0",
            "OK"
        );
        stop.cancel();
        running.wait().await.unwrap();
    })
    .await
    .expect("in time");
}

/// Seed 004 §6's keepalive enforcement (`controlPlane.minPingInterval`, 10 s by default): a
/// client may ping between its calls, but one that keeps pinging faster than the interval with
/// no call between is disconnected on its third strike; its next connection is served.
#[tokio::test]
async fn a_client_that_pings_too_often_is_disconnected() {
    tokio::time::timeout(LIMIT, async {
        let (running, stop) = controller().await;
        let tcp = tokio::net::TcpStream::connect(running.grpc_addr)
            .await
            .unwrap();
        let (mut send, mut connection) = h2::client::handshake(tcp).await.unwrap();
        let mut pings = connection.ping_pong().expect("taken once");
        let connection = tokio::spawn(connection);
        // Two pings between calls: one strike each round, cleared by the next call.
        for _ in 0..5 {
            for _ in 0..2 {
                pings.ping(h2::Ping::opaque()).await.unwrap();
            }
            assert_eq!(
                unary(&mut send, REGISTER, &register_with_labels(&[])).await,
                "0"
            );
        }
        // Back to back with no call (the last ping was just before the last call, so each is
        // a strike): the two strikes tolerated are answered, the third ends the connection.
        let mut answered = 0;
        for _ in 0..4 {
            if pings.ping(h2::Ping::opaque()).await.is_err() {
                break;
            }
            answered += 1;
        }
        assert_eq!(answered, 2);
        let _ = connection.await.unwrap();
        // The policy is per connection: a new one is served.
        let mut again = connect(&running).await;
        assert_eq!(
            unary(&mut again, REGISTER, &register_with_labels(&[])).await,
            "0"
        );
        stop.cancel();
    })
    .await
    .unwrap();
}
