//! Example (a): an IOP Edge embedded in an existing axum application.
//!
//! One complete program, no file on disk: an in-memory development CA
//! (`workload_identity::dev_ca`) hands out the Edge's and the Nodes' mTLS identities; the Edge
//! is configured in code with `iop_edge::builder` (each Node, adapter and model named once);
//! two Nodes with the built-in `demo` adapter run
//! in the same process and register over real mTLS sockets. The application keeps its own
//! routes, its own fallback and its own authentication middleware, which decides who may call
//! the model API mounted under `/llm` (OpenAI chat completions, the Responses API and the
//! Anthropic Messages API, as `/llm/v1/...`), and names the user each request is for, so that
//! the Edge's per-key rate limits apply per user (alice: 3 requests a minute; 429 with
//! `retry-after` and `x-ratelimit-*` headers past it). The Edge's connection limits (`Limits`) apply
//! to the listener, and its certificate is rotated in place every `--rotate-secs`.
//!
//! ```sh
//! cargo run -p iop-examples --bin edge-in-axum
//! curl -s localhost:3000/llm/v1/chat/completions -H 'x-app-user: alice' \
//!   -H 'content-type: application/json' \
//!   -d '{"model": "demo", "messages": [{"role": "user", "content": "hello"}]}'
//! ```
//!
//! A third Node may join from another process with a custom adapter (example (b),
//! `custom_adapter_node.rs`): `--export-node-tls DIR` writes its certificate, key and the CA
//! (the only files this example ever writes, and only when asked) and the Edge serves model
//! `reverse` on it.
//!
//! The Edge's status page (live Nodes, providers, queue, traffic) is served on its own
//! listener when `--admin-token-file FILE` names a token (`--admin-listen ADDR`, default any
//! free loopback port; printed at start): open it in a browser with the token as the password.
//!
//! Flags: `--listen ADDR` (default `127.0.0.1:3000`), `--rotate-secs N` (default 300),
//! `--export-node-tls DIR`, `--admin-token-file FILE`, `--admin-listen ADDR`.
#![allow(clippy::print_stdout, reason = "an example prints what it does")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use iop_edge::Edge;
use iop_edge::builder::{AdapterSpec, EdgeBuilder, EdgeTls, NodeSpec};
use iop_edge::config::{ConfigError, EdgeConfig, Limits};
use iop_edge::limits::{KeyId, KeyLimits, LimitsConfig};
use iop_edge::ratelimit::{Limits as RateLimits, Rate};
use iop_node::{AdapterRegistry, Node, NodeOptions};
use workload_identity::dev_ca::DevCa;
use workload_identity::role;

/// The Edge's configuration in code (`iop_edge::builder`): Nodes, their adapters and the models
/// each adapter serves, every name written once (the TOML file's `[[models.providers]]` are
/// derived). The same limits and keys as the file (`iop_edge::config`).
fn edge_config(tls: Arc<workload_identity::WorkloadTls>) -> Result<EdgeConfig, ConfigError> {
    let demo = || AdapterSpec::demo("demo").capacity(4).serves("demo");
    EdgeBuilder::new("edge-1")
        .listen_nodes(SocketAddr::from(([127, 0, 0, 1], 0))) // where Nodes dial (mTLS)
        .queue(Duration::from_secs(10), 256)
        .limits(Limits {
            http_max_connections: 256, // enforced by Edge::serve on the application's listener
            http_header_timeout_sec: 10,
            ..Limits::default()
        })
        // Per-user rate limits: the ids come from this application's own authentication
        // (`require_user` puts a `KeyId` on each request); alice may send 3 requests a minute.
        .rate_limits(LimitsConfig {
            keys: [(
                "alice".to_owned(),
                KeyLimits {
                    limits: RateLimits {
                        requests: Rate::per_minute(3),
                        ..RateLimits::default()
                    },
                    ..KeyLimits::default()
                },
            )]
            .into(),
            ..LimitsConfig::default()
        })
        .node(NodeSpec::new("node-1").adapter(demo()))
        .node(NodeSpec::new("node-2").adapter(demo()))
        // Example (b), from another process: a native adapter type that Node registers.
        .node(
            NodeSpec::new("node-fn").adapter(
                AdapterSpec::native("reverse", "reverse", "")
                    .capacity(2)
                    .serves("reverse"),
            ),
        )
        .build(EdgeTls::Material(tls))
}

/// Who may call the model API: the application's own rule (here a header naming a known
/// user; in a real service, your session or SSO check).
const USERS: [&str; 2] = ["alice", "bob"];

async fn require_user(mut request: Request, next: Next) -> Response {
    let user = request
        .headers()
        .get("x-app-user")
        .and_then(|v| v.to_str().ok())
        .and_then(|u| USERS.iter().find(|known| **known == u));
    if let Some(user) = user {
        // Who the request is for: the Edge limits (and records usage) under this id.
        request.extensions_mut().insert(KeyId::new(user));
        next.run(request).await
    } else {
        (StatusCode::UNAUTHORIZED, "sign in to my app first\n").into_response()
    }
}

struct Args {
    listen: SocketAddr,
    rotate: Duration,
    export: Option<std::path::PathBuf>,
    admin_token_file: Option<std::path::PathBuf>,
    admin_listen: SocketAddr,
}

