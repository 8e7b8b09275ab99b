//! Issuer (ECDSA P-256) and recipient (X25519) keys: generation, loading and export.
//!
//! | key | raw form | PEM form |
//! |---|---|---|
//! | issuer signing key | — | PKCS#8 `PRIVATE KEY` |
//! | issuer public key | 65-byte SEC1 uncompressed point | SPKI `PUBLIC KEY` |
//! | recipient secret key | 32 bytes | PKCS#8 `PRIVATE KEY` (RFC 8410) |
//! | recipient public key | 32 bytes | SPKI `PUBLIC KEY` (RFC 8410) |
//!
//! Every key carries an id (1–128 bytes of `A-Z a-z 0-9 . _ - :`): issuer ids let a Node trust
//! several issuer keys during rotation; recipient ids are named by the lease binding.
//!
//! ECDSA uses *ring* (measured ≈3× faster verification than the RustCrypto `p256` crate here;
//! see `benches/README.md`). Signatures are the fixed 64-byte `r || s` form, normalised to
//! low-S on signing and required to be low-S on verification, so a valid signature has exactly
//! one encoding.

use std::collections::BTreeMap;

use hpke::{Deserializable as _, Kem as _, Serializable as _};
use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, KeyPair as _};
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{PrivatePkcs8KeyDer, SubjectPublicKeyInfoDer};
use zeroize::Zeroizing;

pub(crate) type Kem = hpke::kem::X25519HkdfSha256;

/// DER prefix of a P-256 uncompressed-point SubjectPublicKeyInfo (RFC 5480).
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];
/// DER prefix of an X25519 SubjectPublicKeyInfo (RFC 8410).
const X25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x6e, 0x03, 0x21, 0x00,
];
/// DER prefix of an X25519 PKCS#8 private key without attributes (RFC 8410).
const X25519_PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x6e, 0x04, 0x22, 0x04, 0x20,
];

/// Why a key could not be generated, loaded or used. Never carries key material.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key id is empty, too long or has characters outside `A-Z a-z 0-9 . _ - :`.
    #[error("invalid key id")]
    InvalidKeyId,
    /// The PEM text has no section of the expected kind, or is not PEM.
    #[error("no {0} PEM section found")]
    Pem(&'static str),
    /// The DER bytes are not a key of the expected algorithm and form.
    #[error("not a valid {0}")]
    Malformed(&'static str),
    /// The system random generator failed.
    #[error("random number generation failed")]
    Rng,
}

pub(crate) fn check_key_id(id: &str) -> Result<(), KeyError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'));
    if ok {
        Ok(())
    } else {
        Err(KeyError::InvalidKeyId)
    }
}

fn pem(label: &str, der: &[u8]) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        // Base64 output is ASCII.
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// The key id derived from an issuer public key: `p256:` and the first 8 bytes of the
/// SHA-256 of its SEC1 uncompressed point, in lowercase hex (`p256:3f2a…`, 21 characters).
///
/// The Control Plane signs with this id and a Node computes it from the PEM it pins, so the
/// two agree without an operator copying an id around; a different key has a different id.
pub fn issuer_key_id(point: &[u8; 65]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, point);
    let mut id = String::with_capacity(21);
    id.push_str("p256:");
    for b in &d.as_ref()[..8] {
        id.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        id.push(char::from(b"0123456789abcdef"[usize::from(b & 0xf)]));
    }
    id
}

// === impl IssuerSigningKey ===

/// The Control Plane's lease-signing key (ECDSA P-256, SHA-256).
pub struct IssuerSigningKey {
    key_id: String,
    pair: EcdsaKeyPair,
    pkcs8: Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for IssuerSigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuerSigningKey")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

impl IssuerSigningKey {
    /// Generates a new key.
    pub fn generate(key_id: &str) -> Result<Self, KeyError> {
        check_key_id(key_id)?;
        let rng = SystemRandom::new();
        let doc = EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
            .map_err(|_| KeyError::Rng)?;
        Self::from_pkcs8_der(key_id, doc.as_ref())
    }

