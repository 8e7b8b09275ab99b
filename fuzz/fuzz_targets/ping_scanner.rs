//! Arbitrary client bytes through the proxy-pool controller's keepalive enforcement scanner.
//! See `src/ping_scanner.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::ping_scanner::run(data));
