//! The worker control plane's domain (seed `004` sections 4, 5 and 7): validated commands,
//! the session state machine's rules, the [`ControlStore`] port and the [`Service`].
//!
//! Nothing here names protobuf, tonic, Redis or tokio: the transport maps DTOs to these types
//! and back, and the store implementations ([`crate::memory`], [`crate::redis_store`]) carry
//! out the atomic check-and-write steps.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

/// The only protocol version this delivery unit speaks.
pub const PROTOCOL_VERSION: u32 = 1;
/// Longest worker, instance, zone and proxy id (bytes).
pub const MAX_ID_LEN: usize = 128;
/// Most labels on a registration.
pub const MAX_LABELS: usize = 32;
/// Longest label key (bytes).
pub const MAX_LABEL_KEY: usize = 64;
/// Longest label value (bytes).
pub const MAX_LABEL_VALUE: usize = 256;
/// Largest total of label keys and values (bytes).
pub const MAX_LABELS_TOTAL: usize = 4096;
/// Longest ACK error message (bytes); checked, then dropped.
pub const MAX_ERROR_MESSAGE: usize = 512;
/// Longest ACK error code (bytes).
pub const MAX_ERROR_CODE: usize = 64;

/// A 128-bit session id.
pub type SessionId = [u8; 16];
/// A raw SHA-256 snapshot checksum.
pub type Checksum = [u8; 32];

/// A snapshot position, ordered by `(ownership_epoch, version)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SnapshotTuple {
    /// Ownership epoch (compared first).
    pub ownership_epoch: u64,
    /// Snapshot version.
    pub version: u64,
}

/// A worker session as the store holds it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Session {
    /// Worker id.
    pub worker_id: String,
    /// Worker instance.
    pub instance_id: String,
    /// Session id (never logged).
    pub session_id: SessionId,
    /// Last positively acknowledged snapshot (zero after registration).
    pub acked: SnapshotTuple,
    /// Its checksum (zero after registration).
    pub acked_checksum: Checksum,
    /// Whether runtime reports are accepted (only after a positive ACK).
    pub runtime_enabled: bool,
}

/// The snapshot currently published to a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SnapshotReference {
    /// Position.
    pub tuple: SnapshotTuple,
    /// Checksum.
    pub checksum: Checksum,
}

/// A worker's acknowledgement of a snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SnapshotAcknowledgement {
    /// Worker id.
    pub worker_id: String,
    /// Session id.
    pub session_id: SessionId,
    /// The acknowledged position.
    pub tuple: SnapshotTuple,
    /// Its checksum.
    pub checksum: Checksum,
    /// Applied (positive) or rejected (negative).
    pub applied: bool,
}

/// One proxy's counters in a sparse report.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Counter {
    /// Proxy id.
    pub proxy_id: String,
    /// Requests in flight.
    pub in_flight: u64,
    /// Open upstream connections.
    pub open_connections: u64,
}

/// A report's counters in canonical form (seed 004 §5.3 and §7: every proxy id valid and
/// unique, every count non-negative, sorted by proxy id), held as the canonical bytes the digest
/// covers and the Redis store keeps: one `proxy_id ' ' in_flight ' ' open_connections '\n'` line
/// per proxy, counts in decimal.
///
/// Only [`Counters::new`] and [`CountersBuilder`] make one, and both validate, so a value of
/// this type is canonical by construction. Holding the bytes rather than a `Vec<Counter>` is a
/// choice for the hot path: the gRPC transport writes each counter's line as it decodes it
/// (`crate::grpc::report`), and a 1000-counter report is then one buffer instead of 1000
/// strings, with nothing left to build for the digest or the store.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    canonical: Vec<u8>,
    len: usize,
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Counters {
    /// Validates and sorts `counters`, as the service does for a report: the errors are the
    /// service's (`proxy_id`, `duplicate proxy_id`); there is no count limit here.
    pub fn new(counters: Vec<Counter>) -> Result<Self, ServiceError> {
        let mut b = CountersBuilder::new(usize::MAX);
        for c in &counters {
            b.push_counts(c.proxy_id.as_bytes(), c.in_flight, c.open_connections);
        }
        b.finish()
    }

    /// The canonical bytes (what [`Report::digest`] covers).
    pub fn canonical(&self) -> &[u8] {
        &self.canonical
    }

    /// How many proxies.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No counters: the report is a heartbeat.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The counters in canonical order.
    pub fn iter(&self) -> CountersIter<'_> {
        CountersIter {
            rest: &self.canonical,
        }
    }

    /// The counters as owned values.
    pub fn to_vec(&self) -> Vec<Counter> {
        self.iter()
            .map(|c| Counter {
                proxy_id: c.proxy_id.to_owned(),
                in_flight: c.in_flight,
                open_connections: c.open_connections,
            })
            .collect()
    }

    /// Parses canonical bytes back (the Redis store's stored runtime): `None` unless every line
    /// is a valid counter and the ids are strictly increasing.
    pub fn from_canonical(canonical: &[u8]) -> Option<Self> {
        let mut b = CountersBuilder::new(usize::MAX);
        for line in canonical.split_inclusive(|&c| c == b'\n') {
            let (id, in_flight, open) = parse_line(line)?;
            b.push_counts(id, in_flight, open);
        }
        let counters = b.finish().ok()?;
        (counters.canonical == canonical).then_some(counters)
    }
}

/// One counter of [`Counters`], borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterRef<'a> {
    /// Proxy id.
    pub proxy_id: &'a str,
    /// Requests in flight.
    pub in_flight: u64,
    /// Open upstream connections.
    pub open_connections: u64,
}

