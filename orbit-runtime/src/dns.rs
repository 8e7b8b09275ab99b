//! DNS providers for system endpoint records (seed `003`, "Heartbeat").
//!
//! A reported address writes an `A` (IPv4) or `AAAA` (IPv6) record for each eligible endpoint
//! name of the Node, never proxied (`proxied=false` for Cloudflare-style providers), as an
//! idempotent create-or-update. [`MemoryDns`] is the embedded default; [`Rfc2136Dns`] updates a
//! real authoritative server (TSIG-signed RFC 2136 UPDATEs) and also serves ACME DNS-01 TXT
//! records ([`TxtProvider`]); [`CloudflareDns`] speaks the Cloudflare-style REST API.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;

use async_trait::async_trait;

/// The record type for an address.
pub fn record_type(addr: IpAddr) -> &'static str {
    match addr {
        IpAddr::V4(_) => "A",
        IpAddr::V6(_) => "AAAA",
    }
}

/// A DNS failure (no provider detail).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DnsError {
    /// The provider refused or failed.
    #[error("dns provider unavailable")]
    Unavailable,
}

/// A place to write endpoint address records.
#[async_trait]
pub trait DnsProvider: Send + Sync + 'static {
    /// Creates or updates the single `A`/`AAAA` record of `name` to `addr` (not proxied).
    async fn upsert_address(&self, name: &str, addr: IpAddr) -> Result<(), DnsError>;
    /// The current address record of `name`, if any.
    async fn address(&self, name: &str) -> Result<Option<IpAddr>, DnsError>;
}

/// In-memory records (the embedded default and the tests' model).
#[derive(Debug, Default)]
pub struct MemoryDns {
    records: Mutex<BTreeMap<String, IpAddr>>,
    writes: Mutex<u64>,
}

impl MemoryDns {
    /// How many writes were made (idempotence checks).
    pub fn writes(&self) -> u64 {
        *self
            .writes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait]
impl DnsProvider for MemoryDns {
    async fn upsert_address(&self, name: &str, addr: IpAddr) -> Result<(), DnsError> {
        let mut records = self
            .records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if records.get(name) != Some(&addr) {
            records.insert(name.to_owned(), addr);
            *self
                .writes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
        }
        Ok(())
    }

    async fn address(&self, name: &str) -> Result<Option<IpAddr>, DnsError> {
        Ok(self
            .records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(name)
            .copied())
    }
}

/// TXT records (ACME DNS-01 challenges).
#[async_trait]
pub trait TxtProvider: Send + Sync + 'static {
    /// Adds the TXT value `value` at `name` (other values there are kept).
    async fn add_txt(&self, name: &str, value: &str) -> Result<(), DnsError>;
    /// Deletes exactly the TXT value `value` at `name` (other values there are kept).
    async fn delete_txt(&self, name: &str, value: &str) -> Result<(), DnsError>;
}

/// An RFC 2136 dynamic-update client for one zone on one authoritative server, signing every
/// update with TSIG (RFC 8945, `hmac-sha256`). Address records are replaced as one RRset
/// (delete the name's `A`/`AAAA` RRset, add the new record, in one UPDATE message: atomic on the
/// server); TXT values are added and deleted individually. Reads are plain queries to the same
/// server. Limits: UDP only (updates and answers fit easily), a 3 s timeout with one retry; the
/// server's TSIG on the response is not verified (the response code is checked).
#[derive(Clone)]
pub struct Rfc2136Dns {
    server: std::net::SocketAddr,
    zone: String,
    key_name: String,
    secret: Vec<u8>,
    ttl: u32,
}

impl std::fmt::Debug for Rfc2136Dns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rfc2136Dns")
            .field("server", &self.server)
            .field("zone", &self.zone)
            .field("key_name", &self.key_name)
            .finish_non_exhaustive()
    }
}

const TYPE_A: u16 = 1;
const TYPE_SOA: u16 = 6;
const TYPE_TXT: u16 = 16;
const TYPE_AAAA: u16 = 28;
const TYPE_TSIG: u16 = 250;
const CLASS_IN: u16 = 1;
const CLASS_NONE: u16 = 254;
const CLASS_ANY: u16 = 255;
const TSIG_FUDGE: u16 = 300;

