//! Benchmarks and load tools for the workspace. Criterion benches live in `benches/benches/`,
//! load tools in `src/bin/` (`mesh_load`, `http_load`); see `benches/README.md` for how to run
//! them and the numbers measured so far. This library holds the load tools' shared harness.
#![forbid(unsafe_code)]

/// The load tools allocate as the shipped binaries do (`iop_bins` sets mimalloc): a bench that
/// embeds a library with the system allocator would measure glibc's malloc, not our code.
/// The `system-alloc` feature keeps glibc's, for heap profilers that see only `malloc`
/// (`heaptrack`; mimalloc maps its own pages).
#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Shared pieces of the load tools: mTLS configs with SPIFFE identities, fixed-rate drivers and
/// percentiles.
#[allow(
    clippy::unwrap_used,
    missing_docs,
    reason = "load-tool harness: failed setup should panic"
)]
pub mod load {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use iop_tests::pki::{Ca, TRUST_DOMAIN};
    use workload_identity::{ExpectedPeer, client_cert_verifier, role, server_cert_verifier};

    pub fn edge_tls(ca: &Ca) -> Arc<rustls::ServerConfig> {
        let leaf = ca.workload(role::EDGE, "edge-1", true);
        let verifier = client_cert_verifier(
            ca.roots(),
            ExpectedPeer::any_name(TRUST_DOMAIN, role::NODE).unwrap(),
        )
        .unwrap();
        Arc::new(
            workload_identity::server_config(leaf.chain.clone(), leaf.key(), verifier).unwrap(),
        )
    }

