//! `orbit_heartbeat`: signed heartbeats per second through the OrbitMesh control plane, against
//! the same handler with signature verification switched off, in the same run.
//!
//! ```text
//! cargo run --release -p iop-benches --bin orbit_heartbeat
//! ```
//!
//! One process on 127.0.0.1: the control plane's axum router served twice over the same state —
//! verifying (the product) and not verifying (the baseline: header parsing, identity lookup,
//! body parsing, liveness write and DNS reconciliation all still run). Requests are signed
//! before the clock starts (each with its own nonce), so client-side signing is not measured;
//! 32 concurrent HTTP/1.1 clients send them. The clients are made once, before any round, and
//! warmed up against both handlers.
//!
//! The two handlers run in alternating rounds (`ROUNDS`, the order flipped every round), so a
//! shared machine's drift lands on both; the rates are over all rounds, and the ratio is also
//! given per round. `ORBIT_HB_ONLY=verified` (or `unverified`) runs one handler only, for a
//! profiler.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "load tool"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_benches::load::{ms, percentile};
use orbit_runtime::dns::MemoryDns;
use orbit_runtime::server::{ControlPlane, ServerConfig, system_clock};
use orbit_runtime::signing::{Identity, sign};

const CONCURRENCY: usize = 32;
/// Heartbeats per client per round.
const PER_TASK: usize = 300;
/// Rounds of each handler (32 × 300 × 9 = 86,400 heartbeats each). One round takes about a
/// second here, and single rounds vary by ±20 % on the shared machine.
const ROUNDS: usize = 9;

