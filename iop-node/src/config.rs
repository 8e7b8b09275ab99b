//! The Node's configuration file (TOML) and its strict validation.
//!
//! ```toml
//! node_id = "node-1"            # must equal the name in the Node's workload certificate
//!
//! [edge]
//! address = "edge.internal:7443" # host:port the Node dials
//! server_name = "edge.internal" # DNS name or IP the Edge certificate must carry
//! name = "edge-1"               # the Edge's workload name (spiffe://<trust_domain>/edge/<name>)
//!
//! # or, to serve several Edges at once (one session each; see the crate docs), instead of [edge]:
//! # [[edges]]
//! # address = "edge-1.internal:7443"
//! # server_name = "edge-1.internal"
//! # name = "edge-1"
//! # [[edges]]
//! # address = "edge-2.internal:7443"
//! # server_name = "edge-2.internal"
//! # name = "edge-2"
//!
//! [tls]
//! trust_domain = "iop.local"
//! ca = "/etc/iop/ca.pem"        # PEM bundle of the workload CA
//! cert = "/etc/iop/node.pem"    # PEM chain, leaf first (URI SAN spiffe://<td>/node/<node_id>)
//! key = "/etc/iop/node.key"     # PEM PKCS#8 private key
//! reload_sec = 5                # re-read the three files this often (0 = never): a rotated
//!                               # certificate is used from the next connection on
//!
//! [reconnect]                   # seed 000 semantics
//! interval_sec = 10             # omitted = 10; must be > 0 when max_attempts = 0
//! max_attempts = 10             # omitted = 10; 0 = unlimited until shutdown; < 0 is an error
//!
//! [runtime]
//! close_grace_ms = 2000         # after a response stall, how long the provider may take to return
//!
//! [credential_plane]            # managed mode (seeds 000/001); omitted = disabled
//! enabled = true
//! recipient_key = "/var/lib/iop/node-1.x25519.pem" # X25519 PKCS#8 PEM; created (0600) if missing
//! recipient_key_id = "node-1-key-1"                # announced at registration, bound in leases
//! [[credential_plane.issuers]]  # the Control Plane's lease issuer keys (several for rotation)
//! public_key = "/etc/iop/cp-issuer.pub.pem"        # `iop-cp issuer-key` prints it
//! # key_id = "p256:…"   optional: derived from the key; if given it must match
//!
//! [telemetry]                   # OpenTelemetry tracing (iop_telemetry); omitted = the OTEL_*
//! otlp_endpoint = "http://127.0.0.1:4318" #   variables, and off when they name no collector
//!
//! [[credentials]]               # legacy mode only: upstream keys this Node holds itself
//! adapter = "openai"            # the adapter instance name in the Edge's config
//! api_key_env = "OPENAI_API_KEY" # or api_key_file = "/etc/iop/openai.key" (not world-readable)
//! # header = "x-api-key"        # optional; default: the instance's protocol profile's auth
//! # prefix = ""                 #   header (Authorization: Bearer; x-api-key for `anthropic`)
//! ```
//!
//! Unknown keys are errors. Every error names the key it is about, and none prints key material.
//! A key is read once at startup, stays in this process's memory only (zeroized on exit), and
//! is written into the upstream request right before it leaves; it never goes to the Edge, a
//! log line or a metric. `[[credentials]]` together with `[credential_plane] enabled = true` is
//! refused: a managed Node takes credentials only from leases.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use iop_wire::reconnect::ReconnectPolicy;
use serde::Deserialize;
use workload_identity::{ExpectedPeer, MaterialError, WorkloadTls, role};

use crate::{AdapterRegistry, NodeOptions};

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfigFile {
    /// `node_id`.
    pub node_id: String,
    /// `[edge]`: the one Edge (or use [`NodeConfigFile::edges`]).
    #[serde(default)]
    pub edge: Option<EdgeSection>,
    /// `[[edges]]`: several Edges, served at once.
    #[serde(default)]
    pub edges: Vec<EdgeSection>,
    /// `[tls]`.
    pub tls: TlsSection,
    /// `[reconnect]`.
    #[serde(default)]
    pub reconnect: ReconnectSection,
    /// `[runtime]`.
    #[serde(default)]
    pub runtime: RuntimeSection,
    /// `[credential_plane]`.
    #[serde(default)]
    pub credential_plane: CredentialPlaneSection,
    /// `[[credentials]]`.
    #[serde(default)]
    pub credentials: Vec<CredentialEntry>,
    /// `[telemetry]`: OpenTelemetry tracing ([`iop_telemetry::TelemetryToml`]); the `OTEL_*`
    /// variables fill what it leaves out, and tracing is off when neither names a collector.
    #[serde(default)]
    pub telemetry: iop_telemetry::TelemetryToml,
}

