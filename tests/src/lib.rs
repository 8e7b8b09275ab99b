//! End-to-end tests over real sockets and TLS live in `tests/tests/`, one file per scenario.
#![forbid(unsafe_code)]
