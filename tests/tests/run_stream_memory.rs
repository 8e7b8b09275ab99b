//! What a stream whose reader stops really costs the Edge (#28): a Node streams one-byte
//! deltas as fast as it can to a caller that never reads (a run), or an upstream streams 16 KiB
//! chunks through a tunnel to one. Every allocation of this process is
//! counted (`cap`, the global allocator of this test binary): the growth while the stream
//! fills is held to its byte bound (`TransportConfig::max_stream_buffer`) plus a fixed slack,
//! and after the stream is ended (slow consumer) and dropped the memory comes back. A third
//! case sends one 6 MiB request body through a tunnel: the Edge's write buffer and the Node's
//! read buffer grow to it, and both give it back at the next liveness frame (before issue #33
//! they held it, 14 MiB in all, for as long as the Node stayed connected).
//!
//! Before the Edge counted what each buffered event holds (its queue slot and heap blocks), it
//! counted a one-byte delta as 65 bytes while it held about 300: the same probe grew by 5–6×
//! the bound (measured from outside as 21–26 MiB per stream against 4 MiB). A tunnel's bodies
//! are views of the frames that carried them, sharing the connection's read buffer: before a
//! body was copied out once its reader fell behind, the tunnel probe grew by 1.7× the bound.
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::alloc::System;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use cap::Cap;
use iop_edge::{EdgeHandle, TransportConfig};
use iop_node::{Adapter, AdapterError, AdapterRegistry, RunCompletion, RunEvents};
use iop_tests::node::bind_with_node;
use iop_tests::pki::Ca;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, NodeConfigPayload, ProviderStatus, RunEventKind, RunRequest,
};
use iop_wire::validate::ResponseStallTimeout;
use tokio_util::sync::CancellationToken;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

const LIMIT: Duration = Duration::from_secs(60);
/// The stream's byte bound.
const BOUND: usize = 2 << 20;
/// What else the process may allocate while the stream fills (TLS records, frame buffers,
/// channel blocks, the runtime's timers).
const SLACK: usize = 1 << 20;

/// Streams one-byte deltas without end until cancelled.
struct Firehose {
    sent: Arc<AtomicU64>,
}

