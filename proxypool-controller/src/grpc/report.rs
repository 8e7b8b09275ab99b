//! `ReportRuntime` straight from the wire: a decoder for `ReportRuntimeRequest` that writes each
//! counter's canonical line as it reads it, and the tonic plumbing that serves the RPC with it.
//!
//! # Why not prost here
//!
//! A full report carries up to `maxRuntimeCounters` sub-messages. prost decodes each into a
//! `ProxyCounters` with its own `String`. The service then validates them, sorts them,
//! writes their canonical lines and digests those. With 1000 counters, prost's decode was
//! ≈ 21 % of the controller's CPU per report, and the handler after it (conversions, checks,
//! canonical lines, the store's arguments) another ≈ 17 % (`benches/README.md`,
//! `proxypool_load`). This decoder reads the same bytes once. It checks
//! each counter as the service would, and writes its canonical line into one buffer
//! ([`CountersBuilder`]). No allocation is made per counter.
//!
//! The encoding every protobuf library writes for a usual counter (an ASCII id under 128
//! bytes, counts under 128, each field once and in order) is read by a path of its own: one
//! byte pattern, no key loop. Everything else takes the general path, and both give the same
//! values for the bytes the first takes. With the builder's word-at-a-time id comparison, this
//! took the decode of 1000 counters from 26 to 14 µs (`benches/benches/report_decode.rs`).
//!
//! Every other RPC, and the response, stay on the generated prost code. So does
//! [`super::Controller`]'s `report_runtime`, for anyone serving the generated
//! `WorkerControlPlaneServer` directly.
//!
//! # Same answers as prost
//!
//! The decoder accepts exactly the encodings prost accepts, with the same field values:
//! - varints of at most 10 bytes, the tenth below 2;
//! - keys up to `u32::MAX` with a field number of at least 1 and a wire type 0–5;
//! - last-one-wins scalars and strings, with UTF-8 checked on every occurrence;
//! - repeated `counters` in order;
//! - unknown fields skipped, groups included, with prost's recursion limit of 100;
//! - a wrong wire type for a known field is an error.
//!
//! Anything else is a [`DecodeError`]. Like tonic's prost codec, it answers `INTERNAL`, with a
//! message naming the problem and never a byte of the input. `tests/report_decoder.rs` holds
//! the decoder to prost on generated and mutated messages, and so does the `report_decode`
//! fuzz target. The service then answers exactly as [`Service::report_runtime`] would for the
//! prost-decoded request: [`Service::report_canonical`] checks the same fields in the same
//! order.
//!
//! [`Service::report_runtime`]: crate::domain::Service::report_runtime
//! [`Service::report_canonical`]: crate::domain::Service::report_canonical

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Buf as _;
use tonic::Status;
use tonic::body::Body;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::server::{NamedService, UnaryService};

use super::Controller;
use crate::domain::{CanonicalReportCommand, CountersBuilder};
use crate::proto::controlplane as pb;
use crate::proto::controlplane::worker_control_plane_server::WorkerControlPlaneServer;

/// The RPC this module serves.
pub const REPORT_RUNTIME_PATH: &str = "/controlplane.v1.WorkerControlPlane/ReportRuntime";

/// prost's recursion limit (nested messages and groups).
const RECURSION_LIMIT: u32 = 100;

