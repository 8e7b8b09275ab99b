//! An ephemeral, in-memory development CA: every [`DevCa::new`] makes a fresh CA, and each
//! call hands out a SPIFFE workload identity (`spiffe://iop.local/<role>/<name>`, DNS
//! `localhost`, IP 127.0.0.1) as ready rustls configs or as [`WorkloadTls`], so a demo or an
//! embedding example runs mutual TLS with no file on disk. The certificates are the ones
//! `iop-ca` issues ([`crate::ca`]). Not for production: the CA key lives in memory and the
//! certificates are valid for a year.
//!
//! ```
//! let ca = workload_identity::dev_ca::DevCa::new().unwrap();
//! let edge = ca.edge_tls("edge-1").unwrap();       // the Edge's Node listener
//! let node = ca.node_tls("node-1", "edge-1").unwrap(); // a Node dialling it
//! # let _ = (edge, node);
//! ```

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use crate::{ExpectedPeer, WorkloadTls, role};

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

    /// The trust domain ([`TRUST_DOMAIN`]).
    pub fn trust_domain(&self) -> &str {
        TRUST_DOMAIN
    }

    /// The CA certificate (PEM), for a peer outside this process.
    pub fn ca_pem(&self) -> &str {
        self.ca.cert_pem()
    }

    /// A fresh certificate and key (PEM) for workload `role/name`: what a rotation hands to
    /// [`WorkloadTls::reload_pem`], or what a peer in another process loads from files.
    pub fn issue_pem(&self, role: &str, name: &str) -> Result<(String, String), DevCaError> {
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
        Ok((issued.cert_pem, issued.key_pem))
    }

    /// The replaceable material of workload `role/name` (see [`role`]), for an API that takes
    /// a [`WorkloadTls`] (the Edge's and the Node's configs do).
    pub fn material(&self, role: &str, name: &str) -> Result<Arc<WorkloadTls>, DevCaError> {
        let (cert, key) = self.issue_pem(role, name)?;
        WorkloadTls::from_pem(
            self.ca.cert_pem().as_bytes(),
            cert.as_bytes(),
            key.as_bytes(),
        )
        .map_err(err)
    }

    /// The Edge's server TLS: identity `edge/<name>`, accepting any Node of this CA.
    pub fn edge_tls(&self, name: &str) -> Result<Arc<rustls::ServerConfig>, DevCaError> {
        self.server(
            role::EDGE,
            name,
            ExpectedPeer::any_name(TRUST_DOMAIN, role::NODE),
        )
    }

    /// A Node's client TLS: identity `node/<name>`, expecting the Edge `edge/<edge>`.
    pub fn node_tls(
        &self,
        name: &str,
        edge: &str,
    ) -> Result<Arc<rustls::ClientConfig>, DevCaError> {
        self.client(
            role::NODE,
            name,
            ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, edge),
        )
    }

    /// A Control Plane's server TLS: identity `control-plane/<name>`, accepting any Edge of
    /// this CA.
    pub fn control_plane_tls(&self, name: &str) -> Result<Arc<rustls::ServerConfig>, DevCaError> {
        self.server(
            role::CONTROL_PLANE,
            name,
            ExpectedPeer::any_name(TRUST_DOMAIN, role::EDGE),
        )
    }

    /// An Edge's client TLS to its Control Plane: identity `edge/<name>`, expecting
    /// `control-plane/<cp>`.
    pub fn edge_client_tls(
        &self,
        name: &str,
        cp: &str,
    ) -> Result<Arc<rustls::ClientConfig>, DevCaError> {
        self.client(
            role::EDGE,
            name,
            ExpectedPeer::exact(TRUST_DOMAIN, role::CONTROL_PLANE, cp),
        )
    }

    fn server(
        &self,
        role: &str,
        name: &str,
        expected: Result<ExpectedPeer, crate::IdentityError>,
    ) -> Result<Arc<rustls::ServerConfig>, DevCaError> {
        let config = self
            .material(role, name)?
            .server_config(expected.map_err(err)?)
            .map_err(err)?;
        Ok(Arc::new(config))
    }

    fn client(
        &self,
        role: &str,
        name: &str,
        expected: Result<ExpectedPeer, crate::IdentityError>,
    ) -> Result<Arc<rustls::ClientConfig>, DevCaError> {
        let config = self
            .material(role, name)?
            .client_config(expected.map_err(err)?)
            .map_err(err)?;
        Ok(Arc::new(config))
    }
}
