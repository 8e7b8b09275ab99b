//! DNS providers for system endpoint records (seed `003`, "Heartbeat").
//!
//! A reported address writes an `A` (IPv4) or `AAAA` (IPv6) record for each eligible endpoint
//! name of the Node, never proxied (`proxied=false` for Cloudflare-style providers), as an
//! idempotent create-or-update. [`MemoryDns`] is the embedded default; [`Rfc2136Dns`] updates a
//! real authoritative server (TSIG-signed RFC 2136 UPDATEs built, signed and verified with
//! `hickory-proto`, over UDP with TCP fallback) and also serves ACME DNS-01 TXT records
//! ([`TxtProvider`]); [`CloudflareDns`] speaks the Cloudflare-style REST API.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;

use async_trait::async_trait;
use hickory_proto::dnssec::rdata::tsig::TsigAlgorithm;
use hickory_proto::dnssec::tsig::TSigner;
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode, UpdateMessage as _};
use hickory_proto::rr::rdata::{A, AAAA, TXT};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};

/// The record type for an address.
pub fn record_type(addr: IpAddr) -> &'static str {
    match addr {
        IpAddr::V4(_) => "A",
        IpAddr::V6(_) => "AAAA",
    }
}

/// A DNS failure (no provider detail).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DnsError {
    /// The provider refused or failed (including an answer without a valid TSIG).
    #[error("dns provider unavailable")]
    Unavailable,
    /// A zone, record or key name is not a DNS name.
    #[error("not a valid DNS name")]
    InvalidName,
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

/// An RFC 2136 dynamic-update client for one zone on one authoritative server.
///
/// Messages, their parsing and TSIG (RFC 8945, `hmac-sha256`) are `hickory-proto`'s: every
/// message is signed with the key, and every answer must carry the server's valid TSIG over
/// the request's MAC, within the fudge of our clock, or it is refused — an unsigned or forged
/// answer never counts as success. Address records are replaced as one RRset (delete the
/// name's `A` and `AAAA` RRsets and add the new record in one UPDATE: atomic on the server);
/// TXT values are added and deleted exactly (delete by rdata). Reads are signed queries to the
/// same server (the idempotence check must not trust a spoofed answer either).
///
/// Transport (ours, kept small: hickory's client neither falls back to TCP on truncation nor
/// lets us choose the socket): UDP from the unspecified address of the server's family (IPv4
/// or IPv6), a 3 s timeout and one retry; an answer with the TC bit set is fetched again over
/// TCP (RFC 7766), as is every exchange when UDP gets no answer at all.
#[derive(Clone)]
pub struct Rfc2136Dns {
    server: std::net::SocketAddr,
    zone: Name,
    signer: TSigner,
    ttl: u32,
    tcp_fallbacks: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for Rfc2136Dns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rfc2136Dns")
            .field("server", &self.server)
            .field("zone", &self.zone)
            .field("key_name", self.signer.signer_name())
            .finish_non_exhaustive()
    }
}

/// How far our clock and the server's may disagree (RFC 8945 recommends 300 s).
const TSIG_FUDGE: u16 = 300;
/// One UDP attempt's wait for the answer.
const UDP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);
/// A whole TCP exchange.
const TCP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

fn unix_secs() -> u32 {
    u32::try_from(iop_wire::time::unix_secs(std::time::SystemTime::now())).unwrap_or(u32::MAX)
}

impl Rfc2136Dns {
    /// A client for `zone` on `server`, with the TSIG key `key_name` (hmac-sha256) and its
    /// secret; records get `ttl` seconds. Fails when `zone` or `key_name` is not a DNS name.
    pub fn new(
        server: std::net::SocketAddr,
        zone: &str,
        key_name: &str,
        secret: Vec<u8>,
        ttl: u32,
    ) -> Result<Self, DnsError> {
        let zone = fqdn(zone)?;
        let signer = TSigner::new(
            secret,
            TsigAlgorithm::HmacSha256,
            fqdn(key_name)?,
            TSIG_FUDGE,
        )
        .map_err(|_| DnsError::InvalidName)?;
        Ok(Self {
            server,
            zone,
            signer,
            ttl,
            tcp_fallbacks: Default::default(),
        })
    }

