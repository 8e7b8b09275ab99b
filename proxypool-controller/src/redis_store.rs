//! The Redis [`ControlStore`], shared by every Controller replica (seed 004 §3.3), on one
//! Redis server or on a Redis Cluster ([`RedisStore::connect_to`]).
//!
//! Keys, on one server (all with the `{activity}` hash tag, so one slot holds them and one Lua
//! script may touch several, the epoch included):
//!
//! | key | type | content |
//! |---|---|---|
//! | `<ns>:{activity}:epoch` | string | the global ownership epoch; no TTL (any old TTL is removed on read) |
//! | `<ns>:{activity}:session:<worker>` | hash | `sid` (hex), `inst`, `av`/`ae` (acked version/epoch, decimal), `ac` (acked checksum, hex), `rt` (runtime enabled `0`/`1`), `seq`/`dg` (report sequence fence and digest); TTL = session TTL |
//! | `<ns>:{activity}:snapshot:<worker>` | hash | the published reference `v`, `e`, `c` |
//! | `<ns>:{activity}:runtime:<worker>` | string | the last report: `seq\nobserved_at\n` + canonical counters; TTL = max stale age |
//!
//! On a **Redis Cluster** one slot would put every key on one master, and the cluster would add
//! nothing. There each worker's keys carry the worker's own hash tag, and the epoch has its
//! own: `<ns>:{w:<worker>}:session` (likewise `snapshot`, `runtime`) and `<ns>:{epoch}:epoch`.
//! Worker ids are `[A-Za-z0-9._-]` (never a brace), so the tag is exactly the worker.
//!
//! **The epoch on a cluster.** Every check and write of an ACK or a report touches one
//! worker's keys only, so it stays one script in that worker's slot; the epoch is read in a
//! second call, after it (the epoch script, on the epoch's slot). That is as correct as the
//! single-slot answer: no rule of seed 004 checks an ACK or a report against the global
//! epoch (they are checked against the worker's session and its published reference, whose
//! tuples carry their own epoch); the epoch only goes back to the worker in the answer, as
//! the Controller's current epoch. And the epoch only moves forward, so the value read after
//! the script is the one current when the script ran or a newer one — exactly what a reply
//! sent a moment later would carry anyway. It costs one more round trip per ACK and report.
//!
//! **Moving from one server to a cluster** changes every key's name, so the new keyspace
//! starts empty: workers register again (their sessions are gone either way), but the epoch
//! must never go back. Copy it before the first controller starts on the cluster:
//! `SET <ns>:{epoch}:epoch <the value of <ns>:{activity}:epoch>`.
//!
//! **Durability** ([`RedisStore::with_durability`]): Redis replicates asynchronously, so a
//! write a master acknowledged can be lost when it fails before its replica has it. With a
//! durability setting each write script is followed by `WAIT <replicas> <timeout>` on the
//! master that ran it, and the write counts as done only when that many replicas have it
//! (otherwise the call fails as unavailable, and the worker retries).
//!
//! Every multi-key check-and-write (register, publish, ACK, report) is one Lua script, so a
//! failed step writes nothing. Numbers are compared as decimal strings (exact for all of
//! `u64`). Scripts run with EVALSHA and fall back to `SCRIPT LOAD` on `NOSCRIPT` (after a
//! restart or failover). Each call's command is built once, its arguments written straight into
//! it (a `ScriptCall`, not redis-rs's `ScriptInvocation`, which copies them on every attempt).
//! Nothing scans: every key is named.
//! Backend errors are logged at `debug` and surface as [`StoreError::Unavailable`] only.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bounded_http::redis::Connection;
/// Where the store's Redis is: one server, or a cluster's seeds.
pub use bounded_http::redis::Target;
use redis::Script;

use crate::domain::{
    ControlStore, Counter, Counters, Report, Session, SnapshotAcknowledgement, SnapshotReference,
    SnapshotTuple, StoreError, WorkerRecord,
};

