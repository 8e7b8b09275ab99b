//! The frame codec shared by the runtime wire and the control wire.
//!
//! On the socket a frame is a 4-byte big-endian length `N` followed by `N` bytes of one protobuf
//! envelope (`Envelope` on the runtime wire, `ControlEnvelope` on the control wire):
//!
//! ```text
//! +----------------+---------------------------+
//! | N: u32 BE      | N bytes: envelope message |
//! +----------------+---------------------------+
//! ```
//!
//! - `N` above the configured maximum ([`DEFAULT_MAX_FRAME_LEN`] unless set) is rejected from
//!   the four header bytes alone ([`FrameError::TooLarge`]); nothing of the declared size is
//!   reserved. [`FrameCodec`] does not pre-reserve valid frames either: a peer that declares
//!   a large frame and trickles it only costs the bytes it actually sent. `TokioCodec`
//!   reserves the room of a frame up to `RESERVE_WHOLE_FRAME` (1 MiB and 4 KiB) once its
//!   prefix is read, so a bulk tunnel body is read into one buffer instead of one that grows
//!   by copying; a trickling peer then costs at most that much more than it sent.
//! - "Need more bytes" ([`Decoded::Incomplete`] / `Ok(None)`) is kept apart from "invalid"
//!   (`Err`), in the shape of linkerd's `parse_sni`.
//! - `N = 0` is a frame whose envelope is empty, which is invalid
//!   ([`InvalidMessage::EmptyEnvelope`]).
//! - A runtime envelope's repeated and map fields are counted against validation's bounds
//!   before prost decodes it, in one pass over the bytes that allocates nothing: a frame of more
//!   headers (or metadata entries, adapters, ...) than validation takes is refused with
//!   [`InvalidMessage::TooLong`] before it is built, so what a frame decodes into stays a small
//!   multiple of its size (an 8 MB frame of empty headers cost 235 MB of heap to decode before,
//!   40 bytes now). The control wire's envelope is counted the same way. There it bounds what an Edge's
//!   frames cost the Control Plane (a status answer's Nodes, provider snapshots and adapters,
//!   usage records, metadata); a projection's lists are bounded only as validation bounds
//!   them (2^20 entries each), since the Control Plane is the trusted author of what an Edge
//!   holds (up to 512 MiB, `control_session`).
//!
//! With the `tokio-codec` feature, `TokioCodec` (not linked here: it exists only with that
//! feature, and the crate's docs must build without it) implements tokio-util's `Decoder` and
//! `Encoder` on top of the same functions, for the async crates.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::error::{FrameError, InvalidMessage};

/// Bytes of the length prefix.
pub const LENGTH_PREFIX_LEN: usize = 4;

/// Default maximum envelope size: 8 MiB. Large enough for a chat request with inline images,
/// small enough that a connection cannot pin much memory. Configure with
/// [`FrameCodec::with_max_frame_len`].
pub const DEFAULT_MAX_FRAME_LEN: usize = 8 * 1024 * 1024;

/// A message type that travels as one framed envelope.
pub trait WireFrame: Sized {
    /// Decodes and validates one envelope from exactly `payload`.
    fn decode_envelope(payload: Bytes) -> Result<Self, InvalidMessage>;
    /// Appends the length prefix and the envelope to `buf` (one reservation), or refuses an
    /// envelope larger than `max_len` without touching `buf`.
    fn encode_frame(&self, max_len: usize, buf: &mut BytesMut) -> Result<(), FrameError>;
    /// [`WireFrame::encode_frame`] consuming the frame, so its contents move into the envelope
    /// rather than being cloned (the default clones as `encode_frame` does).
    fn encode_frame_owned(self, max_len: usize, buf: &mut BytesMut) -> Result<(), FrameError>
    where
        Self: Sized,
    {
        self.encode_frame(max_len, buf)
    }
}

/// Outcome of decoding from a byte slice.
#[derive(Debug, PartialEq)]
pub enum Decoded<F> {
    /// A whole frame: the message and how many bytes it took (prefix included).
    Frame {
        /// The decoded message.
        frame: F,
        /// Bytes consumed, prefix included.
        consumed: usize,
    },
    /// Not enough bytes yet; at least `needed` more are required.
    Incomplete {
        /// Minimum additional bytes before a frame can be decoded.
        needed: usize,
    },
}

/// Length-prefix framing with a hard size limit. Cheap to copy; holds no buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameCodec {
    max_frame_len: usize,
}

impl Default for FrameCodec {
    fn default() -> Self {
        Self {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
        }
    }
}

impl FrameCodec {
    /// A codec with the default limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// A codec accepting envelopes of at most `max_frame_len` bytes (capped at `u32::MAX`).
    pub fn with_max_frame_len(max_frame_len: usize) -> Self {
        Self {
            max_frame_len: max_frame_len.min(u32::MAX as usize),
        }
    }

