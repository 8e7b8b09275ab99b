//! A throwaway development PKI for tests: a CA and SPIFFE workload leaves (rcgen, ring).

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::RootCertStore;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// The trust domain of every test identity.
pub const TRUST_DOMAIN: &str = "iop.test";

/// A development workload CA.
#[derive(Debug)]
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    /// A self-signed CA.
    pub fn new(common_name: &str) -> Self {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("ring key generation does not fail");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("valid CA params");
        Self { issuer }
    }

    /// The CA certificate as PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A root store holding this CA.
    pub fn roots(&self) -> Arc<RootCertStore> {
        let mut roots = RootCertStore::empty();
        roots
            .add(self.issuer.der().clone())
            .expect("rcgen CA certificate is valid DER");
        Arc::new(roots)
    }

    /// A workload leaf with the given URI SANs. Like SPIRE's X509-SVIDs it is usable as both
    /// a TLS client and server certificate; `server` adds the names the Node dials.
    pub fn leaf(&self, uris: &[String], server: bool) -> Leaf {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "iop workload");
        for uri in uris {
            let uri = uri.as_str().try_into().expect("test URIs are ASCII");
            params.subject_alt_names.push(SanType::URI(uri));
        }
        if server {
            let dns = "localhost".try_into().expect("ASCII name");
            params.subject_alt_names.push(SanType::DnsName(dns));
            params
                .subject_alt_names
                .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().expect("ring key generation does not fail");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("valid leaf params");
        Leaf {
            chain: vec![cert.der().clone()],
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// A leaf for `spiffe://iop.test/<role>/<name>`.
    pub fn workload(&self, role: &str, name: &str, server: bool) -> Leaf {
        self.leaf(&[spiffe(role, name)], server)
    }
}

/// The SPIFFE id `spiffe://iop.test/<role>/<name>`.
pub fn spiffe(role: &str, name: &str) -> String {
    format!("spiffe://{TRUST_DOMAIN}/{role}/{name}")
}

/// A workload certificate and its key.
#[derive(Debug)]
pub struct Leaf {
    /// The certificate chain (leaf only).
    pub chain: Vec<CertificateDer<'static>>,
    key: PrivatePkcs8KeyDer<'static>,
    /// The certificate as PEM.
    pub cert_pem: String,
    /// The PKCS#8 private key as PEM.
    pub key_pem: String,
}

impl Leaf {
    /// The private key.
    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key.clone_key())
    }
}

/// The Edge's server TLS: the `edge/<edge_name>` identity, accepting any Node of this CA.
pub fn edge_server_tls(ca: &Ca, edge_name: &str) -> Arc<rustls::ServerConfig> {
    let leaf = ca.workload(workload_identity::role::EDGE, edge_name, true);
    let expected =
        workload_identity::ExpectedPeer::any_name(TRUST_DOMAIN, workload_identity::role::NODE)
            .expect("valid expected peer");
    let verifier = workload_identity::client_cert_verifier(ca.roots(), expected).expect("roots");
    Arc::new(
        workload_identity::server_config(leaf.chain.clone(), leaf.key(), verifier)
            .expect("edge config"),
    )
}

/// A Node's client TLS: the `<role>/<cert_name>` identity (normally role `node`), expecting the
/// Edge `edge/<edge_name>`.
pub fn node_client_tls(
    ca: &Ca,
    role: &str,
    cert_name: &str,
    edge_name: &str,
) -> Arc<rustls::ClientConfig> {
    let leaf = ca.workload(role, cert_name, false);
    let expected = workload_identity::ExpectedPeer::exact(
        TRUST_DOMAIN,
        workload_identity::role::EDGE,
        edge_name,
    )
    .expect("valid expected peer");
    let verifier = workload_identity::server_cert_verifier(ca.roots(), expected).expect("roots");
    Arc::new(
        workload_identity::client_config(leaf.chain.clone(), leaf.key(), verifier)
            .expect("node config"),
    )
}

/// A workload's server TLS: the `<role>/<name>` identity, requiring clients of `client_role`
/// (any name) from this CA.
pub fn server_tls(ca: &Ca, role: &str, name: &str, client_role: &str) -> Arc<rustls::ServerConfig> {
    let leaf = ca.workload(role, name, true);
    let expected = workload_identity::ExpectedPeer::any_name(TRUST_DOMAIN, client_role)
        .expect("valid expected peer");
    let verifier = workload_identity::client_cert_verifier(ca.roots(), expected).expect("roots");
    Arc::new(
        workload_identity::server_config(leaf.chain.clone(), leaf.key(), verifier)
            .expect("server config"),
    )
}

/// A workload's client TLS: the `<role>/<cert_name>` identity, expecting the server
/// `<server_role>/<server_name>`.
pub fn client_tls(
    ca: &Ca,
    role: &str,
    cert_name: &str,
    server_role: &str,
    server_name: &str,
) -> Arc<rustls::ClientConfig> {
    let leaf = ca.workload(role, cert_name, false);
    let expected = workload_identity::ExpectedPeer::exact(TRUST_DOMAIN, server_role, server_name)
        .expect("valid expected peer");
    let verifier = workload_identity::server_cert_verifier(ca.roots(), expected).expect("roots");
    Arc::new(
        workload_identity::client_config(leaf.chain.clone(), leaf.key(), verifier)
            .expect("client config"),
    )
}
