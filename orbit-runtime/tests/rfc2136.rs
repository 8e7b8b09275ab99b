//! The RFC 2136 provider against a real BIND 9 (`named`, started by `scripts/test-all.sh` on a
//! free loopback port on 127.0.0.1 and ::1: `ORBIT_TEST_DNS_SERVER`, `ORBIT_TEST_DNS_SERVER_V6`,
//! `ORBIT_TEST_DNS_ZONE`, `ORBIT_TEST_TSIG`) over IPv4 and IPv6, with the TCP fallback for a
//! truncated answer, and the agent → control plane → DNS path: a reported address change
//! updates the record in the real server, an empty address keeps it.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::net::IpAddr;
use std::sync::Arc;

use async_trait::async_trait;
use base64::Engine as _;
use orbit_runtime::agent::{Agent, AgentConfig, Applier};
use orbit_runtime::dns::{DnsProvider, Rfc2136Dns, TxtProvider};
use orbit_runtime::server::{ControlPlane, RuntimeConfiguration, ServerConfig, system_clock};
use orbit_runtime::versions::ApplyStatus;

fn need(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| {
        panic!("{k} is not set: run scripts/test-all.sh (it starts a private named), or set ORBIT_TEST_DNS_SERVER, ORBIT_TEST_DNS_SERVER_V6, ORBIT_TEST_DNS_ZONE and ORBIT_TEST_TSIG=name:base64")
    })
}

/// The server on `var` (`ORBIT_TEST_DNS_SERVER` or `_V6`), the zone, the key name and secret.
fn env(var: &str) -> (std::net::SocketAddr, String, String, Vec<u8>) {
    let server = need(var).parse().unwrap();
    let zone = need("ORBIT_TEST_DNS_ZONE");
    let tsig = need("ORBIT_TEST_TSIG");
    let (name, secret) = tsig.split_once(':').unwrap();
    let secret = base64::engine::general_purpose::STANDARD
        .decode(secret)
        .unwrap();
    (server, zone, name.to_owned(), secret)
}

fn provider(var: &str) -> (Rfc2136Dns, String) {
    let (server, zone, key, secret) = env(var);
    (
        Rfc2136Dns::new(server, &zone, &key, secret, 30).unwrap(),
        zone,
    )
}

/// Every behaviour, against the server at `var`.
async fn records(var: &str, tag: &str) {
    let (dns, zone) = provider(var);
    let name = format!("records-{tag}-{}.{zone}", std::process::id());
    let v4: IpAddr = "203.0.113.9".parse().unwrap();
    let v6: IpAddr = "2001:db8::9".parse().unwrap();
    dns.upsert_address(&name, v4).await.unwrap();
    assert_eq!(dns.address(&name).await.unwrap(), Some(v4));
    dns.upsert_address(&name, v4).await.unwrap(); // idempotent
    assert_eq!(dns.address(&name).await.unwrap(), Some(v4));
    dns.upsert_address(&name, v6).await.unwrap(); // the family changes: A gone, AAAA there
    assert_eq!(dns.address(&name).await.unwrap(), Some(v6));
    // TXT values are added and deleted exactly.
    let txt = format!("_acme-challenge.{name}");
    dns.add_txt(&txt, "value-one").await.unwrap();
    dns.add_txt(&txt, "value-two").await.unwrap();
    let mut values = dns.txt(&txt).await.unwrap();
    values.sort();
    assert_eq!(values, ["value-one", "value-two"]);
    dns.delete_txt(&txt, "value-one").await.unwrap();
    assert_eq!(dns.txt(&txt).await.unwrap(), ["value-two"]);
    dns.delete_txt(&txt, "value-two").await.unwrap();
    assert!(dns.txt(&txt).await.unwrap().is_empty());
    // Outside the zone, or with a wrong key: refused.
    assert!(dns.upsert_address("elsewhere.example.", v4).await.is_err());
    let (server, zone, key, _) = env(var);
    let forged = Rfc2136Dns::new(server, &zone, &key, vec![0; 32], 30).unwrap();
    assert!(
        forged
            .upsert_address(&name, "192.0.2.1".parse().unwrap())
            .await
            .is_err()
    );
    assert_eq!(
        dns.address(&name).await.unwrap(),
        Some(v6),
        "the forged update changed nothing"
    );
    assert_eq!(dns.tcp_fallbacks(), 0, "every answer fitted in UDP");
}