/// The iterator of [`Counters::iter`].
#[derive(Clone, Debug)]
pub struct CountersIter<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for CountersIter<'a> {
    type Item = CounterRef<'a>;

    fn next(&mut self) -> Option<CounterRef<'a>> {
        let end = self.rest.iter().position(|&c| c == b'\n')?;
        let (line, rest) = self.rest.split_at(end + 1);
        self.rest = rest;
        // Built by `CountersBuilder` only: every line parses, and ids are ASCII.
        let (id, in_flight, open_connections) = parse_line(line)?;
        Some(CounterRef {
            proxy_id: std::str::from_utf8(id).ok()?,
            in_flight,
            open_connections,
        })
    }
}

/// `id ' ' decimal ' ' decimal '\n'` → its parts (decimals without sign or leading zeros).
fn parse_line(line: &[u8]) -> Option<(&[u8], u64, u64)> {
    let line = line.strip_suffix(b"\n")?;
    let mut parts = line.split(|&c| c == b' ');
    let (id, a, b) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    Some((id, parse_decimal(a)?, parse_decimal(b)?))
}

fn parse_decimal(d: &[u8]) -> Option<u64> {
    if d.is_empty() || (d.len() > 1 && d[0] == b'0') || !d.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(d).ok()?.parse().ok()
}

/// Builds [`Counters`] one counter at a time, validating as it goes, in the order the service
/// reports problems: more than `max` counters (`counters`), else the first invalid counter in
/// input order (`proxy_id`, then `counter` for a negative count), else a repeated id
/// (`duplicate proxy_id`). Counters that arrive sorted (workers usually send them so) are
/// written straight into the canonical bytes; otherwise they are sorted once at the end.
///
/// Memory stays bounded by the input: after `max` counters, or after the first error, nothing
/// more is written, only counted.
#[derive(Debug)]
pub struct CountersBuilder {
    out: Vec<u8>,
    len: usize,
    max: usize,
    /// Where the last written line's id is (the sort key of the next one).
    last: std::ops::Range<usize>,
    sorted: bool,
    duplicate: bool,
    invalid: Option<&'static str>,
}

impl CountersBuilder {
    /// A builder that refuses more than `max` counters.
    pub fn new(max: usize) -> Self {
        Self {
            out: Vec::new(),
            len: 0,
            max,
            last: 0..0,
            sorted: true,
            duplicate: false,
            invalid: None,
        }
    }

    /// As [`CountersBuilder::new`], with room for about `bytes` of canonical counters.
    pub fn with_capacity(max: usize, bytes: usize) -> Self {
        let mut b = Self::new(max);
        b.out.reserve(bytes);
        b
    }

    /// Adds a counter as received (signed counts: a negative one is refused).
    pub fn push(&mut self, proxy_id: &[u8], in_flight: i64, open_connections: i64) {
        match (u64::try_from(in_flight), u64::try_from(open_connections)) {
            (Ok(f), Ok(o)) => self.push_counts(proxy_id, f, o),
            _ => {
                self.len += 1;
                if self.invalid.is_none() {
                    self.invalid = Some(if valid_id_bytes(proxy_id) {
                        "counter"
                    } else {
                        "proxy_id"
                    });
                }
            }
        }
    }

    /// Adds a counter with unsigned counts.
    pub fn push_counts(&mut self, proxy_id: &[u8], in_flight: u64, open_connections: u64) {
        self.len += 1;
        if self.invalid.is_some() || self.len > self.max {
            return;
        }
        if !valid_id_bytes(proxy_id) {
            self.invalid = Some("proxy_id");
            return;
        }
        if self.len > 1 && self.sorted {
            match cmp_ids(&self.out[self.last.clone()], proxy_id) {
                std::cmp::Ordering::Less => {}
                std::cmp::Ordering::Equal => self.duplicate = true,
                std::cmp::Ordering::Greater => self.sorted = false,
            }
        }
        // The whole line at once: the id, two spaces, two decimals of at most 20 digits, '\n'.
        self.out.reserve(proxy_id.len() + 43);
        let start = self.out.len();
        self.out.extend_from_slice(proxy_id);
        self.last = start..self.out.len();
        match (u8::try_from(in_flight), u8::try_from(open_connections)) {
            // Most counts are one digit: the rest of the line is five bytes, written at once.
            (Ok(f @ 0..10), Ok(o @ 0..10)) => {
                self.out
                    .extend_from_slice(&[b' ', b'0' + f, b' ', b'0' + o, b'\n']);
            }
            _ => {
                self.out.push(b' ');
                push_decimal(&mut self.out, in_flight);
                self.out.push(b' ');
                push_decimal(&mut self.out, open_connections);
                self.out.push(b'\n');
            }
        }
    }

    /// The canonical counters, or the service's error for them.
    pub fn finish(self) -> Result<Counters, ServiceError> {
        if self.len > self.max {
            return Err(ServiceError::Invalid("counters"));
        }
        if let Some(field) = self.invalid {
            return Err(ServiceError::Invalid(field));
        }
        let canonical = if self.sorted {
            self.out
        } else {
            // Sort the lines by id (ids are unique unless refused below, so the line order is
            // the id order), then look for neighbours with the same id.
            let mut lines: Vec<&[u8]> = self.out.split_inclusive(|&c| c == b'\n').collect();
            let id = |l: &[u8]| -> usize { l.iter().position(|&c| c == b' ').unwrap_or(l.len()) };
            lines.sort_unstable_by(|a, b| a[..id(a)].cmp(&b[..id(b)]));
            if lines
                .windows(2)
                .any(|w| w[0][..id(w[0])] == w[1][..id(w[1])])
            {
                return Err(ServiceError::Invalid("duplicate proxy_id"));
            }
            lines.concat()
        };
        if self.duplicate {
            return Err(ServiceError::Invalid("duplicate proxy_id"));
        }
        Ok(Counters {
            canonical,
            len: self.len,
        })
    }
}