const LIB: &str = r"
local function cmpnum(a, b)
  if #a ~= #b then
    if #a < #b then return -1 else return 1 end
  end
  if a == b then return 0 end
  if a < b then return -1 else return 1 end
end
local function cmptuple(ea, va, eb, vb)
  local c = cmpnum(ea, eb)
  if c ~= 0 then return c end
  return cmpnum(va, vb)
end
";

const EPOCH: &str = r"
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], '1')
  return '1'
end
redis.call('PERSIST', KEYS[1])
return v
";

const OPEN: &str = r"
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'sid', ARGV[1], 'inst', ARGV[2], 'av', '0', 'ae', '0', 'ac', '',
  'rt', '0', 'seq', '', 'dg', '')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 'OK'
";

const RECORD: &str = r"
local cur = redis.call('HMGET', KEYS[1], 'v', 'e', 'c')
if cur[1] then
  local o = cmptuple(ARGV[2], ARGV[1], cur[2], cur[1])
  if o < 0 then return 'REGRESS' end
  if o == 0 and cur[3] ~= ARGV[3] then return 'REGRESS' end
end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'e', ARGV[2], 'c', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 'OK'
";

const ACK: &str = r"
local s = redis.call('HMGET', KEYS[1], 'sid', 'av', 'ae', 'ac', 'rt')
if not s[1] or s[1] ~= ARGV[1] then return 'STALE_SESSION' end
local ct = cmptuple(ARGV[3], ARGV[2], s[3], s[2])
if ct < 0 then return 'STALE_ACK' end
if ct == 0 and not (s[2] == '0' and s[3] == '0') and s[4] ~= ARGV[4] then return 'MISMATCH' end
local r = redis.call('HMGET', KEYS[2], 'v', 'e', 'c')
if not r[1] then return 'MISMATCH' end
local cr = cmptuple(ARGV[3], ARGV[2], r[2], r[1])
if cr < 0 then return 'STALE_ACK' end
if cr ~= 0 or r[3] ~= ARGV[4] then return 'MISMATCH' end
if ARGV[5] == '1' then
  if ct > 0 then
    redis.call('DEL', KEYS[3])
    redis.call('HSET', KEYS[1], 'av', ARGV[2], 'ae', ARGV[3], 'ac', ARGV[4], 'rt', '1',
      'seq', '', 'dg', '')
  elseif s[5] ~= '1' then
    redis.call('DEL', KEYS[3])
    redis.call('HSET', KEYS[1], 'rt', '1', 'seq', '', 'dg', '')
  end
else
  redis.call('DEL', KEYS[3])
  redis.call('HSET', KEYS[1], 'rt', '0', 'seq', '', 'dg', '')
end
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 'OK'
";

const REPORT: &str = r"
local s = redis.call('HMGET', KEYS[1], 'sid', 'av', 'ae', 'rt', 'seq', 'dg')
if not s[1] or s[1] ~= ARGV[1] then return 'STALE_SESSION' end
if s[4] ~= '1' or s[2] ~= ARGV[3] or s[3] ~= ARGV[4] then return 'MISMATCH' end
if s[5] and s[5] ~= '' then
  local o = cmpnum(ARGV[2], s[5])
  if o < 0 then return 'STALE' end
  if o == 0 then
    if s[6] ~= ARGV[5] then return 'CONFLICT' end
    redis.call('PEXPIRE', KEYS[1], ARGV[7])
    redis.call('PEXPIRE', KEYS[2], ARGV[8])
    return 'OK'
  end
end
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'dg', ARGV[5])
redis.call('SET', KEYS[2], ARGV[6], 'PX', ARGV[8])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return 'OK'
";