    pub fn node_tls(ca: &Ca, name: &str) -> Arc<rustls::ClientConfig> {
        let leaf = ca.workload(role::NODE, name, false);
        let verifier = server_cert_verifier(
            ca.roots(),
            ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, "edge-1").unwrap(),
        )
        .unwrap();
        Arc::new(
            workload_identity::client_config(leaf.chain.clone(), leaf.key(), verifier).unwrap(),
        )
    }

    pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
        let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
        sorted[i.min(sorted.len() - 1)]
    }

    pub async fn at_rate<F, Fut>(rate: u32, count: u32, f: F) -> Vec<Duration>
    where
        F: Fn(u64) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut tasks = Vec::with_capacity(count as usize);
        for i in 0..count {
            tick.tick().await;
            let fut = f(u64::from(i));
            tasks.push(tokio::spawn(async move {
                let t = Instant::now();
                fut.await;
                t.elapsed()
            }));
        }
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out.sort();
        out
    }

    pub fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1000.0
    }

    /// A binary next to this one (`target/release/NAME`), or the path in env `var`.
    pub fn bin(var: &str, name: &str) -> std::path::PathBuf {
        std::env::var_os(var).map_or_else(
            || {
                std::env::current_exe()
                    .unwrap()
                    .parent()
                    .unwrap()
                    .join(name)
            },
            std::path::PathBuf::from,
        )
    }

    /// CPU time (user + system) of process `pid` so far, from `/proc/PID/stat` (zero if it is
    /// gone).
    pub fn cpu(pid: u32) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command name (which may hold spaces) start after the last ')'.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        // Fields by position (not every field is an unsigned number: tpgid is -1 without a tty).
        let f: Vec<&str> = rest.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of the whole line: 12 and 13 from the state (1).
        let num = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
        let ticks = num(11) + num(12);
        Duration::from_secs_f64(ticks as f64 / clk_tck())
    }

    fn clk_tck() -> f64 {
        static TCK: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
        *TCK.get_or_init(|| {
            std::process::Command::new("getconf")
                .arg("CLK_TCK")
                .output()
                .ok()
                .and_then(|o| String::from_utf8(o.stdout).ok())
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(100.0)
        })
    }

    pub use iop_tests::proc::{fd_count as fds, rss_kib};

    /// Waits (at most 30 s) until something accepts on 127.0.0.1:`port`.
    pub fn wait_port(port: u16) {
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(30), "port {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A port free on 127.0.0.1 just now.
    pub fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A minimal HTTP/1.1 keep-alive client for load generation: one connection, a request
    /// written as prepared bytes, the response read by its `content-length` or chunked framing.
    /// On a 2-core machine a full client (reqwest) costs the load generator several times what
    /// this does, CPU taken from the processes being measured; both paths of a comparison use
    /// the same client, so its own cost cancels in a difference or a ratio.
    #[derive(Debug)]
    pub struct RawHttp {
        stream: tokio::net::TcpStream,
        buf: Vec<u8>,
    }

    /// One response as [`RawHttp::exchange`] saw it.
    #[derive(Clone, Copy, Debug)]
    pub struct Exchange {
        pub status: u16,
        /// From writing the request to the first byte of the body.
        pub first_byte: Duration,
        /// From writing the request to the last byte of the response.
        pub last_byte: Duration,
    }

    /// A prepared `POST` of a JSON body.
    pub fn post_json(port: u16, path: &str, body: &str) -> Vec<u8> {
        format!(
            "POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }

    impl RawHttp {
        pub async fn connect(port: u16) -> std::io::Result<Self> {
            let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            stream.set_nodelay(true)?;
            Ok(Self {
                stream,
                buf: Vec::with_capacity(16 * 1024),
            })
        }

        /// Writes `request` and reads one whole response.
        pub async fn exchange(&mut self, request: &[u8]) -> std::io::Result<Exchange> {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let start = Instant::now();
            self.stream.write_all(request).await?;
            let mut first_byte = None;
            loop {
                if let Some((status, head, end)) = parse_response(&self.buf)? {
                    if first_byte.is_none() && self.buf.len() > head {
                        first_byte = Some(start.elapsed());
                    }
                    if let Some(end) = end {
                        let last_byte = start.elapsed();
                        self.buf.drain(..end);
                        return Ok(Exchange {
                            status,
                            first_byte: first_byte.unwrap_or(last_byte),
                            last_byte,
                        });
                    }
                }
                if self.buf.capacity() - self.buf.len() < 4096 {
                    self.buf.reserve(16 * 1024);
                }
                if self.stream.read_buf(&mut self.buf).await? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
            }
        }
    }

    fn bad(what: &str) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned())
    }

    fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
        hay.windows(needle.len()).position(|w| w == needle)
    }

    /// `(status, end of the head, end of the response if complete)`, or `None` while the head
    /// is incomplete.
    fn parse_response(buf: &[u8]) -> std::io::Result<Option<(u16, usize, Option<usize>)>> {
        let Some(h) = find(buf, b"\r\n\r\n") else {
            return Ok(None);
        };
        let head = std::str::from_utf8(&buf[..h]).map_err(|_| bad("head"))?;
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| bad("status line"))?;
        let (mut length, mut chunked) = (None, false);
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = Some(value.parse::<usize>().map_err(|_| bad("content-length"))?);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value.eq_ignore_ascii_case("chunked");
            }
        }
        let body = h + 4;
        if !chunked {
            let end = body + length.unwrap_or(0);
            return Ok(Some((status, body, (buf.len() >= end).then_some(end))));
        }
        // Chunked: size line, data, CRLF; a zero size then the final CRLF (no trailers).
        let mut at = body;
        loop {
            let Some(line) = find(&buf[at..], b"\r\n") else {
                return Ok(Some((status, body, None)));
            };
            let size_text = std::str::from_utf8(&buf[at..at + line]).map_err(|_| bad("chunk"))?;
            let size_text = size_text.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_text, 16).map_err(|_| bad("chunk size"))?;
            let next = at + line + 2 + size + 2;
            if buf.len() < next {
                return Ok(Some((status, body, None)));
            }
            if size == 0 {
                return Ok(Some((status, body, Some(next))));
            }
            at = next;
        }
    }

    /// A child process killed (and reaped) on drop.
    #[derive(Debug)]
    pub struct Killed(pub std::process::Child);

    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