    /// The configured maximum envelope size.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    /// Reads the prefix: `Ok(None)` when fewer than four bytes are present, otherwise the
    /// envelope length, checked against the limit.
    pub fn peek_len(&self, buf: &[u8]) -> Result<Option<usize>, FrameError> {
        let Some(prefix) = buf.get(..LENGTH_PREFIX_LEN) else {
            return Ok(None);
        };
        let declared = u32::from_be_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]);
        let len = declared as usize;
        if len > self.max_frame_len {
            return Err(FrameError::TooLarge {
                declared: u64::from(declared),
                max: self.max_frame_len,
            });
        }
        Ok(Some(len))
    }

    /// Decodes one frame from the front of `buf` without consuming it.
    ///
    /// The payload is copied once into a `Bytes`; use [`FrameCodec::decode`] on a `BytesMut`
    /// to avoid the copy.
    pub fn decode_slice<F: WireFrame>(&self, buf: &[u8]) -> Result<Decoded<F>, FrameError> {
        let Some(len) = self.peek_len(buf)? else {
            return Ok(Decoded::Incomplete {
                needed: LENGTH_PREFIX_LEN - buf.len(),
            });
        };
        let total = LENGTH_PREFIX_LEN + len;
        let Some(payload) = buf.get(LENGTH_PREFIX_LEN..total) else {
            return Ok(Decoded::Incomplete {
                needed: total - buf.len(),
            });
        };
        let frame = F::decode_envelope(Bytes::copy_from_slice(payload))?;
        Ok(Decoded::Frame {
            frame,
            consumed: total,
        })
    }

    /// Decodes one frame from the front of `buf`, consuming it; `Ok(None)` when more bytes
    /// are needed (nothing consumed).
    ///
    /// An invalid envelope is consumed before the error is returned, so the caller may log and
    /// go on; an over-size prefix consumes nothing (the stream cannot be resynchronised).
    pub fn decode<F: WireFrame>(&self, buf: &mut BytesMut) -> Result<Option<F>, FrameError> {
        let Some(len) = self.peek_len(buf)? else {
            return Ok(None);
        };
        if buf.len() < LENGTH_PREFIX_LEN + len {
            return Ok(None);
        }
        buf.advance(LENGTH_PREFIX_LEN);
        let payload = buf.split_to(len).freeze();
        Ok(Some(F::decode_envelope(payload)?))
    }

    /// Appends one frame (prefix + envelope) to `dst`. Fails, leaving `dst` as it was, when the
    /// envelope is larger than the limit.
    pub fn encode<F: WireFrame>(&self, frame: &F, dst: &mut BytesMut) -> Result<(), FrameError> {
        frame.encode_frame(self.max_frame_len, dst)
    }

    /// [`FrameCodec::encode`] consuming `frame`: what it carries moves into the envelope
    /// instead of being cloned (what the tokio codec does with the frames it is given).
    pub fn encode_owned<F: WireFrame>(
        &self,
        frame: F,
        dst: &mut BytesMut,
    ) -> Result<(), FrameError> {
        frame.encode_frame_owned(self.max_frame_len, dst)
    }

    /// [`FrameCodec::encode_owned`] of a runtime frame, except that a tunnel `BODY` frame
    /// (no metadata) whose body is at least `min_body` bytes is written without its body, which
    /// is returned: on the wire the frame is the bytes appended to `dst` followed by the
    /// returned body (empty for every other frame, written whole into `dst`).
    ///
    /// The writer hands the body to the socket (rustls, which copies it once while encrypting)
    /// as it is, instead of copying it into the frame buffer first: on a bulk tunnel that copy
    /// was the Node's second of each byte (issue #33). The bytes are those `encode_owned`
    /// writes (tests compare them): the body is the last field of `ProviderTunnelFrame`, itself
    /// the last field of the envelope.
    pub fn encode_split(
        &self,
        frame: crate::runtime::RuntimeFrame,
        min_body: usize,
        dst: &mut BytesMut,
    ) -> Result<Bytes, FrameError> {
        use crate::runtime::{RuntimeMessage as M, TunnelPayload};
        let body_len = match &frame.message {
            M::ProviderTunnelFrame(t) if t.metadata.is_empty() => match &t.payload {
                TunnelPayload::Body(b) if b.len() >= min_body.max(1) => b.len(),
                _ => 0,
            },
            _ => 0,
        };
        if body_len == 0 {
            self.encode_owned(frame, dst)?;
            return Ok(Bytes::new());
        }
        let (c, s) = (frame.correlation_id, frame.stream_id);
        let M::ProviderTunnelFrame(tunnel) = frame.message else {
            unreachable!("checked above")
        };
        let TunnelPayload::Body(body) = tunnel.payload else {
            unreachable!("checked above")
        };
        /// Field keys (`field << 3 | wire type`) of `Envelope` and `ProviderTunnelFrame`.
        const CORRELATION_ID_KEY: u64 = 1 << 3;
        const STREAM_ID_KEY: u64 = 2 << 3;
        const TUNNEL_FRAME_KEY: u64 = (17 << 3) | 2;
        const KIND_KEY: u64 = 1 << 3;
        const SEQUENCE_KEY: u64 = 2 << 3;
        const BODY_KEY: u64 = (5 << 3) | 2;
        let kind = crate::proto::runtime::TunnelFrameKind::Body as u64;
        let scalar_len = |v: u64| if v == 0 { 0 } else { 1 + varint_len(v) };
        let inner = scalar_len(kind)
            + scalar_len(tunnel.sequence)
            + 1
            + varint_len(body_len as u64)
            + body_len;
        let len = scalar_len(c) + scalar_len(s) + 2 + varint_len(inner as u64) + inner;
        // The prefix refuses an envelope over the limit before anything is written; the room it
        // reserves is only the head's (the body is not copied into `dst`).
        let prefix = u32::try_from(len)
            .ok()
            .filter(|_| len <= self.max_frame_len)
            .ok_or(FrameError::OutgoingTooLarge {
                len,
                max: self.max_frame_len,
            })?;
        dst.reserve(LENGTH_PREFIX_LEN + len - body_len);
        dst.put_u32(prefix);
        for (key, value) in [(CORRELATION_ID_KEY, c), (STREAM_ID_KEY, s)] {
            if value != 0 {
                put_varint(key, dst);
                put_varint(value, dst);
            }
        }
        put_varint(TUNNEL_FRAME_KEY, dst);
        put_varint(inner as u64, dst);
        for (key, value) in [(KIND_KEY, kind), (SEQUENCE_KEY, tunnel.sequence)] {
            if value != 0 {
                put_varint(key, dst);
                put_varint(value, dst);
            }
        }
        put_varint(BODY_KEY, dst);
        put_varint(body_len as u64, dst);
        Ok(body)
    }

    /// Decodes one frame from the front of `buf` without consuming it and without copying:
    /// the frame's byte fields are slices of `buf`.
    pub fn decode_bytes<F: WireFrame>(&self, buf: &Bytes) -> Result<Decoded<F>, FrameError> {
        let Some(len) = self.peek_len(buf)? else {
            return Ok(Decoded::Incomplete {
                needed: LENGTH_PREFIX_LEN - buf.len(),
            });
        };
        let total = LENGTH_PREFIX_LEN + len;
        if buf.len() < total {
            return Ok(Decoded::Incomplete {
                needed: total - buf.len(),
            });
        }
        let frame = F::decode_envelope(buf.slice(LENGTH_PREFIX_LEN..total))?;
        Ok(Decoded::Frame {
            frame,
            consumed: total,
        })
    }

    /// Encodes one frame into a fresh buffer.
    pub fn encode_to_bytes<F: WireFrame>(&self, frame: &F) -> Result<Bytes, FrameError> {
        let mut buf = BytesMut::new();
        self.encode(frame, &mut buf)?;
        Ok(buf.freeze())
    }
}

