//! `cp_load`: what one Control Plane replica (`iop-cp serve`, a separate process) spends per
//! connected Edge and per mutation it pushes to its Edges: the figures behind the capacity
//! model's "Edges per Control Plane replica" (`benches/README.md`, issue #32).
//!
//! ```text
//! cargo build --release -p iop-bins && cargo run --release -p iop-benches --bin cp_load
//! CP_LOAD_EDGES=1,100,400 CP_LOAD_PRINCIPALS=10,1000 CP_LOAD_MUTATIONS=20 \
//!   cargo run --release -p iop-benches --bin cp_load
//! IOP_CP_BIN=/old/target/release/iop-cp cargo run --release -p iop-benches --bin cp_load
//! ```
//!
//! For each store size (`CP_LOAD_PRINCIPALS`: principals, each with one token and one route on
//! a shared slot, written through the admin HTTP API) a fresh `iop-cp serve` in managed mode on
//! a SQLite data directory, then Edges added up to each count in `CP_LOAD_EDGES`: real
//! `iop_edge::control::ControlConnector`s in this process, each with its own mTLS identity.
//! Measured from `/proc` of the Control Plane process:
//!
//! - **memory per Edge**: its RSS with the Edges connected against its RSS with none;
//! - **idle CPU per Edge**: its CPU time over one heartbeat interval (10 s, the binary's
//!   default) with every Edge connected and nothing changing;
//! - **a mutation's fan-out**: `CP_LOAD_MUTATIONS` principals created one after another through
//!   the admin API; for each, the time from the request until every Edge holds the new
//!   projection generation, the Control Plane's CPU and the bytes it wrote (`wchar`, so TLS
//!   records included) per mutation and per Edge. The baseline in the same run is the same
//!   mutation with one Edge connected: the commit and one push.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "load tool"
)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use iop_benches::load::{self, Killed, RawHttp, ms, percentile, rss_kib};
use iop_edge::control::{ControlConfig, ControlConnector, SessionState};
use iop_edge::{TransportConfig, bind};
use tokio_util::sync::CancellationToken;
use workload_identity::dev_ca::DevCa;
use workload_identity::role;

/// The heartbeat `iop-cp serve` tells Edges by default (`--heartbeat-ms`).
const HEARTBEAT: Duration = Duration::from_secs(10);

fn list(var: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(var).map_or_else(
        |_| default.to_vec(),
        |v| v.split(',').map(|x| x.trim().parse().unwrap()).collect(),
    )
}

/// Bytes the process has written through `write`-like calls (`/proc/PID/io` `wchar`).
fn wchar(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("wchar:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn request(method: &str, port: u16, path: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

struct Cp {
    child: Killed,
    listen: u16,
    admin: RawHttp,
    admin_port: u16,
}

impl Cp {
    fn pid(&self) -> u32 {
        self.child.0.id()
    }

    async fn call(&mut self, method: &str, path: &str, body: &str) {
        let port = self.admin_port;
        let ex = self
            .admin
            .exchange(&request(method, port, path, body))
            .await
            .unwrap();
        assert!(ex.status < 300, "{method} {path}: {}", ex.status);
    }
}

async fn start_cp(dir: &Path, ca: &DevCa) -> Cp {
    let bin = load::bin("IOP_CP_BIN", "iop-cp");
    let data = dir.join("data");
    let out = Command::new(&bin)
        .arg("--data-dir")
        .arg(&data)
        .arg("init")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (cargo build --release -p iop-bins)", bin.display()));
    assert!(
        out.status.success(),
        "iop-cp init: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (cert, key) = ca.issue_pem(role::CONTROL_PLANE, "cp-1").unwrap();
    std::fs::write(dir.join("ca.pem"), ca.ca_pem()).unwrap();
    std::fs::write(dir.join("cp.pem"), cert).unwrap();
    std::fs::write(dir.join("cp.key"), key).unwrap();
    let (listen, admin_port) = (load::free_port(), load::free_port());
    let child = Command::new(&bin)
        .arg("--data-dir")
        .arg(&data)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{listen}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin_port}"),
            "--trust-domain",
            ca.trust_domain(),
            "--credential-plane",
        ])
        .arg("--tls-ca")
        .arg(dir.join("ca.pem"))
        .arg("--tls-cert")
        .arg(dir.join("cp.pem"))
        .arg("--tls-key")
        .arg(dir.join("cp.key"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let child = Killed(child);
    load::wait_port(listen);
    load::wait_port(admin_port);
    let admin = RawHttp::connect(admin_port).await.unwrap();
    Cp {
        child,
        listen,
        admin,
        admin_port,
    }
}

async fn connect_edge(ca: &DevCa, cp: u16, i: usize) -> ControlConnector {
    let name = format!("edge-{i}");
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), ca.edge_tls(&name).unwrap());
    cfg.pool = None;
    let edge = bind(cfg).await.unwrap().0;
    ControlConnector::start(
        edge,
        ControlConfig {
            managed: true,
            ..ControlConfig::new(
                vec![format!("127.0.0.1:{cp}")],
                "localhost".try_into().unwrap(),
                ca.edge_client_tls(&name, "cp-1").unwrap(),
                name,
            )
        },
        CancellationToken::new(),
    )
    .unwrap()
}

