//! `proc_load`: the mesh as an operator runs it — the upstream, the `iop-edge` binary and the
//! `iop-node` binary as **separate processes** — against the same upstream called directly,
//! in the same run. Prints Markdown tables; numbers go to `benches/README.md`.
//!
//! ```text
//! cargo build --release -p iop-bins && cargo run --release -p iop-benches --bin proc_load
//! cargo run --release -p iop-benches --bin proc_load -- instructions
//! PROC_LOAD_RATES=100,500,1000 PROC_LOAD_SECONDS=5 cargo run --release -p iop-benches --bin proc_load -- latency
//! IOP_EDGE_BIN=/old/iop-edge IOP_NODE_BIN=/old/iop-node cargo run --release -p iop-benches --bin proc_load
//! ```
//!
//! Processes: this tool (the load generator: a current-thread tokio runtime with a minimal
//! raw HTTP/1.1 keep-alive client, `iop_benches::load::RawHttp`), the upstream (this binary
//! re-executed as `proc_load upstream`: a minimal axum server on a current-thread runtime
//! answering `POST /v1/chat/completions` with a 1 KiB JSON completion, or 6 SSE events when
//! `"stream":true`), `iop-edge` and `iop-node` (release builds next to this one, or
//! `IOP_EDGE_BIN` / `IOP_NODE_BIN`), Edge ⇄ Node over mTLS on loopback. All share the cores.
//!
//! The floor, in the same run: the upstream behind two minimal forwarding processes (this binary
//! as `proc_load relay`, current-thread, `copy_bidirectional`) standing where the Edge and the
//! Node stand, once over plain TCP and once over the mesh's own mTLS between the two. No design
//! of two extra processes can cost less than they do; the mesh's figure minus theirs is what
//! our code adds.
//!
//! - **latency**: open loop at each rate of `PROC_LOAD_RATES` (default 100,500,1000 per path)
//!   for `PROC_LOAD_SECONDS` (default 5) s per path: ticks at twice the rate alternate a request
//!   straight to the upstream and one through the path measured (the TCP relays, the TLS
//!   relays, the mesh), so both see the same moments of a noisy machine without queueing behind
//!   each other. Non-streaming ≈1 KiB chat completion (time to the last byte), then streaming
//!   (time to the first body byte, TTFB). Added p50/p99 over the direct path of each; the Edge's
//!   and the Node's CPU time per request (from `/proc/PID/stat`) over the mesh requests.
//! - **max**: closed loop, `C` concurrent connections (16 and 64) for 4 s, non-streaming:
//!   direct, the relays, then the mesh: requests per second and the mesh's ratio to direct.
//! - **held** (`proc_load held`, not in the default run; issue #32's capacity model): what an
//!   open stream holds. `PROC_LOAD_HELD` (default 400) streaming requests whose upstream sends
//!   its first event and then nothing for 120 s, opened at once and held while the Edge's and
//!   the Node's resident memory and open descriptors are read from `/proc`, against their
//!   values before. The same through the two mTLS relays (the floor) in the same run. Then the
//!   clients go away and the figures are read again. **waiting** (`proc_load waiting`): the
//!   same with requests whose upstream sends nothing at all for 120 s (a provider slow to
//!   start its answer): what a request waiting for its response's head holds.
//! - **instructions** (`proc_load instructions`, not in the default run; needs `valgrind`):
//!   the Edge, the Node and the two mTLS relays each run under callgrind, and the user-space
//!   instructions each spends per request (non-streaming and streaming, `PROC_LOAD_REQUESTS`
//!   of each, default 1000, on one keep-alive connection after 300 to warm up) are printed
//!   beside each other. A count, repeatable to a fraction of a percent on a noisy machine
//!   where the timings above swing by more than most changes move them; it leaves out the
//!   kernel and cold caches, which the timings include. `PROC_LOAD_PROFILES=DIR` keeps the
//!   profiles in `DIR` (one file per process and dump) for `callgrind_annotate`.
//! - **tracing** (`proc_load tracing`, not in the default run): three meshes at once, tracing
//!   off, on at 1 % sampling and on at 100 %, all exporting over OTLP/HTTP to a minimal
//!   collector process (this binary as `proc_load collector`, which reads and discards the
//!   batches); three interleaved rounds of the open-loop latency at `PROC_LOAD_TRACE_RATE`
//!   (default 500/s, `PROC_LOAD_SECONDS` each) and of the 64-client closed loop, medians of
//!   three with the per-run values. The tracing-off mesh's `iop_edge_gateway_overhead_seconds`
//!   (scraped before and after each round) is set beside the added latency measured here:
//!   the mean of the histogram against the mean added latency of the same requests, over the
//!   direct upstream and over the mTLS relay floor (measured in the same round).
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
use iop_benches::load::{
    Exchange, Killed, RawHttp, bin, cpu, fds, free_port, percentile, post_json, rss_kib, wait_port,
};
use iop_tests::pki::{self, Ca};
use workload_identity::role;

const MODEL: &str = "proc-model";

/// Milliseconds, three decimals.
fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
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