// === impl WireFrame ===

/// Appends prefix + `envelope` with a single reservation, or refuses it if over `max_len`.
fn put_frame(
    envelope: &impl prost::Message,
    max_len: usize,
    buf: &mut BytesMut,
) -> Result<(), FrameError> {
    put_prefix(envelope.encoded_len(), max_len, buf)?;
    envelope.encode_raw(buf);
    Ok(())
}

/// Reserves room for a `len`-byte envelope and its prefix and writes the prefix, or refuses an
/// envelope over `max_len` without touching `buf`.
fn put_prefix(len: usize, max_len: usize, buf: &mut BytesMut) -> Result<(), FrameError> {
    // `max_len <= u32::MAX` (see `with_max_frame_len`), so the prefix cannot truncate.
    let prefix = u32::try_from(len)
        .ok()
        .filter(|_| len <= max_len)
        .ok_or(FrameError::OutgoingTooLarge { len, max: max_len })?;
    buf.reserve(LENGTH_PREFIX_LEN + len);
    buf.put_u32(prefix);
    Ok(())
}

/// [`put_frame`] of an `Envelope { correlation_id, stream_id, message: <tag>(message) }`
/// written field by field, with the same bytes prost writes for it (fields in number order,
/// zero scalars omitted, the message length-delimited). It spares building the `Envelope`:
/// the boxed run and tunnel requests are not boxed again, and the message's length is computed
/// once (prost's oneof encoder computes it a second time).
fn put_envelope(
    correlation_id: u64,
    stream_id: u64,
    tag: u32,
    message: &impl prost::Message,
    max_len: usize,
    buf: &mut BytesMut,
) -> Result<(), FrameError> {
    /// Field keys: `field << 3 | wire type` (0 varint, 2 length-delimited).
    const CORRELATION_ID_KEY: u64 = 1 << 3;
    const STREAM_ID_KEY: u64 = 2 << 3;
    let scalar_len = |v: u64| if v == 0 { 0 } else { 1 + varint_len(v) };
    let body = message.encoded_len();
    let key = (u64::from(tag) << 3) | 2;
    let len = scalar_len(correlation_id)
        + scalar_len(stream_id)
        + varint_len(key)
        + varint_len(body as u64)
        + body;
    put_prefix(len, max_len, buf)?;
    for (field_key, value) in [
        (CORRELATION_ID_KEY, correlation_id),
        (STREAM_ID_KEY, stream_id),
    ] {
        if value != 0 {
            put_varint(field_key, buf);
            put_varint(value, buf);
        }
    }
    put_varint(key, buf);
    put_varint(body as u64, buf);
    message.encode_raw(buf);
    Ok(())
}

