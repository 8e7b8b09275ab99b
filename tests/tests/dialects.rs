//! The HTTP surface in each route's dialect, over real sockets and mTLS, with an Edge built from
//! a configuration file by `iop_edge::config` and a Node holding the upstream keys itself:
//!
//! - an upstream's error on a translated route keeps its status and message in the route's
//!   dialect; on a passthrough the upstream's own status and body come back;
//! - a model whose provider serves none of the route's operations gets 400
//!   `unsupported_operation` in the route's dialect naming the model and the operation — never
//!   502;
//! - unknown paths, wrong methods, bodies over the limit and bad or missing keys get the
//!   route's dialect (Anthropic's shape and types on `/v1/messages*`);
//! - a client that disconnects cancels the upstream request on every route, passed through or
//!   translated;
//! - a passed-through stream whose provider stalls after it started ends with an error event in
//!   the route's dialect (the Node's stall watchdog), not with a bare cut.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::time::Duration;

use iop_edge::config::EdgeConfigFile;
use iop_edge::{Lifecycle, bind, http};
use iop_node::credential::LocalKey;
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::{self, Ca};
use iop_tests::upstream::{Kind, Upstream};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const KEY: &str = "gw-dialects-key";
const UPSTREAM_KEY: &str = "sk-dialects-upstream";
const LIMIT: Duration = Duration::from_secs(30);

struct Mesh {
    base: String,
    chat: Upstream,
    anthropic: Upstream,
    _dir: std::path::PathBuf,
}

async fn mesh() -> Mesh {
    let chat = Upstream::start(Kind::ChatOnly, UPSTREAM_KEY, "fake-model").await;
    let anthropic = Upstream::start(Kind::Anthropic, UPSTREAM_KEY, "fake-model").await;
    let ca = Ca::new("dialects CA");
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "iop-dialects-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let edge_leaf = ca.workload(role::EDGE, "edge-1", true);
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("edge.pem"), &edge_leaf.cert_pem).unwrap();
    std::fs::write(dir.join("edge.key"), &edge_leaf.key_pem).unwrap();
    let provider = |model: &str, adapter: &str, target: &str| {
        format!(
            "[[models]]\nname = \"{model}\"\n[[models.providers]]\nnode_id = \"node-1\"\nprovider_id = \"{model}\"\nadapter = \"{adapter}\"\ntarget = \"{target}\"\ncapacity = 4\n"
        )
    };
    // A provider whose stalls the Node's watchdog ends after 1 s of silence.
    let stalling = |model: &str, adapter: &str| {
        let mut p = provider(model, adapter, "hang");
        p.push_str("response_stall_timeout_sec = 1\n");
        p
    };
    let text = format!(
        r#"edge_id = "edge-1"
[listen]
nodes = "127.0.0.1:0"
http = "127.0.0.1:0"
[tls]
trust_domain = "{td}"
ca = "{d}/ca.pem"
cert = "{d}/edge.pem"
key = "{d}/edge.key"
[pool]
queue_wait_sec = 5
[[nodes]]
node_id = "node-1"
[[nodes.adapters]]
name = "chat"
type = "openai_compat"
base_url = "{chat}"
capacity = 8
[[nodes.adapters]]
name = "anth"
type = "openai_compat"
base_url = "{anth}"
profile = "anthropic"
capacity = 8
[[nodes.adapters]]
name = "listing"
type = "openai_compat"
base_url = "{chat}"
operations = {{ models = "/models" }}
capacity = 8
{p1}{p2}{p3}{p4}{p5}{p6}{p7}{p8}"#,
        td = pki::TRUST_DOMAIN,
        d = dir.display(),
        chat = chat.base_url(),
        anth = anthropic.base_url(),
        p1 = provider("via-chat", "chat", "fake-model"),
        p2 = provider("via-anth", "anth", "fake-model"),
        p3 = provider("chat-missing", "chat", "missing-model"),
        p4 = provider("slow-chat", "chat", "slow"),
        p5 = provider("slow-anth", "anth", "slow"),
        p6 = provider("nothing", "listing", "fake-model"),
        p7 = stalling("hang-chat", "chat"),
        p8 = stalling("hang-anth", "anth"),
    );
    // A custom profile must serve a route; the `listing` adapter only lists models.
    let err = EdgeConfigFile::parse(&text).unwrap().build().unwrap_err();
    assert!(
        err.to_string()
            .starts_with("nodes.adapters.operations: a profile needs"),
        "{err}"
    );
    let text = text.replace(
        "operations = { models = \"/models\" }",
        "operations = { models = \"/models\", responses = \"/responses\" }",
    );
    let mut built = EdgeConfigFile::parse(&text).unwrap().build().unwrap();
    built.http.api_keys = Some(std::sync::Arc::new(http::ApiKeys::new([KEY])));
    let (edge, _) = bind(built.transport).await.unwrap();
    let mut life = edge.subscribe();
    let tls = pki::node_client_tls(&ca, role::NODE, "node-1", "edge-1");
    let key = || LocalKey::new(UPSTREAM_KEY.as_bytes().to_vec()).unwrap();
    let opts = NodeOptions::new("node-1", &edge.local_addr().to_string(), "localhost", tls)
        .unwrap()
        .with_adapters(AdapterRegistry::with_builtins())
        .with_local_key("chat", key())
        .with_local_key("anth", key());
    tokio::spawn(run_node(opts, CancellationToken::new()));
    while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
    let app = http::router(edge, built.http);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(http::serve(listener, app, std::future::pending()));
    Mesh {
        base,
        chat,
        anthropic,
        _dir: dir,
    }
}

fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(format!("{base}{path}"))
        .bearer_auth(KEY)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn anthropic_error(v: &Value, kind: &str) {
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], kind, "{v}");
}

#[tokio::test]
async fn upstream_errors_keep_their_status_in_the_routes_dialect() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        let msgs = json!({"model": "chat-missing", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
        // Translated (Messages over chat): the upstream's 404 and its message, Anthropic shape.
        let (status, v) = post(&m.base, "/v1/messages", &msgs).await;
        assert_eq!(status, 404);
        anthropic_error(&v, "not_found_error");
        assert_eq!(v["error"]["message"], "The model `missing-model` does not exist.");
        // Translated (Responses over chat): OpenAI shape, same status and message.
        let (status, v) = post(&m.base, "/v1/responses", &json!({"model": "chat-missing", "input": "hi"})).await;
        assert_eq!(status, 404);
        assert_eq!(v["error"]["message"], "The model `missing-model` does not exist.");
        // Passthrough: the upstream's own body, byte for byte (its own code field included).
        let (status, v) = post(&m.base, "/v1/chat/completions", &json!({"model": "chat-missing", "messages": []})).await;
        assert_eq!(status, 404);
        assert_eq!(v["error"]["code"], "model_not_found");
        // Anthropic upstream refusing (max_tokens missing on a passthrough).
        let (status, v) = post(&m.base, "/v1/messages", &json!({"model": "via-anth", "messages": []})).await;
        assert_eq!(status, 400);
        anthropic_error(&v, "invalid_request_error");
        assert_eq!(v["error"]["message"], "max_tokens: Field required");
        // A passthrough carries the client's anthropic-beta header, and no other of its headers.
        let r = client()
            .post(format!("{}/v1/messages", m.base))
            .header("x-api-key", KEY)
            .header("anthropic-beta", "interleaved-thinking-2025-05-14")
            .header("x-client-secret", "not-for-upstream")
            .json(&json!({"model": "via-anth", "max_tokens": 8, "messages": [{"role": "user", "content": "beta"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let sent = m.anthropic.seen().into_iter().rev().find(|s| s.path == "/v1/messages").unwrap();
        assert_eq!(sent.header("anthropic-beta"), Some("interleaved-thinking-2025-05-14"));
        assert_eq!(sent.header("x-client-secret"), None);
        assert_eq!(sent.header("x-api-key"), Some(UPSTREAM_KEY), "the Node's key, not the client's");
        // A provider's redirect comes back to the client as it was sent; the Node does not
        // follow it (it would carry the Node's key in `x-api-key` wherever it points).
        let no_follow = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let r = no_follow
            .post(format!("{}/v1/messages", m.base))
            .header("x-api-key", KEY)
            .json(&json!({"model": "via-anth", "max_tokens": 8, "messages": [{"role": "user", "content": "redirect me"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 307);
        assert_eq!(r.headers()["location"], "/v1/elsewhere");
        assert!(
            m.anthropic.seen().iter().all(|s| s.path != "/v1/elsewhere"),
            "the redirect was not followed"
        );
        // Translated chat → Anthropic: the default max_tokens is supplied, so it succeeds.
        let (status, v) = post(&m.base, "/v1/chat/completions", &json!({"model": "via-anth", "messages": [{"role": "user", "content": "hi"}]})).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"], "echo: hi");
        let sent = m.anthropic.seen().into_iter().rev().find(|s| s.path == "/v1/messages").unwrap();
        assert_eq!(sent.json()["max_tokens"], 4096);
        assert_eq!(sent.json()["model"], "fake-model", "the external name became the target");
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn unservable_operations_unknown_paths_and_limits_answer_in_the_routes_dialect() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        // `nothing` lists models and passes responses through, nothing else: 400, not 502.
        let (status, v) = post(
            &m.base,
            "/v1/chat/completions",
            &json!({"model": "nothing", "messages": []}),
        )
        .await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (400, Some("unsupported_operation"))
        );
        let text = v["error"]["message"].as_str().unwrap();
        assert!(
            text.contains("`nothing`") && text.contains("`chat_completions`"),
            "{text}"
        );
        let (status, v) = post(
            &m.base,
            "/v1/messages",
            &json!({"model": "nothing", "max_tokens": 4, "messages": []}),
        )
        .await;
        assert_eq!(status, 400);
        anthropic_error(&v, "invalid_request_error");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("`messages`")
        );
        // Unknown model: 404 in each shape.
        let (status, v) = post(
            &m.base,
            "/v1/messages",
            &json!({"model": "nope", "max_tokens": 4, "messages": []}),
        )
        .await;
        assert_eq!(status, 404);
        anthropic_error(&v, "not_found_error");
        let (status, v) = post(
            &m.base,
            "/v1/responses",
            &json!({"model": "nope", "input": "x"}),
        )
        .await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (404, Some("model_not_found"))
        );
        // Unknown paths and wrong methods.
        let (status, v) = post(&m.base, "/v1/messages/batches", &json!({})).await;
        assert_eq!(status, 404);
        anthropic_error(&v, "not_found_error");
        let (status, v) = post(&m.base, "/v1/embeddings", &json!({})).await;
        assert_eq!(
            (status, v["error"]["type"].as_str()),
            (404, Some("invalid_request_error"))
        );
        let r = client()
            .get(format!("{}/v1/messages", m.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 405);
        anthropic_error(&r.json().await.unwrap(), "invalid_request_error");
        // Limits: a body over 8 MiB.
        let big = vec![b'x'; http::MAX_REQUEST_BODY + 1];
        let r = client()
            .post(format!("{}/v1/messages", m.base))
            .header("x-api-key", KEY)
            .body(big)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 413);
        anthropic_error(&r.json().await.unwrap(), "request_too_large");
        // Keys: missing, wrong, and the accepted forms.
        let r = client()
            .post(format!("{}/v1/messages", m.base))
            .json(&json!({"model": "via-chat"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
        anthropic_error(&r.json().await.unwrap(), "authentication_error");
        let r = client()
            .post(format!("{}/v1/chat/completions", m.base))
            .header("authorization", "Bearer wrong")
            .json(&json!({"model": "via-chat", "messages": []}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            (v["error"]["type"].as_str(), v["error"]["code"].as_str()),
            (Some("authentication_error"), Some("invalid_api_key"))
        );
        let chat = json!({"model": "via-chat", "messages": [{"role": "user", "content": "k"}]});
        for (name, value) in [
            ("authorization", format!("bearer {KEY}")),
            ("x-api-key", KEY.to_owned()),
        ] {
            let r = client()
                .post(format!("{}/v1/chat/completions", m.base))
                .header(name, value)
                .json(&chat)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{name}");
        }
        // count_tokens: passed through where the provider counts, estimated where it does not.
        let count =
            json!({"model": "via-anth", "messages": [{"role": "user", "content": "count me"}]});
        let (status, v) = post(&m.base, "/v1/messages/count_tokens", &count).await;
        assert_eq!(status, 200);
        assert!(
            v.get("estimated").is_none() && v["input_tokens"].as_u64().unwrap() > 0,
            "{v}"
        );
        let count =
            json!({"model": "via-chat", "messages": [{"role": "user", "content": "count me"}]});
        let before = m.chat.seen().len();
        let (status, v) = post(&m.base, "/v1/messages/count_tokens", &count).await;
        assert_eq!((status, v["estimated"].as_bool()), (200, Some(true)));
        assert_eq!(m.chat.seen().len(), before, "an estimate asks no upstream");
        // Every one of the five routes is counted in the metrics, successes and refusals.
        let _ = client()
            .get(format!("{}/v1/models", m.base))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        let metrics = client()
            .get(format!("{}/metrics", m.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for endpoint in [
            "models",
            "chat_completions",
            "responses",
            "messages",
            "count_tokens",
        ] {
            let counted: u64 = ["ok", "error"]
                .iter()
                .filter_map(|outcome| {
                    let series = format!(
                        "iop_edge_requests_total{{endpoint=\"{endpoint}\",outcome=\"{outcome}\"}} "
                    );
                    metrics
                        .lines()
                        .find_map(|l| l.strip_prefix(series.as_str())?.parse::<u64>().ok())
                })
                .sum();
            assert!(counted > 0, "{endpoint} is not counted:\n{metrics}");
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn client_disconnect_cancels_the_upstream_on_every_route() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        let cases = [
            ("/v1/chat/completions", json!({"model": "slow-chat", "stream": true, "messages": [{"role": "user", "content": "x"}]}), &m.chat, "chat passthrough"),
            ("/v1/responses", json!({"model": "slow-chat", "stream": true, "input": "x"}), &m.chat, "responses over chat"),
            ("/v1/messages", json!({"model": "slow-chat", "stream": true, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}), &m.chat, "messages over chat"),
            ("/v1/chat/completions", json!({"model": "slow-anth", "stream": true, "messages": [{"role": "user", "content": "x"}]}), &m.anthropic, "chat over messages"),
            ("/v1/responses", json!({"model": "slow-anth", "stream": true, "input": "x"}), &m.anthropic, "responses over messages"),
            ("/v1/messages", json!({"model": "slow-anth", "stream": true, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}), &m.anthropic, "messages passthrough"),
        ];
        for (path, body, upstream, what) in cases {
            let mut resp = client()
                .post(format!("{}{path}", m.base))
                .bearer_auth(KEY)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "{what}");
            assert!(resp.chunk().await.unwrap().is_some(), "{what}: the stream flows");
            let gone = upstream.dropped();
            drop(resp);
            tokio::time::timeout(Duration::from_secs(10), gone)
                .await
                .unwrap_or_else(|_| panic!("{what}: the upstream request was not cancelled"));
        }
    })
    .await
    .unwrap();
}

/// Seed 000: a stream is cancelled when the Edge's write to its client fails, also while the
/// client's connection stays open. An HTTP/2 client (prior knowledge, the `h2` crate) opens two
/// streamed chat completions on one connection and resets the first after its first chunk:
/// that stream's upstream request is cancelled, the second keeps flowing, and the same
/// connection then serves a new request.
#[tokio::test]
async fn a_reset_stream_cancels_its_upstream_and_the_connection_keeps_serving() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        let authority = m.base.trim_start_matches("http://").to_owned();
        let tcp = tokio::net::TcpStream::connect(&authority).await.unwrap();
        let (mut h2, connection) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let body = json!({"model": "slow-chat", "stream": true, "messages": [{"role": "user", "content": "x"}]});
        let body = bytes::Bytes::from(serde_json::to_vec(&body).unwrap());
        let request = |method: &str, path: &str| {
            ::http::Request::builder()
                .method(method)
                .uri(format!("http://{authority}{path}"))
                .header("authorization", format!("Bearer {KEY}"))
                .header("content-type", "application/json")
                .body(())
                .unwrap()
        };
        let mut open = Vec::new();
        for _ in 0..2 {
            h2 = h2.ready().await.unwrap();
            let (response, mut send) = h2
                .send_request(request("POST", "/v1/chat/completions"), false)
                .unwrap();
            send.send_data(body.clone(), true).unwrap();
            let response = response.await.unwrap();
            assert_eq!(response.status(), 200);
            let mut recv = response.into_body();
            let first = recv.data().await.unwrap().unwrap();
            recv.flow_control().release_capacity(first.len()).unwrap();
            open.push((send, recv));
        }
        let before = m.chat.dropped_count();
        let (mut reset, kept) = (open.remove(0), open.remove(0));
        // The client resets the first stream; its connection stays open.
        reset.0.send_reset(h2::Reason::CANCEL);
        let waited = tokio::time::timeout(Duration::from_secs(10), async {
            while m.chat.dropped_count() == before {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(waited.is_ok(), "the reset stream's upstream request was not cancelled");
        // The other stream keeps flowing on the same connection, its upstream untouched.
        let (_send, mut recv) = kept;
        for _ in 0..3 {
            let chunk = recv.data().await.unwrap().unwrap();
            recv.flow_control().release_capacity(chunk.len()).unwrap();
        }
        assert_eq!(m.chat.dropped_count(), before + 1);
        // And the connection serves a new request.
        h2 = h2.ready().await.unwrap();
        let (response, _) = h2.send_request(request("GET", "/v1/models"), true).unwrap();
        assert_eq!(response.await.unwrap().status(), 200);
        drop(reset);
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_passthrough_stream_that_stalls_ends_with_the_routes_error_event() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        // Chat: the provider's first chunk, then (1 s of silence later) OpenAI's error chunk,
        // and the body ends cleanly.
        let body = json!({"model": "hang-chat", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
        let r = client()
            .post(format!("{}/v1/chat/completions", m.base))
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.expect("a clean end, not a cut");
        assert!(text.starts_with("data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}"), "{text}");
        let last = text.trim_end().lines().last().unwrap();
        let v: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(v["error"]["type"], "server_error", "{text}");
        assert_eq!(v["error"]["message"], "provider request failed");
        // Messages: the provider's message_start, then Anthropic's `event: error`.
        let body = json!({"model": "hang-anth", "max_tokens": 8, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
        let r = client()
            .post(format!("{}/v1/messages", m.base))
            .header("x-api-key", KEY)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.expect("a clean end, not a cut");
        assert!(text.starts_with("event: message_start\n"), "{text}");
        assert!(text.ends_with("\n\n"), "{text}");
        let tail: Vec<&str> = text.trim_end().lines().rev().take(2).collect();
        assert_eq!(tail[1], "event: error", "{text}");
        let v: Value = serde_json::from_str(tail[0].strip_prefix("data: ").unwrap()).unwrap();
        anthropic_error(&v, "api_error");
    })
    .await
    .expect("within the limit");
}

/// Posts `body` as it is (not re-encoded by a JSON library) and returns status and body text.
async fn post_raw(base: &str, path: &str, body: &'static str) -> (u16, String) {
    let r = client()
        .post(format!("{base}{path}"))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test]
async fn a_passthrough_forwards_the_clients_bytes_with_only_the_model_replaced() {
    let m = mesh().await;
    // Spacing, member order, number spelling and a nested `model` are the client's and stay.
    let chat = r#"{ "temperature" : 1.50, "messages": [{"role": "user", "content": "say \"model\""}],
  "metadata": {"model": "not this one"}, "model":"via-chat", "max_tokens": 1e1 }"#;
    let (status, _) = post_raw(&m.base, "/v1/chat/completions", chat).await;
    assert_eq!(status, 200);
    let seen = m.chat.seen().pop().unwrap();
    assert_eq!(
        std::str::from_utf8(&seen.body).unwrap(),
        chat.replace(r#""model":"via-chat""#, r#""model":"fake-model""#),
        "the upstream reads the client's bytes with only `model` replaced"
    );
    // A stream asks for the usage chunk up front; the client, which did not, never sees it.
    let stream =
        r#"{"model":"via-chat","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let (status, text) = post_raw(&m.base, "/v1/chat/completions", stream).await;
    assert_eq!(status, 200);
    assert!(!text.contains("\"usage\""), "{text}");
    let seen = m.chat.seen().pop().unwrap();
    assert_eq!(
        std::str::from_utf8(&seen.body).unwrap(),
        r#"{"stream_options":{"include_usage":true},"model":"fake-model","stream":true,"messages":[{"role":"user","content":"hi"}]}"#
    );
    // The same on an Anthropic passthrough.
    let messages = r#"{"max_tokens": 16, "model": "via-anth",
 "messages": [{"role": "user", "content": "hi"}]}"#;
    let (status, _) = post_raw(&m.base, "/v1/messages", messages).await;
    assert_eq!(status, 200);
    let seen = m.anthropic.seen().pop().unwrap();
    assert_eq!(
        std::str::from_utf8(&seen.body).unwrap(),
        messages.replace(r#""via-anth""#, r#""fake-model""#)
    );
    // A second `model` (or `stream`) hiding behind the one the Edge read: an upstream that
    // keeps the first of two names would read another model or mode than the one admitted and
    // charged. The Edge sends one of each, the one it read.
    for (hidden, stream) in [
        (
            r#"{"model":"chat-missing","model":"via-chat","messages":[{"role":"user","content":"hi"}]}"#,
            false,
        ),
        (
            r#"{"mod\u0065l":"chat-missing","model":"via-chat","messages":[{"role":"user","content":"hi"}]}"#,
            false,
        ),
        (
            r#"{"model":"via-chat","stream":true,"stream":false,"messages":[{"role":"user","content":"hi"}]}"#,
            false,
        ),
    ] {
        let (status, _) = post_raw(&m.base, "/v1/chat/completions", hidden).await;
        assert_eq!(status, 200, "{hidden}");
        let seen = m.chat.seen().pop().unwrap();
        let body = std::str::from_utf8(&seen.body).unwrap();
        assert_eq!(body.matches("\"model\"").count(), 1, "{body}");
        assert_eq!(
            body.matches("\"stream\"").count(),
            usize::from(hidden.contains("\"stream\"")),
            "{body}"
        );
        assert!(!body.contains("\\u0065"), "{body}");
        assert_eq!(seen.json()["model"], "fake-model", "{body}");
        assert_eq!(
            seen.json()["stream"].as_bool().unwrap_or(false),
            stream,
            "{body}"
        );
    }
}
