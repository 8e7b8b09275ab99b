//! Generated protobuf code is committed under `src/gen/`. This test regenerates it with a
//! pure-Rust toolchain (protox + prost-build, no system `protoc`) and fails on any drift.
//!
//! After editing a `.proto` file, regenerate with:
//!
//! ```text
//! IOP_WIRE_REGENERATE=1 cargo test -p iop-wire-codegen
//! ```

use std::path::{Path, PathBuf};

/// The `iop-wire` crate directory (this crate lives in `iop-wire/codegen/`).
fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The single place the code generator is configured.
fn generate(out_dir: &Path) {
    let proto_dir = crate_dir().join("proto");
    let fds = protox::compile(["runtime.proto", "control.proto"], [&proto_dir])
        .expect("the .proto files compile");
    let mut config = prost_build::Config::new();
    config
        .out_dir(out_dir)
        // Deterministic encoding: maps iterate in key order, so encode(decode(x)) is stable.
        .btree_map(["."])
        // Zero-copy slices of the received frame for body/input bytes.
        .bytes(["."])
        // The once-per-stream messages boxed: an Envelope is as large as its largest message
        // (680 bytes with these inline), and it is moved whole while decoding and encoding
        // every frame, the hot tunnel and run-event frames included.
        .boxed(".iop.runtime.v1.Envelope.message.register_request")
        .boxed(".iop.runtime.v1.Envelope.message.run_request")
        .boxed(".iop.runtime.v1.Envelope.message.provider_tunnel_request")
        // The stall evidence (200 bytes) only on a stall terminal; inline, it made every
        // tunnel frame and run event that much larger.
        .boxed(".iop.runtime.v1.ProviderTunnelFrame.execution_failure")
        .boxed(".iop.runtime.v1.RunEvent.execution_failure");
    config.compile_fds(fds).expect("prost-build generates code");
}

/// After `IOP_WIRE_REGENERATE=1` wrote `src/gen`, the same comparison without writing.
#[allow(clippy::unwrap_used, reason = "a test helper: failed I/O should panic")]
fn generated_code_matches_proto_after_regeneration() {
    let tmp = std::env::temp_dir().join(format!("iop-wire-codegen-check-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    generate(&tmp);
    let committed_dir = crate_dir().join("src/gen");
    let listing = |dir: &Path| -> Vec<(std::ffi::OsString, String)> {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.file_name(), std::fs::read_to_string(e.path()).unwrap())
            })
            .collect();
        v.sort();
        v
    };
    let (fresh, committed) = (listing(&tmp), listing(&committed_dir));
    std::fs::remove_dir_all(&tmp).ok();
    assert!(
        fresh == committed,
        "src/gen does not match the generator after regenerating"
    );
}

#[test]
fn generated_code_matches_proto() {
    let tmp = std::env::temp_dir().join(format!("iop-wire-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    generate(&tmp);
    let committed_dir = crate_dir().join("src/gen");
    let regenerate = std::env::var_os("IOP_WIRE_REGENERATE").is_some();
    let mut drift = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert!(!names.is_empty(), "the generator produced no files");
    for name in names {
        let fresh = std::fs::read_to_string(tmp.join(&name)).unwrap();
        let committed_path = committed_dir.join(&name);
        let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
        if fresh != committed {
            if regenerate {
                std::fs::write(&committed_path, &fresh).unwrap();
            } else {
                drift.push(name.to_string_lossy().into_owned());
            }
        }
    }
    // A file in src/gen that the generator no longer writes (a renamed or removed proto
    // package) is drift too; regenerating removes it.
    let fresh: std::collections::BTreeSet<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    for entry in std::fs::read_dir(&committed_dir).unwrap() {
        let name = entry.unwrap().file_name();
        if !fresh.contains(&name) {
            if regenerate {
                std::fs::remove_file(committed_dir.join(&name)).unwrap();
            } else {
                drift.push(format!("{} (stale)", name.to_string_lossy()));
            }
        }
    }
    std::fs::remove_dir_all(&tmp).ok();
    if regenerate {
        // What was just written must now match: the regenerate run checks itself.
        return generated_code_matches_proto_after_regeneration();
    }
    assert!(
        drift.is_empty(),
        "generated code in src/gen/ is out of date for {drift:?}; run \
         `IOP_WIRE_REGENERATE=1 cargo test -p iop-wire-codegen` and commit the result"
    );
}
