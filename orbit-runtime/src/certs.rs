//! Certificates for Node endpoints (seed `003`, "Certificates"): CSR validation and issuance
//! through ACME DNS-01 with a real ACME client (`instant-acme`, *ring*).
//!
//! - [`validate_csr`]: the CSR's self-signature verifies; it names at least one DNS name, every
//!   name (subject alternative names, and the common name if any) is one of the Node's endpoint
//!   names; its key is ECDSA P-256 or P-384, or RSA of at least 2048 bits (what public ACME CAs
//!   accept). Each failure is its own [`CsrError`].
//! - [`AcmeIssuer::issue`]: a new order for the names; for each authorization the DNS-01
//!   `_acme-challenge.<name>` TXT value is written through the [`TxtProvider`]; challenges are
//!   marked ready; the order is polled, finalized with the Runtime's CSR (the private key never
//!   leaves the Runtime) and the chain downloaded. Every TXT value written is then deleted —
//!   exactly that value, on success and on failure alike.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use instant_acme::{
    Account, AuthorizationStatus, ChallengeType, Identifier, NewAccount, NewOrder, OrderStatus,
    RetryPolicy,
};
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::FromDer as _;

use crate::dns::TxtProvider;

/// Why a CSR was refused (HTTP 400; nothing of the CSR is echoed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CsrError {
    /// Not a DER/PEM certification request.
    #[error("csr does not parse")]
    Parse,
    /// The self-signature does not verify.
    #[error("csr signature invalid")]
    Signature,
    /// No DNS name requested.
    #[error("csr names no dns name")]
    NoNames,
    /// A requested name is not one of the Node's endpoints.
    #[error("csr names a host that is not this node's endpoint")]
    ForeignName,
    /// The key type or size is not accepted.
    #[error("csr key not accepted")]
    Key,
}

/// Why issuance failed (no CA or DNS detail).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IssueError {
    /// The ACME server refused or failed.
    #[error("acme issuance failed: {0}")]
    Acme(&'static str),
    /// The DNS provider failed.
    #[error("dns provider failed")]
    Dns,
}

/// PEM (`CERTIFICATE REQUEST`) or DER to DER.
pub fn csr_der(input: &[u8]) -> Result<Vec<u8>, CsrError> {
    let text = std::str::from_utf8(input).ok();
    match text.and_then(|t| {
        t.trim_start()
            .strip_prefix("-----BEGIN CERTIFICATE REQUEST-----")
    }) {
        Some(rest) => {
            let body = rest
                .split("-----END CERTIFICATE REQUEST-----")
                .next()
                .ok_or(CsrError::Parse)?;
            let b64: String = body.chars().filter(|c| !c.is_whitespace()).collect();
            base64::Engine::decode(&base64::engine::general_purpose::STANDARD, b64)
                .map_err(|_| CsrError::Parse)
        }
        None => Ok(input.to_vec()),
    }
}

const OID_EC: &str = "1.2.840.10045.2.1";
const OID_RSA: &str = "1.2.840.113549.1.1.1";
const OID_P256: &str = "1.2.840.10045.3.1.7";
const OID_P384: &str = "1.3.132.0.34";

/// Checks a CSR (DER) against the Node's endpoint names; returns the requested names.
pub fn validate_csr(der: &[u8], endpoints: &[String]) -> Result<Vec<String>, CsrError> {
    let (rest, csr) = X509CertificationRequest::from_der(der).map_err(|_| CsrError::Parse)?;
    if !rest.is_empty() {
        return Err(CsrError::Parse);
    }
    csr.verify_signature().map_err(|_| CsrError::Signature)?;
    let info = &csr.certification_request_info;
    let spki = &info.subject_pki;
    let alg = spki.algorithm.algorithm.to_id_string();
    let key_ok = match alg.as_str() {
        OID_EC => spki
            .algorithm
            .parameters
            .as_ref()
            .and_then(|p| p.as_oid().ok())
            .is_some_and(|curve| {
                let c = curve.to_id_string();
                c == OID_P256 || c == OID_P384
            }),
        OID_RSA => match spki.parsed() {
            Ok(x509_parser::public_key::PublicKey::RSA(rsa)) => rsa.key_size() >= 2048,
            _ => false,
        },
        _ => false,
    };
    if !key_ok {
        return Err(CsrError::Key);
    }
    let mut names: Vec<String> = Vec::new();
    if let Some(exts) = csr.requested_extensions() {
        for ext in exts {
            if let ParsedExtension::SubjectAlternativeName(san) = ext {
                for n in &san.general_names {
                    match n {
                        GeneralName::DNSName(d) => names.push(d.to_ascii_lowercase()),
                        // Only DNS names can be validated with DNS-01.
                        _ => return Err(CsrError::ForeignName),
                    }
                }
            }
        }
    }
    for cn in info.subject.iter_common_name() {
        let cn = cn
            .as_str()
            .map_err(|_| CsrError::Parse)?
            .to_ascii_lowercase();
        if !names.contains(&cn) {
            names.push(cn);
        }
    }
    if names.is_empty() {
        return Err(CsrError::NoNames);
    }
    let allowed: Vec<String> = endpoints
        .iter()
        .map(|e| e.trim_end_matches('.').to_ascii_lowercase())
        .collect();
    if names.iter().any(|n| !allowed.contains(n)) {
        return Err(CsrError::ForeignName);
    }
    names.sort();
    names.dedup();
    Ok(names)
}

