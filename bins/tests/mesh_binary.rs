//! The README's first command: `iop-mesh` starts a whole local mesh, serves an OpenAI-compatible
//! chat completion, and stops cleanly on Ctrl-C (SIGINT).
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

const BIN: &str = env!("CARGO_BIN_EXE_iop-mesh");
const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn local_mesh_serves_chat_and_stops_on_ctrl_c() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(BIN)
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--nodes",
            "2",
            "--demo-delay-ms",
            "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let base = tokio::time::timeout(LIMIT, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(url) = line.strip_prefix("iop-mesh: OpenAI-compatible base URL: ") {
                return url.to_owned();
            }
        }
        panic!("no base URL printed");
    })
    .await
    .unwrap();
    assert_eq!(base, format!("http://127.0.0.1:{port}/v1"));

    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let chat =
        serde_json::json!({"model": "demo", "messages": [{"role": "user", "content": "ping"}]});
    let r: serde_json::Value = http
        .post(format!("{base}/chat/completions"))
        .json(&chat)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["choices"][0]["message"]["content"], "echo: ping");

    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(LIMIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}
