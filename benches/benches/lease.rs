//! Lease issue (sign + seal) and open (verify + decrypt), each beside the raw primitives
//! measured in the same run:
//!
//! - `primitives/ecdsa_p256_sign/ring`, `primitives/ecdsa_p256_verify/{ring,p256_crate}`: the
//!   two ECDSA implementations the issue asked us to choose between;
//! - `primitives/hpke_seal`, `primitives/hpke_open`: bare HPKE base mode, DHKEM(X25519,
//!   HKDF-SHA256) + HKDF-SHA256 + AES-128-GCM, on the same plaintext size;
//! - `lease/issue`, `lease/open`: the crate's full paths.
//!
//! `lease/open` uses a replay guard that records nothing (the same envelope is opened every
//! iteration), so it measures the signature, scope and window checks and the decryption.
#![allow(clippy::unwrap_used, missing_docs, reason = "benchmark scaffolding")]

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use hpke::{Kem as _, OpModeR, OpModeS, Serializable as _};
use iop_lease::*;
use iop_wire::runtime::CredentialLeaseBinding;
use p256::ecdsa::signature::{Signer as _, Verifier as _};

type Kem = hpke::kem::X25519HkdfSha256;
type Kdf = hpke::kdf::HkdfSha256;
type Aead = hpke::aead::AesGcm128;

const NOW: i64 = 1_764_460_800_000;
const SECRET: &[u8] = b"sk-proj-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"; // 54 bytes

struct NoReplay;

impl ReplayGuard for NoReplay {
    fn check_and_record(&mut self, _: [u8; 16], _: i64, _: i64) -> Result<(), ReplayError> {
        Ok(())
    }
}

fn binding() -> CredentialLeaseBinding {
    CredentialLeaseBinding {
        principal_id: "team-a".into(),
        slot_id: "slot-openai-prod".into(),
        route_id: "route-17".into(),
        profile: "openai".into(),
        upstream_target: "gpt-4o-mini".into(),
        node_id: "node-0042".into(),
        recipient_key_id: "node-0042-k1".into(),
        credential_revision: 3,
        route_revision: 9,
        projection_generation: 1042,
    }
}

fn credential() -> Credential {
    Credential::new(HeaderSpec::bearer(), Secret::new(SECRET.to_vec())).unwrap()
}

fn primitives(c: &mut Criterion) {
    let msg = vec![0x5au8; 330]; // about the size of the signed lease bytes
    let mut g = c.benchmark_group("primitives");

    // ring ECDSA P-256.
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        &rng,
    )
    .unwrap();
    let pair = ring::signature::EcdsaKeyPair::from_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        pkcs8.as_ref(),
        &rng,
    )
    .unwrap();
    let sig = pair.sign(&rng, &msg).unwrap();
    let public = ring::signature::KeyPair::public_key(&pair)
        .as_ref()
        .to_vec();
    g.bench_function("ecdsa_p256_sign/ring", |b| {
        b.iter(|| pair.sign(&rng, black_box(&msg)).unwrap())
    });
    g.bench_function("ecdsa_p256_verify/ring", |b| {
        b.iter(|| {
            ring::signature::UnparsedPublicKey::new(
                &ring::signature::ECDSA_P256_SHA256_FIXED,
                &public,
            )
            .verify(black_box(&msg), sig.as_ref())
            .unwrap()
        })
    });

    // RustCrypto p256.
    let sk = p256::ecdsa::SigningKey::from_slice(&[0x11; 32]).unwrap();
    let vk = *sk.verifying_key();
    let psig: p256::ecdsa::Signature = sk.sign(&msg);
    g.bench_function("ecdsa_p256_sign/p256_crate", |b| {
        b.iter(|| -> p256::ecdsa::Signature { sk.sign(black_box(&msg)) })
    });
    g.bench_function("ecdsa_p256_verify/p256_crate", |b| {
        b.iter(|| vk.verify(black_box(&msg), &psig).unwrap())
    });

    // Bare HPKE on a plaintext the size of the sealed credential.
    let (hsk, hpk) = Kem::gen_keypair();
    let pt = vec![0x41u8; 1 + 2 + 13 + 2 + 7 + 4 + SECRET.len()];
    let info = vec![0x22u8; 120];
    let aad = vec![0x33u8; 60];
    g.bench_function("hpke_seal", |b| {
        b.iter(|| {
            hpke::single_shot_seal::<Aead, Kdf, Kem>(
                &OpModeS::Base,
                &hpk,
                &info,
                black_box(&pt),
                &aad,
            )
            .unwrap()
        })
    });
    let (enc, ct) =
        hpke::single_shot_seal::<Aead, Kdf, Kem>(&OpModeS::Base, &hpk, &info, &pt, &aad).unwrap();
    g.bench_function("hpke_open", |b| {
        b.iter(|| {
            hpke::single_shot_open::<Aead, Kdf, Kem>(
                &OpModeR::Base,
                &hsk,
                &enc,
                &info,
                black_box(&ct),
                &aad,
            )
            .unwrap()
        })
    });
    let _ = enc.to_bytes();
    g.finish();
}

fn lease(c: &mut Criterion) {
    let issuer = Issuer::new(
        IssuerSigningKey::generate("issuer-1").unwrap(),
        DEFAULT_MAX_TTL,
    )
    .unwrap();
    let node_key = RecipientSecretKey::generate("node-0042-k1").unwrap();
    let public = node_key.public_key();
    let recipient = Recipient::new(
        node_key,
        [issuer.public_key()].into_iter().collect(),
        OpenPolicy::default(),
    );
    let b = binding();
    let cred = credential();
    let env = issuer
        .issue(&b, &public, &cred, NOW, Duration::from_secs(30))
        .unwrap();
    println!(
        "lease envelope: {} bytes for a {}-byte secret ({} bytes overhead)",
        env.to_bytes().len(),
        SECRET.len(),
        env.to_bytes().len() - SECRET.len()
    );

    let mut g = c.benchmark_group("lease");
    g.bench_function("issue", |bench| {
        bench.iter(|| {
            issuer
                .issue(black_box(&b), &public, &cred, NOW, Duration::from_secs(30))
                .unwrap()
        })
    });
    g.bench_function("open", |bench| {
        bench.iter(|| {
            recipient
                .open(black_box(&env), &b, NOW + 1, &mut NoReplay)
                .unwrap()
        })
    });
    g.bench_function("open_and_inject", |bench| {
        bench.iter(|| {
            let opened = recipient
                .open(black_box(&env), &b, NOW + 1, &mut NoReplay)
                .unwrap();
            let mut headers = http::HeaderMap::new();
            opened.inject(&mut headers);
            headers
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = primitives, lease
}
criterion_main!(benches);
