//! The Cloudflare-style REST DNS client against a local server speaking that API (records kept in
//! memory; every write must carry the bearer token and `proxied=false`): create, idempotent
//! re-upsert (no write), update in place, family change, TXT add/delete exact, no token in
//! errors.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, put};
use orbit_runtime::dns::{CloudflareDns, DnsProvider, TxtProvider};
use serde_json::{Value, json};

#[derive(Default)]
struct Api {
    records: Vec<Value>,
    writes: u32,
    next: u32,
}

type Shared = Arc<Mutex<Api>>;

fn authorized(h: &HeaderMap) -> bool {
    h.get("authorization").and_then(|v| v.to_str().ok()) == Some("Bearer cf-token")
}

async fn list(
    State(s): State<Shared>,
    h: HeaderMap,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> (StatusCode, axum::Json<Value>) {
    if !authorized(&h) {
        return (StatusCode::FORBIDDEN, axum::Json(json!({"success": false})));
    }
    let api = s.lock().unwrap();
    let result: Vec<Value> = api
        .records
        .iter()
        .filter(|r| Some(r["name"].as_str().unwrap()) == q.get("name").map(String::as_str))
        .cloned()
        .collect();
    (
        StatusCode::OK,
        axum::Json(json!({"success": true, "result": result})),
    )
}

async fn create(
    State(s): State<Shared>,
    h: HeaderMap,
    axum::Json(mut b): axum::Json<Value>,
) -> StatusCode {
    if !authorized(&h) {
        return StatusCode::FORBIDDEN;
    }
    let mut api = s.lock().unwrap();
    if b["type"] != "TXT" {
        assert_eq!(b["proxied"], false, "address records are never proxied");
    }
    api.next += 1;
    api.writes += 1;
    b["id"] = json!(format!("rec-{}", api.next));
    api.records.push(b);
    StatusCode::OK
}

async fn update(
    State(s): State<Shared>,
    h: HeaderMap,
    Path((_, id)): Path<(String, String)>,
    axum::Json(mut b): axum::Json<Value>,
) -> StatusCode {
    if !authorized(&h) {
        return StatusCode::FORBIDDEN;
    }
    assert_eq!(b["proxied"], false);
    let mut api = s.lock().unwrap();
    api.writes += 1;
    b["id"] = json!(id);
    let Some(slot) = api.records.iter_mut().find(|r| r["id"] == id.as_str()) else {
        return StatusCode::NOT_FOUND;
    };
    *slot = b;
    StatusCode::OK
}

async fn delete(
    State(s): State<Shared>,
    h: HeaderMap,
    Path((_, id)): Path<(String, String)>,
) -> StatusCode {
    if !authorized(&h) {
        return StatusCode::FORBIDDEN;
    }
    let mut api = s.lock().unwrap();
    api.writes += 1;
    api.records.retain(|r| r["id"] != id.as_str());
    StatusCode::OK
}

async fn fake() -> (String, Shared) {
    let state: Shared = Arc::default();
    let app = Router::new()
        .route("/zones/{zone}/dns_records", get(list).post(create))
        .route("/zones/{zone}/dns_records/{id}", put(update).delete(delete))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, state)
}

#[tokio::test]
async fn cloudflare_style_records() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (url, api) = fake().await;
    let dns = CloudflareDns::new(&url, "zone-1", "cf-token", 60).unwrap();
    let name = "edge-1.example.net";
    let a1: IpAddr = "203.0.113.1".parse().unwrap();
    dns.upsert_address(name, a1).await.unwrap();
    assert_eq!(dns.address(name).await.unwrap(), Some(a1));
    let writes = api.lock().unwrap().writes;
    dns.upsert_address(name, a1).await.unwrap();
    assert_eq!(api.lock().unwrap().writes, writes, "idempotent: no write");
    let a2: IpAddr = "203.0.113.2".parse().unwrap();
    dns.upsert_address(name, a2).await.unwrap();
    assert_eq!(dns.address(name).await.unwrap(), Some(a2));
    assert_eq!(api.lock().unwrap().records.len(), 1, "updated in place");
    let v6: IpAddr = "2001:db8::1".parse().unwrap();
    dns.upsert_address(name, v6).await.unwrap();
    {
        let api = api.lock().unwrap();
        assert_eq!(api.records.len(), 1);
        assert_eq!(api.records[0]["type"], "AAAA");
    }
    let txt = "_acme-challenge.edge-1.example.net";
    dns.add_txt(txt, "v1").await.unwrap();
    dns.add_txt(txt, "v2").await.unwrap();
    dns.add_txt(txt, "v2").await.unwrap();
    dns.delete_txt(txt, "v1").await.unwrap();
    let left: Vec<String> = api
        .lock()
        .unwrap()
        .records
        .iter()
        .filter(|r| r["type"] == "TXT")
        .map(|r| r["content"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(left, ["v2"]);
    // A wrong token: a plain error without the token.
    let bad = CloudflareDns::new(&url, "zone-1", "wrong-secret-token", 60).unwrap();
    let e = bad.upsert_address(name, a1).await.unwrap_err();
    assert!(!format!("{e} {e:?} {bad:?}").contains("wrong-secret-token"));
}
