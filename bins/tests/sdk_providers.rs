//! The official `openai` and `anthropic` Python SDKs through `iop-edge` + `iop-node` processes
//! with gateway keys, in front of providers that need a key the Node holds itself:
//!
//! - a fake upstream that serves **only** models and chat completions (so `/v1/responses` and
//!   `/v1/messages` are translated);
//! - a fake Anthropic-native upstream (so `/v1/chat/completions` and `/v1/responses` are
//!   translated, messages and count_tokens pass through);
//! - the same SDK checks through `iop-mesh --openai-url` with its defaults.
//!
//! Each checks models, chat (streamed and not), responses (streamed and not), messages
//! (streamed, not, and the SDK's `messages.stream` helper), count_tokens, function tools in all
//! three dialects, an invalid key (401 in the right shape) and an unknown model (404 in the
//! right shape); then that the upstream saw exactly the Node's key in its header and never the
//! client's, and that neither key appears in the Edge's or the Node's logs (at debug level),
//! the metrics or an error body.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod support;

use std::time::Duration;

use iop_tests::upstream::{Kind, Upstream};
use support::{Proc, TempDir, wait_until};

const GATEWAY_KEY: &str = "gw-test-key-7f3a9c";
const UPSTREAM_KEY: &str = "sk-upstream-secret-41d2e8";
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/sdk_check.py");
const LIMIT: Duration = Duration::from_secs(30);

fn no_secret_in(what: &str, text: &str) {
    for secret in [GATEWAY_KEY, UPSTREAM_KEY] {
        assert!(!text.contains(secret), "{what} contains a key:\n{text}");
    }
}

/// What every run checks after the SDKs: the upstream saw exactly the Node's key, in its own
/// header, and never the gateway key; nothing leaked.
fn check_upstream_and_secrets(upstream: &Upstream, kind: Kind, root: &str, logs: &[String]) {
    let seen = upstream.seen();
    assert!(!seen.is_empty());
    for s in &seen {
        let (header, value) = match kind {
            Kind::ChatOnly => ("authorization", format!("Bearer {UPSTREAM_KEY}")),
            Kind::Anthropic => ("x-api-key", UPSTREAM_KEY.to_owned()),
        };
        assert_eq!(
            s.header(header),
            Some(value.as_str()),
            "{} {:?}",
            s.path,
            s.headers
        );
        for (name, v) in &s.headers {
            assert!(
                !v.contains(GATEWAY_KEY),
                "gateway key sent upstream in {name}"
            );
        }
        if kind == Kind::Anthropic {
            assert_eq!(s.header("anthropic-version"), Some("2023-06-01"));
        }
    }
    for (i, log) in logs.iter().enumerate() {
        no_secret_in(&format!("log {i}"), log);
    }
    let (status, metrics) = support::http_get(&format!("{root}/metrics"), &[]);
    assert_eq!(status, 200);
    no_secret_in("metrics", &metrics);
    assert!(metrics.contains("iop_edge_requests_total{endpoint=\"messages\",outcome=\"ok\"}"));
    // Error bodies: a wrong key, and a request the translation refuses.
    let bearer = format!("Bearer {GATEWAY_KEY}x");
    let (status, body) = support::http_post(
        &format!("{root}/v1/chat/completions"),
        &[("authorization", &bearer)],
        r#"{"model":"mesh-model","messages":[]}"#,
    );
    assert_eq!(status, 401);
    no_secret_in("401 body", &body);
    let (status, body) = match kind {
        // Messages over a chat upstream: a document block has no chat form.
        Kind::ChatOnly => support::http_post(
            &format!("{root}/v1/messages"),
            &[("x-api-key", GATEWAY_KEY)],
            r#"{"model":"mesh-model","max_tokens":8,"messages":[{"role":"user","content":[{"type":"document","source":{}}]}]}"#,
        ),
        // Chat over an Anthropic upstream: tool-call arguments must be a JSON object.
        Kind::Anthropic => support::http_post(
            &format!("{root}/v1/chat/completions"),
            &[("authorization", &format!("Bearer {GATEWAY_KEY}"))],
            r#"{"model":"mesh-model","messages":[{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"[1]"}}]}]}"#,
        ),
    };
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid_request_error"), "{body}");
    no_secret_in("400 body", &body);
}

fn edge_and_node(kind: Kind, profile: &str) {
    support::require_sdks();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(kind, UPSTREAM_KEY, "fake-model"));
    let dir = TempDir::new("sdk");
    support::pki(dir.path(), &["node-1"]);
    let ports = support::edge_config(dir.path(), &upstream.base_url(), profile, GATEWAY_KEY);
    let debug = [("RUST_LOG", "debug")];
    let edge = support::spawn_edge(dir.path(), &debug);
    let node = support::spawn_node(dir.path(), "node-1", ports.nodes, UPSTREAM_KEY, &debug);
    let root = format!("http://127.0.0.1:{}", ports.http);
    wait_until("the Edge to have a ready Node", LIMIT, || {
        support::http_ok(&format!("{root}/readyz"))
    });
    let out = support::python(SCRIPT, &[&root, GATEWAY_KEY, "mesh-model"]);
    assert!(out.contains("sdk check: openai"), "{out}");
    println!("{}", out.trim());
    check_upstream_and_secrets(&upstream, kind, &root, &[edge.log_text(), node.log_text()]);
    // The routes were really translated: the chat-only upstream never saw a Responses or
    // Messages request, the Anthropic one never saw a chat request.
    let paths: Vec<String> = upstream.seen().into_iter().map(|s| s.path).collect();
    match kind {
        Kind::ChatOnly => assert!(
            paths
                .iter()
                .all(|p| p == "/v1/chat/completions" || p == "/v1/models")
        ),
        Kind::Anthropic => {
            assert!(
                paths.iter().any(|p| p == "/v1/messages/count_tokens"),
                "count_tokens passes through"
            );
            assert!(
                paths
                    .iter()
                    .all(|p| p.starts_with("/v1/messages") || p == "/v1/models")
            );
        }
    }
}

