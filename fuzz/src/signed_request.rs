//! `orbit-runtime` signed-request header parsing and verification on arbitrary input.
//!
//! Input: ten fields separated by `0x00`: the seven `X-OrbitMesh-*` header values (node id,
//! edge runtime id, installation id, timestamp, nonce, body SHA-256, signature), then method,
//! request target and body. Properties: no panic, bounded work; any input that verifies is
//! exactly the deterministic Ed25519 signature of the fixed test key over its own payload (a
//! forgery or a second accepted encoding would fail this), and it verifies only once (nonce).

use ed25519_dalek::SigningKey;
use orbit_runtime::signing::{self, Identity, NonceStore, parse_headers, sign, verify};

/// Server time of the fixture (the seed corpus is signed at this time).
pub const NOW: i64 = 1_764_460_800;
const WINDOW: i64 = 300;

/// The fixed test key.
pub fn key() -> SigningKey {
    SigningKey::from_bytes(&[7; 32])
}

/// The registered identity of the fixture.
pub fn identity() -> Identity {
    Identity {
        node_id: "node-1".into(),
        edge_runtime_id: "er-1".into(),
        installation_id: "inst-1".into(),
    }
}

/// The seed format of a request: the ten fields joined by `0x00`.
pub fn encode(
    headers: &signing::SignedHeaders,
    method: &str,
    target: &str,
    body: &[u8],
) -> Vec<u8> {
    let mut out = Vec::new();
    for (_, v) in headers.to_pairs() {
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out.extend_from_slice(method.as_bytes());
    out.push(0);
    out.extend_from_slice(target.as_bytes());
    out.push(0);
    out.extend_from_slice(body);
    out
}

/// One fuzz input.
pub fn run(data: &[u8]) {
    let fields: Vec<&[u8]> = data.splitn(10, |b| *b == 0).collect();
    let field = |i: usize| fields.get(i).copied().unwrap_or_default();
    let names = [
        signing::H_NODE_ID,
        signing::H_EDGE_RUNTIME_ID,
        signing::H_INSTALLATION_ID,
        signing::H_TIMESTAMP,
        signing::H_NONCE,
        signing::H_BODY_SHA256,
        signing::H_SIGNATURE,
    ];
    let Ok(h) = parse_headers(|name| {
        names
            .iter()
            .position(|n| *n == name)
            .map(field)
            .filter(|v| !v.is_empty())
    }) else {
        return;
    };
    let method = String::from_utf8_lossy(field(7));
    let target = String::from_utf8_lossy(field(8));
    let body = field(9);
    let key = key();
    let mut nonces = NonceStore::new(WINDOW, 16);
    let verified = verify(
        &h,
        &identity(),
        &key.verifying_key(),
        &method,
        &target,
        body,
        NOW,
        WINDOW,
        &mut nonces,
    );
    if verified.is_ok() {
        let again = sign(
            &key,
            &h.identity,
            &method,
            &target,
            body,
            h.timestamp,
            &h.nonce,
        );
        assert_eq!(
            again.signature, h.signature,
            "accepted a signature the key did not make"
        );
        let replay = verify(
            &h,
            &identity(),
            &key.verifying_key(),
            &method,
            &target,
            body,
            NOW,
            WINDOW,
            &mut nonces,
        );
        assert_eq!(replay, Err(signing::VerifyError::Replayed));
    }
}