fn put_name(out: &mut Vec<u8>, name: &str) -> Result<(), DnsError> {
    for label in name.trim_end_matches('.').split('.') {
        let l = label.as_bytes();
        if l.is_empty() || l.len() > 63 {
            return Err(DnsError::Unavailable);
        }
        out.push(l.len() as u8);
        out.extend_from_slice(&l.to_ascii_lowercase());
    }
    out.push(0);
    Ok(())
}

fn put_rr(
    out: &mut Vec<u8>,
    name: &str,
    rtype: u16,
    class: u16,
    ttl: u32,
    rdata: &[u8],
) -> Result<(), DnsError> {
    put_name(out, name)?;
    out.extend_from_slice(&rtype.to_be_bytes());
    out.extend_from_slice(&class.to_be_bytes());
    out.extend_from_slice(&ttl.to_be_bytes());
    let len = u16::try_from(rdata.len()).map_err(|_| DnsError::Unavailable)?;
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(rdata);
    Ok(())
}

fn txt_rdata(value: &str) -> Result<Vec<u8>, DnsError> {
    let v = value.as_bytes();
    if v.len() > 255 {
        return Err(DnsError::Unavailable);
    }
    let mut r = vec![v.len() as u8];
    r.extend_from_slice(v);
    Ok(r)
}

/// Skips a (possibly compressed) name at `pos`; returns the position after it.
fn skip_name(msg: &[u8], mut pos: usize) -> Option<usize> {
    for _ in 0..128 {
        let len = *msg.get(pos)?;
        if len == 0 {
            return Some(pos + 1);
        }
        if len & 0xC0 == 0xC0 {
            return Some(pos + 2);
        }
        pos += 1 + usize::from(len);
    }
    None
}

impl Rfc2136Dns {
    /// A client for `zone` on `server`, with the TSIG key `key_name` (hmac-sha256) and its
    /// secret; records get `ttl` seconds.
    pub fn new(
        server: std::net::SocketAddr,
        zone: &str,
        key_name: &str,
        secret: Vec<u8>,
        ttl: u32,
    ) -> Self {
        Self {
            server,
            zone: zone.trim_end_matches('.').to_ascii_lowercase(),
            key_name: key_name.trim_end_matches('.').to_ascii_lowercase(),
            secret,
            ttl,
        }
    }

    fn in_zone(&self, name: &str) -> bool {
        let n = name.trim_end_matches('.').to_ascii_lowercase();
        n == self.zone || n.ends_with(&format!(".{}", self.zone))
    }

    /// Builds and signs an UPDATE with `updates` (already encoded RRs, `count` of them).
    fn update_message(&self, id: u16, updates: &[u8], count: u16) -> Result<Vec<u8>, DnsError> {
        let mut msg = Vec::with_capacity(128 + updates.len());
        msg.extend_from_slice(&id.to_be_bytes());
        msg.extend_from_slice(&0x2800u16.to_be_bytes()); // opcode UPDATE
        msg.extend_from_slice(&1u16.to_be_bytes()); // ZOCOUNT
        msg.extend_from_slice(&0u16.to_be_bytes()); // PRCOUNT
        msg.extend_from_slice(&count.to_be_bytes()); // UPCOUNT
        msg.extend_from_slice(&0u16.to_be_bytes()); // ADCOUNT (TSIG added below)
        put_name(&mut msg, &self.zone)?;
        msg.extend_from_slice(&TYPE_SOA.to_be_bytes());
        msg.extend_from_slice(&CLASS_IN.to_be_bytes());
        msg.extend_from_slice(updates);
        self.sign(id, msg)
    }

