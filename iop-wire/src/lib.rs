//! placeholder
mod proto;
