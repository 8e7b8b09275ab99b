//! Signed-request verification: every single-byte change of method, path, query, body,
//! timestamp, nonce or identity header is rejected; replays inside the window are rejected and
//! requests outside it too; small-order ("weak") keys and malleable signatures are rejected.
#![allow(clippy::unwrap_used, reason = "tests")]

use std::collections::HashMap;

use ed25519_dalek::SigningKey;
use orbit_runtime::signing::{
    self, Identity, NonceStore, SignedHeaders, VerifyError, parse_headers, parse_public_key, sign,
    verify,
};

const PATH: &str = "/api/v1/edge-runtime/heartbeat?verbose=1";
const BODY: &[u8] = br#"{"reported_address":"203.0.113.7"}"#;
const NONCE: &str = "0123456789abcdef0123456789abcdef";
const NOW: i64 = 1_764_460_800;
const WINDOW: i64 = 300;

fn key() -> SigningKey {
    SigningKey::from_bytes(&[7; 32])
}

fn identity() -> Identity {
    Identity {
        node_id: "node-1".into(),
        edge_runtime_id: "er-1".into(),
        installation_id: "inst-1".into(),
    }
}

/// The request as the server receives it: method, target, body, header map.
#[derive(Clone)]
struct Received {
    method: String,
    target: String,
    body: Vec<u8>,
    headers: HashMap<&'static str, Vec<u8>>,
}

fn signed() -> Received {
    let h = sign(&key(), &identity(), "POST", PATH, BODY, NOW, NONCE);
    Received {
        method: "POST".into(),
        target: PATH.into(),
        body: BODY.to_vec(),
        headers: h
            .to_pairs()
            .into_iter()
            .map(|(k, v)| (k, v.into_bytes()))
            .collect(),
    }
}

fn check(r: &Received, nonces: &mut NonceStore) -> Result<(), VerifyError> {
    let h: SignedHeaders = parse_headers(|name| r.headers.get(name).map(Vec::as_slice))?;
    verify(
        &h,
        &identity(),
        &key().verifying_key(),
        &r.method,
        &r.target,
        &r.body,
        NOW,
        WINDOW,
        nonces,
    )
}

fn fresh() -> NonceStore {
    NonceStore::new(WINDOW, 1024)
}

/// Every byte position of `s`, changed to another allowed-looking byte.
fn mutations(s: &[u8]) -> Vec<Vec<u8>> {
    (0..s.len())
        .map(|i| {
            let mut m = s.to_vec();
            m[i] = if m[i] == b'a' { b'b' } else { b'a' };
            m
        })
        .collect()
}

#[test]
fn the_signed_request_verifies_once() {
    let mut n = fresh();
    check(&signed(), &mut n).unwrap();
    assert_eq!(check(&signed(), &mut n), Err(VerifyError::Replayed));
}

#[test]
fn every_single_byte_change_is_rejected() {
    let base = signed();
    let mut total = 0;
    // Method, path + query, body.
    for m in mutations(base.method.as_bytes()) {
        let mut r = base.clone();
        r.method = String::from_utf8(m).unwrap();
        assert!(check(&r, &mut fresh()).is_err());
        total += 1;
    }
    for m in mutations(base.target.as_bytes()) {
        let mut r = base.clone();
        r.target = String::from_utf8(m).unwrap();
        assert_eq!(
            check(&r, &mut fresh()),
            Err(VerifyError::BadSignature),
            "{}",
            r.target
        );
        total += 1;
    }
    for m in mutations(&base.body) {
        let mut r = base.clone();
        r.body = m;
        assert_eq!(
            check(&r, &mut fresh()),
            Err(VerifyError::BodyDigestMismatch)
        );
        total += 1;
    }
    // Every header byte, including the signature and the digest.
    for name in [
        signing::H_NODE_ID,
        signing::H_EDGE_RUNTIME_ID,
        signing::H_INSTALLATION_ID,
        signing::H_TIMESTAMP,
        signing::H_NONCE,
        signing::H_BODY_SHA256,
        signing::H_SIGNATURE,
    ] {
        for m in mutations(&base.headers[name]) {
            let mut r = base.clone();
            r.headers.insert(name, m);
            assert!(check(&r, &mut fresh()).is_err(), "{name}");
            total += 1;
        }
        let mut r = base.clone();
        r.headers.remove(name);
        assert_eq!(
            check(&r, &mut fresh()),
            Err(VerifyError::MissingHeader(name))
        );
    }
    assert!(total > 250, "{total} mutations");
}

