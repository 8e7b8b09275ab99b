//! `lease_rtt`: the credential lease acquisition round trip (Edge → Control Plane → Edge) over
//! the managed mTLS control wire, beside a bare ping/pong round trip on the same connection.
//!
//! ```text
//! cargo run --release -p iop-benches --bin lease_rtt
//! LEASE_RTT_COUNT=5000 cargo run --release -p iop-benches --bin lease_rtt
//! ```
//!
//! One process on 127.0.0.1: an `iop-cp` server (managed, SQLite store in memory, one
//! principal/slot/route) and an `iop-edge` control connector. Each lease request makes the
//! Control Plane re-read the route, slot and principal at one generation, check the binding,
//! decrypt the slot (AES-256-GCM) and issue a lease (HPKE seal + ECDSA P-256 signature).
//! Sequential round trips give p50/p99; 32 concurrent callers give the sustained rate.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "load tool"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_benches::load::{ms, percentile};
use iop_cp::admin::Admin;
use iop_cp::lease::{DEFAULT_LEASE_TTL, LeaseService};
use iop_cp::seal::MasterKey;
use iop_cp::server::{self, ServerConfig};
use iop_cp::store::{SqliteStore, Store};
use iop_edge::control::{ControlConfig, ControlConnector, SessionState};
use iop_edge::{TransportConfig, bind};
use iop_tests::pki::{self, Ca};
use iop_wire::runtime::CredentialLeaseBinding;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const CONCURRENCY: usize = 32;

#[tokio::main]
async fn main() {
    let count: usize = std::env::var("LEASE_RTT_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let ca = Ca::new("lease_rtt CA");
    let store: Arc<dyn Store> = Arc::new(SqliteStore::in_memory().unwrap());
    let admin = Admin::new(store.clone(), Arc::new(MasterKey::generate().unwrap().0), 1);
    admin.create_principal("team-a", "A").await.unwrap();
    admin
        .put_slot(
            "slot-1",
            "openai",
            "authorization",
            "Bearer ",
            b"sk-bench-0123456789abcdef0123456789abcdef",
        )
        .await
        .unwrap();
    admin
        .put_route("r1", "team-a", "gpt", "slot-1", "gpt-4o-mini", "")
        .await
        .unwrap();
    admin
        .ensure_issuer_key(|| Ok(iop_lease::IssuerSigningKey::generate_derived().unwrap()))
        .await
        .unwrap();
    let leases = Arc::new(LeaseService::new(
        store.clone(),
        admin.master_key().clone(),
        DEFAULT_LEASE_TTL,
    ));
    let config = ServerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        pki::server_tls(&ca, role::CONTROL_PLANE, "cp-1", role::EDGE),
        true,
    );
    let (cp, _task) = server::serve(config, admin.clone(), Some(leases))
        .await
        .unwrap();
    let mut edge_cfg = TransportConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        pki::edge_server_tls(&ca, "edge-1"),
    );
    edge_cfg.pool = None;
    let edge = bind(edge_cfg).await.unwrap().0;
    let connector = ControlConnector::start(
        edge,
        ControlConfig {
            managed: true,
            ..ControlConfig::new(
                vec![cp.local_addr().to_string()],
                "localhost".try_into().unwrap(),
                pki::client_tls(&ca, role::EDGE, "edge-1", role::CONTROL_PLANE, "cp-1"),
                "edge-1",
            )
        },
        CancellationToken::new(),
    )
    .unwrap();
    let mut state = connector.state();
    while *state.borrow_and_update() != SessionState::Connected {
        state.changed().await.unwrap();
    }
    let node_key = iop_lease::RecipientSecretKey::generate("node-1-key").unwrap();
    let public = *node_key.public_key().as_bytes();
    let binding = CredentialLeaseBinding {
        principal_id: "team-a".into(),
        slot_id: "slot-1".into(),
        route_id: "r1".into(),
        profile: "openai".into(),
        upstream_target: "gpt-4o-mini".into(),
        node_id: "node-1".into(),
        recipient_key_id: "node-1-key".into(),
        credential_revision: 1,
        route_revision: 1,
        projection_generation: connector.projection().unwrap().generation(),
    };

    // Warm-up.
    for _ in 0..200 {
        connector.ping().await.unwrap();
        connector
            .acquire_lease(binding.clone(), public)
            .await
            .unwrap();
    }

    let mut pings = Vec::with_capacity(count);
    for _ in 0..count {
        pings.push(connector.ping().await.unwrap());
    }
    pings.sort();
    let mut leases_rtt = Vec::with_capacity(count);
    for _ in 0..count {
        let t = Instant::now();
        connector
            .acquire_lease(binding.clone(), public)
            .await
            .unwrap();
        leases_rtt.push(t.elapsed());
    }
    leases_rtt.sort();

    let rate = |n: usize, f: fn(ControlConnector, CredentialLeaseBinding, [u8; 32]) -> _| {
        let (connector, binding) = (connector.clone(), binding.clone());
        async move {
            let started = Instant::now();
            let mut tasks = Vec::new();
            for _ in 0..CONCURRENCY {
                let (c, b) = (connector.clone(), binding.clone());
                tasks.push(tokio::spawn(async move {
                    for _ in 0..n / CONCURRENCY {
                        let fut: std::pin::Pin<Box<dyn Future<Output = ()> + Send>> =
                            f(c.clone(), b.clone(), public);
                        fut.await;
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            (n / CONCURRENCY * CONCURRENCY) as f64 / started.elapsed().as_secs_f64()
        }
    };
    let ping_rate = rate(count * 4, |c, _, _| {
        Box::pin(async move {
            c.ping().await.unwrap();
        })
    })
    .await;
    let lease_rate = rate(count, |c, b, k| {
        Box::pin(async move {
            c.acquire_lease(b, k).await.unwrap();
        })
    })
    .await;

    println!("# lease_rtt (loopback mTLS, release build expected)\n");
    println!("{count} sequential round trips each; rates with {CONCURRENCY} concurrent callers.\n");
    println!(
        "| round trip | p50 | p99 | per second (sequential) | per second ({CONCURRENCY} concurrent) |"
    );
    println!("|---|---:|---:|---:|---:|");
    let row = |name: &str, v: &[Duration], rate: f64| {
        println!(
            "| {name} | {:.3} ms | {:.3} ms | {:.0} | {rate:.0} |",
            ms(percentile(v, 0.5)),
            ms(percentile(v, 0.99)),
            v.len() as f64 / v.iter().sum::<Duration>().as_secs_f64(),
        );
    };
    row(
        "ping/pong on the control connection (baseline)",
        &pings,
        ping_rate,
    );
    row("AcquireLease → lease", &leases_rtt, lease_rate);
    println!(
        "\nlease ÷ ping: p50 {:.2}×, p99 {:.2}×, concurrent rate {:.2}×",
        ms(percentile(&leases_rtt, 0.5)) / ms(percentile(&pings, 0.5)),
        ms(percentile(&leases_rtt, 0.99)) / ms(percentile(&pings, 0.99)),
        lease_rate / ping_rate
    );
}
