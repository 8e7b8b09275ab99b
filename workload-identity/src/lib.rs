//! SPIFFE workload identities and the rustls configurations built on them, for every TLS
//! endpoint of the mesh: the Edge ↔ Node runtime wire, the Edge ↔ Control Plane wire and their
//! admin listeners.
//!
//! | module / feature | owns |
//! |---|---|
//! | crate root | [`WorkloadId`] (the SPIFFE ID in a certificate's one URI SAN), [`ExpectedPeer`], rustls verifiers that check role and name inside the handshake, [`peer_identity`] |
//! | [`WorkloadTls`] | a workload's replaceable material (CA bundle, chain, key) and the server/client configs that read it at every handshake |
//! | [`HostTls`] | the same for a server whose own certificate names a host, not a workload (the proxy-pool controller: clients verified by chain only, their identity read by the application) |
//! | [`SpiffeId`] | a SPIFFE ID of any path length (the proxy-pool's `spiffe://TD/ENV/worker/ID`) |
//! | `reload` (feature `reload`, tokio) | a task that re-reads the three files and hands changes to [`WorkloadTls::reload_pem`] or [`HostTls::reload_pem`] |
//! | `ca` (feature `ca`, rcgen) | a small file-backed workload CA (`iop-ca`) |
//! | `dev_ca` (feature `dev-ca`) | an in-memory development CA that hands out Edge, Node and Control Plane material with no file on disk |
//!
//! It was `iop_wire::identity`: the wire crate stays free of TLS, and the Edge, the Node, the
//! Control Plane and the tests share this one parser and one set of verifiers.
//!
//! # Scheme
//!
//! Every workload holds an X.509 leaf certificate signed by the deployment's workload CA. The
//! leaf carries exactly one URI subject-alternative-name, a [SPIFFE ID] of the form
//!
//! ```text
//! spiffe://<trust-domain>/<role>/<name>
//! ```
//!
//! for example `spiffe://iop.test/node/node-1`. The role is one of the constants in [`role`]
//! (`node`, `edge`, `control-plane`); the name is the workload's stable id. [`WorkloadId`] is the
//! parsed form, and it only exists if the URI follows the SPIFFE ID syntax and has exactly those
//! two path segments.
//!
//! # Who checks what
//!
//! Both sides of a link authenticate each other (mutual TLS, TLS 1.3 only, ring provider, no
//! session resumption: every connection is a full handshake against the current material):
//!
//! - The **Edge** is the TLS server. Its [`client_cert_verifier`] requires a client certificate,
//!   verifies the chain against the workload CA, then checks the leaf's SPIFFE ID against an
//!   [`ExpectedPeer`] — normally "role `node`, any name" ([`ExpectedPeer::any_name`]). The
//!   accepted name then *is* the Node id: after the handshake the driver reads it with
//!   [`peer_identity`], and registration must claim that same id.
//! - The **Node** is the TLS client. Its [`server_cert_verifier`] verifies the chain, the
//!   ordinary server name (DNS/IP SAN against the name it dialled), and then the SPIFFE ID
//!   against an exact expected Edge ([`ExpectedPeer::exact`]).
//!
//! A peer with no certificate, a certificate from another CA, the wrong role, the wrong name or
//! a malformed/ambiguous SPIFFE ID therefore fails *inside the TLS handshake*, on the side that
//! checks it, before any application byte is exchanged: the Edge's `accept` fails for a bad
//! Node, so no registration bytes are ever read from it and no credential lease can be
//! delivered to it; the Node's `connect` fails for a bad Edge, so it never sends registration.
//!
//! One TLS 1.3 subtlety for drivers: the client finishes its side of the handshake before the
//! server has judged the client certificate, so a rejected Node's `connect` can return `Ok`;
//! its first read then fails with the server's alert. A Node must not treat a completed
//! `connect` as "accepted" — only the Edge's registration response says that.
//!
//! # How failures surface
//!
//! Chain failures are whatever [`rustls::client::WebPkiServerVerifier`] and
//! [`rustls::server::WebPkiClientVerifier`] report (for example
//! [`CertificateError::UnknownIssuer`] for a foreign CA, or
//! [`rustls::Error::NoCertificatesPresented`] for a client without a certificate). Identity
//! failures, detected after the chain verified, are reported as
//!
//! ```text
//! rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc<IdentityError>)))
//! ```
//!
//! so the detecting side keeps the precise reason; recover it with
//! [`IdentityError::from_rustls_error`]. On the wire this becomes a `certificate_unknown` alert,
//! so the rejected peer learns nothing about which identity was expected.
//!
//! Without features this crate is pure: it never touches a socket or a clock (rustls passes
//! `now` into the verifiers) and never installs a process-wide crypto provider.
//!
//! [SPIFFE ID]: https://github.com/spiffe/spiffe/blob/main/standards/SPIFFE-ID.md

#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "ca")]
pub mod ca;
#[cfg(feature = "dev-ca")]
pub mod dev_ca;
mod material;
#[cfg(feature = "reload")]
pub mod reload;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, ClientConfig, CommonState, DigitallySignedStruct, DistinguishedName,
    OtherError, RootCertStore, ServerConfig, SignatureScheme,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use x509_parser::extensions::GeneralName;

