//! `proc_load`: the mesh as an operator runs it — the upstream, the `iop-edge` binary and the
//! `iop-node` binary as **separate processes** — against the same upstream called directly,
//! in the same run. Prints Markdown tables; numbers go to `benches/README.md`.
//!
//! ```text
//! cargo build --release -p iop-bins && cargo run --release -p iop-benches --bin proc_load
//! PROC_LOAD_RATES=100,500,1000 PROC_LOAD_SECONDS=5 cargo run --release -p iop-benches --bin proc_load -- latency
//! IOP_EDGE_BIN=/old/iop-edge IOP_NODE_BIN=/old/iop-node cargo run --release -p iop-benches --bin proc_load
//! ```
//!
//! Processes: this tool (the load generator, a current-thread tokio runtime with a pooled
//! keep-alive HTTP/1.1 client), the upstream (this binary re-executed as `proc_load upstream`:
//! a minimal axum server on a current-thread runtime answering `POST /v1/chat/completions`
//! with a 1 KiB JSON completion, or 6 SSE events when `"stream":true`), `iop-edge` and
//! `iop-node` (release builds next to this one, or `IOP_EDGE_BIN` / `IOP_NODE_BIN`), Edge ⇄
//! Node over mTLS on loopback. All four share the machine's cores.
//!
//! - **latency**: open loop at each rate of `PROC_LOAD_RATES` (default 100,500,1000 per path)
//!   for `PROC_LOAD_SECONDS` (default 5) s: ticks at twice the rate alternate a request straight
//!   to the upstream and one through the Edge, so both paths see the same moments of a noisy
//!   machine without queueing behind each other.
//!   Non-streaming ≈1 KiB chat completion (time to the last byte), then streaming (time to the
//!   first body byte, TTFB). p50/p99 of each path and the difference; the Edge's and the
//!   Node's CPU time per request (from `/proc/PID/stat`) over the mesh requests of the run.
//! - **max**: closed loop, `C` concurrent clients (16 and 64) for 4 s, non-streaming, direct
//!   then through the mesh: requests per second and the ratio.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "load tool"
)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use iop_benches::load::{Killed, bin, free_port, percentile};
use iop_tests::pki::{self, Ca};
use iop_wire::identity::role;

const MODEL: &str = "proc-model";

/// Milliseconds, three decimals.
fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

/// CPU time (user + system) of `pid` so far.
fn cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the state.
    let ticks = f.get(10).copied().unwrap_or(0) + f.get(11).copied().unwrap_or(0);
    Duration::from_secs_f64(ticks as f64 / clk_tck())
}

fn clk_tck() -> f64 {
    static TCK: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TCK.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

// === The upstream (its own process) ===

fn completion() -> Bytes {
    let content = "x".repeat(800);
    Bytes::from(format!(
        r#"{{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"{MODEL}","choices":[{{"index":0,"message":{{"role":"assistant","content":"{content}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":12,"completion_tokens":200,"total_tokens":212}}}}"#
    ))
}

fn sse() -> Bytes {
    let mut out = String::new();
    for i in 0..6 {
        out.push_str(&format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}},\"finish_reason\":null}}]}}\n\n"
        ));
    }
    out.push_str("data: [DONE]\n\n");
    Bytes::from(out)
}

