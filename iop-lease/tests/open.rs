//! Opening leases: every single-field mutation is refused with the right error, the validity
//! window at its boundaries, replay, foreign recipients, low-order keys, key rotation, and the
//! RFC 9180 known answer through the crate's own HPKE path.
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::time::Duration;

use bytes::Bytes;
use iop_lease::*;
use iop_wire::runtime::{CredentialLeaseBinding, ManagedCredential};

const NOW: i64 = 1_764_460_800_000;
const SECRET: &str = "sk-live-DO-NOT-LEAK-0123456789";
const TTL: Duration = Duration::from_secs(30);

struct World {
    issuer: Issuer,
    recipient: Recipient,
    node_public: RecipientPublicKey,
    binding: CredentialLeaseBinding,
}

fn world() -> World {
    let issuer = Issuer::new(
        IssuerSigningKey::generate("issuer-a").unwrap(),
        DEFAULT_MAX_TTL,
    )
    .unwrap();
    let node_key = RecipientSecretKey::generate("node-1-k1").unwrap();
    let node_public = node_key.public_key();
    let trusted: TrustedIssuers = [issuer.public_key()].into_iter().collect();
    let recipient = Recipient::new(node_key, trusted, OpenPolicy::default());
    let binding = CredentialLeaseBinding {
        principal_id: "team-a".into(),
        slot_id: "slot-openai".into(),
        route_id: "route-1".into(),
        profile: "openai".into(),
        upstream_target: "gpt-4o-mini".into(),
        node_id: "node-1".into(),
        recipient_key_id: "node-1-k1".into(),
        credential_revision: 3,
        route_revision: 4,
        projection_generation: 5,
    };
    World {
        issuer,
        recipient,
        node_public,
        binding,
    }
}

fn credential() -> Credential {
    Credential::new(
        HeaderSpec::bearer(),
        Secret::new(SECRET.as_bytes().to_vec()),
    )
    .unwrap()
}

impl World {
    fn issue(&self) -> ManagedCredential {
        self.issuer
            .issue(&self.binding, &self.node_public, &credential(), NOW, TTL)
            .unwrap()
    }

    fn open(&self, env: &ManagedCredential, now: i64) -> Result<OpenedCredential, OpenError> {
        self.recipient
            .open(env, &self.binding, now, &mut MemoryReplayGuard::default())
    }
}

fn assert_no_secret(e: &OpenError) {
    assert!(!format!("{e} {e:?}").contains("DO-NOT-LEAK"));
}

#[test]
fn a_valid_lease_opens_and_injects_only_its_header() {
    let w = world();
    let env = w.issue();
    let opened = w.open(&env, NOW + 1).unwrap();
    assert!(!format!("{opened:?}").contains("DO-NOT-LEAK"));
    assert_eq!(opened.lease_id(), env.lease.lease_id);
    let mut headers = http::HeaderMap::new();
    headers.insert("x-request-id", http::HeaderValue::from_static("r1"));
    opened.inject(&mut headers);
    assert_eq!(headers.len(), 2);
    assert_eq!(
        headers["authorization"],
        format!("Bearer {SECRET}").as_str()
    );
    // The standalone byte form round-trips and still opens.
    let back = ManagedCredential::from_bytes(&env.to_bytes()).unwrap();
    assert_eq!(back, env);
    assert!(w.open(&back, NOW + 2).is_ok());
}