/// The URI scheme and authority separator every SPIFFE ID starts with.
pub const SPIFFE_SCHEME_PREFIX: &str = "spiffe://";

/// Longest accepted SPIFFE ID in bytes, scheme included (SPIFFE-ID spec §2.3).
pub const MAX_SPIFFE_ID_LEN: usize = 2048;

/// Longest accepted trust domain in bytes (the RFC 3986 host limit, SPIFFE-ID spec §2.3).
pub const MAX_TRUST_DOMAIN_LEN: usize = 255;

/// The workload roles used in this project, as they appear in the SPIFFE ID path.
pub mod role {
    /// A Node: runs providers, dials the Edge as a TLS client.
    pub const NODE: &str = "node";
    /// An Edge: accepts Node connections as a TLS server.
    pub const EDGE: &str = "edge";
    /// The control plane.
    pub const CONTROL_PLANE: &str = "control-plane";
}

// === impl IdentityError ===

/// Why a workload identity was rejected or a TLS configuration could not be built.
///
/// The text of every variant is safe to log and to return to an operator: it contains trust
/// domains, roles and names (which are not secrets and, when they come from a certificate, have
/// already passed the SPIFFE syntax check and its length limits), never certificate bytes, key
/// material or raw unvalidated input. The two variants wrapping a rustls error put its text in
/// the message rather than in `source()`, so a one-line log keeps the cause without an error
/// chain printing it twice.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// The SPIFFE ID is longer than [`MAX_SPIFFE_ID_LEN`] bytes.
    #[error("SPIFFE ID is {len} bytes long, the limit is {MAX_SPIFFE_ID_LEN}")]
    IdTooLong {
        /// Length of the rejected ID in bytes.
        len: usize,
    },
    /// The ID does not start with exactly `spiffe://`.
    #[error("SPIFFE ID does not start with `spiffe://`")]
    WrongScheme,
    /// The trust domain (URI host) is empty.
    #[error("SPIFFE ID has an empty trust domain")]
    EmptyTrustDomain,
    /// The trust domain is longer than [`MAX_TRUST_DOMAIN_LEN`] bytes.
    #[error("SPIFFE trust domain is {len} bytes long, the limit is {MAX_TRUST_DOMAIN_LEN}")]
    TrustDomainTooLong {
        /// Length of the rejected trust domain in bytes.
        len: usize,
    },
    /// The trust domain has a byte outside `a-z 0-9 . - _`. This is also how a port (`:`),
    /// userinfo (`@`) or upper-case host is rejected.
    #[error("SPIFFE trust domain has an invalid character at byte {at}")]
    InvalidTrustDomainChar {
        /// Byte offset of the offending character in the whole SPIFFE ID.
        at: usize,
    },
    /// A path segment has a byte outside `a-z A-Z 0-9 . - _`. This is also how a query (`?`),
    /// fragment (`#`) or percent-encoding (`%`) is rejected.
    #[error("SPIFFE ID path has an invalid character at byte {at}")]
    InvalidPathChar {
        /// Byte offset of the offending character in the whole SPIFFE ID.
        at: usize,
    },
    /// A path segment is empty: `//` inside the path, or a trailing `/`.
    #[error("SPIFFE ID path has an empty segment")]
    EmptyPathSegment,
    /// A path segment is `.` or `..`.
    #[error("SPIFFE ID path has a `.` or `..` segment")]
    DotPathSegment,
    /// The path does not have exactly two segments (`/<role>/<name>`).
    #[error("SPIFFE ID path has {found} segments, expected 2 (`/<role>/<name>`)")]
    WrongSegmentCount {
        /// Number of path segments found.
        found: usize,
    },
    /// The certificate is not a well-formed X.509 certificate, or its subject-alternative-name
    /// extension is malformed or duplicated.
    #[error("certificate could not be parsed")]
    BadCertificate,
    /// The certificate has no URI subject alternative name.
    #[error("certificate has no URI subject alternative name")]
    NoUriSan,
    /// The certificate has more than one URI subject alternative name, so its identity is
    /// ambiguous (the X509-SVID spec requires exactly one).
    #[error("certificate has {count} URI subject alternative names, expected exactly 1")]
    MultipleUriSans {
        /// Number of URI SANs found.
        count: usize,
    },
    /// The connection has no peer certificate (the handshake has not completed, or the peer
    /// was not asked for one).
    #[error("peer presented no certificate")]
    NoCertificate,
    /// The peer's trust domain is not the expected one.
    #[error("peer trust domain is `{found}`, expected `{expected}`")]
    WrongTrustDomain {
        /// The trust domain that was required.
        expected: String,
        /// The trust domain the peer presented.
        found: String,
    },
    /// The peer's role is not the expected one.
    #[error("peer role is `{found}`, expected `{expected}`")]
    WrongRole {
        /// The role that was required.
        expected: String,
        /// The role the peer presented.
        found: String,
    },
    /// The peer's name is not the expected one.
    #[error("peer name is `{found}`, expected `{expected}`")]
    WrongName {
        /// The name that was required.
        expected: String,
        /// The name the peer presented.
        found: String,
    },
    /// The rustls WebPKI verifier could not be built (for example: no trust anchors).
    #[error("could not build the certificate verifier: {0}")]
    Verifier(rustls::client::VerifierBuilderError),
    /// rustls rejected the TLS configuration (for example: the key does not match the
    /// certificate, or the provider does not support TLS 1.3).
    #[error("invalid TLS configuration: {0}")]
    Config(rustls::Error),
}

