//! Gateway API keys for the Edge without a Control Plane (legacy mode), and where a request's
//! key is read from.
//!
//! A key is accepted from `Authorization: Bearer <key>` (the scheme is case-insensitive, RFC
//! 9110 §11.1) or `x-api-key: <key>` (what Anthropic clients send). Keys are kept only as
//! SHA-256 digests and a presented key is compared with every digest in constant time, so
//! neither memory nor timing gives a key away. Managed mode authenticates against the Control
//! Plane's projection instead, with the same key extraction.
//!
//! Sources ([`ApiKeys::load`]):
//! - a key file: one entry per line, either a key or `sha256:<64 hex digits>` (so the file need
//!   not hold the keys themselves); blank lines and lines starting with `#` are skipped. A file
//!   that others can read (mode `o+r`) is refused with the reason, like `ssh` refuses a
//!   world-readable private key;
//! - an environment variable holding one key or several separated by commas.
//!
//! **Key ids.** Every key has an id, which is what the rate limiter, metrics and logs name (a
//! key itself never appears anywhere): a key file line may name it after the key, separated by
//! whitespace (`sha256:<hex> team-a`); a key without a name gets `key-<the first 12 hex digits
//! of its SHA-256>`, stable across restarts and reorderings. Ids are 1–64 characters of
//! letters, digits, `.`, `_` and `-`, and unique.

use std::path::Path;

use axum::http::{HeaderMap, header};
use ring::digest::{SHA256, digest};

/// A set of gateway API keys, as SHA-256 digests, each with its id.
#[derive(Clone, Default)]
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
    ids: Vec<std::sync::Arc<str>>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeys")
            .field("count", &self.digests.len())
            .finish()
    }
}

/// Why API keys could not be loaded. Never carries a key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiKeysError {
    /// The key file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The key file can be read by other users.
    #[error("{path} is readable by other users (mode {mode:o}); make it private: chmod 600 {path}")]
    WorldReadable {
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// A `sha256:` line is not 64 hex digits.
    #[error("{path}:{line}: a sha256: entry must be 64 hex digits")]
    BadDigest {
        /// The file.
        path: String,
        /// The line number.
        line: usize,
    },
    /// The environment variable is not set or empty.
    #[error("environment variable {0} is not set or empty")]
    MissingEnv(String),
    /// No key at all.
    #[error("no API key configured")]
    Empty,
    /// A key id is not 1–64 letters, digits, `.`, `_` or `-`.
    #[error("{path}:{line}: a key id must be 1-64 letters, digits, '.', '_' or '-'")]
    BadId {
        /// The file.
        path: String,
        /// The line number.
        line: usize,
    },
    /// Two keys have the same id.
    #[error("key id {0} is used twice")]
    DuplicateId(String),
}