/// A script that also returns the ownership epoch (its last key), read and initialised exactly as
/// [`EPOCH`] does, in the same atomic step: `"<status> <epoch>"`. The body's own `return`s end
/// its `main()`.
fn with_epoch(body: &str) -> String {
    format!(
        "{LIB}local function main()\n{body}\nend\nlocal st = main()\n\
local ek = KEYS[#KEYS]\nlocal ev = redis.call('GET', ek)\n\
if not ev then\n  redis.call('SET', ek, '1')\n  ev = '1'\nelse\n  redis.call('PERSIST', ek)\nend\n\
return st .. ' ' .. ev\n"
    )
}

/// `"<status> <epoch>"` from a [`with_epoch`] script.
fn status_and_epoch(answer: &str) -> Result<(Result<(), StoreError>, u64), StoreError> {
    let (st, epoch) = answer.split_once(' ').ok_or(StoreError::Unavailable)?;
    let epoch = epoch.parse::<u64>().map_err(|_| StoreError::Unavailable)?;
    let outcome = status(st);
    if outcome == Err(StoreError::Unavailable) {
        return Err(StoreError::Unavailable);
    }
    Ok((outcome, epoch.max(1)))
}

/// How many replicas must hold a write before the store counts it done
/// ([`RedisStore::with_durability`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Durability {
    /// Replicas that must acknowledge each write (`WAIT <replicas>`).
    pub replicas: u32,
    /// How long to wait for them; past it the write fails as unavailable.
    pub timeout: Duration,
}

/// The Redis store.
#[derive(Clone)]
pub struct RedisStore {
    conn: Arc<std::sync::RwLock<Connection>>,
    /// Where it connects, for [`RedisStore::recover`].
    target: Target,
    /// When a cluster connection was last rebuilt.
    rebuilt: Arc<tokio::sync::Mutex<Option<std::time::Instant>>>,
    /// Per-worker hash tags (a cluster) instead of the one `{activity}` slot.
    per_worker: bool,
    durability: Option<Durability>,
    prefix: String,
    epoch: Script,
    open: Script,
    record: Script,
    ack: Script,
    report: Script,
    ack_epoch: Script,
    report_epoch: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn backend(e: &redis::RedisError) -> StoreError {
    tracing::debug!(error = %e, "redis store error");
    StoreError::Unavailable
}

/// Lowercase hex (session ids, checksums and digests travel to Redis as hex text).
fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(char::from(DIGITS[usize::from(x >> 4)]));
        s.push(char::from(DIGITS[usize::from(x & 0x0f)]));
    }
    s
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != N * 2 {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// One script call, written straight into the `EVALSHA` command that goes to Redis.
///
/// redis-rs's `ScriptInvocation` gathers keys and arguments in vectors of their own and copies
/// them into a fresh command on every attempt; a report's ≈ 16 KB of counters were written
/// into a growing vector, then copied into the command. Here each argument is written once,
/// into a command sized for it, and the same command is sent again after a `NOSCRIPT`. (redis-rs
/// still copies the command twice on its way to the socket: packed, then into its codec's
/// buffer.) Keys go first, as `EVALSHA` wants them: every key is given to [`ScriptCall::new`].
struct ScriptCall<'a> {
    script: &'a Script,
    cmd: redis::Cmd,
}

impl<'a> ScriptCall<'a> {
    /// `EVALSHA <script's SHA-1> <keys.len()> <keys…>`, with room for `args` more arguments
    /// of about `arg_bytes` in all.
    fn new(script: &'a Script, keys: &[&str], args: usize, arg_bytes: usize) -> Self {
        let key_bytes: usize = keys.iter().map(|k| k.len()).sum();
        let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + args, 64 + key_bytes + arg_bytes);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys.len());
        for key in keys {
            cmd.arg(*key);
        }
        Self { script, cmd }
    }

    /// Adds an argument (`ARGV[n]`, in order).
    fn arg(&mut self, arg: impl redis::ToRedisArgs) -> &mut Self {
        self.cmd.arg(arg);
        self
    }
}

