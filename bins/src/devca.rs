//! An ephemeral development CA for the local mesh: every run makes a fresh CA and SPIFFE
//! workload identities (`spiffe://iop.local/<role>/<name>`), so even the demo runs mTLS.
//! Nothing is written to disk.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use iop_wire::identity::{self, ExpectedPeer, role};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// The trust domain of the local mesh.
pub const TRUST_DOMAIN: &str = "iop.local";

/// Why the development PKI could not be made.
#[derive(Debug, thiserror::Error)]
#[error("development PKI: {0}")]
pub struct DevCaError(String);

fn err(e: impl std::fmt::Display) -> DevCaError {
    DevCaError(e.to_string())
}

/// An in-memory CA.
#[derive(Debug)]
pub struct DevCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl DevCa {
    /// A fresh self-signed CA.
    pub fn new() -> Result<Self, DevCaError> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "iop local mesh CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().map_err(err)?;
        Ok(Self {
            issuer: CertifiedIssuer::self_signed(params, key).map_err(err)?,
        })
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, DevCaError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.issuer.der().clone()).map_err(err)?;
        Ok(Arc::new(roots))
    }

    fn leaf(
        &self,
        role: &str,
        name: &str,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), DevCaError> {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        let uri = format!("spiffe://{TRUST_DOMAIN}/{role}/{name}");
        params
            .subject_alt_names
            .push(SanType::URI(uri.as_str().try_into().map_err(err)?));
        params
            .subject_alt_names
            .push(SanType::DnsName("localhost".try_into().map_err(err)?));
        params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(err)?;
        Ok((
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        ))
    }

    /// The Edge's server TLS: identity `edge/<name>`, accepting any Node of this CA.
    pub fn edge_tls(&self, name: &str) -> Result<Arc<rustls::ServerConfig>, DevCaError> {
        let (chain, key) = self.leaf(role::EDGE, name)?;
        let expected = ExpectedPeer::any_name(TRUST_DOMAIN, role::NODE).map_err(err)?;
        let verifier = identity::client_cert_verifier(self.roots()?, expected).map_err(err)?;
        Ok(Arc::new(
            identity::server_config(chain, key, verifier).map_err(err)?,
        ))
    }

    /// A Node's client TLS: identity `node/<name>`, expecting the Edge `edge/<edge>`.
    pub fn node_tls(
        &self,
        name: &str,
        edge: &str,
    ) -> Result<Arc<rustls::ClientConfig>, DevCaError> {
        let (chain, key) = self.leaf(role::NODE, name)?;
        let expected = ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, edge).map_err(err)?;
        let verifier = identity::server_cert_verifier(self.roots()?, expected).map_err(err)?;
        Ok(Arc::new(
            identity::client_config(chain, key, verifier).map_err(err)?,
        ))
    }
}