/// Why a `ReportRuntimeRequest` did not decode. The message names the problem and the field,
/// never a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A varint longer than 10 bytes, overflowing 64 bits, or cut short.
    #[error("invalid varint")]
    Varint,
    /// A key above `u32::MAX`, with field number 0, or with wire type 6 or 7.
    #[error("invalid field key")]
    Key,
    /// A known field with another wire type than its own.
    #[error("{0}: unexpected wire type")]
    WireType(&'static str),
    /// A length or fixed-size value running past the end of the message.
    #[error("buffer underflow")]
    Underflow,
    /// A string that is not UTF-8.
    #[error("{0}: invalid string value: data is not UTF-8 encoded")]
    Utf8(&'static str),
    /// An end-group key without its start, or with another field number.
    #[error("unexpected end group tag")]
    EndGroup,
    /// Groups nested deeper than prost allows.
    #[error("recursion limit reached")]
    Recursion,
}

/// Decodes a `ReportRuntimeRequest` from `buf`. The counters are checked and written in
/// canonical form as they are read; `max_counters` is the service's `maxRuntimeCounters`.
/// Their verdict (the canonical counters, or the service's error for them) is in
/// [`CanonicalReportCommand::counters`].
pub fn decode(buf: &[u8], max_counters: usize) -> Result<CanonicalReportCommand, DecodeError> {
    let mut r = Reader { buf };
    let mut worker_id: &[u8] = &[];
    let mut session_id: &[u8] = &[];
    let (mut sequence, mut snapshot_version, mut ownership_epoch, mut observed_at) =
        (0u64, 0u64, 0u64, 0u64);
    // A counter's canonical line is about as long as its encoding.
    let mut counters = CountersBuilder::with_capacity(max_counters, buf.len());
    while !r.buf.is_empty() {
        // Counters are nearly all of a report: a counter's key (field 7, length-delimited) with
        // a one-byte length first, read as the general path below reads it.
        if let [COUNTER_KEY, len @ 0..0x80, rest @ ..] = r.buf
            && let Some((m, rest)) = rest.split_at_checked(usize::from(*len))
        {
            r.buf = rest;
            let (id, in_flight, open) = counter(m)?;
            counters.push(id, in_flight, open);
            continue;
        }
        let (tag, wire) = r.key()?;
        match tag {
            1 => worker_id = r.string(wire, "worker_id")?,
            2 => session_id = r.bytes(wire, "session_id")?,
            3 => sequence = r.uint(wire, "sequence")?,
            4 => snapshot_version = r.uint(wire, "snapshot_version")?,
            5 => ownership_epoch = r.uint(wire, "ownership_epoch")?,
            6 => observed_at = r.uint(wire, "observed_at_unix_ms")?,
            7 => {
                let (id, in_flight, open) = counter(r.bytes(wire, "counters")?)?;
                counters.push(id, in_flight, open);
            }
            _ => r.skip(wire, tag, RECURSION_LIMIT)?,
        }
    }
    let worker_id = std::str::from_utf8(worker_id).map_err(|_| DecodeError::Utf8("worker_id"))?;
    Ok(CanonicalReportCommand {
        worker_id: worker_id.to_owned(),
        session_id: session_id.to_vec(),
        sequence,
        snapshot_version,
        ownership_epoch,
        // int64 on the wire: the varint's two's complement, as prost reads it.
        observed_at_unix_ms: observed_at as i64,
        counters: counters.finish(),
    })
}

/// The reference for [`decode`]: prost's decode of the generated `ReportRuntimeRequest`, then
/// [`from_proto`]. The tests and the `report_decode` fuzz target hold [`decode`] to it.
pub fn decode_reference(
    buf: &[u8],
    max_counters: usize,
) -> Result<CanonicalReportCommand, prost::DecodeError> {
    let m = <pb::ReportRuntimeRequest as prost::Message>::decode(buf)?;
    Ok(from_proto(m, max_counters))
}

/// A prost-decoded `ReportRuntimeRequest` as the service takes it: the counters through a
/// [`CountersBuilder`] in wire order. What the generated server's path
/// (`Controller::report_runtime`) hands the service.
pub fn from_proto(m: pb::ReportRuntimeRequest, max_counters: usize) -> CanonicalReportCommand {
    let mut counters = CountersBuilder::new(max_counters);
    for c in &m.counters {
        counters.push(c.proxy_id.as_bytes(), c.in_flight, c.open_connections);
    }
    CanonicalReportCommand {
        worker_id: m.worker_id,
        session_id: m.session_id.to_vec(),
        sequence: m.sequence,
        snapshot_version: m.snapshot_version,
        ownership_epoch: m.ownership_epoch,
        observed_at_unix_ms: m.observed_at_unix_ms,
        counters: counters.finish(),
    }
}

/// One `ProxyCounters` message: its last `proxy_id`, `in_flight` and `open_connections`.
#[inline]
fn counter(buf: &[u8]) -> Result<(&[u8], i64, i64), DecodeError> {
    match counter_common(buf) {
        Some(c) => Ok(c),
        None => counter_any(buf),
    }
}

/// The encoding every protobuf library writes for a counter with an ASCII id shorter than 128
/// bytes and counts below 128, each field once and in field order (a zero count left out):
/// `0a len id [10 n] [18 n]`. Anything else (`None`) goes through [`counter_any`], which reads
/// it as prost does; for these bytes both give the same values.
#[inline]
fn counter_common(buf: &[u8]) -> Option<(&[u8], i64, i64)> {
    let [0x0a, len, rest @ ..] = buf else {
        return None;
    };
    let len = usize::from(*len);
    if len >= 0x80 || rest.len() < len {
        return None;
    }
    let (id, rest) = rest.split_at(len);
    let (in_flight, rest) = match rest {
        [0x10, n, rest @ ..] if *n < 0x80 => (*n, rest),
        _ => (0, rest),
    };
    let (open, rest) = match rest {
        [0x18, n, rest @ ..] if *n < 0x80 => (*n, rest),
        _ => (0, rest),
    };
    (rest.is_empty() && id.is_ascii()).then_some((id, i64::from(in_flight), i64::from(open)))
}

/// [`counter`] for any encoding prost accepts.
#[inline(never)]
fn counter_any(buf: &[u8]) -> Result<(&[u8], i64, i64), DecodeError> {
    let mut r = Reader { buf };
    let (mut id, mut in_flight, mut open): (&[u8], u64, u64) = (&[], 0, 0);
    while !r.buf.is_empty() {
        let (tag, wire) = r.key()?;
        match tag {
            1 => id = r.string(wire, "ProxyCounters.proxy_id")?,
            2 => in_flight = r.uint(wire, "ProxyCounters.in_flight")?,
            3 => open = r.uint(wire, "ProxyCounters.open_connections")?,
            // Inside a nested message: one level of prost's recursion budget is spent.
            _ => r.skip(wire, tag, RECURSION_LIMIT - 1)?,
        }
    }
    Ok((id, in_flight as i64, open as i64))
}

/// The key of `ReportRuntimeRequest.counters` (field 7, wire type 2) as its one byte.
const COUNTER_KEY: u8 = 7 << 3 | LEN;

/// Wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const START_GROUP: u8 = 3;
const END_GROUP: u8 = 4;
const FIXED32: u8 = 5;

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A varint with prost's rules: at most 10 bytes, the tenth below 2.
    #[inline]
    fn varint(&mut self) -> Result<u64, DecodeError> {
        // Keys, lengths and small counts are one byte.
        if let Some((&b, rest)) = self.buf.split_first()
            && b < 0x80
        {
            self.buf = rest;
            return Ok(u64::from(b));
        }
        self.varint_long()
    }

    #[inline(never)]
    fn varint_long(&mut self) -> Result<u64, DecodeError> {
        let mut value = 0u64;
        for (i, &b) in self.buf.iter().take(10).enumerate() {
            if i == 9 && b >= 0x02 {
                return Err(DecodeError::Varint);
            }
            value |= u64::from(b & 0x7f) << (7 * i);
            if b < 0x80 {
                self.buf = &self.buf[i + 1..];
                return Ok(value);
            }
        }
        Err(DecodeError::Varint)
    }

    #[inline]
    fn key(&mut self) -> Result<(u32, u8), DecodeError> {
        let key = u32::try_from(self.varint()?).map_err(|_| DecodeError::Key)?;
        let wire = (key & 0x07) as u8;
        let tag = key >> 3;
        if wire > FIXED32 || tag == 0 {
            return Err(DecodeError::Key);
        }
        Ok((tag, wire))
    }

    #[inline]
    fn take(&mut self, len: u64) -> Result<&'a [u8], DecodeError> {
        let len = usize::try_from(len).map_err(|_| DecodeError::Underflow)?;
        if len > self.buf.len() {
            return Err(DecodeError::Underflow);
        }
        let (head, rest) = self.buf.split_at(len);
        self.buf = rest;
        Ok(head)
    }

    #[inline]
    fn bytes(&mut self, wire: u8, field: &'static str) -> Result<&'a [u8], DecodeError> {
        if wire != LEN {
            return Err(DecodeError::WireType(field));
        }
        let len = self.varint()?;
        self.take(len)
    }

    /// A string field's bytes, checked to be UTF-8 (as prost checks every occurrence).
    #[inline]
    fn string(&mut self, wire: u8, field: &'static str) -> Result<&'a [u8], DecodeError> {
        let s = self.bytes(wire, field)?;
        // Valid ids are ASCII: the common case needs no full UTF-8 check.
        if !s.is_ascii() && std::str::from_utf8(s).is_err() {
            return Err(DecodeError::Utf8(field));
        }
        Ok(s)
    }

    #[inline]
    fn uint(&mut self, wire: u8, field: &'static str) -> Result<u64, DecodeError> {
        if wire != VARINT {
            return Err(DecodeError::WireType(field));
        }
        self.varint()
    }

    /// Skips an unknown field as prost's `skip_field` does, `budget` being its recursion
    /// budget at this depth.
    fn skip(&mut self, wire: u8, tag: u32, budget: u32) -> Result<(), DecodeError> {
        if budget == 0 {
            return Err(DecodeError::Recursion);
        }
        let len = match wire {
            VARINT => {
                self.varint()?;
                0
            }
            FIXED64 => 8,
            LEN => self.varint()?,
            START_GROUP => loop {
                let (inner_tag, inner_wire) = self.key()?;
                if inner_wire == END_GROUP {
                    if inner_tag != tag {
                        return Err(DecodeError::EndGroup);
                    }
                    break 0;
                }
                self.skip(inner_wire, inner_tag, budget - 1)?;
            },
            END_GROUP => return Err(DecodeError::EndGroup),
            _ => 4,
        };
        self.take(len).map(|_| ())
    }
}

/// A tonic codec for `ReportRuntime`: requests through [`decode`], responses through prost.
#[derive(Clone, Copy, Debug)]
pub struct ReportCodec {
    max_counters: usize,
}

impl ReportCodec {
    /// A codec for a service with `maxRuntimeCounters = max_counters`.
    pub fn new(max_counters: usize) -> Self {
        Self { max_counters }
    }
}

impl Codec for ReportCodec {
    type Encode = pb::ReportRuntimeResponse;
    type Decode = CanonicalReportCommand;
    type Encoder = tonic_prost::ProstEncoder<pb::ReportRuntimeResponse>;
    type Decoder = ReportDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        ReportDecoder {
            max_counters: self.max_counters,
        }
    }
}