    /// Appends the TSIG RR (RFC 8945 §4.3) to `msg`.
    fn sign(&self, id: u16, mut msg: Vec<u8>) -> Result<Vec<u8>, DnsError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut key_wire = Vec::new();
        put_name(&mut key_wire, &self.key_name)?;
        let mut alg_wire = Vec::new();
        put_name(&mut alg_wire, "hmac-sha256")?;
        let time48 = &now.to_be_bytes()[2..8];
        // The MAC covers the message, then the TSIG variables.
        let mut signed = msg.clone();
        signed.extend_from_slice(&key_wire);
        signed.extend_from_slice(&CLASS_ANY.to_be_bytes());
        signed.extend_from_slice(&0u32.to_be_bytes());
        signed.extend_from_slice(&alg_wire);
        signed.extend_from_slice(time48);
        signed.extend_from_slice(&TSIG_FUDGE.to_be_bytes());
        signed.extend_from_slice(&0u16.to_be_bytes()); // error
        signed.extend_from_slice(&0u16.to_be_bytes()); // other len
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.secret);
        let mac = ring::hmac::sign(&key, &signed);
        let mut rdata = alg_wire;
        rdata.extend_from_slice(time48);
        rdata.extend_from_slice(&TSIG_FUDGE.to_be_bytes());
        rdata.extend_from_slice(&(mac.as_ref().len() as u16).to_be_bytes());
        rdata.extend_from_slice(mac.as_ref());
        rdata.extend_from_slice(&id.to_be_bytes());
        rdata.extend_from_slice(&0u16.to_be_bytes());
        rdata.extend_from_slice(&0u16.to_be_bytes());
        put_rr(&mut msg, &self.key_name, TYPE_TSIG, CLASS_ANY, 0, &rdata)?;
        msg[10..12].copy_from_slice(&1u16.to_be_bytes());
        Ok(msg)
    }

    async fn exchange(&self, msg: &[u8], id: u16) -> Result<Vec<u8>, DnsError> {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .or_else(|_| {
                std::net::UdpSocket::bind("0.0.0.0:0").and_then(tokio::net::UdpSocket::from_std)
            })
            .map_err(|_| DnsError::Unavailable)?;
        socket
            .connect(self.server)
            .await
            .map_err(|_| DnsError::Unavailable)?;
        let mut buf = vec![0u8; 4096];
        for _ in 0..2 {
            socket.send(msg).await.map_err(|_| DnsError::Unavailable)?;
            match tokio::time::timeout(std::time::Duration::from_secs(3), socket.recv(&mut buf))
                .await
            {
                Ok(Ok(n)) if n >= 12 && buf[..2] == id.to_be_bytes() => {
                    buf.truncate(n);
                    return Ok(buf);
                }
                _ => continue,
            }
        }
        Err(DnsError::Unavailable)
    }

    async fn update(&self, updates: Vec<u8>, count: u16) -> Result<(), DnsError> {
        let id = random_id();
        let msg = self.update_message(id, &updates, count)?;
        let resp = self.exchange(&msg, id).await?;
        let rcode = resp[3] & 0x0F;
        if rcode == 0 {
            Ok(())
        } else {
            tracing::warn!(target: "orbit_runtime", event = "orbit_dns_update_refused", rcode, "dns update refused");
            Err(DnsError::Unavailable)
        }
    }

    async fn query(&self, name: &str, rtype: u16) -> Result<Vec<Vec<u8>>, DnsError> {
        let id = random_id();
        let mut msg = Vec::new();
        msg.extend_from_slice(&id.to_be_bytes());
        msg.extend_from_slice(&0u16.to_be_bytes());
        msg.extend_from_slice(&1u16.to_be_bytes());
        msg.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        put_name(&mut msg, name)?;
        msg.extend_from_slice(&rtype.to_be_bytes());
        msg.extend_from_slice(&CLASS_IN.to_be_bytes());
        let resp = self.exchange(&msg, id).await?;
        let answers = u16::from_be_bytes([resp[6], resp[7]]);
        let mut pos = skip_name(&resp, 12).ok_or(DnsError::Unavailable)? + 4;
        let mut out = Vec::new();
        for _ in 0..answers {
            pos = skip_name(&resp, pos).ok_or(DnsError::Unavailable)?;
            let head = resp.get(pos..pos + 10).ok_or(DnsError::Unavailable)?;
            let t = u16::from_be_bytes([head[0], head[1]]);
            let len = usize::from(u16::from_be_bytes([head[8], head[9]]));
            let rdata = resp
                .get(pos + 10..pos + 10 + len)
                .ok_or(DnsError::Unavailable)?;
            if t == rtype {
                out.push(rdata.to_vec());
            }
            pos += 10 + len;
        }
        Ok(out)
    }

    /// The TXT values at `name` (tests, and checking a challenge is gone).
    pub async fn txt(&self, name: &str) -> Result<Vec<String>, DnsError> {
        Ok(self
            .query(name, TYPE_TXT)
            .await?
            .into_iter()
            .filter_map(|r| {
                r.split_first()
                    .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            })
            .collect())
    }
}