#[async_trait]
impl Adapter for Firehose {
    async fn run(
        &self,
        _request: RunRequest,
        events: RunEvents,
    ) -> Result<RunCompletion, AdapterError> {
        loop {
            tokio::select! {
                () = events.cancelled() => return Err(AdapterError::Provider("cancelled".into())),
                open = events.delta("x") => {
                    if !open {
                        return Err(AdapterError::Provider("closed".into()));
                    }
                    self.sent.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    async fn probe(
        &self,
        _target: &str,
        _credential: Option<&iop_node::credential::UpstreamCredential>,
    ) -> ProviderStatus {
        ProviderStatus::Available
    }
}

async fn mesh(ca: &Ca, sent: Arc<AtomicU64>) -> (EdgeHandle, CancellationToken) {
    let tls = iop_tests::pki::edge_server_tls(ca, "edge-1");
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
    cfg.max_stream_buffer = BOUND;
    // Only the byte bound may end the stream.
    cfg.slow_consumer_timeout = Duration::from_secs(3600);
    cfg.node_configs = vec![(
        "node-1".into(),
        NodeConfigPayload {
            adapters: vec![AdapterConfig {
                name: "fire".into(),
                adapter_type: "firehose".into(),
                enabled: true,
                capacity: 1,
                long_context_capacity: 0,
                targets: vec!["m".into()],
                settings: AdapterSettings::None,
            }],
            ..Default::default()
        },
    )];
    let mut registry = AdapterRegistry::new();
    registry.register(
        "firehose",
        Arc::new(move |_: &AdapterConfig| {
            Ok(Arc::new(Firehose { sent: sent.clone() }) as Arc<dyn Adapter>)
        }),
    );
    bind_with_node(ca, cfg, registry).await
}

fn request(run_id: &str) -> RunRequest {
    RunRequest {
        run_id: run_id.into(),
        adapter: "fire".into(),
        target: "m".into(),
        input: bytes::Bytes::new(),
        metadata: Default::default(),
        response_stall_timeout: ResponseStallTimeout::from_wire_ms(60_000).unwrap(),
        timeout: None,
        long_context: false,
        credential: None,
        trace: None,
    }
}

/// The process's allocation peak from `baseline` until `edge` has ended one stream as a slow
/// consumer (nobody read it); its growth over `baseline` is checked against the bound.
async fn growth_until_cut(edge: &EdgeHandle, baseline: usize, what: &str) {
    let mut peak = baseline;
    loop {
        peak = peak.max(ALLOCATOR.allocated());
        if edge
            .metrics()
            .render(0, 0)
            .contains("iop_edge_slow_consumers_total 1")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let growth = peak.max(ALLOCATOR.allocated()).saturating_sub(baseline);
    println!(
        "{what}: the process grew by {} KiB at most (bound {} KiB + slack {} KiB)",
        growth >> 10,
        BOUND >> 10,
        SLACK >> 10
    );
    assert!(
        growth <= BOUND + SLACK,
        "a stalled {what} held {} KiB against its bound of {} KiB",
        growth >> 10,
        BOUND >> 10
    );
}

/// Waits (up to 30 s) for the process's allocations to come back near `baseline` after the
/// stream ended and was dropped.
async fn comes_back(baseline: usize, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let now = ALLOCATOR.allocated();
        if now <= baseline + SLACK / 2 {
            println!(
                "{what}: after the stream, {} KiB above the baseline",
                now.saturating_sub(baseline) >> 10
            );
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} KiB above the baseline after the {what} ended",
            now.saturating_sub(baseline) >> 10
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One test for both cases, one after the other: the allocator's count is the whole
/// process's, so two cases running at once would measure each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_streams_cost_their_bound_and_give_it_back() {
    a_run_stream_nobody_reads().await;
    a_tunnel_nobody_reads().await;
    a_large_request_gives_its_frame_buffers_back().await;
}

async fn a_run_stream_nobody_reads() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let sent = Arc::new(AtomicU64::new(0));
        let (edge, shutdown) = mesh(&ca, sent.clone()).await;
        // Warm up every path once (a short read stream), so the baseline holds the buffers a
        // connection keeps anyway.
        let mut warm = edge.run("node-1", request("warm")).await.unwrap();
        for _ in 0..100 {
            warm.next().await.unwrap();
        }
        drop(warm);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let baseline = ALLOCATOR.allocated();

        let mut stream = edge.run("node-1", request("stalled")).await.unwrap();
        // Nobody reads: wait for the Edge to end the stream at its bound (the Node's adapter
        // is cancelled then, and stops sending).
        growth_until_cut(&edge, baseline, "run stream").await;
        let deltas = sent.load(Ordering::Relaxed);
        println!("{deltas} one-byte deltas sent");
        assert!(deltas > 1_000, "the stream filled ({deltas} deltas)");
        // The reader sees what was delivered before the cut, then the slow-consumer terminal.
        let mut last = None;
        while let Some(ev) = stream.next().await {
            last = Some(ev);
        }
        let last = last.unwrap();
        assert_eq!(last.kind, RunEventKind::Error);
        assert!(last.error.contains("slow consumer"), "{}", last.error);
        drop(stream);
        // And the memory comes back (the buffer emptied, the Node's cancel settled).
        comes_back(baseline, "run stream").await;
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// An Edge bound with `cfg` and one Node whose `openai_compat` adapter `up` tunnels chat
/// completions to `base_url`, connected and ready.
async fn tunnel_mesh(
    ca: &Ca,
    mut cfg: TransportConfig,
    base_url: String,
) -> (EdgeHandle, CancellationToken) {
    use iop_wire::runtime::{ConcreteProtocolProfile, OpenAiCompatSettings, Operation};
    cfg.node_configs = vec![(
        "node-1".into(),
        NodeConfigPayload {
            adapters: vec![AdapterConfig {
                name: "up".into(),
                adapter_type: "openai_compat".into(),
                enabled: true,
                capacity: 2,
                long_context_capacity: 0,
                targets: vec![],
                settings: AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                    base_url,
                    protocol_profile: ConcreteProtocolProfile {
                        name: "openai".into(),
                        operation_paths: [(Operation::ChatCompletions, "/chat/completions".into())]
                            .into_iter()
                            .collect(),
                        ..Default::default()
                    },
                    request_timeout_sec: 0,
                }),
            }],
            ..Default::default()
        },
    )];
    bind_with_node(ca, cfg, AdapterRegistry::with_builtins()).await
}

/// The same for a tunnel: an OpenAI-style upstream streams 16 KiB chunks as fast as it can to
/// a caller that never reads. The growth is held to the bound plus the same slack.
async fn a_tunnel_nobody_reads() {
    use iop_tests::upstream::{Kind, Upstream};
    use iop_wire::runtime::{Header, Operation, ProviderTunnelRequest};
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let upstream = Upstream::start(Kind::ChatOnly, "", "firehose").await;
        let tls = iop_tests::pki::edge_server_tls(&ca, "edge-1");
        let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
        cfg.max_stream_buffer = BOUND;
        cfg.slow_consumer_timeout = Duration::from_secs(3600);
        // Credit off: the byte bound is what holds the Edge against a Node that does not
        // honour credit (an older one, or a hostile peer). With credit the Node would stop at
        // the window (`bins/tests/stream_credit.rs`).
        cfg.stream_window = 0;
        let (edge, shutdown) = tunnel_mesh(&ca, cfg, upstream.base_url()).await;
        let request = |id: &str| ProviderTunnelRequest {
            run_id: id.into(),
            adapter: "up".into(),
            target: "firehose".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers: vec![Header {
                name: "content-type".into(),
                value: bytes::Bytes::from_static(b"application/json"),
            }],
            body: bytes::Bytes::from_static(
                b"{\"model\":\"firehose\",\"stream\":true,\"messages\":[]}",
            ),
            stream: true,
            operation: Some(Operation::ChatCompletions),
            ..Default::default()
        };
        // Warm up: a stream read for a while, then dropped (its cancel settles).
        let mut warm = edge.tunnel("node-1", request("warm")).await.unwrap();
        for _ in 0..50 {
            warm.next().await.unwrap();
        }
        drop(warm);
        while upstream.dropped_count() < 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let baseline = ALLOCATOR.allocated();
        let stream = edge.tunnel("node-1", request("stalled")).await.unwrap();
        growth_until_cut(&edge, baseline, "tunnel").await;
        drop(stream);
        comes_back(baseline, "tunnel").await;
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// A provider that reads a request whole, drops it, and answers a small JSON body: it keeps
/// nothing of what it was sent (the shared fake upstream records every body).
async fn forgetful_upstream() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if socket.read_exact(&mut byte).await.is_err() {
                        return;
                    }
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
                let len: u64 = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                let mut rest = (&mut socket).take(len);
                tokio::io::copy(&mut rest, &mut tokio::io::sink())
                    .await
                    .unwrap();
                let body = br#"{"id":"x","object":"chat.completion","choices":[]}"#;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = socket.write_all(answer.as_bytes()).await;
                let _ = socket.write_all(body).await;
            });
        }
    });
    addr
}