#[tokio::test]
async fn records_in_a_real_dns_server_over_ipv4() {
    records("ORBIT_TEST_DNS_SERVER", "v4").await;
}

/// The server on `::1`: the client sends from the unspecified IPv6 address (it used to bind
/// 127.0.0.1 and got EINVAL for any server that is not on IPv4 loopback).
#[tokio::test]
async fn records_in_a_real_dns_server_over_ipv6() {
    assert!(
        need("ORBIT_TEST_DNS_SERVER_V6").starts_with('['),
        "an IPv6 server"
    );
    records("ORBIT_TEST_DNS_SERVER_V6", "v6").await;
}

/// An answer too large for UDP comes back truncated (TC); the client asks again over TCP and
/// gets all of it.
#[tokio::test]
async fn a_truncated_answer_is_fetched_again_over_tcp() {
    let (dns, zone) = provider("ORBIT_TEST_DNS_SERVER");
    let name = format!("_big-{}.{zone}", std::process::id());
    let values: Vec<String> = (0..12)
        .map(|i| format!("{i:02}-{}", "v".repeat(100)))
        .collect();
    for v in &values {
        dns.add_txt(&name, v).await.unwrap();
    }
    let before = dns.tcp_fallbacks();
    let mut got = dns.txt(&name).await.unwrap();
    got.sort();
    assert_eq!(
        got, values,
        "all twelve values (≈1.3 KB, over UDP's 512 bytes)"
    );
    assert_eq!(dns.tcp_fallbacks(), before + 1, "the query went over TCP");
    for v in &values {
        dns.delete_txt(&name, v).await.unwrap();
    }
    assert!(dns.txt(&name).await.unwrap().is_empty());
}

struct Nothing;

#[async_trait]
impl Applier for Nothing {
    async fn apply(&self, _: u64, c: &[RuntimeConfiguration]) -> Vec<(String, ApplyStatus)> {
        c.iter()
            .map(|c| (c.id.clone(), ApplyStatus::Applied))
            .collect()
    }
}

#[tokio::test]
async fn reported_address_reaches_the_dns_server() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (dns, zone) = provider("ORBIT_TEST_DNS_SERVER");
    let dns = Arc::new(dns);
    let cp = ControlPlane::in_memory(
        ServerConfig::new("http://unused"),
        dns.clone(),
        system_clock(),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = cp.router();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let dir = std::env::temp_dir().join(format!("orbit-dns-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut agent = Agent::open(AgentConfig {
        control_plane_url: url,
        deployment_token: cp.create_deployment_token(1).await.unwrap(),
        state_dir: dir.clone(),
        device_fingerprint_hash: "fp".into(),
    })
    .unwrap();
    agent.register(None).await.unwrap();
    let node = agent.state().node_id.clone().unwrap();
    let endpoint = format!("edge-{}.{zone}", std::process::id());
    assert!(cp.add_endpoint(&node, &endpoint).await.unwrap());
    let a1: IpAddr = "198.51.100.20".parse().unwrap();
    agent.tick(&Nothing, Some(a1)).await.unwrap();
    assert_eq!(dns.address(&endpoint).await.unwrap(), Some(a1));
    agent.tick(&Nothing, None).await.unwrap();
    assert_eq!(
        dns.address(&endpoint).await.unwrap(),
        Some(a1),
        "an empty address keeps the record"
    );
    let a2: IpAddr = "198.51.100.21".parse().unwrap();
    agent.tick(&Nothing, Some(a2)).await.unwrap();
    assert_eq!(dns.address(&endpoint).await.unwrap(), Some(a2));
    std::fs::remove_dir_all(&dir).unwrap();
}
