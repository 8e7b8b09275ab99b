//! Arbitrary bytes through the frame codec, as a runtime frame and as a control frame.
//!
//! Never panics; every frame that decodes passes the round-trip oracle: encode → decode gives
//! the same frame, encoding that frame again gives the same bytes, and so does encoding it by
//! value (`encode_owned`, which writes the run and tunnel envelopes field by field).

use std::fmt::Debug;

use iop_wire::codec::{Decoded, FrameCodec, WireFrame};
use iop_wire::control::ControlFrame;
use iop_wire::runtime::RuntimeFrame;

/// The codec limit the target decodes with.
pub const MAX_FRAME_LEN: usize = 64 * 1024;

/// Runs one input.
pub fn run(data: &[u8]) {
    let codec = FrameCodec::with_max_frame_len(MAX_FRAME_LEN);
    round_trip::<RuntimeFrame>(codec, data);
    round_trip::<ControlFrame>(codec, data);
}

fn round_trip<F: WireFrame + PartialEq + Debug + Clone>(codec: FrameCodec, data: &[u8]) {
    let Ok(Decoded::Frame { frame, consumed }) = codec.decode_slice::<F>(data) else {
        return;
    };
    assert!(consumed <= data.len());
    // The canonical encoding of a frame decoded from a few KiB stays far below the limit.
    let encoded = codec
        .encode_to_bytes(&frame)
        .expect("a decoded frame re-encodes");
    let Ok(Decoded::Frame {
        frame: again,
        consumed,
    }) = codec.decode_slice::<F>(&encoded)
    else {
        panic!("re-encoded frame does not decode: {frame:?}");
    };
    assert_eq!(consumed, encoded.len());
    assert_eq!(again, frame, "decode → encode → decode changed the frame");
    let reencoded = codec
        .encode_to_bytes(&again)
        .expect("a decoded frame re-encodes");
    assert_eq!(reencoded, encoded, "encoding is not stable");
    let mut owned = bytes::BytesMut::new();
    codec
        .encode_owned(again, &mut owned)
        .expect("a decoded frame re-encodes by value");
    assert_eq!(owned.freeze(), encoded, "encode_owned differs from encode");
}
