//! An ephemeral development CA for the local mesh: every run makes a fresh CA and SPIFFE
//! workload identities (`spiffe://iop.local/<role>/<name>`, DNS `localhost`, IP 127.0.0.1), so
//! even the demo runs mTLS. Nothing is written to disk. The certificates are the ones
//! `iop-ca` issues ([`crate::ca`]).

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use iop_wire::identity::{ExpectedPeer, WorkloadTls, role};

use crate::ca::WorkloadCa;

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
    ca: WorkloadCa,
}

impl DevCa {
    /// A fresh self-signed CA.
    pub fn new() -> Result<Self, DevCaError> {
        Ok(Self {
            ca: WorkloadCa::generate(TRUST_DOMAIN, 365).map_err(err)?,
        })
    }

    fn material(&self, role: &str, name: &str) -> Result<Arc<WorkloadTls>, DevCaError> {
        let issued = self
            .ca
            .issue(
                role,
                name,
                &["localhost".to_owned()],
                &[IpAddr::V4(Ipv4Addr::LOCALHOST)],
                365,
            )
            .map_err(err)?;
        WorkloadTls::from_pem(
            self.ca.cert_pem().as_bytes(),
            issued.cert_pem.as_bytes(),
            issued.key_pem.as_bytes(),
        )
        .map_err(err)
    }

    /// The Edge's server TLS: identity `edge/<name>`, accepting any Node of this CA.
    pub fn edge_tls(&self, name: &str) -> Result<Arc<rustls::ServerConfig>, DevCaError> {
        let expected = ExpectedPeer::any_name(TRUST_DOMAIN, role::NODE).map_err(err)?;
        let config = self
            .material(role::EDGE, name)?
            .server_config(expected)
            .map_err(err)?;
        Ok(Arc::new(config))
    }

    /// A Node's client TLS: identity `node/<name>`, expecting the Edge `edge/<edge>`.
    pub fn node_tls(
        &self,
        name: &str,
        edge: &str,
    ) -> Result<Arc<rustls::ClientConfig>, DevCaError> {
        let expected = ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, edge).map_err(err)?;
        let config = self
            .material(role::NODE, name)?
            .client_config(expected)
            .map_err(err)?;
        Ok(Arc::new(config))
    }

    /// A Control Plane's server TLS: identity `control-plane/<name>`, accepting any Edge of
    /// this CA.
    pub fn control_plane_tls(&self, name: &str) -> Result<Arc<rustls::ServerConfig>, DevCaError> {
        let expected = ExpectedPeer::any_name(TRUST_DOMAIN, role::EDGE).map_err(err)?;
        let config = self
            .material(role::CONTROL_PLANE, name)?
            .server_config(expected)
            .map_err(err)?;
        Ok(Arc::new(config))
    }

    /// An Edge's client TLS to its Control Plane: identity `edge/<name>`, expecting
    /// `control-plane/<cp>`.
    pub fn edge_client_tls(
        &self,
        name: &str,
        cp: &str,
    ) -> Result<Arc<rustls::ClientConfig>, DevCaError> {
        let expected = ExpectedPeer::exact(TRUST_DOMAIN, role::CONTROL_PLANE, cp).map_err(err)?;
        let config = self
            .material(role::EDGE, name)?
            .client_config(expected)
            .map_err(err)?;
        Ok(Arc::new(config))
    }
}