/// One `[[credentials]]` entry: an upstream key this Node holds for one adapter instance.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialEntry {
    /// `credentials.adapter`: the instance name in the Edge's config.
    pub adapter: String,
    /// `credentials.api_key_env`.
    pub api_key_env: Option<String>,
    /// `credentials.api_key_file`.
    pub api_key_file: Option<PathBuf>,
    /// `credentials.header`.
    pub header: Option<String>,
    /// `credentials.prefix` (with `header`).
    pub prefix: Option<String>,
}

impl CredentialEntry {
    fn load(&self) -> Result<crate::credential::LocalKey, ConfigError> {
        use crate::credential::LocalKey;
        let key = match (&self.api_key_env, &self.api_key_file) {
            (Some(var), None) => LocalKey::from_env(var)
                .map_err(|e| invalid("credentials.api_key_env", e.to_string()))?,
            (None, Some(path)) => LocalKey::from_file(path)
                .map_err(|e| invalid("credentials.api_key_file", e.to_string()))?,
            _ => {
                return Err(invalid(
                    "credentials",
                    format!(
                        "adapter `{}`: exactly one of api_key_env and api_key_file is required",
                        self.adapter
                    ),
                ));
            }
        };
        match (&self.header, &self.prefix) {
            (Some(h), p) => key
                .with_header(h, p.as_deref().unwrap_or(""))
                .map_err(|e| invalid("credentials.header", e.to_string())),
            (None, Some(_)) => Err(invalid("credentials.prefix", "needs credentials.header")),
            (None, None) => Ok(key),
        }
    }
}

/// `[credential_plane]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialPlaneSection {
    /// `credential_plane.enabled`.
    #[serde(default)]
    pub enabled: bool,
    /// `credential_plane.recipient_key`.
    pub recipient_key: Option<PathBuf>,
    /// `credential_plane.recipient_key_id`.
    pub recipient_key_id: Option<String>,
    /// `credential_plane.issuers`.
    #[serde(default)]
    pub issuers: Vec<IssuerEntry>,
}

/// One `[[credential_plane.issuers]]` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IssuerEntry {
    /// `key_id`: optional. The id is derived from the key (`iop_lease::issuer_key_id`, what
    /// `iop-cp issuer-key` prints); when given it must equal that id, so a key pinned under
    /// the wrong id is refused at startup instead of failing every lease.
    #[serde(default)]
    pub key_id: Option<String>,
    /// `public_key`: a PEM file.
    pub public_key: PathBuf,
}

