//! The served `ReportRuntime` (decoded straight into canonical counters, `grpc::report`)
//! answers every request as the generated prost server over the same controller does: the same
//! status code and message, or the same response, and the same stored runtime. Requests include
//! malformed bytes, sent through a raw-bytes codec; for those both answer `INTERNAL`, and only
//! the code is compared, as each decoder words its own message (prost's names the message
//! type, ours the field; neither quotes the input).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf as _, BufMut as _};
use proxypool_controller::domain::{
    ControlStore, Service, ServiceConfig, SnapshotReference, SnapshotTuple,
};
use proxypool_controller::grpc::Controller;
use proxypool_controller::grpc::report::{REPORT_RUNTIME_PATH, WorkerControlPlaneService};
use proxypool_controller::memory::MemoryStore;
use proxypool_controller::metrics::Metrics;
use proxypool_controller::proto::controlplane as pb;
use proxypool_controller::proto::controlplane::worker_control_plane_client::WorkerControlPlaneClient;
use proxypool_controller::proto::controlplane::worker_control_plane_server::WorkerControlPlaneServer;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;

/// Sends raw message bytes, reads a `ReportRuntimeResponse`.
#[derive(Clone, Copy, Debug, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = pb::ReportRuntimeResponse;
    type Encoder = Self;
    type Decoder = Self;
    fn encoder(&mut self) -> Self {
        Self
    }
    fn decoder(&mut self) -> Self {
        Self
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = pb::ReportRuntimeResponse;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut DecodeBuf<'_>,
    ) -> Result<Option<pb::ReportRuntimeResponse>, tonic::Status> {
        let bytes = src.copy_to_bytes(src.remaining());
        prost::Message::decode(bytes)
            .map(Some)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}

const MAX_COUNTERS: usize = 5;

