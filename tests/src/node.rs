//! An Edge with one Node connected to it, what a Node says about its adapters, asked through
//! the Edge (`PROVIDER_LIFECYCLE`), and the answer the simulations' tunnel providers give.

use std::time::Duration;

use iop_edge::{EdgeHandle, Lifecycle, TransportConfig, bind};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_wire::runtime::{NodeCommandKind, NodeCommandRequest};
use tokio_util::sync::CancellationToken;
use workload_identity::role;

use crate::pki::Ca;

/// Binds an Edge (`edge-1`) with `cfg` and connects Node `node-1` with `adapters` to it, over
/// mTLS from `ca`: the Edge once the Node is connected, and the token that stops the Node.
///
/// # Panics
///
/// When the Edge cannot bind or the Node's options are refused (test setup).
#[allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]
pub async fn bind_with_node(
    ca: &Ca,
    cfg: TransportConfig,
    adapters: AdapterRegistry,
) -> (EdgeHandle, CancellationToken) {
    let edge = bind(cfg).await.unwrap().0;
    let mut life = edge.subscribe();
    let node_tls = crate::pki::node_client_tls(ca, role::NODE, "node-1", "edge-1");
    let opts = NodeOptions::new(
        "node-1",
        &edge.local_addr().to_string(),
        "localhost",
        node_tls,
    )
    .unwrap()
    .with_adapters(adapters);
    let shutdown = CancellationToken::new();
    tokio::spawn(run_node(opts, shutdown.clone()));
    while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
    (edge, shutdown)
}

/// `adapter`'s requests in flight on `node_id` (its capacity gate's permits taken), from the
/// Node's `PROVIDER_LIFECYCLE` answer (`in_flight=N capacity=M`); `None` without an answer.
pub async fn in_flight(edge: &EdgeHandle, node_id: &str, adapter: &str) -> Option<u32> {
    let r = edge
        .command(
            node_id,
            NodeCommandRequest {
                kind: NodeCommandKind::ProviderLifecycle,
                adapter: String::new(),
                target: String::new(),
            },
        )
        .await
        .ok()?;
    r.result
        .get(adapter)?
        .split(' ')
        .next()?
        .strip_prefix("in_flight=")?
        .parse()
        .ok()
}

/// Waits until `adapter` on `node_id` has nothing in flight; panics after 10 s (a bound, not a
/// timing assumption: an idle adapter answers at once).
pub async fn wait_idle(edge: &EdgeHandle, node_id: &str, adapter: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let n = in_flight(edge, node_id, adapter).await;
        if n == Some(0) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{adapter} on {node_id} still busy: {n:?} in flight"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The answer of a simulated tunnel provider: status 200, three body chunks (`chunk-0\n` …)
/// `gap` apart, then a usage observation (1 prompt token, 3 completion tokens). With `stall`,
/// it goes silent after the first chunk until the Node fences the attempt. Stops early, with
/// `Ok`, when the tunnel ended.
pub async fn answer_in_chunks(
    frames: &iop_node::TunnelSink,
    gap: Duration,
    stall: bool,
) -> Result<(), iop_node::AdapterError> {
    if !frames.start(200, Vec::new()).await {
        return Ok(());
    }
    for i in 0..3 {
        tokio::time::sleep(gap).await;
        if !frames
            .body(bytes::Bytes::from(format!("chunk-{i}\n")))
            .await
        {
            return Ok(());
        }
        if stall {
            frames.cancelled().await;
            return Ok(());
        }
    }
    frames
        .usage(iop_wire::runtime::Usage {
            prompt_tokens: 1,
            completion_tokens: 3,
            total_tokens: 4,
            cached_prompt_tokens: 0,
        })
        .await;
    Ok(())
}