impl IdentityError {
    /// Finds the identity error inside a rustls error produced by one of this module's
    /// verifiers, if it is one.
    ///
    /// Returns `None` for every other rustls error, including chain failures such as
    /// [`CertificateError::UnknownIssuer`] or [`rustls::Error::NoCertificatesPresented`].
    pub fn from_rustls_error(err: &rustls::Error) -> Option<&Self> {
        match err {
            rustls::Error::InvalidCertificate(CertificateError::Other(other)) => {
                other.0.downcast_ref::<Self>()
            }
            _ => None,
        }
    }

    /// The rustls error a verifier returns for an identity failure: see the module docs.
    fn into_rustls(self) -> rustls::Error {
        rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(self))))
    }
}

// === impl WorkloadId ===

/// A SPIFFE ID with any number of path segments (`spiffe://<trust-domain>/<seg>/...`),
/// checked against the SPIFFE ID syntax. [`WorkloadId`] is the two-segment form the mesh uses;
/// another system reads its own shape from [`SpiffeId::segments`] (the proxy-pool controller's
/// workers are `spiffe://<trust-domain>/<environment>/worker/<id>`), so every listener parses
/// identities with this one parser.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SpiffeId {
    uri: String,
    /// End of the trust domain in `uri`; the path (if any) starts there.
    trust_domain_end: usize,
}

impl SpiffeId {
    /// Parses a SPIFFE ID: scheme exactly `spiffe`; non-empty trust domain of `a-z 0-9 . - _`
    /// at most [`MAX_TRUST_DOMAIN_LEN`] bytes (so no port or userinfo); path segments of
    /// `a-z A-Z 0-9 . - _`, none empty or `.`/`..` (so no trailing slash, query or fragment);
    /// at most [`MAX_SPIFFE_ID_LEN`] bytes in all. The path may be empty.
    pub fn parse(uri: &str) -> Result<Self, IdentityError> {
        if uri.len() > MAX_SPIFFE_ID_LEN {
            return Err(IdentityError::IdTooLong { len: uri.len() });
        }
        let Some(rest) = uri.strip_prefix(SPIFFE_SCHEME_PREFIX) else {
            return Err(IdentityError::WrongScheme);
        };
        let (trust_domain, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        check_trust_domain(trust_domain)?;
        let trust_domain_end = SPIFFE_SCHEME_PREFIX.len() + trust_domain.len();
        // `path` is empty or starts with '/'.
        if let Some(path) = path.strip_prefix('/') {
            let mut offset = trust_domain_end + 1;
            for segment in path.split('/') {
                check_segment(segment, offset)?;
                offset += segment.len() + 1;
            }
        }
        Ok(Self {
            uri: uri.to_owned(),
            trust_domain_end,
        })
    }

    /// Reads the SPIFFE ID of a certificate's single URI subject alternative name (not a
    /// verification: for certificates a verifier has already accepted).
    pub fn from_certificate(cert: &CertificateDer<'_>) -> Result<Self, IdentityError> {
        Self::parse(&single_uri_san(cert)?)
    }

    /// The trust domain.
    pub fn trust_domain(&self) -> &str {
        &self.uri[SPIFFE_SCHEME_PREFIX.len()..self.trust_domain_end]
    }

    /// The path segments, in order (none for an ID without a path).
    pub fn segments(&self) -> impl Iterator<Item = &str> {
        self.uri[self.trust_domain_end..]
            .strip_prefix('/')
            .into_iter()
            .flat_map(|p| p.split('/'))
    }

    /// The whole URI.
    pub fn as_str(&self) -> &str {
        &self.uri
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri)
    }
}

/// A certificate's single URI subject alternative name.
fn single_uri_san(cert: &CertificateDer<'_>) -> Result<String, IdentityError> {
    let (rest, x509) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|_| IdentityError::BadCertificate)?;
    if !rest.is_empty() {
        return Err(IdentityError::BadCertificate);
    }
    // `Err` here also covers a duplicated SAN extension, which would otherwise let a
    // certificate carry two identities.
    let san = x509
        .subject_alternative_name()
        .map_err(|_| IdentityError::BadCertificate)?;
    let mut uris = san
        .iter()
        .flat_map(|ext| ext.value.general_names.iter())
        .filter_map(|name| match name {
            GeneralName::URI(uri) => Some(*uri),
            _ => None,
        });
    let Some(uri) = uris.next() else {
        return Err(IdentityError::NoUriSan);
    };
    let others = uris.count();
    if others > 0 {
        return Err(IdentityError::MultipleUriSans { count: others + 1 });
    }
    Ok(uri.to_owned())
}

/// A validated workload identity: a SPIFFE ID `spiffe://<trust-domain>/<role>/<name>`.
///
/// `Display` and [`WorkloadId::as_str`] give the URI.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkloadId {
    /// The whole URI; the accessors slice into it.
    uri: String,
    /// End of the trust domain in `uri`; the role starts one byte later.
    trust_domain_end: usize,
    /// End of the role in `uri`; the name starts one byte later and runs to the end.
    role_end: usize,
}

