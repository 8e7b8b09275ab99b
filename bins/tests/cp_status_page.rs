//! `iop-cp`'s status page (issue #31) against the real binary, in a real browser (Playwright
//! driving Debian's chromium, `bins/tests/python/cp_status_page.py`): a managed `iop-edge`
//! connected to it shows with the projection generation it acknowledged; a token created and
//! a slot rotated by the CLI show on the page (the rotation while it is open, without a
//! reload, with the time it was put, and the Edge catching up with the new generation);
//! an unauthenticated request gets `401` and no page; no console error; the CSP header is
//! there; no response of the page carries a secret (the slot credentials, the raw token, the
//! admin token). Screenshots at 1280×800 and 390×844 under
//! `target/tmp/status-page-screenshots/`.

#![allow(clippy::unwrap_used, reason = "tests")]

mod support;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncBufReadExt as _;

const ADMIN_TOKEN: &str = "cp-admin-token-0123456789";
const SECRET: &str = "sk-live-cp-page-secret-0123";

fn cli(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_iop-cp"));
    cmd.arg("--data-dir").arg(dir).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "iop-cp {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_planes_status_page_in_a_real_browser() {
    assert!(
        std::process::Command::new("python3")
            .args(["-c", "import playwright.sync_api"])
            .status()
            .is_ok_and(|s| s.success())
            && Path::new("/usr/bin/chromium").exists(),
        "Playwright (python3 -m pip install playwright) and Debian's chromium (apt-get install \
         chromium) are required (scripts/test-all.sh installs both)"
    );
    let dir = std::env::temp_dir().join(format!("iop-cp-status-page-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("data");
    cli(&data, &["init"], &[]);
    cli(
        &data,
        &["principal", "create", "team-a", "--name", "Team A"],
        &[],
    );
    let out = cli(&data, &["token", "create", "--principal", "team-a"], &[]);
    let token = out
        .lines()
        .find_map(|l| l.strip_prefix("token: "))
        .unwrap()
        .to_owned();
    let token_id = out
        .lines()
        .find_map(|l| l.strip_prefix("token_id: "))
        .unwrap()
        .to_owned();
    cli(
        &data,
        &[
            "slot",
            "put",
            "openai-prod",
            "--profile",
            "openai",
            "--credential-env",
            "THE_SECRET",
        ],
        &[("THE_SECRET", SECRET)],
    );
    cli(
        &data,
        &[
            "route",
            "put",
            "r1",
            "--principal",
            "team-a",
            "--model",
            "m",
            "--slot",
            "openai-prod",
            "--target",
            "m",
        ],
        &[],
    );

    support::pki(&dir, &["node-1"]);
    support::iop_ca(&[
        "issue",
        "--dir",
        dir.join("ca").to_str().unwrap(),
        "--role",
        "control-plane",
        "--name",
        "cp-1",
        "--dns",
        "localhost",
        "--out",
        dir.join("cp").to_str().unwrap(),
    ]);
    let (ca_pem, cert, key) = (
        dir.join("ca/ca.pem"),
        dir.join("cp.pem"),
        dir.join("cp.key"),
    );
    let cp_port = support::free_port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-cp"))
        .arg("--data-dir")
        .arg(&data)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{cp_port}"),
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--tls-ca")
        .arg(&ca_pem)
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .args(["--trust-domain", "iop.test", "--credential-plane"])
        .env("IOP_CP_ADMIN_TOKEN", ADMIN_TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let page = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("iop-cp prints its page");
            if let Some(rest) = line.strip_prefix("iop-cp: status page on ") {
                return rest.split(' ').next().unwrap().to_owned();
            }
        }
    })
    .await
    .unwrap();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    // A managed Edge connected to it (no Node is needed for the page).
    let d = dir.display();
    std::fs::write(
        dir.join("edge.toml"),
        format!(
            r#"edge_id = "edge-1"
[listen]
nodes = "127.0.0.1:{nodes}"
http = "127.0.0.1:{http}"
[tls]
trust_domain = "iop.test"
ca = "{d}/ca/ca.pem"
cert = "{d}/edge.pem"
key = "{d}/edge.key"
[control_plane]
address = "127.0.0.1:{cp_port}"
server_name = "localhost"
name = "cp-1"
credential_plane = true
[[models]]
name = "m"
[[models.providers]]
node_id = "node-1"
provider_id = "upstream-1"
adapter = "upstream"
target = "m"
capacity = 4
[[nodes]]
node_id = "node-1"
[[nodes.adapters]]
name = "upstream"
type = "openai_compat"
base_url = "http://127.0.0.1:9/v1"
profile = "openai"
capacity = 4
"#,
            nodes = support::free_port(),
            http = support::free_port(),
        ),
    )
    .unwrap();
    let edge = support::Proc::spawn(
        env!("CARGO_BIN_EXE_iop-edge"),
        &["--config", dir.join("edge.toml").to_str().unwrap()],
        &[],
        &dir,
        "edge",
    );

    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/cp_status_page.py"
    );
    let args: Vec<String> = vec![
        script.into(),
        page.clone(),
        ADMIN_TOKEN.into(),
        env!("CARGO_BIN_EXE_iop-cp").into(),
        data.display().to_string(),
        token_id.clone(),
        shots.display().to_string(),
    ];
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .args(&args)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}\nthe Edge's log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        edge.log_text()
    );
    println!("iop-cp status page: {}", stdout.lines().last().unwrap());

    // No secret in any response of the page.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let mut bodies = Vec::new();
    for path in ["", "app.js", "page.css", "common.js", "api/status"] {
        let r = client
            .get(format!("{page}{path}"))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert!(r.headers().contains_key("content-security-policy"));
        bodies.push(r.text().await.unwrap());
        let anonymous = client.get(format!("{page}{path}")).send().await.unwrap();
        assert_eq!(anonymous.status(), 401, "{path}");
    }
    let status: serde_json::Value = serde_json::from_str(&bodies[4]).unwrap();
    assert!(
        status["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["id"] == token_id.as_str()),
        "{status}"
    );
    for body in &bodies {
        for secret in [
            SECRET,
            "sk-rotated-cp-page-secret-0123",
            &token,
            ADMIN_TOKEN,
        ] {
            assert!(!body.contains(secret), "a secret in a response");
        }
    }
    for name in ["cp-1280x800.png", "cp-390x844.png"] {
        assert!(
            std::fs::read(shots.join(name))
                .unwrap()
                .starts_with(b"\x89PNG")
        );
    }
    assert!(
        status["edges"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["id"] == "edge-1" && e["projection_generation"] == status["generation"]),
        "the Edge, caught up: {status}\n{}",
        edge.log_text()
    );
    drop(edge);
    child.kill().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