/// A complete sparse runtime report, canonical (counters sorted by proxy id, unique).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Report {
    /// Worker id.
    pub worker_id: String,
    /// Session id.
    pub session_id: SessionId,
    /// Report sequence.
    pub sequence: u64,
    /// The acknowledged snapshot the report is about.
    pub tuple: SnapshotTuple,
    /// Observation time, Unix milliseconds.
    pub observed_at_unix_ms: i64,
    /// Counters, canonical.
    pub counters: Counters,
}

impl Report {
    /// The canonical content bytes: the counters only (sequence, session and time excluded),
    /// one `proxy_id ' ' in_flight ' ' open_connections '\n'` line per proxy, sorted.
    pub fn canonical_counters(&self) -> &[u8] {
        self.counters.canonical()
    }

    /// SHA-256 of the observation time (8 bytes, big-endian) and
    /// [`Report::canonical_counters`]: equal sequences with a different digest conflict.
    pub fn digest(&self) -> [u8; 32] {
        Self::digest_of(self.observed_at_unix_ms, self.canonical_counters())
    }

    /// [`Report::digest`] of an observation time and canonical counters.
    pub fn digest_of(observed_at_unix_ms: i64, canonical_counters: &[u8]) -> [u8; 32] {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(&observed_at_unix_ms.to_be_bytes());
        ctx.update(canonical_counters);
        let mut out = [0u8; 32];
        out.copy_from_slice(ctx.finish().as_ref());
        out
    }
}

/// `a.cmp(b)` for ids (at most [`MAX_ID_LEN`] bytes), eight bytes at a time and inlined: this
/// runs once per counter of every report, and for ids of a dozen bytes the call into `memcmp`
/// cost more than the comparison.
#[inline]
fn cmp_ids(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    let mut a_words = a.chunks_exact(8);
    let mut b_words = b.chunks_exact(8);
    for (x, y) in a_words.by_ref().zip(b_words.by_ref()) {
        let (x, y) = (word(x), word(y));
        if x != y {
            return x.cmp(&y);
        }
    }
    // The first `n` bytes are equal, and fewer than eight are left in the shorter one: one
    // more word ends at its end (overlapping bytes already found equal, or zero-padded when it
    // is shorter than a word, both sides alike), then the lengths decide.
    let m = a.len().min(b.len());
    if !m.is_multiple_of(8) {
        let (x, y) = if m >= 8 {
            (word(&a[m - 8..m]), word(&b[m - 8..m]))
        } else {
            (padded_word(&a[..m]), padded_word(&b[..m]))
        };
        if x != y {
            return x.cmp(&y);
        }
    }
    a.len().cmp(&b.len())
}

/// The first eight bytes of `w` as a big-endian number (so numbers compare as the bytes do).
#[inline]
fn word(w: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&w[..8]);
    u64::from_be_bytes(b)
}

/// [`word`] of fewer than eight bytes, zero-padded on the right.
#[inline]
fn padded_word(w: &[u8]) -> u64 {
    w.iter()
        .zip((0..8).rev())
        .fold(0, |v, (&c, i)| v | u64::from(c) << (8 * i))
}

/// `n` in decimal (what `write!("{n}")` writes, without the formatting machinery: this runs
/// twice per counter of every report).
#[inline]
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    if n < 10 {
        // Most counts are small.
        out.push(b'0' + u8::try_from(n).unwrap_or(0));
        return;
    }
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        // `n % 10` is below 10.
        digits[i] = b'0' + u8::try_from(n % 10).unwrap_or(0);
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// Everything a store holds for one worker, read back the same way from either store (the
/// differential test holds the Redis store's Lua scripts to [`crate::memory::StoreState`] with
/// it, after every step).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerRecord {
    /// The live session.
    pub session: Option<Session>,
    /// Its report sequence fence: the last accepted sequence and its content digest.
    pub fence: Option<(u64, [u8; 32])>,
    /// The published snapshot reference.
    pub reference: Option<SnapshotReference>,
    /// The stored runtime: sequence, observation time and counters.
    pub runtime: Option<(u64, i64, Vec<Counter>)>,
}

/// A store failure. Distinct kinds, distinct recovery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum StoreError {
    /// The session was replaced or has expired.
    #[error("stale session")]
    StaleSession,
    /// The ACK or report does not match the published/acknowledged snapshot (ahead of it, or
    /// the same tuple with another checksum); nothing written.
    #[error("snapshot mismatch")]
    SnapshotMismatch,
    /// The ACK names an older snapshot than the session's acknowledged bound or the published
    /// reference (seed 004 §3.3, "旧版本 ACK 必须失败"; §5.2.2 "stale ACK"): it fails, nothing is
    /// written, and the worker resyncs with a full snapshot. Kept apart from
    /// [`StoreError::SnapshotMismatch`] in the domain (seed §1: distinct recovery causes);
    /// both reach the worker as `require_full_snapshot`.
    #[error("stale acknowledgement")]
    StaleAck,
    /// The report sequence went back.
    #[error("stale report")]
    StaleReport,
    /// Same sequence, different canonical content.
    #[error("conflicting report")]
    ConflictingReport,
    /// A published reference would move back, or change checksum at the same position.
    #[error("snapshot reference conflict")]
    ReferenceConflict,
    /// The backend failed.
    #[error("store unavailable")]
    Unavailable,
}