impl CredentialPlaneSection {
    /// The recipient (key + pinned issuers), when enabled.
    fn recipient(&self) -> Result<Option<iop_lease::Recipient>, ConfigError> {
        if !self.enabled {
            return Ok(None);
        }
        let path = self
            .recipient_key
            .as_ref()
            .ok_or_else(|| invalid("credential_plane.recipient_key", "required when enabled"))?;
        let key_id = self
            .recipient_key_id
            .as_deref()
            .ok_or_else(|| invalid("credential_plane.recipient_key_id", "required when enabled"))?;
        let key = match std::fs::read_to_string(path) {
            Ok(pem) => iop_lease::RecipientSecretKey::from_pem(key_id, &pem)
                .map_err(|e| invalid("credential_plane.recipient_key", e.to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = iop_lease::RecipientSecretKey::generate(key_id)
                    .map_err(|e| invalid("credential_plane.recipient_key_id", e.to_string()))?;
                write_private(path, key.to_pem().as_bytes()).map_err(|e| {
                    invalid(
                        "credential_plane.recipient_key",
                        format!("cannot create {}: {e}", path.display()),
                    )
                })?;
                key
            }
            Err(e) => {
                return Err(invalid(
                    "credential_plane.recipient_key",
                    format!("cannot read {}: {e}", path.display()),
                ));
            }
        };
        if self.issuers.is_empty() {
            return Err(invalid(
                "credential_plane.issuers",
                "at least one issuer public key is required when enabled",
            ));
        }
        let mut trusted = iop_lease::TrustedIssuers::new();
        for issuer in &self.issuers {
            let pem = std::fs::read_to_string(&issuer.public_key).map_err(|e| {
                invalid(
                    "credential_plane.issuers.public_key",
                    format!("cannot read {}: {e}", issuer.public_key.display()),
                )
            })?;
            let k = iop_lease::IssuerPublicKey::from_pem_derived(&pem)
                .map_err(|e| invalid("credential_plane.issuers.public_key", e.to_string()))?;
            if let Some(id) = issuer.key_id.as_deref().filter(|id| *id != k.key_id()) {
                return Err(invalid(
                    "credential_plane.issuers.key_id",
                    format!(
                        "{id:?} is not the id of {} (its id is {:?}, as `iop-cp issuer-key` prints); remove key_id or set it to that",
                        issuer.public_key.display(),
                        k.key_id()
                    ),
                ));
            }
            trusted.insert(k);
        }
        Ok(Some(iop_lease::Recipient::new(
            key,
            trusted,
            iop_lease::OpenPolicy::default(),
        )))
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        opts.mode(0o600);
    }
    let mut f = opts.open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// `[edge]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeSection {
    /// `edge.address`.
    pub address: String,
    /// `edge.server_name`.
    pub server_name: String,
    /// `edge.name`.
    pub name: String,
}

/// `[tls]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    /// `tls.trust_domain`.
    pub trust_domain: String,
    /// `tls.ca`.
    pub ca: PathBuf,
    /// `tls.cert`.
    pub cert: PathBuf,
    /// `tls.key`.
    pub key: PathBuf,
    /// `tls.reload_sec`: re-read the three files this often (default 5; 0 = never).
    #[serde(default = "default_reload")]
    pub reload_sec: u64,
}

fn default_reload() -> u64 {
    5
}

/// The Node's options with its TLS material and files (see [`NodeConfigFile::build`]).
#[derive(Debug)]
pub struct NodeBuilt {
    /// The options for [`crate::run_node`].
    pub options: NodeOptions,
    /// The TLS material the options' client configuration reads at every handshake.
    pub tls: Arc<WorkloadTls>,
    /// `tls.ca`.
    pub ca: PathBuf,
    /// `tls.cert`.
    pub cert: PathBuf,
    /// `tls.key`.
    pub key: PathBuf,
    /// `tls.reload_sec`; `None` = never.
    pub reload: Option<Duration>,
    /// Tracing settings: start them with [`iop_telemetry::Telemetry::start`] and put the
    /// result in [`NodeOptions::telemetry`] (the `iop-node` binary does).
    pub telemetry: iop_telemetry::TelemetryConfig,
}

/// `[reconnect]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconnectSection {
    /// `reconnect.interval_sec`.
    pub interval_sec: Option<i64>,
    /// `reconnect.max_attempts`.
    pub max_attempts: Option<i64>,
}

/// `[runtime]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeSection {
    /// `runtime.close_grace_ms`.
    pub close_grace_ms: Option<u64>,
}

/// A configuration error. The text names the key (or file) it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML did not parse or had unknown/missing keys (toml's message names them).
    #[error("{0}")]
    Syntax(String),
    /// A key had an invalid value.
    #[error("{key}: {message}")]
    Invalid {
        /// The key, e.g. `reconnect.max_attempts`.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
}

fn invalid(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        message: message.into(),
    }
}

fn read(key: &'static str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))
}

