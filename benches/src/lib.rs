//! Benchmarks for the workspace. The code lives in `benches/benches/`; see `benches/README.md`
//! for how to run them and the numbers measured so far.
#![forbid(unsafe_code)]