fn args() -> Result<Args, String> {
    let mut out = Args {
        listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
        rotate: Duration::from_secs(300),
        export: None,
        admin_token_file: None,
        admin_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => out.listen = value()?.parse().map_err(|e| format!("--listen: {e}"))?,
            "--rotate-secs" => {
                let secs: u64 = value()?
                    .parse()
                    .map_err(|e| format!("--rotate-secs: {e}"))?;
                out.rotate = Duration::from_secs(secs.max(1));
            }
            "--export-node-tls" => out.export = Some(value()?.into()),
            "--admin-token-file" => out.admin_token_file = Some(value()?.into()),
            "--admin-listen" => {
                out.admin_listen = value()?
                    .parse()
                    .map_err(|e| format!("--admin-listen: {e}"))?;
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = args()?;
    let _ = rustls::crypto::ring::default_provider().install_default();

    // Development PKI, in memory.
    let ca = Arc::new(DevCa::new()?);
    let edge_tls = ca.material(role::EDGE, "edge-1")?;

    // The Edge: Node listener, pool and queue.
    let config = edge_config(edge_tls.clone())?;
    let edge = Edge::start(config).await?;
    let nodes_at = edge.node_addr();

    // Two Nodes in this process, dialling the Edge over mTLS like any remote Node.
    let mut lifecycle = edge.handle().subscribe();
    let mut nodes = Vec::new();
    for id in ["node-1", "node-2"] {
        let options = NodeOptions::new(
            id,
            &nodes_at.to_string(),
            "localhost",
            ca.node_tls(id, "edge-1")?,
        )?
        .with_adapters(AdapterRegistry::with_builtins());
        nodes.push(Node::start(options));
    }
    let mut ready = 0;
    while ready < 2 {
        if let iop_edge::Lifecycle::Connected { .. } = lifecycle.recv().await? {
            ready += 1;
        }
    }

    // Example (b)'s Node runs elsewhere: hand it its identity only when asked.
    if let Some(dir) = &args.export {
        std::fs::create_dir_all(dir)?;
        let (cert, key) = ca.issue_pem(role::NODE, "node-fn")?;
        std::fs::write(dir.join("ca.pem"), ca.ca_pem())?;
        std::fs::write(dir.join("node-fn.pem"), cert)?;
        std::fs::write(dir.join("node-fn.key"), key)?;
        println!("node-fn identity written to {}", dir.display());
    }

    // Certificate rotation: re-issue the Edge's certificate and swap it in place; new Node
    // connections use it, established ones continue.
    let rotation = {
        let (ca, tls) = (ca.clone(), edge_tls.clone());
        tokio::spawn(async move {
            let mut every = tokio::time::interval(args.rotate);
            every.tick().await;
            loop {
                every.tick().await;
                match ca.issue_pem(role::EDGE, "edge-1") {
                    Ok((cert, key)) => {
                        match tls.reload_pem(
                            ca.ca_pem().as_bytes(),
                            cert.as_bytes(),
                            key.as_bytes(),
                        ) {
                            Ok(_) => println!("edge certificate rotated"),
                            Err(e) => println!("edge certificate refused: {e}"),
                        }
                    }
                    Err(e) => println!("edge certificate not issued: {e}"),
                }
            }
        })
    };

    // The application: its own routes, fallback and middleware; the Edge's API under /llm
    // behind the application's authentication, the Edge's health and metrics under /ops.
    let app = Router::new()
        .route("/", get(|| async { "my application\n" }))
        .route(
            "/about",
            get(|| async { "an app that also serves models\n" }),
        )
        .nest("/llm", edge.api().layer(middleware::from_fn(require_user)))
        .nest("/ops", edge.ops())
        .fallback(|| async { (StatusCode::NOT_FOUND, "no such page in my app\n") });

    // The status page for operators, on its own listener (never the app's), when a token is
    // given: every request needs it (Bearer, or the Basic password a browser asks for).
    let admin = match &args.admin_token_file {
        None => None,
        Some(path) => {
            let token = iop_edge::admin::AdminToken::new(&std::fs::read_to_string(path)?)
                .ok_or("the admin token must be at least 16 printable characters")?;
            let listener = tokio::net::TcpListener::bind(args.admin_listen).await?;
            println!("status page on http://{}/", listener.local_addr()?);
            let page = edge.status_page(token);
            Some(tokio::spawn(async move {
                let _ = axum::serve(listener, page).await;
            }))
        }
    };

    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let at = listener.local_addr()?;
    println!("nodes on {nodes_at}");
    println!("app on http://{at}");
    println!(
        "try: curl -s http://{at}/llm/v1/chat/completions -H 'x-app-user: alice' \
         -H 'content-type: application/json' \
         -d '{{\"model\": \"demo\", \"messages\": [{{\"role\": \"user\", \"content\": \"hello\"}}]}}'"
    );
    edge.serve(listener, app, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;

    rotation.abort();
    if let Some(a) = admin {
        a.abort();
    }
    for node in nodes {
        node.stop().await;
    }
    edge.shutdown().await;
    Ok(())
}
