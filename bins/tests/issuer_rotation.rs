//! Lease issuer key rotation, as an operator runs it: `iop-cp serve` (SQLite), one managed
//! `iop-edge` with two `iop-node`s on one model, a keyed fake upstream, the `iop-cp` CLI.
//!
//! - `iop-cp issuer-key rotate --overlap-secs N` stages a new key: leases stay signed with the
//!   old one, and the Edge reports (status `warning`) the Nodes that do not pin the new key.
//! - node-2 is restarted pinning both keys (its warning clears); node-1 is left alone.
//! - `iop-cp issuer-key activate` under a steady load: no request fails. node-1 (old key
//!   only) is no longer selected (status `refused`, `edge_node_issuer_untrusted`); requests
//!   after the switch succeed, and with node-1 out and only the new key signing, each is a
//!   lease node-2 verified with the new key (node-1 never logs "unknown issuer").
//! - node-1 restarted with the new key is selected again; a rotation with a 2 s overlap is
//!   activated by `serve` itself at its time (`cp_issuer_key_activated`), after which neither
//!   Node (neither pins the newest key) is selected.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod support;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use iop_tests::upstream::{Kind, Upstream};
use support::{Proc, TempDir, iop_ca, wait_until};

const KEY: &str = "sk-rotation-upstream-key";
const LIMIT: Duration = Duration::from_secs(30);
const PAGE_TOKEN: &str = "edge-page-token-0123456789";

/// `iop-cp` on `data`; (stdout, stderr).
fn cli(data: &Path, args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_iop-cp"))
        .arg("--data-dir")
        .arg(data)
        .args(args)
        .env("OPENAI_API_KEY", KEY)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "iop-cp {args:?}: {err}");
    (String::from_utf8(out.stdout).unwrap(), err)
}

fn node(dir: &Path, n: u32, edge_port: u16, pins: &[&str]) -> Proc {
    let cfg = support::managed_node_config(dir, &format!("node-{n}"), "edge-1", edge_port, pins);
    Proc::spawn(
        env!("CARGO_BIN_EXE_iop-node"),
        &["--config", cfg.to_str().unwrap()],
        &[],
        dir,
        &format!("node-{n}"),
    )
}

/// node-N's entry in the Control Plane's view of edge-1.
fn status(admin: u16, n: u32) -> serde_json::Value {
    let (code, body) = support::http_get(
        &format!("http://127.0.0.1:{admin}/admin/v1/edges/edge-1/status"),
        &[],
    );
    if code != 200 {
        return serde_json::Value::Null;
    }
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["node_id"] == format!("node-{n}"))
        .cloned()
        .unwrap_or_default()
}

fn text(v: &serde_json::Value, field: &str) -> String {
    v[field].as_str().unwrap_or_default().to_owned()
}

