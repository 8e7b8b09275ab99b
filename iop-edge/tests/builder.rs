//! `iop_edge::builder`: the typed tree builds the same Edge as the equivalent TOML file (Node
//! payloads, providers, models, HTTP models, limits), derives provider ids and targets as its
//! docs say, and its errors name the file's keys.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::sync::Arc;
use std::time::Duration;

use iop_edge::builder::{AdapterSpec, ControlPlaneSpec, EdgeBuilder, EdgeTls, ModelSpec, NodeSpec};
use iop_edge::config::{ConfigError, EdgeConfig, EdgeConfigFile, Limits};
use workload_identity::WorkloadTls;
use workload_identity::dev_ca::DevCa;

fn material() -> (DevCa, Arc<WorkloadTls>) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = DevCa::new().unwrap();
    let tls = ca.material("edge", "edge-1").unwrap();
    (ca, tls)
}

/// What the Edge runs with, minus the TLS objects (which hold keys and compare by pointer).
fn parts(c: &EdgeConfig) -> String {
    format!(
        "{:?}\n{:?}\n{:?}\n{:?}\n{:?} {:?} {:?} {:?}\n{:?}",
        c.transport.node_configs,
        c.transport.pool,
        c.http.models,
        c.http.queue_wait,
        c.transport.max_stream_buffer,
        c.transport.max_unauthenticated_per_ip,
        c.serve.max_connections,
        c.serve.header_timeout,
        c.control
            .as_ref()
            .map(|c| (&c.addresses, c.managed, c.binding.stale_wait)),
    )
}

const TOML: &str = r#"
edge_id = "edge-1"
[listen]
nodes = "127.0.0.1:0"
http = "127.0.0.1:3000"
[tls]
trust_domain = "iop.local"
[pool]
queue_wait_sec = 10
max_queue = 64
[limits]
http_max_connections = 256
max_unauthenticated_per_ip = 4
[[nodes]]
node_id = "node-1"
[[nodes.adapters]]
name = "openai"
type = "openai_compat"
base_url = "https://api.openai.com/v1"
profile = "openai"
capacity = 8
long_context_capacity = 8
targets = ["gpt-4o-mini", "gpt-4o-2024-08-06"]
[[nodes]]
node_id = "node-2"
[[nodes.adapters]]
name = "demo"
type = "demo"
capacity = 2
long_context_capacity = 2
targets = ["gpt-4o-mini"]
options = { delay_ms = "5" }
[[models]]
name = "gpt-4o-mini"
[[models.providers]]
node_id = "node-1"
provider_id = "openai:gpt-4o-mini"
adapter = "openai"
target = "gpt-4o-mini"
capacity = 8
long_context_capacity = 8
[[models.providers]]
node_id = "node-2"
provider_id = "demo"
adapter = "demo"
target = "gpt-4o-mini"
capacity = 2
long_context_capacity = 2
response_stall_timeout_sec = 60
[[models]]
name = "gpt-4o"
[[models.providers]]
node_id = "node-1"
provider_id = "openai:gpt-4o"
adapter = "openai"
target = "gpt-4o-2024-08-06"
capacity = 3
long_context_capacity = 8
[control_plane]
addresses = ["127.0.0.1:7600", "127.0.0.1:7601"]
server_name = "localhost"
name = "cp-1"
credential_plane = true
stale_binding_wait_ms = 5000
"#;

fn builder() -> EdgeBuilder {
    EdgeBuilder::new("edge-1")
        .listen_nodes("127.0.0.1:0".parse().unwrap())
        .listen_http("127.0.0.1:3000".parse().unwrap())
        .queue(Duration::from_secs(10), 64)
        .limits(Limits {
            http_max_connections: 256,
            max_unauthenticated_per_ip: 4,
            ..Limits::default()
        })
        .node(
            NodeSpec::new("node-1").adapter(
                AdapterSpec::openai_compat("openai", "https://api.openai.com/v1")
                    .profile("openai")
                    .capacity(8)
                    .serves("gpt-4o-mini")
                    .serves(
                        ModelSpec::new("gpt-4o")
                            .target("gpt-4o-2024-08-06")
                            .capacity(3),
                    ),
            ),
        )
        .node(
            NodeSpec::new("node-2").adapter(
                AdapterSpec::demo("demo")
                    .option("delay_ms", "5")
                    .capacity(2)
                    .serves(
                        ModelSpec::new("gpt-4o-mini")
                            .response_stall_timeout(Duration::from_secs(60)),
                    ),
            ),
        )
        .control_plane(
            ControlPlaneSpec::new(["127.0.0.1:7600", "127.0.0.1:7601"], "localhost", "cp-1")
                .managed()
                .stale_binding_wait(Duration::from_secs(5)),
        )
}