/// Whether `id` may name a key (it goes into metric labels and logs as is).
pub fn valid_key_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl ApiKeys {
    /// Keys given directly.
    pub fn new<I, S>(keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut k = Self::default();
        for key in keys {
            k.add(key.as_ref());
        }
        k
    }

    /// Adds one key, its id derived from it (`key-<12 hex digits of its SHA-256>`).
    pub fn add(&mut self, key: &str) {
        self.push(sha256(key.as_bytes()), None);
    }

    /// Adds one key with the id `id`. Fails on an id that is not valid or already used.
    pub fn add_named(&mut self, id: &str, key: &str) -> Result<(), ApiKeysError> {
        if !valid_key_id(id) {
            return Err(ApiKeysError::BadId {
                path: "(code)".into(),
                line: 0,
            });
        }
        self.push_unique(sha256(key.as_bytes()), Some(id))
    }

    fn push(&mut self, digest: [u8; 32], id: Option<&str>) {
        let id = match id {
            Some(id) => std::sync::Arc::from(id),
            None => {
                let mut s = String::from("key-");
                for b in &digest[..6] {
                    s.push_str(&format!("{b:02x}"));
                }
                std::sync::Arc::from(s)
            }
        };
        self.digests.push(digest);
        self.ids.push(id);
    }

    fn push_unique(&mut self, digest: [u8; 32], id: Option<&str>) -> Result<(), ApiKeysError> {
        self.push(digest, id);
        let new = self.ids.last().map(|i| i.to_string()).unwrap_or_default();
        if self.ids[..self.ids.len() - 1].iter().any(|i| **i == *new) {
            self.digests.pop();
            self.ids.pop();
            return Err(ApiKeysError::DuplicateId(new));
        }
        Ok(())
    }

    /// The key ids, in the order the keys were added.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.ids.iter().map(|i| &**i)
    }

    /// Loads keys from a file and/or an environment variable (at least one key in all).
    pub fn load(file: Option<&Path>, env: Option<&str>) -> Result<Self, ApiKeysError> {
        let mut keys = Self::default();
        if let Some(path) = file {
            keys.add_file(path)?;
        }
        if let Some(var) = env {
            let value = std::env::var(var).unwrap_or_default();
            let before = keys.len();
            for key in value.split(',').map(str::trim).filter(|k| !k.is_empty()) {
                keys.add(key);
            }
            if keys.len() == before {
                return Err(ApiKeysError::MissingEnv(var.to_owned()));
            }
        }
        if keys.is_empty() {
            return Err(ApiKeysError::Empty);
        }
        Ok(keys)
    }

    fn add_file(&mut self, path: &Path) -> Result<(), ApiKeysError> {
        let shown = path.display().to_string();
        let read = |source| ApiKeysError::Read {
            path: shown.clone(),
            source,
        };
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o777;
            if mode & 0o004 != 0 {
                return Err(ApiKeysError::WorldReadable {
                    path: shown.clone(),
                    mode,
                });
            }
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let entry = fields.next().unwrap_or_default();
            let id = fields.next();
            if fields.next().is_some() || id.is_some_and(|id| !valid_key_id(id)) {
                return Err(ApiKeysError::BadId {
                    path: shown.clone(),
                    line: i + 1,
                });
            }
            let digest = match entry.strip_prefix("sha256:") {
                Some(hex) => parse_hex(hex).ok_or_else(|| ApiKeysError::BadDigest {
                    path: shown.clone(),
                    line: i + 1,
                })?,
                None => sha256(entry.as_bytes()),
            };
            self.push_unique(digest, id)?;
        }
        Ok(())
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// Whether `key` is one of the keys (constant time in the key and over every digest).
    pub fn verify(&self, key: &str) -> bool {
        self.identify(key).is_some()
    }

    /// [`ApiKeys::identify`], the id shared rather than borrowed.
    pub(crate) fn identify_shared(&self, key: &str) -> Option<std::sync::Arc<str>> {
        self.ids.get(self.index_of(key)?).cloned()
    }

    /// The id of `key` if it is one of the keys (constant time in the key and over every
    /// digest: each is compared, and the match selected without a branch).
    pub fn identify(&self, key: &str) -> Option<&str> {
        self.ids.get(self.index_of(key)?).map(|i| &**i)
    }

    fn index_of(&self, key: &str) -> Option<usize> {
        use subtle::{ConditionallySelectable as _, ConstantTimeEq as _};
        let d = sha256(key.as_bytes());
        let mut found = subtle::Choice::from(0);
        let mut index = 0u64;
        for (i, k) in self.digests.iter().enumerate() {
            let hit = k[..].ct_eq(&d[..]);
            index.conditional_assign(&u64::try_from(i).unwrap_or(u64::MAX), hit);
            found |= hit;
        }
        if bool::from(found) {
            usize::try_from(index).ok()
        } else {
            None
        }
    }

    /// `sha256:<hex>` of a key, the line a key file may hold instead of the key.
    pub fn digest_line(key: &str) -> String {
        let d = sha256(key.as_bytes());
        let mut s = String::from("sha256:");
        for b in d {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(digest(&SHA256, bytes).as_ref());
    out
}

fn parse_hex(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The key a request presents: `Authorization: Bearer <key>` (scheme case-insensitive), else
/// `x-api-key`.
pub(crate) fn presented_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        && let Some((scheme, token)) = value.split_once(' ')
        && scheme.eq_ignore_ascii_case("bearer")
    {
        return Some(token.trim());
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn keys_and_digest_lines_verify_and_nothing_else() {
        let keys = ApiKeys::new(["sk-one", "sk-two"]);
        assert!(keys.verify("sk-one") && keys.verify("sk-two"));
        assert!(!keys.verify("sk-on") && !keys.verify("") && !keys.verify("sk-one "));
        let dir = std::env::temp_dir().join(format!("iop-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        let text = format!(
            "# gateway keys\n\nsk-file\n{}\n",
            ApiKeys::digest_line("sk-digest")
        );
        std::fs::write(&file, text).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
            let e = ApiKeys::load(Some(&file), None).unwrap_err().to_string();
            assert!(e.contains("readable by other users (mode 644)"), "{e}");
            assert!(e.contains("chmod 600"), "{e}");
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let keys = ApiKeys::load(Some(&file), None).unwrap();
        assert_eq!(keys.len(), 2);
        assert!(keys.verify("sk-file") && keys.verify("sk-digest"));
        assert!(!keys.verify("sha256:") && !keys.verify("# gateway keys"));
        std::fs::write(&file, "sha256:abc\n").unwrap();
        let e = ApiKeys::load(Some(&file), None).unwrap_err().to_string();
        assert!(
            e.ends_with(":1: a sha256: entry must be 64 hex digits"),
            "{e}"
        );
        let e = ApiKeys::load(None, Some("IOP_TEST_SURELY_UNSET_VAR"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "environment variable IOP_TEST_SURELY_UNSET_VAR is not set or empty"
        );
        assert!(matches!(
            ApiKeys::load(None, None),
            Err(ApiKeysError::Empty)
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn keys_are_read_from_bearer_any_case_or_x_api_key() {
        let mut h = HeaderMap::new();
        assert_eq!(presented_key(&h), None);
        h.insert("x-api-key", "sk-x".parse().unwrap());
        assert_eq!(presented_key(&h), Some("sk-x"));
        h.insert(header::AUTHORIZATION, "bearer sk-b".parse().unwrap());
        assert_eq!(presented_key(&h), Some("sk-b"));
        h.insert(header::AUTHORIZATION, "BEARER sk-c".parse().unwrap());
        assert_eq!(presented_key(&h), Some("sk-c"));
        h.insert(header::AUTHORIZATION, "Basic abc".parse().unwrap());
        assert_eq!(presented_key(&h), Some("sk-x"), "falls back to x-api-key");
    }
}