fn random_id() -> u16 {
    let mut b = [0u8; 2];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    u16::from_be_bytes(b)
}

#[async_trait]
impl DnsProvider for Rfc2136Dns {
    async fn upsert_address(&self, name: &str, addr: IpAddr) -> Result<(), DnsError> {
        if !self.in_zone(name) {
            return Err(DnsError::Unavailable);
        }
        // Idempotent: no UPDATE when the server already has exactly this one address record.
        let (a, aaaa) = (
            self.query(name, TYPE_A).await?,
            self.query(name, TYPE_AAAA).await?,
        );
        let only_this = match addr {
            IpAddr::V4(v4) => aaaa.is_empty() && a == [v4.octets().to_vec()],
            IpAddr::V6(v6) => a.is_empty() && aaaa == [v6.octets().to_vec()],
        };
        if only_this {
            return Ok(());
        }
        let (rtype, other, rdata) = match addr {
            IpAddr::V4(a) => (TYPE_A, TYPE_AAAA, a.octets().to_vec()),
            IpAddr::V6(a) => (TYPE_AAAA, TYPE_A, a.octets().to_vec()),
        };
        // One message: drop both address RRsets, add the new record.
        let mut updates = Vec::new();
        put_rr(&mut updates, name, rtype, CLASS_ANY, 0, &[])?;
        put_rr(&mut updates, name, other, CLASS_ANY, 0, &[])?;
        put_rr(&mut updates, name, rtype, CLASS_IN, self.ttl, &rdata)?;
        self.update(updates, 3).await
    }

    async fn address(&self, name: &str) -> Result<Option<IpAddr>, DnsError> {
        if let Some(a) = self.query(name, TYPE_A).await?.first() {
            let o: [u8; 4] = a.as_slice().try_into().map_err(|_| DnsError::Unavailable)?;
            return Ok(Some(IpAddr::from(o)));
        }
        if let Some(a) = self.query(name, TYPE_AAAA).await?.first() {
            let o: [u8; 16] = a.as_slice().try_into().map_err(|_| DnsError::Unavailable)?;
            return Ok(Some(IpAddr::from(o)));
        }
        Ok(None)
    }
}

#[async_trait]
impl TxtProvider for Rfc2136Dns {
    async fn add_txt(&self, name: &str, value: &str) -> Result<(), DnsError> {
        if !self.in_zone(name) {
            return Err(DnsError::Unavailable);
        }
        let mut updates = Vec::new();
        put_rr(
            &mut updates,
            name,
            TYPE_TXT,
            CLASS_IN,
            self.ttl,
            &txt_rdata(value)?,
        )?;
        self.update(updates, 1).await
    }

    async fn delete_txt(&self, name: &str, value: &str) -> Result<(), DnsError> {
        if !self.in_zone(name) {
            return Err(DnsError::Unavailable);
        }
        let mut updates = Vec::new();
        put_rr(
            &mut updates,
            name,
            TYPE_TXT,
            CLASS_NONE,
            0,
            &txt_rdata(value)?,
        )?;
        self.update(updates, 1).await
    }
}

/// A Cloudflare-style REST DNS client (`/zones/{zone_id}/dns_records`, bearer token). Address
/// upserts are idempotent: an existing record of the right type with the right content and
/// `proxied=false` is left alone; one with other content is updated in place (`PUT`); none is
/// created (`POST`); records of the other address family at the same name are deleted. Records
/// are always written with `proxied=false`. TXT values are created and deleted individually.
/// Errors never carry the token or the provider's text.
#[derive(Clone)]
pub struct CloudflareDns {
    client: reqwest::Client,
    base_url: String,
    zone_id: String,
    token: String,
    ttl: u32,
}

impl std::fmt::Debug for CloudflareDns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CloudflareDns")
            .field("base_url", &self.base_url)
            .field("zone_id", &self.zone_id)
            .finish_non_exhaustive()
    }
}