/// A request whose body holds this is answered with its first SSE event, then nothing for
/// [`HOLD_FOR`] (an open stream that costs only what it holds).
const HOLD_MARK: &[u8] = b"HOLD-THIS-STREAM";
const HOLD_FOR: Duration = Duration::from_secs(120);
/// A request whose body holds this is answered after [`HOLD_FOR`] (a request waiting for its
/// response's head).
const WAIT_MARK: &[u8] = b"WAIT-FOR-THE-HEAD";

fn held_response(events: Bytes) -> Response {
    let first = events.slice(..events.iter().position(|&b| b == b'\n').unwrap() + 2);
    let rest = events.slice(first.len()..);
    let body = futures_util::stream::unfold(0u8, move |state| {
        let (first, rest) = (first.clone(), rest.clone());
        async move {
            match state {
                0 => Some((Ok::<_, std::convert::Infallible>(first), 1)),
                1 => {
                    tokio::time::sleep(HOLD_FOR).await;
                    Some((Ok(rest), 2))
                }
                _ => None,
            }
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(body))
        .unwrap()
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
                    if body.windows(HOLD_MARK.len()).any(|w| w == HOLD_MARK) {
                        return held_response(events);
                    }
                    if body.windows(WAIT_MARK.len()).any(|w| w == WAIT_MARK) {
                        tokio::time::sleep(HOLD_FOR).await;
                    }
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

fn start(dir: &Path) -> Mesh {
    start_with(dir, "", None)
}

/// The mesh, with `telemetry` (a `[telemetry]` table, or nothing) in the Edge's and the
/// Node's configuration; with `callgrind`, the Edge and the Node run under it and write their
/// profiles there (`iop-edge.out`, `iop-node.out`).
fn start_with(dir: &Path, telemetry: &str, callgrind: Option<&Path>) -> Mesh {
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
    std::fs::write(dir.join("edge.toml"), edge + telemetry).unwrap();
    std::fs::write(dir.join("node.toml"), node + telemetry).unwrap();
    let spawn = |var: &str, name: &str, config: &str| {
        let mut command = under_callgrind(callgrind, name, bin(var, name));
        Killed(
            command
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

// === The floor: the same upstream behind two minimal forwarding processes ===

/// How a relay process forwards.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RelayMode {
    /// Bytes as they come, both ways.
    Plain,
    /// Plain in, mTLS out (where the Edge sits).
    TlsOut,
    /// mTLS in, plain out (where the Node sits).
    TlsIn,
}

/// `proc_load relay LISTEN TARGET MODE DIR`: a minimal forwarding process (current-thread
/// tokio, one upstream connection per accepted one, `copy_bidirectional`), the least any
/// process in the path can cost. Two of them in a row stand where the Edge and the Node do;
/// in TLS mode the link between them is the mesh's own mTLS (the same `WorkloadTls` configs,
/// TLS 1.3, no resumption, certificates from `DIR`).
fn relay(listen: u16, target: u16, mode: RelayMode, dir: &Path) {
    use workload_identity::ExpectedPeer;
    use workload_identity::WorkloadTls;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let acceptor = (mode == RelayMode::TlsIn).then(|| {
        let tls =
            WorkloadTls::from_pem(&read("ca.pem"), &read("edge.pem"), &read("edge.key")).unwrap();
        let expected = ExpectedPeer::any_name(pki::TRUST_DOMAIN, role::NODE).unwrap();
        tokio_rustls::TlsAcceptor::from(Arc::new(tls.server_config(expected).unwrap()))
    });
    let connector = (mode == RelayMode::TlsOut).then(|| {
        let tls =
            WorkloadTls::from_pem(&read("ca.pem"), &read("node.pem"), &read("node.key")).unwrap();
        let expected = ExpectedPeer::exact(pki::TRUST_DOMAIN, role::EDGE, "edge-1").unwrap();
        tokio_rustls::TlsConnector::from(Arc::new(tls.client_config(expected).unwrap()))
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", listen))
            .await
            .unwrap();
        loop {
            let (mut inbound, _) = listener.accept().await.unwrap();
            let (acceptor, connector) = (acceptor.clone(), connector.clone());
            tokio::spawn(async move {
                let _ = inbound.set_nodelay(true);
                let mut out = tokio::net::TcpStream::connect(("127.0.0.1", target))
                    .await
                    .unwrap();
                let _ = out.set_nodelay(true);
                let _ = match (acceptor, connector) {
                    (Some(a), _) => {
                        let Ok(mut tls) = a.accept(inbound).await else {
                            return;
                        };
                        tokio::io::copy_bidirectional(&mut tls, &mut out).await
                    }
                    (_, Some(c)) => {
                        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
                        let Ok(mut tls) = c.connect(name, out).await else {
                            return;
                        };
                        tokio::io::copy_bidirectional(&mut inbound, &mut tls).await
                    }
                    _ => tokio::io::copy_bidirectional(&mut inbound, &mut out).await,
                };
            });
        }
    });
}

/// Two relays in a row in front of the upstream; the port clients use.
fn relays(dir: &Path, upstream: u16, tls: bool) -> (Killed, Killed, u16) {
    relays_with(dir, upstream, tls, None)
}

/// [`relays`], under callgrind when asked (`relay-out.out`, `relay-in.out`).
fn relays_with(
    dir: &Path,
    upstream: u16,
    tls: bool,
    callgrind: Option<&Path>,
) -> (Killed, Killed, u16) {
    let (first, second) = (free_port(), free_port());
    let (m1, m2) = if tls {
        ("tls-out", "tls-in")
    } else {
        ("plain", "plain")
    };
    let spawn = |listen: u16, target: u16, mode: &str| {
        let name = if mode == "tls-in" {
            "relay-in"
        } else {
            "relay-out"
        };
        let mut command = under_callgrind(callgrind, name, std::env::current_exe().unwrap());
        Killed(
            command
                .args(["relay", &listen.to_string(), &target.to_string(), mode])
                .arg(dir)
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let b = spawn(second, upstream, m2);
    wait_port(second);
    let a = spawn(first, second, m1);
    wait_port(first);
    (a, b, first)
}

/// Waits until a request through `port` is answered 200 (a mesh has started), for at most
/// `limit`.
async fn until_up(port: u16, limit: Duration) {
    let pool = Pool::new(port, false);
    let start = Instant::now();
    while !pool.once_ok().await {
        assert!(start.elapsed() < limit, "mesh did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// === Instructions per request (callgrind) ===

/// `program`, or `valgrind --tool=callgrind … program` writing its profiles to
/// `DIR/NAME.out` when `callgrind` is `Some(DIR)`.
fn under_callgrind(callgrind: Option<&Path>, name: &str, program: std::path::PathBuf) -> Command {
    let Some(dir) = callgrind else {
        return Command::new(program);
    };
    let mut command = Command::new("valgrind");
    command
        .arg("--tool=callgrind")
        .arg(format!(
            "--callgrind-out-file={}",
            dir.join(format!("{name}.out")).display()
        ))
        .args(["--dump-instr=no", "--quiet"])
        .arg(program);
    command
}

/// `callgrind_control ACTION PID`, which waits until the process has acted.
fn callgrind_control(action: &str, pid: u32) {
    let status = Command::new("callgrind_control")
        .args([action, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("callgrind_control (Debian package valgrind)");
    assert!(status.success(), "callgrind_control {action} {pid}");
}

/// The instructions of the newest dump of `DIR/NAME.out` (`NAME.out.1`, `.2`, …).
fn last_dump(dir: &Path, name: &str) -> u64 {
    let prefix = format!("{name}.out.");
    let newest = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let file = e.unwrap().file_name().into_string().ok()?;
            let n: u32 = file.strip_prefix(&prefix)?.parse().ok()?;
            Some((n, file))
        })
        .max()
        .expect("a callgrind dump");
    let text = std::fs::read_to_string(dir.join(newest.1)).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("summary: "))
        .expect("a summary line")
        .trim()
        .parse()
        .unwrap()
}

/// `proc_load instructions`: user-space instructions per request in each process of the
/// path, counted by callgrind, the mesh (Edge, Node) beside the two mTLS relays (the floor)
/// in the same run. A count, not a time: the same binaries and requests give the same figure
/// within a fraction of a percent whatever else the machine does, so a change's effect on
/// the work per request can be read off one run on a noisy machine. It leaves out the kernel
/// (about 40 % of the Edge's time at saturation: sockets, wake-ups) and the cost of cold caches.
/// `PROC_LOAD_REQUESTS` (default 1000) requests of each kind on one keep-alive connection,
/// after 300 to warm up.
async fn instructions(dir: &Path, mesh: &Mesh, relays: &[&Killed; 2], relay_port: u16) {
    let n: u32 = std::env::var("PROC_LOAD_REQUESTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let paths = [
        (
            "mesh",
            mesh.http,
            [
                ("Edge", "iop-edge", &mesh.edge),
                ("Node", "iop-node", &mesh.node),
            ],
        ),
        (
            "TLS relays",
            relay_port,
            [
                ("relay (Edge's place)", "relay-out", relays[0]),
                ("relay (Node's place)", "relay-in", relays[1]),
            ],
        ),
    ];
    let mut rows = Vec::new();
    for stream in [false, true] {
        for (path, port, processes) in &paths {
            let request = post_json(*port, "/v1/chat/completions", &body(stream));
            let mut client = RawHttp::connect(*port).await.unwrap();
            for _ in 0..300 {
                assert_eq!(client.exchange(&request).await.unwrap().status, 200);
            }
            for (_, _, p) in processes {
                callgrind_control("-z", p.0.id());
            }
            for _ in 0..n {
                assert_eq!(client.exchange(&request).await.unwrap().status, 200);
            }
            let mut counts = Vec::new();
            for (label, name, p) in processes {
                callgrind_control("-d", p.0.id());
                counts.push((*label, last_dump(dir, name) / u64::from(n)));
            }
            rows.push((stream, *path, counts));
        }
    }
    println!(
        "\n**User-space instructions per request (callgrind)**, {n} requests of each kind on one keep-alive connection:\n"
    );
    println!("| request | path | per process | both |");
    println!("|---|---|---|---:|");
    for (stream, path, counts) in &rows {
        let kind = if *stream {
            "streaming"
        } else {
            "non-streaming"
        };
        let each: Vec<String> = counts.iter().map(|(l, c)| format!("{l} {c}")).collect();
        let total: u64 = counts.iter().map(|(_, c)| c).sum();
        println!("| {kind} | {path} | {} | {total} |", each.join(", "));
    }
    for stream in [false, true] {
        let total = |path: &str| -> u64 {
            rows.iter()
                .filter(|(s, p, _)| *s == stream && *p == path)
                .flat_map(|(_, _, c)| c.iter().map(|(_, c)| c))
                .sum()
        };
        println!(
            "\n{}: mesh ÷ relays {:.2}×",
            if stream { "streaming" } else { "non-streaming" },
            total("mesh") as f64 / total("TLS relays") as f64
        );
    }
}

// === What an open stream holds ===

/// `n` streaming requests to `port` whose upstream holds them open, each read to its first
/// event; with `waiting`, requests whose upstream does not answer, given a second to reach it.
async fn open_held(port: u16, n: usize, waiting: bool) -> Vec<tokio::net::TcpStream> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mark = if waiting { WAIT_MARK } else { HOLD_MARK };
    let prompt = format!("{} {}", String::from_utf8_lossy(mark), "y".repeat(880));
    let body = format!(
        r#"{{"model":"{MODEL}","stream":true,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    );
    let request = post_json(port, "/v1/chat/completions", &body);
    let mut open = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        s.write_all(&request).await.unwrap();
        open.push(s);
    }
    if waiting {
        tokio::time::sleep(Duration::from_secs(1)).await;
        return open;
    }
    for s in &mut open {
        let mut seen = Vec::new();
        let mut chunk = [0u8; 4096];
        while !seen.windows(5).any(|w| w == b"data:") {
            let got = s.read(&mut chunk).await.unwrap();
            assert!(got > 0, "a held stream ended before its first event");
            seen.extend_from_slice(&chunk[..got]);
        }
    }
    open
}

async fn held(m: &Mesh, relays: u16, relay_pids: [u32; 2], waiting: bool) {
    let n: usize = std::env::var("PROC_LOAD_HELD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    if waiting {
        println!("\n## held: {n} requests waiting for their head (the upstream sends nothing)\n");
    } else {
        println!("\n## held: {n} open streams (first event sent, then the upstream is silent)\n");
    }
    println!(
        "| process | RSS before | RSS with {n} open | per open stream | fds per open stream | RSS after the clients left |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (path, port, pids) in [
        (
            "mesh",
            m.http,
            [("Edge", m.edge.0.id()), ("Node", m.node.0.id())],
        ),
        (
            "two mTLS relays",
            relays,
            [
                ("relay at the Edge's place", relay_pids[0]),
                ("relay at the Node's place", relay_pids[1]),
            ],
        ),
    ] {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before: Vec<(u64, usize)> = pids.iter().map(|(_, p)| (rss_kib(*p), fds(*p))).collect();
        let open = open_held(port, n, waiting).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let during: Vec<(u64, usize)> = pids.iter().map(|(_, p)| (rss_kib(*p), fds(*p))).collect();
        drop(open);
        tokio::time::sleep(Duration::from_secs(2)).await;
        for (i, (name, pid)) in pids.iter().enumerate() {
            println!(
                "| {path}: {name} | {:.1} MiB | {:.1} MiB | {:.1} KiB | {:.2} | {:.1} MiB |",
                before[i].0 as f64 / 1024.0,
                during[i].0 as f64 / 1024.0,
                during[i].0.saturating_sub(before[i].0) as f64 / n as f64,
                during[i].1.saturating_sub(before[i].1) as f64 / n as f64,
                rss_kib(*pid) as f64 / 1024.0,
            );
        }
    }
}

// === Load ===

/// A path under test: its name and the port clients send to.
#[derive(Clone, Copy)]
struct Path2 {
    name: &'static str,
    port: u16,
}

/// Open loop at `rate`/s per path for `seconds`, ticks alternating `a` and `b` (both see the
/// same moments of a noisy machine, neither waits behind the other): sorted samples of each,
/// time to the first body byte (`first_byte`) or to the last byte. Each request takes an idle
/// keep-alive connection of its path, or opens one (then kept).
async fn paired(
    a: Path2,
    b: Path2,
    rate: u32,
    seconds: u32,
    stream: bool,
    first_byte: bool,
) -> (Vec<Duration>, Vec<Duration>) {
    let pools = [Pool::new(a.port, stream), Pool::new(b.port, stream)];
    let mut tasks = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1) / (2 * rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    for i in 0..2 * rate * seconds {
        tick.tick().await;
        let pool = pools[(i % 2) as usize].clone();
        tasks.push(tokio::spawn(async move {
            let e = pool.once().await;
            (
                (i % 2) as usize,
                if first_byte {
                    e.first_byte
                } else {
                    e.last_byte
                },
            )
        }));
    }
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for t in tasks {
        let (path, took) = t.await.unwrap();
        if path == 0 { &mut x } else { &mut y }.push(took);
    }
    x.sort();
    y.sort();
    (x, y)
}

/// Idle keep-alive connections to one port, and the request they send.
#[derive(Clone)]
struct Pool {
    port: u16,
    request: Arc<Vec<u8>>,
    idle: Arc<std::sync::Mutex<Vec<RawHttp>>>,
}

impl Pool {
    fn new(port: u16, stream: bool) -> Self {
        Self {
            port,
            request: Arc::new(post_json(port, "/v1/chat/completions", &body(stream))),
            idle: Arc::default(),
        }
    }

    /// One request, whether it was answered 200 (while waiting for a mesh to start).
    async fn once_ok(&self) -> bool {
        match RawHttp::connect(self.port).await {
            Ok(mut c) => c
                .exchange(&self.request)
                .await
                .is_ok_and(|e| e.status == 200),
            Err(_) => false,
        }
    }

    async fn once(&self) -> Exchange {
        let conn = self.idle.lock().unwrap().pop();
        let mut conn = match conn {
            Some(c) => c,
            None => RawHttp::connect(self.port).await.unwrap(),
        };
        let e = conn.exchange(&self.request).await.unwrap();
        assert_eq!(e.status, 200, "port {}", self.port);
        self.idle.lock().unwrap().push(conn);
        e
    }
}

struct Row {
    direct: (Duration, Duration),
    added: Vec<(Duration, Duration)>,
    cpu: (Duration, Duration),
}

async fn latency(m: &Mesh, floors: &[Path2]) {
    let rates: Vec<u32> = std::env::var("PROC_LOAD_RATES")
        .unwrap_or_else(|_| "100,500,1000".into())
        .split(',')
        .map(|r| r.trim().parse().unwrap())
        .collect();
    let seconds: u32 = std::env::var("PROC_LOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let direct = Path2 {
        name: "direct",
        port: m.upstream,
    };
    let mesh = Path2 {
        name: "mesh",
        port: m.http,
    };
    let mut paths: Vec<Path2> = floors.to_vec();
    paths.push(mesh);
    // Warm every path (connections, TLS, allocators).
    for &p in &paths {
        let _ = paired(direct, p, 200, 1, false, false).await;
    }
    for (stream, what) in [
        (false, "non-streaming ≈1 KiB chat, time to last byte"),
        (true, "streaming chat, time to first body byte (TTFB)"),
    ] {
        let mut rows = Vec::new();
        for &rate in &rates {
            let mut row = Row {
                direct: (Duration::ZERO, Duration::ZERO),
                added: Vec::new(),
                cpu: (Duration::ZERO, Duration::ZERO),
            };
            let mut directs = Vec::new();
            for &p in &paths {
                let (e0, n0) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
                let (d, n) = paired(direct, p, rate, seconds, stream, stream).await;
                let (e1, n1) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
                let (d50, n50) = (percentile(&d, 0.5), percentile(&n, 0.5));
                let (d99, n99) = (percentile(&d, 0.99), percentile(&n, 0.99));
                directs.push((d50, d99));
                row.added
                    .push((n50.saturating_sub(d50), n99.saturating_sub(d99)));
                if p.name == "mesh" {
                    let reqs = n.len() as u32;
                    row.cpu = ((e1 - e0) / reqs, (n1 - n0) / reqs);
                }
            }
            directs.sort();
            row.direct = directs[directs.len() / 2];
            rows.push((rate, row));
        }
        println!(
            "\n**Added latency over the direct upstream, {what}** (open loop, each path alternating with direct, {seconds} s per rate and path):\n"
        );
        let names: Vec<&str> = paths.iter().map(|p| p.name).collect();
        print!("| rate | direct p50 / p99 |");
        for n in &names {
            print!(" {n}: added p50 / p99 |");
        }
        println!(" mesh − TLS floor, p50 | Edge CPU/req | Node CPU/req |");
        print!("|---:|---:|");
        for _ in &names {
            print!("---:|");
        }
        println!("---:|---:|---:|");
        for (rate, row) in rows {
            print!("| {rate}/s | {} / {} |", ms(row.direct.0), ms(row.direct.1));
            for (i, (a50, a99)) in row.added.iter().enumerate() {
                if names[i] == "mesh" {
                    print!(" **{}** / **{}** |", ms(*a50), ms(*a99));
                } else {
                    print!(" {} / {} |", ms(*a50), ms(*a99));
                }
            }
            let tls_floor = names
                .iter()
                .position(|n| *n == "TLS relays")
                .map(|i| row.added[i].0);
            let mesh = row.added[row.added.len() - 1].0;
            match tls_floor {
                Some(f) => print!(" {} |", ms(mesh.saturating_sub(f))),
                None => print!(" – |"),
            }
            println!(" {} | {} |", ms(row.cpu.0), ms(row.cpu.1));
        }
    }
}

/// Closed loop: `concurrency` connections each sending the next request when the last one
/// ended, for `run`: requests per second.
async fn closed_loop(port: u16, concurrency: usize, run: Duration) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + run;
    let request = Arc::new(post_json(port, "/v1/chat/completions", &body(false)));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (done, request) = (done.clone(), request.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = RawHttp::connect(port).await.unwrap();
            while Instant::now() < end {
                let e = conn.exchange(&request).await.unwrap();
                assert_eq!(e.status, 200);
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

async fn max(m: &Mesh, floors: &[Path2]) {
    let secs = 4;
    println!("\n**Max sustained requests/s** (closed loop, non-streaming, {secs} s per cell):\n");
    print!("| concurrency | direct (baseline) |");
    for f in floors {
        print!(" {} |", f.name);
    }
    println!(" through the mesh | mesh ÷ direct | Edge CPU/req | Node CPU/req |");
    print!("|---:|---:|");
    for _ in floors {
        print!("---:|");
    }
    println!("---:|---:|---:|---:|");
    for c in [16, 64] {
        let d = closed_loop(m.upstream, c, Duration::from_secs(secs)).await;
        let mut floor = Vec::new();
        for f in floors {
            floor.push(closed_loop(f.port, c, Duration::from_secs(secs)).await);
        }
        let (e0, n0) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
        let mesh_rps = closed_loop(m.http, c, Duration::from_secs(secs)).await;
        let (e1, n1) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
        let reqs = mesh_rps * secs as f64;
        let per =
            |a: Duration, b: Duration| format!("{:.4} ms", (b - a).as_secs_f64() * 1e3 / reqs);
        print!("| {c} | {d:.0} |");
        for f in floor {
            print!(" {f:.0} |");
        }
        println!(
            " **{mesh_rps:.0}** | {:.2}× | {} | {} |",
            mesh_rps / d,
            per(e0, e1),
            per(n0, n1)
        );
    }
}

// === Tracing: off, 1 %, 100 % ===

/// `proc_load collector PORT`: a minimal OTLP/HTTP receiver (current-thread): reads each batch
/// and answers an empty `ExportTraceServiceResponse`.
fn collector(port: u16) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let app = Router::new().route(
            "/v1/traces",
            post(|body: Bytes| async move {
                std::hint::black_box(body.len());
                Response::builder()
                    .header("content-type", "application/x-protobuf")
                    .body(Body::empty())
                    .unwrap()
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

/// A counter or a histogram's `_sum`/`_count` line of an exposition.
fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn scrape(port: u16) -> String {
    reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn median3(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn mean(v: &[Duration]) -> f64 {
    v.iter().map(Duration::as_secs_f64).sum::<f64>() / v.len().max(1) as f64
}

fn tracing_cost(dir: &Path) {
    let cport = free_port();
    let _collector = Killed(
        Command::new(std::env::current_exe().unwrap())
            .args(["collector", &cport.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_port(cport);
    let variants: [(&str, Option<f64>); 3] = [
        ("off", None),
        ("on, 1 % sampled", Some(0.01)),
        ("on, 100 % sampled", Some(1.0)),
    ];
    let meshes: Vec<Mesh> = variants
        .iter()
        .enumerate()
        .map(|(i, (_, ratio))| {
            let sub = dir.join(format!("trace{i}"));
            std::fs::create_dir_all(&sub).unwrap();
            let t = ratio.map_or(String::new(), |r| {
                format!("[telemetry]\notlp_endpoint = \"http://127.0.0.1:{cport}\"\nsample_ratio = {r}\n")
            });
            start_with(&sub, &t, None)
        })
        .collect();
    let rate: u32 = std::env::var("PROC_LOAD_TRACE_RATE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500);
    let seconds: u32 = std::env::var("PROC_LOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    // The mTLS relay floor in front of the tracing-off mesh's upstream (its certificates).
    let (_r1, _r2, floor_port) = relays(&dir.join("trace0"), meshes[0].upstream, true);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for m in &meshes {
            until_up(m.http, Duration::from_secs(30)).await;
        }
        let path = |m: &Mesh| {
            (
                Path2 { name: "direct", port: m.upstream },
                Path2 { name: "mesh", port: m.http },
            )
        };
        for m in &meshes {
            let (d, p) = path(m);
            let _ = paired(d, p, 200, 1, false, false).await;
        }
        // [variant][round] = (added p50, added p99) in ms; closed loop rps.
        let mut added = vec![Vec::new(); 3];
        let mut rps = vec![Vec::new(); 3];
        // [variant][round] = Edge + Node CPU µs per request in the closed loop.
        let mut closed_cpu = vec![Vec::new(); 3];
        // [variant][round] = (Edge, Node) CPU µs per request over the open loop.
        let mut cpus = vec![Vec::new(); 3];
        let mut overhead = Vec::new();
        // More rounds than three (`PROC_LOAD_ROUNDS`) when the machine is noisy.
        let rounds: usize = std::env::var("PROC_LOAD_ROUNDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(3);
        for round in 0..rounds {
            for (i, m) in meshes.iter().enumerate() {
                let (d, p) = path(m);
                let before = scrape(m.http).await;
                let (e0, n0) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
                let (x, y) = paired(d, p, rate, seconds, false, false).await;
                let (e1, n1) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
                let after = scrape(m.http).await;
                let reqs = y.len() as f64;
                cpus[i].push((
                    (e1 - e0).as_secs_f64() * 1e6 / reqs,
                    (n1 - n0).as_secs_f64() * 1e6 / reqs,
                ));
                let a50 = percentile(&y, 0.5).saturating_sub(percentile(&x, 0.5));
                let a99 = percentile(&y, 0.99).saturating_sub(percentile(&x, 0.99));
                added[i].push((a50.as_secs_f64() * 1e3, a99.as_secs_f64() * 1e3));
                if i == 0 {
                    let floor = Path2 {
                        name: "TLS relays",
                        port: floor_port,
                    };
                    let (fx, fy) = paired(d, floor, rate, seconds, false, false).await;
                    let floor_added = (mean(&fy) - mean(&fx)) * 1e3;
                    let key = "iop_edge_gateway_overhead_seconds";
                    let label = "{endpoint=\"chat_completions\"}";
                    let sum = metric(&after, &format!("{key}_sum{label}"))
                        - metric(&before, &format!("{key}_sum{label}"));
                    let count = metric(&after, &format!("{key}_count{label}"))
                        - metric(&before, &format!("{key}_count{label}"));
                    let added = (mean(&y) - mean(&x)) * 1e3;
                    overhead.push((
                        round,
                        added,
                        added - floor_added,
                        sum / count.max(1.0) * 1e3,
                        count,
                    ));
                }
            }
            for (i, m) in meshes.iter().enumerate() {
                let (e0, n0) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
                let r = closed_loop(m.http, 64, Duration::from_secs(4)).await;
                let (e1, n1) = (cpu(m.edge.0.id()), cpu(m.node.0.id()));
                rps[i].push(r);
                closed_cpu[i].push(((e1 - e0) + (n1 - n0)).as_secs_f64() * 1e6 / (r * 4.0));
            }
        }
        println!(
            "\n**Tracing cost** ({rate}/s open loop for {seconds} s and a 64-client closed loop for 4 s per variant, {rounds} interleaved rounds; medians, per-run values in brackets):\n"
        );
        println!(
            "| tracing | added p50 | added p99 | Edge CPU/req | Node CPU/req | closed loop req/s | ÷ off | ÷ off, same round | closed loop Edge + Node CPU/req |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        let off_rps = median3(&rps[0]);
        for (i, (name, _)) in variants.iter().enumerate() {
            let p50: Vec<f64> = added[i].iter().map(|a| a.0).collect();
            let p99: Vec<f64> = added[i].iter().map(|a| a.1).collect();
            let runs = |v: &[f64], d: usize| {
                v.iter().map(|x| format!("{x:.d$}")).collect::<Vec<_>>().join(", ")
            };
            let ecpu: Vec<f64> = cpus[i].iter().map(|c| c.0).collect();
            let ncpu: Vec<f64> = cpus[i].iter().map(|c| c.1).collect();
            let same_round: Vec<f64> = rps[i].iter().zip(&rps[0]).map(|(x, o)| x / o).collect();
            println!(
                "| {name} | {:.3} ms [{}] | {:.3} ms [{}] | {:.1} µs [{}] | {:.1} µs [{}] | {:.0} [{}] | {:.2}× | {:.2}× [{}] | {:.1} µs [{}] |",
                median3(&p50),
                runs(&p50, 3),
                median3(&p99),
                runs(&p99, 3),
                median3(&ecpu),
                runs(&ecpu, 1),
                median3(&ncpu),
                runs(&ncpu, 1),
                median3(&rps[i]),
                runs(&rps[i], 0),
                median3(&rps[i]) / off_rps,
                median3(&same_round),
                runs(&same_round, 2),
                median3(&closed_cpu[i]),
                runs(&closed_cpu[i], 1),
            );
        }
        println!(
            "\n**The gateway overhead histogram against the measured added latency** (tracing off, the same {rate}/s requests):\n"
        );
        println!("| round | mean added latency (mesh − direct, client) | mean mesh − TLS relay floor (client) | mean `iop_edge_gateway_overhead_seconds` (Edge time − Node's provider time) | requests in the histogram |");
        println!("|---:|---:|---:|---:|---:|");
        for (round, measured, over_floor, histogram, count) in overhead {
            println!(
                "| {} | {measured:.3} ms | {over_floor:.3} ms | {histogram:.3} ms | {count:.0} |",
                round + 1
            );
        }
        for (i, m) in meshes.iter().enumerate().skip(1) {
            let text = scrape(m.http).await;
            let c = |o: &str| metric(&text, &format!("iop_telemetry_spans_total{{outcome=\"{o}\"}}"));
            println!(
                "\n{}: spans exported {:.0}, dropped {:.0}, failed {:.0}",
                variants[i].0,
                c("exported"),
                c("dropped"),
                c("failed")
            );
        }
    });
    drop(meshes);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("upstream") {
        return upstream(args[2].parse().unwrap());
    }
    if args.get(1).map(String::as_str) == Some("collector") {
        return collector(args[2].parse().unwrap());
    }
    if args.get(1).map(String::as_str) == Some("tracing-perf") {
        // One mesh at 100 % sampling under the 64-client closed loop while `perf record`
        // samples its Edge and Node (perf.data in the working directory).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = std::env::temp_dir().join(format!("proc_load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cport = free_port();
        let _collector = Killed(
            Command::new(std::env::current_exe().unwrap())
                .args(["collector", &cport.to_string()])
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        );
        wait_port(cport);
        let ratio = args.get(2).cloned().unwrap_or_else(|| "1.0".into());
        let t = if ratio == "off" {
            String::new()
        } else {
            format!(
                "[telemetry]\notlp_endpoint = \"http://127.0.0.1:{cport}\"\nsample_ratio = {ratio}\n"
            )
        };
        let m = start_with(&dir, &t, None);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            until_up(m.http, Duration::from_secs(30)).await;
            let _ = closed_loop(m.http, 64, Duration::from_secs(2)).await;
            let pids = format!("{},{}", m.edge.0.id(), m.node.0.id());
            let mut perf = Command::new("perf")
                .args([
                    "record",
                    "-F",
                    "999",
                    "-g",
                    "-p",
                    &pids,
                    "-o",
                    "perf.data",
                    "--",
                    "sleep",
                    "8",
                ])
                .spawn()
                .unwrap();
            let rps = closed_loop(m.http, 64, Duration::from_secs(8)).await;
            let _ = perf.wait();
            println!("closed loop at {ratio}: {rps:.0} req/s");
        });
        drop(m);
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    if args.get(1).map(String::as_str) == Some("tracing") {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = std::env::temp_dir().join(format!("proc_load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        tracing_cost(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    if args.get(1).map(String::as_str) == Some("relay") {
        let mode = match args[4].as_str() {
            "tls-out" => RelayMode::TlsOut,
            "tls-in" => RelayMode::TlsIn,
            _ => RelayMode::Plain,
        };
        return relay(
            args[2].parse().unwrap(),
            args[3].parse().unwrap(),
            mode,
            Path::new(&args[5]),
        );
    }
    let part = args.get(1).cloned().unwrap_or_default();
    // `serve`: start the mesh, print its ports, run until killed (for wrk, perf, ad hoc clients).
    let serve = part == "serve";
    // reqwest's rustls backend needs a process-wide provider even for http:// URLs.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!("proc_load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    if part == "instructions" {
        // `PROC_LOAD_PROFILES=DIR` keeps the profiles there (for `callgrind_annotate`).
        let profiles = std::env::var_os("PROC_LOAD_PROFILES")
            .map_or_else(|| dir.join("callgrind"), std::path::PathBuf::from);
        std::fs::create_dir_all(&profiles).unwrap();
        assert!(
            Command::new("valgrind").arg("--version").output().is_ok(),
            "proc_load instructions needs valgrind (Debian: apt-get install valgrind)"
        );
        let mesh = start_with(&dir, "", Some(&profiles));
        let (out, inward, relay_port) = relays_with(&dir, mesh.upstream, true, Some(&profiles));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // Under callgrind a process starts many times slower.
            until_up(mesh.http, Duration::from_secs(120)).await;
            instructions(&profiles, &mesh, &[&out, &inward], relay_port).await;
        });
        drop((mesh, out, inward));
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
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
    let (_tcp1, _tcp2, tcp_port) = relays(&dir, mesh.upstream, false);
    let (_tls1, _tls2, tls_port) = relays(&dir, mesh.upstream, true);
    let floors = [
        Path2 {
            name: "TCP relays",
            port: tcp_port,
        },
        Path2 {
            name: "TLS relays",
            port: tls_port,
        },
    ];
    rt.block_on(async {
        // The mesh is up when a request passes.
        until_up(mesh.http, Duration::from_secs(30)).await;
        if serve {
            println!(
                "proc_load: serving: mesh http://127.0.0.1:{}/v1/chat/completions, upstream http://127.0.0.1:{}/v1/chat/completions, TCP relays :{tcp_port}, TLS relays :{tls_port}",
                mesh.http, mesh.upstream
            );
            // Until Ctrl-C or SIGTERM; then every child process is stopped as the guards drop
            // (killing this process with SIGKILL leaves them running).
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
        if part.is_empty() || part == "latency" {
            latency(&mesh, &floors).await;
        }
        if part.is_empty() || part == "max" {
            max(&mesh, &floors).await;
        }
        if part == "held" || part == "waiting" {
            let waiting = part == "waiting";
            held(&mesh, tls_port, [_tls1.0.id(), _tls2.0.id()], waiting).await;
        }
    });
    drop(mesh);
    let _ = std::fs::remove_dir_all(&dir);
}
