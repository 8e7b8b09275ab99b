//! Per-stream credit on the Edge–Node wire (#33), from outside: the `iop-edge` and `iop-node`
//! binaries as processes, a fake provider that streams a bulk body as fast as it is read, and
//! clients on raw sockets.
//!
//! - A bulk tunnel body many times the Edge's per-stream byte bound, read at 2 MiB/s: it
//!   completes (no slow-consumer cut), and the Edge's and the Node's resident memory stay
//!   within the bound plus a fixed slack: what the reader has not read waits in the sockets'
//!   kernel buffers, TCP slowing the provider down, not in either process.
//! - Meanwhile a second bulk body on the same Node connection, read as fast as possible,
//!   completes long before the slow one: the slow reader holds back only its own stream.
//! - A reader that stops is still ended at the slow-consumer timeout, and the provider request
//!   is cancelled.
//!
//! Without credit (a Node that does not announce it, as before this issue), the slow reader is
//! ended as soon as the byte bound fills: the first assertion fails (checked by breaking the
//! Node's `stream_credit`).
//!
//! The body size and rate are `STREAM_CREDIT_MIB` (default 24) and `STREAM_CREDIT_RATE_MIB`
//! (default 2); the issue's figure is `STREAM_CREDIT_MIB=256` (128 s).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod support;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use iop_tests::upstream::{Kind, Upstream};
use support::{TempDir, wait_until};

const KEY: &str = "gw-credit-key";
const UPSTREAM_KEY: &str = "sk-credit-upstream";
const LIMIT: Duration = Duration::from_secs(60);
/// The Edge's per-stream byte bound in this test; the credit window is a quarter of it.
const BOUND_KIB: u64 = 1024;
/// What else a process may grow by while the streams run: TLS records, frame and socket
/// buffers of both streams, the allocator's caches. Measured growth with huge pages off (as the
/// binaries run): 2.2–4.2 MiB over ten runs; with them on it was 0–15 MiB in 2 MiB steps, a
/// bound no slack made steady, hence the check that they are off.
const SLACK_KIB: u64 = 6 * 1024;

