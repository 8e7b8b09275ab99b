//! Dispatch through the Edge's provider pool over real mTLS: two Nodes in one model group, one
//! killed mid-load. No accepted request is lost, every lease is released exactly once, and the
//! survivor takes the queue.
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use iop_edge::pool::ContextSize;
use std::time::Duration;

use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{Dispatched, EdgeHandle, Lifecycle, PoolRequest, TransportConfig, bind};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::Ca;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, NativeSettings, NodeConfigPayload, RunEventKind, RunRequest,
};
use iop_wire::validate::ResponseStallTimeout;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(60);

/// A demo adapter of capacity 2 that waits `delay_ms` before each of its 45 words.
fn demo_node_config(delay_ms: u32) -> NodeConfigPayload {
    NodeConfigPayload {
        adapters: vec![AdapterConfig {
            name: "demo-a".into(),
            adapter_type: "demo".into(),
            enabled: true,
            capacity: 2,
            long_context_capacity: 0,
            targets: vec!["demo-model".into()],
            settings: AdapterSettings::Native(NativeSettings {
                base_url: String::new(),
                options: [
                    ("delay_ms".to_owned(), delay_ms.to_string()),
                    ("repeat".to_owned(), "15".to_owned()),
                ]
                .into_iter()
                .collect(),
            }),
        }],
        ..Default::default()
    }
}

fn provider(node: &str) -> ProviderSpec {
    ProviderSpec {
        key: ProviderKey {
            node_id: node.into(),
            provider_id: format!("{node}-demo"),
        },
        adapter: "demo-a".into(),
        target: "demo-model".into(),
        kind: ProviderKind::Native,
        category: "local_inference".into(),
        capacity: 2,
        long_context_capacity: 0,
        response_stall_timeout: Duration::from_secs(60),
        enabled: true,
    }
}

fn start_node(ca: &Ca, edge: &EdgeHandle, name: &str) -> CancellationToken {
    let tls = iop_tests::pki::node_client_tls(ca, role::NODE, name, "edge-1");
    let opts = NodeOptions::new(name, &edge.local_addr().to_string(), "localhost", tls)
        .unwrap()
        .with_adapters(AdapterRegistry::with_builtins());
    let stop = CancellationToken::new();
    tokio::spawn(run_node(opts, stop.clone()));
    stop
}

fn build(i: usize) -> PoolRequest {
    {
        PoolRequest::Run(RunRequest {
            run_id: format!("p-{i}"),
            adapter: String::new(), // filled from the lease
            target: String::new(),
            input: bytes::Bytes::from(format!("req {i}")),
            metadata: Default::default(),
            response_stall_timeout: ResponseStallTimeout::DEFAULT,
            timeout: None,
            long_context: false,
            credential: None,
            trace: None,
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_node_mid_load_loses_no_queued_request_and_releases_every_lease() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let mut cfg = TransportConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            iop_tests::pki::edge_server_tls(&ca, "edge-1"),
        );
        // node-1's runs cannot finish within the test (a minute per word), so the two it holds
        // are still running when it is killed whatever the machine's speed; node-2's take about
        // 0.9 s each, so the two queued requests stay queued until the kill.
        cfg.node_configs = vec![
            ("node-1".into(), demo_node_config(60_000)),
            ("node-2".into(), demo_node_config(20)),
        ];
        cfg.pool = Some(PoolConfig {
            providers: vec![provider("node-1"), provider("node-2")],
            models: vec![(
                "m".into(),
                vec![provider("node-1").key, provider("node-2").key],
            )],
            max_queue: 16,
        });
        let edge = bind(cfg).await.unwrap().0;
        let mut life = edge.subscribe();
        // Before any Node: configured providers are offline with zero figures.
        let snap = edge.snapshot();
        assert!(
            snap.iter()
                .all(|s| s.health == "offline" && s.capacity == 0)
        );
        let stop1 = start_node(&ca, &edge, "node-1");
        let _stop2 = start_node(&ca, &edge, "node-2");
        let mut ready = 0;
        while ready < 2 {
            if let Lifecycle::Connected { .. } = life.recv().await.unwrap() {
                ready += 1;
            }
        }

        // Six requests for four slots: four dispatched, two queued.
        let mut tasks = Vec::new();
        for i in 0..6 {
            let edge = edge.clone();
            tasks.push(tokio::spawn(async move {
                // Admission and sending are two steps: a request admitted on node-1 but not yet
                // sent when node-1 is fenced ends at dispatch with `Disconnected` (its lease is
                // gone), the same outcome as a run cut by the disconnect.
                let dispatched = edge
                    .dispatch(
                        "m",
                        ContextSize::Standard,
                        Duration::from_secs(30),
                        build(i),
                    )
                    .await;
                let Dispatched::Run(mut s) = (match dispatched {
                    Err(iop_edge::transport::DispatchError::Disconnected) => return None,
                    other => other.unwrap(),
                }) else {
                    panic!("native providers get runs")
                };
                let mut last = None;
                while let Some(ev) = s.next().await {
                    last = Some(ev);
                }
                Some(last.expect("a terminal"))
            }));
        }
        // Wait until the load is in place, then kill node-1 mid-stream.
        loop {
            let snap = edge.snapshot();
            let in_flight: u32 = snap.iter().map(|s| s.in_flight).sum();
            let queued: u32 = snap.iter().map(|s| s.queued).max().unwrap();
            if in_flight == 4 && queued == 2 {
                // Candidate pressure: both waiters count on both live providers.
                assert!(snap.iter().all(|s| s.queued == 2));
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop1.cancel();

        let mut disconnected = 0;
        let mut completed = 0;
        for t in tasks {
            let Some(last) = t.await.unwrap() else {
                disconnected += 1;
                continue;
            };
            match last.kind {
                RunEventKind::Complete => completed += 1,
                RunEventKind::Error => {
                    assert_eq!(last.error, iop_edge::transport::NODE_DISCONNECTED);
                    disconnected += 1;
                }
                other => panic!("unexpected terminal {other:?}"),
            }
        }
        // The two running on node-1 ended with one terminal each; the two queued ones were not
        // lost: the survivor served them.
        assert_eq!((disconnected, completed), (2, 4));
        let snap = edge.snapshot();
        let n1 = snap.iter().find(|s| s.node_id == "node-1").unwrap();
        let n2 = snap.iter().find(|s| s.node_id == "node-2").unwrap();
        assert_eq!(
            (
                n1.health.as_str(),
                n1.status.as_str(),
                n1.capacity,
                n1.in_flight
            ),
            ("offline", "unavailable", 0, 0)
        );
        assert_eq!(
            (n2.health.as_str(), n2.capacity, n2.in_flight, n2.queued),
            ("healthy", 2, 0, 0),
            "every lease released"
        );
    })
    .await
    .expect("scenario finishes");
}
