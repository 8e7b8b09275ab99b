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
//! 32 concurrent HTTP/1.1 clients send them.
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
const PER_TASK: usize = 1500;

async fn serve(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

async fn run(url: &str, batches: Vec<Vec<Vec<(&'static str, String)>>>) -> (f64, Vec<Duration>) {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for batch in batches {
        let url = url.to_owned();
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .tcp_nodelay(true)
                .build()
                .unwrap();
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
    let rate = lat.len() as f64 / started.elapsed().as_secs_f64();
    lat.sort();
    (rate, lat)
}

fn signed_batches(
    key: &ed25519_dalek::SigningKey,
    identity: &Identity,
    salt: u64,
) -> Vec<Vec<Vec<(&'static str, String)>>> {
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
    // Warm-up, then the measured runs (fresh nonces for each).
    run(
        &verified,
        signed_batches(&key, &identity, 0)
            .into_iter()
            .map(|b| b[..100].to_vec())
            .collect(),
    )
    .await;
    let (v_rate, v_lat) = run(&verified, signed_batches(&key, &identity, 1)).await;
    let (u_rate, u_lat) = run(&unverified, signed_batches(&key, &identity, 2)).await;
    println!("# orbit_heartbeat ({CONCURRENCY} clients × {PER_TASK} heartbeats each)\n");
    println!("| handler | heartbeats/s | p50 | p99 |\n|---|---:|---:|---:|");
    println!(
        "| without signature verification (baseline) | {u_rate:.0} | {:.3} ms | {:.3} ms |",
        ms(percentile(&u_lat, 0.5)),
        ms(percentile(&u_lat, 0.99))
    );
    println!(
        "| verified (Ed25519 strict, digest, window, nonce) | {v_rate:.0} | {:.3} ms | {:.3} ms |",
        ms(percentile(&v_lat, 0.5)),
        ms(percentile(&v_lat, 0.99))
    );
    println!("\nverified ÷ baseline: {:.2}×", v_rate / u_rate);
}
