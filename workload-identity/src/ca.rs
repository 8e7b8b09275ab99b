//! A small workload CA (rcgen): a self-signed CA and SPIFFE workload certificates for the Edge,
//! the Nodes and the Control Plane. `iop-ca` is its command line; `iop-mesh` uses it in memory.
//!
//! - The CA: ECDSA P-256, `CA:true, pathlen:0`, key usages `keyCertSign` and `cRLSign`, subject
//!   `CN=iop workload CA, O=<trust domain>` (the trust domain is read back from there).
//! - A workload certificate: ECDSA P-256, exactly one URI SAN `spiffe://<td>/<role>/<name>`
//!   (what this crate checks), the DNS and IP SANs given (a server needs the name its
//!   clients dial), key usage `digitalSignature`, extended key usages `serverAuth` and
//!   `clientAuth` (an Edge is a server to Nodes and a client of the Control Plane), valid from
//!   five minutes ago (clock skew) for the days given.

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use crate::WorkloadId;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// Why a CA operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CaError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A file exists and `--force` was not given.
    #[error("{0} exists; refusing to overwrite it without --force")]
    Exists(String),
    /// An identity part is invalid.
    #[error("{0}")]
    Identity(String),
    /// Certificate generation or parsing failed.
    #[error("certificate: {0}")]
    Cert(String),
}

fn cert_err(e: impl std::fmt::Display) -> CaError {
    CaError::Cert(e.to_string())
}

/// A certificate and its private key, PEM.
#[derive(Debug)]
pub struct Issued {
    /// The certificate (PEM).
    pub cert_pem: String,
    /// The PKCS#8 private key (PEM).
    pub key_pem: String,
}

/// The CA.
#[derive(Debug)]
pub struct WorkloadCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    trust_domain: String,
}

fn validity(params: &mut CertificateParams, days: u32) {
    let now = std::time::SystemTime::now();
    params.not_before = (now - Duration::from_secs(300)).into();
    params.not_after = (now + Duration::from_secs(u64::from(days) * 86_400)).into();
}

impl WorkloadCa {
    /// A fresh CA for `trust_domain`, valid for `days`.
    pub fn generate(trust_domain: &str, days: u32) -> Result<Self, CaError> {
        // The trust domain must be one a SPIFFE ID can carry.
        WorkloadId::new(trust_domain, "x", "x").map_err(|e| CaError::Identity(e.to_string()))?;
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "iop workload CA");
        params
            .distinguished_name
            .push(DnType::OrganizationName, trust_domain);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        validity(&mut params, days);
        let key = KeyPair::generate().map_err(cert_err)?;
        let issuer = CertifiedIssuer::self_signed(params, key).map_err(cert_err)?;
        let cert_pem = issuer.pem();
        let key_pem = issuer.key().serialize_pem();
        // Re-read as the CLI will, so both paths sign the same way.
        Self::from_pem(&cert_pem, &key_pem)
    }

    /// The CA from its PEM certificate and key (as `iop-ca init` wrote them).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, CaError> {
        let key = KeyPair::from_pem(key_pem).map_err(cert_err)?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key).map_err(cert_err)?;
        let der = rustls_pki_types::CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(cert_err)?;
        let (_, parsed) = x509_parser::parse_x509_certificate(&der).map_err(cert_err)?;
        let trust_domain = parsed
            .subject()
            .iter_organization()
            .next()
            .and_then(|o| o.as_str().ok())
            .ok_or_else(|| CaError::Cert("the CA names no trust domain (O=)".into()))?
            .to_owned();
        Ok(Self {
            issuer,
            cert_pem: cert_pem.to_owned(),
            trust_domain,
        })
    }

    /// Reads `ca.pem` and `ca.key` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, CaError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| CaError::Io {
                path: path.display().to_string(),
                source,
            })
        };
        Self::from_pem(&read("ca.pem")?, &read("ca.key")?)
    }

    /// The CA certificate (PEM): the bundle every workload trusts.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's private key (PEM).
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// The trust domain.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// A workload certificate for `spiffe://<td>/<role>/<name>` with `dns` and `ips` SANs.
    pub fn issue(
        &self,
        role: &str,
        name: &str,
        dns: &[String],
        ips: &[IpAddr],
        days: u32,
    ) -> Result<Issued, CaError> {
        let id = WorkloadId::new(&self.trust_domain, role, name)
            .map_err(|e| CaError::Identity(e.to_string()))?;
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params
            .subject_alt_names
            .push(SanType::URI(id.as_str().try_into().map_err(cert_err)?));
        for d in dns {
            params.subject_alt_names.push(SanType::DnsName(
                d.as_str()
                    .try_into()
                    .map_err(|_| CaError::Identity(format!("`{d}` is not a DNS name")))?,
            ));
        }
        for ip in ips {
            params.subject_alt_names.push(SanType::IpAddress(*ip));
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        validity(&mut params, days);
        let key = KeyPair::generate().map_err(cert_err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(cert_err)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

use rustls_pki_types::pem::PemObject as _;

/// Writes `bytes` to `path` with mode 0600, refusing to replace an existing file unless
/// `force`. The bytes go to a temporary file in the same directory that is renamed over
/// `path`, so a process watching the file never reads half of it.
pub fn write_private(path: &Path, bytes: &[u8], force: bool) -> Result<(), CaError> {
    use std::io::Write as _;
    let shown = path.display().to_string();
    if !force && path.exists() {
        return Err(CaError::Exists(shown));
    }
    let io = |source| CaError::Io {
        path: shown.clone(),
        source,
    };
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
    let tmp = match dir {
        Some(d) => d.join(format!(".{}.tmp", std::process::id())),
        None => std::path::PathBuf::from(format!(".{}.tmp", std::process::id())),
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        opts.mode(0o600);
    }
    let mut f = opts.open(&tmp).map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_carry_the_identity_and_verify_against_the_ca() {
        let ca = WorkloadCa::generate("iop.example", 30).unwrap();
        let again = WorkloadCa::from_pem(ca.cert_pem(), &ca.key_pem()).unwrap();
        assert_eq!(again.trust_domain(), "iop.example");
        let issued = again
            .issue(
                "edge",
                "edge-1",
                &["edge.example".into()],
                &["127.0.0.1".parse().unwrap()],
                1,
            )
            .unwrap();
        let tls = crate::WorkloadTls::from_pem(
            ca.cert_pem().as_bytes(),
            issued.cert_pem.as_bytes(),
            issued.key_pem.as_bytes(),
        )
        .unwrap();
        assert_eq!(tls.identity().as_str(), "spiffe://iop.example/edge/edge-1");
        let der =
            rustls_pki_types::CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap();
        let (_, parsed) = x509_parser::parse_x509_certificate(&der).unwrap();
        let lifetime =
            parsed.validity().not_after.timestamp() - parsed.validity().not_before.timestamp();
        assert_eq!(lifetime, 86_400 + 300);
        assert!(ca.issue("edge", "bad/name", &[], &[], 1).is_err());
        assert!(WorkloadCa::generate("Not A Domain", 1).is_err());
    }

    #[test]
    fn private_files_are_0600_and_never_overwritten_without_force() {
        let dir = std::env::temp_dir().join(format!("iop-ca-write-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.key");
        write_private(&f, b"one", false).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            assert_eq!(
                std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
        let e = write_private(&f, b"two", false).unwrap_err().to_string();
        assert!(
            e.ends_with("exists; refusing to overwrite it without --force"),
            "{e}"
        );
        assert_eq!(std::fs::read(&f).unwrap(), b"one");
        write_private(&f, b"two", true).unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"two");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
