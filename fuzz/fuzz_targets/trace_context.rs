//! Arbitrary `traceparent`/`tracestate` bytes through the W3C trace context parser. See
//! `src/trace_context.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::trace_context::run(data));