#[test]
fn the_tree_builds_what_the_file_builds() {
    let (_ca, tls) = material();
    let from_file = EdgeConfigFile::parse(TOML)
        .unwrap()
        .build_with_tls(tls.clone())
        .unwrap();
    let from_code = builder().build(EdgeTls::Material(tls)).unwrap();
    assert_eq!(parts(&from_code), parts(&from_file));
    // The derived parts, spelled out: one model served by two Nodes in declaration order, an
    // adapter serving two models gets `<adapter>:<model>` ids, its target list is derived.
    let pool = from_code.transport.pool.as_ref().unwrap();
    let ids = |model: &str| -> Vec<String> {
        pool.models
            .iter()
            .find(|(m, _)| m == model)
            .unwrap()
            .1
            .iter()
            .map(|k| format!("{}/{}", k.node_id, k.provider_id))
            .collect()
    };
    assert_eq!(
        ids("gpt-4o-mini"),
        ["node-1/openai:gpt-4o-mini", "node-2/demo"]
    );
    assert_eq!(ids("gpt-4o"), ["node-1/openai:gpt-4o"]);
    assert_eq!(
        from_code.transport.node_configs[0].1.adapters[0].targets,
        ["gpt-4o-mini", "gpt-4o-2024-08-06"]
    );
    assert_eq!(from_code.http.models, ["gpt-4o-mini", "gpt-4o"]);
    assert!(
        from_code.tls_files.is_none(),
        "material in code is not reloaded"
    );
}

#[test]
fn pem_bytes_and_files_are_tls_sources_too() {
    let (ca, _) = material();
    let (cert, key) = ca.issue_pem("edge", "edge-1").unwrap();
    let pem = EdgeTls::Pem {
        ca: ca.ca_pem().as_bytes().to_vec(),
        cert: cert.clone().into_bytes(),
        key: key.clone().into_bytes(),
    };
    let simple = || {
        EdgeBuilder::new("edge-1")
            .node(NodeSpec::new("n").adapter(AdapterSpec::demo("demo").serves("demo")))
    };
    let c = simple().build(pem).unwrap();
    assert!(c.tls_files.is_none());
    assert_eq!(c.tls.identity().as_str(), "spiffe://iop.local/edge/edge-1");

    let dir = std::env::temp_dir().join(format!("iop-edge-builder-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.ca_pem()).unwrap();
    std::fs::write(dir.join("edge.pem"), &cert).unwrap();
    std::fs::write(dir.join("edge.key"), &key).unwrap();
    let files = EdgeTls::Files {
        ca: dir.join("ca.pem"),
        cert: dir.join("edge.pem"),
        key: dir.join("edge.key"),
        reload: Some(Duration::from_secs(5)),
    };
    let c = simple().build(files).unwrap();
    let tls_files = c.tls_files.expect("files are reloaded");
    assert_eq!(tls_files.reload, Some(Duration::from_secs(5)));
    assert_eq!(tls_files.paths.cert, dir.join("edge.pem"));
    // A missing file names its key.
    let e = simple()
        .build(EdgeTls::Files {
            ca: dir.join("ca.pem"),
            cert: dir.join("missing.pem"),
            key: dir.join("edge.key"),
            reload: None,
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::Invalid {
                key: "tls.cert",
                ..
            }
        ),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn errors_name_the_files_keys() {
    let (ca, tls) = material();
    let key = |b: EdgeBuilder, tls: Arc<WorkloadTls>| match b.build(EdgeTls::Material(tls)) {
        Err(ConfigError::Invalid { key, .. }) => key,
        other => panic!("{other:?}"),
    };
    let one = |a: AdapterSpec| EdgeBuilder::new("edge-1").node(NodeSpec::new("n").adapter(a));
    assert_eq!(
        key(
            one(AdapterSpec::openai_compat("o", "http://x")
                .profile("nope")
                .serves("m")),
            tls.clone()
        ),
        "nodes.adapters.profile"
    );
    assert_eq!(
        key(
            one(AdapterSpec::openai_compat("o", "").serves("m")),
            tls.clone()
        ),
        "nodes.adapters.base_url"
    );
    assert_eq!(
        key(
            one(AdapterSpec::demo("d").profile("openai").serves("m")),
            tls.clone()
        ),
        "nodes.adapters.profile"
    );
    // The certificate names another Edge.
    assert_eq!(key(EdgeBuilder::new("edge-2"), tls.clone()), "tls.cert");
    // Gateway keys and managed mode exclude each other.
    let managed = EdgeBuilder::new("edge-1")
        .api_keys(iop_edge::http::ApiKeys::new(&["k".to_owned()]))
        .control_plane(ControlPlaneSpec::new(["127.0.0.1:1"], "localhost", "cp").managed());
    assert_eq!(key(managed, tls.clone()), "auth");
    let wait = EdgeBuilder::new("edge-1").control_plane(
        ControlPlaneSpec::new(["127.0.0.1:1"], "localhost", "cp")
            .stale_binding_wait(Duration::from_secs(61)),
    );
    assert_eq!(key(wait, tls), "control_plane.stale_binding_wait_ms");
    drop(ca);
}