/// A connection's frame buffers grow to the largest frame they carry. After a 6 MiB request
/// body went through (the Edge's write buffer, the Node's read buffer), both give the room
/// back at the next liveness frame: the process returns to its baseline within a few
/// heartbeat intervals (0.5 s here), instead of holding the body's size for as long as the
/// Node stays connected.
async fn a_large_request_gives_its_frame_buffers_back() {
    use iop_wire::liveness::HeartbeatConfig;
    use iop_wire::runtime::{Header, Operation, ProviderTunnelRequest};
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let upstream = forgetful_upstream().await;
        let tls = iop_tests::pki::edge_server_tls(&ca, "edge-1");
        let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
        cfg.registry.heartbeat = HeartbeatConfig::from_interval(Duration::from_millis(500));
        let (edge, shutdown) = tunnel_mesh(&ca, cfg, format!("http://{upstream}/v1")).await;
        let request = |id: &str, body: bytes::Bytes| ProviderTunnelRequest {
            run_id: id.into(),
            adapter: "up".into(),
            target: "m".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers: vec![Header {
                name: "content-type".into(),
                value: bytes::Bytes::from_static(b"application/json"),
            }],
            body,
            stream: false,
            operation: Some(Operation::ChatCompletions),
            ..Default::default()
        };
        let answered = |mut stream: iop_edge::TunnelStream| async move {
            let mut frames = 0;
            while stream.next().await.is_some() {
                frames += 1;
            }
            assert!(frames > 0, "the tunnel answered nothing");
        };
        // Warm up every path with a small request, and let a few pings pass.
        answered(
            edge.tunnel("node-1", request("warm", bytes::Bytes::from_static(b"{}")))
                .await
                .unwrap(),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let baseline = ALLOCATOR.allocated();
        let body = bytes::Bytes::from(vec![b' '; 6 << 20]);
        answered(edge.tunnel("node-1", request("large", body)).await.unwrap()).await;
        println!(
            "large request: {} KiB above the baseline once answered",
            ALLOCATOR.allocated().saturating_sub(baseline) >> 10
        );
        comes_back(baseline, "large request").await;
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}
