//! Arbitrary bytes through `FrameCodec::decode_slice` as runtime and control frames; every
//! decoded frame must survive decode → encode → decode unchanged. See `src/frame_decoder.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::frame_decoder::run(data));
