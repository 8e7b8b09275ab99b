//! The RFC 2136 provider against a real BIND 9 (`named`, started by `scripts/test-all.sh` on a
//! free loopback port: `ORBIT_TEST_DNS_SERVER`, `ORBIT_TEST_DNS_ZONE`, `ORBIT_TEST_TSIG`), and the
//! agent → control plane → DNS path: a reported address change updates the record in the real
//! server, an empty address keeps it.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::net::IpAddr;
use std::sync::Arc;

use async_trait::async_trait;
use base64::Engine as _;
use orbit_runtime::agent::{Agent, AgentConfig, Applier};
use orbit_runtime::dns::{DnsProvider, Rfc2136Dns, TxtProvider};
use orbit_runtime::server::{ControlPlane, RuntimeConfiguration, ServerConfig, system_clock};
use orbit_runtime::versions::ApplyStatus;

fn env() -> (std::net::SocketAddr, String, String, Vec<u8>) {
    let need = |k: &str| {
        std::env::var(k).unwrap_or_else(|_| {
            panic!("{k} is not set: run scripts/test-all.sh (it starts a private named), or set ORBIT_TEST_DNS_SERVER, ORBIT_TEST_DNS_ZONE and ORBIT_TEST_TSIG=name:base64")
        })
    };
    let server = need("ORBIT_TEST_DNS_SERVER").parse().unwrap();
    let zone = need("ORBIT_TEST_DNS_ZONE");
    let tsig = need("ORBIT_TEST_TSIG");
    let (name, secret) = tsig.split_once(':').unwrap();
    let secret = base64::engine::general_purpose::STANDARD
        .decode(secret)
        .unwrap();
    (server, zone, name.to_owned(), secret)
}

fn provider() -> (Rfc2136Dns, String) {
    let (server, zone, key, secret) = env();
    (Rfc2136Dns::new(server, &zone, &key, secret, 30), zone)
}

#[tokio::test]
async fn records_in_a_real_dns_server() {
    let (dns, zone) = provider();
    let name = format!("records-{}.{zone}", std::process::id());
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
    let (server, zone, key, _) = env();
    let forged = Rfc2136Dns::new(server, &zone, &key, vec![0; 32], 30);
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
    let (dns, zone) = provider();
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