fn status(s: &str) -> Result<(), StoreError> {
    match s {
        "OK" => Ok(()),
        "STALE_SESSION" => Err(StoreError::StaleSession),
        "MISMATCH" => Err(StoreError::SnapshotMismatch),
        "STALE_ACK" => Err(StoreError::StaleAck),
        "STALE" => Err(StoreError::StaleReport),
        "CONFLICT" => Err(StoreError::ConflictingReport),
        "REGRESS" => Err(StoreError::ReferenceConflict),
        _ => Err(StoreError::Unavailable),
    }
}

/// Whether `ns` is usable as a key namespace (no braces: the hash tag must stay `activity`).
fn valid_namespace(ns: &str) -> bool {
    !ns.is_empty()
        && ns.len() <= 64
        && ns
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

impl RedisStore {
    /// Connects to one Redis server at `url` (`redis://host:port/db`) with keys under
    /// `namespace`.
    pub async fn connect(url: &str, namespace: &str) -> Result<Self, StoreError> {
        Self::connect_to(&Target::Single(url.to_owned()), namespace).await
    }

    /// Connects to one server or a Redis Cluster (keys laid out per worker there: see the
    /// module docs), with keys under `namespace`. Every call is bounded (2 s): it fails as
    /// unavailable rather than hang while Redis is down, and the connection recovers in the
    /// background (the cluster client follows slot moves and failovers).
    pub async fn connect_to(target: &Target, namespace: &str) -> Result<Self, StoreError> {
        if !valid_namespace(namespace) {
            return Err(StoreError::Unavailable);
        }
        let conn = Connection::connect(target, Duration::from_secs(2))
            .await
            .map_err(|e| backend(&e))?;
        let per_worker = conn.is_cluster();
        let script = |body: &str| Script::new(&format!("{LIB}{body}"));
        Ok(Self {
            conn: Arc::new(std::sync::RwLock::new(conn)),
            target: target.clone(),
            rebuilt: Arc::default(),
            per_worker,
            durability: None,
            prefix: if per_worker {
                format!("{namespace}:")
            } else {
                format!("{namespace}:{{activity}}:")
            },
            epoch: script(EPOCH),
            open: script(OPEN),
            record: script(RECORD),
            ack: script(ACK),
            report: script(REPORT),
            ack_epoch: Script::new(&with_epoch(ACK)),
            report_epoch: Script::new(&with_epoch(REPORT)),
        })
    }

    /// Each write counts as done only once `durability.replicas` replicas hold it (see the
    /// module docs); `None` (the default): once the master has it.
    pub fn with_durability(mut self, durability: Option<Durability>) -> Self {
        self.durability = durability;
        self
    }

    /// Whether the keys are laid out per worker (a cluster).
    pub fn is_per_worker(&self) -> bool {
        self.per_worker
    }

    /// Runs a write script, then, with a durability setting, `WAIT`s on the master that ran
    /// it (the one holding `key`) until enough replicas have it.
    async fn run_write(&self, call: &ScriptCall<'_>, key: &str) -> Result<String, StoreError> {
        let answer = self.run(call).await?;
        let Some(d) = self.durability else {
            return Ok(answer);
        };
        let mut wait = redis::cmd("WAIT");
        wait.arg(d.replicas).arg(millis(d.timeout));
        let acked: i64 = match &self.conn() {
            Connection::Cluster(c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::with_key(key, SlotAddr::Master),
                ));
                let v = c
                    .clone()
                    .route_command(wait, route)
                    .await
                    .map_err(|e| backend(&e))?;
                redis::from_redis_value(v).map_err(|e| backend(&e.into()))?
            }
            Connection::Single(_) => {
                let mut conn = self.conn();
                wait.query_async(&mut conn).await.map_err(|e| backend(&e))?
            }
        };
        if acked < i64::from(d.replicas) {
            tracing::debug!(
                acked,
                want = d.replicas,
                "redis store: too few replicas acknowledged a write"
            );
            return Err(StoreError::Unavailable);
        }
        Ok(answer)
    }

    /// Runs a script: EVALSHA, and on `NOSCRIPT` (the script cache is empty after a restart or
    /// a failover) `SCRIPT LOAD` and the same EVALSHA again; at most three loads in a row (the
    /// cache can be flushed again in between, e.g. during a failover).
    async fn run(&self, call: &ScriptCall<'_>) -> Result<String, StoreError> {
        let mut conn = self.conn();
        let mut loads = 0;
        loop {
            let e = match call.cmd.query_async::<String>(&mut conn).await {
                Ok(v) => return Ok(v),
                Err(e)
                    if loads < 3
                        && e.kind()
                            == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    loads += 1;
                    match call.script.load_async(&mut conn).await {
                        Ok(_) => continue,
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            };
            self.recover().await;
            return Err(backend(&e));
        }
    }

    /// The current connection.
    fn conn(&self) -> Connection {
        self.conn
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// After a failed call on a cluster: builds a new cluster connection (at most once a
    /// second), so the next call starts from the cluster's topology as it is now. redis-rs's
    /// cluster connection, left idle while a master died, was seen to keep failing long after
    /// the failover ended (`redis_failover` found it: a fresh client read at once, the old one
    /// not within 30 s); one server's connection manager reconnects on its own.
    async fn recover(&self) {
        if !self.per_worker {
            return;
        }
        let mut last = self.rebuilt.lock().await;
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        *last = Some(std::time::Instant::now());
        match Connection::connect(&self.target, Duration::from_secs(2)).await {
            Ok(c) => {
                *self
                    .conn
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = c;
                tracing::info!("redis store: cluster connection rebuilt after a failed call");
            }
            Err(e) => tracing::debug!(error = %e, "redis store: cluster reconnect failed"),
        }
    }

    fn key(&self, kind: &str, worker_id: &str) -> String {
        let mut key = String::with_capacity(self.prefix.len() + kind.len() + 5 + worker_id.len());
        key.push_str(&self.prefix);
        if self.per_worker {
            key.push_str("{w:");
            key.push_str(worker_id);
            key.push_str("}:");
            key.push_str(kind);
        } else {
            key.push_str(kind);
            key.push(':');
            key.push_str(worker_id);
        }
        key
    }

    /// The Redis key of `kind` (`session`, `snapshot`, `runtime`) for `worker_id` (tests and
    /// operators inspecting Redis).
    pub fn key_of(&self, kind: &str, worker_id: &str) -> String {
        self.key(kind, worker_id)
    }

    /// The epoch key (tests: set a TTL on it to check that reads remove it).
    pub fn epoch_key(&self) -> String {
        if self.per_worker {
            format!("{}{{epoch}}:epoch", self.prefix)
        } else {
            format!("{}epoch", self.prefix)
        }
    }

    /// A connection for tests and the load tool's raw baseline.
    pub fn connection(&self) -> Connection {
        self.conn()
    }

    /// The SHA-1 `EVALSHA` names the report script by. The load tool's raw baseline sends the
    /// script itself with arguments it builds once (keys from [`RedisStore::key_of`]; `ARGV`:
    /// session id hex, sequence, version, epoch, digest hex, stored blob, session TTL ms, report
    /// TTL ms).
    pub fn report_script_hash(&self) -> &str {
        self.report.get_hash()
    }

    /// The SHA-1s of the scripts the controller runs for a report and for an ACK: the variants
    /// that also return the ownership epoch, `"<status> <epoch>"` (the load tool's minimal
    /// tonic server runs them with arguments it takes from the request). Their keys are those
    /// of [`RedisStore::report_script_hash`] (report) or `session`, `snapshot`, `runtime` (ACK),
    /// then [`RedisStore::epoch_key`]; the ACK's `ARGV`: session id hex, version, epoch,
    /// checksum hex, `1`/`0` applied, session TTL ms. Redis knows them once the controller
    /// has run each once.
    pub fn with_epoch_script_hashes(&self) -> (&str, &str) {
        (self.report_epoch.get_hash(), self.ack_epoch.get_hash())
    }

    /// The ACK `script` ([`ACK`], or it returning the epoch too, then with `epoch_key` as its
    /// last key) with `ack`'s keys and args.
    fn ack_call<'a>(
        &self,
        script: &'a Script,
        ack: &SnapshotAcknowledgement,
        ttl: Duration,
        epoch_key: Option<&str>,
    ) -> ScriptCall<'a> {
        let (session, snapshot, runtime) = (
            self.key("session", &ack.worker_id),
            self.key("snapshot", &ack.worker_id),
            self.key("runtime", &ack.worker_id),
        );
        let mut keys = vec![session.as_str(), snapshot.as_str(), runtime.as_str()];
        keys.extend(epoch_key);
        let mut call = ScriptCall::new(script, &keys, 6, 160);
        call.arg(hex(&ack.session_id))
            .arg(ack.tuple.version)
            .arg(ack.tuple.ownership_epoch)
            .arg(hex(&ack.checksum))
            .arg(if ack.applied { "1" } else { "0" })
            .arg(millis(ttl));
        call
    }

    /// The report `script` ([`REPORT`], or it returning the epoch too, then with `epoch_key`
    /// as its last key) with `report`'s keys and args.
    fn report_call<'a>(
        &self,
        script: &'a Script,
        report: &Report,
        session_ttl: Duration,
        report_ttl: Duration,
        epoch_key: Option<&str>,
    ) -> ScriptCall<'a> {
        let digest = report.digest();
        let (session, runtime) = (
            self.key("session", &report.worker_id),
            self.key("runtime", &report.worker_id),
        );
        let mut keys = vec![session.as_str(), runtime.as_str()];
        keys.extend(epoch_key);
        // The blob's two decimal lines are at most 41 bytes; the other arguments at most 200.
        let blob = StoredReport(report);
        let mut call = ScriptCall::new(script, &keys, 8, 256 + report.canonical_counters().len());
        call.arg(hex(&report.session_id))
            .arg(report.sequence)
            .arg(report.tuple.version)
            .arg(report.tuple.ownership_epoch)
            .arg(hex(&digest))
            .arg(blob)
            .arg(millis(session_ttl))
            .arg(millis(report_ttl));
        call
    }

    /// Reads a worker's session and its report sequence fence (tests and the crash-test model
    /// check): [`RedisStore::record`]'s.
    pub async fn session(
        &self,
        worker_id: &str,
    ) -> Result<Option<(Session, Option<u64>)>, StoreError> {
        let record = self.record(worker_id).await?;
        Ok(record
            .session
            .map(|s| (s, record.fence.map(|(seq, _)| seq))))
    }

    /// Reads everything held for a worker (the differential test against the reference store):
    /// session, fence, published reference and runtime, in one `MULTI` so they agree.
    pub async fn record(&self, worker_id: &str) -> Result<WorkerRecord, StoreError> {
        let mut conn = self.conn();
        type Raw = (
            std::collections::HashMap<String, String>,
            std::collections::HashMap<String, String>,
            Option<Vec<u8>>,
        );
        let raw: Result<Raw, StoreError> = redis::pipe()
            .atomic()
            .cmd("HGETALL")
            .arg(self.key("session", worker_id))
            .cmd("HGETALL")
            .arg(self.key("snapshot", worker_id))
            .cmd("GET")
            .arg(self.key("runtime", worker_id))
            .query_async(&mut conn)
            .await
            .map_err(|e| backend(&e));
        if raw.is_err() {
            self.recover().await;
        }
        let (s, r, blob) = raw?;
        let field = |m: &std::collections::HashMap<String, String>, k: &str| {
            m.get(k).cloned().unwrap_or_default()
        };
        let num = |m: &std::collections::HashMap<String, String>, k: &str| {
            field(m, k)
                .parse::<u64>()
                .map_err(|_| StoreError::Unavailable)
        };
        let mut out = WorkerRecord::default();
        if !s.is_empty() {
            out.session = Some(Session {
                worker_id: worker_id.to_owned(),
                instance_id: field(&s, "inst"),
                session_id: unhex::<16>(&field(&s, "sid")).ok_or(StoreError::Unavailable)?,
                acked: SnapshotTuple {
                    ownership_epoch: num(&s, "ae")?,
                    version: num(&s, "av")?,
                },
                acked_checksum: match field(&s, "ac").as_str() {
                    "" => [0; 32],
                    c => unhex::<32>(c).ok_or(StoreError::Unavailable)?,
                },
                runtime_enabled: field(&s, "rt") == "1",
            });
            if !field(&s, "seq").is_empty() {
                out.fence = Some((
                    num(&s, "seq")?,
                    unhex::<32>(&field(&s, "dg")).ok_or(StoreError::Unavailable)?,
                ));
            }
        }
        if !r.is_empty() {
            out.reference = Some(SnapshotReference {
                tuple: SnapshotTuple {
                    ownership_epoch: num(&r, "e")?,
                    version: num(&r, "v")?,
                },
                checksum: unhex::<32>(&field(&r, "c")).ok_or(StoreError::Unavailable)?,
            });
        }
        if let Some(blob) = blob {
            out.runtime = Some(decode_runtime(&blob).ok_or(StoreError::Unavailable)?);
        }
        Ok(out)
    }

    /// Reads a worker's stored runtime: `(sequence, counters)`, [`RedisStore::record`]'s.
    pub async fn runtime(
        &self,
        worker_id: &str,
    ) -> Result<Option<(u64, Vec<Counter>)>, StoreError> {
        let record = self.record(worker_id).await?;
        Ok(record.runtime.map(|(seq, _, counters)| (seq, counters)))
    }
}

