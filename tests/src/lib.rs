//! Support code for the end-to-end tests in `tests/tests/` (one file per scenario, over real
//! sockets and TLS).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod net;
pub mod node;
pub mod otlp;
pub mod pki;
pub mod proc;
pub mod redis_cluster;
pub mod upstream;