fn limits() -> String {
    let mut text = String::new();
    for model in ["bulk-slow", "bulk-fast", "bulk-stop"] {
        text += &format!(
            "[[models]]\nname = \"{model}\"\n[[models.providers]]\nnode_id = \"node-1\"\nprovider_id = \"{model}-1\"\nadapter = \"upstream\"\ntarget = \"{model}\"\ncapacity = 8\n"
        );
    }
    text += &format!(
        "[limits]\nstream_buffer_bytes = {}\nslow_consumer_timeout_sec = 2\n",
        BOUND_KIB * 1024
    );
    text
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Sends a streamed chat for `model` asking for `mib` MiB.
fn open(http: u16, model: &str, mib: u64) -> TcpStream {
    let body = format!(r#"{{"model":"{model}","stream":true,"max_tokens":{mib},"messages":[]}}"#);
    let mut s = TcpStream::connect(("127.0.0.1", http)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s.set_read_timeout(Some(LIMIT)).unwrap();
    s
}

/// Reads the response until `data: [DONE]` (or the end), at most `rate` bytes per second
/// (`None`: as fast as it comes), counting into `read`. Whether `[DONE]` arrived.
fn read_all(mut s: TcpStream, rate: Option<u64>, read: &AtomicU64) -> bool {
    let start = Instant::now();
    let mut buf = vec![0u8; 64 * 1024];
    let mut tail = Vec::new();
    loop {
        let want = match rate {
            None => buf.len(),
            Some(rate) => {
                let allowed = (start.elapsed().as_secs_f64() * rate as f64) as u64;
                let ahead = read.load(Ordering::Relaxed).saturating_sub(allowed);
                if ahead > 0 {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                buf.len()
                    .min(usize::try_from(rate / 20).unwrap_or(usize::MAX).max(1))
            }
        };
        match s.read(&mut buf[..want]) {
            Ok(0) | Err(_) => return false,
            Ok(n) => {
                read.fetch_add(n as u64, Ordering::Relaxed);
                tail.extend_from_slice(&buf[..n]);
                if tail.windows(12).any(|w| w == b"data: [DONE]") {
                    return true;
                }
                let keep = tail.len().saturating_sub(16);
                tail.drain(..keep);
            }
        }
    }
}

fn metric(http: u16, name: &str) -> u64 {
    let (_, page) = support::http_get(&format!("http://127.0.0.1:{http}/metrics"), &[]);
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_slow_reader_slows_its_own_stream_and_a_stopped_one_is_still_cut() {
    let mib = env_u64("STREAM_CREDIT_MIB", 24);
    let rate = env_u64("STREAM_CREDIT_RATE_MIB", 2) << 20;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, UPSTREAM_KEY, "fake-model"));
    let dir = TempDir::new("stream-credit");
    support::pki(dir.path(), &["node-1"]);
    let ports = support::edge_config_with(
        dir.path(),
        &upstream.base_url(),
        "chat_only",
        KEY,
        &limits(),
    );
    let edge = support::spawn_edge(dir.path(), &[]);
    let node = support::spawn_node(dir.path(), "node-1", ports.nodes, UPSTREAM_KEY, &[]);
    let http = ports.http;
    wait_until("the Node to be ready", LIMIT, || {
        let (status, _) = support::http_get(&format!("http://127.0.0.1:{http}/readyz"), &[]);
        status == 200
    });
    // A first small body warms both processes up (TLS, pools, allocator) before the baseline.
    let warm = AtomicU64::new(0);
    assert!(read_all(open(http, "bulk-fast", 1), None, &warm));
    let (edge_pid, node_pid) = (edge.child.id(), node.child.id());
    // The binaries turn transparent huge pages off (`iop_bins::limit_huge_pages`): with them,
    // their resident memory grows in 2 MiB steps and the bound below would measure the kernel.
    for (name, pid) in [("Edge", edge_pid), ("Node", node_pid)] {
        assert_eq!(
            iop_tests::proc::thp_enabled(pid),
            Some(false),
            "the {name} runs without transparent huge pages"
        );
    }
    let before = (
        iop_tests::proc::rss_kib(edge_pid),
        iop_tests::proc::rss_kib(node_pid),
    );

    // 1. The slow reader, and beside it a fast one on the same Node connection.
    let slow_read = Arc::new(AtomicU64::new(0));
    let slow_done = Arc::new(AtomicBool::new(false));
    let slow = {
        let (read, done) = (slow_read.clone(), slow_done.clone());
        let s = open(http, "bulk-slow", mib);
        std::thread::spawn(move || {
            let whole = read_all(s, Some(rate), &read);
            done.store(true, Ordering::SeqCst);
            whole
        })
    };
    let mut peak = before;
    let mut ahead_max = 0u64;
    let sample = |peak: &mut (u64, u64), ahead_max: &mut u64| {
        peak.0 = peak.0.max(iop_tests::proc::rss_kib(edge_pid));
        peak.1 = peak.1.max(iop_tests::proc::rss_kib(node_pid));
        let read = slow_read.load(Ordering::Relaxed);
        *ahead_max = (*ahead_max).max(upstream.bulk_sent("bulk-slow").saturating_sub(read));
    };
    wait_until("the slow reader to read 2 MiB", LIMIT, || {
        slow_read.load(Ordering::Relaxed) >= 2 << 20
    });
    let fast_mib = 64;
    let fast_read = AtomicU64::new(0);
    let t = Instant::now();
    let fast_whole = read_all(open(http, "bulk-fast", fast_mib), None, &fast_read);
    let fast_took = t.elapsed();
    let slow_still_running = !slow_done.load(Ordering::SeqCst);
    let slow_at_fast_end = slow_read.load(Ordering::Relaxed);
    let started = Instant::now();
    while !slow.is_finished() {
        sample(&mut peak, &mut ahead_max);
        assert!(
            started.elapsed() < Duration::from_secs(mib * 4 + 60),
            "the slow reader is still reading after {:?}: {} of {mib} MiB",
            started.elapsed(),
            slow_read.load(Ordering::Relaxed) >> 20
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let slow_whole = slow.join().unwrap();
    let cuts = metric(http, "iop_edge_slow_consumers_total");
    println!(
        "slow reader: {mib} MiB at {} MiB/s, whole: {slow_whole}; provider at most {} KiB ahead of it",
        rate >> 20,
        ahead_max >> 10
    );
    println!(
        "fast reader beside it: {fast_mib} MiB in {fast_took:?} ({:.0} MiB/s), whole: {fast_whole}; \
         the slow one had read {} MiB by then",
        fast_mib as f64 / fast_took.as_secs_f64(),
        slow_at_fast_end >> 20
    );
    println!(
        "RSS growth: Edge {} KiB, Node {} KiB (bound {BOUND_KIB} KiB per stream + {SLACK_KIB} KiB slack)",
        peak.0.saturating_sub(before.0),
        peak.1.saturating_sub(before.1)
    );
    assert!(
        slow_whole,
        "the slow reader got the whole body; slow-consumer cuts: {cuts}\nedge:\n{}",
        edge.log_text()
    );
    assert_eq!(cuts, 0, "no stream was ended as a slow consumer");
    assert!(fast_whole, "the fast reader got the whole body");
    assert!(
        slow_still_running,
        "the fast stream finished while the slow one was still being read"
    );
    assert!(
        peak.0.saturating_sub(before.0) < BOUND_KIB + SLACK_KIB,
        "the Edge grew by {} KiB",
        peak.0 - before.0
    );
    assert!(
        peak.1.saturating_sub(before.1) < BOUND_KIB + SLACK_KIB,
        "the Node grew by {} KiB",
        peak.1 - before.1
    );
    // Where the body waits meanwhile is the kernel's socket buffers (TCP's own flow control
    // slowing the provider down, up to tcp_rmem's maximum on each hop), not either process:
    // their growth is held above. The figure printed is for the record.

    // 2. A reader that stops is ended at the slow-consumer timeout (2 s here).
    let drops_before = upstream.dropped_count();
    let mut s = open(http, "bulk-stop", 64);
    let mut first = vec![0u8; 256 * 1024];
    s.read_exact(&mut first).unwrap();
    let stopped = Instant::now();
    wait_until(
        "the stopped reader's provider request to be cancelled",
        LIMIT,
        || upstream.dropped_count() > drops_before,
    );
    let after = stopped.elapsed();
    println!("a reader that stopped: cut and cancelled upstream after {after:?}");
    assert_eq!(metric(http, "iop_edge_slow_consumers_total"), 1);
    assert!(
        after >= Duration::from_secs(2),
        "cut by the timeout, not before it: {after:?}"
    );
    assert!(
        upstream.bulk_sent("bulk-stop") < 16 << 20,
        "the provider was not read on: {} KiB",
        upstream.bulk_sent("bulk-stop") >> 10
    );
    drop(s);
}
