//! At-rest encryption of credential slots with a key only the Control Plane holds.
//!
//! AES-256-GCM (*ring*), a random 96-bit nonce per seal, and the slot id in the associated
//! data, so a sealed credential cannot be moved to another slot. Format: `0x01 ‖ nonce(12) ‖
//! ciphertext ‖ tag(16)`. The master key is 32 random bytes in a file (`0600`) in the data
//! directory, created on first start; losing it makes every slot unreadable (rotate the slots).

use std::path::Path;

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::rand::{SecureRandom as _, SystemRandom};
use zeroize::Zeroizing;

const VERSION: u8 = 1;
const NONCE_LEN: usize = 12;
const AAD_TAG: &[u8] = b"iop-cp/slot/v1\0";
/// Lease issuer keys are sealed under their own tag: no slot's sealed bytes open as a key.
const ISSUER_AAD_TAG: &[u8] = b"iop-cp/issuer/v1\0";

/// Sealing failures. They carry nothing from the plaintext or the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// The sealed bytes are malformed, for another slot, or the key is wrong.
    #[error("sealed credential cannot be opened")]
    Open,
    /// The key file is missing, unreadable or not 32 bytes.
    #[error("master key unavailable")]
    Key,
    /// The system random generator failed.
    #[error("random generator failed")]
    Rng,
}

/// The Control Plane's at-rest key.
pub struct MasterKey {
    key: LessSafeKey,
}

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MasterKey(..)")
    }
}

impl MasterKey {
    /// A key from 32 raw bytes.
    pub fn from_bytes(raw: &[u8]) -> Result<Self, SealError> {
        let unbound = UnboundKey::new(&AES_256_GCM, raw).map_err(|_| SealError::Key)?;
        Ok(Self {
            key: LessSafeKey::new(unbound),
        })
    }

    /// A fresh random key and its raw bytes (to store).
    pub fn generate() -> Result<(Self, Zeroizing<[u8; 32]>), SealError> {
        let mut raw = Zeroizing::new([0u8; 32]);
        SystemRandom::new()
            .fill(raw.as_mut())
            .map_err(|_| SealError::Rng)?;
        Ok((Self::from_bytes(raw.as_ref())?, raw))
    }

    /// Loads the key file at `path`, creating it (mode `0600`) when it does not exist.
    pub fn load_or_create(path: &Path) -> Result<Self, SealError> {
        match std::fs::read(path) {
            Ok(raw) => {
                let raw = Zeroizing::new(raw);
                Self::from_bytes(&raw)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let (key, raw) = Self::generate()?;
                write_private(path, raw.as_ref()).map_err(|_| SealError::Key)?;
                Ok(key)
            }
            Err(_) => Err(SealError::Key),
        }
    }

    /// Seals `plaintext` for `slot_id`.
    pub fn seal(&self, slot_id: &str, plaintext: &[u8]) -> Result<Vec<u8>, SealError> {
        self.seal_with(aad(AAD_TAG, slot_id), plaintext)
    }

    /// Opens what [`MasterKey::seal`] produced for the same `slot_id`.
    pub fn open(&self, slot_id: &str, sealed: &[u8]) -> Result<Zeroizing<Vec<u8>>, SealError> {
        self.open_with(aad(AAD_TAG, slot_id), sealed)
    }

    /// Seals a lease issuer key's PEM for key id `key_id` (a separate associated-data tag from
    /// slots).
    pub fn seal_issuer(&self, key_id: &str, pem: &[u8]) -> Result<Vec<u8>, SealError> {
        self.seal_with(aad(ISSUER_AAD_TAG, key_id), pem)
    }

    /// Opens what [`MasterKey::seal_issuer`] produced for the same `key_id`.
    pub fn open_issuer(
        &self,
        key_id: &str,
        sealed: &[u8],
    ) -> Result<Zeroizing<Vec<u8>>, SealError> {
        self.open_with(aad(ISSUER_AAD_TAG, key_id), sealed)
    }

    fn seal_with(&self, aad: Vec<u8>, plaintext: &[u8]) -> Result<Vec<u8>, SealError> {
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| SealError::Rng)?;
        let mut out = Vec::with_capacity(1 + NONCE_LEN + plaintext.len() + 16);
        out.push(VERSION);
        out.extend_from_slice(&nonce);
        let mut body = plaintext.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad),
                &mut body,
            )
            .map_err(|_| SealError::Open)?;
        out.extend_from_slice(&body);
        Ok(out)
    }

    fn open_with(&self, aad: Vec<u8>, sealed: &[u8]) -> Result<Zeroizing<Vec<u8>>, SealError> {
        let [VERSION, rest @ ..] = sealed else {
            return Err(SealError::Open);
        };
        if rest.len() < NONCE_LEN + 16 {
            return Err(SealError::Open);
        }
        let (nonce, body) = rest.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError::Open)?;
        let mut buf = Zeroizing::new(body.to_vec());
        let len = self
            .key
            .open_in_place(nonce, Aad::from(aad), &mut buf)
            .map_err(|_| SealError::Open)?
            .len();
        buf.truncate(len);
        Ok(buf)
    }
}

fn aad(tag: &[u8], id: &str) -> Vec<u8> {
    let mut a = tag.to_vec();
    a.extend_from_slice(id.as_bytes());
    a
}

/// Writes a new file readable by its owner only (`0600` on Unix); fails if it exists.
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        opts.mode(0o600);
    }
    let mut f = opts.open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn seal_open_and_slot_binding() {
        let (key, _) = MasterKey::generate().unwrap();
        let sealed = key.seal("slot-a", b"sk-secret").unwrap();
        assert!(!sealed.windows(9).any(|w| w == b"sk-secret"));
        assert_eq!(
            key.open("slot-a", &sealed).unwrap().as_slice(),
            b"sk-secret"
        );
        assert_eq!(key.open("slot-b", &sealed).unwrap_err(), SealError::Open);
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(key.open("slot-a", &flipped).unwrap_err(), SealError::Open);
        assert_eq!(key.open("slot-a", &[]).unwrap_err(), SealError::Open);
        assert_eq!(key.open("slot-a", &[1, 2, 3]).unwrap_err(), SealError::Open);
        let (other, _) = MasterKey::generate().unwrap();
        assert_eq!(other.open("slot-a", &sealed).unwrap_err(), SealError::Open);
    }

    #[test]
    fn key_file_is_created_once_and_private() {
        let dir = std::env::temp_dir().join(format!("iop-cp-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("master.key");
        let _ = std::fs::remove_file(&path);
        let a = MasterKey::load_or_create(&path).unwrap();
        let sealed = a.seal("s", b"x").unwrap();
        let b = MasterKey::load_or_create(&path).unwrap();
        assert_eq!(b.open("s", &sealed).unwrap().as_slice(), b"x");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