    /// Loads a PKCS#8 DER key (as ring and OpenSSL 3 write them, with the public key included).
    pub fn from_pkcs8_der(key_id: &str, der: &[u8]) -> Result<Self, KeyError> {
        check_key_id(key_id)?;
        let pair = EcdsaKeyPair::from_pkcs8(
            &signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            der,
            &SystemRandom::new(),
        )
        .map_err(|_| KeyError::Malformed("P-256 PKCS#8 private key"))?;
        Ok(Self {
            key_id: key_id.to_owned(),
            pair,
            pkcs8: Zeroizing::new(der.to_vec()),
        })
    }

    /// Loads a PEM `PRIVATE KEY` (PKCS#8).
    pub fn from_pem(key_id: &str, pem_text: &str) -> Result<Self, KeyError> {
        let der = PrivatePkcs8KeyDer::from_pem_slice(pem_text.as_bytes())
            .map_err(|_| KeyError::Pem("PRIVATE KEY"))?;
        Self::from_pkcs8_der(key_id, der.secret_pkcs8_der())
    }

    /// The PEM `PRIVATE KEY` (PKCS#8) text, zeroized on drop.
    pub fn to_pem(&self) -> Zeroizing<String> {
        Zeroizing::new(pem("PRIVATE KEY", &self.pkcs8))
    }

    /// Generates a new key whose id is [`issuer_key_id`] of its public key.
    pub fn generate_derived() -> Result<Self, KeyError> {
        Self::generate("pending").map(Self::with_derived_id)
    }

    /// Loads a PEM `PRIVATE KEY` (PKCS#8) with the id [`issuer_key_id`] of its public key.
    pub fn from_pem_derived(pem_text: &str) -> Result<Self, KeyError> {
        Self::from_pem("pending", pem_text).map(Self::with_derived_id)
    }

    fn with_derived_id(mut self) -> Self {
        self.key_id = issuer_key_id(self.public_key().sec1());
        self
    }

    /// The key id.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The matching public key, for the Nodes' trust list.
    pub fn public_key(&self) -> IssuerPublicKey {
        let mut point = [0u8; 65];
        point.copy_from_slice(self.pair.public_key().as_ref());
        IssuerPublicKey {
            key_id: self.key_id.clone(),
            point,
        }
    }

    /// Signs `message` and returns the low-S `r || s` signature.
    pub(crate) fn sign(&self, message: &[u8]) -> Result<[u8; 64], KeyError> {
        let sig = self
            .pair
            .sign(&SystemRandom::new(), message)
            .map_err(|_| KeyError::Rng)?;
        let mut out = [0u8; 64];
        out.copy_from_slice(sig.as_ref());
        normalize_low_s(&mut out);
        Ok(out)
    }
}

// === impl IssuerPublicKey ===

/// An issuer's public key, as a Node pins it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IssuerPublicKey {
    key_id: String,
    point: [u8; 65],
}

impl IssuerPublicKey {
    /// From a 65-byte SEC1 uncompressed point. The point itself is validated when used.
    pub fn from_sec1(key_id: &str, point: &[u8]) -> Result<Self, KeyError> {
        check_key_id(key_id)?;
        let point = <[u8; 65]>::try_from(point)
            .ok()
            .filter(|p| p[0] == 0x04)
            .ok_or(KeyError::Malformed("P-256 uncompressed point"))?;
        Ok(Self {
            key_id: key_id.to_owned(),
            point,
        })
    }

    /// From a DER SubjectPublicKeyInfo.
    pub fn from_spki_der(key_id: &str, der: &[u8]) -> Result<Self, KeyError> {
        let point = der
            .strip_prefix(&P256_SPKI_PREFIX[..])
            .ok_or(KeyError::Malformed("P-256 SubjectPublicKeyInfo"))?;
        Self::from_sec1(key_id, point)
    }

