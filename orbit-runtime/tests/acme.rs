//! ACME DNS-01 end to end: the agent submits a CSR for its endpoint; the control plane validates
//! it, orders from Let's Encrypt's `pebble` (started by `scripts/test-all.sh` on loopback, real
//! validation) and writes the challenge TXT record into the private BIND 9 through the RFC 2136
//! provider; pebble checks it there; the issued chain names the endpoint and chains to pebble's
//! root; the TXT record is gone afterwards. CSRs for foreign names or unaccepted keys are refused.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::sync::Arc;

use base64::Engine as _;
use orbit_runtime::agent::{Agent, AgentConfig, AgentError};
use orbit_runtime::certs::AcmeIssuer;
use orbit_runtime::dns::Rfc2136Dns;
use orbit_runtime::server::{ControlPlane, ServerConfig, system_clock};
use x509_parser::prelude::*;

fn need(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| {
        panic!("{k} is not set: run scripts/test-all.sh (it starts a private named and pebble)")
    })
}

fn pem_certs(pem: &str) -> Vec<Vec<u8>> {
    pem.split("-----BEGIN CERTIFICATE-----")
        .skip(1)
        .map(|part| {
            let b64: String = part
                .split("-----END CERTIFICATE-----")
                .next()
                .unwrap()
                .chars()
                .filter(|c| !c.is_whitespace())
                .collect();
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap()
        })
        .collect()
}

fn csr(names: &[&str], key: &rcgen::KeyPair) -> String {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let mut params = rcgen::CertificateParams::new(names).unwrap();
    // rcgen's default subject has a placeholder common name; a CSR's CN must be one of its
    // names (as ACME CAs require), so leave the subject empty.
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.serialize_request(key).unwrap().pem().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acme_dns01_with_pebble_and_bind9() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server: std::net::SocketAddr = need("ORBIT_TEST_DNS_SERVER").parse().unwrap();
    let zone = need("ORBIT_TEST_DNS_ZONE");
    let tsig = need("ORBIT_TEST_TSIG");
    let (key_name, secret) = tsig.split_once(':').unwrap();
    let dns = Arc::new(
        Rfc2136Dns::new(
            server,
            &zone,
            key_name,
            base64::engine::general_purpose::STANDARD
                .decode(secret)
                .unwrap(),
            10,
        )
        .unwrap(),
    );
    let root_path = need("ORBIT_TEST_ACME_ROOT");
    let issuer = AcmeIssuer::new(
        &need("ORBIT_TEST_ACME_DIRECTORY"),
        Some(root_path.as_ref()),
        dns.clone(),
    )
    .await
    .expect("ACME account at pebble");
    let cp = ControlPlane::in_memory(
        ServerConfig::new("http://unused"),
        dns.clone(),
        system_clock(),
    )
    .unwrap()
    .with_acme(Arc::new(issuer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = cp.router();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let dir = std::env::temp_dir().join(format!("orbit-acme-{}", std::process::id()));
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
    let endpoint = format!("tls-{}.{zone}", std::process::id());
    assert!(cp.add_endpoint(&node, &endpoint).await.unwrap());

    // Refused before any ACME traffic: a foreign name, an Ed25519 key.
    let key = rcgen::KeyPair::generate().unwrap(); // ECDSA P-256
    let out = dir.join("endpoint.pem");
    assert_eq!(
        agent
            .request_certificate(&csr(&["other.example.com"], &key), &out)
            .await
            .unwrap_err(),
        AgentError::Status(400)
    );
    let ed = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
    assert_eq!(
        agent
            .request_certificate(&csr(&[endpoint.as_str()], &ed), &out)
            .await
            .unwrap_err(),
        AgentError::Status(400)
    );

    // Issue.
    let id = agent
        .request_certificate(&csr(&[endpoint.as_str()], &key), &out)
        .await
        .unwrap();
    let chain_pem = std::fs::read_to_string(&out).unwrap();
    let chain = pem_certs(&chain_pem);
    assert!(chain.len() >= 2, "leaf and intermediate");
    let (_, leaf) = X509Certificate::from_der(&chain[0]).unwrap();
    let sans: Vec<String> = leaf
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(d) => Some((*d).to_owned()),
            _ => None,
        })
        .collect();
    assert_eq!(sans, std::slice::from_ref(&endpoint));
    assert_eq!(
        &*leaf.public_key().subject_public_key.data,
        key.public_key_raw(),
        "the Runtime's own key"
    );
    // The chain verifies up to pebble's root (from its management interface).
    let mgmt = need("ORBIT_TEST_PEBBLE_MANAGEMENT");
    let root_ca = reqwest::Certificate::from_pem(&std::fs::read(&root_path).unwrap()).unwrap();
    let http = reqwest::Client::builder()
        .add_root_certificate(root_ca)
        .build()
        .unwrap();
    let root_pem = http
        .get(format!("{mgmt}/roots/0"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let root = pem_certs(&root_pem).remove(0);
    let mut all = chain.clone();
    all.push(root);
    for pair in all.windows(2) {
        let (_, child) = X509Certificate::from_der(&pair[0]).unwrap();
        let (_, parent) = X509Certificate::from_der(&pair[1]).unwrap();
        child
            .verify_signature(Some(parent.public_key()))
            .expect("chains to pebble's root");
    }
    // The challenge record was removed, and the metadata is listed.
    assert!(
        dns.txt(&format!("_acme-challenge.{endpoint}"))
            .await
            .unwrap()
            .is_empty()
    );
    let listed = agent.certificates().await.unwrap();
    assert_eq!(listed["certificates"][0]["certificate_id"], id.as_str());
    assert_eq!(listed["certificates"][0]["names"][0], endpoint.as_str());
    std::fs::remove_dir_all(&dir).unwrap();
}
