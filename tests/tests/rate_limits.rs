//! Per-key rate limits (issue #29) on one Edge with no shared store, over real sockets and mTLS:
//! an Edge built from a configuration file with a key file naming its keys, a Node holding
//! the upstream keys, and fake OpenAI-compatible and Anthropic upstreams that report usage.
//!
//! - the limits and key ids of `[auth]` are read from the file, and its errors name their key;
//! - a request limit admits exactly its limit, then answers 429 in the route's dialect with
//!   `retry-after` (the real wait, not a window) and the quota headers (`x-ratelimit-*` on
//!   OpenAI routes, `anthropic-ratelimit-*` on `/v1/messages`), streamed responses included;
//! - tokens are reserved from the estimate at admission and reconciled to the provider's
//!   reported usage when the response ends, on every route and form (JSON, chat stream with
//!   usage, Anthropic stream, Responses translated over chat): the next request's remaining
//!   count is exact;
//! - a concurrency limit frees when the response ends or its client goes away;
//! - refusals are counted per key id in `/metrics`, and no key appears anywhere.
//!
//! Token arithmetic is exact because the test's rates replenish one token per 1000 s: the
//! time between two requests adds nothing (the module docs of `iop_edge::limits` give the
//! rule).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use iop_edge::config::EdgeConfigFile;
use iop_edge::limits::budget::{self, Budget, Price};
use iop_edge::limits::{KeyLimits, Limiter, LimitsConfig, OnUnavailable, SharedConfig};
use iop_edge::ratelimit::{Limits, Rate};
use iop_edge::{Lifecycle, bind, http};
use iop_node::credential::LocalKey;
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::{self, Ca};
use iop_tests::upstream::{Kind, Upstream};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const UPSTREAM_KEY: &str = "sk-limits-upstream";
const REQ_KEY: &str = "gw-limits-requests";
const TOK_KEY: &str = "gw-limits-tokens";
const CON_KEY: &str = "gw-limits-concurrent";
const FREE_KEY: &str = "gw-limits-free";
const TEAM_KEY: &str = "gw-limits-team";
const BIG_KEY: &str = "gw-limits-big";
const BUD_KEY: &str = "gw-limits-budget";
/// The shared key's limits (per `TICK` × limit seconds: nothing replenishes in a test).
const TEAM_REQUESTS: u64 = 40;
const TEAM_TOKENS: u64 = 3000;
const LIMIT: Duration = Duration::from_secs(60);

/// One token per `TICK` seconds: nothing replenishes between two requests of a test.
const TICK: u64 = 1000;

fn slow_rate(limit: u64) -> Option<Rate> {
    Rate::new(limit, Duration::from_secs(limit * TICK))
}

struct Mesh {
    base: String,
    usage: Option<Arc<dyn iop_edge::usage::UsageSink>>,
    chat: Upstream,
    anthropic: Upstream,
    dir: std::path::PathBuf,
}

fn provider(model: &str, adapter: &str, target: &str) -> String {
    format!(
        "[[models]]\nname = \"{model}\"\n[[models.providers]]\nnode_id = \"node-1\"\nprovider_id = \"{model}\"\nadapter = \"{adapter}\"\ntarget = \"{target}\"\ncapacity = 8\n"
    )
}

/// The Edge's file; `auth` is its `[auth]` section.
fn config_text(dir: &std::path::Path, chat: &str, anth: &str, auth: &str) -> String {
    format!(
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
{auth}
[[nodes]]
node_id = "node-1"
[[nodes.adapters]]
name = "chat"
type = "openai_compat"
base_url = "{chat}"
capacity = 16
[[nodes.adapters]]
name = "anth"
type = "openai_compat"
base_url = "{anth}"
profile = "anthropic"
capacity = 16
[[nodes.adapters]]
name = "plain"
type = "openai_compat"
base_url = "{chat}"
capacity = 16
stream_usage = false
trace_propagation = false
{p1}{p2}{p3}{p4}{p5}{p6}{p7}"#,
        td = pki::TRUST_DOMAIN,
        d = dir.display(),
        p1 = provider("via-chat", "chat", "fake-model"),
        p2 = provider("via-anth", "anth", "fake-model"),
        p3 = provider("slow-chat", "chat", "slow"),
        p4 = provider("chat-missing", "chat", "missing-model"),
        p5 = provider("plain-chat", "plain", "fake-model"),
        p6 = provider("linger-chat", "chat", "linger"),
        p7 = provider("hang-anth", "anth", "hang"),
    )
}

async fn mesh() -> Mesh {
    mesh_with("", None).await
}