/// The store port (seed 004 §3.2). Every method is one atomic step.
#[async_trait]
pub trait ControlStore: Send + Sync + 'static {
    /// The global ownership epoch, initialised to 1 if absent; persistent (no TTL) and never
    /// decreasing.
    async fn current_ownership_epoch(&self) -> Result<u64, StoreError>;
    /// Replaces the worker's session with `session` (not acknowledged) and deletes its runtime.
    async fn open_session(&self, session: &Session, ttl: Duration) -> Result<(), StoreError>;
    /// Publishes `reference` for `worker_id`: strictly forward by tuple; the same tuple only
    /// with the same checksum (an idempotent renewal).
    async fn record_issued_snapshot(
        &self,
        worker_id: &str,
        reference: SnapshotReference,
        ttl: Duration,
    ) -> Result<(), StoreError>;
    /// Checks and applies an acknowledgement (seed 004 §5.2), renewing the session by `ttl`.
    async fn acknowledge_snapshot(
        &self,
        ack: &SnapshotAcknowledgement,
        ttl: Duration,
    ) -> Result<(), StoreError>;
    /// Checks and applies a report (seed 004 §5.3): session renewed by `session_ttl`, the
    /// report kept for `report_ttl`.
    async fn replace_runtime(
        &self,
        report: &Report,
        session_ttl: Duration,
        report_ttl: Duration,
    ) -> Result<(), StoreError>;

    /// [`ControlStore::acknowledge_snapshot`], then the ownership epoch the answer carries:
    /// `Err` only when the store failed; the acknowledgement's own outcome is inside. A store
    /// that can do both in one atomic round trip overrides this (the Redis store does: every
    /// ACK was two round trips).
    async fn acknowledge_with_epoch(
        &self,
        ack: &SnapshotAcknowledgement,
        ttl: Duration,
    ) -> Result<(Result<(), StoreError>, u64), StoreError> {
        let outcome = self.acknowledge_snapshot(ack, ttl).await;
        if outcome == Err(StoreError::Unavailable) {
            return Err(StoreError::Unavailable);
        }
        Ok((outcome, self.current_ownership_epoch().await?))
    }

    /// [`ControlStore::replace_runtime`], then the ownership epoch, like
    /// [`ControlStore::acknowledge_with_epoch`].
    async fn replace_runtime_with_epoch(
        &self,
        report: &Report,
        session_ttl: Duration,
        report_ttl: Duration,
    ) -> Result<(Result<(), StoreError>, u64), StoreError> {
        let outcome = self.replace_runtime(report, session_ttl, report_ttl).await;
        if outcome == Err(StoreError::Unavailable) {
            return Err(StoreError::Unavailable);
        }
        Ok((outcome, self.current_ownership_epoch().await?))
    }
}

/// Service settings (validated by the config layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceConfig {
    /// Heartbeat interval told to workers.
    pub heartbeat_interval: Duration,
    /// Session lifetime without renewal.
    pub session_ttl: Duration,
    /// Oldest usable runtime report.
    pub max_stale_age: Duration,
    /// Most counters in one report.
    pub max_runtime_counters: usize,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(10),
            session_ttl: Duration::from_secs(35),
            max_stale_age: Duration::from_secs(30),
            max_runtime_counters: 100_000,
        }
    }
}

/// A registration request (already decoded; labels unique).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegisterCommand {
    /// Worker id.
    pub worker_id: String,
    /// Instance id.
    pub instance_id: String,
    /// Zone (may be empty).
    pub zone: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// The worker's protocol version.
    pub supported_protocol_version: u32,
}

/// A successful registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// New session id.
    pub session_id: SessionId,
    /// Current ownership epoch.
    pub ownership_epoch: u64,
    /// Protocol version.
    pub protocol_version: u32,
    /// Heartbeat interval.
    pub heartbeat_interval: Duration,
    /// Maximum stale age.
    pub max_stale_age: Duration,
}

/// An acknowledgement as received (the checksum still unchecked in length).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AcknowledgeCommand {
    /// Worker id.
    pub worker_id: String,
    /// Session id bytes.
    pub session_id: Vec<u8>,
    /// Snapshot version.
    pub snapshot_version: u64,
    /// Ownership epoch.
    pub ownership_epoch: u64,
    /// Checksum bytes.
    pub checksum: Vec<u8>,
    /// Applied.
    pub applied: bool,
    /// Error code (negative ACKs).
    pub error_code: String,
    /// Error message: length-checked, then dropped.
    pub error_message: String,
}

/// A report as received.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReportCommand {
    /// Worker id.
    pub worker_id: String,
    /// Session id bytes.
    pub session_id: Vec<u8>,
    /// Sequence.
    pub sequence: u64,
    /// Snapshot version.
    pub snapshot_version: u64,
    /// Ownership epoch.
    pub ownership_epoch: u64,
    /// Observation time.
    pub observed_at_unix_ms: i64,
    /// `(proxy_id, in_flight, open_connections)` as received (signed: negatives are refused).
    pub counters: Vec<(String, i64, i64)>,
}

/// A report whose counters a [`CountersBuilder`] has already checked and put in canonical
/// form (see [`Service::report_canonical`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CanonicalReportCommand {
    /// Worker id.
    pub worker_id: String,
    /// Session id bytes.
    pub session_id: Vec<u8>,
    /// Sequence.
    pub sequence: u64,
    /// Snapshot version.
    pub snapshot_version: u64,
    /// Ownership epoch.
    pub ownership_epoch: u64,
    /// Observation time.
    pub observed_at_unix_ms: i64,
    /// The counters, or the error the service answers for them (after the checks of the other
    /// fields, which come first).
    pub counters: Result<Counters, ServiceError>,
}

