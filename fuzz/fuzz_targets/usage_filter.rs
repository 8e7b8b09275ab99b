//! Untrusted upstream bytes through the Edge's usage-chunk filter. See `src/usage_filter.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::usage_filter::run(data));