    /// From a PEM `PUBLIC KEY`.
    pub fn from_pem(key_id: &str, pem_text: &str) -> Result<Self, KeyError> {
        let der = SubjectPublicKeyInfoDer::from_pem_slice(pem_text.as_bytes())
            .map_err(|_| KeyError::Pem("PUBLIC KEY"))?;
        Self::from_spki_der(key_id, der.as_ref())
    }

    /// From a PEM `PUBLIC KEY`, with the id [`issuer_key_id`] of the key.
    pub fn from_pem_derived(pem_text: &str) -> Result<Self, KeyError> {
        let mut key = Self::from_pem("pending", pem_text)?;
        key.key_id = issuer_key_id(&key.point);
        Ok(key)
    }

    /// The PEM `PUBLIC KEY` text.
    pub fn to_pem(&self) -> String {
        let mut der = P256_SPKI_PREFIX.to_vec();
        der.extend_from_slice(&self.point);
        pem("PUBLIC KEY", &der)
    }

    /// The key id.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The SEC1 uncompressed point.
    pub fn sec1(&self) -> &[u8; 65] {
        &self.point
    }

    /// Verifies a low-S `r || s` signature over `message`.
    pub(crate) fn verify(&self, message: &[u8], sig: &[u8; 64]) -> bool {
        is_low_s(sig)
            && signature::UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_FIXED, &self.point)
                .verify(message, sig)
                .is_ok()
    }
}

/// The issuer keys a Node trusts, by id. Several at once during key rotation.
#[derive(Clone, Debug, Default)]
pub struct TrustedIssuers {
    keys: BTreeMap<String, IssuerPublicKey>,
}

impl TrustedIssuers {
    /// An empty set (which opens nothing).
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts `key` (replacing a key with the same id).
    pub fn insert(&mut self, key: IssuerPublicKey) {
        self.keys.insert(key.key_id.clone(), key);
    }

    /// Stops trusting the key with `key_id`.
    pub fn remove(&mut self, key_id: &str) -> Option<IssuerPublicKey> {
        self.keys.remove(key_id)
    }

    /// The key with `key_id`.
    pub fn get(&self, key_id: &str) -> Option<&IssuerPublicKey> {
        self.keys.get(key_id)
    }

    /// The trusted key ids, in order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// Number of trusted keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is trusted.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

impl FromIterator<IssuerPublicKey> for TrustedIssuers {
    fn from_iter<I: IntoIterator<Item = IssuerPublicKey>>(iter: I) -> Self {
        let mut t = Self::new();
        for k in iter {
            t.insert(k);
        }
        t
    }
}

// === low-S ===

// The normalisation and the check are the `p256`/`ecdsa` crate's (`Signature::normalize_s`,
// constant time); signing and verifying stay *ring*'s, about 3× faster here.

fn is_low_s(sig: &[u8; 64]) -> bool {
    // Not a valid signature encoding at all (r or s zero, or not below n): not low-S either.
    p256::ecdsa::Signature::from_slice(sig).is_ok_and(|s| s.normalize_s() == s)
}

/// Replaces a high `s` with `n - s` (an equally valid signature).
fn normalize_low_s(sig: &mut [u8; 64]) {
    if let Ok(s) = p256::ecdsa::Signature::from_slice(sig) {
        sig.copy_from_slice(&s.normalize_s().to_bytes());
    }
}

// === impl RecipientSecretKey ===

/// A Node's X25519 lease recipient key.
pub struct RecipientSecretKey {
    key_id: String,
    secret: <Kem as hpke::Kem>::PrivateKey,
    public: [u8; 32],
}

impl std::fmt::Debug for RecipientSecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecipientSecretKey")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

impl RecipientSecretKey {
    /// Generates a new key.
    pub fn generate(key_id: &str) -> Result<Self, KeyError> {
        check_key_id(key_id)?;
        let (secret, public) = Kem::gen_keypair();
        let mut pk = [0u8; 32];
        pk.copy_from_slice(&public.to_bytes());
        Ok(Self {
            key_id: key_id.to_owned(),
            secret,
            public: pk,
        })
    }

