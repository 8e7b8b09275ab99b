//! Credential plaintext, the header it is injected as, and the sealed plaintext format.
//!
//! The plaintext never has a `Debug` or `Display` form and is zeroized when dropped.
//! [`OpenedCredential::inject`] consumes the opened credential, so the plaintext is dropped
//! (and zeroized) right after the header is written.
//!
//! One copy escapes zeroization: the `http::HeaderValue` written into the request's header
//! map, which the HTTP client owns until the request is sent. It is marked sensitive, so HTTP/2
//! never adds it to the HPACK table and `Debug` shows `Sensitive`.
//!
//! Sealed plaintext format (inside the HPKE ciphertext):
//!
//! ```text
//! u8     format version (1)
//! u16be  len || header name (lowercase HTTP token)
//! u16be  len || value prefix (e.g. "Bearer ")
//! u32be  len || secret
//! ```

use http::header::{HeaderMap, HeaderName, HeaderValue};
use zeroize::Zeroizing;

/// Largest secret a lease carries, in bytes.
pub const MAX_SECRET_LEN: usize = 16 * 1024;
/// Largest header value prefix, in bytes.
pub const MAX_PREFIX_LEN: usize = 64;

const FORMAT_VERSION: u8 = 1;

/// Headers a lease may never write: framing, routing and hop-by-hop headers.
const FORBIDDEN_HEADERS: [&str; 11] = [
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "proxy-connection",
    "cookie",
];

/// Why a credential or its header declaration was refused. Never carries the secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CredentialError {
    /// The header name is not a valid HTTP header name.
    #[error("invalid header name")]
    InvalidHeaderName,
    /// The header is one a lease may not write (framing, routing, hop-by-hop).
    #[error("header may not be written by a lease")]
    ForbiddenHeader,
    /// The prefix is too long or has bytes a header value cannot hold.
    #[error("invalid header value prefix")]
    InvalidPrefix,
    /// The secret is empty, too long, or has bytes a header value cannot hold.
    #[error("invalid secret")]
    InvalidSecret,
    /// The decrypted plaintext is not in the sealed format.
    #[error("malformed credential plaintext")]
    Malformed,
}

/// Secret bytes. Zeroized on drop; no `Debug`, no `Display`, no `Clone`.
#[expect(
    missing_debug_implementations,
    reason = "plaintext credentials must never be printable"
)]
pub struct Secret(Zeroizing<Vec<u8>>);

impl Secret {
    /// Wraps `bytes` (taken by value so no copy is left behind).
    pub fn new(bytes: Vec<u8>) -> Self {
        Self(Zeroizing::new(bytes))
    }

    /// Wraps `bytes` after checking that an HTTP header can carry them: 1..=[`MAX_SECRET_LEN`]
    /// bytes of visible ASCII (the rule [`Credential::new`] applies).
    pub fn for_header(bytes: Vec<u8>) -> Result<Self, CredentialError> {
        let secret = Self::new(bytes);
        check_secret(secret.expose())?;
        Ok(secret)
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn expose(&self) -> &[u8] {
        &self.0
    }
}

/// The header a credential is injected as: `name: prefix + secret`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderSpec {
    name: HeaderName,
    prefix: String,
}

impl HeaderSpec {
    /// `Authorization: Bearer <secret>`.
    pub fn bearer() -> Self {
        Self {
            name: http::header::AUTHORIZATION,
            prefix: "Bearer ".to_owned(),
        }
    }

    /// `<name>: <prefix><secret>`, e.g. `("x-api-key", "")`.
    pub fn new(name: &str, prefix: &str) -> Result<Self, CredentialError> {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| CredentialError::InvalidHeaderName)?;
        if FORBIDDEN_HEADERS.contains(&name.as_str()) || name.as_str().starts_with("proxy-") {
            return Err(CredentialError::ForbiddenHeader);
        }
        if prefix.len() > MAX_PREFIX_LEN || !header_value_bytes(prefix.as_bytes()) {
            return Err(CredentialError::InvalidPrefix);
        }
        Ok(Self {
            name,
            prefix: prefix.to_owned(),
        })
    }

    /// The header name.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    /// The value prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Writes `name: prefix + secret` into `headers`, replacing any value a caller put there,
    /// marked sensitive, and touches nothing else. Every credential the Node sends upstream —
    /// an opened lease or the Node's own key — is written here; the value's copy is zeroized.
    pub fn inject(&self, secret: &Secret, headers: &mut HeaderMap) {
        let mut value = Zeroizing::new(Vec::with_capacity(self.prefix.len() + secret.len()));
        value.extend_from_slice(self.prefix.as_bytes());
        value.extend_from_slice(secret.expose());
        // The prefix was checked when the spec was built and the secret when it was wrapped
        // (visible ASCII, space/tab in the prefix), so the conversion cannot fail.
        if let Ok(mut v) = HeaderValue::from_bytes(&value) {
            v.set_sensitive(true);
            headers.insert(self.name.clone(), v);
        }
    }
}