impl WorkloadId {
    /// Parses a SPIFFE ID of exactly the form `spiffe://<trust-domain>/<role>/<name>`.
    ///
    /// Follows the SPIFFE ID syntax ([`SpiffeId::parse`]); on top of the spec, the path must
    /// have exactly two segments.
    pub fn parse(uri: &str) -> Result<Self, IdentityError> {
        let id = SpiffeId::parse(uri)?;
        let found = id.segments().count();
        if found != 2 {
            return Err(IdentityError::WrongSegmentCount { found });
        }
        let trust_domain_end = id.trust_domain_end;
        let role_end = trust_domain_end + 1 + id.segments().next().map_or(0, str::len);
        Ok(Self {
            uri: id.uri,
            trust_domain_end,
            role_end,
        })
    }

    /// Builds `spiffe://<trust_domain>/<role>/<name>`, validating each part as
    /// [`WorkloadId::parse`] would. Error offsets refer to the assembled URI.
    pub fn new(trust_domain: &str, role: &str, name: &str) -> Result<Self, IdentityError> {
        let len = SPIFFE_SCHEME_PREFIX.len() + trust_domain.len() + role.len() + name.len() + 2;
        if len > MAX_SPIFFE_ID_LEN {
            return Err(IdentityError::IdTooLong { len });
        }
        check_trust_domain(trust_domain)?;
        let trust_domain_end = SPIFFE_SCHEME_PREFIX.len() + trust_domain.len();
        check_segment(role, trust_domain_end + 1)?;
        let role_end = trust_domain_end + 1 + role.len();
        check_segment(name, role_end + 1)?;
        Ok(Self {
            uri: format!("{SPIFFE_SCHEME_PREFIX}{trust_domain}/{role}/{name}"),
            trust_domain_end,
            role_end,
        })
    }

    /// Reads the identity from a certificate's single URI subject alternative name.
    ///
    /// This does **not** verify the certificate; it is for certificates a verifier has
    /// already accepted, or for checking one's own certificate at start-up.
    pub fn from_certificate(cert: &CertificateDer<'_>) -> Result<Self, IdentityError> {
        Self::parse(&single_uri_san(cert)?)
    }

    /// The trust domain, e.g. `iop.test`.
    pub fn trust_domain(&self) -> &str {
        &self.uri[SPIFFE_SCHEME_PREFIX.len()..self.trust_domain_end]
    }

    /// The role, e.g. [`role::NODE`].
    pub fn role(&self) -> &str {
        &self.uri[self.trust_domain_end + 1..self.role_end]
    }

    /// The workload name, e.g. `node-1`.
    pub fn name(&self) -> &str {
        &self.uri[self.role_end + 1..]
    }

    /// The whole SPIFFE ID URI.
    pub fn as_str(&self) -> &str {
        &self.uri
    }
}

impl fmt::Display for WorkloadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri)
    }
}

impl FromStr for WorkloadId {
    type Err = IdentityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// Checks a trust domain: non-empty, bounded, `a-z 0-9 . - _` only.
fn check_trust_domain(trust_domain: &str) -> Result<(), IdentityError> {
    if trust_domain.is_empty() {
        return Err(IdentityError::EmptyTrustDomain);
    }
    if trust_domain.len() > MAX_TRUST_DOMAIN_LEN {
        return Err(IdentityError::TrustDomainTooLong {
            len: trust_domain.len(),
        });
    }
    let valid = |b: u8| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'-' | b'_');
    match trust_domain.bytes().position(|b| !valid(b)) {
        Some(i) => Err(IdentityError::InvalidTrustDomainChar {
            at: SPIFFE_SCHEME_PREFIX.len() + i,
        }),
        None => Ok(()),
    }
}

/// Checks one path segment starting at byte `offset` of the URI.
fn check_segment(segment: &str, offset: usize) -> Result<(), IdentityError> {
    if segment.is_empty() {
        return Err(IdentityError::EmptyPathSegment);
    }
    let valid = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_');
    if let Some(i) = segment.bytes().position(|b| !valid(b)) {
        return Err(IdentityError::InvalidPathChar { at: offset + i });
    }
    if segment == "." || segment == ".." {
        return Err(IdentityError::DotPathSegment);
    }
    Ok(())
}

// === impl ExpectedPeer ===

/// The identity a peer must present: a trust domain, a role and optionally a name.
///
/// With no name ([`ExpectedPeer::any_name`]) any workload of that role is accepted; this is
/// how the Edge accepts Nodes, whose authenticated name then becomes the Node id that
/// registration must match.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ExpectedPeer {
    trust_domain: String,
    role: String,
    name: Option<String>,
}

impl ExpectedPeer {
    /// Accept any workload with `role` in `trust_domain`.
    ///
    /// Fails if either part could never appear in a valid [`WorkloadId`], so a typo in
    /// configuration is reported at start-up rather than as a rejected peer.
    pub fn any_name(trust_domain: &str, role: &str) -> Result<Self, IdentityError> {
        check_trust_domain(trust_domain)?;
        check_segment(role, SPIFFE_SCHEME_PREFIX.len() + trust_domain.len() + 1)?;
        Ok(Self {
            trust_domain: trust_domain.to_owned(),
            role: role.to_owned(),
            name: None,
        })
    }

