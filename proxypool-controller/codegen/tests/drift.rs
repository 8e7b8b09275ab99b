//! The tonic/prost code for `controlplane.proto` is committed under
//! `proxypool-controller/src/gen/`. This test regenerates it with a pure-Rust toolchain
//! (protox + tonic-prost-build, no system `protoc`) and fails on any drift.
//!
//! After editing the `.proto` file, regenerate with:
//!
//! ```text
//! PROXYPOOL_REGENERATE=1 cargo test -p proxypool-controller-codegen
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test")]

use std::path::{Path, PathBuf};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The single place the code generator is configured.
fn generate(out_dir: &Path) {
    let proto_dir = crate_dir().join("proto");
    let fds = protox::compile(["controlplane.proto"], [&proto_dir]).expect("the .proto compiles");
    // The descriptor set, for the gRPC reflection service.
    std::fs::write(
        out_dir.join("controlplane_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )
    .unwrap();
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .out_dir(out_dir)
        .btree_map(".")
        .bytes(".")
        .compile_fds(fds)
        .expect("tonic-prost-build generates code");
}

#[test]
fn generated_code_matches_proto() {
    let tmp = std::env::temp_dir().join(format!("proxypool-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    generate(&tmp);
    let committed_dir = crate_dir().join("src/gen");
    let regenerate = std::env::var_os("PROXYPOOL_REGENERATE").is_some();
    let mut drift = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert!(!names.is_empty(), "the generator produced no files");
    for name in names {
        let fresh = std::fs::read(tmp.join(&name)).unwrap();
        let committed_path = committed_dir.join(&name);
        let committed = std::fs::read(&committed_path).unwrap_or_default();
        if fresh != committed {
            if regenerate {
                std::fs::create_dir_all(&committed_dir).unwrap();
                std::fs::write(&committed_path, &fresh).unwrap();
            } else {
                drift.push(name.to_string_lossy().into_owned());
            }
        }
    }
    std::fs::remove_dir_all(&tmp).ok();
    assert!(
        drift.is_empty(),
        "generated code in proxypool-controller/src/gen/ is out of date for {drift:?}; run \
         `PROXYPOOL_REGENERATE=1 cargo test -p proxypool-controller-codegen` and commit the result"
    );
}