fn varint_len(v: u64) -> usize {
    // One byte per started group of seven bits (at least one).
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn put_varint(mut v: u64, buf: &mut BytesMut) {
    while v >= 0x80 {
        buf.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    buf.put_u8(v as u8);
}

impl WireFrame for crate::runtime::RuntimeFrame {
    fn decode_envelope(payload: Bytes) -> Result<Self, InvalidMessage> {
        // Repeated fields counted before prost builds them (`prescan`'s docs: an 8 MB frame of
        // empty headers decoded into 224 MB before validation could refuse it).
        crate::prescan::runtime_envelope(&payload)?;
        <crate::proto::runtime::Envelope as prost::Message>::decode(payload)?.try_into()
    }

    fn encode_frame(&self, max_len: usize, buf: &mut BytesMut) -> Result<(), FrameError> {
        put_frame(&self.to_proto(), max_len, buf)
    }

    fn encode_frame_owned(self, max_len: usize, buf: &mut BytesMut) -> Result<(), FrameError> {
        use crate::runtime::RuntimeMessage as M;
        let (c, s) = (self.correlation_id, self.stream_id);
        // The frames of runs and tunnels, the hot path: their strings, maps and bodies move
        // into the message, written without an `Envelope`. Field numbers of `Envelope.message`
        // in `runtime.proto`. The rest (connection-level, once per session or request) convert
        // as `encode_frame` does.
        match self.message {
            M::RunRequest(m) => put_envelope(c, s, 14, &m.into_proto(), max_len, buf),
            M::RunEvent(m) => put_envelope(c, s, 15, &m.into_proto(), max_len, buf),
            M::ProviderTunnelRequest(m) => put_envelope(c, s, 16, &m.into_proto(), max_len, buf),
            M::ProviderTunnelFrame(m) => put_envelope(c, s, 17, &m.into_proto(), max_len, buf),
            message => Self {
                correlation_id: c,
                stream_id: s,
                message,
            }
            .encode_frame(max_len, buf),
        }
    }
}

impl WireFrame for crate::control::ControlFrame {
    fn decode_envelope(payload: Bytes) -> Result<Self, InvalidMessage> {
        crate::prescan::control_envelope(&payload)?;
        <crate::proto::control::ControlEnvelope as prost::Message>::decode(payload)?.try_into()
    }

    fn encode_frame(&self, max_len: usize, buf: &mut BytesMut) -> Result<(), FrameError> {
        if let crate::control::ControlMessage::EncodedProjection(e) = &self.message {
            return put_encoded_projection(self.correlation_id, e, max_len, buf);
        }
        put_frame(&self.to_proto(), max_len, buf)
    }
}

/// A `ControlEnvelope { correlation_id, <part or apply request>(projection) }` around a
/// projection encoded once ([`crate::control::EncodedProjection`]), with the bytes prost writes
/// for the same envelope (`codec` tests compare them): the projection is copied, not encoded
/// again.
fn put_encoded_projection(
    correlation_id: u64,
    e: &crate::control::EncodedProjection,
    max_len: usize,
    buf: &mut BytesMut,
) -> Result<(), FrameError> {
    use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
    let projection = e.bytes().len();
    // The apply request is a message whose field 1 is the projection.
    let body = if e.is_apply() {
        key_len(1) + encoded_len_varint(projection as u64) + projection
    } else {
        projection
    };
    let field = e.envelope_field();
    let id = if correlation_id == 0 {
        0
    } else {
        key_len(1) + encoded_len_varint(correlation_id)
    };
    put_prefix(
        id + key_len(field) + encoded_len_varint(body as u64) + body,
        max_len,
        buf,
    )?;
    if correlation_id != 0 {
        encode_key(1, WireType::Varint, buf);
        encode_varint(correlation_id, buf);
    }
    encode_key(field, WireType::LengthDelimited, buf);
    encode_varint(body as u64, buf);
    if e.is_apply() {
        encode_key(1, WireType::LengthDelimited, buf);
        encode_varint(projection as u64, buf);
    }
    buf.put_slice(e.bytes());
    Ok(())
}

#[cfg(feature = "tokio-codec")]
pub use self::tokio_codec::{
    CodecError, RESERVE_WHOLE_FRAME, TokioCodec, WRITE_BATCH, framed, release_buffers,
};

#[cfg(feature = "tokio-codec")]
mod tokio_codec {
    use std::marker::PhantomData;

    use bytes::BytesMut;

    use super::{FrameCodec, LENGTH_PREFIX_LEN, WireFrame};

    /// The largest frame whose room [`TokioCodec`] reserves whole once its length prefix is
    /// read: 1 MiB and 4 KiB, a tunnel body frame of the largest window the Node cuts to
    /// (1 MiB) and its head.
    ///
    /// tokio-util reads into what the buffer has spare and asks it for one more byte when it
    /// is full. After a frame is handed out (a view of the buffer), the rest of the buffer is
    /// shared with it, so that request allocates a fresh buffer of the partial frame's size,
    /// which then grows by doubling, copying what it holds each time: a 1 MiB body was copied
    /// about once more on the way in, into freshly faulted pages (issue #33's profile of the
    /// bulk path). Reserving the frame's room when its prefix arrives makes it one read into
    /// one buffer. A larger frame grows as bytes arrive, as before, so a peer that declares a
    /// large frame and sends a few bytes of it makes the connection hold at most this much
    /// more than it sent; the bound per connection stays the codec's `max_frame_len`.
    pub const RESERVE_WHOLE_FRAME: usize = (1 << 20) + 4096;
    use crate::error::FrameError;

    /// tokio-util `Decoder`/`Encoder` for frames of type `F` (e.g.
    /// [`RuntimeFrame`](crate::runtime::RuntimeFrame)), over [`FrameCodec`].
    #[derive(Debug)]
    pub struct TokioCodec<F> {
        codec: FrameCodec,
        _frame: PhantomData<fn() -> F>,
    }

    impl<F> TokioCodec<F> {
        /// Wraps `codec`.
        pub fn new(codec: FrameCodec) -> Self {
            Self {
                codec,
                _frame: PhantomData,
            }
        }
    }

    /// How many bytes of frames a connection made by [`framed`] queues before its writer writes
    /// them (`Framed::set_backpressure_boundary`): the plaintext of one TLS record.
    pub const WRITE_BATCH: usize = 16 * 1024;

    /// A runtime-wire connection over `io`: frames of `codec`, read and write buffers that start
    /// at `capacity` bytes (what an idle connection holds; the Edge and the Node use 1 KiB),
    /// and frames written in batches of up to [`WRITE_BATCH`] bytes.
    ///
    /// `Framed::with_capacity` alone makes the starting capacity the write batch too: every
    /// burst past 1 KiB (a tunnel's start and 1 KiB body, then its usage and end) left in two
    /// writes, two TLS records, and two reads and wake-ups at the peer. The write buffer grows
    /// to a batch only while one is queued, and [`release_buffers`] gives the room back.
    pub fn framed<T, F>(
        io: T,
        codec: FrameCodec,
        capacity: usize,
    ) -> tokio_util::codec::Framed<T, TokioCodec<F>>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite,
    {
        #[expect(
            clippy::disallowed_methods,
            reason = "the one place, with the batch set"
        )]
        let mut framed =
            tokio_util::codec::Framed::with_capacity(io, TokioCodec::new(codec), capacity);
        framed.set_backpressure_boundary(WRITE_BATCH);
        framed
    }

    /// Gives back the room a connection's frame buffers grew to: each buffer of `framed` that
    /// is empty is replaced by a fresh one of `keep` bytes. A buffer keeps the allocation of the
    /// largest frame it carried (a 4 MiB request body) until it is replaced; the Edge and the
    /// Node call this at each liveness frame (`Ping`/`Pong`, once per heartbeat interval), so a
    /// connection that carried one large frame does not hold its size while it stays open.
    /// Bodies already handed out as views of the read buffer keep their own bytes.
    pub fn release_buffers<T, U>(framed: &mut tokio_util::codec::Framed<T, U>, keep: usize) {
        if framed.read_buffer().is_empty() {
            *framed.read_buffer_mut() = BytesMut::with_capacity(keep);
        }
        if framed.write_buffer().is_empty() {
            *framed.write_buffer_mut() = BytesMut::with_capacity(keep);
        }
    }

    impl<F> Default for TokioCodec<F> {
        fn default() -> Self {
            Self::new(FrameCodec::default())
        }
    }

    /// Error of the tokio codec: the socket, or the frame.
    #[derive(Debug, thiserror::Error)]
    #[non_exhaustive]
    pub enum CodecError {
        /// The underlying I/O failed.
        #[error("i/o: {0}")]
        Io(#[from] std::io::Error),
        /// The bytes were not a valid frame.
        #[error(transparent)]
        Frame(#[from] FrameError),
    }

    impl<F: WireFrame> tokio_util::codec::Decoder for TokioCodec<F> {
        type Item = F;
        type Error = CodecError;

        /// [`FrameCodec::decode`]; while a frame of at most [`RESERVE_WHOLE_FRAME`] bytes is
        /// incomplete, the buffer is given room for the rest of it at once (see the constant).
        fn decode(&mut self, src: &mut BytesMut) -> Result<Option<F>, CodecError> {
            let frame = self.codec.decode(src)?;
            if frame.is_none()
                && let Ok(Some(len)) = self.codec.peek_len(src)
                && len <= RESERVE_WHOLE_FRAME
            {
                // Incomplete: fewer than `LENGTH_PREFIX_LEN + len` bytes are here.
                src.reserve(LENGTH_PREFIX_LEN + len - src.len());
            }
            Ok(frame)
        }
    }

    impl<F: WireFrame> tokio_util::codec::Encoder<F> for TokioCodec<F> {
        type Error = CodecError;

        fn encode(&mut self, item: F, dst: &mut BytesMut) -> Result<(), CodecError> {
            Ok(self.codec.encode_owned(item, dst)?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::{RuntimeFrame, RuntimeMessage, TunnelFrame, TunnelPayload};

    fn body_frame(body_len: usize) -> RuntimeFrame {
        RuntimeFrame::on_stream(
            7,
            RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
                sequence: 1,
                payload: TunnelPayload::Body(Bytes::from(vec![b'x'; body_len])),
                metadata: Default::default(),
            }),
        )
    }

    /// `encode_split` writes the bytes `encode_owned` writes, the body returned apart: at the
    /// varint boundaries of every length it writes, with and without ids and sequence.
    #[test]
    fn a_split_body_frame_is_the_bytes_encode_owned_writes() {
        let codec = FrameCodec::new();
        let min = 1024;
        let tunnel = |c: u64, s: u64, sequence: u64, payload: TunnelPayload| RuntimeFrame {
            correlation_id: c,
            stream_id: s,
            message: RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
                sequence,
                payload,
                metadata: Default::default(),
            }),
        };
        let mut cases = 0;
        for body_len in [min, 16_383, 16_384, 70_000, 2_097_151, 2_097_152] {
            for (c, s, sequence) in [(0, 0, 0), (0, 7, 1), (300, 1 << 40, 127), (1, 2, 128)] {
                let frame = tunnel(
                    c,
                    s,
                    sequence,
                    TunnelPayload::Body(Bytes::from(vec![b'x'; body_len])),
                );
                let whole = codec.encode_to_bytes(&frame).unwrap();
                let mut head = BytesMut::from(&b"before"[..]);
                let body = codec.encode_split(frame.clone(), min, &mut head).unwrap();
                assert_eq!(body.len(), body_len, "the body comes back whole");
                assert_eq!(&head[..6], b"before", "appended, not replaced");
                let mut wire = head.split_off(6);
                wire.extend_from_slice(&body);
                assert_eq!(
                    wire, whole,
                    "body {body_len}, ids {c}/{s}, sequence {sequence}"
                );
                if s != 0 {
                    // (A stream frame without a stream id is invalid; its bytes still compare.)
                    assert_eq!(
                        codec.decode::<RuntimeFrame>(&mut wire).unwrap(),
                        Some(frame)
                    );
                }
                cases += 1;
            }
        }
        assert_eq!(cases, 24);
        // Written whole: a body under the threshold, a body frame with metadata (its map
        // follows the body on the wire), and every other frame.
        let with_metadata = RuntimeFrame {
            message: RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
                sequence: 3,
                payload: TunnelPayload::Body(Bytes::from(vec![b'y'; 4 * min])),
                metadata: [("k".to_owned(), "v".to_owned())].into(),
            }),
            ..tunnel(0, 5, 0, TunnelPayload::End)
        };
        for frame in [
            tunnel(
                0,
                5,
                2,
                TunnelPayload::Body(Bytes::from(vec![b'z'; min - 1])),
            ),
            with_metadata,
            tunnel(0, 5, 4, TunnelPayload::End),
            RuntimeFrame::new(RuntimeMessage::Ping),
        ] {
            let mut head = BytesMut::new();
            let body = codec.encode_split(frame.clone(), min, &mut head).unwrap();
            assert!(body.is_empty(), "{frame:?}");
            assert_eq!(head.freeze(), codec.encode_to_bytes(&frame).unwrap());
        }
    }

    #[test]
    fn a_split_body_over_the_limit_is_refused_untouched() {
        let limit = 64 * 1024;
        let codec = FrameCodec::with_max_frame_len(limit);
        let n = (limit - 64..limit)
            .find(|&n| envelope_len(n) == limit)
            .expect("some n hits the limit");
        let mut buf = BytesMut::from(&b"queued"[..]);
        assert_eq!(
            codec
                .encode_split(body_frame(n), 1024, &mut buf)
                .unwrap()
                .len(),
            n
        );
        let written = buf.len();
        assert!(matches!(
            codec.encode_split(body_frame(n + 1), 1024, &mut buf),
            Err(FrameError::OutgoingTooLarge { len, max }) if len == limit + 1 && max == limit
        ));
        assert_eq!(buf.len(), written, "nothing written for the refused frame");
    }

    /// The tokio codec gives an incomplete frame of at most `RESERVE_WHOLE_FRAME` its whole
    /// room once its prefix is read (one buffer, no growth by copying), and a larger one only
    /// what arrives.
    #[cfg(feature = "tokio-codec")]
    #[test]
    fn the_tokio_codec_reserves_a_credited_frame_whole() {
        use tokio_util::codec::Decoder as _;
        let big = FrameCodec::with_max_frame_len(4 << 20);
        let mut codec = TokioCodec::<RuntimeFrame>::new(big);
        for (body_len, whole) in [
            (200 * 1024, true),
            (1 << 20, true),
            (RESERVE_WHOLE_FRAME, false),
            (3 << 20, false),
        ] {
            let bytes = big.encode_to_bytes(&body_frame(body_len)).unwrap();
            let mut buf = BytesMut::with_capacity(1024);
            buf.extend_from_slice(&bytes[..100]);
            assert!(codec.decode(&mut buf).unwrap().is_none());
            assert_eq!(
                buf.capacity() >= bytes.len(),
                whole,
                "{body_len}-byte body: capacity {}",
                buf.capacity()
            );
            let at = buf.as_ptr();
            buf.extend_from_slice(&bytes[100..]);
            if whole {
                assert_eq!(buf.as_ptr(), at, "the rest went into the same buffer");
            }
            assert_eq!(codec.decode(&mut buf).unwrap(), Some(body_frame(body_len)));
        }
    }

    /// A burst of frames past the 1 KiB a connection's buffers start at (a tunnel's start, a
    /// 1 KiB body, its usage and end) leaves in one write, not one per KiB.
    #[cfg(feature = "tokio-codec")]
    #[tokio::test]
    async fn a_burst_of_frames_leaves_in_one_write() {
        use futures_util::SinkExt as _;
        use std::pin::Pin;
        use std::task::{Context, Poll};
        /// Records the length of each write.
        struct Writes(Vec<usize>);
        impl tokio::io::AsyncRead for Writes {
            fn poll_read(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
                _: &mut tokio::io::ReadBuf<'_>,
            ) -> Poll<std::io::Result<()>> {
                Poll::Pending
            }
        }
        impl tokio::io::AsyncWrite for Writes {
            fn poll_write(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<std::io::Result<usize>> {
                self.0.push(buf.len());
                Poll::Ready(Ok(buf.len()))
            }
            fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                Poll::Ready(Ok(()))
            }
            fn poll_shutdown(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<std::io::Result<()>> {
                Poll::Ready(Ok(()))
            }
        }
        let codec = FrameCodec::new();
        let burst = [
            body_frame(10),
            body_frame(1024),
            body_frame(10),
            body_frame(10),
        ];
        let len: usize = burst
            .iter()
            .map(|f| codec.encode_to_bytes(f).unwrap().len())
            .sum();
        let mut framed = framed::<_, RuntimeFrame>(Writes(Vec::new()), codec, 1024);
        for frame in burst {
            framed.feed(frame).await.unwrap();
        }
        framed.flush().await.unwrap();
        assert_eq!(framed.get_ref().0, vec![len]);
    }

    #[test]
    fn round_trip_and_incomplete() {
        let codec = FrameCodec::new();
        let frame = body_frame(10);
        let bytes = codec.encode_to_bytes(&frame).unwrap();
        for cut in 0..bytes.len() {
            match codec.decode_slice::<RuntimeFrame>(&bytes[..cut]).unwrap() {
                Decoded::Incomplete { needed } => {
                    assert!(needed > 0 && cut + needed <= bytes.len())
                }
                Decoded::Frame { .. } => {
                    panic!("decoded a frame from {cut} of {} bytes", bytes.len())
                }
            }
        }
        let Decoded::Frame {
            frame: back,
            consumed,
        } = codec.decode_slice::<RuntimeFrame>(&bytes).unwrap()
        else {
            panic!("expected a frame")
        };
        assert_eq!(consumed, bytes.len());
        assert_eq!(back, frame);
        let mut buf = BytesMut::from(&bytes[..]);
        buf.extend_from_slice(&bytes);
        assert_eq!(
            codec.decode::<RuntimeFrame>(&mut buf).unwrap(),
            Some(frame.clone())
        );
        assert_eq!(codec.decode::<RuntimeFrame>(&mut buf).unwrap(), Some(frame));
        assert!(buf.is_empty());
        assert_eq!(codec.decode::<RuntimeFrame>(&mut buf).unwrap(), None);
    }

    /// The envelope length of `body_frame(n)`.
    fn envelope_len(n: usize) -> usize {
        FrameCodec::new()
            .encode_to_bytes(&body_frame(n))
            .unwrap()
            .len()
            - LENGTH_PREFIX_LEN
    }

    #[test]
    fn size_limit_boundaries_on_decode() {
        let limit = 1024;
        // Find a body length whose envelope is exactly `limit` bytes.
        let n = (0..limit)
            .find(|&n| envelope_len(n) == limit)
            .expect("some n hits the limit");
        let big = FrameCodec::with_max_frame_len(limit + 1024);
        let codec = FrameCodec::with_max_frame_len(limit);
        for (body, ok) in [(n - 1, true), (n, true), (n + 1, false)] {
            let bytes = big.encode_to_bytes(&body_frame(body)).unwrap();
            let res = codec.decode_slice::<RuntimeFrame>(&bytes);
            if ok {
                assert!(
                    matches!(res, Ok(Decoded::Frame { .. })),
                    "len {}",
                    bytes.len() - 4
                );
            } else {
                assert_eq!(
                    res.unwrap_err(),
                    FrameError::TooLarge {
                        declared: (limit + 1) as u64,
                        max: limit
                    }
                );
            }
        }
    }

    #[test]
    fn size_limit_boundaries_on_encode() {
        let limit = 1024;
        let n = (0..limit).find(|&n| envelope_len(n) == limit).unwrap();
        let codec = FrameCodec::with_max_frame_len(limit);
        let mut buf = BytesMut::from(&b"keep"[..]);
        assert!(codec.encode(&body_frame(n - 1), &mut buf).is_ok());
        assert!(codec.encode(&body_frame(n), &mut buf).is_ok());
        let before = buf.clone();
        assert_eq!(
            codec.encode(&body_frame(n + 1), &mut buf),
            Err(FrameError::OutgoingTooLarge {
                len: limit + 1,
                max: limit
            })
        );
        assert_eq!(buf, before, "a refused encode leaves the buffer untouched");
    }

    #[test]
    fn oversize_is_rejected_from_the_header_alone() {
        let codec = FrameCodec::with_max_frame_len(16);
        // Only the prefix, declaring 4 GiB - 1: rejected without waiting for (or reserving) it.
        let mut buf = BytesMut::from(&u32::MAX.to_be_bytes()[..]);
        let cap = buf.capacity();
        assert!(matches!(
            codec.decode::<RuntimeFrame>(&mut buf),
            Err(FrameError::TooLarge { declared, .. }) if declared == u64::from(u32::MAX)
        ));
        assert_eq!(buf.capacity(), cap);
        assert_eq!(buf.len(), 4, "nothing consumed");
    }

    #[test]
    fn empty_and_garbage_envelopes_are_invalid_not_incomplete() {
        let codec = FrameCodec::new();
        let empty = 0u32.to_be_bytes();
        assert_eq!(
            codec.decode_slice::<RuntimeFrame>(&empty).unwrap_err(),
            FrameError::Invalid(InvalidMessage::EmptyEnvelope)
        );
        let mut garbage = 3u32.to_be_bytes().to_vec();
        garbage.extend_from_slice(&[0xff, 0xff, 0xff]);
        assert!(matches!(
            codec.decode_slice::<RuntimeFrame>(&garbage).unwrap_err(),
            FrameError::Invalid(InvalidMessage::Protobuf(_))
        ));
        // An invalid frame is consumed so the caller can go on.
        let mut buf = BytesMut::from(&garbage[..]);
        assert!(codec.decode::<RuntimeFrame>(&mut buf).is_err());
        assert!(buf.is_empty());
    }
}
