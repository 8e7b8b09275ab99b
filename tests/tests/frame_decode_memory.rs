//! What one runtime frame costs to decode, counted by this test binary's allocator (`cap`): a
//! frame of nothing but empty repeated elements is refused before prost builds them.
//!
//! An 8 MB `ProviderTunnelFrame` of four million empty headers (2 bytes each on the wire, a
//! 48-byte struct each decoded) peaked at 224 MB of heap before validation could refuse its
//! 129th header; an Edge reading many Nodes could hold that once per Node. `iop_wire`'s codec
//! now counts repeated fields before decoding (`prescan`, see `iop_wire::codec`'s docs): the
//! same frame costs nothing beyond its own bytes. Without the count this test fails (checked).
//!
//! One test per binary: the allocator's peak is the whole process's, so nothing else may run
//! beside it.
#![allow(clippy::unwrap_used, reason = "tests")]

use std::alloc::System;

use bytes::{BufMut as _, BytesMut};
use cap::Cap;
use iop_wire::codec::FrameCodec;
use iop_wire::error::{FrameError, InvalidMessage};
use iop_wire::runtime::RuntimeFrame;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

/// Appends a protobuf varint.
fn varint(buf: &mut BytesMut, mut v: usize) {
    while v >= 0x80 {
        buf.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    buf.put_u8(v as u8);
}

#[test]
fn a_frame_of_empty_headers_is_refused_before_it_is_built() {
    const HEADERS: usize = 4_000_000;
    // Envelope { stream_id: 7, provider_tunnel_frame (17): { headers (4): "" × HEADERS } },
    // written straight into the one buffer the codec reads, so that building it peaks at its
    // own size.
    let inner = 2 * HEADERS;
    let mut frame = BytesMut::with_capacity(inner + 16);
    frame.put_u32(0); // the length prefix, set below
    frame.put_slice(&[0x10, 0x07, 0x8a, 0x01]);
    varint(&mut frame, inner);
    for _ in 0..HEADERS {
        frame.put_slice(&[0x22, 0x00]);
    }
    let len = u32::try_from(frame.len() - 4).unwrap();
    frame[..4].copy_from_slice(&len.to_be_bytes());
    let size = frame.len();

    let before = ALLOCATOR.allocated();
    assert!(
        ALLOCATOR.max_allocated() < before + size,
        "building the frame peaked at its own size"
    );
    let decoded = FrameCodec::with_max_frame_len(16 << 20).decode::<RuntimeFrame>(&mut frame);
    let peak = ALLOCATOR.max_allocated().saturating_sub(before);
    println!(
        "a {size}-byte frame of empty headers: {peak} bytes allocated at the peak of its decode"
    );
    assert!(
        matches!(
            decoded,
            Err(FrameError::Invalid(InvalidMessage::TooLong("headers")))
        ),
        "refused for its headers: {decoded:?}"
    );
    assert!(
        peak < 1 << 20,
        "decoding cost {peak} bytes beyond the frame's own {size}"
    );
}