    /// From the 32 raw secret bytes.
    pub fn from_raw(key_id: &str, raw: &[u8]) -> Result<Self, KeyError> {
        check_key_id(key_id)?;
        let secret = <Kem as hpke::Kem>::PrivateKey::from_bytes(raw)
            .map_err(|_| KeyError::Malformed("X25519 private key"))?;
        let public = <Kem as hpke::Kem>::sk_to_pk(&secret);
        let mut pk = [0u8; 32];
        pk.copy_from_slice(&public.to_bytes());
        Ok(Self {
            key_id: key_id.to_owned(),
            secret,
            public: pk,
        })
    }

    /// From a PKCS#8 DER private key (RFC 8410).
    pub fn from_pkcs8_der(key_id: &str, der: &[u8]) -> Result<Self, KeyError> {
        let raw = der
            .strip_prefix(&X25519_PKCS8_PREFIX[..])
            .filter(|raw| raw.len() == 32)
            .ok_or(KeyError::Malformed("X25519 PKCS#8 private key"))?;
        Self::from_raw(key_id, raw)
    }

    /// From a PEM `PRIVATE KEY`.
    pub fn from_pem(key_id: &str, pem_text: &str) -> Result<Self, KeyError> {
        let der = PrivatePkcs8KeyDer::from_pem_slice(pem_text.as_bytes())
            .map_err(|_| KeyError::Pem("PRIVATE KEY"))?;
        Self::from_pkcs8_der(key_id, der.secret_pkcs8_der())
    }

    /// The PEM `PRIVATE KEY` text, zeroized on drop.
    pub fn to_pem(&self) -> Zeroizing<String> {
        let mut der = Zeroizing::new(X25519_PKCS8_PREFIX.to_vec());
        der.extend_from_slice(&self.secret.to_bytes());
        Zeroizing::new(pem("PRIVATE KEY", &der))
    }

    /// The 32 raw secret bytes, zeroized on drop.
    pub fn to_raw(&self) -> Zeroizing<[u8; 32]> {
        let mut out = Zeroizing::new([0u8; 32]);
        out.copy_from_slice(&self.secret.to_bytes());
        out
    }

    /// The key id.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The public half, for the Node's registration.
    pub fn public_key(&self) -> RecipientPublicKey {
        RecipientPublicKey {
            key_id: self.key_id.clone(),
            bytes: self.public,
        }
    }

    pub(crate) fn hpke_secret(&self) -> &<Kem as hpke::Kem>::PrivateKey {
        &self.secret
    }
}

// === impl RecipientPublicKey ===

/// A Node's X25519 recipient public key and its id, as registered with the Edge.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecipientPublicKey {
    key_id: String,
    bytes: [u8; 32],
}

impl RecipientPublicKey {
    /// From the 32 raw bytes.
    pub fn from_raw(key_id: &str, raw: &[u8]) -> Result<Self, KeyError> {
        check_key_id(key_id)?;
        let bytes =
            <[u8; 32]>::try_from(raw).map_err(|_| KeyError::Malformed("X25519 public key"))?;
        Ok(Self {
            key_id: key_id.to_owned(),
            bytes,
        })
    }

    /// From a DER SubjectPublicKeyInfo (RFC 8410).
    pub fn from_spki_der(key_id: &str, der: &[u8]) -> Result<Self, KeyError> {
        let raw = der
            .strip_prefix(&X25519_SPKI_PREFIX[..])
            .ok_or(KeyError::Malformed("X25519 SubjectPublicKeyInfo"))?;
        Self::from_raw(key_id, raw)
    }

    /// From a PEM `PUBLIC KEY`.
    pub fn from_pem(key_id: &str, pem_text: &str) -> Result<Self, KeyError> {
        let der = SubjectPublicKeyInfoDer::from_pem_slice(pem_text.as_bytes())
            .map_err(|_| KeyError::Pem("PUBLIC KEY"))?;
        Self::from_spki_der(key_id, der.as_ref())
    }

