//! Arbitrary bytes through the proxy-pool controller's `ReportRuntime` decoder, held to prost's
//! decode and the service's counter builder. See `src/report_decode.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::report_decode::run(data));