    /// Accept only the workload `spiffe://<trust_domain>/<role>/<name>`.
    pub fn exact(trust_domain: &str, role: &str, name: &str) -> Result<Self, IdentityError> {
        Ok(WorkloadId::new(trust_domain, role, name)?.into())
    }

    /// The required trust domain.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The required role.
    pub fn role(&self) -> &str {
        &self.role
    }

    /// The required name, or `None` if any name is accepted.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Checks `id` against this expectation: trust domain, then role, then name.
    pub fn check(&self, id: &WorkloadId) -> Result<(), IdentityError> {
        if id.trust_domain() != self.trust_domain {
            return Err(IdentityError::WrongTrustDomain {
                expected: self.trust_domain.clone(),
                found: id.trust_domain().to_owned(),
            });
        }
        if id.role() != self.role {
            return Err(IdentityError::WrongRole {
                expected: self.role.clone(),
                found: id.role().to_owned(),
            });
        }
        match &self.name {
            Some(name) if id.name() != name => Err(IdentityError::WrongName {
                expected: name.clone(),
                found: id.name().to_owned(),
            }),
            _ => Ok(()),
        }
    }
}

impl From<WorkloadId> for ExpectedPeer {
    /// Expect exactly this workload.
    fn from(id: WorkloadId) -> Self {
        Self {
            trust_domain: id.trust_domain().to_owned(),
            role: id.role().to_owned(),
            name: Some(id.name().to_owned()),
        }
    }
}

impl fmt::Display for ExpectedPeer {
    /// The expected SPIFFE ID, with `*` for "any name".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name.as_deref().unwrap_or("*");
        write!(
            f,
            "{SPIFFE_SCHEME_PREFIX}{}/{}/{name}",
            self.trust_domain, self.role
        )
    }
}

pub use crate::material::{HostTls, MaterialError, WorkloadTls};

// === impl verifiers ===

/// The only crypto provider this crate uses; passed explicitly so nothing depends on a
/// process-wide default being installed.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads the end-entity identity and checks it against `expected`, in rustls' error type.
fn check_end_entity(
    end_entity: &CertificateDer<'_>,
    expected: &ExpectedPeer,
) -> Result<(), rustls::Error> {
    WorkloadId::from_certificate(end_entity)
        .and_then(|id| expected.check(&id))
        .map_err(IdentityError::into_rustls)
}

/// Builds the server-side (Edge) verifier of client certificates.
///
/// A client certificate is mandatory. The chain is verified with rustls' WebPKI verifier
/// (ring provider, `roots` as trust anchors); only then is the leaf's SPIFFE ID read and
/// checked against `expected`, so an unauthenticated certificate is never parsed for its
/// identity. Identity failures are reported as described in the module docs.
pub fn client_cert_verifier(
    roots: Arc<RootCertStore>,
    expected: ExpectedPeer,
) -> Result<Arc<dyn ClientCertVerifier>, IdentityError> {
    let inner = WebPkiClientVerifier::builder_with_provider(roots, provider())
        .build()
        .map_err(IdentityError::Verifier)?;
    Ok(Arc::new(SpiffeClientVerifier { inner, expected }))
}

/// Builds the client-side (Node) verifier of server certificates.
///
/// The chain *and* the ordinary server name (DNS/IP SAN against the name the client dialled)
/// are verified by rustls' WebPKI verifier (ring provider); then the leaf's SPIFFE ID is
/// checked against `expected`. Identity failures are reported as described in the module docs.
pub fn server_cert_verifier(
    roots: Arc<RootCertStore>,
    expected: ExpectedPeer,
) -> Result<Arc<dyn ServerCertVerifier>, IdentityError> {
    let inner = WebPkiServerVerifier::builder_with_provider(roots, provider())
        .build()
        .map_err(IdentityError::Verifier)?;
    Ok(Arc::new(SpiffeServerVerifier { inner, expected }))
}

/// WebPKI client verification followed by a SPIFFE identity check.
#[derive(Debug)]
struct SpiffeClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    expected: ExpectedPeer,
}

