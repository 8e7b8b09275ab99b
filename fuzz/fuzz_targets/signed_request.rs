//! `orbit-runtime` signed-request headers + verification. See `src/signed_request.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::signed_request::run(data));
