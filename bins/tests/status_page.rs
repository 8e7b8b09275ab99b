//! The Edge's status page (issue #31) against the real binaries, in a real browser: an
//! `iop-edge` with `[admin]`, two `iop-node`s, a fake upstream per Node, and Playwright (PyPI)
//! driving Debian's `chromium` (`bins/tests/python/status_page.py`).
//!
//! - The page lists both Nodes as ready; requests move the traffic figures; a stalled provider
//!   shows its overlay; the drill-down on one Node shows only its providers; a Node killed with
//!   SIGKILL turns red without a reload (the time it took is printed); no console error; the
//!   CSP header is there; an unauthenticated request gets `401` and no page.
//! - From here: every response of the admin listener (the page, its script and style, the JSON
//!   and the event stream) is searched for the test's secrets (the gateway key, the admin
//!   token, the upstream key, the private keys).
//! - Screenshots at 1280×800 and 390×844 are saved under
//!   `target/tmp/status-page-screenshots/` (`CARGO_TARGET_TMPDIR`).

#![allow(clippy::unwrap_used, reason = "tests")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use support::{Proc, TempDir, bin_dir, free_port, pki};

const KEY: &str = "sk-gateway-status-page-secret";
const ADMIN_TOKEN: &str = "admin-token-0123456789-secret";