impl ClientCertVerifier for SpiffeClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        check_end_entity(end_entity, &self.expected)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// WebPKI server verification (chain and server name) followed by a SPIFFE identity check.
#[derive(Debug)]
struct SpiffeServerVerifier {
    inner: Arc<WebPkiServerVerifier>,
    expected: ExpectedPeer,
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        check_end_entity(end_entity, &self.expected)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

// === impl connection helpers ===

/// The authenticated identity of the peer of a connection whose handshake has completed.
///
/// Only meaningful when the connection was configured with [`client_cert_verifier`] or
/// [`server_cert_verifier`]: those have already verified the chain and checked the identity,
/// and this re-reads it from the end-entity certificate. Pass a `ServerConnection` or
/// `ClientConnection` (they deref to [`CommonState`]).
pub fn peer_identity(conn: &CommonState) -> Result<WorkloadId, IdentityError> {
    let end_entity = conn
        .peer_certificates()
        .and_then(<[_]>::first)
        .ok_or(IdentityError::NoCertificate)?;
    WorkloadId::from_certificate(end_entity)
}

/// A TLS 1.3-only server configuration (ring provider) that authenticates clients with
/// `client_verifier` and presents `cert_chain` (leaf first) with `key`.
///
/// Also reads the leaf's own SPIFFE ID, so a mis-issued local certificate fails at start-up
/// rather than at every peer.
pub fn server_config(
    cert_chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    client_verifier: Arc<dyn ClientCertVerifier>,
) -> Result<ServerConfig, IdentityError> {
    check_own_chain(&cert_chain)?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(IdentityError::Config)?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(cert_chain, key)
        .map_err(IdentityError::Config)?;
    // No resumption (as in `workload_tls`): a resumed session carries the identity its first
    // handshake verified. It also spares every connection two tickets nobody could use after
    // an Edge restart.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(config)
}

/// A TLS 1.3-only client configuration (ring provider) that authenticates the server with
/// `server_verifier` and presents `cert_chain` (leaf first) with `key`.
///
/// Also reads the leaf's own SPIFFE ID, so a mis-issued local certificate fails at start-up
/// rather than at every peer.
pub fn client_config(
    cert_chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    server_verifier: Arc<dyn ServerCertVerifier>,
) -> Result<ClientConfig, IdentityError> {
    check_own_chain(&cert_chain)?;
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(IdentityError::Config)?
        .dangerous()
        .with_custom_certificate_verifier(server_verifier)
        .with_client_auth_cert(cert_chain, key)
        .map_err(IdentityError::Config)?;
    // As for the server: every connection a full handshake with the current material.
    config.resumption = rustls::client::Resumption::disabled();
    Ok(config)
}

/// Our own leaf must carry a valid workload identity.
fn check_own_chain(cert_chain: &[CertificateDer<'static>]) -> Result<(), IdentityError> {
    let leaf = cert_chain.first().ok_or(IdentityError::NoCertificate)?;
    WorkloadId::from_certificate(leaf).map(drop)
}

#[cfg(test)]
mod tests {
    use rcgen::{CertificateParams, KeyPair, SanType};

    use super::*;

    #[test]
    fn a_spiffe_id_of_any_length_keeps_its_segments() {
        let id = SpiffeId::parse("spiffe://proxypool.test/staging/worker/w-1").unwrap();
        assert_eq!(id.trust_domain(), "proxypool.test");
        assert_eq!(
            id.segments().collect::<Vec<_>>(),
            ["staging", "worker", "w-1"]
        );
        let bare = SpiffeId::parse("spiffe://iop.test").unwrap();
        assert_eq!(bare.segments().count(), 0);
        assert!(matches!(
            SpiffeId::parse("spiffe://iop.test/a//b"),
            Err(IdentityError::EmptyPathSegment)
        ));
        // The two-segment form is the same parser with a count.
        assert!(matches!(
            WorkloadId::parse("spiffe://iop.test/staging/worker/w-1"),
            Err(IdentityError::WrongSegmentCount { found: 3 })
        ));
    }

    const TD: &str = "iop.test";

    fn id(s: &str) -> Result<WorkloadId, IdentityError> {
        WorkloadId::parse(s)
    }

    /// A self-signed certificate with the given URI SANs plus one DNS SAN (which must be
    /// ignored when counting URI SANs).
    fn cert_with_uris(uris: &[&str]) -> CertificateDer<'static> {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        for uri in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*uri).try_into().unwrap()));
        }
        let key = KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().clone()
    }

    #[test]
    fn parse_accepts_valid_ids() {
        let ok = [
            "spiffe://iop.test/node/node-1",
            "spiffe://iop.test/edge/edge-1",
            "spiffe://iop.test/control-plane/cp",
            "spiffe://a/b/c",
            "spiffe://my_td-1.example/Role.x/Name_With-ALL.chars09",
            "spiffe://iop.test/node/...",
            "spiffe://iop.test/node/.hidden",
        ];
        for s in ok {
            let parsed = id(s).unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(parsed.as_str(), s);
            assert_eq!(parsed.to_string(), s);
        }
        let parsed = id("spiffe://iop.test/node/node-1").unwrap();
        assert_eq!(parsed.trust_domain(), "iop.test");
        assert_eq!(parsed.role(), role::NODE);
        assert_eq!(parsed.name(), "node-1");
        assert_eq!(
            "spiffe://iop.test/node/node-1"
                .parse::<WorkloadId>()
                .unwrap(),
            parsed
        );
    }