    /// How many exchanges were completed over TCP (truncated or unanswered over UDP).
    pub fn tcp_fallbacks(&self) -> u64 {
        self.tcp_fallbacks
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `name` as a name inside the zone, or why not.
    fn in_zone(&self, name: &str) -> Result<Name, DnsError> {
        let n = fqdn(name)?;
        if self.zone.zone_of(&n) {
            Ok(n)
        } else {
            Err(DnsError::Unavailable)
        }
    }

    /// An UPDATE of the zone with `updates`.
    fn update_message(&self, updates: Vec<Record>) -> Message {
        let mut zone = Query::new();
        zone.set_name(self.zone.clone())
            .set_query_class(DNSClass::IN)
            .set_query_type(RecordType::SOA);
        let mut message = Message::new();
        message
            .set_id(random_id())
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Update)
            .set_recursion_desired(false);
        message.add_zone(zone);
        for u in updates {
            message.add_update(u);
        }
        message
    }

    /// Signs `message`, sends it, and returns the server's verified answer.
    async fn exchange(&self, mut message: Message) -> Result<Message, DnsError> {
        let verifier = message
            .finalize(&self.signer, unix_secs())
            .map_err(|_| DnsError::Unavailable)?;
        let mut verifier = verifier.ok_or(DnsError::Unavailable)?;
        let request = message.to_vec().map_err(|_| DnsError::Unavailable)?;
        let id = message.id();
        let raw = match self.udp(&request, id).await {
            Some(raw) if !is_truncated(&raw) => raw,
            // Truncated, or no answer over UDP: the same signed request over TCP.
            _ => {
                self.tcp_fallbacks
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.tcp(&request, id).await?
            }
        };
        let answer = verifier(&raw).map_err(|_| {
            tracing::warn!(target: "orbit_runtime", event = "orbit_dns_answer_unverified", "dns answer without a valid TSIG refused");
            DnsError::Unavailable
        })?;
        let answer = answer.into_message();
        if answer.id() != id || answer.message_type() != MessageType::Response {
            return Err(DnsError::Unavailable);
        }
        Ok(answer)
    }

    /// One UDP exchange, from the unspecified address of the server's family. `None` when no
    /// answer came in two tries.
    async fn udp(&self, request: &[u8], id: u16) -> Option<Vec<u8>> {
        let local: std::net::SocketAddr = if self.server.is_ipv6() {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
        };
        let socket = tokio::net::UdpSocket::bind(local).await.ok()?;
        socket.connect(self.server).await.ok()?;
        let mut buf = vec![0u8; 4096];
        for _ in 0..2 {
            socket.send(request).await.ok()?;
            if let Ok(Ok(n)) = tokio::time::timeout(UDP_TIMEOUT, socket.recv(&mut buf)).await
                && n >= 12
                && buf[..2] == id.to_be_bytes()
            {
                buf.truncate(n);
                return Some(buf);
            }
        }
        None
    }

    /// One TCP exchange (RFC 1035 §4.2.2: a 2-byte length before each message).
    async fn tcp(&self, request: &[u8], id: u16) -> Result<Vec<u8>, DnsError> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let exchange = async {
            let mut s = tokio::net::TcpStream::connect(self.server).await?;
            let len = u16::try_from(request.len())
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
            let mut framed = Vec::with_capacity(request.len() + 2);
            framed.extend_from_slice(&len.to_be_bytes());
            framed.extend_from_slice(request);
            s.write_all(&framed).await?;
            let mut len = [0u8; 2];
            s.read_exact(&mut len).await?;
            let mut answer = vec![0u8; usize::from(u16::from_be_bytes(len))];
            s.read_exact(&mut answer).await?;
            Ok::<_, std::io::Error>(answer)
        };
        match tokio::time::timeout(TCP_TIMEOUT, exchange).await {
            Ok(Ok(answer)) if answer.len() >= 12 && answer[..2] == id.to_be_bytes() => Ok(answer),
            _ => Err(DnsError::Unavailable),
        }
    }

    async fn update(&self, updates: Vec<Record>) -> Result<(), DnsError> {
        let answer = self.exchange(self.update_message(updates)).await?;
        match answer.response_code() {
            ResponseCode::NoError => Ok(()),
            rcode => {
                tracing::warn!(target: "orbit_runtime", event = "orbit_dns_update_refused", rcode = %rcode, "dns update refused");
                Err(DnsError::Unavailable)
            }
        }
    }

    /// The records of type `rtype` at `name`.
    async fn query(&self, name: Name, rtype: RecordType) -> Result<Vec<RData>, DnsError> {
        let mut query = Query::new();
        query
            .set_name(name)
            .set_query_class(DNSClass::IN)
            .set_query_type(rtype);
        let mut message = Message::new();
        message
            .set_id(random_id())
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Query)
            .set_recursion_desired(false);
        message.add_query(query);
        let answer = self.exchange(message).await?;
        if !matches!(
            answer.response_code(),
            ResponseCode::NoError | ResponseCode::NXDomain
        ) {
            return Err(DnsError::Unavailable);
        }
        Ok(answer
            .answers()
            .iter()
            .filter(|r| r.record_type() == rtype)
            .map(|r| r.data().clone())
            .collect())
    }

    /// The TXT values at `name` (tests, and checking a challenge is gone).
    pub async fn txt(&self, name: &str) -> Result<Vec<String>, DnsError> {
        let name = fqdn(name)?;
        Ok(self
            .query(name, RecordType::TXT)
            .await?
            .into_iter()
            .filter_map(|r| match r {
                RData::TXT(t) => Some(
                    t.txt_data()
                        .iter()
                        .map(|piece| String::from_utf8_lossy(piece).into_owned())
                        .collect::<String>(),
                ),
                _ => None,
            })
            .collect())
    }
}

