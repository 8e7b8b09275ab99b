//! Untrusted provider bytes through the Node's usage scanner. See `src/usage_scan.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::usage_scan::run(data));