    #[test]
    fn parse_rejects_each_rule() {
        use IdentityError as E;
        let table = [
            // Scheme.
            ("", E::WrongScheme),
            ("https://iop.test/node/n", E::WrongScheme),
            ("SPIFFE://iop.test/node/n", E::WrongScheme),
            ("spiffe:/iop.test/node/n", E::WrongScheme),
            ("spiffe:iop.test/node/n", E::WrongScheme),
            (" spiffe://iop.test/node/n", E::WrongScheme),
            // Trust domain: non-empty, lowercase charset, no port / userinfo / query.
            ("spiffe:///node/n", E::EmptyTrustDomain),
            ("spiffe://", E::EmptyTrustDomain),
            (
                "spiffe://IOP.test/node/n",
                E::InvalidTrustDomainChar { at: 9 },
            ),
            (
                "spiffe://iop.test:8443/node/n",
                E::InvalidTrustDomainChar { at: 17 },
            ),
            (
                "spiffe://user@iop.test/node/n",
                E::InvalidTrustDomainChar { at: 13 },
            ),
            (
                "spiffe://iop.test?x/node/n",
                E::InvalidTrustDomainChar { at: 17 },
            ),
            (
                "spiffe://i\u{f6}p.test/node/n",
                E::InvalidTrustDomainChar { at: 10 },
            ),
            // Path shape: exactly two non-empty, non-dot segments, no trailing slash.
            ("spiffe://iop.test", E::WrongSegmentCount { found: 0 }),
            ("spiffe://iop.test/", E::EmptyPathSegment),
            ("spiffe://iop.test/node", E::WrongSegmentCount { found: 1 }),
            (
                "spiffe://iop.test/node/n/x",
                E::WrongSegmentCount { found: 3 },
            ),
            ("spiffe://iop.test/node/n/", E::EmptyPathSegment),
            ("spiffe://iop.test//n", E::EmptyPathSegment),
            ("spiffe://iop.test/node//n", E::EmptyPathSegment),
            ("spiffe://iop.test/./n", E::DotPathSegment),
            ("spiffe://iop.test/node/..", E::DotPathSegment),
            // Path charset: no query, fragment, percent-encoding, space, port-like or non-ASCII.
            (
                "spiffe://iop.test/node/n?x=1",
                E::InvalidPathChar { at: 24 },
            ),
            (
                "spiffe://iop.test/node/n#frag",
                E::InvalidPathChar { at: 24 },
            ),
            ("spiffe://iop.test/node/n%41", E::InvalidPathChar { at: 24 }),
            ("spiffe://iop.test/no de/n", E::InvalidPathChar { at: 20 }),
            ("spiffe://iop.test/node/n:1", E::InvalidPathChar { at: 24 }),
            (
                "spiffe://iop.test/node/n\u{f6}",
                E::InvalidPathChar { at: 24 },
            ),
        ];
        for (input, expected) in table {
            match id(input) {
                Ok(parsed) => panic!("{input:?} was accepted as {parsed}"),
                // The enum is not `PartialEq` (it can carry rustls errors); Debug is exact here.
                Err(e) => assert_eq!(format!("{e:?}"), format!("{expected:?}"), "{input:?}"),
            }
        }
    }

    #[test]
    fn length_limits() {
        let prefix = "spiffe://iop.test/node/";
        let at_limit = format!("{prefix}{}", "n".repeat(MAX_SPIFFE_ID_LEN - prefix.len()));
        assert_eq!(at_limit.len(), 2048);
        assert_eq!(id(&at_limit).unwrap().name().len(), 2048 - prefix.len());
        let over = format!("{at_limit}n");
        assert!(matches!(
            id(&over),
            Err(IdentityError::IdTooLong { len: 2049 })
        ));

        let td_ok = "t".repeat(MAX_TRUST_DOMAIN_LEN);
        assert!(id(&format!("spiffe://{td_ok}/node/n")).is_ok());
        let td_over = "t".repeat(MAX_TRUST_DOMAIN_LEN + 1);
        assert!(matches!(
            id(&format!("spiffe://{td_over}/node/n")),
            Err(IdentityError::TrustDomainTooLong { len: 256 })
        ));

        // `new` applies the same limits to the assembled URI.
        let name = "n".repeat(MAX_SPIFFE_ID_LEN - prefix.len());
        assert_eq!(
            WorkloadId::new(TD, role::NODE, &name).unwrap().as_str(),
            at_limit
        );
        let name = format!("{name}n");
        assert!(matches!(
            WorkloadId::new(TD, role::NODE, &name),
            Err(IdentityError::IdTooLong { len: 2049 })
        ));
    }

    #[test]
    fn new_validates_parts() {
        let built = WorkloadId::new(TD, role::EDGE, "edge-1").unwrap();
        assert_eq!(built, id("spiffe://iop.test/edge/edge-1").unwrap());
        assert_eq!(built.role(), role::EDGE);

        assert!(matches!(
            WorkloadId::new("", role::NODE, "n"),
            Err(IdentityError::EmptyTrustDomain)
        ));
        // A '/' inside a part must not smuggle in an extra segment.
        assert!(matches!(
            WorkloadId::new(TD, "node/x", "n"),
            Err(IdentityError::InvalidPathChar { at: 22 })
        ));
        assert!(matches!(
            WorkloadId::new(TD, role::NODE, ".."),
            Err(IdentityError::DotPathSegment)
        ));
        assert!(matches!(
            WorkloadId::new(TD, role::NODE, ""),
            Err(IdentityError::EmptyPathSegment)
        ));
    }

