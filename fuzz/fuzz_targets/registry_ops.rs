//! Accept/register/ready/close/timeout/app-frame sequences against the Edge `Registry`, checked
//! for strict ready/fence alternation per generation. See `src/registry_ops.rs`.
#![no_main]

use iop_fuzz::registry_ops::{Op, run};

libfuzzer_sys::fuzz_target!(|ops: Vec<Op>| run(&ops));
