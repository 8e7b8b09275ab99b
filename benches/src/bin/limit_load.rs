//! `limit_load`: what per-key rate limits cost (issue #29), through the real binaries, in the
//! same run as the same mesh without limits. Prints Markdown; numbers go to
//! `benches/README.md`.
//!
//! ```text
//! cargo build --release -p iop-bins -p iop-benches
//! cargo run --release -p iop-benches --bin limit_load
//! LIMIT_LOAD_RATE=1000 LIMIT_LOAD_SECONDS=5 LIMIT_LOAD_RUNS=3 cargo run --release -p iop-benches --bin limit_load
//! ```
//!
//! Processes: this tool (current-thread load generator, raw HTTP/1.1 keep-alive), the upstream
//! (`proc_load upstream`: a 1 KiB JSON completion reporting 212 tokens), a private
//! `redis-server`, and three meshes of `iop-edge` + `iop-node`, identical but for `[auth]`:
//!
//! - **off**: a gateway key, no limits (the baseline);
//! - **local**: the key limited (requests, tokens, in flight) and given a monthly spend budget
//!   (at `[prices]`), by the Edge alone;
//! - **shared**: the same limits and budget shared through Redis (`[auth.shared]`, defaults).
//!
//! The limits are far above the load (a key under its limit, the case the target is about):
//! every request is admitted, reserves its estimate and is settled to the reported usage.
//!
//! Open loop at `LIMIT_LOAD_RATE` per path (default 1000/s) for `LIMIT_LOAD_SECONDS` (5):
//! ticks alternate a request to **off** and one to the path measured, so both see the same
//! moments of a noisy machine; `LIMIT_LOAD_RUNS` (3) rounds, each measuring local then shared.
//! Reported: each path's p50/p99 (non-streaming, time to the last byte), added over off in the
//! same round, and for shared the Redis calls per request two ways: the Edge's own count
//! (`iop_edge_ratelimit_store_calls_total`) and Redis's (`INFO commandstats`: `evalsha` and
//! `eval` calls).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "load tool"
)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_benches::load::{Exchange, Killed, RawHttp, bin, free_port, percentile, wait_port};
use iop_tests::pki::{self, Ca};
use workload_identity::role;

const MODEL: &str = "proc-model";
const KEY: &str = "sk-limit-load-key";

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

struct Mesh {
    name: &'static str,
    _edge: Killed,
    _node: Killed,
    http: u16,
}