/// The decoder half of [`ReportCodec`].
#[derive(Clone, Copy, Debug)]
pub struct ReportDecoder {
    max_counters: usize,
}

impl Decoder for ReportDecoder {
    type Item = CanonicalReportCommand;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        let len = src.remaining();
        // tonic hands over one whole message, in one contiguous buffer.
        let decoded = if src.chunk().len() >= len {
            let r = decode(&src.chunk()[..len], self.max_counters);
            src.advance(len);
            r
        } else {
            decode(&src.copy_to_bytes(len), self.max_counters)
        };
        decoded
            .map(Some)
            .map_err(|e| Status::internal(format!("failed to decode ReportRuntimeRequest: {e}")))
    }
}

/// The worker control plane as served: `ReportRuntime` through [`ReportCodec`], every other
/// RPC through the generated server. Named as the generated service, so gRPC health and
/// reflection see one service.
#[derive(Clone, Debug)]
pub struct WorkerControlPlaneService {
    generated: WorkerControlPlaneServer<Controller>,
    controller: Arc<Controller>,
    max_decoding_message_size: usize,
    max_encoding_message_size: usize,
}

impl WorkerControlPlaneService {
    /// Serves `controller` with messages up to `max_message_bytes` either way.
    pub fn new(controller: Controller, max_message_bytes: usize) -> Self {
        let controller = Arc::new(controller);
        let generated = WorkerControlPlaneServer::from_arc(controller.clone())
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes);
        Self {
            generated,
            controller,
            max_decoding_message_size: max_message_bytes,
            max_encoding_message_size: max_message_bytes,
        }
    }
}