/// Visible ASCII and space/tab only: no CR, LF, NUL or other control bytes.
fn header_value_bytes(b: &[u8]) -> bool {
    b.iter()
        .all(|&c| c == b' ' || c == b'\t' || c.is_ascii_graphic())
}

/// A credential to seal: the header declaration and the secret.
#[expect(missing_debug_implementations, reason = "holds a plaintext secret")]
pub struct Credential {
    pub(crate) header: HeaderSpec,
    pub(crate) secret: Secret,
}

impl Credential {
    /// A credential for `header`. The secret must be 1..=[`MAX_SECRET_LEN`] bytes of visible
    /// ASCII (what an HTTP header value can carry).
    pub fn new(header: HeaderSpec, secret: Secret) -> Result<Self, CredentialError> {
        check_secret(secret.expose())?;
        Ok(Self { header, secret })
    }

    /// The sealed plaintext encoding (zeroized on drop).
    pub(crate) fn encode(&self) -> Zeroizing<Vec<u8>> {
        let name = self.header.name.as_str().as_bytes();
        let prefix = self.header.prefix.as_bytes();
        let secret = self.secret.expose();
        let mut out = Zeroizing::new(Vec::with_capacity(
            1 + 2 + name.len() + 2 + prefix.len() + 4 + secret.len(),
        ));
        out.push(FORMAT_VERSION);
        // Lengths are bounded at construction (header names by `http`, prefix 64, secret 16 KiB).
        out.extend_from_slice(&u16::try_from(name.len()).unwrap_or(u16::MAX).to_be_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(
            &u16::try_from(prefix.len())
                .unwrap_or(u16::MAX)
                .to_be_bytes(),
        );
        out.extend_from_slice(prefix);
        out.extend_from_slice(
            &u32::try_from(secret.len())
                .unwrap_or(u32::MAX)
                .to_be_bytes(),
        );
        out.extend_from_slice(secret);
        out
    }

    /// Parses the sealed plaintext encoding.
    pub(crate) fn decode(mut bytes: &[u8]) -> Result<Self, CredentialError> {
        let mut take = |n: usize| -> Result<&[u8], CredentialError> {
            let (head, rest) = bytes
                .split_at_checked(n)
                .ok_or(CredentialError::Malformed)?;
            bytes = rest;
            Ok(head)
        };
        if take(1)? != [FORMAT_VERSION] {
            return Err(CredentialError::Malformed);
        }
        let name_len = u16::from_be_bytes([take(1)?[0], take(1)?[0]]);
        let name = std::str::from_utf8(take(usize::from(name_len))?)
            .map_err(|_| CredentialError::Malformed)?;
        let name = name.to_owned();
        let prefix_len = u16::from_be_bytes([take(1)?[0], take(1)?[0]]);
        let prefix = std::str::from_utf8(take(usize::from(prefix_len))?)
            .map_err(|_| CredentialError::Malformed)?
            .to_owned();
        let len_bytes = take(4)?;
        let secret_len =
            u32::from_be_bytes([len_bytes[0], len_bytes[1], len_bytes[2], len_bytes[3]]);
        let secret_len = usize::try_from(secret_len).map_err(|_| CredentialError::Malformed)?;
        if secret_len > MAX_SECRET_LEN {
            return Err(CredentialError::InvalidSecret);
        }
        let secret = Secret::new(take(secret_len)?.to_vec());
        if !bytes.is_empty() {
            return Err(CredentialError::Malformed);
        }
        let header = HeaderSpec::new(&name, &prefix)?;
        Self::new(header, secret)
    }
}

fn check_secret(secret: &[u8]) -> Result<(), CredentialError> {
    if secret.is_empty()
        || secret.len() > MAX_SECRET_LEN
        || !secret.iter().all(u8::is_ascii_graphic)
    {
        return Err(CredentialError::InvalidSecret);
    }
    Ok(())
}

/// A lease opened for one dispatch: the header to write and the secret. Consumed by
/// [`OpenedCredential::inject`].
pub struct OpenedCredential {
    pub(crate) credential: Credential,
    pub(crate) lease_id: [u8; 16],
}

impl std::fmt::Debug for OpenedCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedCredential")
            .field("header", &self.credential.header.name)
            .finish_non_exhaustive()
    }
}

