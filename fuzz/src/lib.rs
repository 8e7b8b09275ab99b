//! Fuzz entry points for `iop-wire`, `iop-lease`, `iop-dialect`, `orbit-runtime` and `proxypool-controller`. Each target in `fuzz_targets/` is a few lines that call
//! one `run` function here; keeping the logic in a library lets `examples/gen_corpus.rs` build
//! seed inputs from the same operation types (see `README.md`).
#![forbid(unsafe_code)]

pub mod frame_decoder;
pub mod lease_open;
pub mod passthrough_splice;
pub mod ping_scanner;
pub mod registry_ops;
pub mod report_decode;
pub mod seed;
pub mod signed_request;
pub mod stream_translate;
pub mod trace_context;
pub mod tunnel_sequencer;
pub mod usage_filter;
pub mod usage_scan;
