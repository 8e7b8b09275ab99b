//! `iop-lease` envelope parsing and opening.
//!
//! The first input byte picks a mode:
//!
//! - even: the rest is a standalone envelope (`ManagedCredential::from_bytes`); whatever parses
//!   is opened against its own binding at its issue time. Parsing must round-trip, and nothing
//!   may panic.
//! - odd: the rest is a list of `(position, xor)` byte pairs applied to the encoding of a valid
//!   envelope; with bit 1 set the mutated envelope is re-signed by the issuer, so the checks
//!   after the signature (recipient, scope, window, decryption, plaintext) are reached.
//!
//! Oracle: whenever a lease opens, its binding is the issued one and the injected header is
//! exactly the issued credential; the secret never appears in an error's text.

use std::sync::OnceLock;

use iop_lease::{
    Credential, HeaderSpec, Issuer, IssuerSigningKey, MemoryReplayGuard, OpenPolicy, Recipient,
    RecipientSecretKey, Secret, TrustedIssuers,
};
use iop_wire::runtime::{CredentialLeaseBinding, ManagedCredential};

/// A fixed test issuer key (PKCS#8, P-256), so committed seeds verify in every run.
const ISSUER_PKCS8: &str = "308187020100301306072a8648ce3d020106082a8648ce3d030107046d306b0201010420a10317a23e2a50cbc941b113f1ba44b66c880a24eb4f71c4ea0d3a319b67a6baa144034200048995ed3fd54875fe91d6336e61eff361db7352fcde098fd974bd0043b5b257975a22f50b4676a1e7e81bf94c888662619b946aa7db12f7c2223e1d42cce36091";
/// A fixed test recipient key.
const RECIPIENT_RAW: [u8; 32] = [0x42; 32];
/// The secret every fixture lease carries.
pub const SECRET: &str = "sk-fuzz-SECRET-value";
/// Issue time of the fixture lease.
pub const NOW: i64 = 1_764_460_800_000;

/// Issuer, recipient, binding and one valid envelope.
#[derive(Debug)]
pub struct Fixture {
    /// The issuer.
    pub issuer: Issuer,
    /// The recipient (trusts the issuer).
    pub recipient: Recipient,
    /// The binding the fixture lease was issued for.
    pub binding: CredentialLeaseBinding,
    /// A valid envelope for `binding`, issued at [`NOW`] for 30 s.
    pub valid: ManagedCredential,
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("constant hex"))
        .collect()
}

/// The shared fixture.
pub fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let key = IssuerSigningKey::from_pkcs8_der("fuzz-issuer", &hex(ISSUER_PKCS8))
            .expect("fixed issuer key loads");
        let issuer = Issuer::new(key, iop_lease::DEFAULT_MAX_TTL).expect("default ttl");
        let secret = RecipientSecretKey::from_raw("fuzz-node-key", &RECIPIENT_RAW)
            .expect("fixed recipient key loads");
        let public = secret.public_key();
        let trusted: TrustedIssuers = [issuer.public_key()].into_iter().collect();
        let recipient = Recipient::new(secret, trusted, OpenPolicy::default());
        let binding = CredentialLeaseBinding {
            principal_id: "p".into(),
            slot_id: "s".into(),
            route_id: "r".into(),
            profile: "openai".into(),
            upstream_target: "gpt-4o-mini".into(),
            node_id: "node-1".into(),
            recipient_key_id: "fuzz-node-key".into(),
            credential_revision: 1,
            route_revision: 2,
            projection_generation: 3,
        };
        let valid = issuer
            .issue(
                &binding,
                &public,
                &credential(),
                NOW,
                std::time::Duration::from_secs(30),
            )
            .expect("fixture lease issues");
        Fixture {
            issuer,
            recipient,
            binding,
            valid,
        }
    })
}

fn credential() -> Credential {
    Credential::new(
        HeaderSpec::bearer(),
        Secret::new(SECRET.as_bytes().to_vec()),
    )
    .expect("valid credential")
}

fn check_opened(opened: iop_lease::OpenedCredential) {
    let mut headers = http::HeaderMap::new();
    opened.inject(&mut headers);
    assert_eq!(headers.len(), 1);
    assert_eq!(
        headers["authorization"],
        format!("Bearer {SECRET}").as_str()
    );
}

fn open(env: &ManagedCredential, expected: &CredentialLeaseBinding, now: i64) {
    let f = fixture();
    let mut guard = MemoryReplayGuard::with_capacity(4);
    match f.recipient.open(env, expected, now, &mut guard) {
        Ok(opened) => {
            assert_eq!(
                &env.binding, &f.binding,
                "a lease opened for a binding never issued"
            );
            check_opened(opened);
        }
        Err(e) => assert!(!format!("{e} {e:?}").contains("SECRET")),
    }
}

/// The fuzz entry point.
pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let f = fixture();
    if mode & 1 == 0 {
        if let Ok(env) = ManagedCredential::from_bytes(rest) {
            let again = ManagedCredential::from_bytes(&env.to_bytes()).expect("re-encoding parses");
            assert_eq!(again, env);
            open(&env, &env.binding, env.lease.issued_at_unix_ms);
        }
        return;
    }
    let mut bytes = f.valid.to_bytes();
    for pair in rest.chunks_exact(2).take(16) {
        let at = usize::from(pair[0]) * bytes.len() / 256;
        bytes[at] ^= pair[1];
    }
    if let Ok(mut env) = ManagedCredential::from_bytes(&bytes) {
        if mode & 2 != 0 && f.issuer.resign(&mut env).is_err() {
            return;
        }
        open(&env, &f.binding, NOW + 1);
    }
}