/// A mesh whose `[auth]` has `extra` appended; with `shared`, the limits are shared through
/// that store.
async fn mesh_with(extra: &str, shared: Option<SharedConfig>) -> Mesh {
    let chat = Upstream::start(Kind::ChatOnly, UPSTREAM_KEY, "fake-model").await;
    let anthropic = Upstream::start(Kind::Anthropic, UPSTREAM_KEY, "fake-model").await;
    let ca = Ca::new("limits CA");
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "iop-limits-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let edge_leaf = ca.workload(role::EDGE, "edge-1", true);
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("edge.pem"), &edge_leaf.cert_pem).unwrap();
    std::fs::write(dir.join("edge.key"), &edge_leaf.key_pem).unwrap();
    let keys = dir.join("keys");
    std::fs::write(
        &keys,
        format!(
            "# gateway keys: <key or sha256:hex> [id]\n{REQ_KEY} req\n{} tok\n{CON_KEY} con\n{FREE_KEY}\n{TEAM_KEY} team\n{BIG_KEY} big\n{BUD_KEY} bud\n",
            http::ApiKeys::digest_line(TOK_KEY)
        ),
    )
    .unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let auth = format!(
        r#"[auth]
keys_file = "{}"
output_estimate = 64
[auth.key_limits.req]
requests_per_minute = 3
[auth.key_limits.tok]
tokens_per_minute = 1000
[auth.key_limits.tok.models.via-anth]
requests_per_minute = 100
[auth.key_limits.con]
concurrent = 1
{extra}"#,
        keys.display()
    );
    let text = config_text(&dir, &chat.base_url(), &anthropic.base_url(), &auth);
    let mut built = EdgeConfigFile::parse(&text).unwrap().build().unwrap();
    // What the file says, read back.
    let limiter = built.http.limiter.as_ref().expect("limits configured");
    let config = limiter.config();
    assert_eq!(config.output_estimate, 64);
    assert_eq!(config.keys["req"].limits.requests, Rate::per_minute(3));
    assert_eq!(config.keys["tok"].limits.tokens, Rate::per_minute(1000));
    assert_eq!(
        config.keys["tok"].models["via-anth"].requests,
        Rate::per_minute(100)
    );
    assert_eq!(config.keys["con"].limits.concurrent, Some(1));
    assert!(
        config.default.is_unlimited(),
        "no [auth.limits]: unnamed keys are free"
    );
    // The same limits on rates that replenish one unit per 1000 s (exact arithmetic).
    let mut keys = BTreeMap::new();
    let limits = |requests, tokens, concurrent| KeyLimits {
        limits: Limits {
            requests,
            tokens,
            concurrent,
        },
        models: BTreeMap::new(),
        budget: Default::default(),
    };
    keys.insert("req".to_owned(), limits(slow_rate(3), None, None));
    keys.insert("tok".to_owned(), limits(None, slow_rate(1000), None));
    keys.insert("con".to_owned(), limits(None, None, Some(1)));
    keys.insert(
        "team".to_owned(),
        limits(slow_rate(TEAM_REQUESTS), slow_rate(TEAM_TOKENS), None),
    );
    keys.insert("big".to_owned(), limits(slow_rate(1_000_000), None, None));
    keys.insert(
        "bud".to_owned(),
        KeyLimits {
            budget: Budget {
                per_day_pusd: budget::usd(0.0001),
                per_month_pusd: None,
            },
            ..KeyLimits::default()
        },
    );
    let prices = [
        (
            "via-chat".to_owned(),
            Price::per_million_usd(1.0, 2.0).unwrap(),
        ),
        (
            "via-anth".to_owned(),
            Price::per_million_usd(1.0, 2.0).unwrap(),
        ),
    ]
    .into();
    let limiter = Limiter::new(LimitsConfig {
        keys,
        output_estimate: 64,
        shared,
        prices,
        ..LimitsConfig::default()
    })
    .unwrap();
    if let Some(u) = &built.http.usage {
        limiter.set_usage(Arc::clone(u));
    }
    built.http.limiter = Some(Arc::new(limiter));
    let (edge, _) = bind(built.transport).await.unwrap();
    let mut life = edge.subscribe();
    let tls = pki::node_client_tls(&ca, role::NODE, "node-1", "edge-1");
    let key = || LocalKey::new(UPSTREAM_KEY.as_bytes().to_vec()).unwrap();
    let opts = NodeOptions::new("node-1", &edge.local_addr().to_string(), "localhost", tls)
        .unwrap()
        .with_adapters(AdapterRegistry::with_builtins())
        .with_local_key("chat", key())
        .with_local_key("anth", key())
        .with_local_key("plain", key());
    tokio::spawn(run_node(opts, CancellationToken::new()));
    while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
    let usage = built.http.usage.clone();
    let app = http::router(edge, built.http);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(http::serve(listener, app, std::future::pending()));
    Mesh {
        base,
        usage,
        chat,
        anthropic,
        dir,
    }
}

fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

async fn post(base: &str, path: &str, key: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{base}{path}"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

fn number(r: &reqwest::Response, name: &str) -> u64 {
    header(r, name)
        .unwrap_or_else(|| panic!("{name} missing: {:?}", r.headers()))
        .parse()
        .unwrap()
}

fn chat(model: &str, stream: bool) -> Value {
    json!({"model": model, "max_tokens": 40, "stream": stream,
           "messages": [{"role": "user", "content": "count my tokens please"}]})
}

#[tokio::test]
async fn a_request_limit_admits_its_limit_then_429_with_the_real_wait() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        let started = std::time::Instant::now();
        // Three admitted, the quota counting down on every form of answer.
        let r = post(
            &m.base,
            "/v1/chat/completions",
            REQ_KEY,
            &chat("via-chat", false),
        )
        .await;
        assert_eq!(r.status(), 200);
        assert_eq!(number(&r, "x-ratelimit-limit-requests"), 3);
        assert_eq!(number(&r, "x-ratelimit-remaining-requests"), 2);
        // Full again in 1000 s (one request's share of the period).
        assert_eq!(header(&r, "x-ratelimit-reset-requests").unwrap(), "16m40s");
        assert!(
            header(&r, "x-ratelimit-limit-tokens").is_none(),
            "tokens are not limited"
        );
        // A stream carries them too (headers go before the first byte).
        let r = post(
            &m.base,
            "/v1/chat/completions",
            REQ_KEY,
            &chat("via-chat", true),
        )
        .await;
        assert_eq!(r.status(), 200);
        assert_eq!(number(&r, "x-ratelimit-remaining-requests"), 1);
        assert!(r.text().await.unwrap().ends_with("data: [DONE]\n\n"));
        // Anthropic's names on /v1/messages, a stream, reset as an RFC 3339 time.
        let r = post(&m.base, "/v1/messages", REQ_KEY, &chat("via-anth", true)).await;
        assert_eq!(r.status(), 200);
        assert_eq!(number(&r, "anthropic-ratelimit-requests-limit"), 3);
        assert_eq!(number(&r, "anthropic-ratelimit-requests-remaining"), 0);
        let reset = header(&r, "anthropic-ratelimit-requests-reset").unwrap();
        assert!(reset.ends_with('Z') && reset.contains('T'), "{reset}");
        assert!(header(&r, "x-ratelimit-remaining-requests").is_none());
        let _ = r.text().await.unwrap();
        // The fourth: 429, the route's dialect, the real wait (1000 s per request, less the
        // time since the first admission), headers with nothing remaining.
        let upstream_before = m.chat.seen().len();
        let r = post(
            &m.base,
            "/v1/chat/completions",
            REQ_KEY,
            &chat("via-chat", false),
        )
        .await;
        assert_eq!(r.status(), 429);
        let elapsed = started.elapsed().as_secs();
        let retry = number(&r, "retry-after");
        assert!(
            (TICK - elapsed - 1..=TICK).contains(&retry),
            "retry-after {retry}"
        );
        let retry_ms = number(&r, "retry-after-ms");
        assert!(
            retry_ms.div_ceil(1000) == retry,
            "{retry_ms} ms vs {retry} s"
        );
        assert_eq!(number(&r, "x-ratelimit-remaining-requests"), 0);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
        assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(!message.contains(REQ_KEY), "{message}");
        let r = post(&m.base, "/v1/messages", REQ_KEY, &chat("via-anth", false)).await;
        assert_eq!(r.status(), 429);
        assert_eq!(number(&r, "anthropic-ratelimit-requests-remaining"), 0);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
        assert_eq!(
            m.chat.seen().len(),
            upstream_before,
            "a refusal reaches no provider"
        );
        // Another key is not affected, and an unnamed key without limits gets no headers.
        let r = post(
            &m.base,
            "/v1/chat/completions",
            FREE_KEY,
            &chat("via-chat", false),
        )
        .await;
        assert_eq!(r.status(), 200);
        assert!(header(&r, "x-ratelimit-limit-requests").is_none());
        // Counted per key id; no key anywhere in the exposition.
        let metrics = metrics_text(&m.base).await;
        assert!(
            metrics.contains("iop_edge_ratelimit_refused_total{key=\"req\",limit=\"requests\"} 2"),
            "{metrics}"
        );
        assert!(metrics.contains("iop_edge_ratelimit_admitted_total{key=\"req\"} 3"));
        for secret in [REQ_KEY, TOK_KEY, CON_KEY, FREE_KEY] {
            assert!(!metrics.contains(secret));
        }
        assert_eq!(metrics.matches("# EOF").count(), 1);
        std::fs::remove_dir_all(&m.dir).ok();
    })
    .await
    .expect("within the limit");
}

