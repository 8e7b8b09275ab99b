//! The configuration the pair harness (`pair.rs`) and the model checker (`model.rs`) share:
//! an Edge that knows `node-1` and `node-2`, model `m` served by one provider on each, and
//! the requests they send.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use iop_edge_core::pool::{Pool, PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge_core::registry::{Registry, RegistryConfig};
use iop_wire::HeartbeatConfig;
use iop_wire::runtime::{Header, NodeConfigPayload, ProviderTunnelRequest, RunRequest};
use iop_wire::validate::ResponseStallTimeout;

/// The two Node ids.
pub(crate) const NODES: [&str; 2] = ["node-1", "node-2"];

/// A provider of capacity 1 on `node`.
pub(crate) fn provider(node: &str, id: &str, kind: ProviderKind) -> ProviderSpec {
    ProviderSpec {
        key: ProviderKey {
            node_id: node.into(),
            provider_id: id.into(),
        },
        adapter: format!("{id}-adapter"),
        target: format!("{id}-target"),
        kind,
        category: "api".into(),
        capacity: 1,
        long_context_capacity: 0,
        response_stall_timeout: Duration::from_secs(120),
        enabled: true,
    }
}

/// A registry knowing both Nodes (config revision 1), 10 s heartbeats and handshake timeout.
pub(crate) fn registry() -> Registry {
    let mut registry = Registry::new(RegistryConfig {
        heartbeat: HeartbeatConfig::from_interval(Duration::from_secs(10)),
        default_node_config: None,
        handshake_timeout: Duration::from_secs(10),
        ..Default::default()
    });
    for n in NODES {
        registry.set_node_config(
            n,
            Some(NodeConfigPayload {
                revision: 1,
                ..Default::default()
            }),
        );
    }
    registry
}

/// Model `m` on `p1` (node-1) and `p2` (node-2), with a queue of `max_queue`.
pub(crate) fn pool(max_queue: usize) -> Pool {
    let providers = vec![
        provider(NODES[0], "p1", ProviderKind::OpenAiCompat),
        provider(NODES[1], "p2", ProviderKind::OpenAiCompat),
    ];
    let models = vec![(
        "m".to_owned(),
        providers.iter().map(|p| p.key.clone()).collect(),
    )];
    Pool::new(PoolConfig {
        providers,
        models,
        max_queue,
    })
}

/// A run request (adapter and target are filled in from the lease on pool dispatch).
pub(crate) fn run_request(run_id: &str) -> RunRequest {
    RunRequest {
        run_id: run_id.into(),
        adapter: "a".into(),
        target: "t".into(),
        input: Bytes::from_static(b"hi"),
        metadata: BTreeMap::new(),
        response_stall_timeout: ResponseStallTimeout::DEFAULT,
        timeout: None,
        long_context: false,
        credential: None,
        trace: None,
    }
}

/// A tunnel request (adapter and target are filled in from the lease on pool dispatch).
pub(crate) fn tunnel_request(run_id: &str) -> ProviderTunnelRequest {
    ProviderTunnelRequest {
        run_id: run_id.into(),
        adapter: "a".into(),
        target: "t".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        headers: vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }],
        body: Bytes::from_static(b"{}"),
        stream: true,
        ..Default::default()
    }
}
