//! A client's request body through the Edge's passthrough splice. See
//! `src/passthrough_splice.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::passthrough_splice::run(data));
