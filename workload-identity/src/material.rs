//! A workload's TLS material that can be replaced while it serves: the CA bundle and its own
//! certificate chain and key (re-exported as [`crate::WorkloadTls`]).
//!
//! SPIRE's spiffe-helper, cert-manager and plain `iop-ca issue --force` rewrite these files
//! while the process runs. [`WorkloadTls`] holds the current material; the rustls
//! configurations built from it ([`WorkloadTls::server_config`], [`WorkloadTls::client_config`])
//! read it at every handshake — the own certificate through a certificate resolver, the peer's
//! chain through a verifier rebuilt when the CA bundle changes — so after
//! [`WorkloadTls::reload_pem`] new connections use the new files and established ones continue
//! with what they negotiated. A bundle that does not parse, a key that does not match its
//! certificate, or a certificate whose SPIFFE ID is not the workload's own identity is refused
//! and the old material stays in use.
//!
//! TLS session resumption is off in both directions: a resumed session carries the identity
//! its first handshake verified, which would outlive a rotation, a CA change or an expiry. The
//! links are long-lived, so a full handshake per connection costs little.
//!
//! Pure: PEM bytes in, nothing read from disk here. The `reload` module (feature `reload`)
//! polls the files.

use std::sync::{Arc, RwLock};

use rustls::client::ResolvesClientCert;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
};

use crate::{ExpectedPeer, IdentityError, WorkloadId, client_cert_verifier, server_cert_verifier};

/// Why TLS material was refused. Never carries key bytes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MaterialError {
    /// The CA bundle has no certificate, or one that is not a valid trust anchor.
    #[error("CA bundle: {0}")]
    Ca(&'static str),
    /// The certificate chain is empty or not PEM.
    #[error("certificate: {0}")]
    Cert(&'static str),
    /// The private key is missing, not PEM, or does not match the certificate.
    #[error("private key: {0}")]
    Key(&'static str),
    /// The certificate's identity is not valid, or not the one this workload had.
    #[error("certificate identity: {0}")]
    Identity(IdentityError),
    /// The new certificate names another workload.
    #[error("certificate identity changed from {old} to {new}; restart to change identity")]
    IdentityChanged {
        /// The running identity.
        old: WorkloadId,
        /// The new file's identity.
        new: WorkloadId,
    },
}

#[derive(Debug)]
struct Material {
    generation: u64,
    roots: Arc<RootCertStore>,
    certified: Arc<CertifiedKey>,
    id: WorkloadId,
}

/// The current TLS material of a workload. See the module docs.
#[derive(Debug)]
pub struct WorkloadTls {
    current: RwLock<Arc<Material>>,
}

fn parse_roots(ca: &[u8]) -> Result<RootCertStore, MaterialError> {
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca) {
        let c = c.map_err(|_| MaterialError::Ca("not a PEM certificate bundle"))?;
        roots
            .add(c)
            .map_err(|_| MaterialError::Ca("a certificate is not a valid trust anchor"))?;
    }
    if roots.is_empty() {
        return Err(MaterialError::Ca("no certificate found"));
    }
    Ok(roots)
}

/// The chain and its key; `check_leaf` sees the leaf before the key is parsed.
fn parse_certified<T>(
    cert: &[u8],
    key: &[u8],
    check_leaf: impl FnOnce(&CertificateDer<'_>) -> Result<T, MaterialError>,
) -> Result<(T, CertifiedKey), MaterialError> {
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| MaterialError::Cert("not a PEM certificate chain"))?;
    let leaf = chain
        .first()
        .ok_or(MaterialError::Cert("no certificate found"))?;
    let checked = check_leaf(leaf)?;
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|_| MaterialError::Key("no PEM private key found"))?;
    let provider = rustls::crypto::ring::default_provider();
    let certified = CertifiedKey::from_der(chain, key, &provider)
        .map_err(|_| MaterialError::Key("unsupported, or does not match the certificate"))?;
    Ok((checked, certified))
}

