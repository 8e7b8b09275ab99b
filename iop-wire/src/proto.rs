//! Generated protobuf code (prost), nested as the proto packages are so cross-package paths
//! resolve. Private to the crate: the public API is the domain types in `runtime`/`control`.
#![allow(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    unused_qualifications,
    clippy::all,
    clippy::pedantic
)]

pub(crate) mod iop {
    pub(crate) mod runtime {
        pub(crate) mod v1 {
            include!("gen/iop.runtime.v1.rs");
        }
    }
    pub(crate) mod control {
        pub(crate) mod v1 {
            include!("gen/iop.control.v1.rs");
        }
    }
}

pub(crate) use iop::control::v1 as control;
pub(crate) use iop::runtime::v1 as runtime;
