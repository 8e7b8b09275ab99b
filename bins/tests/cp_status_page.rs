//! `iop-cp`'s status page (issue #31) against the real binary, in a real browser (Playwright
//! driving Debian's chromium, `bins/tests/python/cp_status_page.py`): a token created and a
//! slot rotated by the CLI show on the page (the rotation while it is open, without a reload);
//! an unauthenticated request gets `401` and no page; no console error; the CSP header is
//! there; no response of the page carries a secret (the slot credentials, the raw token, the
//! admin token). Screenshots at 1280×800 and 390×844 under
//! `target/tmp/status-page-screenshots/`.

#![allow(clippy::unwrap_used, reason = "tests")]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use iop_tests::pki::Ca;
use tokio::io::AsyncBufReadExt as _;
use workload_identity::role;

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

    let ca = Ca::new("cp page CA");
    let leaf = ca.workload(role::CONTROL_PLANE, "cp-1", true);
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let (ca_pem, cert, key) = (
        write("ca.pem", &ca.pem()),
        write("cp.pem", &leaf.cert_pem),
        write("cp.key", &leaf.key_pem),
    );
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-cp"))
        .arg("--data-dir")
        .arg(&data)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--tls-ca")
        .arg(&ca_pem)
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .args(["--trust-domain", iop_tests::pki::TRUST_DOMAIN])
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
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
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
    child.kill().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
