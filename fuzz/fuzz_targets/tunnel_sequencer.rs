//! Open/close/frame sequences against `TunnelSequencer`, checked against a model of the
//! ordering rules. See `src/tunnel_sequencer.rs`.
#![no_main]

use iop_fuzz::tunnel_sequencer::{Op, run};

libfuzzer_sys::fuzz_target!(|ops: Vec<Op>| run(&ops));