/// `seq\nobserved_at\n` + canonical counters, as the report script stores it.
fn decode_runtime(blob: &[u8]) -> Option<(u64, i64, Vec<Counter>)> {
    let mut parts = blob.splitn(3, |&c| c == b'\n');
    let seq = std::str::from_utf8(parts.next()?).ok()?.parse().ok()?;
    let observed: i64 = std::str::from_utf8(parts.next()?).ok()?.parse().ok()?;
    let counters = Counters::from_canonical(parts.next()?)?;
    Some((seq, observed, counters.to_vec()))
}

#[async_trait]
impl ControlStore for RedisStore {
    async fn current_ownership_epoch(&self) -> Result<u64, StoreError> {
        let v = self
            .run(&ScriptCall::new(&self.epoch, &[&self.epoch_key()], 0, 0))
            .await?;
        let epoch = v.parse::<u64>().map_err(|_| StoreError::Unavailable)?;
        Ok(epoch.max(1))
    }

    async fn open_session(&self, session: &Session, ttl: Duration) -> Result<(), StoreError> {
        let (key, runtime) = (
            self.key("session", &session.worker_id),
            self.key("runtime", &session.worker_id),
        );
        let mut call = ScriptCall::new(&self.open, &[&key, &runtime], 3, 256);
        call.arg(hex(&session.session_id))
            .arg(&session.instance_id)
            .arg(millis(ttl));
        status(&self.run_write(&call, &key).await?)
    }

