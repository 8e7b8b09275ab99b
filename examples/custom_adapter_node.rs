//! Example (b): a Node with a custom [`Adapter`], registering with an Edge (example (a)'s, or
//! any Edge whose config has `type = "reverse"` for this Node).
//!
//! The adapter is "a local function model": it reverses the words of the last user message and
//! streams them one at a time. What the Node asks of an adapter, and what it takes care of:
//!
//! - **Content only.** The adapter sends text deltas through [`RunEvents`] and returns a
//!   [`RunCompletion`] (usage, metadata) or an [`AdapterError`]; the Node sends `START` and
//!   exactly one terminal itself.
//! - **Cancellation is by drop.** A client that goes away, a `CancelRequest`, the run's
//!   deadline or a lost connection drop the adapter's future: hold no state that must be
//!   cleaned up by hand.
//! - **Stalls.** If the provider goes silent past the run's stall timeout, the Node fences the
//!   attempt: [`RunEvents::cancelled`] resolves, and the adapter should return promptly.
//! - **Capacity.** The Node admits at most the instance's configured `capacity` runs at once
//!   (its own gate, behind the Edge's), so the adapter needs no limit of its own.
//! - **Backpressure.** [`RunEvents::delta`] waits when the client reads slowly.
//!
//! ```sh
//! cargo run -p iop-examples --bin edge-in-axum -- --export-node-tls /tmp/node-fn
//! cargo run -p iop-examples --bin custom-adapter-node -- --edge 127.0.0.1:PORT --tls-dir /tmp/node-fn
//! ```
//!
//! (`PORT` is the "nodes on" address example (a) prints.) Flags: `--edge ADDR` (required),
//! `--tls-dir DIR` (required: `ca.pem`, `<node-id>.pem`, `<node-id>.key`), `--node-id`
//! (default `node-fn`), `--edge-name` (default `edge-1`), `--server-name` (default
//! `localhost`).
#![allow(clippy::print_stdout, reason = "an example prints what it does")]

use std::sync::Arc;
use std::time::Duration;

use iop_node::credential::UpstreamCredential;
use iop_node::{
    Adapter, AdapterBuildError, AdapterConfig, AdapterError, AdapterRegistry, AdapterSettings,
    Node, NodeOptions, ProviderStatus, RunCompletion, RunEvents, RunRequest, Usage, async_trait,
    last_message_text,
};
use workload_identity::{ExpectedPeer, WorkloadTls, role};

/// Reverses the words of the last message, streaming one word per delta.
#[derive(Debug)]
struct ReverseAdapter {
    /// Pause before each word (`options.delay_ms`), to make the streaming visible.
    delay: Duration,
    /// The targets this instance serves (from the Edge's config).
    targets: Vec<String>,
}

impl ReverseAdapter {
    /// The factory: builds an instance from the Edge's `[[nodes.adapters]]` entry.
    fn from_config(config: &AdapterConfig) -> Result<Self, AdapterBuildError> {
        let AdapterSettings::Native(settings) = &config.settings else {
            return Err(AdapterBuildError::WrongSettings);
        };
        let delay = match settings.options.get("delay_ms") {
            None => 20,
            Some(v) => v.parse().map_err(|_| {
                AdapterBuildError::InvalidSetting("options.delay_ms: not a number".into())
            })?,
        };
        Ok(Self {
            delay: Duration::from_millis(delay),
            targets: config.targets.clone(),
        })
    }
}

#[async_trait]
impl Adapter for ReverseAdapter {
    async fn run(
        &self,
        request: RunRequest,
        events: RunEvents,
    ) -> Result<RunCompletion, AdapterError> {
        if !self.targets.is_empty() && !self.targets.contains(&request.target) {
            return Err(AdapterError::UnknownTarget);
        }
        let text = last_message_text(&request.input)?;
        let words: Vec<&str> = text.split_whitespace().rev().collect();
        let mut sent = 0u64;
        for (i, word) in words.iter().enumerate() {
            tokio::select! {
                // Fenced after a stall: stop at once.
                () = events.cancelled() => return Err(AdapterError::Provider("fenced".into())),
                () = tokio::time::sleep(self.delay) => {}
            }
            let piece = if i == 0 {
                (*word).to_owned()
            } else {
                format!(" {word}")
            };
            if !events.delta(piece).await {
                break; // the run is gone
            }
            sent += 1;
        }
        let prompt = u64::try_from(words.len()).unwrap_or(u64::MAX);
        Ok(RunCompletion {
            metadata: Default::default(),
            usage: Some(Usage {
                prompt_tokens: prompt,
                completion_tokens: sent,
                total_tokens: prompt + sent,
                cached_prompt_tokens: 0,
            }),
        })
    }

    async fn probe(
        &self,
        target: &str,
        _credential: Option<&UpstreamCredential>,
    ) -> ProviderStatus {
        // A local function is available whenever it serves the target.
        if self.targets.is_empty() || self.targets.iter().any(|t| t == target) {
            ProviderStatus::Available
        } else {
            ProviderStatus::Unavailable
        }
    }
}

struct Args {
    edge: String,
    tls_dir: std::path::PathBuf,
    node_id: String,
    edge_name: String,
    server_name: String,
}

fn args() -> Result<Args, String> {
    let (mut edge, mut tls_dir) = (None, None);
    let mut out = Args {
        edge: String::new(),
        tls_dir: Default::default(),
        node_id: "node-fn".into(),
        edge_name: "edge-1".into(),
        server_name: "localhost".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--edge" => edge = Some(value),
            "--tls-dir" => tls_dir = Some(value.into()),
            "--node-id" => out.node_id = value,
            "--edge-name" => out.edge_name = value,
            "--server-name" => out.server_name = value,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    out.edge = edge.ok_or("--edge ADDR is required")?;
    out.tls_dir = tls_dir.ok_or("--tls-dir DIR is required")?;
    Ok(out)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = args()?;
    let _ = rustls::crypto::ring::default_provider().install_default();

    // This Node's identity, from the files example (a) exported (or your own CA's).
    let read = |name: &str| std::fs::read(args.tls_dir.join(name));
    let material = WorkloadTls::from_pem(
        &read("ca.pem")?,
        &read(&format!("{}.pem", args.node_id))?,
        &read(&format!("{}.key", args.node_id))?,
    )?;
    let trust_domain = material.identity().trust_domain().to_owned();
    let edge = ExpectedPeer::exact(&trust_domain, role::EDGE, &args.edge_name)?;
    let tls = Arc::new(material.client_config(edge)?);

    // The built-in adapters plus ours, under the type name the Edge's config uses.
    let mut adapters = AdapterRegistry::with_builtins();
    adapters.register(
        "reverse",
        Arc::new(|c: &AdapterConfig| {
            Ok(Arc::new(ReverseAdapter::from_config(c)?) as Arc<dyn Adapter>)
        }),
    );

    let options = NodeOptions::new(&args.node_id, &args.edge, &args.server_name, tls)?
        .with_adapters(adapters);
    println!("{} dialling {}", args.node_id, args.edge);
    let exit = Node::start(options)
        .run_until(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
    println!("{} stopped: {exit:?}", args.node_id);
    std::process::exit(exit.exit_code());
}