/// The tokens the next admission of `body` on `path` reports remaining, and the usage the
/// answer reported (0 when none).
async fn tokens_after(base: &str, path: &str, body: &Value) -> (u64, u64, reqwest::Response) {
    let r = post(base, path, TOK_KEY, body).await;
    assert_eq!(r.status(), 200);
    let remaining = number(
        &r,
        if path == "/v1/messages" {
            "anthropic-ratelimit-tokens-remaining"
        } else {
            "x-ratelimit-remaining-tokens"
        },
    );
    (remaining, 0, r)
}

/// The input estimate of `body` in chat form: 4 bytes of text per token, 4 per message.
fn input_estimate(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4) + 4
}

#[tokio::test]
async fn tokens_are_reserved_then_reconciled_to_the_reported_usage() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        let text = "count my tokens please";
        let estimate = 40 + input_estimate(text);
        let mut left = 1000u64;
        // JSON passthrough: the answer's usage is charged.
        let (remaining, _, r) =
            tokens_after(&m.base, "/v1/chat/completions", &chat("via-chat", false)).await;
        assert_eq!(remaining, left - estimate, "the estimate is reserved");
        let v: Value = r.json().await.unwrap();
        let used = v["usage"]["total_tokens"].as_u64().unwrap();
        assert!(used > 0 && used != estimate);
        left -= used;
        // A chat stream with include_usage: its usage chunk is charged.
        let mut body = chat("via-chat", true);
        body["stream_options"] = json!({"include_usage": true});
        let (remaining, _, r) = tokens_after(&m.base, "/v1/chat/completions", &body).await;
        assert_eq!(
            remaining,
            left - estimate,
            "the previous answer was reconciled"
        );
        let sse = r.text().await.unwrap();
        let usage_line = sse
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find(|v| v["usage"].is_object())
            .expect("usage chunk");
        left -= usage_line["usage"]["total_tokens"].as_u64().unwrap();
        assert_eq!(usage_line["usage"]["total_tokens"], used, "the same answer");
        // A chat stream without include_usage: the Edge asks the upstream for it, charges it
        // exactly, and the client sees the stream it asked for (no usage chunk, [DONE] last).
        let (remaining, _, r) =
            tokens_after(&m.base, "/v1/chat/completions", &chat("via-chat", true)).await;
        assert_eq!(remaining, left - estimate);
        let sent = m.chat.seen().into_iter().last().unwrap();
        let sent: Value = serde_json::from_slice(&sent.body).unwrap();
        assert_eq!(sent["stream_options"]["include_usage"], true, "{sent}");
        let sse = r.text().await.unwrap();
        assert!(!sse.contains("\"usage\":{"), "{sse}");
        assert!(sse.ends_with("data: [DONE]\n\n"), "{sse}");
        assert!(sse.contains("\"finish_reason\":\"stop\""), "{sse}");
        left -= used;
        // An Anthropic stream: input from message_start, output from message_delta.
        let (remaining, _, r) =
            tokens_after(&m.base, "/v1/messages", &chat("via-anth", true)).await;
        assert_eq!(remaining, left - estimate);
        let sse = r.text().await.unwrap();
        let events: Vec<Value> = sse
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .collect();
        let input = events
            .iter()
            .find_map(|e| e["message"]["usage"]["input_tokens"].as_u64())
            .unwrap();
        let output = events
            .iter()
            .rev()
            .find_map(|e| {
                (e["type"] == "message_delta")
                    .then(|| e["usage"]["output_tokens"].as_u64())
                    .flatten()
            })
            .unwrap();
        left -= input + output;
        // Responses translated over chat (its estimate from the chat form of `input`).
        let responses = json!({"model": "via-chat", "max_output_tokens": 40, "input": text});
        let (remaining, _, r) = tokens_after(&m.base, "/v1/responses", &responses).await;
        assert_eq!(remaining, left - (40 + input_estimate(text)));
        let v: Value = r.json().await.unwrap();
        left -= v["usage"]["total_tokens"].as_u64().unwrap();
        // A request whose estimate alone exceeds the limit never fits: no retry-after.
        let mut huge = chat("via-chat", false);
        huge["max_tokens"] = json!(5000);
        let r = post(&m.base, "/v1/chat/completions", TOK_KEY, &huge).await;
        assert_eq!(r.status(), 429);
        assert!(header(&r, "retry-after").is_none());
        assert_eq!(number(&r, "x-ratelimit-remaining-tokens"), left);
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("estimate exceeds"),
            "{v}"
        );
        // A request whose provider refuses it is given its tokens back (an upstream 404:
        // nothing used), and the next one sees the quota unchanged.
        let r = post(
            &m.base,
            "/v1/chat/completions",
            TOK_KEY,
            &chat("chat-missing", false),
        )
        .await;
        assert_eq!(r.status(), 404);
        assert_eq!(number(&r, "x-ratelimit-remaining-tokens"), left - estimate);
        let _ = r.text().await;
        let (remaining, _, _) =
            tokens_after(&m.base, "/v1/chat/completions", &chat("via-chat", false)).await;
        assert_eq!(remaining, left - estimate);
        std::fs::remove_dir_all(&m.dir).ok();
    })
    .await
    .expect("within the limit");
}