/// What the worker must do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Accepted; the Controller's ownership epoch.
    Accepted {
        /// Current ownership epoch.
        ownership_epoch: u64,
    },
    /// Nothing was written: resynchronise with a full snapshot.
    RequireFullSnapshot {
        /// Current ownership epoch.
        ownership_epoch: u64,
    },
}

/// Service failures; each maps to one gRPC code in the transport.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    /// A field is out of bounds (InvalidArgument). Names the field, never its value.
    #[error("invalid {0}")]
    Invalid(&'static str),
    /// Unsupported protocol version (FailedPrecondition).
    #[error("unsupported protocol version")]
    UnsupportedProtocol,
    /// The request's worker id is not the mTLS identity's (PermissionDenied).
    #[error("worker identity mismatch")]
    IdentityMismatch,
    /// Session replaced or expired (FailedPrecondition).
    #[error("stale session")]
    StaleSession,
    /// Report sequence went back (Aborted).
    #[error("stale report")]
    StaleReport,
    /// Same sequence, different content (AlreadyExists).
    #[error("conflicting report")]
    ConflictingReport,
    /// The store failed (Unavailable).
    #[error("store unavailable")]
    Unavailable,
}

/// A source of session ids (a CSPRNG in production; fixed in tests).
pub trait SessionIds: Send + Sync + 'static {
    /// A new random 128-bit id.
    fn next(&self) -> Result<SessionId, ServiceError>;
}

/// Session ids from the OS CSPRNG (*ring*'s `SystemRandom`).
#[derive(Debug, Default)]
pub struct SystemSessionIds;

impl SessionIds for SystemSessionIds {
    fn next(&self) -> Result<SessionId, ServiceError> {
        let mut id = [0u8; 16];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut id)
            .map_err(|_| ServiceError::Unavailable)?;
        Ok(id)
    }
}

/// `[A-Za-z0-9][A-Za-z0-9._-]{0,127}`.
pub fn valid_id(v: &str) -> bool {
    valid_id_bytes(v.as_bytes())
}

/// [`valid_id`] of raw bytes (ids are ASCII, so a valid one is valid UTF-8 too).
pub fn valid_id_bytes(b: &[u8]) -> bool {
    /// `[A-Za-z0-9._-]`.
    const ID_BYTE: [bool; 256] = {
        let mut t = [false; 256];
        let mut i = 0;
        while i < 256 {
            let c = i as u8;
            t[i] = c.is_ascii_alphanumeric() || c == b'.' || c == b'_' || c == b'-';
            i += 1;
        }
        t
    };
    match b.first() {
        Some(first) if b.len() <= MAX_ID_LEN && first.is_ascii_alphanumeric() => {
            // Every byte checked, no early exit: the loop vectorises.
            b.iter().fold(true, |ok, &c| ok & ID_BYTE[usize::from(c)])
        }
        _ => false,
    }
}

/// Empty or `[A-Z][A-Z0-9_]{0,63}`.
pub fn valid_error_code(v: &str) -> bool {
    let b = v.as_bytes();
    b.is_empty()
        || (b.len() <= MAX_ERROR_CODE
            && b[0].is_ascii_uppercase()
            && b.iter()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_'))
}

fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), ServiceError> {
    if labels.len() > MAX_LABELS {
        return Err(ServiceError::Invalid("labels"));
    }
    let mut total = 0usize;
    for (k, v) in labels {
        let trimmed = |s: &str| s.trim() == s;
        if k.is_empty() || k.len() > MAX_LABEL_KEY || !trimmed(k) || k.chars().any(char::is_control)
        {
            return Err(ServiceError::Invalid("label key"));
        }
        if v.len() > MAX_LABEL_VALUE || !trimmed(v) || v.chars().any(char::is_control) {
            return Err(ServiceError::Invalid("label value"));
        }
        total += k.len() + v.len();
    }
    if total > MAX_LABELS_TOTAL {
        return Err(ServiceError::Invalid("labels"));
    }
    Ok(())
}

fn session_id(v: &[u8]) -> Result<SessionId, ServiceError> {
    v.try_into()
        .map_err(|_| ServiceError::Invalid("session_id"))
}

fn store_error(e: StoreError) -> ServiceError {
    match e {
        StoreError::StaleSession => ServiceError::StaleSession,
        StoreError::StaleReport => ServiceError::StaleReport,
        StoreError::ConflictingReport => ServiceError::ConflictingReport,
        StoreError::SnapshotMismatch
        | StoreError::StaleAck
        | StoreError::ReferenceConflict
        | StoreError::Unavailable => ServiceError::Unavailable,
    }
}