fn parse(ca: &[u8], cert: &[u8], key: &[u8]) -> Result<Material, MaterialError> {
    let roots = parse_roots(ca)?;
    let (id, certified) = parse_certified(cert, key, |leaf| {
        WorkloadId::from_certificate(leaf).map_err(MaterialError::Identity)
    })?;
    Ok(Material {
        generation: 0,
        roots: Arc::new(roots),
        certified: Arc::new(certified),
        id,
    })
}

/// What the resolvers and reloading verifiers read at each handshake.
trait Current: Send + Sync + std::fmt::Debug {
    /// The material's generation and CA bundle.
    fn roots(&self) -> (u64, Arc<RootCertStore>);
    /// The own certificate and key.
    fn certified(&self) -> Arc<CertifiedKey>;
}

impl Current for WorkloadTls {
    fn roots(&self) -> (u64, Arc<RootCertStore>) {
        let m = self.load();
        (m.generation, m.roots.clone())
    }
    fn certified(&self) -> Arc<CertifiedKey> {
        self.load().certified.clone()
    }
}

impl WorkloadTls {
    /// Material from PEM: the CA bundle, the chain (leaf first) and the PKCS#8/SEC1/PKCS#1 key.
    pub fn from_pem(ca: &[u8], cert: &[u8], key: &[u8]) -> Result<Arc<Self>, MaterialError> {
        let material = parse(ca, cert, key)?;
        Ok(Arc::new(Self {
            current: RwLock::new(Arc::new(material)),
        }))
    }

    fn load(&self) -> Arc<Material> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Replaces the material with new PEM, unless it is invalid or names another workload (the
    /// old material then stays). Returns whether anything changed.
    pub fn reload_pem(&self, ca: &[u8], cert: &[u8], key: &[u8]) -> Result<bool, MaterialError> {
        let mut new = parse(ca, cert, key)?;
        let mut current = self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if new.id != current.id {
            return Err(MaterialError::IdentityChanged {
                old: current.id.clone(),
                new: new.id,
            });
        }
        let same =
            new.certified.cert == current.certified.cert && new.roots.roots == current.roots.roots;
        if same {
            return Ok(false);
        }
        new.generation = current.generation + 1;
        *current = Arc::new(new);
        Ok(true)
    }

    /// The workload's own identity (from its certificate).
    pub fn identity(&self) -> WorkloadId {
        self.load().id.clone()
    }

    /// How many times the material changed.
    pub fn generation(&self) -> u64 {
        self.load().generation
    }

    /// The end-entity certificate currently presented.
    pub fn leaf(&self) -> CertificateDer<'static> {
        self.load().certified.cert[0].clone()
    }

    /// A TLS 1.3 server configuration (ring) presenting the current certificate and verifying
    /// clients against the current CA bundle and `expected`.
    pub fn server_config(
        self: &Arc<Self>,
        expected: ExpectedPeer,
    ) -> Result<ServerConfig, IdentityError> {
        let verifier = Arc::new(ReloadingClientVerifier {
            tls: self.clone(),
            cache: RwLock::new(None),
            expected: Some(expected),
        });
        verifier.current()?;
        let mut config =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .map_err(IdentityError::Config)?
                .with_client_cert_verifier(verifier)
                .with_cert_resolver(Arc::new(Resolver(self.clone())));
        no_resumption(&mut config);
        Ok(config)
    }

    /// A TLS 1.3 client configuration (ring) presenting the current certificate and verifying
    /// servers against the current CA bundle, the dialled name and `expected`.
    pub fn client_config(
        self: &Arc<Self>,
        expected: ExpectedPeer,
    ) -> Result<ClientConfig, IdentityError> {
        let verifier = Arc::new(ReloadingServerVerifier {
            tls: self.clone(),
            cache: RwLock::new(None),
            expected,
        });
        verifier.current()?;
        let mut config =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .map_err(IdentityError::Config)?
                .dangerous()
                .with_custom_certificate_verifier(verifier)
                .with_client_cert_resolver(Arc::new(Resolver(self.clone())));
        // As for the server: every connection a full handshake with the current material.
        config.resumption = rustls::client::Resumption::disabled();
        Ok(config)
    }
}

