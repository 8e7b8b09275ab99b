//! Keepalive enforcement (seed 004 §6), sans-io: a scanner of the HTTP/2 frames a client
//! sends, which tells the connection to close when the client pings too often.
//!
//! tonic (over hyper and h2) answers every client PING and has no server-side minimum ping
//! interval, so a client could keep the server busy answering pings. This is gRPC-Go's
//! `keepalive.EnforcementPolicy` for our server, applied to the decrypted bytes each
//! connection reads:
//!
//! - a PING from the client (not an ACK of ours) that comes sooner than
//!   [`PingPolicy::min_interval`] after its previous PING is a **strike**;
//! - a HEADERS frame (a new call) clears the strikes, as gRPC-Go clears them when the
//!   server sends on a stream;
//! - a strike past [`PingPolicy::max_strikes`] ends the connection ([`TooManyPings`]). The
//!   server then closes it without a GOAWAY (hyper does not let us write one; gRPC-Go sends
//!   `ENHANCE_YOUR_CALM` first). A client sees its connection closed and reconnects with its
//!   usual backoff.
//!
//! Choices where gRPC-Go differs: its default minimum interval is 5 minutes and it refuses
//! pings without an active call unless `PermitWithoutStream`; we default to 10 s and permit
//! pings without a call, because workers are long-lived clients that may ping an idle
//! connection to keep NAT state, and our own server pings every 30 s. The scanner only reads
//! frame headers (9 bytes each), holds no more than one partial header, and allocates
//! nothing: a peer cannot make it hold memory. Bytes that are not an HTTP/2 client preface
//! turn it off (hyper refuses such a connection itself).

use std::time::{Duration, Instant};

/// The HTTP/2 client connection preface.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const PING: u8 = 0x6;
const ACK: u8 = 0x1;

/// How often a client may ping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PingPolicy {
    /// The shortest time between two client PINGs that is not a strike.
    pub min_interval: Duration,
    /// Strikes tolerated; one more closes the connection (gRPC-Go's `maxPingStrikes`, 2).
    pub max_strikes: u8,
}

impl PingPolicy {
    /// `min_interval` with gRPC-Go's two strikes.
    pub fn new(min_interval: Duration) -> Self {
        Self {
            min_interval,
            max_strikes: 2,
        }
    }
}

/// The client sent PINGs too often.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("client sent too many pings")]
pub struct TooManyPings;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Matched this many bytes of the preface.
    Preface(usize),
    /// Collecting a frame header.
    Header { buf: [u8; 9], have: usize },
    /// Skipping a frame's payload.
    Payload { remaining: usize },
    /// Not HTTP/2 (or already over the limit): nothing more is read.
    Off,
}

/// Scans the client-to-server bytes of one connection, in the order read.
#[derive(Clone, Debug)]
pub struct PingScanner {
    policy: PingPolicy,
    state: State,
    last_ping: Option<Instant>,
    strikes: u8,
}

impl PingScanner {
    /// A scanner for a new connection.
    pub fn new(policy: PingPolicy) -> Self {
        Self {
            policy,
            state: State::Preface(0),
            last_ping: None,
            strikes: 0,
        }
    }

    /// Feeds the next bytes the client sent, read at `now`. Once this returns
    /// [`TooManyPings`], the connection must close (later calls return it again).
    pub fn feed(&mut self, mut bytes: &[u8], now: Instant) -> Result<(), TooManyPings> {
        while !bytes.is_empty() {
            match &mut self.state {
                State::Off => {
                    return if self.strikes > self.policy.max_strikes {
                        Err(TooManyPings)
                    } else {
                        Ok(())
                    };
                }
                State::Preface(matched) => {
                    let want = &PREFACE[*matched..];
                    let n = want.len().min(bytes.len());
                    if bytes[..n] != want[..n] {
                        self.state = State::Off;
                        continue;
                    }
                    *matched += n;
                    bytes = &bytes[n..];
                    if *matched == PREFACE.len() {
                        self.state = State::Header {
                            buf: [0; 9],
                            have: 0,
                        };
                    }
                }
                State::Header { buf, have } => {
                    let n = (9 - *have).min(bytes.len());
                    buf[*have..*have + n].copy_from_slice(&bytes[..n]);
                    *have += n;
                    bytes = &bytes[n..];
                    if *have == 9 {
                        let header = *buf;
                        self.frame(&header, now)?;
                    }
                }
                State::Payload { remaining } => {
                    let n = (*remaining).min(bytes.len());
                    *remaining -= n;
                    bytes = &bytes[n..];
                    if *remaining == 0 {
                        self.state = State::Header {
                            buf: [0; 9],
                            have: 0,
                        };
                    }
                }
            }
        }
        Ok(())
    }