#[test]
fn every_signed_field_mutation_breaks_the_signature() {
    let w = world();
    let env = w.issue();
    let flip = |b: &Bytes| {
        let mut v = b.to_vec();
        v[0] ^= 1;
        Bytes::from(v)
    };
    type Mutation = (&'static str, Box<dyn Fn(&mut ManagedCredential)>);
    let mutations: Vec<Mutation> = vec![
        (
            "signature",
            Box::new(move |e| e.lease.signature = flip(&e.lease.signature)),
        ),
        ("lease_id", Box::new(|e| e.lease.lease_id[0] ^= 1)),
        ("issued_at", Box::new(|e| e.lease.issued_at_unix_ms -= 1)),
        ("not_after", Box::new(|e| e.lease.not_after_unix_ms -= 1)),
        ("enc", Box::new(move |e| e.lease.enc = flip(&e.lease.enc))),
        (
            "recipient_public_key",
            Box::new(move |e| e.lease.recipient_public_key = flip(&e.lease.recipient_public_key)),
        ),
        (
            "ciphertext",
            Box::new(move |e| e.lease.ciphertext = flip(&e.lease.ciphertext)),
        ),
        (
            "binding.principal_id",
            Box::new(|e| e.binding.principal_id.push('x')),
        ),
        ("binding.slot_id", Box::new(|e| e.binding.slot_id.push('x'))),
        (
            "binding.route_id",
            Box::new(|e| e.binding.route_id.push('x')),
        ),
        ("binding.profile", Box::new(|e| e.binding.profile.push('x'))),
        (
            "binding.upstream_target",
            Box::new(|e| e.binding.upstream_target.push('x')),
        ),
        ("binding.node_id", Box::new(|e| e.binding.node_id.push('x'))),
        (
            "binding.recipient_key_id",
            Box::new(|e| e.binding.recipient_key_id.push('x')),
        ),
        (
            "binding.credential_revision",
            Box::new(|e| e.binding.credential_revision += 1),
        ),
        (
            "binding.route_revision",
            Box::new(|e| e.binding.route_revision += 1),
        ),
        (
            "binding.projection_generation",
            Box::new(|e| e.binding.projection_generation += 1),
        ),
    ];
    for (name, mutate) in &mutations {
        let mut m = env.clone();
        mutate(&mut m);
        let err = w.open(&m, NOW + 1).unwrap_err();
        assert_eq!(err, OpenError::BadSignature, "mutating {name}");
        assert_no_secret(&err);
    }
    // Format-level mutations are caught before the signature.
    let mut m = env.clone();
    m.lease.version = 2;
    assert_eq!(w.open(&m, NOW).unwrap_err(), OpenError::UnsupportedVersion);
    let mut m = env.clone();
    m.lease.signature = m.lease.signature.slice(..63);
    assert_eq!(
        w.open(&m, NOW).unwrap_err(),
        OpenError::Malformed("signature")
    );
    let mut m = env.clone();
    m.lease.enc = m.lease.enc.slice(..31);
    assert_eq!(w.open(&m, NOW).unwrap_err(), OpenError::Malformed("enc"));
    let mut m = env.clone();
    m.lease.ciphertext = m.lease.ciphertext.slice(..15);
    assert_eq!(
        w.open(&m, NOW).unwrap_err(),
        OpenError::Malformed("ciphertext")
    );
    let mut m = env;
    m.lease.issuer_key_id = "issuer-unknown".into();
    assert_eq!(w.open(&m, NOW).unwrap_err(), OpenError::UnknownIssuer);
}

#[test]
fn resigned_mutations_still_fail_at_their_own_step() {
    // Even the issuer cannot move a sealed credential to another binding or time window:
    // re-signing a mutated envelope gets past the signature, and a later step refuses it.
    let w = world();
    let env = w.issue();
    let resigned = |f: &dyn Fn(&mut ManagedCredential)| {
        let mut m = env.clone();
        f(&mut m);
        w.issuer.resign(&mut m).unwrap();
        m
    };
    // A binding field changed in the envelope: the scope check names the field...
    let m = resigned(&|e| e.binding.route_revision += 1);
    assert_eq!(
        w.open(&m, NOW).unwrap_err(),
        OpenError::BindingMismatch("route_revision")
    );
    // ...and even when the Node expects exactly that binding, HPKE `info` refuses it.
    let mut replay = MemoryReplayGuard::default();
    assert_eq!(
        w.recipient
            .open(&m, &m.binding, NOW, &mut replay)
            .unwrap_err(),
        OpenError::DecryptFailed
    );
    // Timestamps are in the AEAD's associated data.
    let m = resigned(&|e| e.lease.not_after_unix_ms -= 1);
    assert_eq!(w.open(&m, NOW).unwrap_err(), OpenError::DecryptFailed);
    let m = resigned(&|e| e.lease.lease_id[5] ^= 0x80);
    assert_eq!(w.open(&m, NOW).unwrap_err(), OpenError::DecryptFailed);
    let m = resigned(&|e| {
        let mut c = e.lease.ciphertext.to_vec();
        c[0] ^= 1;
        e.lease.ciphertext = c.into();
    });
    assert_eq!(w.open(&m, NOW).unwrap_err(), OpenError::DecryptFailed);
    let m = resigned(&|e| {
        let mut c = e.lease.enc.to_vec();
        c[3] ^= 1;
        e.lease.enc = c.into();
    });
    assert_eq!(w.open(&m, NOW).unwrap_err(), OpenError::DecryptFailed);
    // The all-zero X25519 shared secret: a low-order `enc` (u = 0) is refused by the HPKE
    // crate's mandatory check, surfacing as a decryption failure.
    let m = resigned(&|e| e.lease.enc = Bytes::from_static(&[0; 32]));
    assert_eq!(w.open(&m, NOW).unwrap_err(), OpenError::DecryptFailed);
    // A recipient key that is not ours.
    let m = resigned(&|e| e.lease.recipient_public_key = Bytes::from_static(&[9; 32]));
    assert_eq!(w.open(&m, NOW).unwrap_err(), OpenError::WrongRecipient);
}

#[test]
fn expected_binding_mismatches_name_the_field() {
    let w = world();
    let env = w.issue();
    type Case = (&'static str, Box<dyn Fn(&mut CredentialLeaseBinding)>);
    let cases: Vec<Case> = vec![
        (
            "principal_id",
            Box::new(|b| b.principal_id = "team-b".into()),
        ),
        ("slot_id", Box::new(|b| b.slot_id = "slot-2".into())),
        ("route_id", Box::new(|b| b.route_id = "route-2".into())),
        ("profile", Box::new(|b| b.profile = "anthropic".into())),
        (
            "upstream_target",
            Box::new(|b| b.upstream_target = "gpt-4o".into()),
        ),
        ("node_id", Box::new(|b| b.node_id = "node-2".into())),
        (
            "recipient_key_id",
            Box::new(|b| b.recipient_key_id = "node-1-k2".into()),
        ),
        (
            "credential_revision",
            Box::new(|b| b.credential_revision = 2),
        ),
        ("route_revision", Box::new(|b| b.route_revision = 5)),
        (
            "projection_generation",
            Box::new(|b| b.projection_generation = 6),
        ),
    ];
    for (field, mutate) in cases {
        let mut expected = w.binding.clone();
        mutate(&mut expected);
        let err = w
            .recipient
            .open(&env, &expected, NOW, &mut MemoryReplayGuard::default())
            .unwrap_err();
        assert_eq!(err, OpenError::BindingMismatch(field));
    }
}

#[test]
fn validity_window_boundaries() {
    let w = world();
    let env = w.issue();
    let skew = i64::try_from(DEFAULT_CLOCK_SKEW.as_millis()).unwrap();
    let not_after = env.lease.not_after_unix_ms;
    let issued_at = env.lease.issued_at_unix_ms;
    // End of the window: not_after − skew, not_after, not_after + skew − 1 open; + skew does not.
    for now in [not_after - skew, not_after, not_after + skew - 1] {
        assert!(
            w.open(&env, now).is_ok(),
            "now = not_after {:+}",
            now - not_after
        );
    }
    assert_eq!(
        w.open(&env, not_after + skew).unwrap_err(),
        OpenError::Expired
    );
    // Start of the window: issued_at − skew opens, one millisecond earlier does not.
    assert!(w.open(&env, issued_at - skew).is_ok());
    assert_eq!(
        w.open(&env, issued_at - skew - 1).unwrap_err(),
        OpenError::NotYetValid
    );
}

#[test]
fn ttl_is_bounded_on_both_sides() {
    let w = world();
    // The issuer refuses a TTL above its maximum.
    assert_eq!(
        w.issuer
            .issue(
                &w.binding,
                &w.node_public,
                &credential(),
                NOW,
                DEFAULT_MAX_TTL + Duration::from_millis(1)
            )
            .unwrap_err(),
        IssueError::TtlOutOfBounds
    );
    assert_eq!(
        Issuer::new(
            IssuerSigningKey::generate("i").unwrap(),
            Duration::from_secs(3600)
        )
        .unwrap_err(),
        IssueError::InvalidMaxTtl
    );
    // A permissive issuer's long lease is refused by a stricter recipient.
    let long = Issuer::new(
        IssuerSigningKey::generate("issuer-long").unwrap(),
        HARD_MAX_TTL,
    )
    .unwrap();
    let node_key = RecipientSecretKey::generate("node-1-k1").unwrap();
    let public = node_key.public_key();
    let strict = Recipient::new(
        node_key,
        [long.public_key()].into_iter().collect(),
        OpenPolicy {
            max_ttl: Duration::from_secs(60),
            ..OpenPolicy::default()
        },
    );
    let env = long
        .issue(
            &w.binding,
            &public,
            &credential(),
            NOW,
            Duration::from_secs(61),
        )
        .unwrap();
    assert_eq!(
        strict
            .open(&env, &w.binding, NOW, &mut MemoryReplayGuard::default())
            .unwrap_err(),
        OpenError::TtlTooLong
    );
    let ok = long
        .issue(
            &w.binding,
            &public,
            &credential(),
            NOW,
            Duration::from_secs(60),
        )
        .unwrap();
    assert!(
        strict
            .open(&ok, &w.binding, NOW, &mut MemoryReplayGuard::default())
            .is_ok()
    );
}

#[test]
fn replay_is_refused_and_a_full_guard_fails_closed() {
    let w = world();
    let env = w.issue();
    let mut guard = MemoryReplayGuard::with_capacity(1);
    assert!(w.recipient.open(&env, &w.binding, NOW, &mut guard).is_ok());
    assert_eq!(
        w.recipient
            .open(&env, &w.binding, NOW + 5, &mut guard)
            .unwrap_err(),
        OpenError::Replayed
    );
    let other = w.issue();
    assert_eq!(
        w.recipient
            .open(&other, &w.binding, NOW + 5, &mut guard)
            .unwrap_err(),
        OpenError::ReplayGuardFull
    );
    // Once the first lease can no longer pass the window, its entry is released.
    let later =
        env.lease.not_after_unix_ms + i64::try_from(DEFAULT_CLOCK_SKEW.as_millis()).unwrap();
    let fresh = w
        .issuer
        .issue(&w.binding, &w.node_public, &credential(), later, TTL)
        .unwrap();
    assert!(
        w.recipient
            .open(&fresh, &w.binding, later, &mut guard)
            .is_ok()
    );
}

#[test]
fn a_lease_for_another_node_cannot_be_opened() {
    let w = world();
    let other_key = RecipientSecretKey::generate("node-2-k1").unwrap();
    let mut binding = w.binding.clone();
    binding.node_id = "node-2".into();
    binding.recipient_key_id = "node-2-k1".into();
    let env = w
        .issuer
        .issue(&binding, &other_key.public_key(), &credential(), NOW, TTL)
        .unwrap();
    // Node 1 receives node 2's lease: refused whatever binding it expects.
    assert_eq!(w.open(&env, NOW).unwrap_err(), OpenError::WrongRecipient);
    assert_eq!(
        w.recipient
            .open(&env, &binding, NOW, &mut MemoryReplayGuard::default())
            .unwrap_err(),
        OpenError::WrongRecipient
    );
    // The binding's recipient key id must be the recipient's.
    assert_eq!(
        w.issuer
            .issue(&binding, &w.node_public, &credential(), NOW, TTL)
            .unwrap_err(),
        IssueError::RecipientMismatch
    );
}

#[test]
fn sealing_to_a_low_order_key_is_refused() {
    let w = world();
    let zero = RecipientPublicKey::from_raw("node-1-k1", &[0; 32]).unwrap();
    assert_eq!(
        w.issuer
            .issue(&w.binding, &zero, &credential(), NOW, TTL)
            .unwrap_err(),
        IssueError::Seal
    );
}

#[test]
fn issuer_key_rotation() {
    let w = world();
    let next = Issuer::new(
        IssuerSigningKey::generate("issuer-b").unwrap(),
        DEFAULT_MAX_TTL,
    )
    .unwrap();
    let node_key = RecipientSecretKey::generate("node-1-k1").unwrap();
    let public = node_key.public_key();
    let mut recipient = Recipient::new(
        node_key,
        [w.issuer.public_key(), next.public_key()]
            .into_iter()
            .collect(),
        OpenPolicy::default(),
    );
    let mut guard = MemoryReplayGuard::default();
    let old = w
        .issuer
        .issue(&w.binding, &public, &credential(), NOW, TTL)
        .unwrap();
    let new = next
        .issue(&w.binding, &public, &credential(), NOW, TTL)
        .unwrap();
    assert!(recipient.open(&old, &w.binding, NOW, &mut guard).is_ok());
    assert!(recipient.open(&new, &w.binding, NOW, &mut guard).is_ok());
    // Retire the old key.
    recipient.set_trusted_issuers([next.public_key()].into_iter().collect());
    let old2 = w
        .issuer
        .issue(&w.binding, &public, &credential(), NOW, TTL)
        .unwrap();
    assert_eq!(
        recipient
            .open(&old2, &w.binding, NOW, &mut guard)
            .unwrap_err(),
        OpenError::UnknownIssuer
    );
    // A key id claiming another trusted issuer does not verify.
    let mut forged = old2;
    forged.lease.issuer_key_id = "issuer-b".into();
    assert_eq!(
        recipient
            .open(&forged, &w.binding, NOW, &mut guard)
            .unwrap_err(),
        OpenError::BadSignature
    );
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// RFC 9180 Appendix A.1.1: DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM, base mode,
/// sequence number 0, opened through the crate's recipient key type and HPKE suite.
#[test]
fn rfc9180_a1_known_answer() {
    let sk = RecipientSecretKey::from_raw(
        "rfc",
        &hex("4612c550263fc8ad58375df3f557aac531d26850903e55a9f23f21d8534e8ac8"),
    )
    .unwrap();
    assert_eq!(
        sk.public_key().as_bytes().to_vec(),
        hex("3948cfe0ad1ddb695d780e59077195da6c56506b027329794ab02bca80815c4d")
    );
    let pt = hpke_open_for_test_vectors(
        &sk,
        &hex("37fda3567bdbd628e88668c3c8d7e97d1d1253b6d4ea6d44c150f741f1bf4431"),
        &hex("4f6465206f6e2061204772656369616e2055726e"),
        &hex("436f756e742d30"),
        &hex(
            "f938558b5d72f1a23810b4be2ab4f84331acc02fc97babc53a52ae8218a355a96d8770ac83d07bea87e13c512a",
        ),
    );
    assert_eq!(pt.as_deref(), Some(&b"Beauty is truth, truth beauty"[..]));
    // One flipped tag bit and it fails.
    let mut ct = hex(
        "f938558b5d72f1a23810b4be2ab4f84331acc02fc97babc53a52ae8218a355a96d8770ac83d07bea87e13c512a",
    );
    let last = ct.len() - 1;
    ct[last] ^= 1;
    assert!(
        hpke_open_for_test_vectors(
            &sk,
            &hex("37fda3567bdbd628e88668c3c8d7e97d1d1253b6d4ea6d44c150f741f1bf4431"),
            &hex("4f6465206f6e2061204772656369616e2055726e"),
            &hex("436f756e742d30"),
            &ct
        )
        .is_none()
    );
}

#[test]
fn envelope_overhead_is_small_and_fixed() {
    let w = world();
    let env = w.issue();
    let bytes = env.to_bytes().len();
    let secret = SECRET.len();
    // Fixed parts: enc 32 + tag 16 + signature 64 + lease id 16 + recipient key 32 + plaintext
    // framing (1 + 2 + 2 + 4 + "authorization" + "Bearer ") + binding + timestamps + key id.
    let overhead = bytes - secret;
    assert!(overhead < 400, "overhead {overhead} bytes");
    println!("envelope: {bytes} bytes for a {secret}-byte secret ({overhead} bytes overhead)");
}
