//! The embedding examples, run as a user runs them: example (a) (`edge-in-axum`) and example
//! (b) (`custom-adapter-node`) as two processes, and real HTTP clients against the application.
//!
//! Checked: the application's own route, fallback and authentication stay in force around the
//! mounted API; a chat completion is served by (a)'s in-process demo Nodes; (b)'s Node, whose
//! certificate (a) exported, registers after (a) rotated its own certificate in place, and its
//! custom adapter streams the reversed words; the Edge's connection limits govern the
//! application's listener (a connection that sends no request is closed by the header timeout
//! of `[limits]`; a bare `axum::serve` would keep it open).
//!
//! Example (c) (`managed-edge --once`) runs whole: a Control Plane from the library, a
//! managed Edge and a Node with a credential plane, one client request with a token.
//!
//! Nothing here waits on a tight window: each wait is for an event (a printed line, a closed
//! socket), bounded only to fail instead of hanging.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(120);

/// A child process killed on drop, with its stdout lines on a channel.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Proc {
    fn spawn(bin: &str, args: &[&str]) -> Self {
        let mut child = Command::new(bin)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap_or_else(|e| panic!("{bin}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The rest of the first line that starts with `prefix`.
    fn wait_for(&mut self, prefix: &str) -> String {
        if let Some(l) = self.seen.iter().find(|l| l.starts_with(prefix)) {
            return l[prefix.len()..].to_owned();
        }
        loop {
            let line = self
                .lines
                .recv_timeout(WAIT)
                .unwrap_or_else(|_| panic!("no line `{prefix}…` (saw {:?})", self.seen));
            self.seen.push(line.clone());
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_owned();
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn chat(model: &str, content: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": content}],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_in_axum_and_a_custom_adapter_node_serve_real_clients() {
    let dir = std::env::temp_dir().join(format!("iop-examples-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_arg = dir.to_str().expect("utf-8 temp dir").to_owned();
    std::fs::create_dir_all(&dir).expect("temp dir");
    let token_file = dir.join("admin.token");
    std::fs::write(&token_file, "example-admin-token-0123\n").expect("token file");
    let token_arg = token_file.to_str().expect("utf-8").to_owned();

    let mut a = Proc::spawn(
        env!("CARGO_BIN_EXE_edge-in-axum"),
        &[
            "--admin-token-file",
            &token_arg,
            "--listen",
            "127.0.0.1:0",
            "--rotate-secs",
            "1",
            "--export-node-tls",
            &dir_arg,
        ],
    );
    let page = a.wait_for("status page on ");
    let nodes = a.wait_for("nodes on ");
    let app = a.wait_for("app on ");
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();

    // The status page: the token opens it, nothing else does, and it knows the Nodes.
    let status = format!("{page}api/status");
    let denied = http.get(&status).send().await.expect("status page");
    assert_eq!(denied.status(), 401);
    let mut seen = serde_json::Value::Null;
    for _ in 0..500 {
        seen = http
            .get(&status)
            .bearer_auth("example-admin-token-0123")
            .send()
            .await
            .expect("status page")
            .json()
            .await
            .expect("json");
        if seen["nodes"].as_array().is_some_and(|n| n.len() >= 2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        seen["nodes"].as_array().is_some_and(|n| n
            .iter()
            .filter(|n| n["state"] == "ready")
            .count()
            >= 2),
        "{seen}"
    );

    // The connection limits of `[limits]` (header timeout 10 s) hold on the app's listener:
    // a connection that never sends a request is closed by the server.
    let idle = {
        let addr = app.trim_start_matches("http://").to_owned();
        std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(60)))
                .expect("timeout");
            let mut buf = [0u8; 1];
            // 0 bytes (closed) or a reset: the server let it go. Our own read timeout is not.
            match s.read(&mut buf) {
                Ok(n) => n == 0,
                Err(e) => !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
            }
        })
    };

    // The application's own route and fallback.
    let get = |path: &str| http.get(format!("{app}{path}")).send();
    let r = get("/").await.expect("GET /");
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.expect("body"), "my application\n");
    let r = get("/no/such/page").await.expect("GET fallback");
    assert_eq!(r.status(), 404);
    assert_eq!(r.text().await.expect("body"), "no such page in my app\n");
    // The Edge's health under /ops.
    let r = get("/ops/readyz").await.expect("readyz");
    assert_eq!(r.status(), 200, "two demo Nodes are ready");

    // The application's authentication decides who may call the API.
    let post = |user: Option<&str>, body: serde_json::Value| {
        let mut req = http
            .post(format!("{app}/llm/v1/chat/completions"))
            .json(&body);
        if let Some(u) = user {
            req = req.header("x-app-user", u);
        }
        req.send()
    };
    let r = post(None, chat("demo", "hello", false))
        .await
        .expect("post");
    assert_eq!(r.status(), 401);
    assert_eq!(r.text().await.expect("body"), "sign in to my app first\n");
    let r = post(Some("mallory"), chat("demo", "hello", false))
        .await
        .expect("post");
    assert_eq!(r.status(), 401);
    let r = post(Some("alice"), chat("demo", "hello from alice", false))
        .await
        .expect("post");
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.expect("json");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "echo: hello from alice"
    );
    // alice's rate limit (3 a minute, set in code for the id her login gives): two more, then
    // 429 with the real wait; bob is not limited.
    for left in [1, 0] {
        let r = post(Some("alice"), chat("demo", "again", false))
            .await
            .expect("post");
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["x-ratelimit-remaining-requests"],
            left.to_string().as_str()
        );
    }
    let r = post(Some("alice"), chat("demo", "once more", false))
        .await
        .expect("post");
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("seconds");
    assert!((1..=20).contains(&retry), "retry-after {retry}");
    let v: serde_json::Value = r.json().await.expect("json");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");

    // (a) rotates its certificate in place; (b) then dials it with the identity (a) exported.
    a.wait_for("edge certificate rotated");
    a.wait_for("node-fn identity written to ");
    let _b = Proc::spawn(
        env!("CARGO_BIN_EXE_custom-adapter-node"),
        &["--edge", &nodes, "--tls-dir", &dir_arg],
    );
    // The model waits in the Edge's queue until node-fn is ready (queue_wait_sec = 10); retry
    // on 503 so a slow start cannot fail the test, and never accept another answer.
    let mut streamed = String::new();
    for _ in 0..30 {
        let r = post(Some("bob"), chat("reverse", "one two three", true))
            .await
            .expect("post");
        if r.status() == 503 {
            continue;
        }
        assert_eq!(r.status(), 200);
        streamed = r.text().await.expect("body");
        break;
    }
    let deltas: String = streamed
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(deltas, "three two one", "streamed: {streamed}");
    assert!(streamed.trim_end().ends_with("data: [DONE]"), "{streamed}");

    assert!(
        tokio::task::spawn_blocking(move || idle.join().expect("idle thread"))
            .await
            .expect("join"),
        "the idle connection was closed by the header timeout"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Example (c): the managed Edge against an in-process Control Plane answers a client that
/// presents the Control Plane's token, through a Node that holds no upstream key (the stand-in
/// upstream answers only with the key the Control Plane leased).
#[test]
fn a_managed_edge_serves_a_token_holder_with_a_leased_key() {
    let mut c = Proc::spawn(env!("CARGO_BIN_EXE_managed-edge"), &["--once"]);
    let answer = c.wait_for("answer: ");
    assert_eq!(answer, "\"the upstream heard: hello from team a\"");
    let status = c.child.wait().expect("exit");
    assert!(status.success(), "{status}");
}