#[test]
fn official_sdks_through_edge_and_node_over_a_chat_only_upstream() {
    edge_and_node(Kind::ChatOnly, "chat_only");
}

#[test]
fn official_sdks_through_edge_and_node_over_an_anthropic_native_upstream() {
    edge_and_node(Kind::Anthropic, "anthropic");
}

#[test]
fn official_sdks_through_iop_mesh_openai_url_with_its_defaults() {
    support::require_sdks();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, UPSTREAM_KEY, "fake-model"));
    let dir = TempDir::new("mesh-sdk");
    let port = support::free_port();
    let listen = format!("127.0.0.1:{port}");
    let url = upstream.base_url();
    let mesh = Proc::spawn(
        env!("CARGO_BIN_EXE_iop-mesh"),
        &[
            "--listen",
            &listen,
            "--openai-url",
            &url,
            "--model",
            "mesh-model",
            "--upstream-model",
            "fake-model",
            "--upstream-api-key-env",
            "UPSTREAM_KEY",
            "--api-key",
            GATEWAY_KEY,
        ],
        &[("RUST_LOG", "debug"), ("UPSTREAM_KEY", UPSTREAM_KEY)],
        dir.path(),
        "mesh",
    );
    let root = format!("http://{listen}");
    wait_until("iop-mesh to serve", LIMIT, || {
        mesh.log_text().contains("base URL")
    });
    let out = support::python(SCRIPT, &[&root, GATEWAY_KEY, "mesh-model"]);
    println!("{}", out.trim());
    check_upstream_and_secrets(&upstream, Kind::ChatOnly, &root, &[mesh.log_text()]);
}

#[test]
fn iop_mesh_refuses_a_public_listener_without_a_key() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iop-mesh"))
        .args(["--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to listen on 0.0.0.0:0 without a key"),
        "{err}"
    );
}

/// `iop-mesh --managed`: the embedded Control Plane leases the upstream key; the official SDKs
/// use the token the mesh prints. The upstream sees exactly the slot's key on every request
/// and never the token; neither appears in the mesh's log (at debug level) or its metrics.
#[test]
fn official_sdks_through_iop_mesh_managed_with_its_printed_token() {
    support::require_sdks();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, UPSTREAM_KEY, "fake-model"));
    let dir = TempDir::new("mesh-managed");
    let port = support::free_port();
    let listen = format!("127.0.0.1:{port}");
    let url = upstream.base_url();
    let mesh = Proc::spawn(
        env!("CARGO_BIN_EXE_iop-mesh"),
        &[
            "--managed",
            "--listen",
            &listen,
            "--openai-url",
            &url,
            "--model",
            "mesh-model",
            "--upstream-model",
            "fake-model",
            "--upstream-api-key-env",
            "UPSTREAM_KEY",
        ],
        &[("RUST_LOG", "debug"), ("UPSTREAM_KEY", UPSTREAM_KEY)],
        dir.path(),
        "mesh",
    );
    wait_until("iop-mesh to serve", LIMIT, || {
        mesh.log_text().contains("base URL")
    });
    let log = mesh.log_text();
    let token = log
        .lines()
        .find_map(|l| l.strip_prefix("iop-mesh: token: "))
        .expect("the mesh prints a token")
        .trim()
        .to_owned();
    assert!(
        log.contains(&format!("authorization: Bearer {token}")),
        "a ready curl:\n{log}"
    );
    let root = format!("http://{listen}");
    let out = support::python(SCRIPT, &[&root, &token, "mesh-model"]);
    println!("{}", out.trim());
    let seen = upstream.seen();
    assert!(seen.iter().any(|s| s.path == "/v1/chat/completions"));
    for s in &seen {
        assert_eq!(
            s.header("authorization"),
            Some(format!("Bearer {UPSTREAM_KEY}").as_str()),
            "{} {:?}",
            s.path,
            s.headers
        );
        for (name, v) in &s.headers {
            assert!(!v.contains(&token), "the token was sent upstream in {name}");
        }
    }
    let (status, metrics) = support::http_get(&format!("{root}/metrics"), &[]);
    assert_eq!(status, 200);
    // Everything after the token line: the mesh prints the token once, on purpose.
    let after = log
        .split_once(&format!("token: {token}"))
        .map_or("", |(_, rest)| rest);
    let after = after.replace(&format!("Bearer {token}'"), "");
    for (what, text) in [("log", after.as_str()), ("metrics", metrics.as_str())] {
        assert!(
            !text.contains(UPSTREAM_KEY),
            "the upstream key is in the {what}"
        );
        assert!(!text.contains(&token), "the token is in the {what}");
    }
}