#[test]
fn an_issuer_key_rotation_with_overlap_fails_no_request() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, KEY, "fake-model"));
    let dir = TempDir::new("issuer-rotation");
    let d = dir.path();
    support::pki(d, &["node-1", "node-2"]);
    let ca = d.join("ca");
    iop_ca(&[
        "issue",
        "--dir",
        ca.to_str().unwrap(),
        "--role",
        "control-plane",
        "--name",
        "cp-1",
        "--dns",
        "localhost",
        "--out",
        d.join("cp").to_str().unwrap(),
    ]);
    let data = d.join("cp-data");
    cli(&data, &["init"]);
    cli(
        &data,
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
    cli(&data, &["principal", "create", "team-a"]);
    cli(
        &data,
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
    let (created, _) = cli(&data, &["token", "create", "--principal", "team-a"]);
    let token = created
        .lines()
        .find_map(|l| l.strip_prefix("token: "))
        .unwrap()
        .to_owned();
    let (old_pem, old_err) = cli(&data, &["issuer-key"]);
    std::fs::write(d.join("old.pub.pem"), &old_pem).unwrap();
    let old_id = old_err
        .lines()
        .find_map(|l| l.strip_prefix("key id: "))
        .unwrap()
        .to_owned();

    let (cp_port, admin, nodes, http, page) = (
        support::free_port(),
        support::free_port(),
        support::free_port(),
        support::free_port(),
        support::free_port(),
    );
    std::fs::write(d.join("admin.token"), format!("{PAGE_TOKEN}\n")).unwrap();
    support::set_mode(&d.join("admin.token"), 0o600);
    let dd = d.display();
    let mut cp = Proc::spawn(
        env!("CARGO_BIN_EXE_iop-cp"),
        &[
            "serve",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            &format!("127.0.0.1:{cp_port}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
            "--tls-ca",
            &format!("{dd}/ca/ca.pem"),
            "--tls-cert",
            &format!("{dd}/cp.pem"),
            "--tls-key",
            &format!("{dd}/cp.key"),
            "--trust-domain",
            "iop.test",
            "--credential-plane",
        ],
        &[],
        d,
        "cp",
    );
    let providers: String = (1..=2)
        .map(|n| {
            format!(
                "[[models.providers]]\nnode_id = \"node-{n}\"\nprovider_id = \"upstream-{n}\"\nadapter = \"openai\"\ntarget = \"fake-model\"\ncapacity = 8\n"
            )
        })
        .collect();
    let node_sections: String = (1..=2)
        .map(|n| {
            format!(
                "[[nodes]]\nnode_id = \"node-{n}\"\n[[nodes.adapters]]\nname = \"openai\"\ntype = \"openai_compat\"\nbase_url = \"{}\"\nprofile = \"openai\"\ncapacity = 8\n",
                upstream.base_url()
            )
        })
        .collect();
    std::fs::write(
        d.join("edge.toml"),
        format!(
            r#"edge_id = "edge-1"
[listen]
nodes = "127.0.0.1:{nodes}"
http = "127.0.0.1:{http}"
[admin]
listen = "127.0.0.1:{page}"
token_file = "{dd}/admin.token"
[tls]
trust_domain = "iop.test"
ca = "{dd}/ca/ca.pem"
cert = "{dd}/edge.pem"
key = "{dd}/edge.key"
[control_plane]
address = "127.0.0.1:{cp_port}"
server_name = "localhost"
name = "cp-1"
credential_plane = true
# Generous for a loaded machine (the 1 s default rule is tested exactly, in virtual time, in
# iop-edge/core/tests/binding.rs): a request whose binding went stale waits this long for a
# newer projection or a live session.
stale_binding_wait_ms = 10000
[[models]]
name = "fake-model"
{providers}{node_sections}"#
        ),
    )
    .unwrap();
    let cfg = d.join("edge.toml");
    let mut edge = Proc::spawn(
        env!("CARGO_BIN_EXE_iop-edge"),
        &["--config", cfg.to_str().unwrap()],
        &[],
        d,
        "edge",
    );
    let mut n1 = node(d, 1, nodes, &["old.pub.pem"]);
    let mut n2 = node(d, 2, nodes, &["old.pub.pem"]);
    wait_until("both Nodes to be connected", LIMIT, || {
        status(admin, 1)["connected"] == true && status(admin, 2)["connected"] == true
    });
    assert_eq!(support::chat(http, &token, "hi").0, 200);

    // Stage a new key: a warning for both Nodes, nothing refused.
    let (new_pem, staged_err) = cli(&data, &["issuer-key", "rotate", "--overlap-secs", "3600"]);
    assert!(staged_err.contains("staged issuer key"), "{staged_err}");
    std::fs::write(d.join("new.pub.pem"), &new_pem).unwrap();
    let (list, _) = cli(&data, &["issuer-key", "list"]);
    let new_id = list
        .lines()
        .find_map(|l| l.strip_prefix("staged\t"))
        .and_then(|l| l.split('\t').next())
        .unwrap()
        .to_owned();
    assert_ne!(new_id, old_id);
    let (staged_pem, _) = cli(&data, &["issuer-key", "--staged"]);
    assert_eq!(staged_pem, new_pem);
    wait_until(
        "both Nodes to be warned about the staged key",
        LIMIT,
        || (1..=2).all(|n| text(&status(admin, n), "warning").contains(&new_id)),
    );
    assert_eq!(text(&status(admin, 1), "refused"), "");
    assert_eq!(support::chat(http, &token, "hi").0, 200);
    // The Edge's status page says the same: both keys, and the Nodes warned.
    let mut control = serde_json::Value::Null;
    wait_until("the Edge's page to show the staged key", LIMIT, || {
        let (code, body) = support::http_get(
            &format!("http://127.0.0.1:{page}/api/status"),
            &[("authorization", &format!("Bearer {PAGE_TOKEN}"))],
        );
        control =
            serde_json::from_str::<serde_json::Value>(&body).unwrap_or_default()["control"].clone();
        code == 200 && control["issuer_staged"][0] == new_id.as_str()
    });
    assert_eq!(control["state"], "connected", "{control}");
    assert_eq!(control["managed"], true, "{control}");
    assert_eq!(control["issuer_active"], old_id.as_str(), "{control}");
    assert!(
        control["issuer_staged"][1].as_i64().unwrap() > 0,
        "{control}"
    );
    assert_eq!(
        control["warned_nodes"],
        serde_json::json!(["node-1", "node-2"]),
        "{control}"
    );
    assert!(
        control["projection_generation"].as_u64().unwrap() >= 1,
        "{control}"
    );

    // node-2 pins both keys.
    assert_eq!(n2.stop(), Some(0), "{}", n2.log_text());
    let n2b = node(d, 2, nodes, &["old.pub.pem", "new.pub.pem"]);
    wait_until("node-2 back, trusting the staged key", LIMIT, || {
        let s = status(admin, 2);
        s["connected"] == true && text(&s, "warning").is_empty()
    });

    // Activation under a steady load: nothing fails.
    let stop = Arc::new(AtomicBool::new(false));
    let load = support::steady(http, token.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(500));
    let (activated, _) = cli(&data, &["issuer-key", "activate"]);
    assert!(activated.contains(&new_id), "{activated}");
    wait_until("node-1 to be refused for the new key", LIMIT, || {
        let r = text(&status(admin, 1), "refused");
        r.contains("issuer key not trusted") && r.contains(&new_id)
    });
    // From here on the Control Plane signs only with the new key and node-1 is not selected:
    // each of these is a lease node-2 verified with the new key.
    for i in 0..5 {
        assert_eq!(
            support::chat(http, &token, "after the switch").0,
            200,
            "request {i} after the switch"
        );
    }
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    let results = load.join().unwrap();
    let failed: Vec<&(u16, String)> = results.iter().filter(|(s, _)| *s != 200).collect();
    println!(
        "activation under load: {} requests, {} failed",
        results.len(),
        failed.len()
    );
    assert!(results.len() >= 20, "the load ran: {}", results.len());
    assert!(
        failed.is_empty(),
        "failed across the activation: {failed:?}"
    );
    assert!(
        edge.log_text().contains("edge_node_issuer_untrusted"),
        "{}",
        edge.log_text()
    );
    assert!(
        !n1.log_text().contains("unknown issuer"),
        "node-1 was sent a lease it cannot verify:\n{}",
        n1.log_text()
    );
    let (list, _) = cli(&data, &["issuer-key", "list"]);
    assert!(
        list.starts_with(&format!("active\t{new_id}\t")) && list.lines().count() == 1,
        "the old key is gone: {list}"
    );

    // node-1 with the new key is selected again.
    assert_eq!(n1.stop(), Some(0), "{}", n1.log_text());
    let n1b = node(d, 1, nodes, &["new.pub.pem"]);
    wait_until("node-1 back and selectable", LIMIT, || {
        let s = status(admin, 1);
        s["connected"] == true && text(&s, "refused").is_empty()
    });

    // A short overlap: `serve` activates the key itself; then neither Node trusts it.
    let (_, err) = cli(&data, &["issuer-key", "rotate", "--overlap-secs", "2"]);
    assert!(err.contains("staged issuer key"), "{err}");
    wait_until("serve to activate the staged key", LIMIT, || {
        cp.log_text().contains("cp_issuer_key_activated")
    });
    wait_until("neither Node to be selected", LIMIT, || {
        (1..=2).all(|n| text(&status(admin, n), "refused").contains("issuer key not trusted"))
    });
    for mut p in [n1b, n2b] {
        assert_eq!(p.stop(), Some(0), "{}", p.log_text());
    }
    assert_eq!(edge.stop(), Some(0), "{}", edge.log_text());
    assert_eq!(cp.stop(), Some(0), "{}", cp.log_text());
    for s in upstream.seen() {
        assert_eq!(
            s.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
    }
}