    async fn record_issued_snapshot(
        &self,
        worker_id: &str,
        reference: SnapshotReference,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let key = self.key("snapshot", worker_id);
        let mut call = ScriptCall::new(&self.record, &[&key], 4, 128);
        call.arg(reference.tuple.version)
            .arg(reference.tuple.ownership_epoch)
            .arg(hex(&reference.checksum))
            .arg(millis(ttl));
        status(&self.run_write(&call, &key).await?)
    }

    async fn acknowledge_snapshot(
        &self,
        ack: &SnapshotAcknowledgement,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let call = self.ack_call(&self.ack, ack, ttl, None);
        status(
            &self
                .run_write(&call, &self.key("session", &ack.worker_id))
                .await?,
        )
    }

    async fn replace_runtime(
        &self,
        report: &Report,
        session_ttl: Duration,
        report_ttl: Duration,
    ) -> Result<(), StoreError> {
        let call = self.report_call(&self.report, report, session_ttl, report_ttl, None);
        status(
            &self
                .run_write(&call, &self.key("session", &report.worker_id))
                .await?,
        )
    }

    async fn acknowledge_with_epoch(
        &self,
        ack: &SnapshotAcknowledgement,
        ttl: Duration,
    ) -> Result<(Result<(), StoreError>, u64), StoreError> {
        if self.per_worker {
            // The worker's slot, then the epoch's (see the module docs).
            let outcome = self.acknowledge_snapshot(ack, ttl).await;
            if outcome == Err(StoreError::Unavailable) {
                return Err(StoreError::Unavailable);
            }
            return Ok((outcome, self.current_ownership_epoch().await?));
        }
        let call = self.ack_call(&self.ack_epoch, ack, ttl, Some(&self.epoch_key()));
        status_and_epoch(
            &self
                .run_write(&call, &self.key("session", &ack.worker_id))
                .await?,
        )
    }