/// `name` as an absolute, lower-case DNS name.
fn fqdn(name: &str) -> Result<Name, DnsError> {
    let mut n = Name::from_ascii(name.trim_end_matches('.'))
        .map_err(|_| DnsError::InvalidName)?
        .to_lowercase();
    if n.num_labels() == 0 {
        return Err(DnsError::InvalidName);
    }
    n.set_fqdn(true);
    Ok(n)
}

/// The TC bit of a DNS header.
fn is_truncated(raw: &[u8]) -> bool {
    raw.get(2).is_some_and(|flags| flags & 0x02 != 0)
}

fn random_id() -> u16 {
    let mut b = [0u8; 2];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    u16::from_be_bytes(b)
}

fn txt_record(name: Name, ttl: u32, value: &str) -> Result<Record, DnsError> {
    if value.len() > 255 {
        return Err(DnsError::Unavailable);
    }
    Ok(Record::from_rdata(
        name,
        ttl,
        RData::TXT(TXT::new(vec![value.to_owned()])),
    ))
}

#[async_trait]
impl DnsProvider for Rfc2136Dns {
    async fn upsert_address(&self, name: &str, addr: IpAddr) -> Result<(), DnsError> {
        let name = self.in_zone(name)?;
        // Idempotent: no UPDATE when the server already has exactly this one address record.
        let (a, aaaa) = (
            self.query(name.clone(), RecordType::A).await?,
            self.query(name.clone(), RecordType::AAAA).await?,
        );
        let only_this = match addr {
            IpAddr::V4(v4) => aaaa.is_empty() && a == [RData::A(A(v4))],
            IpAddr::V6(v6) => a.is_empty() && aaaa == [RData::AAAA(AAAA(v6))],
        };
        if only_this {
            return Ok(());
        }
        // One message: drop both address RRsets, add the new record.
        let mut updates = Vec::new();
        for rtype in [RecordType::A, RecordType::AAAA] {
            let mut delete = Record::update0(name.clone(), 0, rtype);
            delete.set_dns_class(DNSClass::ANY);
            updates.push(delete);
        }
        let rdata = match addr {
            IpAddr::V4(v4) => RData::A(A(v4)),
            IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
        };
        updates.push(Record::from_rdata(name, self.ttl, rdata));
        self.update(updates).await
    }

    async fn address(&self, name: &str) -> Result<Option<IpAddr>, DnsError> {
        let name = fqdn(name)?;
        for rtype in [RecordType::A, RecordType::AAAA] {
            for r in self.query(name.clone(), rtype).await? {
                match r {
                    RData::A(a) => return Ok(Some(IpAddr::V4(a.0))),
                    RData::AAAA(a) => return Ok(Some(IpAddr::V6(a.0))),
                    _ => {}
                }
            }
        }
        Ok(None)
    }
}

#[async_trait]
impl TxtProvider for Rfc2136Dns {
    async fn add_txt(&self, name: &str, value: &str) -> Result<(), DnsError> {
        let name = self.in_zone(name)?;
        self.update(vec![txt_record(name, self.ttl, value)?]).await
    }