/// No resumption: a resumed session would carry the identity it began with past a rotation, a
/// CA change or an expiry. Every handshake verifies the current material.
fn no_resumption(config: &mut ServerConfig) {
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
}

// === impl HostTls ===

#[derive(Debug)]
struct HostMaterial {
    generation: u64,
    roots: Arc<RootCertStore>,
    certified: Arc<CertifiedKey>,
}

/// A server's replaceable TLS material when its own certificate names a host (a DNS name), not
/// a SPIFFE workload: the CA bundle its clients must chain to, and its own chain and key.
///
/// Clients are verified with the WebPKI rules only (chain, validity, client-auth usage); which
/// client it is, is the application's to read after the handshake (the proxy-pool controller
/// reads a worker id of `spiffe://TD/ENV/worker/ID` and closes any other). Reload works as for
/// [`WorkloadTls`]: [`HostTls::reload_pem`] refuses invalid material and keeps the old; new
/// handshakes use the new; the own certificate may name another host after a reload.
#[derive(Debug)]
pub struct HostTls {
    current: RwLock<Arc<HostMaterial>>,
}

fn parse_host(ca: &[u8], cert: &[u8], key: &[u8]) -> Result<HostMaterial, MaterialError> {
    let roots = parse_roots(ca)?;
    let ((), certified) = parse_certified(cert, key, |leaf| {
        x509_parser::parse_x509_certificate(leaf)
            .map(|_| ())
            .map_err(|_| MaterialError::Cert("the certificate does not parse"))
    })?;
    Ok(HostMaterial {
        generation: 0,
        roots: Arc::new(roots),
        certified: Arc::new(certified),
    })
}

impl HostTls {
    /// Material from PEM: the client CA bundle, the chain (leaf first) and its key.
    pub fn from_pem(client_ca: &[u8], cert: &[u8], key: &[u8]) -> Result<Arc<Self>, MaterialError> {
        Ok(Arc::new(Self {
            current: RwLock::new(Arc::new(parse_host(client_ca, cert, key)?)),
        }))
    }

    fn load(&self) -> Arc<HostMaterial> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Replaces the material with new PEM unless it is invalid (the old then stays). Returns
    /// whether anything changed.
    pub fn reload_pem(
        &self,
        client_ca: &[u8],
        cert: &[u8],
        key: &[u8],
    ) -> Result<bool, MaterialError> {
        let mut new = parse_host(client_ca, cert, key)?;
        let mut current = self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if new.certified.cert == current.certified.cert && new.roots.roots == current.roots.roots {
            return Ok(false);
        }
        new.generation = current.generation + 1;
        *current = Arc::new(new);
        Ok(true)
    }

    /// How many times the material changed.
    pub fn generation(&self) -> u64 {
        self.load().generation
    }

    /// The end-entity certificate currently presented.
    pub fn leaf(&self) -> CertificateDer<'static> {
        self.load().certified.cert[0].clone()
    }

    /// A TLS 1.3 server configuration (ring) presenting the current certificate and requiring a
    /// client certificate that chains to the current CA bundle, with `alpn` offered.
    pub fn server_config(self: &Arc<Self>, alpn: &[&[u8]]) -> Result<ServerConfig, IdentityError> {
        let verifier = Arc::new(ReloadingClientVerifier {
            tls: self.clone(),
            cache: RwLock::new(None),
            expected: None,
        });
        verifier.current()?;
        let mut config =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .map_err(IdentityError::Config)?
                .with_client_cert_verifier(verifier)
                .with_cert_resolver(Arc::new(Resolver(self.clone())));
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        no_resumption(&mut config);
        Ok(config)
    }
}

impl Current for HostTls {
    fn roots(&self) -> (u64, Arc<RootCertStore>) {
        let m = self.load();
        (m.generation, m.roots.clone())
    }
    fn certified(&self) -> Arc<CertifiedKey> {
        self.load().certified.clone()
    }
}

// === impl resolvers and verifiers ===

#[derive(Debug)]
struct Resolver<T>(Arc<T>);

impl<T: Current> ResolvesServerCert for Resolver<T> {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.certified())
    }
}