    /// The PEM `PUBLIC KEY` text.
    pub fn to_pem(&self) -> String {
        let mut der = X25519_SPKI_PREFIX.to_vec();
        der.extend_from_slice(&self.bytes);
        pem("PUBLIC KEY", &der)
    }

    /// The key id.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The 32 raw bytes (what `RegisterRequest.recipient_public_key` carries).
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.bytes
    }

    /// The form `RegisterRequest` carries.
    pub fn to_registration(&self) -> iop_wire::runtime::RecipientKey {
        iop_wire::runtime::RecipientKey {
            key_id: self.key_id.clone(),
            public_key: self.bytes,
        }
    }

    pub(crate) fn hpke_public(&self) -> Result<<Kem as hpke::Kem>::PublicKey, KeyError> {
        <Kem as hpke::Kem>::PublicKey::from_bytes(&self.bytes)
            .map_err(|_| KeyError::Malformed("X25519 public key"))
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn derived_issuer_ids_agree_between_the_private_and_the_public_pem_and_differ_per_key() {
        let a = IssuerSigningKey::generate_derived().unwrap();
        let b = IssuerSigningKey::generate_derived().unwrap();
        assert!(
            a.key_id().starts_with("p256:") && a.key_id().len() == 21,
            "{}",
            a.key_id()
        );
        assert_ne!(a.key_id(), b.key_id());
        let public = IssuerPublicKey::from_pem_derived(&a.public_key().to_pem()).unwrap();
        assert_eq!(public.key_id(), a.key_id());
        let reloaded = IssuerSigningKey::from_pem_derived(&a.to_pem()).unwrap();
        assert_eq!(reloaded.key_id(), a.key_id());
        check_key_id(a.key_id()).unwrap();
    }

    use super::*;

    #[test]
    fn issuer_key_pem_round_trip_and_signatures_are_low_s() {
        let key = IssuerSigningKey::generate("issuer-1").unwrap();
        let again = IssuerSigningKey::from_pem("issuer-1", &key.to_pem()).unwrap();
        assert_eq!(again.public_key(), key.public_key());
        let public = IssuerPublicKey::from_pem("issuer-1", &key.public_key().to_pem()).unwrap();
        assert_eq!(public, key.public_key());
        for i in 0..32u8 {
            let msg = [i; 10];
            let sig = key.sign(&msg).unwrap();
            assert!(is_low_s(&sig));
            assert!(public.verify(&msg, &sig));
            assert!(!public.verify(&[i ^ 1; 10], &sig));
        }
    }

    /// The P-256 group order `n`, big-endian (the tests' independent arithmetic).
    const P256_N: [u8; 32] = [
        0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        0xff, 0xbc, 0xe6, 0xfa, 0xad, 0xa7, 0x17, 0x9e, 0x84, 0xf3, 0xb9, 0xca, 0xc2, 0xfc, 0x63,
        0x25, 0x51,
    ];

    /// `r || be(s)` with `s` given as a 32-byte big-endian value.
    fn sig_with_s(s: [u8; 32]) -> [u8; 64] {
        let mut sig = [0u8; 64];
        sig[31] = 1; // r = 1
        sig[32..].copy_from_slice(&s);
        sig
    }

    /// `n - x`, big-endian.
    fn n_minus(x: [u8; 32]) -> [u8; 32] {
        let mut out = [0u8; 32];
        let mut borrow = 0i16;
        for i in (0..32).rev() {
            let mut d = i16::from(P256_N[i]) - i16::from(x[i]) - borrow;
            borrow = i16::from(d < 0);
            if d < 0 {
                d += 256;
            }
            out[i] = u8::try_from(d).unwrap();
        }
        out
    }

    /// The boundary: `s = (n-1)/2` is the largest low value, `(n+1)/2` the smallest high one
    /// (normalised to `(n-1)/2`), `1` and `n-1` are twins, `0` and `n` are no signature.
    #[test]
    fn low_s_boundaries() {
        // (n - 1) / 2
        let half: [u8; 32] = [
            0x7f, 0xff, 0xff, 0xff, 0x80, 0x00, 0x00, 0x00, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff,
            0xff, 0xff, 0xde, 0x73, 0x7d, 0x56, 0xd3, 0x8b, 0xcf, 0x42, 0x79, 0xdc, 0xe5, 0x61,
            0x7e, 0x31, 0x92, 0xa8,
        ];
        let above = n_minus(half); // (n + 1) / 2
        assert!(is_low_s(&sig_with_s(half)));
        assert!(!is_low_s(&sig_with_s(above)));
        let mut x = sig_with_s(above);
        normalize_low_s(&mut x);
        assert_eq!(x, sig_with_s(half));
        let mut one = [0u8; 32];
        one[31] = 1;
        assert!(is_low_s(&sig_with_s(one)));
        let mut top = sig_with_s(n_minus(one));
        assert!(!is_low_s(&top));
        normalize_low_s(&mut top);
        assert_eq!(top, sig_with_s(one));
        assert!(!is_low_s(&sig_with_s([0; 32])), "s = 0 is no signature");
        assert!(!is_low_s(&sig_with_s(P256_N)), "s = n is no signature");
    }

    #[test]
    fn high_s_twin_is_rejected() {
        let key = IssuerSigningKey::generate("k").unwrap();
        let sig = key.sign(b"m").unwrap();
        // n - s is the other valid encoding; it must not verify.
        let mut twin = sig;
        let mut borrow = 0i16;
        for i in (0..32).rev() {
            let mut d = i16::from(P256_N[i]) - i16::from(sig[32 + i]) - borrow;
            borrow = i16::from(d < 0);
            if d < 0 {
                d += 256;
            }
            twin[32 + i] = u8::try_from(d).unwrap();
        }
        assert!(!is_low_s(&twin));
        assert!(!key.public_key().verify(b"m", &twin));
        let mut normalized = twin;
        normalize_low_s(&mut normalized);
        assert_eq!(normalized, sig);
    }

    #[test]
    fn recipient_key_forms_round_trip() {
        let key = RecipientSecretKey::generate("rk-1").unwrap();
        let again = RecipientSecretKey::from_pem("rk-1", &key.to_pem()).unwrap();
        assert_eq!(again.public_key(), key.public_key());
        let raw = RecipientSecretKey::from_raw("rk-1", &key.to_raw()[..]).unwrap();
        assert_eq!(raw.public_key(), key.public_key());
        let public = RecipientPublicKey::from_pem("rk-1", &key.public_key().to_pem()).unwrap();
        assert_eq!(public, key.public_key());
        let reg = public.to_registration();
        assert_eq!(
            (reg.key_id.as_str(), &reg.public_key),
            ("rk-1", public.as_bytes())
        );
        assert!(!format!("{key:?}").contains(&format!("{:?}", &key.to_raw()[..4])));
    }

    #[test]
    fn bad_keys_and_ids_are_typed_errors() {
        assert_eq!(
            IssuerSigningKey::generate("").unwrap_err(),
            KeyError::InvalidKeyId
        );
        assert_eq!(
            IssuerSigningKey::generate("a b").unwrap_err(),
            KeyError::InvalidKeyId
        );
        assert_eq!(
            IssuerSigningKey::from_pem("k", "not pem").unwrap_err(),
            KeyError::Pem("PRIVATE KEY")
        );
        assert!(matches!(
            IssuerPublicKey::from_sec1("k", &[4; 64]),
            Err(KeyError::Malformed(_))
        ));
        assert!(matches!(
            RecipientPublicKey::from_raw("k", &[1; 31]),
            Err(KeyError::Malformed(_))
        ));
        let x = RecipientSecretKey::generate("k").unwrap();
        // An X25519 key is not a P-256 key.
        assert!(IssuerPublicKey::from_pem("k", &x.public_key().to_pem()).is_err());
    }
}