    async fn delete_txt(&self, name: &str, value: &str) -> Result<(), DnsError> {
        let name = self.in_zone(name)?;
        // Delete by rdata (RFC 2136 §2.5.4): class NONE, TTL 0, exactly this value.
        let mut delete = txt_record(name, 0, value)?;
        delete.set_dns_class(DNSClass::NONE);
        self.update(vec![delete]).await
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

#[cfg(test)]
mod tests {
    use hickory_proto::dnssec::rdata::DNSSECRData;
    use hickory_proto::dnssec::rdata::tsig::{TSIG, make_tsig_record, message_tbs};

    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";
    const OTHER_KEY: &[u8] = b"fedcba9876543210fedcba9876543210";

    fn signer(key: &[u8]) -> TSigner {
        TSigner::new(
            key.to_vec(),
            TsigAlgorithm::HmacSha256,
            Name::from_ascii("orbit-key.").expect("name"),
            TSIG_FUDGE,
        )
        .expect("hmac-sha256 is supported")
    }

    /// A server answering every request `NOERROR`, signed with `key` over the request's MAC
    /// as RFC 8945 §4.3.3 has it (`None`: unsigned).
    async fn fake_server(key: Option<&'static [u8]>) -> std::net::SocketAddr {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = socket.local_addr().expect("addr");
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok((n, peer)) = socket.recv_from(&mut buf).await {
                let request = Message::from_vec(&buf[..n]).expect("a DNS message");
                let mut answer = Message::new();
                answer
                    .set_id(request.id())
                    .set_message_type(MessageType::Response)
                    .set_op_code(request.op_code())
                    .set_response_code(ResponseCode::NoError);
                for q in request.queries() {
                    answer.add_query(q.clone());
                }
                if let Some(key) = key {
                    let request_mac = request
                        .signature()
                        .iter()
                        .find_map(|r| match r.data() {
                            RData::DNSSEC(DNSSECRData::TSIG(t)) => Some(t.mac().to_vec()),
                            _ => None,
                        })
                        .expect("the client signs its requests");
                    let s = signer(key);
                    let pre = TSIG::new(
                        TsigAlgorithm::HmacSha256,
                        u64::from(unix_secs()),
                        TSIG_FUDGE,
                        Vec::new(),
                        request.id(),
                        0,
                        Vec::new(),
                    );
                    let tbs = message_tbs(Some(&request_mac), &answer, &pre, s.signer_name())
                        .expect("encodable");
                    let mac = s.sign(&tbs).expect("sign");
                    answer.add_tsig(make_tsig_record(s.signer_name().clone(), pre.set_mac(mac)));
                }
                let _ = socket
                    .send_to(&answer.to_vec().expect("encode"), peer)
                    .await;
            }
        });
        addr
    }

    fn client(server: std::net::SocketAddr) -> Rfc2136Dns {
        Rfc2136Dns::new(server, "orbit.test", "orbit-key", KEY.to_vec(), 30).expect("names")
    }

    #[tokio::test]
    async fn only_an_answer_signed_with_our_key_over_our_request_counts() {
        // The control: an answer signed as a real server signs it is accepted.
        let good = client(fake_server(Some(KEY)).await);
        good.add_txt("a.orbit.test", "v")
            .await
            .expect("a valid answer");
        // Signed with another key, or not signed: refused, although it says NOERROR.
        let forged = client(fake_server(Some(OTHER_KEY)).await);
        assert_eq!(
            forged.add_txt("a.orbit.test", "v").await,
            Err(DnsError::Unavailable)
        );
        let unsigned = client(fake_server(None).await);
        assert_eq!(
            unsigned.add_txt("a.orbit.test", "v").await,
            Err(DnsError::Unavailable)
        );
        assert_eq!(
            unsigned.txt("a.orbit.test").await,
            Err(DnsError::Unavailable)
        );
    }

    #[test]
    fn names_are_checked() {
        let server = "127.0.0.1:53".parse().expect("addr");
        assert_eq!(
            Rfc2136Dns::new(server, "bad..zone", "k", Vec::new(), 30).unwrap_err(),
            DnsError::InvalidName
        );
        assert_eq!(
            Rfc2136Dns::new(server, ".", "k", Vec::new(), 30).unwrap_err(),
            DnsError::InvalidName
        );
        let dns = Rfc2136Dns::new(server, "Orbit.Test.", "k", Vec::new(), 30).expect("names");
        assert!(dns.in_zone("A.orbit.test").is_ok());
        assert!(dns.in_zone("orbit.test.example").is_err());
    }
}