#[tokio::test]
async fn a_concurrency_limit_frees_when_the_client_goes_away() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        let drops = m.chat.dropped_count();
        // A stream that never ends holds the one slot.
        let mut held = post(
            &m.base,
            "/v1/chat/completions",
            CON_KEY,
            &chat("slow-chat", true),
        )
        .await;
        assert_eq!(held.status(), 200);
        let _first = held.chunk().await.unwrap();
        let r = post(
            &m.base,
            "/v1/chat/completions",
            CON_KEY,
            &chat("via-chat", false),
        )
        .await;
        assert_eq!(r.status(), 429);
        assert_eq!(
            number(&r, "retry-after"),
            1,
            "frees when a request ends: 1 s"
        );
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("in flight"),
            "{v}"
        );
        // The client goes away: the upstream stream is cancelled and the slot freed.
        drop(held);
        while m.chat.dropped_count() == drops {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        loop {
            let r = post(
                &m.base,
                "/v1/chat/completions",
                CON_KEY,
                &chat("via-chat", false),
            )
            .await;
            if r.status() == 200 {
                break;
            }
            assert_eq!(r.status(), 429);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::fs::remove_dir_all(&m.dir).ok();
    })
    .await
    .expect("within the limit");
}

#[test]
fn limit_settings_errors_name_their_key() {
    let dir = std::env::temp_dir().join(format!("iop-limits-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(&keys, "sk-a team-a\nsk-b\n").unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let ca = Ca::new("limits cfg CA");
    let leaf = ca.workload(role::EDGE, "edge-1", true);
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("edge.pem"), &leaf.cert_pem).unwrap();
    std::fs::write(dir.join("edge.key"), &leaf.key_pem).unwrap();
    let build = |auth: &str| {
        let text = config_text(
            &dir,
            "http://127.0.0.1:9",
            "http://127.0.0.1:9",
            &format!("[auth]\nkeys_file = \"{}\"\n{auth}", keys.display()),
        );
        EdgeConfigFile::parse(&text)
            .and_then(|f| f.build())
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    build("").unwrap();
    build("[auth.limits]\nrequests_per_minute = 10\n[auth.key_limits.team-a]\ntokens_per_minute = 5\n").unwrap();
    // A Redis Cluster's seeds (nothing connects before the first request).
    let text = config_text(
        &dir,
        "http://127.0.0.1:9",
        "http://127.0.0.1:9",
        &format!(
            "[auth]\nkeys_file = \"{}\"\n[auth.limits]\nrequests_per_minute = 10\n[auth.shared]\nredis = \"redis://127.0.0.1:7000/,redis://127.0.0.1:7001/\"\ncluster = true\n",
            keys.display()
        ),
    );
    let built = EdgeConfigFile::parse(&text).unwrap().build().unwrap();
    let shared = built.http.limiter.unwrap().config().shared.clone().unwrap();
    assert!(shared.cluster);
    assert_eq!(
        shared.url,
        "redis://127.0.0.1:7000/,redis://127.0.0.1:7001/"
    );
    for (auth, expected) in [
        (
            "[auth.limits]\nrequests_per_minute = 0\n",
            "auth.limits: a limit must be at least 1 (omit it for no limit)",
        ),
        (
            "[auth.limits]\nconcurrent = 0\n",
            "auth.limits: concurrent must be at least 1",
        ),
        (
            "[auth.key_limits.team-b]\nconcurrent = 2\n",
            "auth.key_limits: team-b: no key has this id",
        ),
        (
            "[auth.limits.models.nope]\nconcurrent = 2\n",
            "auth.limits: models.nope: no [[models]] entry has this name",
        ),
        (
            "[auth.limits]\nrequests_per_hour = 2\n",
            "unknown field `requests_per_hour`",
        ),
    ] {
        let e = build(auth).unwrap_err();
        assert!(e.contains(expected), "{auth}: {e}");
    }
    // [auth.shared].
    build("[auth.limits]\nrequests_per_minute = 10\n[auth.shared]\nredis = \"redis://127.0.0.1:9/\"\non_unavailable = \"closed\"\n").unwrap();
    for (auth, expected) in [
        (
            "[auth.shared]\nredis = \"redis://x/\"\non_unavailable = \"maybe\"\n",
            "auth.shared.on_unavailable: `maybe`: expected `local` or `closed`",
        ),
        (
            "[auth.shared]\nredis = \"redis://x/\"\nredis_env = \"X\"\n",
            "auth.shared: set exactly one of redis and redis_env",
        ),
        (
            "[auth.shared]\nredis_env = \"IOP_SURELY_UNSET_REDIS\"\n",
            "auth.shared.redis_env: environment variable IOP_SURELY_UNSET_REDIS is not set or empty",
        ),
        (
            "[auth.shared]\nredis = \"redis://x/\"\nprefix = \"a{b}\"\n",
            "auth.shared.prefix: must be non-empty",
        ),
        (
            "[auth.shared]\nredis = \"redis://x/\"\nshare = 0\n",
            "auth.shared.share: must be at least 1",
        ),
        (
            "[auth.limits]\ntokens_per_minute = 200000000\n[auth.shared]\nredis = \"redis://x/\"\n",
            "more than the store computes exactly",
        ),
        (
            "[auth.limits]\nconcurrent = 2\n[auth.shared]\nredis = \"nope://x\"\n",
            "auth.shared.redis: rate limit store unavailable",
        ),
    ] {
        let e = build(auth).unwrap_err();
        assert!(e.contains(expected), "{auth}: {e}");
    }
    // A key file line with a bad id names its line.
    std::fs::write(&keys, "sk-a team/a\n").unwrap();
    let e = build("").unwrap_err();
    assert!(e.contains(":1: a key id must be"), "{e}");
    std::fs::write(&keys, "sk-a same\nsk-b same\n").unwrap();
    let e = build("").unwrap_err();
    assert!(e.contains("key id same is used twice"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

// === Shared through Redis ===

/// A private `redis-server` on a free loopback port, which a test may kill and start again
/// on the same port.
struct Redis {
    port: u16,
    child: Option<std::process::Child>,
}

impl Redis {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut r = Self { port, child: None };
        r.restart();
        r
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn restart(&mut self) {
        let child = std::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server is required: apt-get install redis-server (scripts/test-all.sh installs it)");
        self.child = Some(child);
        for _ in 0..500 {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("redis-server did not answer on port {}", self.port);
    }

    fn ping(&self) -> bool {
        use std::io::{Read as _, Write as _};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let mut buf = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn keys(&self, pattern: &str) -> usize {
        let client = redis::Client::open(self.url()).unwrap();
        let mut conn = client.get_connection().unwrap();
        let keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query(&mut conn).unwrap();
        keys.len()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The Edge's `/metrics` text.
async fn metrics_text(base: &str) -> String {
    client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

async fn metric(base: &str, line_start: &str) -> u64 {
    let text = metrics_text(base).await;
    text.lines()
        .find_map(|l| l.strip_prefix(line_start))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

#[tokio::test]
async fn two_edges_share_one_keys_requests_and_tokens_through_redis() {
    tokio::time::timeout(LIMIT, async {
        let redis = Redis::start();
        let shared = SharedConfig::new(redis.url());
        // The file's [auth.shared] is read (the test then sets the same store in code).
        let extra = format!(
            "[auth.shared]\nredis = \"{}\"\non_unavailable = \"closed\"\nborrow_divisor = 8\n",
            redis.url()
        );
        let a = mesh_with(&extra, Some(shared.clone())).await;
        let b = mesh_with(&extra, Some(shared)).await;
        // 100 requests at once, half on each Edge; each reserves its cap (40) plus its input
        // estimate, and uses less (an upper-bound estimate: U = 0, no overshoot at all).
        let mut calls = Vec::new();
        for i in 0..100 {
            let base = if i % 2 == 0 {
                a.base.clone()
            } else {
                b.base.clone()
            };
            calls.push(tokio::spawn(async move {
                let r = post(
                    &base,
                    "/v1/chat/completions",
                    TEAM_KEY,
                    &chat("via-chat", false),
                )
                .await;
                let status = r.status().as_u16();
                let used = if status == 200 {
                    let v: Value = r.json().await.unwrap();
                    v["usage"]["total_tokens"].as_u64().unwrap()
                } else {
                    assert_eq!(status, 429);
                    // Refused by the store or by this Edge's memory of its refusal: the wait
                    // until one more request fits (1000 s per request, less what has passed).
                    let retry = number(&r, "retry-after");
                    assert!((TICK - 60..=TICK).contains(&retry), "retry-after {retry}");
                    0
                };
                (status, used)
            }));
        }
        let mut admitted = 0;
        let mut tokens = 0;
        for c in calls {
            let (status, used) = c.await.unwrap();
            if status == 200 {
                admitted += 1;
                tokens += used;
            }
        }
        // Together no more than the limits (nothing replenishes in the test's time).
        assert!(admitted <= TEAM_REQUESTS, "{admitted} requests admitted");
        assert!(tokens <= TEAM_TOKENS, "{tokens} tokens used");
        // And not much less: each Edge holds at most limit / 8 borrowed ahead when its last
        // request was admitted.
        let estimate = 40 + input_estimate("count my tokens please");
        let by_tokens = TEAM_TOKENS / estimate;
        assert!(
            admitted + 2 * (TEAM_REQUESTS / 8) + 2 >= TEAM_REQUESTS.min(by_tokens),
            "only {admitted} admitted"
        );
        let borrows = metric(
            &a.base,
            "iop_edge_ratelimit_store_calls_total{op=\"borrow\"} ",
        )
        .await
            + metric(
                &b.base,
                "iop_edge_ratelimit_store_calls_total{op=\"borrow\"} ",
            )
            .await;
        eprintln!(
            "two Edges: {admitted} of 100 admitted, {tokens} tokens, {borrows} store borrows"
        );
        assert!(borrows < 100, "{borrows} store calls for 100 requests");
        // The store holds the key's state under its hash tag.
        assert_eq!(redis.keys("iop:rl:{team}:*"), 2);
    })
    .await
    .expect("within the limit");
}

/// Two Edges share one key's spend budget through Redis: what one spent is what the other
/// sees, so the second cannot spend the budget again (each would, counting alone).
#[tokio::test]
async fn two_edges_share_one_keys_budget_through_redis() {
    tokio::time::timeout(LIMIT, async {
        let redis = Redis::start();
        let shared = SharedConfig::new(redis.url());
        let a = mesh_with("", Some(shared.clone())).await;
        let b = mesh_with("", Some(shared)).await;
        // $0.0001 a day; a request reserves $0.00009 and spends $0.000023: one fits.
        let r = post(
            &a.base,
            "/v1/chat/completions",
            BUD_KEY,
            &chat("via-chat", false),
        )
        .await;
        assert_eq!(r.status(), 200);
        // Edge B never served the key: it is refused all the same, at once "held" (Edge A holds
        // the rest as credit; its spend is reported within a second), then for good.
        let r = post(
            &b.base,
            "/v1/chat/completions",
            BUD_KEY,
            &chat("via-chat", false),
        )
        .await;
        assert_eq!(r.status(), 429, "{:?}", r.text().await);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let r = post(
                &b.base,
                "/v1/chat/completions",
                BUD_KEY,
                &chat("via-chat", false),
            )
            .await;
            assert_eq!(r.status(), 429);
            if header(&r, "x-should-retry").as_deref() == Some("false") {
                assert!(r.text().await.unwrap().contains("insufficient_quota"));
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "never refused for good"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Edge A too, once its own credit does not cover a request.
        let r = post(
            &a.base,
            "/v1/chat/completions",
            BUD_KEY,
            &chat("via-chat", false),
        )
        .await;
        assert_eq!(r.status(), 429);
        assert_eq!(header(&r, "x-should-retry").as_deref(), Some("false"));
        // The day's hash, under the key's hash tag; no month budget, no month hash.
        assert_eq!(redis.keys("iop:rl:{bud}:b:*"), 1);
        let takes = metric(
            &a.base,
            "iop_edge_ratelimit_store_calls_total{op=\"budget_take\"} ",
        )
        .await
            + metric(
                &b.base,
                "iop_edge_ratelimit_store_calls_total{op=\"budget_take\"} ",
            )
            .await;
        assert!(takes >= 2, "{takes}");
    })
    .await
    .expect("within the limit");
}

#[tokio::test]
async fn redis_killed_and_restarted_under_load_fails_as_configured_and_recovers() {
    tokio::time::timeout(LIMIT, async {
        let mut redis = Redis::start();
        let mut local = SharedConfig::new(redis.url());
        local.borrow_divisor = u64::MAX;
        let mut closed = local.clone();
        closed.on_unavailable = OnUnavailable::Closed;
        let open = mesh_with("", Some(local)).await;
        let shut = mesh_with("", Some(closed)).await;
        let ok = |base: String| async move {
            post(
                &base,
                "/v1/chat/completions",
                BIG_KEY,
                &chat("via-chat", false),
            )
            .await
        };
        assert_eq!(ok(open.base.clone()).await.status(), 200);
        assert_eq!(ok(shut.base.clone()).await.status(), 200);
        redis.kill();
        // Every request borrows (a share of 1): the store is on every request's path.
        let r = ok(open.base.clone()).await;
        assert_eq!(
            r.status(),
            200,
            "on_unavailable = local: this Edge alone decides"
        );
        assert!(header(&r, "x-ratelimit-remaining-requests").is_some());
        let r = ok(shut.base.clone()).await;
        assert_eq!(r.status(), 503, "on_unavailable = closed");
        assert_eq!(number(&r, "retry-after"), 1);
        assert!(metric(&open.base, "iop_edge_ratelimit_store_errors_total ").await >= 1);
        assert!(
            metric(
                &shut.base,
                "iop_edge_ratelimit_store_unavailable_total{key=\"big\"} "
            )
            .await
                >= 1
        );
        // Back on the same port: both recover without a restart (the reconnect waits at most
        // a second between attempts; polled, not timed).
        redis.restart();
        for base in [&open.base, &shut.base] {
            let before = redis.keys("iop:rl:{big}:*");
            assert_eq!(before, 0, "a fresh Redis");
            loop {
                let r = ok(base.clone()).await;
                if r.status() == 200 && redis.keys("iop:rl:{big}:*") == 1 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            redis.kill();
            redis.restart();
        }
    })
    .await
    .expect("within the limit");
}

// === Usage records ===

#[tokio::test]
async fn every_request_has_exactly_one_usage_record_with_its_outcome_and_tokens() {
    tokio::time::timeout(LIMIT, async {
        let db = std::env::temp_dir().join(format!("iop-usage-{}.db", std::process::id()));
        let _ = std::fs::remove_file(&db);
        let m = mesh_with(&format!("[usage]\nsqlite = \"{}\"\n", db.display()), None).await;
        // Completed: JSON, and a stream without include_usage (the Edge asked for it).
        let r = post(
            &m.base,
            "/v1/chat/completions",
            TOK_KEY,
            &chat("via-chat", false),
        )
        .await;
        let v: Value = r.json().await.unwrap();
        let (input, output) = (
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
            v["usage"]["completion_tokens"].as_u64().unwrap(),
        );
        let r = post(
            &m.base,
            "/v1/chat/completions",
            TOK_KEY,
            &chat("via-chat", true),
        )
        .await;
        let _ = r.text().await.unwrap();
        // Failed: the upstream's 404.
        let r = post(
            &m.base,
            "/v1/chat/completions",
            TOK_KEY,
            &chat("chat-missing", false),
        )
        .await;
        assert_eq!(r.status(), 404);
        // Cancelled: the client goes away mid-stream (no usage yet: the estimate, marked).
        let mut r = post(
            &m.base,
            "/v1/chat/completions",
            TOK_KEY,
            &chat("slow-chat", true),
        )
        .await;
        let _ = r.chunk().await.unwrap();
        drop(r);
        // Refused: the request key's fourth (its limit is 3).
        for _ in 0..4 {
            let _ = post(
                &m.base,
                "/v1/chat/completions",
                REQ_KEY,
                &chat("via-chat", false),
            )
            .await
            .text()
            .await;
        }
        let sink = m.usage.clone().expect("usage configured");
        let conn = rusqlite_open(&db);
        let rows = loop {
            sink.flush();
            let rows: Vec<(String, String, String, i64, i64, bool)> = query(&conn);
            if rows.len() >= 8 {
                break rows;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(rows.len(), 8, "{rows:?}");
        let count =
            |key: &str, status: &str| rows.iter().filter(|r| r.0 == key && r.2 == status).count();
        assert_eq!(count("tok", "completed"), 2, "{rows:?}");
        assert_eq!(count("tok", "failed"), 1, "{rows:?}");
        assert_eq!(count("tok", "cancelled"), 1, "{rows:?}");
        assert_eq!(count("req", "completed"), 3, "{rows:?}");
        assert_eq!(count("req", "refused"), 1, "{rows:?}");
        for r in rows.iter().filter(|r| r.0 == "tok" && r.2 == "completed") {
            assert_eq!(
                (r.3, r.4, r.5),
                (input as i64, output as i64, false),
                "{r:?}"
            );
            assert_eq!(r.1, "via-chat");
        }
        let failed = rows.iter().find(|r| r.2 == "failed").unwrap();
        assert_eq!((failed.3, failed.4, failed.5), (0, 0, false));
        let cancelled = rows.iter().find(|r| r.2 == "cancelled").unwrap();
        assert!(cancelled.5, "no usage reported: the estimate, marked");
        assert_eq!(cancelled.4, 40, "the request's max_tokens");
        // The provider's cached input is recorded (the fake reports half the prompt cached),
        // and every answered request has its time to first byte, within its duration; a
        // completed one what the mesh added (its duration less the provider's time, which the
        // Node reports on the terminal), less than the duration.
        let mut st = conn
            .prepare("SELECT status, input_tokens, cached_input_tokens, first_byte_us, duration_us, added_us FROM usage WHERE key_id = 'tok'")
            .unwrap();
        let timed: Vec<(String, i64, i64, i64, i64, i64)> = st
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?))
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        for (status, input, cached, first, duration, added) in &timed {
            match status.as_str() {
                "completed" => {
                    assert_eq!(*cached, input / 2, "{timed:?}");
                    assert!(*first > 0 && first <= duration, "{timed:?}");
                    assert!(*added > 0 && added < duration, "{timed:?}");
                }
                "cancelled" => assert!(*first > 0, "its first chunk was read: {timed:?}"),
                // The upstream's 404 has a body: its first byte counts too.
                _ => assert_eq!(*cached, 0, "{timed:?}"),
            }
        }
        // The daily rollup agrees, and /metrics counts tokens per key id and model.
        let total: i64 = conn
            .query_row("SELECT sum(requests) FROM usage_daily", [], |r| r.get(0))
            .unwrap();
        assert_eq!(total, 8);
        let metrics = metrics_text(&m.base).await;
        assert!(
            metrics.contains("iop_edge_usage_records_total{status=\"refused\"} 1"),
            "{metrics}"
        );
        assert!(metrics.contains(&format!(
            "iop_edge_usage_tokens_total{{key=\"tok\",model=\"via-chat\",direction=\"output\"}} {}",
            2 * output
        )), "{metrics}");
        assert!(metrics.contains(
            "iop_edge_usage_tokens_total{key=\"tok\",model=\"slow-chat\",direction=\"output\"} 40"
        ), "{metrics}");
        std::fs::remove_file(&db).ok();
    })
    .await
    .expect("within the limit");
}

fn rusqlite_open(path: &std::path::Path) -> rusqlite::Connection {
    rusqlite::Connection::open(path).unwrap()
}

fn query(conn: &rusqlite::Connection) -> Vec<(String, String, String, i64, i64, bool)> {
    let mut st = conn
        .prepare("SELECT key_id, model, status, input_tokens, output_tokens, estimated FROM usage ORDER BY at_ms")
        .unwrap();
    st.query_map([], |r| {
        Ok((
            r.get(0)?,
            r.get(1)?,
            r.get(2)?,
            r.get(3)?,
            r.get(4)?,
            r.get(5)?,
        ))
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

// === Budgets ===

/// The official SDKs against an exhausted budget: a Python script (openai, anthropic) that
/// makes one call per line of output and prints how it ended.
const SDK_BUDGET: &str = r#"
import os, openai, anthropic
base, key = os.environ["BASE"], os.environ["KEY"]
oc = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=2)
body = dict(model="via-chat", max_tokens=40, messages=[{"role": "user", "content": "count my tokens please"}])
r = oc.chat.completions.create(**body)
print("openai ok", r.usage.total_tokens)
try:
    oc.chat.completions.create(**body)
    print("openai unexpected success")
except openai.RateLimitError as e:
    print("openai refused", e.code, e.response.headers.get("x-should-retry"))
ac = anthropic.Anthropic(base_url=base, api_key=key, max_retries=2)
try:
    ac.messages.create(model="via-anth", max_tokens=40, messages=[{"role": "user", "content": "count my tokens please"}])
    print("anthropic unexpected success")
except anthropic.RateLimitError as e:
    print("anthropic refused", e.response.headers.get("x-should-retry"))
"#;

#[tokio::test]
async fn an_exhausted_budget_is_not_retried_by_either_official_sdk_and_survives_a_restart() {
    tokio::time::timeout(LIMIT, async {
        let sdk = std::process::Command::new("python3")
            .args(["-c", "import openai, anthropic"])
            .status();
        assert!(
            sdk.is_ok_and(|s| s.success()),
            "the official SDKs are required: python3 -m pip install openai anthropic (scripts/test-all.sh does this)"
        );
        let db = std::env::temp_dir().join(format!("iop-budget-{}.db", std::process::id()));
        let _ = std::fs::remove_file(&db);
        let usage = format!("[usage]\nsqlite = \"{}\"\n", db.display());
        let m = mesh_with(&usage, None).await;
        let (chat_before, anth_before) = (m.chat.seen().len(), m.anthropic.seen().len());
        let out = tokio::process::Command::new("python3")
            .args(["-c", SDK_BUDGET])
            .env("BASE", &m.base)
            .env("KEY", BUD_KEY)
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines[0], "openai ok 18", "{stdout}");
        assert_eq!(lines[1], "openai refused insufficient_quota false", "{stdout}");
        assert_eq!(lines[2], "anthropic refused false", "{stdout}");
        // Not retried: one upstream call in all (the first), and one request each reached
        // the Edge for the two refusals (the records say so; a retry would add one each).
        assert_eq!(m.chat.seen().len() - chat_before, 1);
        assert_eq!(m.anthropic.seen().len() - anth_before, 0);
        let sink = m.usage.clone().unwrap();
        sink.flush();
        let conn = rusqlite_open(&db);
        let statuses: Vec<(String, String, i64)> = {
            let mut st = conn.prepare("SELECT key_id, status, cost_pusd FROM usage ORDER BY at_ms").unwrap();
            st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().collect::<Result<_, _>>().unwrap()
        };
        assert_eq!(
            statuses,
            [
                ("bud".into(), "completed".into(), 23_000_000),
                ("bud".into(), "refused".into(), 0),
                ("bud".into(), "refused".into(), 0),
            ],
            "cost: 13 input tokens at $1/M and 5 output at $2/M"
        );
        // A restarted Edge on the same records knows what the key spent today.
        let again = mesh_with(&usage, None).await;
        let r = post(&again.base, "/v1/chat/completions", BUD_KEY, &chat("via-chat", false)).await;
        assert_eq!(r.status(), 429);
        assert_eq!(header(&r, "x-should-retry").as_deref(), Some("false"));
        std::fs::remove_file(&db).ok();
    })
    .await
    .expect("within the limit");
}

/// Reads `r`'s body until it holds `marker`, then goes away (as SDKs do at `[DONE]`); the text
/// read.
async fn read_until_then_leave(r: reqwest::Response, marker: &str) -> String {
    let mut text = String::new();
    let mut chunks = r.bytes_stream();
    while !text.contains(marker) {
        let chunk = futures_util::StreamExt::next(&mut chunks)
            .await
            .unwrap_or_else(|| panic!("the body ended before {marker}: {text}"))
            .unwrap();
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    text
}

/// Until `upstream` has seen more than `before` of its streams' readers go away.
async fn until_dropped(upstream: &Upstream, before: usize) {
    while upstream.dropped_count() == before {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_client_gone_at_done_is_charged_the_usage_its_stream_reported() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        let estimate = 40 + input_estimate("count my tokens please");
        // `linger` ends its response only when its reader goes away: the client leaves as soon
        // as it has read `data: [DONE]`, as SDKs do, before the provider's response ends.
        let mut body = chat("linger-chat", true);
        body["stream_options"] = json!({"include_usage": true});
        let drops = m.chat.dropped_count();
        let (remaining, _, r) = tokens_after(&m.base, "/v1/chat/completions", &body).await;
        assert_eq!(remaining, 1000 - estimate, "the estimate is reserved");
        let sse = read_until_then_leave(r, "data: [DONE]").await;
        let used = sse
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| v["usage"]["total_tokens"].as_u64())
            .expect("usage chunk");
        assert_ne!(used, estimate);
        // The Edge let go of the stream (its Node then closed the provider's connection).
        until_dropped(&m.chat, drops).await;
        let (remaining, _, _) =
            tokens_after(&m.base, "/v1/chat/completions", &chat("via-chat", false)).await;
        assert_eq!(
            remaining,
            1000 - used - estimate,
            "the reported usage is charged, not the whole reservation"
        );
    })
    .await
    .expect("within the limit");
}

#[tokio::test]
async fn a_client_gone_mid_stream_keeps_its_whole_reservation() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        let estimate = 40 + input_estimate("count my tokens please");
        // `hang` sends Anthropic's message_start (3 input tokens, 1 output token so far) and
        // then nothing: partial figures, which must not stand in for the answer's usage.
        let drops = m.anthropic.dropped_count();
        let (remaining, _, r) =
            tokens_after(&m.base, "/v1/messages", &chat("hang-anth", true)).await;
        assert_eq!(remaining, 1000 - estimate, "the estimate is reserved");
        read_until_then_leave(r, "message_start").await;
        until_dropped(&m.anthropic, drops).await;
        let (remaining, _, _) =
            tokens_after(&m.base, "/v1/chat/completions", &chat("via-chat", false)).await;
        assert_eq!(
            remaining,
            1000 - 2 * estimate,
            "the reservation is kept whole, not reconciled to message_start's figures"
        );
    })
    .await
    .expect("within the limit");
}

#[tokio::test]
async fn an_upstream_marked_trace_propagation_false_gets_no_traceparent() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
        let traceparent = format!("00-{trace}-00f067aa0ba902b7-01");
        let mut seen = Vec::new();
        // `via-chat` and `plain-chat` share the upstream; only `plain`'s adapter says
        // `trace_propagation = false`.
        for model in ["via-chat", "plain-chat"] {
            let r = client()
                .post(format!("{}/v1/chat/completions", m.base))
                .bearer_auth(FREE_KEY)
                .header("traceparent", &traceparent)
                .json(&chat(model, false))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{model}");
            let sent = m.chat.seen().into_iter().last().unwrap();
            seen.push(sent.header("traceparent").map(str::to_owned));
        }
        let propagated = seen[0]
            .as_deref()
            .expect("via-chat's upstream gets a traceparent");
        assert!(propagated.contains(trace), "{propagated}");
        assert_eq!(
            seen[1], None,
            "plain-chat's upstream must get no traceparent"
        );
    })
    .await
    .expect("within the limit");
}

#[tokio::test]
async fn an_upstream_marked_stream_usage_false_is_not_asked_and_keeps_the_reservation() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh().await;
        let estimate = 40 + input_estimate("count my tokens please");
        let r = post(
            &m.base,
            "/v1/chat/completions",
            TOK_KEY,
            &chat("plain-chat", true),
        )
        .await;
        assert_eq!(r.status(), 200);
        assert_eq!(number(&r, "x-ratelimit-remaining-tokens"), 1000 - estimate);
        let sse = r.text().await.unwrap();
        assert!(sse.ends_with("data: [DONE]\n\n"), "{sse}");
        let sent = m.chat.seen().into_iter().last().unwrap();
        let sent: Value = serde_json::from_slice(&sent.body).unwrap();
        assert!(sent.get("stream_options").is_none(), "{sent}");
        // No usage reported: the stream keeps its whole reservation.
        let (remaining, _, _) =
            tokens_after(&m.base, "/v1/chat/completions", &chat("plain-chat", false)).await;
        assert_eq!(remaining, 1000 - 2 * estimate);
    })
    .await
    .expect("within the limit");
}
