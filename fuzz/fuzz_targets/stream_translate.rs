//! Untrusted upstream SSE bytes through the Edge's dialect translation, checked for split
//! independence, bounded output, well-formed SSE and preserved text. See
//! `src/stream_translate.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::stream_translate::run(data));
