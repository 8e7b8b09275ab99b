//! Shared by the binary tests: temporary directories, free ports, the `iop-ca` CLI, binaries run
//! as processes with their logs in files, and waiting on an observable event (never on time).
#![allow(
    dead_code,
    unreachable_pub,
    reason = "each test binary uses part of it; items are public to the tests that include it"
)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A directory of its own under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("iop-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A free loopback port (bound then released).
///
/// Chosen below the kernel's ephemeral range (32768 and up on Linux): a port the kernel handed
/// out for `bind(0)` is also where it picks the source ports of outgoing connections, so a test
/// running beside this one could take it between this probe and the service's own bind (a
/// service that then cannot listen). A port is free when both loopback and the wildcard
/// address bind it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    // Spread the start by process, then walk: parallel tests in one process never pick the
    // same port twice.
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 600) as u16 * 20;
    for _ in 0..12_000 {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed) % 12_000;
        let port = 20_000 + (base - 20_000 + offset) % 12_000;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
        {
            return port;
        }
    }
    panic!("no free port in 20000..32000");
}

/// The directory of the built binaries (`iop-ca`, `iop-edge`, …).
pub fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_iop-ca"))
        .parent()
        .expect("bin dir")
        .to_owned()
}

/// Runs `iop-ca` with `args`; panics with its output on failure.
pub fn iop_ca(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_iop-ca"))
        .args(args)
        .output()
        .expect("run iop-ca");
    assert!(
        out.status.success(),
        "iop-ca {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A binary running as a child process, stdout and stderr in `<dir>/<name>.log`; killed on
/// drop.
pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(bin: &str, args: &[&str], envs: &[(&str, &str)], dir: &Path, name: &str) -> Self {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let child = Command::new(bin)
            .args(args)
            .envs(envs.iter().copied())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {bin}: {e}"));
        Self { child, log }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of the process's output, for a failure message.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn stop(&mut self) -> Option<i32> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        self.child.wait().ok().and_then(|s| s.code())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `cond` every 20 ms until it holds; panics with `what` after `limit`. For events a
/// test can only observe from outside (a port answering, a log line appearing).
pub fn wait_until(what: &str, limit: Duration, cond: impl FnMut() -> bool) {
    wait_until_with(what, limit, cond, String::new);
}

/// [`wait_until`], and on timeout the panic also says `context()` (the processes' last log
/// lines, the last answer seen): a CI run's failure must say why without a rerun.
pub fn wait_until_with(
    what: &str,
    limit: Duration,
    mut cond: impl FnMut() -> bool,
    context: impl FnOnce() -> String,
) {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() >= limit {
            panic!("timed out waiting for {what}\n{}", context());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `GET url` answers 200.
pub fn http_ok(url: &str) -> bool {
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let Ok(mut s) = std::net::TcpStream::connect(host) else {
        return false;
    };
    use std::io::{Read as _, Write as _};
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if write!(
        s,
        "GET /{path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"
    )
    .is_err()
    {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.1 200")
}

/// Runs `python3 script args…`; returns stdout, panicking with both streams on failure.
pub fn python(script: &str, args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 is required (scripts/test-all.sh checks for it)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The official SDKs are installed (scripts/test-all.sh installs them).
pub fn require_sdks() {
    let ok = Command::new("python3")
        .args(["-c", "import openai, anthropic"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "the official SDKs are required: python3 -m pip install openai anthropic (scripts/test-all.sh does this)"
    );
}

/// The standard Python gRPC clients are installed (scripts/test-all.sh installs them).
pub fn require_grpc_clients() {
    let ok = Command::new("python3")
        .args([
            "-c",
            "import grpc, grpc_health.v1.health_pb2, grpc_reflection.v1alpha.reflection_pb2",
        ])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "the Python gRPC clients are required: python3 -m pip install grpcio grpcio-health-checking grpcio-reflection (scripts/test-all.sh does this)"
    );
}

/// A CA in `<dir>/ca` for trust domain `iop.test`, with certificates for the Edge (`edge-1`,
/// DNS localhost) and the Nodes named, via the `iop-ca` binary.
pub fn pki(dir: &Path, nodes: &[&str]) {
    let ca = dir.join("ca");
    let ca = ca.to_str().expect("utf-8 path");
    iop_ca(&["init", "--dir", ca, "--trust-domain", "iop.test"]);
    let edge = dir.join("edge");
    iop_ca(&[
        "issue",
        "--dir",
        ca,
        "--role",
        "edge",
        "--name",
        "edge-1",
        "--dns",
        "localhost",
        "--ip",
        "127.0.0.1",
        "--out",
        edge.to_str().expect("utf-8"),
    ]);
    for n in nodes {
        let out = dir.join(n);
        iop_ca(&[
            "issue",
            "--dir",
            ca,
            "--role",
            "node",
            "--name",
            n,
            "--out",
            out.to_str().expect("utf-8"),
        ]);
    }
}

/// Ports and paths of an Edge process started by [`edge_config`].
pub struct EdgePorts {
    pub nodes: u16,
    pub http: u16,
}

/// Writes `<dir>/edge.toml`: one Node (`node-1`) with one `openai_compat` adapter `upstream`
/// (`profile`, `base_url`, target `fake-model`), the model `mesh-model`, gateway keys from
/// `<dir>/api-keys`.
pub fn edge_config(dir: &Path, base_url: &str, profile: &str, gateway_key: &str) -> EdgePorts {
    edge_config_with(dir, base_url, profile, gateway_key, "")
}

/// [`edge_config`] with `extra` TOML appended (more models, `[limits]`).
pub fn edge_config_with(
    dir: &Path,
    base_url: &str,
    profile: &str,
    gateway_key: &str,
    extra: &str,
) -> EdgePorts {
    let ports = EdgePorts {
        nodes: free_port(),
        http: free_port(),
    };
    let keys = dir.join("api-keys");
    std::fs::write(&keys, format!("# gateway keys\n{gateway_key}\n")).expect("write keys");
    set_mode(&keys, 0o600);
    let d = dir.display();
    let text = format!(
        r#"edge_id = "edge-1"
[listen]
nodes = "127.0.0.1:{np}"
http = "127.0.0.1:{hp}"
[tls]
trust_domain = "iop.test"
ca = "{d}/ca/ca.pem"
cert = "{d}/edge.pem"
key = "{d}/edge.key"
reload_sec = 1
[auth]
keys_file = "{d}/api-keys"
[pool]
queue_wait_sec = 10
[[nodes]]
node_id = "node-1"
[[nodes.adapters]]
name = "upstream"
type = "openai_compat"
base_url = "{base_url}"
profile = "{profile}"
capacity = 8
[[models]]
name = "mesh-model"
[[models.providers]]
node_id = "node-1"
provider_id = "upstream-1"
adapter = "upstream"
target = "fake-model"
capacity = 8
{extra}
"#,
        np = ports.nodes,
        hp = ports.http,
    );
    std::fs::write(dir.join("edge.toml"), text).expect("write edge.toml");
    ports
}

/// Starts `iop-edge --config <dir>/edge.toml` (as [`edge_config`] writes it) with `envs`,
/// logging to `<dir>/edge.log`.
pub fn spawn_edge(dir: &Path, envs: &[(&str, &str)]) -> Proc {
    let edge_toml = dir.join("edge.toml");
    Proc::spawn(
        env!("CARGO_BIN_EXE_iop-edge"),
        &["--config", edge_toml.to_str().expect("utf-8 path")],
        envs,
        dir,
        "edge",
    )
}

/// Writes [`node_config`] for `node` dialling `edge_port` and starts `iop-node` on it, with
/// `upstream_key` in `UPSTREAM_KEY` and `envs`, logging to `<dir>/node.log`.
pub fn spawn_node(
    dir: &Path,
    node: &str,
    edge_port: u16,
    upstream_key: &str,
    envs: &[(&str, &str)],
) -> Proc {
    let node_toml = node_config(dir, node, edge_port);
    let mut all = vec![("UPSTREAM_KEY", upstream_key)];
    all.extend_from_slice(envs);
    Proc::spawn(
        env!("CARGO_BIN_EXE_iop-node"),
        &["--config", node_toml.to_str().expect("utf-8 path")],
        &all,
        dir,
        "node",
    )
}

/// Writes `<dir>/<node>.toml` for a Node dialling `edge_port`, holding the upstream key of
/// adapter `upstream` in the environment variable `UPSTREAM_KEY`.
pub fn node_config(dir: &Path, node: &str, edge_port: u16) -> PathBuf {
    let d = dir.display();
    let text = format!(
        r#"node_id = "{node}"
[edge]
address = "127.0.0.1:{edge_port}"
server_name = "localhost"
name = "edge-1"
[tls]
trust_domain = "iop.test"
ca = "{d}/ca/ca.pem"
cert = "{d}/{node}.pem"
key = "{d}/{node}.key"
reload_sec = 1
[reconnect]
interval_sec = 1
max_attempts = 0
[[credentials]]
adapter = "upstream"
api_key_env = "UPSTREAM_KEY"
"#
    );
    let path = dir.join(format!("{node}.toml"));
    std::fs::write(&path, text).expect("write node config");
    path
}

/// Writes `<dir>/<node>.toml` for a managed Node (`[credential_plane]`) dialing Edge `edge`
/// on `edge_port`, pinning the issuer public keys in `pins` (file names in `dir`); its path.
pub fn managed_node_config(
    dir: &Path,
    node: &str,
    edge: &str,
    edge_port: u16,
    pins: &[&str],
) -> PathBuf {
    let d = dir.display();
    let mut text = format!(
        r#"node_id = "{node}"
[edge]
address = "127.0.0.1:{edge_port}"
server_name = "localhost"
name = "{edge}"
[tls]
trust_domain = "iop.test"
ca = "{d}/ca/ca.pem"
cert = "{d}/{node}.pem"
key = "{d}/{node}.key"
[reconnect]
interval_sec = 1
max_attempts = 0
[credential_plane]
enabled = true
recipient_key = "{d}/{node}.x25519.pem"
recipient_key_id = "{node}-key"
"#
    );
    for p in pins {
        text.push_str(&format!(
            "[[credential_plane.issuers]]\npublic_key = \"{d}/{p}\"\n"
        ));
    }
    let path = dir.join(format!("{node}.toml"));
    std::fs::write(&path, text).expect("write node config");
    path
}

pub fn set_mode(path: &Path, mode: u32) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
}

/// `GET url` with headers; `(status, body)`.
pub fn http_get(url: &str, headers: &[(&str, &str)]) -> (u16, String) {
    request("GET", url, headers, "")
}

/// `POST url` with a JSON body and headers; `(status, body)`.
pub fn http_post(url: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    request("POST", url, headers, body)
}

/// `method url` with a JSON body; `(status, body)`.
pub fn http_request_json(method: &str, url: &str, body: &str) -> (u16, String) {
    request(method, url, &[], body)
}

fn request(method: &str, url: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let rest = url.strip_prefix("http://").expect("http url");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let started = Instant::now();
    let mut s = match std::net::TcpStream::connect(host) {
        Ok(s) => s,
        Err(e) => return (0, format!("no answer: connect: {e}")),
    };
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut req = format!(
        "{method} /{path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).expect("write");
    let mut buf = Vec::new();
    let read = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    if status == 0 {
        // Status 0 is "no answer"; say why, for the assertion that reports it.
        return (
            0,
            format!(
                "no answer after {:?}: {read:?}, {} bytes read",
                started.elapsed(),
                buf.len()
            ),
        );
    }
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// `(status, body)` of one chat request for model `fake-model` with `token`, on the Edge's HTTP
/// port `port`.
pub fn chat(port: u16, token: &str, text: &str) -> (u16, String) {
    http_post(
        &format!("http://127.0.0.1:{port}/v1/chat/completions"),
        &[("authorization", &format!("Bearer {token}"))],
        &format!(r#"{{"model":"fake-model","messages":[{{"role":"user","content":"{text}"}}]}}"#),
    )
}

/// [`chat`] with `token` every 50 ms (20/s, open loop: the next starts on schedule, whatever
/// the last one took) until `stop`; every `(status, body)`.
pub fn steady(
    port: u16,
    token: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<(u16, String)>> {
    std::thread::spawn(move || {
        let start = Instant::now();
        let mut inflight = Vec::new();
        let mut n = 0u32;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let due = start + Duration::from_millis(50) * n;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let token = token.clone();
            inflight.push(std::thread::spawn(move || chat(port, &token, "steady")));
            n += 1;
        }
        inflight
            .into_iter()
            .map(|h| h.join().expect("request thread"))
            .collect()
    })
}
