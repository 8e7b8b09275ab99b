//! The IOP Node, as an embeddable library.
//!
//! **Status: empty.** This crate is filled by issue #4. It will own the connectivity
//! supervisor (initial dial and reconnect under `iop_wire::reconnect`), the tokio driver around
//! `iop_wire::node::NodeSession`, the `Adapter` trait with the OpenAI-compatible, Ollama and demo
//! adapters, the per-adapter capacity gate, the response-stall watchdog and lease opening.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