impl OpenedCredential {
    /// The header this credential writes.
    pub fn header(&self) -> &HeaderSpec {
        &self.credential.header
    }

    /// The lease id (for correlation in logs; not secret).
    pub fn lease_id(&self) -> [u8; 16] {
        self.lease_id
    }

    /// Writes `name: prefix + secret` into `headers`, replacing any value a caller put there,
    /// and touches nothing else. Consumes `self`: the plaintext is zeroized on return.
    pub fn inject(self, headers: &mut HeaderMap) {
        self.credential
            .header
            .inject(&self.credential.secret, headers);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plaintext_round_trip_and_injection() {
        let c =
            Credential::new(HeaderSpec::bearer(), Secret::new(b"sk-test-123".to_vec())).unwrap();
        let bytes = c.encode();
        let back = Credential::decode(&bytes).unwrap();
        assert_eq!(back.header, HeaderSpec::bearer());
        let mut headers = HeaderMap::new();
        headers.insert(
            "authorization",
            HeaderValue::from_static("Bearer caller-supplied"),
        );
        headers.insert("x-other", HeaderValue::from_static("kept"));
        OpenedCredential {
            credential: back,
            lease_id: [0; 16],
        }
        .inject(&mut headers);
        assert_eq!(headers.len(), 2);
        assert_eq!(headers["authorization"], "Bearer sk-test-123");
        assert!(headers["authorization"].is_sensitive());
        assert_eq!(headers["x-other"], "kept");
        assert!(!format!("{headers:?}").contains("sk-test"));
    }

    #[test]
    fn api_key_header() {
        let spec = HeaderSpec::new("x-api-key", "").unwrap();
        let c = Credential::new(spec, Secret::new(b"abc".to_vec())).unwrap();
        let mut headers = HeaderMap::new();
        OpenedCredential {
            credential: c,
            lease_id: [0; 16],
        }
        .inject(&mut headers);
        assert_eq!(headers["x-api-key"], "abc");
    }

    #[test]
    fn refusals() {
        assert_eq!(
            HeaderSpec::new("bad header", "").unwrap_err(),
            CredentialError::InvalidHeaderName
        );
        assert_eq!(
            HeaderSpec::new("Host", "").unwrap_err(),
            CredentialError::ForbiddenHeader
        );
        assert_eq!(
            HeaderSpec::new("proxy-authorization", "").unwrap_err(),
            CredentialError::ForbiddenHeader
        );
        assert_eq!(
            HeaderSpec::new("x-a", "a\r\nb").unwrap_err(),
            CredentialError::InvalidPrefix
        );
        for bad in [
            &b""[..],
            b"has space",
            b"line\nbreak",
            &[b'a'; MAX_SECRET_LEN + 1][..],
        ] {
            assert!(Credential::new(HeaderSpec::bearer(), Secret::new(bad.to_vec())).is_err());
        }
        assert!(
            Credential::new(
                HeaderSpec::bearer(),
                Secret::new(vec![b'a'; MAX_SECRET_LEN])
            )
            .is_ok()
        );
    }

    #[test]
    fn malformed_plaintexts_are_rejected_not_panicking() {
        let good = Credential::new(HeaderSpec::bearer(), Secret::new(b"k".to_vec()))
            .unwrap()
            .encode();
        for cut in 0..good.len() {
            assert!(Credential::decode(&good[..cut]).is_err());
        }
        let mut trailing = good.to_vec();
        trailing.push(0);
        assert_eq!(
            Credential::decode(&trailing).err(),
            Some(CredentialError::Malformed)
        );
        let mut version = good.to_vec();
        version[0] = 2;
        assert_eq!(
            Credential::decode(&version).err(),
            Some(CredentialError::Malformed)
        );
    }
}