impl<T: Current> ResolvesClientCert for Resolver<T> {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.0.certified())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// A verifier built from the current roots, rebuilt when the material's generation moves.
type Cached<V> = RwLock<Option<(u64, Arc<V>)>>;

fn cached<V: ?Sized>(
    cache: &Cached<V>,
    tls: &dyn Current,
    build: impl FnOnce(Arc<RootCertStore>) -> Result<Arc<V>, IdentityError>,
) -> Result<Arc<V>, IdentityError> {
    let (current, roots) = tls.roots();
    if let Some((generation, v)) = cache
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
        && *generation == current
    {
        return Ok(v.clone());
    }
    let v = build(roots)?;
    *cache
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((current, v.clone()));
    Ok(v)
}

fn verifier_failed(e: IdentityError) -> rustls::Error {
    rustls::Error::General(format!("certificate verifier unavailable: {e}"))
}

/// A client verifier over the current CA bundle: the SPIFFE one when `expected` is set, the
/// WebPKI one alone otherwise ([`HostTls`]).
#[derive(Debug)]
struct ReloadingClientVerifier<T> {
    tls: Arc<T>,
    cache: Cached<dyn ClientCertVerifier>,
    expected: Option<ExpectedPeer>,
}

impl<T: Current> ReloadingClientVerifier<T> {
    fn current(&self) -> Result<Arc<dyn ClientCertVerifier>, IdentityError> {
        cached(&self.cache, &*self.tls, |roots| match &self.expected {
            Some(expected) => client_cert_verifier(roots, expected.clone()),
            None => {
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let verifier: Arc<dyn ClientCertVerifier> =
                    rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider)
                        .build()
                        .map_err(IdentityError::Verifier)?;
                Ok(verifier)
            }
        })
    }
}

impl<T: Current> ClientCertVerifier for ReloadingClientVerifier<T> {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // Hints would borrow from material that can change; clients present their one
        // certificate regardless.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.current()
            .map_err(verifier_failed)?
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current()
            .map_err(verifier_failed)?
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current()
            .map_err(verifier_failed)?
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current()
            .map(|v| v.supported_verify_schemes())
            .unwrap_or_default()
    }
}

#[derive(Debug)]
struct ReloadingServerVerifier {
    tls: Arc<WorkloadTls>,
    cache: Cached<dyn ServerCertVerifier>,
    expected: ExpectedPeer,
}

impl ReloadingServerVerifier {
    fn current(&self) -> Result<Arc<dyn ServerCertVerifier>, IdentityError> {
        cached(&self.cache, &*self.tls, |roots| {
            server_cert_verifier(roots, self.expected.clone())
        })
    }
}