/// An ACME account and the DNS provider that answers its DNS-01 challenges.
pub struct AcmeIssuer {
    account: Account,
    txt: Arc<dyn TxtProvider>,
    retry: RetryPolicy,
}

impl std::fmt::Debug for AcmeIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcmeIssuer").finish_non_exhaustive()
    }
}

impl AcmeIssuer {
    /// Creates an account at `directory_url` (terms of service agreed). `root_pem` is an extra
    /// trust root for the ACME server's own HTTPS certificate (test CAs such as pebble's).
    pub async fn new(
        directory_url: &str,
        root_pem: Option<&Path>,
        txt: Arc<dyn TxtProvider>,
    ) -> Result<Self, IssueError> {
        let builder = match root_pem {
            Some(p) => Account::builder_with_root(p),
            None => Account::builder(),
        }
        .map_err(|_| IssueError::Acme("client"))?;
        let (account, _credentials) = builder
            .create(
                &NewAccount {
                    contact: &[],
                    terms_of_service_agreed: true,
                    only_return_existing: false,
                },
                directory_url.to_owned(),
                None,
            )
            .await
            .map_err(|_| IssueError::Acme("account"))?;
        Ok(Self {
            account,
            txt,
            retry: RetryPolicy::new()
                .initial_delay(Duration::from_millis(250))
                .timeout(Duration::from_secs(60)),
        })
    }

    /// Issues a certificate for `names` with the Runtime's CSR; returns the PEM chain.
    pub async fn issue(&self, names: &[String], csr_der: &[u8]) -> Result<String, IssueError> {
        let identifiers: Vec<Identifier> =
            names.iter().map(|n| Identifier::Dns(n.clone())).collect();
        let mut written: Vec<(String, String)> = Vec::new();
        let result = self.issue_inner(&identifiers, csr_der, &mut written).await;
        // Clean up exactly the TXT values we wrote, whatever happened.
        for (name, value) in written {
            if self.txt.delete_txt(&name, &value).await.is_err() {
                tracing::warn!(target: "orbit_runtime", event = "orbit_acme_txt_cleanup_failed", "challenge TXT record not removed");
            }
        }
        result
    }

    async fn issue_inner(
        &self,
        identifiers: &[Identifier],
        csr_der: &[u8],
        written: &mut Vec<(String, String)>,
    ) -> Result<String, IssueError> {
        let mut order = self
            .account
            .new_order(&NewOrder::new(identifiers))
            .await
            .map_err(|_| IssueError::Acme("order"))?;
        let mut authorizations = order.authorizations();
        while let Some(authz) = authorizations.next().await {
            let mut authz = authz.map_err(|_| IssueError::Acme("authorization"))?;
            match authz.status {
                AuthorizationStatus::Valid => continue,
                AuthorizationStatus::Pending => {}
                _ => return Err(IssueError::Acme("authorization state")),
            }
            let mut challenge = authz
                .challenge(ChallengeType::Dns01)
                .ok_or(IssueError::Acme("no dns-01 challenge"))?;
            let Identifier::Dns(host) = challenge.identifier().identifier else {
                return Err(IssueError::Acme("non-dns identifier"));
            };
            let name = format!("_acme-challenge.{host}");
            let value = challenge.key_authorization().dns_value();
            self.txt
                .add_txt(&name, &value)
                .await
                .map_err(|_| IssueError::Dns)?;
            written.push((name, value));
            challenge
                .set_ready()
                .await
                .map_err(|_| IssueError::Acme("challenge"))?;
        }
        let status = order
            .poll_ready(&self.retry)
            .await
            .map_err(|_| IssueError::Acme("validation"))?;
        if status != OrderStatus::Ready {
            return Err(IssueError::Acme("order not ready"));
        }
        order
            .finalize_csr(csr_der)
            .await
            .map_err(|_| IssueError::Acme("finalize"))?;
        order
            .poll_certificate(&self.retry)
            .await
            .map_err(|_| IssueError::Acme("certificate"))
    }
}