    async fn replace_runtime_with_epoch(
        &self,
        report: &Report,
        session_ttl: Duration,
        report_ttl: Duration,
    ) -> Result<(Result<(), StoreError>, u64), StoreError> {
        if self.per_worker {
            let outcome = self.replace_runtime(report, session_ttl, report_ttl).await;
            if outcome == Err(StoreError::Unavailable) {
                return Err(StoreError::Unavailable);
            }
            return Ok((outcome, self.current_ownership_epoch().await?));
        }
        let epoch_key = self.epoch_key();
        let call = self.report_call(
            &self.report_epoch,
            report,
            session_ttl,
            report_ttl,
            Some(&epoch_key),
        );
        status_and_epoch(
            &self
                .run_write(&call, &self.key("session", &report.worker_id))
                .await?,
        )
    }
}

/// The stored runtime blob of a report, `sequence '\n' observed_at '\n'` and the canonical
/// counters, written straight into the script's argument in the [`ScriptCall`]'s command: the
/// counters (about 16 KB for 1000) are not first copied into a blob of their own.
struct StoredReport<'a>(&'a Report);

impl redis::ToRedisArgs for StoredReport<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        let mut arg = out.writer_for_next_arg();
        // Writes into memory: they cannot fail.
        let _ = write!(arg, "{}\n{}\n", self.0.sequence, self.0.observed_at_unix_ms);
        let _ = arg.write_all(self.0.canonical_counters());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_lowercase_and_round_trips() {
        let bytes: Vec<u8> = (0..=255).collect();
        let want: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex(&bytes), want);
        let digest = [0xa5; 32];
        assert_eq!(unhex::<32>(&hex(&digest)), Some(digest));
    }

    #[test]
    fn stored_runtime_parses_back_strictly() {
        assert_eq!(
            decode_runtime(b"7\n-3\na 1 2\nb 0 0\n").map(|(s, o, c)| (s, o, c.len())),
            Some((7, -3, 2))
        );
        assert_eq!(decode_runtime(b"7\n1\n"), Some((7, 1, Vec::new())));
        assert_eq!(
            decode_runtime(b"7\n1\nb 1 2\na 1 2\n"),
            None,
            "not canonical"
        );
        assert_eq!(decode_runtime(b"7\n1"), None);
    }
}
