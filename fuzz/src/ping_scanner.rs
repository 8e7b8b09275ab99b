//! `proxypool-controller`'s keepalive enforcement scanner (`keepalive::PingScanner`) on
//! arbitrary client bytes: the HTTP/2 frame headers of a connection, as read.
//!
//! Input: the first byte is the read size (1–255) the bytes arrive in, the second a clock step
//! in milliseconds per read, the rest the connection's bytes. Properties:
//! - it never panics and holds nothing but its fixed state (it allocates nothing);
//! - split-invariance: fed in reads of any size at one instant, it decides exactly as when fed
//!   the whole input at once (the same error, or the same strikes);
//! - with the clock moving by at least the minimum interval per read, a read holding at most
//!   one frame header never closes the connection.
//!
//! The input is scanned twice: as given, and after the HTTP/2 client preface (so the fuzzer
//! need not find the 24 bytes first).

use std::time::{Duration, Instant};

use proxypool_controller::keepalive::{PingPolicy, PingScanner};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// One input.
pub fn run(data: &[u8]) {
    let [read, step, rest @ ..] = data else {
        return;
    };
    let mut framed = PREFACE.to_vec();
    framed.extend_from_slice(rest);
    for bytes in [rest, framed.as_slice()] {
        scan(bytes, usize::from(*read).max(1), u64::from(*step));
    }
}

fn scan(bytes: &[u8], read: usize, step_ms: u64) {
    let policy = PingPolicy::new(Duration::from_millis(100));
    let now = Instant::now();
    let mut whole = PingScanner::new(policy);
    let whole_result = whole.feed(bytes, now);
    let mut parts = PingScanner::new(policy);
    let mut parts_result = Ok(());
    for chunk in bytes.chunks(read) {
        parts_result = parts.feed(chunk, now);
        if parts_result.is_err() {
            break;
        }
    }
    assert_eq!(
        whole_result, parts_result,
        "reads of {read} decide differently"
    );
    if whole_result.is_ok() {
        assert_eq!(whole.strikes(), parts.strikes());
    }
    // A slow enough client is never disconnected: one frame header per read (9 bytes or less
    // can complete at most one), each read at least the interval after the last.
    if read <= 9 && step_ms >= 100 {
        let mut slow = PingScanner::new(policy);
        let mut t = now;
        for chunk in bytes.chunks(read) {
            assert!(
                slow.feed(chunk, t).is_ok(),
                "a slow client was disconnected"
            );
            t += Duration::from_millis(step_ms);
        }
    }
}
