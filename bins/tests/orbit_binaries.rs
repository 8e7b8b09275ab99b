//! The `orbit-control-plane` and `orbit-agent` binaries together: a token from the admin API,
//! the agent registers and heartbeats, a desired state published through the admin API is
//! applied by the agent's reference applier (files in its state directory) and reported.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::io::BufRead as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn control_plane_and_agent_processes() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut cp = Command::new(env!("CARGO_BIN_EXE_orbit-control-plane"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--heartbeat-secs",
            "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(cp.stdout.take().unwrap()).lines();
    let api = lines
        .next()
        .unwrap()
        .unwrap()
        .rsplit(' ')
        .next()
        .unwrap()
        .to_owned();
    let admin = lines
        .next()
        .unwrap()
        .unwrap()
        .rsplit(' ')
        .next()
        .unwrap()
        .to_owned();
    let _cp = Kill(cp);
    let http = reqwest::Client::new();
    let token: serde_json::Value = http
        .post(format!("{admin}/admin/v1/deployment-tokens"))
        .json(&serde_json::json!({"uses": 1}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let dir = std::env::temp_dir().join(format!("orbit-bin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("token"), token["token"].as_str().unwrap()).unwrap();
    let agent = Command::new(env!("CARGO_BIN_EXE_orbit-agent"))
        .arg("--control-plane")
        .arg(&api)
        .arg("--deployment-token-file")
        .arg(dir.join("token"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--reported-address", "192.0.2.10"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _agent = Kill(agent);
    // Wait for the registration (node-1 is the first node).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = http
            .get(format!("{admin}/admin/v1/nodes/node-1"))
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            let v: serde_json::Value = r.json().await.unwrap();
            if v["reported_address"] == "192.0.2.10" {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "agent did not register and heartbeat"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let published = http
        .post(format!("{admin}/admin/v1/nodes/node-1/desired-state"))
        .json(&serde_json::json!({"version": 1, "configurations": [{"id": "web", "kind": "nginx", "spec": {"listen": 443}}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(published.status(), 204);
    let file = dir.join("state/configurations/1/web.json");
    loop {
        let v: serde_json::Value = http
            .get(format!("{admin}/admin/v1/nodes/node-1"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        // The agent reports the result, then records the version in `state.json` (recorded
        // first, a lost report would never be sent again): wait for both.
        let state: Option<serde_json::Value> = std::fs::read(dir.join("state/state.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let recorded = state.is_some_and(|s| s["applied_version"] == 1);
        if v["current_version"] == 1 && file.exists() && recorded {
            break;
        }
        assert!(Instant::now() < deadline, "agent did not apply version 1");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), r#"{"listen":443}"#);
    std::fs::remove_dir_all(&dir).ok();
}
