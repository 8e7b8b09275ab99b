//! The official OpenAI Python SDK against the `iop-mesh` binary (models, chat completions and
//! responses, streaming and not, error shape). `scripts/test-all.sh` installs the SDK
//! (`python3 -m pip install openai`); without it this test fails and says how to install it.
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
async fn official_openai_python_sdk_talks_to_the_edge() {
    let sdk = Command::new("python3")
        .args(["-c", "import openai"])
        .status();
    assert!(
        sdk.is_ok_and(|s| s.success()),
        "the OpenAI Python SDK is required: python3 -m pip install openai (scripts/test-all.sh does this)"
    );
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
        .kill_on_drop(true)
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
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/openai_sdk_check.py"
    );
    let out = tokio::time::timeout(
        LIMIT,
        tokio::process::Command::new("python3")
            .arg(script)
            .arg(&base)
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "SDK check failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("models, chat, chat stream, responses, responses stream, 404 ok"));
    let pid = child.id().unwrap().to_string();
    let _ = Command::new("kill").args(["-INT", &pid]).status();
    let _ = child.wait().await;
}
