//! `iop-lease` envelope parsing + open, raw and structure-aware. See `src/lease_open.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::lease_open::run(data));
