//! Several Edges on replicated Control Planes, as processes: two `iop-cp serve` replicas on one
//! PostgreSQL database (`IOP_TEST_PG_URL`, provided by `scripts/test-all.sh`; a schema of its
//! own), two `iop-edge` processes each owning its own `iop-node`, both Edges given both
//! replicas (`[control_plane] addresses`, in opposite orders), a keyed fake upstream.
//!
//! - A mutation made through either replica (the CLI on replica B's data directory) reaches
//!   both Edges: a token created there is accepted by both.
//! - `kill -9` of replica A while clients run at a steady rate through both Edges: the Edge
//!   that was connected to A fails over to B, and no request fails (a lease that found no
//!   session waits for the failover, `iop_edge_core::binding::BindingConfig::stale_wait`).
//! - After the kill, a mutation through B still reaches both Edges.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod support;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use iop_tests::upstream::{Kind, Upstream};
use support::{Proc, TempDir, iop_ca, wait_until};

const KEY: &str = "sk-replicas-upstream-key";
const LIMIT: Duration = Duration::from_secs(30);

fn pg_url() -> String {
    std::env::var("IOP_TEST_PG_URL").expect(
        "IOP_TEST_PG_URL is not set: run scripts/test-all.sh (it creates a PostgreSQL database \
         for the run), or set it to postgres://USER@127.0.0.1:5432/DB",
    )
}