#[derive(serde::Deserialize)]
struct CfRecord {
    id: String,
    #[serde(rename = "type")]
    kind: String,
    content: String,
    #[serde(default)]
    proxied: bool,
}

#[derive(serde::Deserialize)]
struct CfList {
    success: bool,
    #[serde(default)]
    result: Vec<CfRecord>,
}

impl CloudflareDns {
    /// A client for `zone_id` at `base_url` (e.g. `https://api.cloudflare.com/client/v4`).
    pub fn new(base_url: &str, zone_id: &str, token: &str, ttl: u32) -> Result<Self, DnsError> {
        let client = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(15))
            .build()
            .map_err(|_| DnsError::Unavailable)?;
        Ok(Self {
            client,
            base_url: base_url.trim_end_matches('/').to_owned(),
            zone_id: zone_id.to_owned(),
            token: token.to_owned(),
            ttl,
        })
    }

    fn records_url(&self) -> String {
        format!("{}/zones/{}/dns_records", self.base_url, self.zone_id)
    }

    async fn list(&self, name: &str) -> Result<Vec<CfRecord>, DnsError> {
        // DNS names only: nothing in them needs URL encoding.
        let plain = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
        if !plain {
            return Err(DnsError::Unavailable);
        }
        let r = self
            .client
            .get(format!("{}?name={name}&per_page=100", self.records_url()))
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|_| DnsError::Unavailable)?;
        if !r.status().is_success() {
            return Err(DnsError::Unavailable);
        }
        let list: CfList = r.json().await.map_err(|_| DnsError::Unavailable)?;
        if !list.success {
            return Err(DnsError::Unavailable);
        }
        Ok(list.result)
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<(), DnsError> {
        let r = req
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|_| DnsError::Unavailable)?;
        if r.status().is_success() {
            Ok(())
        } else {
            Err(DnsError::Unavailable)
        }
    }
}

fn txt_matches(content: &str, value: &str) -> bool {
    content == value || content.trim_matches('"') == value
}

#[async_trait]
impl DnsProvider for CloudflareDns {
    async fn upsert_address(&self, name: &str, addr: IpAddr) -> Result<(), DnsError> {
        let kind = record_type(addr);
        let content = addr.to_string();
        let records = self.list(name).await?;
        let body = serde_json::json!({
            "type": kind, "name": name, "content": content, "ttl": self.ttl, "proxied": false,
        });
        match records.iter().find(|r| r.kind == kind) {
            Some(r) if r.content == content && !r.proxied => {}
            Some(r) => {
                self.send(
                    self.client
                        .put(format!("{}/{}", self.records_url(), r.id))
                        .json(&body),
                )
                .await?;
            }
            None => {
                self.send(self.client.post(self.records_url()).json(&body))
                    .await?
            }
        }
        // The other address family at this name is stale now.
        for r in records
            .iter()
            .filter(|r| (r.kind == "A" || r.kind == "AAAA") && r.kind != kind)
        {
            self.send(
                self.client
                    .delete(format!("{}/{}", self.records_url(), r.id)),
            )
            .await?;
        }
        Ok(())
    }

    async fn address(&self, name: &str) -> Result<Option<IpAddr>, DnsError> {
        Ok(self
            .list(name)
            .await?
            .into_iter()
            .filter(|r| r.kind == "A" || r.kind == "AAAA")
            .find_map(|r| r.content.parse().ok()))
    }
}

#[async_trait]
impl TxtProvider for CloudflareDns {
    async fn add_txt(&self, name: &str, value: &str) -> Result<(), DnsError> {
        if self
            .list(name)
            .await?
            .iter()
            .any(|r| r.kind == "TXT" && txt_matches(&r.content, value))
        {
            return Ok(());
        }
        let body =
            serde_json::json!({ "type": "TXT", "name": name, "content": value, "ttl": self.ttl });
        self.send(self.client.post(self.records_url()).json(&body))
            .await
    }

    async fn delete_txt(&self, name: &str, value: &str) -> Result<(), DnsError> {
        for r in self.list(name).await? {
            if r.kind == "TXT" && txt_matches(&r.content, value) {
                self.send(
                    self.client
                        .delete(format!("{}/{}", self.records_url(), r.id)),
                )
                .await?;
            }
        }
        Ok(())
    }
}