async fn serve(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

type Batches = Vec<Vec<Vec<(&'static str, String)>>>;

/// One HTTP client per concurrent sender, made once: building a reqwest client loads the
/// platform's root certificates (≈ 6 % of a round's CPU when it was made inside the timed
/// window), which is the client's cost, not the handler's.
fn clients() -> Vec<reqwest::Client> {
    (0..CONCURRENCY)
        .map(|_| {
            reqwest::Client::builder()
                .tcp_nodelay(true)
                .build()
                .unwrap()
        })
        .collect()
}

/// Sends every batch (one client each); the elapsed time and the latencies.
async fn run(
    clients: &[reqwest::Client],
    url: &str,
    batches: Batches,
) -> (Duration, Vec<Duration>) {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (batch, client) in batches.into_iter().zip(clients.iter().cloned()) {
        let url = url.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(batch.len());
            for headers in batch {
                let mut req = client
                    .post(format!("{url}/api/v1/edge-runtime/heartbeat"))
                    .body(&br#"{"reported_address":"203.0.113.7"}"#[..]);
                for (k, v) in headers {
                    req = req.header(k, v);
                }
                let t = Instant::now();
                let r = req.send().await.unwrap();
                assert_eq!(r.status(), 200);
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    (started.elapsed(), lat)
}

fn signed_batches(key: &ed25519_dalek::SigningKey, identity: &Identity, salt: u64) -> Batches {
    let now = iop_wire::time::unix_secs(std::time::SystemTime::now());
    (0..CONCURRENCY)
        .map(|t| {
            (0..PER_TASK)
                .map(|i| {
                    let nonce = format!("{salt:08x}{t:08x}{i:016x}");
                    sign(
                        key,
                        identity,
                        "POST",
                        "/api/v1/edge-runtime/heartbeat",
                        br#"{"reported_address":"203.0.113.7"}"#,
                        now,
                        &nonce,
                    )
                    .to_pairs()
                    .into_iter()
                    .collect()
                })
                .collect()
        })
        .collect()
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cp = ControlPlane::in_memory(
        ServerConfig::new("http://unused"),
        Arc::new(MemoryDns::default()),
        system_clock(),
    )
    .unwrap();
    let verified = serve(cp.router()).await;
    let unverified = serve(cp.without_verification_for_bench().router()).await;
    // One registered runtime.
    let key = ed25519_dalek::SigningKey::from_bytes(&[9; 32]);
    let token = cp.create_deployment_token(1).await.unwrap();
    let reg: serde_json::Value = reqwest::Client::new()
        .post(format!("{verified}/api/v1/edge-runtime/register"))
        .bearer_auth(token)
        .json(&serde_json::json!({
            "installation_id": "bench-inst",
            "public_key": base64::Engine::encode(&base64::engine::general_purpose::STANDARD, key.verifying_key().to_bytes()),
            "device_fingerprint_hash": "bench",
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let identity = Identity {
        node_id: reg["node_id"].as_str().unwrap().into(),
        edge_runtime_id: reg["edge_runtime_id"].as_str().unwrap().into(),
        installation_id: "bench-inst".into(),
    };
    // Warm-up of both handlers (every client connects to each), then the measured rounds
    // (fresh nonces for each, all signed first).
    let clients = clients();
    for (url, salt) in [(&verified, 0), (&unverified, u64::MAX)] {
        run(
            &clients,
            url,
            signed_batches(&key, &identity, salt)
                .into_iter()
                .map(|b| b[..100].to_vec())
                .collect(),
        )
        .await;
    }
    let only = std::env::var("ORBIT_HB_ONLY").unwrap_or_default();
    let rounds: Vec<(Batches, Batches)> = (0..ROUNDS as u64)
        .map(|r| {
            (
                signed_batches(&key, &identity, 1 + 2 * r),
                signed_batches(&key, &identity, 2 + 2 * r),
            )
        })
        .collect();
    let (mut v_time, mut u_time) = (Duration::ZERO, Duration::ZERO);
    let (mut v_lat, mut u_lat) = (Vec::new(), Vec::new());
    let mut ratios = Vec::new();
    for (r, (v_batch, u_batch)) in rounds.into_iter().enumerate() {
        let (mut v, mut u) = (None, None);
        let mut v_batch = (only != "unverified").then_some(v_batch);
        let mut u_batch = (only != "verified").then_some(u_batch);
        let verified_first = r % 2 == 0;
        for verified_turn in [verified_first, !verified_first] {
            if verified_turn {
                if let Some(b) = v_batch.take() {
                    v = Some(run(&clients, &verified, b).await);
                }
            } else if let Some(b) = u_batch.take() {
                u = Some(run(&clients, &unverified, b).await);
            }
        }
        if let (Some((vt, _)), Some((ut, _))) = (&v, &u) {
            ratios.push(ut.as_secs_f64() / vt.as_secs_f64());
        }
        if let Some((t, l)) = v {
            v_time += t;
            v_lat.extend(l);
        }
        if let Some((t, l)) = u {
            u_time += t;
            u_lat.extend(l);
        }
    }
    v_lat.sort();
    u_lat.sort();
    let v_rate = v_lat.len() as f64 / v_time.as_secs_f64().max(1e-9);
    let u_rate = u_lat.len() as f64 / u_time.as_secs_f64().max(1e-9);
    println!(
        "# orbit_heartbeat ({CONCURRENCY} clients × {PER_TASK} heartbeats, {ROUNDS} alternating rounds)\n"
    );
    println!("| handler | heartbeats/s | p50 | p99 |\n|---|---:|---:|---:|");
    if !u_lat.is_empty() {
        println!(
            "| without signature verification (baseline) | {u_rate:.0} | {:.3} ms | {:.3} ms |",
            ms(percentile(&u_lat, 0.5)),
            ms(percentile(&u_lat, 0.99))
        );
    }
    if !v_lat.is_empty() {
        println!(
            "| verified (Ed25519 strict, digest, window, nonce) | {v_rate:.0} | {:.3} ms | {:.3} ms |",
            ms(percentile(&v_lat, 0.5)),
            ms(percentile(&v_lat, 0.99))
        );
    }
    if !ratios.is_empty() {
        let per_round: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        ratios.sort_by(f64::total_cmp);
        println!(
            "\nverified ÷ baseline: {:.2}× over all rounds; per round [{}], median {:.2}×",
            v_rate / u_rate,
            per_round.join(", "),
            ratios[ratios.len() / 2]
        );
    }
}