    #[test]
    fn certificate_uri_san_count() {
        assert!(matches!(
            WorkloadId::from_certificate(&cert_with_uris(&[])),
            Err(IdentityError::NoUriSan)
        ));

        let one = cert_with_uris(&["spiffe://iop.test/node/node-1"]);
        let parsed = WorkloadId::from_certificate(&one).unwrap();
        assert_eq!(parsed, WorkloadId::new(TD, role::NODE, "node-1").unwrap());

        let two = cert_with_uris(&["spiffe://iop.test/node/node-1", "spiffe://iop.test/edge/e"]);
        assert!(matches!(
            WorkloadId::from_certificate(&two),
            Err(IdentityError::MultipleUriSans { count: 2 })
        ));

        // A non-SPIFFE URI SAN still counts, and a lone one is rejected by the parser.
        let other = cert_with_uris(&["https://iop.test/node/n"]);
        assert!(matches!(
            WorkloadId::from_certificate(&other),
            Err(IdentityError::WrongScheme)
        ));
    }

    #[test]
    fn certificate_garbage_is_bad_certificate() {
        let garbage = CertificateDer::from(vec![0x30, 0x03, 0x01, 0x01]);
        assert!(matches!(
            WorkloadId::from_certificate(&garbage),
            Err(IdentityError::BadCertificate)
        ));

        let mut trailing = cert_with_uris(&["spiffe://iop.test/node/n"]).to_vec();
        trailing.push(0);
        assert!(matches!(
            WorkloadId::from_certificate(&CertificateDer::from(trailing)),
            Err(IdentityError::BadCertificate)
        ));
    }

    #[test]
    fn expected_peer_checks() {
        let node1 = WorkloadId::new(TD, role::NODE, "node-1").unwrap();
        let any_node = ExpectedPeer::any_name(TD, role::NODE).unwrap();
        assert_eq!(any_node.name(), None);
        assert_eq!(any_node.to_string(), "spiffe://iop.test/node/*");
        any_node.check(&node1).unwrap();
        any_node
            .check(&WorkloadId::new(TD, role::NODE, "node-2").unwrap())
            .unwrap();

        let edge1 = ExpectedPeer::exact(TD, role::EDGE, "edge-1").unwrap();
        assert_eq!(edge1.name(), Some("edge-1"));
        edge1
            .check(&WorkloadId::new(TD, role::EDGE, "edge-1").unwrap())
            .unwrap();

        match edge1.check(&WorkloadId::new(TD, role::EDGE, "edge-2").unwrap()) {
            Err(IdentityError::WrongName { expected, found }) => {
                assert_eq!((expected.as_str(), found.as_str()), ("edge-1", "edge-2"));
            }
            other => panic!("unexpected {other:?}"),
        }
        match any_node.check(&WorkloadId::new(TD, role::EDGE, "node-1").unwrap()) {
            Err(IdentityError::WrongRole { expected, found }) => {
                assert_eq!((expected.as_str(), found.as_str()), ("node", "edge"));
            }
            other => panic!("unexpected {other:?}"),
        }
        // Trust domain is checked first, even when role and name also differ.
        match edge1.check(&WorkloadId::new("other.test", role::NODE, "x").unwrap()) {
            Err(IdentityError::WrongTrustDomain { expected, found }) => {
                assert_eq!(
                    (expected.as_str(), found.as_str()),
                    ("iop.test", "other.test")
                );
            }
            other => panic!("unexpected {other:?}"),
        }

        assert!(ExpectedPeer::any_name("IOP", role::NODE).is_err());
        assert!(ExpectedPeer::any_name(TD, "node/x").is_err());
        assert_eq!(
            ExpectedPeer::from(node1.clone()),
            ExpectedPeer::exact(TD, "node", "node-1").unwrap()
        );
    }

    #[test]
    fn identity_error_round_trips_through_rustls_error() {
        let err = IdentityError::WrongRole {
            expected: role::NODE.to_owned(),
            found: role::EDGE.to_owned(),
        };
        let tls = err.into_rustls();
        assert!(matches!(
            IdentityError::from_rustls_error(&tls),
            Some(IdentityError::WrongRole { .. })
        ));
        assert!(
            IdentityError::from_rustls_error(&rustls::Error::NoCertificatesPresented).is_none()
        );
        assert!(
            IdentityError::from_rustls_error(&rustls::Error::InvalidCertificate(
                CertificateError::UnknownIssuer
            ))
            .is_none()
        );
    }

    #[test]
    fn configs_reject_a_leaf_without_identity() {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let mut roots = RootCertStore::empty();
        roots.add(cert.der().clone()).unwrap();
        let roots = Arc::new(roots);
        let key_der = || PrivateKeyDer::Pkcs8(key.serialize_der().into());

        let verifier =
            client_cert_verifier(roots.clone(), ExpectedPeer::any_name(TD, "node").unwrap())
                .unwrap();
        assert!(matches!(
            server_config(vec![cert.der().clone()], key_der(), verifier.clone()),
            Err(IdentityError::NoUriSan)
        ));
        assert!(matches!(
            server_config(vec![], key_der(), verifier),
            Err(IdentityError::NoCertificate)
        ));
        let verifier =
            server_cert_verifier(roots, ExpectedPeer::any_name(TD, "edge").unwrap()).unwrap();
        assert!(matches!(
            client_config(vec![cert.der().clone()], key_der(), verifier),
            Err(IdentityError::NoUriSan)
        ));
        assert!(matches!(
            client_cert_verifier(
                Arc::new(RootCertStore::empty()),
                ExpectedPeer::any_name(TD, "node").unwrap()
            ),
            Err(IdentityError::Verifier(_))
        ));
    }
}