/// A fake upstream: "stall" is never answered, and once one was, its model list fails too, so
/// the provider stays unavailable (its recovery probe fails) while the page is looked at.
async fn chat(State(stalled): State<Arc<AtomicBool>>, body: String) -> Response {
    let req: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    if req["messages"][0]["content"] == "stall" {
        stalled.store(true, Ordering::SeqCst);
        std::future::pending::<()>().await;
    }
    axum::Json(json!({
        "id": "c1", "object": "chat.completion", "created": 0, "model": "fake-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }))
    .into_response()
}

async fn models(State(stalled): State<Arc<AtomicBool>>) -> Response {
    if stalled.load(Ordering::SeqCst) {
        return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    axum::Json(json!({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
        .into_response()
}

async fn upstream() -> String {
    let app = Router::new()
        .route("/v1/chat/completions", axum::routing::post(chat))
        .route("/v1/models", axum::routing::get(models))
        .with_state(Arc::new(AtomicBool::new(false)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}/v1")
}

fn edge_toml(dir: &std::path::Path, nodes: u16, http: u16, admin: u16, bases: &[String]) {
    let d = dir.display();
    std::fs::write(dir.join("api-keys"), format!("{KEY} team-a\n")).unwrap();
    support::set_mode(&dir.join("api-keys"), 0o600);
    std::fs::write(dir.join("admin.token"), format!("{ADMIN_TOKEN}\n")).unwrap();
    support::set_mode(&dir.join("admin.token"), 0o600);
    let mut text = format!(
        r#"edge_id = "edge-1"
[listen]
nodes = "127.0.0.1:{nodes}"
http = "127.0.0.1:{http}"
[admin]
listen = "127.0.0.1:{admin}"
token_file = "{d}/admin.token"
[tls]
trust_domain = "iop.test"
ca = "{d}/ca/ca.pem"
cert = "{d}/edge.pem"
key = "{d}/edge.key"
[auth]
keys_file = "{d}/api-keys"
[auth.limits]
requests_per_minute = 12
tokens_per_minute = 1000000
concurrent = 8
budget_usd_per_day = 5.0
[prices."mesh-model"]
input = 1.0
output = 2.0
[pool]
queue_wait_sec = 10
"#
    );
    for (i, base) in bases.iter().enumerate() {
        let n = i + 1;
        text += &format!(
            r#"[[nodes]]
node_id = "node-{n}"
[[nodes.adapters]]
name = "upstream"
type = "openai_compat"
base_url = "{base}"
profile = "openai"
capacity = 4
"#
        );
    }
    text += "[[models]]\nname = \"mesh-model\"\n";
    for n in 1..=bases.len() {
        text += &format!(
            r#"[[models.providers]]
node_id = "node-{n}"
provider_id = "upstream-{n}"
adapter = "upstream"
target = "fake-model"
capacity = 4
response_stall_timeout_sec = 1
"#
        );
    }
    std::fs::write(dir.join("edge.toml"), text).unwrap();
}

/// The Python package and the browser this test needs (scripts/test-all.sh installs both).
fn require_browser() {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import playwright.sync_api"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "Playwright is required: python3 -m pip install playwright (scripts/test-all.sh does this)"
    );
    assert!(
        std::path::Path::new("/usr/bin/chromium").exists(),
        "Debian's chromium is required: apt-get install chromium (scripts/test-all.sh does this; \
         Playwright's own browser download is not used)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_in_a_real_browser() {
    require_browser();
    let dir = TempDir::new("status-page");
    pki(dir.path(), &["node-1", "node-2"]);
    let bases = [upstream().await, upstream().await];
    let (nodes_port, http_port, admin_port) = (free_port(), free_port(), free_port());
    edge_toml(dir.path(), nodes_port, http_port, admin_port, &bases);
    let edge = Proc::spawn(
        bin_dir().join("iop-edge").to_str().unwrap(),
        &["--config", dir.path().join("edge.toml").to_str().unwrap()],
        &[],
        dir.path(),
        "edge",
    );
    let node = |name: &str| {
        let config = support::node_config(dir.path(), name, nodes_port);
        Proc::spawn(
            bin_dir().join("iop-node").to_str().unwrap(),
            &["--config", config.to_str().unwrap()],
            &[("UPSTREAM_KEY", "sk-upstream-secret")],
            dir.path(),
            name,
        )
    };
    let nodes = [node("node-1"), node("node-2")];
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let page = format!("http://127.0.0.1:{admin_port}/");
    let status = format!("{page}api/status");

    // Both Nodes ready, as the JSON says.
    let mut ready = false;
    for _ in 0..1500 {
        if let Ok(r) = client.get(&status).bearer_auth(ADMIN_TOKEN).send().await
            && let Ok(v) = r.json::<Value>().await
            && v["nodes"].as_array().is_some_and(|n| {
                // Ready, and since when (the Edge follows connections from its start).
                n.iter()
                    .filter(|n| n["state"] == "ready" && n["since_ms"].as_u64().is_some())
                    .count()
                    == 2
            })
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ready, "both Nodes ready:\n{}", edge.log_text());
    assert!(
        edge.log_text()
            .contains(&format!("status page on http://127.0.0.1:{admin_port}/")),
        "{}",
        edge.log_text()
    );

    // Unauthenticated, or with a wrong token: 401 on every path, no page.
    for path in [
        "",
        "app.js",
        "page.css",
        "common.js",
        "favicon.svg",
        "api/status",
        "api/events",
    ] {
        let r = client.get(format!("{page}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
        let r = client
            .get(format!("{page}{path}"))
            .bearer_auth("admin-token-0123456789-secreT")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{path} with a wrong token");
        assert!(!r.text().await.unwrap().contains("<table"));
    }
    // The one action (a recovery probe) needs the operator's confirmation header, and is
    // refused from another origin even with the token.
    let probe = format!("{page}api/nodes/node-1/probe");
    let r = client.post(&probe).send().await.unwrap();
    assert_eq!(r.status(), 401, "the probe without the token");
    let r = client
        .post(&probe)
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "the probe without the confirmation");
    let r = client
        .post(&probe)
        .bearer_auth(ADMIN_TOKEN)
        .header("x-iop-confirm", "confirmed")
        .header("sec-fetch-site", "cross-site")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "the probe from another site");
    let r = client
        .post(&probe)
        .bearer_auth(ADMIN_TOKEN)
        .header("x-iop-confirm", "confirmed")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the confirmed probe");
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"cleared": 0}));
    let r = client
        .post(format!("{page}api/nodes/no-such-node/probe"))
        .bearer_auth(ADMIN_TOKEN)
        .header("x-iop-confirm", "confirmed")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409, "a Node that is not ready");

    // The public API port does not serve it.
    let r = client
        .get(format!("http://127.0.0.1:{http_port}/api/status"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // The browser.
    let shots = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/status_page.py");
    let pid = nodes[1].child.id().to_string();
    let api = format!("http://127.0.0.1:{http_port}/v1");
    let (page2, shots2) = (page.clone(), shots.display().to_string());
    let out = tokio::task::spawn_blocking(move || {
        support::python(script, &[&page2, ADMIN_TOKEN, &api, KEY, &pid, &shots2])
    })
    .await
    .unwrap();
    let summary: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    println!("status page: {summary}");
    assert!(summary["requests_answered"].as_u64().unwrap() >= 5);
    // 12 a minute refill one every 5 s: of the 5 requests, at least 4 still count.
    assert!(summary["key_requests"].as_u64().unwrap() >= 4, "{summary}");
    assert!(
        summary["stalled_cause"]
            .as_str()
            .unwrap()
            .contains("stalled"),
        "{summary}"
    );
    assert!(
        summary["probe"]
            .as_str()
            .unwrap()
            .starts_with("unavailable"),
        "{summary}"
    );
    println!(
        "a killed Node turned red on the page {} s after SIGKILL",
        summary["red_after_s"]
    );
    for name in [
        "edge-1280x800.png",
        "edge-stalled-1280x800.png",
        "edge-provider-1280x800.png",
        "edge-node-down-1280x800.png",
        "edge-390x844.png",
    ] {
        let png = std::fs::read(shots.join(name)).unwrap();
        assert!(png.starts_with(b"\x89PNG"), "{name}");
    }

    // Nothing secret in any response: the page, its assets, the JSON and the event stream.
    let mut secrets: Vec<String> =
        vec![KEY.into(), ADMIN_TOKEN.into(), "sk-upstream-secret".into()];
    // A line of every private key's base64 body (the Edge's, the Nodes', the CA's).
    for d in [dir.path().to_owned(), dir.path().join("ca")] {
        for entry in std::fs::read_dir(d).unwrap().flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            if text.contains("PRIVATE KEY-----")
                && let Some(line) = text.lines().nth(1)
            {
                secrets.push(line.to_owned());
            }
        }
    }
    assert!(
        secrets.len() >= 3 + 4,
        "the keys were found: {}",
        secrets.len()
    );
    let mut bodies = Vec::new();
    for path in ["", "app.js", "page.css", "common.js", "api/status"] {
        let r = client
            .get(format!("{page}{path}"))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let csp = r.headers()["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("default-src 'none'"), "{csp}");
        bodies.push(r.text().await.unwrap());
    }
    let mut events = client
        .get(format!("{page}api/events"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), events.chunk())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let first = String::from_utf8_lossy(&first).into_owned();
    assert!(first.starts_with("event: status"), "{first}");
    bodies.push(first);
    assert!(
        bodies[0].contains("<script src=\"app.js\""),
        "the script is a file"
    );
    assert!(!bodies[0].contains("<script>"), "no inline script");
    for body in &bodies {
        for secret in &secrets {
            assert!(!body.contains(secret.as_str()), "a secret in a response");
        }
    }
    drop(nodes);
    drop(edge);
}