    /// Strikes so far.
    pub fn strikes(&self) -> u8 {
        self.strikes
    }

    fn frame(&mut self, header: &[u8; 9], now: Instant) -> Result<(), TooManyPings> {
        let length =
            usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        let (kind, flags) = (header[3], header[4]);
        self.state = if length == 0 {
            State::Header {
                buf: [0; 9],
                have: 0,
            }
        } else {
            State::Payload { remaining: length }
        };
        match kind {
            HEADERS => self.strikes = 0,
            PING if flags & ACK == 0 => {
                if self.last_ping.is_some_and(|last| {
                    now.saturating_duration_since(last) < self.policy.min_interval
                }) {
                    self.strikes = self.strikes.saturating_add(1);
                }
                self.last_ping = Some(now);
                if self.strikes > self.policy.max_strikes {
                    self.state = State::Off;
                    return Err(TooManyPings);
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            flags,
            0,
            0,
            0,
            0,
        ];
        f.extend_from_slice(payload);
        f
    }

    fn ping() -> Vec<u8> {
        frame(PING, 0, &[7; 8])
    }

    fn scanner() -> PingScanner {
        let mut s = PingScanner::new(PingPolicy::new(Duration::from_secs(10)));
        s.feed(PREFACE, Instant::now()).unwrap();
        s
    }

    #[test]
    fn a_ping_flood_ends_the_connection_on_the_third_strike() {
        let mut s = scanner();
        let t = Instant::now();
        // The first ping is free; the next two are strikes, tolerated; the fourth is over.
        for _ in 0..3 {
            s.feed(&ping(), t).unwrap();
        }
        assert_eq!(s.strikes(), 2);
        assert_eq!(s.feed(&ping(), t), Err(TooManyPings));
        assert_eq!(
            s.feed(&frame(0x0, 0, b"x"), t),
            Err(TooManyPings),
            "stays closed"
        );
    }

    #[test]
    fn pings_spaced_by_the_interval_are_never_a_strike() {
        let mut s = scanner();
        let mut t = Instant::now();
        for _ in 0..100 {
            s.feed(&ping(), t).unwrap();
            t += Duration::from_secs(10);
        }
        assert_eq!(s.strikes(), 0);
    }

    #[test]
    fn acks_of_the_servers_pings_are_not_counted() {
        let mut s = scanner();
        let t = Instant::now();
        for _ in 0..100 {
            s.feed(&frame(PING, ACK, &[1; 8]), t).unwrap();
        }
        assert_eq!(s.strikes(), 0);
    }

    #[test]
    fn a_new_call_clears_the_strikes() {
        let mut s = scanner();
        let t = Instant::now();
        for _ in 0..50 {
            s.feed(&ping(), t).unwrap();
            s.feed(&ping(), t).unwrap();
            s.feed(&frame(HEADERS, 0x4, b"\x82"), t).unwrap();
        }
    }

    #[test]
    fn frames_split_anywhere_scan_the_same() {
        let t = Instant::now();
        let mut bytes = PREFACE.to_vec();
        for _ in 0..3 {
            bytes.extend(frame(0x0, 0, &[9; 300]));
            bytes.extend(ping());
        }
        bytes.extend(ping());
        for split in 1..bytes.len() {
            let mut s = PingScanner::new(PingPolicy::new(Duration::from_secs(10)));
            let first = s.feed(&bytes[..split], t);
            let second = first.and_then(|()| s.feed(&bytes[split..], t));
            assert_eq!(second, Err(TooManyPings), "split at {split}");
        }
    }

    #[test]
    fn bytes_that_are_not_http2_turn_the_scanner_off() {
        let mut s = PingScanner::new(PingPolicy::new(Duration::from_secs(10)));
        let t = Instant::now();
        s.feed(b"GET / HTTP/1.1\r\n\r\n", t).unwrap();
        for _ in 0..10 {
            s.feed(&ping(), t).unwrap();
        }
    }
}