impl NodeConfigFile {
    /// `[[credentials]]`, loaded: refused with the credential plane, one entry per adapter.
    fn local_keys(&self) -> Result<Vec<(String, crate::credential::LocalKey)>, ConfigError> {
        if self.credential_plane.enabled && !self.credentials.is_empty() {
            return Err(invalid(
                "credentials",
                "not allowed with credential_plane.enabled: a managed Node takes upstream credentials only from Control Plane leases",
            ));
        }
        let mut keys = Vec::with_capacity(self.credentials.len());
        for entry in &self.credentials {
            if keys.iter().any(|(a, _)| *a == entry.adapter) {
                return Err(invalid(
                    "credentials.adapter",
                    format!("adapter `{}` has more than one entry", entry.adapter),
                ));
            }
            keys.push((entry.adapter.clone(), entry.load()?));
        }
        Ok(keys)
    }

    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Parses TOML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let file: Self = toml::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        match (&file.edge, file.edges.is_empty()) {
            (None, true) => Err(ConfigError::Syntax(
                "missing [edge] (or [[edges]]): the Edge this Node serves".to_owned(),
            )),
            (Some(_), false) => Err(ConfigError::Syntax(
                "[edge] and [[edges]] together: write the one Edge as [edge], or every Edge as [[edges]]"
                    .to_owned(),
            )),
            _ => Ok(file),
        }
    }

    /// Every Edge the file names, the first first.
    fn edge_sections(&self) -> Vec<&EdgeSection> {
        self.edge.iter().chain(&self.edges).collect()
    }

    /// Validates every key and builds the Node's options (reads the TLS files).
    pub fn into_options(self, adapters: AdapterRegistry) -> Result<NodeOptions, ConfigError> {
        self.build(adapters).map(|b| b.options)
    }

    /// As [`NodeConfigFile::into_options`], also returning the TLS material and where it comes
    /// from, for a caller that reloads it (the `iop-node` binary does, every
    /// `tls.reload_sec`).
    pub fn build(self, adapters: AdapterRegistry) -> Result<NodeBuilt, ConfigError> {
        let local_keys = self.local_keys()?;
        let telemetry = self
            .telemetry
            .to_config()
            .map_err(|e| invalid("telemetry", e.to_string()))?;
        let reconnect =
            ReconnectPolicy::from_config(self.reconnect.interval_sec, self.reconnect.max_attempts)
                .map_err(|e| {
                    let key = if e.to_string().contains("max_attempts")
                        && !e.to_string().contains("interval")
                    {
                        "reconnect.max_attempts"
                    } else {
                        "reconnect.interval_sec"
                    };
                    invalid(key, e.to_string())
                })?;
        let sections = self.edge_sections();
        let (name_key, server_key) = if self.edge.is_some() {
            ("edge.name", "edge.server_name")
        } else {
            ("edges.name", "edges.server_name")
        };
        let (mut names, mut addresses) = (
            std::collections::HashSet::new(),
            std::collections::HashSet::new(),
        );
        for e in &sections {
            if !names.insert(e.name.as_str()) || !addresses.insert(e.address.as_str()) {
                return Err(invalid(
                    "edges",
                    format!("edge `{}` ({}) is named twice", e.name, e.address),
                ));
            }
        }
        let first = sections
            .first()
            .ok_or_else(|| invalid("edge", "missing [edge] (or [[edges]])"))?;
        let expected = |e: &EdgeSection| {
            ExpectedPeer::exact(&self.tls.trust_domain, role::EDGE, &e.name)
                .map_err(|err| invalid(name_key, err.to_string()))
        };
        let first_expected = expected(first)?;
        let ca = read("tls.ca", &self.tls.ca)?;
        let cert = read("tls.cert", &self.tls.cert)?;
        let key = read("tls.key", &self.tls.key)?;
        let material = WorkloadTls::from_pem(&ca, &cert, &key).map_err(|e| {
            let key = match e {
                MaterialError::Ca(_) => "tls.ca",
                MaterialError::Key(_) => "tls.key",
                _ => "tls.cert",
            };
            invalid(key, e.to_string())
        })?;
        let own = material.identity();
        if own.role() != role::NODE
            || own.name() != self.node_id
            || own.trust_domain() != self.tls.trust_domain
        {
            return Err(invalid(
                "tls.cert",
                format!(
                    "certificate identity {own} is not spiffe://{}/node/{} (tls.trust_domain, node_id)",
                    self.tls.trust_domain, self.node_id
                ),
            ));
        }
        let tls = material
            .client_config(first_expected)
            .map_err(|e| invalid("tls.ca", e.to_string()))?;
        let server_name_error = || invalid(server_key, "not a valid DNS name or IP address");
        let mut opts = NodeOptions::new(
            &self.node_id,
            &first.address,
            &first.server_name,
            Arc::new(tls),
        )
        .map_err(|e| match e {
            crate::OptionsError::NodeId => {
                invalid("node_id", "must be 1-128 characters of A-Z a-z 0-9 . _ -")
            }
            crate::OptionsError::ServerName => server_name_error(),
        })?
        .with_adapters(adapters)
        .with_reconnect(reconnect);
        for e in sections.iter().skip(1) {
            let tls = material
                .client_config(expected(e)?)
                .map_err(|err| invalid("tls.ca", err.to_string()))?;
            opts = opts
                .with_edge(&e.address, &e.server_name, Arc::new(tls))
                .map_err(|_| server_name_error())?;
        }
        if let Some(ms) = self.runtime.close_grace_ms {
            opts.close_grace = Duration::from_millis(ms);
        }
        for (adapter, key) in local_keys {
            opts = opts.with_local_key(&adapter, key);
        }
        if let Some(recipient) = self.credential_plane.recipient()? {
            opts = opts.with_credential_plane(recipient);
        }
        let reload = (self.tls.reload_sec > 0).then(|| Duration::from_secs(self.tls.reload_sec));
        Ok(NodeBuilt {
            options: opts,
            tls: material,
            ca: self.tls.ca,
            cert: self.tls.cert,
            key: self.tls.key,
            reload,
            telemetry,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_missing_keys_are_named() {
        let e = NodeConfigFile::parse("node_id = \"n\"\nbogus = 1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
        let e = NodeConfigFile::parse("node_id = \"n\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("tls"), "{e}");
        let e = NodeConfigFile::parse(
            "node_id = \"n\"\n[tls]\ntrust_domain = \"t\"\nca = \"/c\"\ncert = \"/x\"\nkey = \"/y\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("[edge]"), "{e}");
    }

    /// `[[edges]]` names several Edges; `[edge]` with it, or an Edge named twice, is an error.
    #[test]
    fn several_edges_are_written_as_edges_tables() {
        let tls =
            "[tls]\ntrust_domain = \"t\"\nca = \"/nonexistent\"\ncert = \"/x\"\nkey = \"/y\"\n";
        let edge = |name: &str, port: u16| {
            format!(
                "[[edges]]\naddress = \"127.0.0.1:{port}\"\nserver_name = \"localhost\"\nname = \"{name}\"\n"
            )
        };
        let two = format!("node_id = \"n\"\n{}{}{tls}", edge("e1", 1), edge("e2", 2));
        let file = NodeConfigFile::parse(&two).unwrap();
        assert!(file.edge.is_none());
        assert_eq!(file.edges.len(), 2);
        // Past parsing, the first file read is the CA: the Edges were accepted.
        let e = file
            .into_options(AdapterRegistry::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("tls.ca"), "{e}");
        let both = format!(
            "node_id = \"n\"\n[edge]\naddress = \"a:1\"\nserver_name = \"localhost\"\nname = \"e\"\n{}{tls}",
            edge("e1", 1)
        );
        let e = NodeConfigFile::parse(&both).unwrap_err().to_string();
        assert!(e.contains("[edge] and [[edges]]"), "{e}");
        let twice = format!("node_id = \"n\"\n{}{}{tls}", edge("e1", 1), edge("e1", 2));
        let e = NodeConfigFile::parse(&twice)
            .unwrap()
            .into_options(AdapterRegistry::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("edges") && e.contains("named twice"), "{e}");
    }

    #[test]
    fn credential_plane_keys_are_checked_and_the_recipient_key_created() {
        let dir = std::env::temp_dir().join(format!("iop-node-cp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let section = |extra: &str| -> CredentialPlaneSection {
            toml::from_str(&format!("enabled = true\n{extra}")).unwrap()
        };
        let e = section("").recipient().unwrap_err().to_string();
        assert!(e.starts_with("credential_plane.recipient_key:"), "{e}");
        let key = dir.join("node.x25519.pem");
        let base = format!(
            "recipient_key = {:?}\nrecipient_key_id = \"node-1-key\"\n",
            key.display().to_string()
        );
        let e = section(&base).recipient().unwrap_err().to_string();
        assert!(e.starts_with("credential_plane.issuers:"), "{e}");
        let issuer = iop_lease::IssuerSigningKey::generate_derived().unwrap();
        let issuer_pem = dir.join("issuer.pub.pem");
        std::fs::write(&issuer_pem, issuer.public_key().to_pem()).unwrap();
        // An id that is not the key's is refused at startup, naming the right one.
        let wrong = format!(
            "{base}[[issuers]]\nkey_id = \"cp-issuer-1\"\npublic_key = {:?}\n",
            issuer_pem.display().to_string()
        );
        let e = section(&wrong).recipient().unwrap_err().to_string();
        assert!(
            e.starts_with("credential_plane.issuers.key_id:") && e.contains(issuer.key_id()),
            "{e}"
        );
        let explicit = format!(
            "{base}[[issuers]]\nkey_id = {:?}\npublic_key = {:?}\n",
            issuer.key_id(),
            issuer_pem.display().to_string()
        );
        section(&explicit).recipient().unwrap().unwrap();
        let full = format!(
            "{base}[[issuers]]\npublic_key = {:?}\n",
            issuer_pem.display().to_string()
        );
        let first = section(&full).recipient().unwrap().unwrap().public_key();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&key).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // The same key on the next start.
        let again = section(&full).recipient().unwrap().unwrap().public_key();
        assert_eq!(first.as_bytes(), again.as_bytes());
        assert!(
            CredentialPlaneSection::default()
                .recipient()
                .unwrap()
                .is_none(),
            "disabled by default"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn local_credentials_are_checked_and_never_printed() {
        let base = "node_id = \"n\"\n[edge]\naddress = \"a:1\"\nserver_name = \"localhost\"\nname = \"e\"\n[tls]\ntrust_domain = \"t\"\nca = \"/nonexistent\"\ncert = \"/x\"\nkey = \"/y\"\n";
        let err = |extra: &str| {
            NodeConfigFile::parse(&format!("{base}{extra}"))
                .unwrap()
                .into_options(AdapterRegistry::new())
                .unwrap_err()
                .to_string()
        };
        let e = err("[[credentials]]\nadapter = \"a\"\napi_key_env = \"IOP_TEST_UNSET_KEY_VAR\"\n");
        assert_eq!(
            e,
            "credentials.api_key_env: environment variable IOP_TEST_UNSET_KEY_VAR is not set or empty"
        );
        let e = err("[[credentials]]\nadapter = \"a\"\n");
        assert!(
            e.starts_with("credentials: adapter `a`: exactly one of"),
            "{e}"
        );
        let e = err(
            "[credential_plane]\nenabled = true\n[[credentials]]\nadapter = \"a\"\napi_key_env = \"X\"\n",
        );
        assert!(
            e.starts_with("credentials: not allowed with credential_plane.enabled"),
            "{e}"
        );
        let dir = std::env::temp_dir().join(format!("iop-node-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "sk-secret-value\n").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
            let e = err(&format!(
                "[[credentials]]\nadapter = \"a\"\napi_key_file = {:?}\n",
                file.display().to_string()
            ));
            assert!(e.contains("is readable by other users (mode 644)"), "{e}");
            assert!(!e.contains("sk-secret-value"));
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        // A readable key, a bad header: the header is named, the key is not printed.
        let e = err(&format!(
            "[[credentials]]\nadapter = \"a\"\napi_key_file = {:?}\nheader = \"bad header\"\n",
            file.display().to_string()
        ));
        assert!(e.starts_with("credentials.header:"), "{e}");
        assert!(!e.contains("sk-secret-value"));
        // Valid: the next error is about TLS, after the key was loaded.
        let e = err(&format!(
            "[[credentials]]\nadapter = \"a\"\napi_key_file = {:?}\nheader = \"x-api-key\"\n",
            file.display().to_string()
        ));
        assert!(e.starts_with("tls.ca:"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reconnect_errors_name_their_key() {
        let base = "node_id = \"n\"\n[edge]\naddress = \"a:1\"\nserver_name = \"localhost\"\nname = \"e\"\n[tls]\ntrust_domain = \"t\"\nca = \"/nonexistent\"\ncert = \"/x\"\nkey = \"/y\"\n";
        let f = NodeConfigFile::parse(&format!("{base}[reconnect]\nmax_attempts = -1\n")).unwrap();
        let e = f
            .into_options(AdapterRegistry::new())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("reconnect.max_attempts:"), "{e}");
        let f = NodeConfigFile::parse(&format!(
            "{base}[reconnect]\nmax_attempts = 0\ninterval_sec = 0\n"
        ))
        .unwrap();
        let e = f
            .into_options(AdapterRegistry::new())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("reconnect.interval_sec:"), "{e}");
        let f = NodeConfigFile::parse(base).unwrap();
        let e = f
            .into_options(AdapterRegistry::new())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("tls.ca:"), "{e}");
    }
}
