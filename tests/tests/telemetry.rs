//! `iop-telemetry` against a real OTLP receiver (the in-process collector of
//! `iop_tests::otlp`), over HTTP/protobuf and gRPC: parent/child order across a "wire" hop,
//! the resource's service name, attributes and events, and a dead collector's spans counted,
//! never waited for.

#![allow(clippy::unwrap_used, reason = "tests")]

use std::time::Duration;

use iop_telemetry::{KeyValue, Protocol, SpanKind, Telemetry, TelemetryConfig, attr};
use iop_tests::otlp::Collector;
use iop_wire::trace::TraceContext;

const CLIENT: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn config(endpoint: &str, protocol: Protocol) -> TelemetryConfig {
    let mut c = TelemetryConfig::default();
    c.endpoint = Some(endpoint.to_owned());
    c.protocol = Some(protocol);
    c.service_name = Some("edge-under-test".into());
    c
}

async fn one_trace_over(protocol: Protocol) {
    let collector = Collector::start().await;
    let endpoint = match protocol {
        Protocol::Grpc => collector.grpc.clone(),
        Protocol::HttpProtobuf => collector.http.clone(),
    };
    let edge = Telemetry::start(&config(&endpoint, protocol), "x").unwrap();
    let node = Telemetry::start(&config(&endpoint, protocol), "x").unwrap();
    let client = TraceContext::parse(CLIENT, Some(b"congo=t61rcWkgMzE")).unwrap();
    let mut server = edge.span(
        "POST /v1/chat/completions",
        SpanKind::Server,
        Some(&client),
        vec![attr::operation("chat"), attr::request_model("m")],
    );
    let attempt = edge.child(&server, "chat m", SpanKind::Client, vec![attr::attempt(1)]);
    // The hop: only the wire form crosses.
    let wire = attempt.context().unwrap();
    let mut exec = node.span("execute", SpanKind::Server, Some(&wire), Vec::new());
    exec.event("response_stalled", vec![KeyValue::new("idle_ms", 5_i64)]);
    let provider = node.child(&exec, "chat m", SpanKind::Client, Vec::new());
    let sent = provider.context().unwrap();
    server.set(attr::input_tokens(7));
    server.fail("timeout");
    drop((provider, exec, attempt, server));
    edge.flush().await;
    node.flush().await;
    let spans = collector
        .wait_for(Duration::from_secs(10), |s| s.len() >= 4)
        .await;
    assert_eq!(spans.len(), 4, "{spans:#?}");
    let by_name = |n: &str, kind: i32| {
        spans
            .iter()
            .find(|s| s.name == n && s.kind == kind)
            .unwrap_or_else(|| panic!("{n} kind {kind} in {spans:#?}"))
    };
    let server = by_name("POST /v1/chat/completions", 2);
    let attempt = by_name("chat m", 3);
    let exec = by_name("execute", 2);
    let provider = spans
        .iter()
        .find(|s| s.name == "chat m" && s.parent_span_id == exec.span_id)
        .unwrap();
    for s in &spans {
        assert_eq!(
            s.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736",
            "continued the client's"
        );
        assert_eq!(s.service, "edge-under-test");
    }
    assert_eq!(
        server.parent_span_id, "00f067aa0ba902b7",
        "the client's span"
    );
    assert_eq!(attempt.parent_span_id, server.span_id);
    assert_eq!(exec.parent_span_id, attempt.span_id, "across the wire");
    assert_eq!(provider.parent_span_id, exec.span_id);
    assert_eq!(
        sent.traceparent(),
        format!("00-{}-{}-01", provider.trace_id, provider.span_id)
    );
    assert_eq!(server.attr("gen_ai.usage.input_tokens"), Some("7"));
    assert_eq!(server.attr("error.type"), Some("timeout"));
    assert_eq!(server.status, 2);
    assert_eq!(exec.events, ["response_stalled"]);
    let stats = edge.stats();
    assert_eq!((stats.exported, stats.dropped, stats.failed), (2, 0, 0));
}

#[tokio::test]
async fn one_trace_over_http_protobuf() {
    one_trace_over(Protocol::HttpProtobuf).await;
}

#[tokio::test]
async fn one_trace_over_grpc() {
    one_trace_over(Protocol::Grpc).await;
}

/// A collector that is not there: every span is counted once, as exported, dropped (the queue
/// was full) or failed (the export did not reach it), and making spans never waits on it.
#[tokio::test]
async fn a_dead_collector_costs_counted_spans_not_waits() {
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    let mut c = config(&format!("http://{addr}"), Protocol::HttpProtobuf);
    c.queue_max = Some(4);
    let t = Telemetry::start(&c, "x").unwrap();
    let started = std::time::Instant::now();
    for _ in 0..1000 {
        drop(t.span("s", SpanKind::Internal, None, Vec::new()));
    }
    // A generous bound that only a blocking queue would miss (1000 exports to a dead port).
    assert!(started.elapsed() < Duration::from_secs(5));
    t.flush().await;
    let s = t.stats();
    assert_eq!(s.exported, 0);
    assert!(s.dropped >= 1000 - 2 * 4, "{s:?}");
    assert_eq!(s.dropped + s.failed, 1000, "{s:?}");
}

/// Unsampled parents are not recorded, but their trace id still goes to the next hop.
#[tokio::test]
async fn an_unsampled_parent_is_followed() {
    let collector = Collector::start().await;
    let t = Telemetry::start(&config(&collector.http, Protocol::HttpProtobuf), "x").unwrap();
    let parent = TraceContext::parse(
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        None,
    )
    .unwrap();
    let s = t.span("x", SpanKind::Server, Some(&parent), Vec::new());
    assert!(!s.is_recording());
    let next = s.context().unwrap();
    assert_eq!(next.trace_id, parent.trace_id);
    assert!(!next.sampled());
    drop(s);
    t.flush().await;
    assert_eq!(t.stats().exported, 0);
    assert!(collector.spans().is_empty());
}
