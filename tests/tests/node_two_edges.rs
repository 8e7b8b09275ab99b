//! One Node serving two Edges at once (issue #32), in process over real sockets: a fake
//! OpenAI-compatible upstream that counts the requests it serves at once, two Edges (each
//! configures the Node's adapter with capacity 4, and neither sees the other's leases), and
//! one Node with a session to each.
//!
//! Both Edges admit up to 4 at once onto the one Node: the Node's shared capacity gate must
//! hold the upstream to 4 (asserted at the upstream), refusing the excess with
//! `REFUSED_CAPACITY_EXHAUSTED`, and each Edge must send a refused request again until it
//! fits: no request fails.

#![allow(clippy::unwrap_used, reason = "tests")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use iop_edge::Edge;
use iop_edge::builder::{AdapterSpec, EdgeBuilder, EdgeTls, NodeSpec};
use iop_node::{AdapterRegistry, Node, NodeOptions};
use serde_json::json;
use workload_identity::dev_ca::DevCa;
use workload_identity::role;

#[derive(Default)]
struct Counts {
    now: AtomicUsize,
    max: AtomicUsize,
    served: AtomicUsize,
}

async fn chat(State(c): State<Arc<Counts>>) -> axum::Json<serde_json::Value> {
    let now = c.now.fetch_add(1, Ordering::SeqCst) + 1;
    c.max.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.now.fetch_sub(1, Ordering::SeqCst);
    c.served.fetch_add(1, Ordering::SeqCst);
    axum::Json(json!({
        "id": "c1", "object": "chat.completion", "created": 0, "model": "fake-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }))
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

async fn edge(ca: &DevCa, name: &str, upstream: &str) -> (Edge, SocketAddr) {
    edge_with(
        ca,
        name,
        AdapterSpec::openai_compat("upstream", upstream)
            .capacity(4)
            .serves("fake-model"),
    )
    .await
}

/// An Edge named `name` whose `node-1` has `adapter`, and its HTTP API's address.
async fn edge_with(ca: &DevCa, name: &str, adapter: AdapterSpec) -> (Edge, SocketAddr) {
    let config = EdgeBuilder::new(name)
        .listen_nodes(SocketAddr::from(([127, 0, 0, 1], 0)))
        .queue(Duration::from_secs(30), 1024)
        .node(NodeSpec::new("node-1").adapter(adapter))
        .build(EdgeTls::Material(ca.material(role::EDGE, name).unwrap()))
        .unwrap();
    let edge = Edge::start(config).await.unwrap();
    let http = serve(edge.router()).await;
    (edge, http)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_edges_admitting_onto_one_node_never_push_it_past_its_capacity() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let counts = Arc::new(Counts::default());
    let upstream = serve(
        Router::new()
            .route("/v1/chat/completions", axum::routing::post(chat))
            .with_state(counts.clone()),
    )
    .await;
    let base = format!("http://{upstream}/v1");
    let ca = DevCa::new().unwrap();
    let (a, a_http) = edge(&ca, "edge-1", &base).await;
    let (b, b_http) = edge(&ca, "edge-2", &base).await;
    let options = NodeOptions::new(
        "node-1",
        &a.node_addr().to_string(),
        "localhost",
        ca.node_tls("node-1", "edge-1").unwrap(),
    )
    .unwrap()
    .with_edge(
        &b.node_addr().to_string(),
        "localhost",
        ca.node_tls("node-1", "edge-2").unwrap(),
    )
    .unwrap()
    .with_adapters(AdapterRegistry::with_builtins());
    let node = Node::start(options);
    for e in [&a, &b] {
        let mut ready = false;
        for _ in 0..500 {
            if !e.handle().ready_nodes().is_empty() {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(ready, "node-1 ready on both Edges");
    }

    // 24 requests on each Edge at once: each Edge admits 4 at a time onto the Node.
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for http in [a_http, b_http] {
        for i in 0..24 {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let r = client
                    .post(format!("http://{http}/v1/chat/completions"))
                    .json(&json!({"model": "fake-model", "messages": [{"role": "user", "content": format!("hi {i}")}]}))
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            }));
        }
    }
    let mut failed = Vec::new();
    for t in tasks {
        let (status, body) = t.await.unwrap();
        if status != 200 {
            failed.push((status, body));
        }
    }
    let max = counts.max.load(Ordering::SeqCst);
    println!(
        "served {} requests; at most {max} at once at the upstream",
        counts.served.load(Ordering::SeqCst)
    );
    assert!(failed.is_empty(), "no request fails: {failed:?}");
    assert_eq!(
        counts.served.load(Ordering::SeqCst),
        48,
        "each request reached the upstream once"
    );
    assert!(
        max <= 4,
        "the Node ran {max} at once, over its capacity of 4"
    );
    assert_eq!(max, 4, "both Edges' load filled the Node's capacity");
    node.stop().await;
    a.shutdown().await;
    b.shutdown().await;
}

/// The same for normalized runs (the `demo` adapter, capacity 2, 20 ms a word): refused runs
/// are sent again, and every request is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_refused_for_capacity_are_sent_again() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = DevCa::new().unwrap();
    let demo = || {
        AdapterSpec::demo("demo")
            .capacity(2)
            .option("delay_ms", "20")
            .serves("demo")
    };
    let (a, a_http) = edge_with(&ca, "edge-1", demo()).await;
    let (b, b_http) = edge_with(&ca, "edge-2", demo()).await;
    let node = Node::start(
        NodeOptions::new(
            "node-1",
            &a.node_addr().to_string(),
            "localhost",
            ca.node_tls("node-1", "edge-1").unwrap(),
        )
        .unwrap()
        .with_edge(
            &b.node_addr().to_string(),
            "localhost",
            ca.node_tls("node-1", "edge-2").unwrap(),
        )
        .unwrap()
        .with_adapters(AdapterRegistry::with_builtins()),
    );
    for e in [&a, &b] {
        for _ in 0..500 {
            if !e.handle().ready_nodes().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            !e.handle().ready_nodes().is_empty(),
            "node-1 ready on both Edges"
        );
    }
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for http in [a_http, b_http] {
        for _ in 0..8 {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let r = client
                    .post(format!("http://{http}/v1/chat/completions"))
                    .json(&json!({"model": "demo", "messages": [{"role": "user", "content": "one two three four"}]}))
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            }));
        }
    }
    let mut failed = Vec::new();
    for t in tasks {
        let (status, body) = t.await.unwrap();
        if status != 200 {
            failed.push((status, body));
        }
    }
    assert!(failed.is_empty(), "no run fails: {failed:?}");
    node.stop().await;
    a.shutdown().await;
    b.shutdown().await;
}