/// A controller over its own memory store, served one way or the other; the store, a client
/// and a raw caller.
async fn serve(fast: bool) -> (MemoryStore, WorkerControlPlaneClient<Channel>, Channel) {
    let store = MemoryStore::default();
    let config = ServiceConfig {
        max_runtime_counters: MAX_COUNTERS,
        ..ServiceConfig::default()
    };
    let service = Arc::new(Service::new(Arc::new(store.clone()), config));
    let controller = Controller::new(service, Arc::new(Metrics::default()), false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let router = if fast {
        tonic::transport::Server::builder()
            .add_service(WorkerControlPlaneService::new(controller, 1 << 20))
    } else {
        tonic::transport::Server::builder().add_service(
            WorkerControlPlaneServer::new(controller)
                .max_decoding_message_size(1 << 20)
                .max_encoding_message_size(1 << 20),
        )
    };
    tokio::spawn(router.serve_with_incoming(incoming));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    (
        store,
        WorkerControlPlaneClient::new(channel.clone()),
        channel,
    )
}

/// An answer, comparable across the two servers.
type Answer = Result<(u64, bool), (tonic::Code, String)>;

async fn raw(channel: &Channel, bytes: Vec<u8>) -> Answer {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    grpc.unary(
        tonic::Request::new(bytes),
        http::uri::PathAndQuery::from_static(REPORT_RUNTIME_PATH),
        RawCodec,
    )
    .await
    .map(|r| {
        let r = r.into_inner();
        (r.ownership_epoch, r.require_full_snapshot)
    })
    .map_err(|s| (s.code(), s.message().to_owned()))
}

fn counters(ids: &[(&str, i64)]) -> Vec<pb::ProxyCounters> {
    ids.iter()
        .map(|(id, n)| pb::ProxyCounters {
            proxy_id: (*id).into(),
            in_flight: *n,
            open_connections: 1,
        })
        .collect()
}

/// Registers `w1`, publishes and acknowledges version 1, then sends every request below;
/// returns each answer and the stored runtime after each.
async fn script(fast: bool) -> Vec<(Answer, Option<Vec<u8>>)> {
    let (store, mut c, channel) = serve(fast).await;
    let sid = c
        .register_worker(pb::RegisterWorkerRequest {
            worker_id: "w1".into(),
            instance_id: "i".into(),
            supported_protocol_version: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .session_id;
    let report = |seq: u64, ids: &[(&str, i64)]| pb::ReportRuntimeRequest {
        worker_id: "w1".into(),
        session_id: sid.clone(),
        sequence: seq,
        snapshot_version: 1,
        ownership_epoch: 1,
        observed_at_unix_ms: 1_700_000_000_000,
        counters: counters(ids),
    };
    // Before the ACK: a full snapshot is required.
    let mut requests = vec![report(1, &[("a", 1)])];
    let mut after_ack = vec![
        report(2, &[("b", 1), ("a", 2)]),
        // Replay, conflict, stale, invalid sequence, then a heartbeat.
        report(2, &[("a", 2), ("b", 1)]),
        report(2, &[("a", 3)]),
        report(1, &[]),
        report(0, &[]),
        report(3, &[]),
        // Each refusal of the counters, and the order between them.
        report(
            4,
            &[("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1)],
        ),
        report(4, &[("a", 1), ("a", 1)]),
        report(4, &[("b c", 1), ("a", -1)]),
        report(4, &[("a", -1), ("b c", 1)]),
        report(4, &[("z", 1), ("y", 2), ("x", 3)]),
    ];
    let mut bad_worker = report(5, &[("bad id", 1)]);
    bad_worker.worker_id = "bad worker".into();
    after_ack.push(bad_worker);
    let mut short_session = report(5, &[]);
    short_session.session_id = vec![1; 15].into();
    after_ack.push(short_session);
    let mut no_time = report(5, &[]);
    no_time.observed_at_unix_ms = -5;
    after_ack.push(no_time);
    requests.append(&mut after_ack);
    let mut out = Vec::new();
    for (i, r) in requests.into_iter().enumerate() {
        if i == 1 {
            store
                .record_issued_snapshot(
                    "w1",
                    SnapshotReference {
                        tuple: SnapshotTuple {
                            ownership_epoch: 1,
                            version: 1,
                        },
                        checksum: [1; 32],
                    },
                    Duration::from_secs(60),
                )
                .await
                .unwrap();
            let a = c
                .acknowledge_snapshot(pb::AcknowledgeSnapshotRequest {
                    worker_id: "w1".into(),
                    session_id: sid.clone(),
                    snapshot_version: 1,
                    ownership_epoch: 1,
                    checksum: vec![1; 32].into(),
                    applied: true,
                    ..Default::default()
                })
                .await
                .unwrap();
            assert!(!a.into_inner().require_full_snapshot);
        }
        let answer = raw(&channel, prost::Message::encode_to_vec(&r)).await;
        out.push((answer, stored(&store)));
    }
    // Malformed: bad UTF-8 in a proxy id, a truncated message, a wrong wire type.
    let mut bad_utf8 = prost::Message::encode_to_vec(&report(9, &[("a", 1)]));
    let at = bad_utf8.iter().rposition(|&b| b == b'a').unwrap();
    bad_utf8[at] = 0xff;
    let mut truncated = prost::Message::encode_to_vec(&report(9, &[("a", 1)]));
    truncated.pop();
    for bytes in [bad_utf8, truncated, vec![0x1a, 0x01]] {
        let answer = raw(&channel, bytes).await;
        // Decode errors differ in wording between prost and our decoder: compare the code.
        let answer = answer.map_err(|(code, _)| (code, String::new()));
        out.push((answer, stored(&store)));
    }
    out
}

fn stored(store: &MemoryStore) -> Option<Vec<u8>> {
    store.runtime("w1").map(|r| r.counters.canonical().to_vec())
}

#[tokio::test]
async fn served_report_runtime_answers_as_the_generated_server() {
    let fast = script(true).await;
    let generated = script(false).await;
    assert_eq!(fast.len(), generated.len());
    for (i, (f, g)) in fast.iter().zip(&generated).enumerate() {
        assert_eq!(f, g, "request {i}");
    }
    // The script reaches every kind of answer.
    let codes: Vec<_> = fast
        .iter()
        .map(|(a, _)| a.as_ref().err().map(|(c, _)| *c))
        .collect();
    for code in [
        tonic::Code::Aborted,
        tonic::Code::AlreadyExists,
        tonic::Code::InvalidArgument,
        tonic::Code::Internal,
    ] {
        assert!(codes.contains(&Some(code)), "{code:?} in {codes:?}");
    }
    assert!(fast.iter().any(|(a, _)| a == &Ok((1, true))));
    assert_eq!(
        fast[1].1.as_deref(),
        Some(&b"a 2 1\nb 1 1\n"[..]),
        "sorted on the way in"
    );
}
