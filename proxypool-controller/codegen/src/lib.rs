//! Code generation for `proxypool-controller`: see `tests/drift.rs`.
#![forbid(unsafe_code)]