/// The worker service (seed 004 §3.2): register, acknowledge, report runtime.
pub struct Service {
    store: Arc<dyn ControlStore>,
    config: ServiceConfig,
    ids: Arc<dyn SessionIds>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Service {
    /// A service over `store`.
    pub fn new(store: Arc<dyn ControlStore>, config: ServiceConfig) -> Self {
        Self::with_ids(store, config, Arc::new(SystemSessionIds))
    }

    /// As [`Service::new`] with a chosen session id source.
    pub fn with_ids(
        store: Arc<dyn ControlStore>,
        config: ServiceConfig,
        ids: Arc<dyn SessionIds>,
    ) -> Self {
        Self { store, config, ids }
    }

    /// The settings.
    pub fn config(&self) -> ServiceConfig {
        self.config
    }

    /// Registers a worker instance (seed 004 §5.1). `identity` is the worker id of the
    /// verified mTLS certificate, `None` when TLS is disabled (loopback only).
    pub async fn register(
        &self,
        cmd: &RegisterCommand,
        identity: Option<&str>,
    ) -> Result<Registration, ServiceError> {
        if cmd.supported_protocol_version != PROTOCOL_VERSION {
            return Err(ServiceError::UnsupportedProtocol);
        }
        if !valid_id(&cmd.worker_id) {
            return Err(ServiceError::Invalid("worker_id"));
        }
        if !valid_id(&cmd.instance_id) {
            return Err(ServiceError::Invalid("instance_id"));
        }
        if !cmd.zone.is_empty() && !valid_id(&cmd.zone) {
            return Err(ServiceError::Invalid("zone"));
        }
        validate_labels(&cmd.labels)?;
        if identity.is_some_and(|id| id != cmd.worker_id) {
            return Err(ServiceError::IdentityMismatch);
        }
        let ownership_epoch = self
            .store
            .current_ownership_epoch()
            .await
            .map_err(store_error)?;
        let session = Session {
            worker_id: cmd.worker_id.clone(),
            instance_id: cmd.instance_id.clone(),
            session_id: self.ids.next()?,
            acked: SnapshotTuple::default(),
            acked_checksum: [0; 32],
            runtime_enabled: false,
        };
        self.store
            .open_session(&session, self.config.session_ttl)
            .await
            .map_err(store_error)?;
        Ok(Registration {
            session_id: session.session_id,
            ownership_epoch,
            protocol_version: PROTOCOL_VERSION,
            heartbeat_interval: self.config.heartbeat_interval,
            max_stale_age: self.config.max_stale_age,
        })
    }

    /// Acknowledges a snapshot (seed 004 §5.2).
    pub async fn acknowledge(
        &self,
        cmd: &AcknowledgeCommand,
        identity: Option<&str>,
    ) -> Result<Decision, ServiceError> {
        if !valid_id(&cmd.worker_id) {
            return Err(ServiceError::Invalid("worker_id"));
        }
        if identity.is_some_and(|id| id != cmd.worker_id) {
            return Err(ServiceError::IdentityMismatch);
        }
        let session_id = session_id(&cmd.session_id)?;
        let checksum: Checksum = cmd
            .checksum
            .as_slice()
            .try_into()
            .map_err(|_| ServiceError::Invalid("checksum"))?;
        if !valid_error_code(&cmd.error_code) {
            return Err(ServiceError::Invalid("error_code"));
        }
        // Checked, then dropped: never logged or stored.
        if cmd.error_message.len() > MAX_ERROR_MESSAGE {
            return Err(ServiceError::Invalid("error_message"));
        }
        let ack = SnapshotAcknowledgement {
            worker_id: cmd.worker_id.clone(),
            session_id,
            tuple: SnapshotTuple {
                ownership_epoch: cmd.ownership_epoch,
                version: cmd.snapshot_version,
            },
            checksum,
            applied: cmd.applied,
        };
        let (outcome, ownership_epoch) = self
            .store
            .acknowledge_with_epoch(&ack, self.config.session_ttl)
            .await
            .map_err(store_error)?;
        decision(outcome, ownership_epoch)
    }

    /// Accepts a complete sparse runtime report (seed 004 §5.3).
    pub async fn report_runtime(
        &self,
        cmd: ReportCommand,
        identity: Option<&str>,
    ) -> Result<Decision, ServiceError> {
        let mut counters = CountersBuilder::new(self.config.max_runtime_counters);
        for (proxy_id, in_flight, open) in &cmd.counters {
            counters.push(proxy_id.as_bytes(), *in_flight, *open);
        }
        let cmd = CanonicalReportCommand {
            worker_id: cmd.worker_id,
            session_id: cmd.session_id,
            sequence: cmd.sequence,
            snapshot_version: cmd.snapshot_version,
            ownership_epoch: cmd.ownership_epoch,
            observed_at_unix_ms: cmd.observed_at_unix_ms,
            counters: counters.finish(),
        };
        self.report_canonical(cmd, identity).await
    }

    /// [`Service::report_runtime`] of a report whose counters were already put in canonical
    /// form (or refused) by a [`CountersBuilder`] made with this service's
    /// `max_runtime_counters`: what the gRPC transport decodes straight from the wire. The
    /// checks run in the same order, so the answer is the same for the same request.
    pub async fn report_canonical(
        &self,
        cmd: CanonicalReportCommand,
        identity: Option<&str>,
    ) -> Result<Decision, ServiceError> {
        if !valid_id(&cmd.worker_id) {
            return Err(ServiceError::Invalid("worker_id"));
        }
        if identity.is_some_and(|id| id != cmd.worker_id) {
            return Err(ServiceError::IdentityMismatch);
        }
        let session_id = session_id(&cmd.session_id)?;
        if cmd.sequence == 0 {
            return Err(ServiceError::Invalid("sequence"));
        }
        if cmd.observed_at_unix_ms <= 0 {
            return Err(ServiceError::Invalid("observed_at"));
        }
        let report = Report {
            worker_id: cmd.worker_id,
            session_id,
            sequence: cmd.sequence,
            tuple: SnapshotTuple {
                ownership_epoch: cmd.ownership_epoch,
                version: cmd.snapshot_version,
            },
            observed_at_unix_ms: cmd.observed_at_unix_ms,
            counters: cmd.counters?,
        };
        let (outcome, ownership_epoch) = self
            .store
            .replace_runtime_with_epoch(&report, self.config.session_ttl, self.config.max_stale_age)
            .await
            .map_err(store_error)?;
        decision(outcome, ownership_epoch)
    }
}

/// The answer to an ACK or a report from the store's outcome: accepted, or a snapshot mismatch
/// the worker resolves with a full snapshot; anything else is the error it maps to.
fn decision(
    outcome: Result<(), StoreError>,
    ownership_epoch: u64,
) -> Result<Decision, ServiceError> {
    match outcome {
        Ok(()) => Ok(Decision::Accepted { ownership_epoch }),
        // A stale ACK failed too, and its recovery is the same: a full snapshot.
        Err(StoreError::SnapshotMismatch | StoreError::StaleAck) => {
            Ok(Decision::RequireFullSnapshot { ownership_epoch })
        }
        Err(e) => Err(store_error(e)),
    }
}

/// The ACK rules of seed 004 §5.2 over a session and the published reference, shared by the
/// in-memory store and documented for the Redis script: returns the new session state, or the
/// refusal. `session` must already be the caller's (session id checked).
pub fn apply_ack(
    session: &Session,
    reference: Option<SnapshotReference>,
    ack: &SnapshotAcknowledgement,
) -> Result<AckEffect, StoreError> {
    // Behind the acknowledged upper bound: a stale ACK.
    if ack.tuple < session.acked {
        return Err(StoreError::StaleAck);
    }
    if ack.tuple == session.acked
        && session.acked != SnapshotTuple::default()
        && ack.checksum != session.acked_checksum
    {
        return Err(StoreError::SnapshotMismatch);
    }
    // Exactly the published reference, or nothing.
    let Some(r) = reference else {
        return Err(StoreError::SnapshotMismatch);
    };
    // An older version than the one published: stale too.
    if ack.tuple < r.tuple {
        return Err(StoreError::StaleAck);
    }
    if ack.tuple != r.tuple || ack.checksum != r.checksum {
        return Err(StoreError::SnapshotMismatch);
    }
    if !ack.applied {
        return Ok(AckEffect::Disable);
    }
    if ack.tuple > session.acked {
        Ok(AckEffect::Advance)
    } else if session.runtime_enabled {
        Ok(AckEffect::Renew)
    } else {
        Ok(AckEffect::Reenable)
    }
}

/// What an accepted ACK does to the session (every effect renews it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckEffect {
    /// Strictly forward: clear the runtime and its fence, store the new bound, enable runtime.
    Advance,
    /// The same ACK again with runtime enabled: renew only.
    Renew,
    /// The same ACK after a negative one: clear residual runtime, enable runtime.
    Reenable,
    /// Negative ACK: keep the bound, clear the runtime and its fence, disable runtime.
    Disable,
}