impl NamedService for WorkerControlPlaneService {
    const NAME: &'static str = <WorkerControlPlaneServer<Controller> as NamedService>::NAME;
}

/// The `ReportRuntime` handler as tonic's unary service.
struct ReportRuntime(Arc<Controller>);

impl UnaryService<CanonicalReportCommand> for ReportRuntime {
    type Response = pb::ReportRuntimeResponse;
    type Future = std::pin::Pin<
        Box<dyn Future<Output = Result<tonic::Response<pb::ReportRuntimeResponse>, Status>> + Send>,
    >;

    fn call(&mut self, request: tonic::Request<CanonicalReportCommand>) -> Self::Future {
        let controller = self.0.clone();
        Box::pin(async move { controller.report_canonical(request).await })
    }
}

impl<B> tower_service::Service<http::Request<B>> for WorkerControlPlaneService
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send + 'static>,
    >;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != REPORT_RUNTIME_PATH {
            return self.generated.call(request);
        }
        let method = ReportRuntime(self.controller.clone());
        let codec = ReportCodec::new(self.controller.max_runtime_counters());
        let (max_decoding, max_encoding) = (
            self.max_decoding_message_size,
            self.max_encoding_message_size,
        );
        Box::pin(async move {
            // As the generated server does it: no compression enabled, the same size limits.
            let mut grpc = tonic::server::Grpc::new(codec)
                .apply_max_message_size_config(Some(max_decoding), Some(max_encoding));
            Ok(grpc.unary(method, request).await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_follow_prost() {
        let v = |b: &[u8]| Reader { buf: b }.varint();
        assert_eq!(v(&[0x00]), Ok(0));
        assert_eq!(v(&[0x96, 0x01]), Ok(150));
        // An overlong zero is accepted, as prost accepts it.
        assert_eq!(v(&[0x80, 0x80, 0x00]), Ok(0));
        let max = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
        assert_eq!(v(&max), Ok(u64::MAX));
        let over = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
        assert_eq!(v(&over), Err(DecodeError::Varint));
        assert_eq!(v(&[0x80; 11]), Err(DecodeError::Varint));
        assert_eq!(v(&[0x80]), Err(DecodeError::Varint));
        assert_eq!(v(&[]), Err(DecodeError::Varint));
    }
}