impl ServerCertVerifier for ReloadingServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.current().map_err(verifier_failed)?.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current()
            .map_err(verifier_failed)?
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.current()
            .map_err(verifier_failed)?
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current()
            .map(|v| v.supported_verify_schemes())
            .unwrap_or_default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, SanType,
    };

    use super::*;
    use crate::role;

    struct Ca {
        issuer: Issuer<'static, KeyPair>,
        pem: String,
    }

    fn ca(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let pem = params.self_signed(&key).unwrap().pem();
        Ca {
            issuer: Issuer::new(params, key),
            pem,
        }
    }

    /// `(cert PEM, key PEM)` for `spiffe://t/<role>/<name>`, DNS `localhost`.
    fn leaf(ca: &Ca, role: &str, name: &str) -> (String, String) {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.subject_alt_names.push(SanType::URI(
            format!("spiffe://t/{role}/{name}").try_into().unwrap(),
        ));
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Runs a handshake in memory; the leaf the client saw, or the error.
    fn handshake(
        client: &Arc<ClientConfig>,
        server: &Arc<ServerConfig>,
    ) -> Result<CertificateDer<'static>, rustls::Error> {
        let mut c = rustls::ClientConnection::new(
            client.clone(),
            ServerName::try_from("localhost").unwrap(),
        )
        .unwrap();
        let mut s = rustls::ServerConnection::new(server.clone()).unwrap();
        for _ in 0..10 {
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut &buf[..]).unwrap();
            s.process_new_packets()?;
            let mut buf = Vec::new();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut &buf[..]).unwrap();
            c.process_new_packets()?;
            if !c.is_handshaking() && !s.is_handshaking() {
                return Ok(c.peer_certificates().unwrap()[0].clone().into_owned());
            }
        }
        panic!("handshake did not finish");
    }

    #[test]
    fn reloaded_material_is_used_by_new_handshakes_and_bad_material_is_refused() {
        let ca1 = ca("ca-1");
        let (edge_cert, edge_key) = leaf(&ca1, role::EDGE, "e");
        let (node_cert, node_key) = leaf(&ca1, role::NODE, "n");
        let edge = WorkloadTls::from_pem(
            ca1.pem.as_bytes(),
            edge_cert.as_bytes(),
            edge_key.as_bytes(),
        )
        .unwrap();
        let node = WorkloadTls::from_pem(
            ca1.pem.as_bytes(),
            node_cert.as_bytes(),
            node_key.as_bytes(),
        )
        .unwrap();
        let server = Arc::new(
            edge.server_config(ExpectedPeer::any_name("t", role::NODE).unwrap())
                .unwrap(),
        );
        // Resumption is off in these configurations: every handshake below is a full one.
        let client = Arc::new(
            node.client_config(ExpectedPeer::exact("t", role::EDGE, "e").unwrap())
                .unwrap(),
        );
        let first = handshake(&client, &server).unwrap();
        assert_eq!(first, edge.leaf());

        // A rotated certificate, same identity: the next handshake presents it.
        let (edge_cert2, edge_key2) = leaf(&ca1, role::EDGE, "e");
        assert!(
            edge.reload_pem(
                ca1.pem.as_bytes(),
                edge_cert2.as_bytes(),
                edge_key2.as_bytes()
            )
            .unwrap()
        );
        assert!(
            !edge
                .reload_pem(
                    ca1.pem.as_bytes(),
                    edge_cert2.as_bytes(),
                    edge_key2.as_bytes()
                )
                .unwrap(),
            "unchanged"
        );
        let second = handshake(&client, &server).unwrap();
        assert_ne!(second, first);
        assert_eq!(edge.generation(), 1);

        // Refused, and the old material stays: garbage, a key of another certificate, another
        // workload's certificate.
        let e = edge
            .reload_pem(ca1.pem.as_bytes(), b"garbage", edge_key2.as_bytes())
            .unwrap_err();
        assert!(matches!(e, MaterialError::Cert(_)), "{e}");
        let e = edge
            .reload_pem(
                ca1.pem.as_bytes(),
                edge_cert2.as_bytes(),
                edge_key.as_bytes(),
            )
            .unwrap_err();
        assert!(matches!(e, MaterialError::Key(_)), "{e}");
        let (other, other_key) = leaf(&ca1, role::EDGE, "other");
        let e = edge
            .reload_pem(ca1.pem.as_bytes(), other.as_bytes(), other_key.as_bytes())
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "certificate identity changed from spiffe://t/edge/e to spiffe://t/edge/other; restart to change identity"
        );
        let e = edge
            .reload_pem(b"", edge_cert2.as_bytes(), edge_key2.as_bytes())
            .unwrap_err();
        assert!(matches!(e, MaterialError::Ca(_)), "{e}");
        assert_eq!(handshake(&client, &server).unwrap(), second);

        // CA rotation: the Node trusts both CAs, then the Edge moves to a certificate of the new
        // CA; a Node that trusts only the old CA refuses it.
        let ca2 = ca("ca-2");
        let both = format!("{}{}", ca1.pem, ca2.pem);
        let stale_node = Arc::new(
            WorkloadTls::from_pem(
                ca1.pem.as_bytes(),
                node_cert.as_bytes(),
                node_key.as_bytes(),
            )
            .unwrap()
            .client_config(ExpectedPeer::exact("t", role::EDGE, "e").unwrap())
            .unwrap(),
        );
        assert!(
            node.reload_pem(both.as_bytes(), node_cert.as_bytes(), node_key.as_bytes())
                .unwrap()
        );
        assert!(
            edge.reload_pem(both.as_bytes(), edge_cert2.as_bytes(), edge_key2.as_bytes())
                .unwrap()
        );
        let (edge_cert3, edge_key3) = leaf(&ca2, role::EDGE, "e");
        assert!(
            edge.reload_pem(both.as_bytes(), edge_cert3.as_bytes(), edge_key3.as_bytes())
                .unwrap()
        );
        assert_eq!(handshake(&client, &server).unwrap(), edge.leaf());
        assert!(handshake(&stale_node, &server).is_err());
    }

    /// `(cert PEM, key PEM)` for a host certificate (DNS `localhost`, no SPIFFE ID).
    fn host_leaf(ca: &Ca) -> (String, String) {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn host_material_serves_without_an_own_spiffe_id_and_reloads() {
        let server_ca = ca("server-ca");
        let client_ca = ca("client-ca");
        let (cert, key) = host_leaf(&server_ca);
        // A WorkloadTls refuses a certificate without a SPIFFE ID; HostTls takes it.
        assert!(matches!(
            WorkloadTls::from_pem(client_ca.pem.as_bytes(), cert.as_bytes(), key.as_bytes()),
            Err(MaterialError::Identity(_))
        ));
        let host =
            HostTls::from_pem(client_ca.pem.as_bytes(), cert.as_bytes(), key.as_bytes()).unwrap();
        let server = Arc::new(host.server_config(&[b"h2"]).unwrap());
        assert_eq!(server.alpn_protocols, vec![b"h2".to_vec()]);
        // Any client chaining to the client CA passes the handshake (its identity is the
        // application's to check); the client verifies the host name as usual.
        let (worker_cert, worker_key) = leaf(&client_ca, "worker", "w-1");
        let client_for = |ca_pem: &str, cert: &str, key: &str| {
            let material =
                WorkloadTls::from_pem(ca_pem.as_bytes(), cert.as_bytes(), key.as_bytes()).unwrap();
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(server_ca.pem.as_bytes()) {
                roots.add(c.unwrap()).unwrap();
            }
            Arc::new(
                ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_root_certificates(roots)
                .with_client_cert_resolver(Arc::new(Resolver(material))),
            )
        };
        let worker = client_for(&client_ca.pem, &worker_cert, &worker_key);
        assert_eq!(handshake(&worker, &server).unwrap(), host.leaf());
        // Without a client certificate: refused.
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(server_ca.pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let anonymous = Arc::new(
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        );
        assert!(handshake(&anonymous, &server).is_err());

        // A rotated server certificate is presented by the next handshake; invalid material
        // is refused and the old stays.
        let first = host.leaf();
        let (cert2, key2) = host_leaf(&server_ca);
        assert!(
            host.reload_pem(client_ca.pem.as_bytes(), cert2.as_bytes(), key2.as_bytes())
                .unwrap()
        );
        assert!(
            !host
                .reload_pem(client_ca.pem.as_bytes(), cert2.as_bytes(), key2.as_bytes())
                .unwrap()
        );
        assert_eq!(host.generation(), 1);
        let second = handshake(&worker, &server).unwrap();
        assert_ne!(second, first);
        assert!(
            host.reload_pem(client_ca.pem.as_bytes(), cert2.as_bytes(), key.as_bytes())
                .is_err()
        );
        assert_eq!(handshake(&worker, &server).unwrap(), second);

        // A new client CA: the old CA's workers are refused from the next handshake on.
        let client_ca2 = ca("client-ca-2");
        assert!(
            host.reload_pem(client_ca2.pem.as_bytes(), cert2.as_bytes(), key2.as_bytes())
                .unwrap()
        );
        assert!(handshake(&worker, &server).is_err());
        let (w2_cert, w2_key) = leaf(&client_ca2, "worker", "w-2");
        let worker2 = client_for(&client_ca2.pem, &w2_cert, &w2_key);
        assert_eq!(handshake(&worker2, &server).unwrap(), second);
    }
}