fn mesh(dir: &Path, ca: &Ca, name: &'static str, upstream: u16, auth: &str) -> Mesh {
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let edge_leaf = ca.workload(role::EDGE, "edge-1", true);
    let node_leaf = ca.workload(role::NODE, "node-1", false);
    for (file, text) in [
        ("ca.pem", ca.pem()),
        ("edge.pem", edge_leaf.cert_pem.clone()),
        ("edge.key", edge_leaf.key_pem.clone()),
        ("node.pem", node_leaf.cert_pem.clone()),
        ("node.key", node_leaf.key_pem.clone()),
        ("keys", format!("{KEY} bench\n")),
    ] {
        std::fs::write(dir.join(file), text).unwrap();
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(dir.join("keys"), std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let (http, nodes) = (free_port(), free_port());
    let d = dir.display();
    let edge = format!(
        "edge_id = \"edge-1\"\n[listen]\nnodes = \"127.0.0.1:{nodes}\"\nhttp = \"127.0.0.1:{http}\"\n[tls]\ntrust_domain = \"{td}\"\nca = \"{d}/ca.pem\"\ncert = \"{d}/edge.pem\"\nkey = \"{d}/edge.key\"\n[auth]\nkeys_file = \"{d}/keys\"\n{auth}\n[[nodes]]\nnode_id = \"node-1\"\n[[nodes.adapters]]\nname = \"up\"\ntype = \"openai_compat\"\nbase_url = \"http://127.0.0.1:{upstream}/v1\"\ncapacity = 512\n[[models]]\nname = \"{MODEL}\"\n[[models.providers]]\nnode_id = \"node-1\"\nprovider_id = \"up\"\nadapter = \"up\"\ntarget = \"{MODEL}\"\ncapacity = 512\n",
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
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        )
    };
    let edge = spawn("IOP_EDGE_BIN", "iop-edge", "edge.toml");
    let node = spawn("IOP_NODE_BIN", "iop-node", "node.toml");
    wait_port(http);
    Mesh {
        name,
        _edge: edge,
        _node: node,
        http,
    }
}

fn request(port: u16) -> Vec<u8> {
    let prompt = "y".repeat(900);
    let body = format!(
        r#"{{"model":"{MODEL}","stream":false,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    );
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Idle keep-alive connections to one port.
#[derive(Clone)]
struct Pool {
    port: u16,
    request: Arc<Vec<u8>>,
    idle: Arc<std::sync::Mutex<Vec<RawHttp>>>,
}

impl Pool {
    fn new(port: u16) -> Self {
        Self {
            port,
            request: Arc::new(request(port)),
            idle: Arc::default(),
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

/// Open loop, ticks alternating `a` and `b` at `rate`/s each: sorted times to the last byte.
async fn paired(a: &Pool, b: &Pool, rate: u32, seconds: u32) -> (Vec<Duration>, Vec<Duration>) {
    let mut tasks = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1) / (2 * rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    for i in 0..2 * rate * seconds {
        tick.tick().await;
        let pool = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(
            async move { (i % 2, pool.once().await.last_byte) },
        ));
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

/// A Prometheus sample of the Edge on `port` (0 when absent); read between phases, blocking.
async fn sample(port: u16, line_start: &str) -> f64 {
    use std::io::{Read as _, Write as _};
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        c,
        "GET /metrics HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    c.read_to_string(&mut text).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(line_start))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Script calls Redis has run (`evalsha` + `eval`).
fn redis_calls(port: u16) -> u64 {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "info", "commandstats"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| l.split("calls=").nth(1))
        .filter_map(|v| v.split(',').next())
        .filter_map(|v| v.parse::<u64>().ok())
        .sum()
}

fn main() {
    let rate: u32 = std::env::var("LIMIT_LOAD_RATE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let seconds: u32 = std::env::var("LIMIT_LOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let runs: u32 = std::env::var("LIMIT_LOAD_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!("limit_load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let redis_port = free_port();
    let _redis = Killed(
        Command::new("redis-server")
            .args(["--port", &redis_port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (apt-get install redis-server)"),
    );
    wait_port(redis_port);
    let up = free_port();
    let _upstream = Killed(
        Command::new(bin("PROC_LOAD_BIN", "proc_load"))
            .args(["upstream", &up.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_port(up);
    let ca = Ca::new("limit_load CA");
    let limits = format!(
        "[auth.limits]\nrequests_per_minute = 6000000\ntokens_per_minute = 100000000\nconcurrent = 4096\nbudget_usd_per_month = 1000000.0\n[prices.{MODEL}]\ninput = 1.0\noutput = 2.0\n"
    );
    let limits = limits.as_str();
    let off = mesh(&dir, &ca, "off", up, "");
    let local = mesh(&dir, &ca, "local", up, limits);
    let shared = mesh(
        &dir,
        &ca,
        "shared",
        up,
        &format!("{limits}[auth.shared]\nredis = \"redis://127.0.0.1:{redis_port}/\"\n"),
    );
    println!(
        "limit_load: {rate}/s per path, {seconds} s, {runs} rounds; {} cores",
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let pools: Vec<Pool> = [&off, &local, &shared]
            .iter()
            .map(|m| Pool::new(m.http))
            .collect();
        // Up when a request passes on each; then warm every path.
        for p in &pools {
            let start = Instant::now();
            loop {
                let ok = match RawHttp::connect(p.port).await {
                    Ok(mut c) => c.exchange(&p.request).await.is_ok_and(|e| e.status == 200),
                    Err(_) => false,
                };
                if ok {
                    break;
                }
                assert!(start.elapsed() < Duration::from_secs(30), "mesh did not start");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        for p in &pools[1..] {
            let _ = paired(&pools[0], p, 200, 1).await;
        }
        println!("\n| round | path | off p50 / p99 | path p50 / p99 | added p50 / p99 | store calls per request (Edge / Redis) |");
        println!("|---:|---|---:|---:|---:|---:|");
        let mut added: [Vec<(Duration, Duration)>; 2] = [Vec::new(), Vec::new()];
        for round in 1..=runs {
            for (i, (m, p)) in [(&local, &pools[1]), (&shared, &pools[2])].into_iter().enumerate() {
                let calls = |port| async move {
                    let mut n = 0.0;
                    for op in ["borrow", "charge", "refund", "budget_take", "budget_settle"] {
                        n += sample(
                            port,
                            &format!("iop_edge_ratelimit_store_calls_total{{op=\"{op}\"}} "),
                        )
                        .await;
                    }
                    n
                };
                let (edge0, redis0) = (calls(m.http).await, redis_calls(redis_port));
                let (o, n) = paired(&pools[0], p, rate, seconds).await;
                let (edge1, redis1) = (calls(m.http).await, redis_calls(redis_port));
                let (o50, o99) = (percentile(&o, 0.5), percentile(&o, 0.99));
                let (n50, n99) = (percentile(&n, 0.5), percentile(&n, 0.99));
                let a = (n50.saturating_sub(o50), n99.saturating_sub(o99));
                added[i].push(a);
                let per = |x: f64| x / n.len() as f64;
                let calls = if m.name == "shared" {
                    format!(
                        "{:.4} / {:.4}",
                        per(edge1 - edge0),
                        per((redis1 - redis0) as f64)
                    )
                } else {
                    "–".into()
                };
                // Signed: the path may be faster than off within the noise.
                let signed = |x: Duration, y: Duration| {
                    let d = x.as_secs_f64() - y.as_secs_f64();
                    format!("{:+.3} ms", d * 1e3)
                };
                println!(
                    "| {round} | {} | {} / {} | {} / {} | {} / {} | {calls} |",
                    m.name,
                    ms(o50),
                    ms(o99),
                    ms(n50),
                    ms(n99),
                    signed(n50, o50),
                    signed(n99, o99),
                );
                let _ = a;
            }
        }
        for (i, name) in ["local", "shared"].iter().enumerate() {
            let mut p50: Vec<Duration> = added[i].iter().map(|a| a.0).collect();
            p50.sort();
            println!(
                "\n{name}: added p50 over off, median of {runs} rounds (clamped at 0): {}",
                ms(p50[p50.len() / 2])
            );
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}