async fn connected(c: &ControlConnector) {
    let mut state = c.state();
    tokio::time::timeout(Duration::from_secs(60), async {
        while *state.borrow_and_update() != SessionState::Connected {
            state.changed().await.unwrap();
        }
    })
    .await
    .expect("an Edge connected within 60 s");
}

fn kib(v: f64) -> String {
    format!("{v:.1} KiB")
}

#[tokio::main]
async fn main() {
    let edge_counts = list("CP_LOAD_EDGES", &[1, 100, 400]);
    let principal_counts = list("CP_LOAD_PRINCIPALS", &[10, 1000]);
    let mutations = list("CP_LOAD_MUTATIONS", &[20])[0];
    let ca = DevCa::new().unwrap();
    println!("# cp_load (iop-cp serve, managed, SQLite; release builds expected)\n");
    println!(
        "{mutations} mutations per row (one principal created each, through the admin API); \
         idle over one heartbeat interval ({} s).\n",
        HEARTBEAT.as_secs()
    );
    println!(
        "Per-Edge figures are marginal: the difference to the row above (the first row: to the \
         Control Plane with no Edge for memory and idle CPU; its mutation figures are the \
         baseline, one commit and one push).\n"
    );
    println!(
        "| principals | Edges | CP RSS | RSS per Edge | CP idle CPU | idle CPU per Edge | mutation → all Edges hold it, p50 / max | CP CPU per mutation | CPU per Edge pushed | bytes written per Edge pushed |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &principals in &principal_counts {
        let dir = std::env::temp_dir().join(format!("cp_load-{}-{principals}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut cp = start_cp(&dir, &ca).await;
        cp.call(
            "PUT",
            "/admin/v1/slots/slot-1",
            r#"{"profile":"openai","credential":"sk-cp-load-0123456789abcdef0123456789"}"#,
        )
        .await;
        for p in 0..principals {
            cp.call(
                "POST",
                "/admin/v1/principals",
                &format!(r#"{{"id":"team-{p}","display_name":"Team {p}"}}"#),
            )
            .await;
            cp.call(
                "POST",
                "/admin/v1/tokens",
                &format!(r#"{{"principal_id":"team-{p}"}}"#),
            )
            .await;
            cp.call(
                "PUT",
                &format!("/admin/v1/routes/r-{p}"),
                &format!(
                    r#"{{"principal_id":"team-{p}","model":"gpt","slot_id":"slot-1","upstream_target":"gpt-4o-mini"}}"#
                ),
            )
            .await;
        }
        // Settle, then the baseline with no Edge.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let c0 = load::cpu(cp.pid());
        tokio::time::sleep(HEARTBEAT).await;
        // (Edges, RSS KiB, idle CPU per second, CPU per mutation, bytes per mutation) before.
        let mut prev = (
            0usize,
            rss_kib(cp.pid()),
            (load::cpu(cp.pid()) - c0).as_secs_f64() / HEARTBEAT.as_secs_f64(),
            0.0f64,
            0.0f64,
        );
        let mut edges: Vec<ControlConnector> = Vec::new();
        let mut created = 0usize;
        for &n in &edge_counts {
            while edges.len() < n {
                edges.push(connect_edge(&ca, cp.listen, edges.len()).await);
            }
            for e in &edges {
                connected(e).await;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            let rss = rss_kib(cp.pid());
            let added = (n - prev.0) as f64;
            let per_edge = rss.saturating_sub(prev.1) as f64 / added;
            let c0 = load::cpu(cp.pid());
            tokio::time::sleep(HEARTBEAT).await;
            let idle = (load::cpu(cp.pid()) - c0).as_secs_f64() / HEARTBEAT.as_secs_f64();
            let idle_per_edge = (idle - prev.2) / added;

            let (c0, w0) = (load::cpu(cp.pid()), wchar(cp.pid()));
            let mut took = Vec::with_capacity(mutations);
            for _ in 0..mutations {
                let g = edges[0].projection().unwrap().generation();
                let t = Instant::now();
                cp.call(
                    "POST",
                    "/admin/v1/principals",
                    &format!(r#"{{"id":"new-{created}"}}"#),
                )
                .await;
                created += 1;
                let waits = edges
                    .iter()
                    .map(|e| e.projection_after(g, Duration::from_secs(120)));
                for held in futures_util::future::join_all(waits).await {
                    assert!(held.is_some(), "an Edge did not get generation {}", g + 1);
                }
                took.push(t.elapsed());
            }
            let cpu = (load::cpu(cp.pid()) - c0).as_secs_f64() / mutations as f64;
            let written = (wchar(cp.pid()) - w0) as f64 / mutations as f64;
            took.sort();
            let (cpu_per_edge, bytes_per_edge) = if prev.0 == 0 {
                (cpu / n as f64, written / n as f64)
            } else {
                ((cpu - prev.3) / added, (written - prev.4) / added)
            };
            println!(
                "| {principals} | {n} | {:.1} MiB | {} | {:.2} % | {:.1} µs/s | {:.2} / {:.2} ms | {:.2} ms | {:.0} µs | {} |",
                rss as f64 / 1024.0,
                kib(per_edge),
                idle * 100.0,
                idle_per_edge * 1e6,
                ms(percentile(&took, 0.5)),
                ms(*took.last().unwrap()),
                cpu * 1e3,
                cpu_per_edge * 1e6,
                kib(bytes_per_edge / 1024.0),
            );
            prev = (n, rss, idle, cpu, written);
        }
        drop(edges);
        drop(cp);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