/// `iop-cp` with the shared database, `data` as its data directory; stdout.
fn cli(data: &Path, schema: &str, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_iop-cp"))
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .args(["--postgres", &pg_url(), "--postgres-schema", schema])
        .env("OPENAI_API_KEY", KEY)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "iop-cp {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The `prefix` line of `token create`'s output (`token: `, `token_id: `).
fn field(out: &str, prefix: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap()
        .to_owned()
}

fn chat(port: u16, token: &str) -> u16 {
    support::chat(port, token, "hi").0
}

/// [`support::steady`], statuses only.
fn steady(port: u16, token: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Vec<u16>> {
    let load = support::steady(port, token, stop);
    std::thread::spawn(move || load.join().unwrap().into_iter().map(|(s, _)| s).collect())
}

fn serve(dir: &Path, name: &str, data: &Path, schema: &str, port: u16) -> Proc {
    let d = dir.display();
    let p = Proc::spawn(
        env!("CARGO_BIN_EXE_iop-cp"),
        &[
            "serve",
            "--data-dir",
            data.to_str().unwrap(),
            "--postgres",
            &pg_url(),
            "--postgres-schema",
            schema,
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin-listen",
            "127.0.0.1:0",
            "--tls-ca",
            &format!("{d}/ca/ca.pem"),
            "--tls-cert",
            &format!("{d}/cp.pem"),
            "--tls-key",
            &format!("{d}/cp.key"),
            "--trust-domain",
            "iop.test",
            "--credential-plane",
        ],
        &[],
        dir,
        name,
    );
    wait_until(&format!("{name} to serve"), LIMIT, || {
        p.log_text().contains("admin API on")
    });
    p
}

/// `edge-N.toml`: managed, both replicas in `order`, one Node `node-N`; returns the HTTP port.
fn edge(dir: &Path, n: u32, cps: [u16; 2], upstream: &str) -> (u16, u16) {
    let (nodes, http) = (support::free_port(), support::free_port());
    let d = dir.display();
    std::fs::write(
        dir.join(format!("edge-{n}.toml")),
        format!(
            r#"edge_id = "edge-{n}"
[listen]
nodes = "127.0.0.1:{nodes}"
http = "127.0.0.1:{http}"
[tls]
trust_domain = "iop.test"
ca = "{d}/ca/ca.pem"
cert = "{d}/edge-{n}.pem"
key = "{d}/edge-{n}.key"
[control_plane]
addresses = ["127.0.0.1:{a}", "127.0.0.1:{b}"]
server_name = "localhost"
name = "cp-1"
credential_plane = true
# Generous for a loaded machine (the 1 s default rule is tested exactly, in virtual time, in
# iop-edge/core/tests/binding.rs): a request whose binding went stale waits this long for a
# newer projection or a live session.
stale_binding_wait_ms = 10000
[[models]]
name = "fake-model"
[[models.providers]]
node_id = "node-{n}"
provider_id = "upstream-{n}"
adapter = "openai"
target = "fake-model"
capacity = 8
[[nodes]]
node_id = "node-{n}"
[[nodes.adapters]]
name = "openai"
type = "openai_compat"
base_url = "{upstream}"
profile = "openai"
capacity = 8
"#,
            a = cps[0],
            b = cps[1],
        ),
    )
    .unwrap();
    support::managed_node_config(
        dir,
        &format!("node-{n}"),
        &format!("edge-{n}"),
        nodes,
        &["cp-issuer.pub.pem"],
    );
    (nodes, http)
}

#[test]
fn two_edges_on_two_control_plane_replicas_survive_a_replica_killed() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, KEY, "fake-model"));
    let dir = TempDir::new("cp-replicas");
    let d = dir.path();
    let schema = format!("replicas_{}", std::process::id());
    let ca = d.join("ca");
    let ca = ca.to_str().unwrap();
    iop_ca(&["init", "--dir", ca, "--trust-domain", "iop.test"]);
    let out = |name: &str| d.join(name).to_str().unwrap().to_owned();
    // One Control Plane identity, presented by both replicas.
    iop_ca(&[
        "issue",
        "--dir",
        ca,
        "--role",
        "control-plane",
        "--name",
        "cp-1",
        "--dns",
        "localhost",
        "--out",
        &out("cp"),
    ]);
    for n in ["edge-1", "edge-2"] {
        iop_ca(&[
            "issue",
            "--dir",
            ca,
            "--role",
            "edge",
            "--name",
            n,
            "--dns",
            "localhost",
            "--out",
            &out(n),
        ]);
    }
    for n in ["node-1", "node-2"] {
        iop_ca(&[
            "issue",
            "--dir",
            ca,
            "--role",
            "node",
            "--name",
            n,
            "--out",
            &out(n),
        ]);
    }

    // Replica A's data directory creates the keys; replica B gets a copy of the master key.
    let (data_a, data_b) = (d.join("cp-a"), d.join("cp-b"));
    cli(&data_a, &schema, &["init"]);
    cli(
        &data_a,
        &schema,
        &[
            "slot",
            "put",
            "openai-prod",
            "--profile",
            "openai",
            "--credential-env",
            "OPENAI_API_KEY",
        ],
    );
    cli(&data_a, &schema, &["principal", "create", "team-a"]);
    cli(
        &data_a,
        &schema,
        &[
            "route",
            "put",
            "r1",
            "--principal",
            "team-a",
            "--model",
            "fake-model",
            "--slot",
            "openai-prod",
            "--target",
            "fake-model",
        ],
    );
    let created = cli(
        &data_a,
        &schema,
        &["token", "create", "--principal", "team-a"],
    );
    let (token, token_id) = (field(&created, "token: "), field(&created, "token_id: "));
    std::fs::create_dir_all(&data_b).unwrap();
    // Without the first replica's keys, a second one refuses to start on a store with slots.
    let refused = Command::new(env!("CARGO_BIN_EXE_iop-cp"))
        .args([
            "serve",
            "--data-dir",
            data_b.to_str().unwrap(),
            "--postgres",
            &pg_url(),
            "--postgres-schema",
            &schema,
        ])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("copy master.key"),
        "{refused:?}"
    );
    // The master key is all a replica copies: the issuer key is in the store, sealed with it.
    std::fs::copy(data_a.join("master.key"), data_b.join("master.key")).unwrap();
    support::set_mode(&data_b.join("master.key"), 0o600);
    let issuer = Command::new(env!("CARGO_BIN_EXE_iop-cp"))
        .args([
            "issuer-key",
            "--data-dir",
            data_a.to_str().unwrap(),
            "--postgres",
            &pg_url(),
            "--postgres-schema",
            &schema,
        ])
        .output()
        .unwrap();
    std::fs::write(d.join("cp-issuer.pub.pem"), &issuer.stdout).unwrap();

    let (port_a, port_b) = (support::free_port(), support::free_port());
    let mut cp_a = serve(d, "cp-a", &data_a, &schema, port_a);
    let mut cp_b = serve(d, "cp-b", &data_b, &schema, port_b);
    let url = upstream.base_url();
    let (_, http1) = edge(d, 1, [port_a, port_b], &url);
    let (_, http2) = edge(d, 2, [port_b, port_a], &url);
    let mut procs = Vec::new();
    for n in 1..=2 {
        let cfg = d.join(format!("edge-{n}.toml"));
        procs.push(Proc::spawn(
            env!("CARGO_BIN_EXE_iop-edge"),
            &["--config", cfg.to_str().unwrap()],
            &[],
            d,
            &format!("edge-{n}"),
        ));
    }
    for n in 1..=2 {
        let cfg = d.join(format!("node-{n}.toml"));
        procs.push(Proc::spawn(
            env!("CARGO_BIN_EXE_iop-node"),
            &["--config", cfg.to_str().unwrap()],
            &[],
            d,
            &format!("node-{n}"),
        ));
    }
    for http in [http1, http2] {
        wait_until("each Edge to serve team A", LIMIT, || {
            chat(http, &token) == 200
        });
    }

    // A mutation through replica B reaches both Edges (edge-1 is connected to A).
    let token_b = field(
        &cli(
            &data_b,
            &schema,
            &["token", "create", "--principal", "team-a"],
        ),
        "token: ",
    );
    for http in [http1, http2] {
        wait_until("the token made through B to work", LIMIT, || {
            chat(http, &token_b) == 200
        });
    }

    // kill -9 replica A under steady load through both Edges.
    let stop = Arc::new(AtomicBool::new(false));
    let loads = [
        steady(http1, token.clone(), stop.clone()),
        steady(http2, token.clone(), stop.clone()),
    ];
    std::thread::sleep(Duration::from_millis(500));
    cp_a.child.kill().unwrap();
    cp_a.child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(2000));
    stop.store(true, Ordering::Relaxed);
    let results: Vec<Vec<u16>> = loads.into_iter().map(|h| h.join().unwrap()).collect();
    for (i, r) in results.iter().enumerate() {
        let failed: Vec<&u16> = r.iter().filter(|s| **s != 200).collect();
        println!(
            "edge-{}: {} requests across the kill, {} failed",
            i + 1,
            r.len(),
            failed.len()
        );
        assert!(r.len() >= 40, "the load ran: {}", r.len());
        assert!(failed.is_empty(), "edge-{} failed: {failed:?}", i + 1);
    }
    assert!(
        procs[0].log_text().contains("edge_control_failover"),
        "edge-1 failed over:\n{}",
        procs[0].log_text()
    );

    // After the kill, a mutation through B still reaches both Edges: team A's first token,
    // revoked there, is refused by both; the token made through B still works.
    cli(&data_b, &schema, &["token", "revoke", &token_id]);
    for http in [http1, http2] {
        wait_until("the revoked token to be refused", LIMIT, || {
            chat(http, &token) == 401
        });
        assert_eq!(chat(http, &token_b), 200);
    }
    for p in procs.iter_mut().rev() {
        assert_eq!(p.stop(), Some(0), "{}", p.log_text());
    }
    assert_eq!(cp_b.stop(), Some(0), "{}", cp_b.log_text());
    for p in procs.iter().chain([&cp_a, &cp_b]) {
        assert!(!p.log_text().contains(KEY), "a log holds the upstream key");
    }
    for s in upstream.seen() {
        assert_eq!(
            s.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
    }
}
