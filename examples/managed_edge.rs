//! Example (c): a managed Edge, composed with the same [`Edge`] as example (a), against a
//! Control Plane (`iop-cp`) that holds the upstream key.
//!
//! One program: an in-memory development CA; a Control Plane from the `iop_cp` library
//! (SQLite store and master key in a temporary data directory, `iop_cp::data_dir`) holding the
//! upstream key in a sealed slot, a principal with a route and a token; a stand-in upstream
//! that insists on that key; the Edge with `[control_plane] credential_plane = true` (its
//! clients present the Control Plane's tokens); a Node with a credential plane that trusts the
//! Control Plane's issuer key and holds no upstream key of its own. Each request's key is
//! leased to exactly the Node that serves it, sealed to that Node.
//!
//! ```sh
//! cargo run -p iop-examples --bin managed-edge
//! ```
//!
//! It prints a client token and a `curl`, sends one request itself, and serves until Ctrl-C.
//! Flags: `--once` (exit after its own request, for CI).
#![allow(clippy::print_stdout, reason = "an example prints what it does")]

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use iop_cp::data_dir::{self, Backend, Mode};
use iop_cp::lease::{DEFAULT_LEASE_TTL, LeaseService};
use iop_cp::server::{self, ServerConfig};
use iop_edge::Edge;
use iop_edge::config::EdgeConfigFile;
use iop_lease::{OpenPolicy, Recipient, RecipientSecretKey, TrustedIssuers};
use iop_node::{AdapterRegistry, Node, NodeOptions};
use workload_identity::dev_ca::DevCa;
use workload_identity::role;

/// The upstream key: only the Control Plane's sealed slot and the upstream know it.
const UPSTREAM_KEY: &str = "sk-example-upstream";
const MODEL: &str = "gpt-example";

/// A stand-in OpenAI-compatible upstream that answers only with the right key.
async fn upstream(
    headers: HeaderMap,
    Json(body): Json<serde_json::Value>,
) -> (StatusCode, Json<serde_json::Value>) {
    let authorized = headers.get("authorization").and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {UPSTREAM_KEY}"));
    if !authorized {
        let error =
            serde_json::json!({"error": {"message": "bad key", "type": "invalid_request_error"}});
        return (StatusCode::UNAUTHORIZED, Json(error));
    }
    let question = body["messages"][0]["content"].as_str().unwrap_or_default();
    (
        StatusCode::OK,
        Json(serde_json::json!({
            "id": "chatcmpl-example",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": format!("the upstream heard: {question}")},
                "finish_reason": "stop"
            }],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        })),
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let once = std::env::args().any(|a| a == "--once");
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = DevCa::new()?;

    // The stand-in upstream.
    let upstream_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let upstream_url = format!("http://{}/v1", upstream_listener.local_addr()?);
    tokio::spawn(async move {
        let app = axum::Router::new().route("/v1/chat/completions", post(upstream));
        let _ = axum::serve(upstream_listener, app).await;
    });

    // The Control Plane: its data directory, the slot, a principal, a route, a token.
    let dir = std::env::temp_dir().join(format!("iop-example-cp-{}", std::process::id()));
    let admin = data_dir::open(&dir, &Backend::Sqlite, Mode::Create).await?;
    let issuer = data_dir::issuer_key(&admin, &dir).await?.key.public_key();
    admin
        .put_slot(
            "upstream",
            "openai",
            "authorization",
            "Bearer ",
            UPSTREAM_KEY.as_bytes(),
        )
        .await?;
    admin.create_principal("team-a", "Team A").await?;
    admin
        .put_route("team-a-route", "team-a", MODEL, "upstream", MODEL, "")
        .await?;
    let token = admin.create_token("team-a").await?.token;
    let leases = LeaseService::new(
        admin.store().clone(),
        admin.master_key().clone(),
        DEFAULT_LEASE_TTL,
    );
    let config = ServerConfig::new("127.0.0.1:0".parse()?, ca.control_plane_tls("cp-1")?, true);
    let (cp, _cp_task) = server::serve(config, admin, Some(Arc::new(leases))).await?;

    // The managed Edge: no [auth] (the Control Plane's tokens authenticate clients).
    let edge_toml = format!(
        r#"
edge_id = "edge-1"
[listen]
nodes = "127.0.0.1:0"
http = "127.0.0.1:0"
[tls]
trust_domain = "iop.local"
[control_plane]
address = "{cp}"
server_name = "localhost"
name = "cp-1"
credential_plane = true
[[nodes]]
node_id = "node-1"
[[nodes.adapters]]
name = "openai"
type = "openai_compat"
base_url = "{upstream_url}"
profile = "openai"
capacity = 4
[[models]]
name = "{MODEL}"
[[models.providers]]
node_id = "node-1"
provider_id = "openai-node-1"
adapter = "openai"
target = "{MODEL}"
capacity = 4
"#,
        cp = cp.local_addr()
    );
    let config =
        EdgeConfigFile::parse(&edge_toml)?.build_with_tls(ca.material(role::EDGE, "edge-1")?)?;
    let edge = Edge::start(config).await?;

    // The Node: a recipient key of its own, pinning the Control Plane's issuer key; no
    // upstream key.
    let recipient = Recipient::new(
        RecipientSecretKey::generate("node-1-key")?,
        [issuer].into_iter().collect::<TrustedIssuers>(),
        OpenPolicy::default(),
    );
    let node = Node::start(
        NodeOptions::new(
            "node-1",
            &edge.node_addr().to_string(),
            "localhost",
            ca.node_tls("node-1", "edge-1")?,
        )?
        .with_adapters(AdapterRegistry::with_builtins())
        .with_credential_plane(recipient),
    );

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client_side = async {
        // Ready once the Edge holds a projection and the Node is ready (`/readyz`).
        let client = reqwest::Client::new();
        for _ in 0..200 {
            let ready = client.get(format!("{base}/readyz")).send().await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let answer: serde_json::Value = client
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(token.as_str())
            .json(&serde_json::json!({
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello from team a"}]
            }))
            .send()
            .await?
            .json()
            .await?;
        println!("answer: {}", answer["choices"][0]["message"]["content"]);
        println!("token (team-a): {}", token.as_str());
        println!(
            "try: curl -s {base}/v1/chat/completions -H 'authorization: Bearer {}' \
             -H 'content-type: application/json' \
             -d '{{\"model\": \"{MODEL}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'",
            token.as_str()
        );
        if !once {
            let _ = tokio::signal::ctrl_c().await;
        }
        let _ = stop.send(());
        Ok::<_, Box<dyn std::error::Error>>(())
    };
    let (served, asked) = tokio::join!(
        edge.serve(listener, edge.router(), async {
            let _ = stopped.await;
        }),
        client_side
    );
    served?;
    asked?;
    node.stop().await;
    edge.shutdown().await;
    cp.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