/// The report rules of seed 004 §5.3 against the session and the stored sequence fence
/// `(sequence, digest)`.
pub fn apply_report(
    session: &Session,
    fence: Option<(u64, [u8; 32])>,
    report: &Report,
) -> Result<ReportEffect, StoreError> {
    if !session.runtime_enabled || report.tuple != session.acked {
        return Err(StoreError::SnapshotMismatch);
    }
    match fence {
        Some((seq, _)) if report.sequence < seq => Err(StoreError::StaleReport),
        Some((seq, digest)) if report.sequence == seq => {
            if digest == report.digest() {
                Ok(ReportEffect::Replay)
            } else {
                Err(StoreError::ConflictingReport)
            }
        }
        _ => Ok(ReportEffect::Replace),
    }
}

/// What an accepted report does (both renew the session and the report TTL).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportEffect {
    /// A newer sequence: replace the runtime and the fence.
    Replace,
    /// The same sequence and content: renew only.
    Replay,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Bytes from a small alphabet (so that pairs share long prefixes and repeat), of lengths
    /// around the comparison's eight-byte words.
    fn near_ids() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(prop::sample::select(&b"\0ab.z9\xff"[..]), 0..26)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        /// The word-at-a-time comparison is the byte order, for any bytes.
        #[test]
        fn ids_compare_as_their_bytes(a in near_ids(), b in near_ids(), share in 0usize..26) {
            // Half the time `b` starts with a prefix of `a`.
            let b = if share % 2 == 0 {
                [&a[..share.min(a.len())], &b[..]].concat()
            } else {
                b
            };
            prop_assert_eq!(cmp_ids(&a, &b), a.cmp(&b));
            prop_assert_eq!(cmp_ids(&b, &a), b.cmp(&a));
            prop_assert_eq!(cmp_ids(&a, &a), std::cmp::Ordering::Equal);
        }

        /// Counters in any order come out sorted by id, one line each as `format!` writes
        /// it; a repeated id is refused whatever the order.
        #[test]
        fn counters_are_sorted_and_unique(
            counters in prop::collection::vec(
                ("[ab][ab.9]{0,17}", prop_oneof![0..12u64, Just(u64::MAX)], 0..12u64),
                0..24,
            ),
        ) {
            let model: BTreeMap<&str, (u64, u64)> =
                counters.iter().map(|(id, f, o)| (id.as_str(), (*f, *o))).collect();
            let built = Counters::new(
                counters
                    .iter()
                    .map(|(id, f, o)| Counter {
                        proxy_id: id.clone(),
                        in_flight: *f,
                        open_connections: *o,
                    })
                    .collect(),
            );
            if model.len() < counters.len() {
                prop_assert_eq!(built, Err(ServiceError::Invalid("duplicate proxy_id")));
            } else {
                let expected: String =
                    model.iter().map(|(id, (f, o))| format!("{id} {f} {o}\n")).collect();
                prop_assert_eq!(built.map(|c| c.canonical().to_vec()), Ok(expected.into_bytes()));
            }
        }
    }

    #[test]
    fn decimals_are_what_format_writes() {
        for n in [0, 1, 9, 10, 99, 100, 12_345, u64::from(u32::MAX), u64::MAX] {
            let mut out = Vec::new();
            push_decimal(&mut out, n);
            assert_eq!(out, n.to_string().into_bytes());
        }
    }

    #[test]
    fn canonical_counters_are_one_line_per_proxy() {
        let report = Report {
            worker_id: "w".into(),
            session_id: [0; 16],
            sequence: 1,
            tuple: SnapshotTuple::default(),
            observed_at_unix_ms: 1,
            counters: Counters::new(vec![
                Counter {
                    proxy_id: "b-2".into(),
                    in_flight: u64::MAX,
                    open_connections: 3,
                },
                Counter {
                    proxy_id: "a".into(),
                    in_flight: 0,
                    open_connections: 17,
                },
            ])
            .unwrap(),
        };
        assert_eq!(
            report.canonical_counters(),
            b"a 0 17\nb-2 18446744073709551615 3\n"
        );
        assert_eq!(report.counters.len(), 2);
        assert_eq!(
            report
                .counters
                .iter()
                .map(|c| c.proxy_id)
                .collect::<Vec<_>>(),
            ["a", "b-2"]
        );
        assert_eq!(
            Counters::from_canonical(report.canonical_counters()),
            Some(report.counters.clone())
        );
    }

    /// What the service did before counters were built in canonical form, kept as the oracle:
    /// the count limit, then each counter in input order (id, then sign), then sort and
    /// duplicates.
    fn reference(
        counters: &[(String, i64, i64)],
        max: usize,
    ) -> Result<Vec<Counter>, ServiceError> {
        if counters.len() > max {
            return Err(ServiceError::Invalid("counters"));
        }
        let mut out = Vec::new();
        for (proxy_id, in_flight, open) in counters {
            if !valid_id(proxy_id) {
                return Err(ServiceError::Invalid("proxy_id"));
            }
            let (Ok(in_flight), Ok(open_connections)) =
                (u64::try_from(*in_flight), u64::try_from(*open))
            else {
                return Err(ServiceError::Invalid("counter"));
            };
            out.push(Counter {
                proxy_id: proxy_id.clone(),
                in_flight,
                open_connections,
            });
        }
        out.sort_unstable();
        if out.windows(2).any(|w| w[0].proxy_id == w[1].proxy_id) {
            return Err(ServiceError::Invalid("duplicate proxy_id"));
        }
        Ok(out)
    }

    fn built(counters: &[(String, i64, i64)], max: usize) -> Result<Counters, ServiceError> {
        let mut b = CountersBuilder::new(max);
        for (id, f, o) in counters {
            b.push(id.as_bytes(), *f, *o);
        }
        b.finish()
    }

    #[test]
    fn the_builder_reports_what_the_service_reported() {
        let c = |id: &str, f: i64, o: i64| (id.to_owned(), f, o);
        type Case = (Vec<(String, i64, i64)>, usize);
        let cases: Vec<Case> = vec![
            (vec![], 0),
            (vec![c("a", 1, 2)], 0),
            (vec![c("b", 1, 2), c("a", 0, 0)], 2),
            (vec![c("a", 1, 2), c("a", 1, 2)], 5),
            (vec![c("b", 1, 2), c("a", 1, 2), c("b", 3, 4)], 5),
            (vec![c("a", -1, 2), c("", 1, 2)], 5),
            (vec![c("", -1, 2), c("a", -1, 2)], 5),
            (vec![c("a", 1, 2), c("a", 1, 2), c("c d", 1, 1)], 5),
            (vec![c("a", 1, i64::MIN), c("a", 1, 2)], 5),
            (vec![c("z", 0, 0), c("y", 0, 0), c("x", -3, 0)], 2),
            (vec![c("p-1", i64::MAX, 0), c("p-0", 0, i64::MAX)], 2),
        ];
        for (counters, max) in cases {
            let want = reference(&counters, max);
            let got = built(&counters, max).map(|c| c.to_vec());
            assert_eq!(got, want, "{counters:?} max {max}");
        }
    }

    proptest::proptest! {
        /// Any input, any order: the builder's answer is the old service's, and what it builds
        /// parses back to itself.
        #[test]
        fn the_builder_agrees_with_the_reference(
            counters in proptest::collection::vec(
                (
                    proptest::sample::select(vec!["a", "b", "p-1", "p-10", "p-2", "Z.9", "", "b c", "-x", "é"]),
                    proptest::prop_oneof![0..5i64, proptest::num::i64::ANY],
                    proptest::prop_oneof![0..5i64, proptest::num::i64::ANY],
                ),
                0..12,
            ),
            max in 0usize..14,
        ) {
            let counters: Vec<(String, i64, i64)> =
                counters.into_iter().map(|(id, f, o)| (id.to_owned(), f, o)).collect();
            let got = built(&counters, max);
            proptest::prop_assert_eq!(got.clone().map(|c| c.to_vec()), reference(&counters, max));
            if let Ok(c) = got {
                proptest::prop_assert_eq!(Counters::from_canonical(c.canonical()), Some(c.clone()));
                proptest::prop_assert_eq!(c.iter().count(), c.len());
            }
        }
    }

    #[test]
    fn from_canonical_refuses_what_the_builder_cannot_make() {
        for bad in [
            &b"a 1 2"[..],
            b"a 1\n",
            b"a 1 2 3\n",
            b"a 01 2\n",
            b"a -1 2\n",
            b"a 1 18446744073709551616\n",
            b"b 1 2\na 1 2\n",
            b"a 1 2\na 1 2\n",
            b" 1 2\n",
            b"\n",
        ] {
            assert_eq!(Counters::from_canonical(bad), None, "{bad:?}");
        }
        assert_eq!(Counters::from_canonical(b"").map(|c| c.len()), Some(0));
    }
}