#[test]
fn timestamp_window() {
    for (ts, ok) in [
        (NOW - WINDOW, true),
        (NOW + WINDOW, true),
        (NOW - WINDOW - 1, false),
        (NOW + WINDOW + 1, false),
    ] {
        let h = sign(&key(), &identity(), "POST", PATH, BODY, ts, NONCE);
        let r = Received {
            method: "POST".into(),
            target: PATH.into(),
            body: BODY.to_vec(),
            headers: h
                .to_pairs()
                .into_iter()
                .map(|(k, v)| (k, v.into_bytes()))
                .collect(),
        };
        let got = check(&r, &mut fresh());
        assert_eq!(got.is_ok(), ok, "{ts}: {got:?}");
        if !ok {
            assert_eq!(got, Err(VerifyError::StaleTimestamp));
        }
    }
}

#[test]
fn nonces_expire_with_the_window_and_the_store_is_bounded() {
    let mut n = NonceStore::new(WINDOW, 2);
    n.record("node-1", "a".repeat(16).as_str(), NOW, NOW)
        .unwrap();
    assert_eq!(
        n.record("node-1", &"a".repeat(16), NOW, NOW + WINDOW),
        Err(VerifyError::Replayed)
    );
    // Another node may use the same nonce.
    n.record("node-2", &"a".repeat(16), NOW, NOW).unwrap();
    // Full of live entries: fail closed.
    assert_eq!(
        n.record("node-1", &"b".repeat(16), NOW, NOW),
        Err(VerifyError::NonceStoreFull)
    );
    // After the window the old entries go and the nonce may be seen again (its request would be
    // stale by then anyway).
    n.record(
        "node-1",
        &"b".repeat(16),
        NOW + WINDOW + 1,
        NOW + WINDOW + 1,
    )
    .unwrap();
    assert!(n.len() <= 2);
}

#[test]
fn weak_keys_and_malleable_signatures() {
    // The eight small-order point encodings (Wycheproof / RFC 8032 edge cases).
    let small_order = [
        "0100000000000000000000000000000000000000000000000000000000000000",
        "0000000000000000000000000000000000000000000000000000000000000000",
        "0000000000000000000000000000000000000000000000000000000000000080",
        "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
        "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
        "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
        "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
        "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",
    ];
    for hex in small_order {
        let raw: Vec<u8> = (0..32)
            .map(|i| u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).unwrap())
            .collect();
        assert!(parse_public_key(&raw).is_none(), "weak key accepted: {hex}");
    }
    assert!(parse_public_key(&[1; 31]).is_none());
    assert!(parse_public_key(key().verifying_key().as_bytes()).is_some());
    // S + L: the same signature in a non-canonical encoding is rejected.
    const L: [u8; 32] = [
        0xed, 0xd3, 0xf5, 0x5c, 0x1a, 0x63, 0x12, 0x58, 0xd6, 0x9c, 0xf7, 0xa2, 0xde, 0xf9, 0xde,
        0x14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10,
    ];
    let base = signed();
    let mut h = parse_headers(|name| base.headers.get(name).map(Vec::as_slice)).unwrap();
    let mut carry = 0u16;
    for (s, l) in h.signature[32..].iter_mut().zip(L) {
        let v = u16::from(*s) + u16::from(l) + carry;
        *s = (v & 0xff) as u8;
        carry = v >> 8;
    }
    let got = verify(
        &h,
        &identity(),
        &key().verifying_key(),
        "POST",
        PATH,
        BODY,
        NOW,
        WINDOW,
        &mut fresh(),
    );
    assert_eq!(got, Err(VerifyError::BadSignature));
}

#[test]
fn errors_map_to_stable_answers() {
    // No signature header: authentication missing (401); present but malformed: 400.
    assert_eq!(VerifyError::MissingHeader(signing::H_NONCE).status(), 401);
    assert_eq!(VerifyError::MalformedHeader(signing::H_NONCE).status(), 400);
    for e in [
        VerifyError::BadSignature,
        VerifyError::Replayed,
        VerifyError::StaleTimestamp,
        VerifyError::BodyDigestMismatch,
        VerifyError::UnknownIdentity,
    ] {
        assert_eq!(e.status(), 401);
        assert!(!e.to_string().contains("node-1"));
    }
}
