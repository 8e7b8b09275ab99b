//! Generated tonic/prost code for `proto/controlplane.proto` (package `controlplane.v1`),
//! committed under `src/gen/` and checked for drift by `proxypool-controller-codegen`.
//! Public: workers, tests and the load tool use the generated client.
#![allow(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    unused_qualifications,
    clippy::all,
    clippy::pedantic
)]

/// `controlplane.v1`: messages, the `worker_control_plane_server` and the
/// `worker_control_plane_client`.
pub mod controlplane {
    include!("gen/controlplane.v1.rs");
}

/// The encoded `FileDescriptorSet` of `controlplane.proto` (for gRPC reflection).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!("gen/controlplane_descriptor.bin");