fn upstream(port: u16) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let (json, events) = (completion(), sse());
        let app = Router::new().route(
            "/v1/chat/completions",
            post(move |body: Bytes| {
                let (json, events) = (json.clone(), events.clone());
                async move {
                    let stream = body.windows(13).any(|w| w == b"\"stream\":true");
                    let (ty, b) = if stream {
                        ("text/event-stream", events)
                    } else {
                        ("application/json", json)
                    };
                    Response::builder()
                        .header("content-type", ty)
                        .body(Body::from(b))
                        .unwrap()
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        iop_edge::http::serve(listener, app, std::future::pending())
            .await
            .unwrap();
    });
}

// === The mesh ===

struct Mesh {
    edge: Killed,
    node: Killed,
    _upstream: Killed,
    http: u16,
    upstream: u16,
}

fn wait_port(port: u16) {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(30), "port {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn start(dir: &Path) -> Mesh {
    let ca = Ca::new("proc_load CA");
    let edge_leaf = ca.workload(role::EDGE, "edge-1", true);
    let node_leaf = ca.workload(role::NODE, "node-1", false);
    for (name, text) in [
        ("ca.pem", ca.pem()),
        ("edge.pem", edge_leaf.cert_pem.clone()),
        ("edge.key", edge_leaf.key_pem.clone()),
        ("node.pem", node_leaf.cert_pem.clone()),
        ("node.key", node_leaf.key_pem.clone()),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let (http, nodes, up) = (free_port(), free_port(), free_port());
    let upstream = Killed(
        Command::new(std::env::current_exe().unwrap())
            .args(["upstream", &up.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_port(up);
    let d = dir.display();
    let edge = format!(
        "edge_id = \"edge-1\"\n[listen]\nnodes = \"127.0.0.1:{nodes}\"\nhttp = \"127.0.0.1:{http}\"\n[tls]\ntrust_domain = \"{td}\"\nca = \"{d}/ca.pem\"\ncert = \"{d}/edge.pem\"\nkey = \"{d}/edge.key\"\n[[nodes]]\nnode_id = \"node-1\"\n[[nodes.adapters]]\nname = \"up\"\ntype = \"openai_compat\"\nbase_url = \"http://127.0.0.1:{up}/v1\"\ncapacity = 512\n[[models]]\nname = \"{MODEL}\"\n[[models.providers]]\nnode_id = \"node-1\"\nprovider_id = \"up\"\nadapter = \"up\"\ntarget = \"{MODEL}\"\ncapacity = 512\n",
        td = pki::TRUST_DOMAIN,
    );
    let node = format!(
        "node_id = \"node-1\"\n[edge]\naddress = \"127.0.0.1:{nodes}\"\nserver_name = \"localhost\"\nname = \"edge-1\"\n[tls]\ntrust_domain = \"{td}\"\nca = \"{d}/ca.pem\"\ncert = \"{d}/node.pem\"\nkey = \"{d}/node.key\"\n[reconnect]\ninterval_sec = 1\nmax_attempts = 0\n",
        td = pki::TRUST_DOMAIN,
    );
    std::fs::write(dir.join("edge.toml"), edge).unwrap();
    std::fs::write(dir.join("node.toml"), node).unwrap();
    let spawn = |var: &str, name: &str, config: &str| {
        Killed(
            Command::new(bin(var, name))
                .arg("--config")
                .arg(dir.join(config))
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let edge = spawn("IOP_EDGE_BIN", "iop-edge", "edge.toml");
    let node = spawn("IOP_NODE_BIN", "iop-node", "node.toml");
    wait_port(http);
    Mesh {
        edge,
        node,
        _upstream: upstream,
        http,
        upstream: up,
    }
}

fn body(stream: bool) -> String {
    let prompt = "y".repeat(900);
    format!(
        r#"{{"model":"{MODEL}","stream":{stream},"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    )
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .build()
        .unwrap()
}

/// One request; the time to the last byte, or (streaming) to the first body byte.
async fn once(client: &reqwest::Client, url: &str, body: &str, first_byte: bool) -> Duration {
    let t = Instant::now();
    let mut resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{url}: {}", resp.status());
    let mut first = None;
    while let Some(chunk) = resp.chunk().await.unwrap() {
        if first.is_none() && !chunk.is_empty() {
            first = Some(t.elapsed());
        }
    }
    let last = t.elapsed();
    if first_byte {
        first.unwrap_or(last)
    } else {
        last
    }
}

fn urls(m: &Mesh) -> (String, String) {
    (
        format!("http://127.0.0.1:{}/v1/chat/completions", m.upstream),
        format!("http://127.0.0.1:{}/v1/chat/completions", m.http),
    )
}

/// Open loop at `rate`/s per path for `seconds`: (direct, mesh) samples, sorted.
async fn paired(m: &Mesh, rate: u32, seconds: u32, stream: bool) -> (Vec<Duration>, Vec<Duration>) {
    let (direct, mesh) = urls(m);
    let client = client();
    let body = Arc::new(body(stream));
    let mut tasks = Vec::new();
    // Ticks at twice the rate alternate the paths: both see the same moments of a noisy
    // machine, and neither waits behind the other's request.
    let mut tick = tokio::time::interval(Duration::from_secs(1) / (2 * rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    for i in 0..2 * rate * seconds {
        tick.tick().await;
        let (path, url) = if i % 2 == 0 {
            (0, direct.clone())
        } else {
            (1, mesh.clone())
        };
        let (client, body) = (client.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            (path, once(&client, &url, &body, stream).await)
        }));
    }
    let (mut d, mut n) = (Vec::new(), Vec::new());
    for t in tasks {
        let (path, took) = t.await.unwrap();
        if path == 0 { &mut d } else { &mut n }.push(took);
    }
    d.sort();
    n.sort();
    (d, n)
}

async fn latency(m: &Mesh) {
    let rates: Vec<u32> = std::env::var("PROC_LOAD_RATES")
        .unwrap_or_else(|_| "100,500,1000".into())
        .split(',')
        .map(|r| r.trim().parse().unwrap())
        .collect();
    let seconds: u32 = std::env::var("PROC_LOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    // Warm both paths (connections, TLS session, allocator).
    let _ = paired(m, 200, 1, false).await;
    for (stream, what) in [
        (false, "non-streaming ≈1 KiB chat, time to last byte"),
        (true, "streaming chat, time to first body byte (TTFB)"),
    ] {
        println!(
            "\n**Added latency, {what}** (open loop, paths alternating, {seconds} s per rate):\n"
        );
        println!(
            "| rate/path | direct p50 | mesh p50 | **added p50** | direct p99 | mesh p99 | **added p99** | Edge CPU/req | Node CPU/req |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for &rate in &rates {
            let (e0, n0) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
            let (d, n) = paired(m, rate, seconds, stream).await;
            let (e1, n1) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
            let per = |a: Duration, b: Duration| ms((b - a) / (n.len() as u32));
            let (d50, n50) = (percentile(&d, 0.5), percentile(&n, 0.5));
            let (d99, n99) = (percentile(&d, 0.99), percentile(&n, 0.99));
            println!(
                "| {rate}/s | {} | {} | **{}** | {} | {} | **{}** | {} | {} |",
                ms(d50),
                ms(n50),
                ms(n50.saturating_sub(d50)),
                ms(d99),
                ms(n99),
                ms(n99.saturating_sub(d99)),
                per(e0, e1),
                per(n0, n1),
            );
        }
    }
}

async fn closed_loop(url: &str, concurrency: usize, run: Duration) -> f64 {
    let client = client();
    let body = Arc::new(body(false));
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + run;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, body, done, url) =
            (client.clone(), body.clone(), done.clone(), url.to_owned());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                once(&client, &url, &body, false).await;
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let t = Instant::now();
    for task in tasks {
        task.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / t.elapsed().as_secs_f64()
}

async fn max(m: &Mesh) {
    let (direct, mesh) = urls(m);
    println!("\n**Max sustained requests/s** (closed loop, non-streaming, 4 s per cell):\n");
    println!(
        "| concurrency | direct (baseline) | through the mesh | mesh ÷ direct | Edge CPU/req | Node CPU/req |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for c in [16, 64] {
        let d = closed_loop(&direct, c, Duration::from_secs(4)).await;
        let (e0, n0) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
        let mesh_rps = closed_loop(&mesh, c, Duration::from_secs(4)).await;
        let (e1, n1) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
        let reqs = mesh_rps * 4.0;
        let per =
            |a: Duration, b: Duration| format!("{:.3} ms", (b - a).as_secs_f64() * 1e3 / reqs);
        println!(
            "| {c} | {d:.0} | {mesh_rps:.0} | {:.2}× | {} | {} |",
            mesh_rps / d,
            per(e0, e1),
            per(n0, n1)
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("upstream") {
        return upstream(args[2].parse().unwrap());
    }
    let part = args.get(1).cloned().unwrap_or_default();
    // `serve`: start the mesh, print its ports, run until killed (for wrk, perf, ad hoc clients).
    let serve = part == "serve";
    // reqwest's rustls backend needs a process-wide provider even for http:// URLs.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!("proc_load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mesh = start(&dir);
    println!(
        "proc_load: edge {} (pid {}), node {} (pid {}); {} cores",
        bin("IOP_EDGE_BIN", "iop-edge").display(),
        mesh.edge.0.id(),
        bin("IOP_NODE_BIN", "iop-node").display(),
        mesh.node.0.id(),
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // The mesh is up when a request passes.
        let (_, url) = urls(&mesh);
        let c = client();
        let start = Instant::now();
        loop {
            let ok = c
                .post(&url)
                .header("content-type", "application/json")
                .body(body(false))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "mesh did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if serve {
            println!(
                "proc_load: serving: mesh http://127.0.0.1:{}/v1/chat/completions, upstream http://127.0.0.1:{}/v1/chat/completions",
                mesh.http, mesh.upstream
            );
            std::future::pending::<()>().await;
        }
        if part.is_empty() || part == "latency" {
            latency(&mesh).await;
        }
        if part.is_empty() || part == "max" {
            max(&mesh).await;
        }
    });
    drop(mesh);
    let _ = std::fs::remove_dir_all(&dir);
}
