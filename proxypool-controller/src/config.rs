//! The controller's configuration file (TOML; the `controlPlane` block of seed 004 §6, with its
//! key names) and its validation. Every error names its key.
//!
//! ```toml
//! [controlPlane]
//! enabled = false              # default: the gRPC listener is not started
//! listen = "127.0.0.1:8443"
//! protocolVersion = 1
//! heartbeatInterval = "10s"
//! sessionTTL = "35s"           # >= 3 x heartbeatInterval
//! maxStaleAge = "30s"          # >= heartbeatInterval
//! maxMessageBytes = 4194304
//! maxRuntimeCounters = 100000
//! maxConcurrentStreams = 256   # per connection (our addition; the seed asks for a bound)
//! shutdownTimeout = "10s"      # graceful stop bound, then hard stop (our addition)
//! minPingInterval = "10s"      # keepalive enforcement: a client pinging more often than this,
//!                              # three times with no call between, is disconnected; "0s" = off
//!
//! [controlPlane.tls]
//! mode = "disabled"            # only on loopback listeners; or "mtls"
//! serverCert = "/etc/proxypool/controller.pem"
//! serverKey = "/etc/proxypool/controller.key"
//! clientCA = "/etc/proxypool/workers-ca.pem"
//! trustDomain = "proxypool.example"   # lowercase DNS name, no port
//! environment = "prod"                # one URI path segment
//! reloadInterval = "5s"        # re-read the three files this often; "0s" = never (our addition)
//!
//! [redis]                      # required when controlPlane.enabled
//! url = "redis://127.0.0.1:6379/"
//! namespace = "proxypool"
//! cluster = false              # true: a Redis Cluster, url = seed URLs, comma-separated
//!                              #   (keys per worker; see proxypool_controller::redis_store)
//! waitReplicas = 0             # > 0: a write counts once this many replicas have it (WAIT);
//! waitTimeout = "100ms"        #   past this it fails as unavailable and the worker retries
//!
//! [admin]                      # /healthz, /readyz (includes Redis), /metrics
//! listen = "127.0.0.1:9464"
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::domain::{PROTOCOL_VERSION, ServiceConfig};

/// The file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct File {
    /// `[controlPlane]`.
    #[serde(default)]
    pub control_plane: ControlPlaneSection,
    /// `[redis]`.
    pub redis: Option<RedisSection>,
    /// `[admin]`.
    pub admin: Option<AdminSection>,
}

/// `[controlPlane]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct ControlPlaneSection {
    /// `controlPlane.enabled`.
    pub enabled: bool,
    /// `controlPlane.listen`.
    pub listen: String,
    /// `controlPlane.protocolVersion`.
    pub protocol_version: u32,
    /// `controlPlane.heartbeatInterval`.
    pub heartbeat_interval: String,
    /// `controlPlane.sessionTTL`.
    #[serde(rename = "sessionTTL")]
    pub session_ttl: String,
    /// `controlPlane.maxStaleAge`.
    pub max_stale_age: String,
    /// `controlPlane.maxMessageBytes`.
    pub max_message_bytes: i64,
    /// `controlPlane.maxRuntimeCounters`.
    pub max_runtime_counters: i64,
    /// `controlPlane.maxConcurrentStreams`.
    pub max_concurrent_streams: i64,
    /// `controlPlane.shutdownTimeout`.
    pub shutdown_timeout: String,
    /// `controlPlane.minPingInterval` (keepalive enforcement; `0s` = off).
    pub min_ping_interval: String,
    /// `[controlPlane.tls]`.
    pub tls: TlsSection,
}

impl Default for ControlPlaneSection {
    fn default() -> Self {
        Self {
            enabled: false,
            listen: "127.0.0.1:8443".into(),
            protocol_version: PROTOCOL_VERSION,
            heartbeat_interval: "10s".into(),
            session_ttl: "35s".into(),
            max_stale_age: "30s".into(),
            max_message_bytes: 4 * 1024 * 1024,
            max_runtime_counters: 100_000,
            max_concurrent_streams: 256,
            shutdown_timeout: "10s".into(),
            min_ping_interval: "10s".into(),
            tls: TlsSection::default(),
        }
    }
}

/// `[controlPlane.tls]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct TlsSection {
    /// `controlPlane.tls.mode`.
    pub mode: String,
    /// `controlPlane.tls.serverCert`.
    pub server_cert: Option<PathBuf>,
    /// `controlPlane.tls.serverKey`.
    pub server_key: Option<PathBuf>,
    /// `controlPlane.tls.clientCA`.
    #[serde(rename = "clientCA")]
    pub client_ca: Option<PathBuf>,
    /// `controlPlane.tls.trustDomain`.
    pub trust_domain: Option<String>,
    /// `controlPlane.tls.environment`.
    pub environment: Option<String>,
    /// `controlPlane.tls.reloadInterval`: how often the three files are re-read (default
    /// `5s`; `0s` = never).
    pub reload_interval: String,
}

impl Default for TlsSection {
    fn default() -> Self {
        Self {
            mode: "disabled".into(),
            server_cert: None,
            server_key: None,
            client_ca: None,
            trust_domain: None,
            environment: None,
            reload_interval: "5s".into(),
        }
    }
}

/// `[redis]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RedisSection {
    /// `redis.url`.
    pub url: String,
    /// `redis.namespace`.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// `redis.cluster`.
    #[serde(default)]
    pub cluster: bool,
    /// `redis.waitReplicas`.
    #[serde(default)]
    pub wait_replicas: u32,
    /// `redis.waitTimeout`.
    pub wait_timeout: Option<String>,
}

/// Where the store is, as validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisConfig {
    /// One server, or a cluster's seeds.
    pub target: bounded_http::redis::Target,
    /// Key namespace.
    pub namespace: String,
    /// Replicas a write waits for (`None`: the master's acknowledgement).
    pub durability: Option<crate::redis_store::Durability>,
}

fn default_namespace() -> String {
    "proxypool".into()
}

/// `[admin]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AdminSection {
    /// `admin.listen`.
    pub listen: String,
}

/// A configuration error naming its key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    /// The key, e.g. `controlPlane.sessionTTL`.
    pub key: &'static str,
    /// What is wrong.
    pub message: String,
}

fn err(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key,
        message: message.into(),
    }
}

/// TLS as validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsMode {
    /// Plaintext (loopback listeners only).
    Disabled,
    /// Mutual TLS with worker identities.
    Mtls {
        /// Server certificate chain (PEM file).
        server_cert: PathBuf,
        /// Server key (PEM file).
        server_key: PathBuf,
        /// Client CA bundle (PEM file).
        client_ca: PathBuf,
        /// Trust domain.
        trust_domain: String,
        /// Environment.
        environment: String,
        /// How often the three files are re-read (`None`: never).
        reload: Option<Duration>,
    },
}

/// The validated configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Whether the gRPC listener runs.
    pub enabled: bool,
    /// Listen address.
    pub listen: SocketAddr,
    /// Service settings.
    pub service: ServiceConfig,
    /// Largest gRPC message.
    pub max_message_bytes: usize,
    /// Concurrent streams per connection.
    pub max_concurrent_streams: u32,
    /// Graceful stop bound.
    pub shutdown_timeout: Duration,
    /// Keepalive enforcement: the shortest interval between a client's PINGs that is not a
    /// strike (`None`: not enforced).
    pub min_ping_interval: Option<Duration>,
    /// TLS.
    pub tls: TlsMode,
    /// The Redis store (required when enabled).
    pub redis: Option<RedisConfig>,
    /// Admin listen address.
    pub admin: Option<SocketAddr>,
}

/// `"10s"`, `"500ms"`, `"2m"`, `"1h"`.
pub fn parse_duration(key: &'static str, v: &str) -> Result<Duration, ConfigError> {
    let bad = || err(key, format!("`{v}` is not a duration like 10s, 500ms, 2m"));
    let (num, unit) = v
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| v.split_at(i))
        .ok_or_else(bad)?;
    let n: u64 = num.parse().map_err(|_| bad())?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.checked_mul(60).ok_or_else(bad)?),
        "h" => Duration::from_secs(n.checked_mul(3600).ok_or_else(bad)?),
        _ => return Err(bad()),
    };
    Ok(d)
}

fn positive(key: &'static str, v: i64) -> Result<u64, ConfigError> {
    u64::try_from(v)
        .ok()
        .filter(|v| *v > 0)
        .ok_or_else(|| err(key, "must be positive"))
}

/// A lowercase DNS name without a port.
fn valid_trust_domain(td: &str) -> bool {
    !td.is_empty()
        && td.len() <= 253
        && td.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// One bounded URI path segment (RFC 3986 unreserved characters).
fn valid_environment(env: &str) -> bool {
    !env.is_empty()
        && env.len() <= 64
        && env != "."
        && env != ".."
        && env
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
}

impl File {
    /// Parses TOML text.
    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// Validates every rule of seed 004 §6.
    pub fn validate(&self) -> Result<Config, ConfigError> {
        let cp = &self.control_plane;
        let listen: SocketAddr = cp
            .listen
            .parse()
            .map_err(|_| err("controlPlane.listen", "not an IP:port address"))?;
        if cp.protocol_version != PROTOCOL_VERSION {
            return Err(err("controlPlane.protocolVersion", "only 1 is supported"));
        }
        let heartbeat = parse_duration("controlPlane.heartbeatInterval", &cp.heartbeat_interval)?;
        let session_ttl = parse_duration("controlPlane.sessionTTL", &cp.session_ttl)?;
        let max_stale_age = parse_duration("controlPlane.maxStaleAge", &cp.max_stale_age)?;
        let shutdown_timeout =
            parse_duration("controlPlane.shutdownTimeout", &cp.shutdown_timeout)?;
        let min_ping_interval =
            parse_duration("controlPlane.minPingInterval", &cp.min_ping_interval)?;
        let min_ping_interval = (!min_ping_interval.is_zero()).then_some(min_ping_interval);
        if heartbeat.is_zero() {
            return Err(err("controlPlane.heartbeatInterval", "must be positive"));
        }
        if session_ttl < heartbeat * 3 {
            return Err(err(
                "controlPlane.sessionTTL",
                "must be at least 3 x heartbeatInterval",
            ));
        }
        if max_stale_age < heartbeat {
            return Err(err(
                "controlPlane.maxStaleAge",
                "must be at least heartbeatInterval",
            ));
        }
        let max_message_bytes = positive("controlPlane.maxMessageBytes", cp.max_message_bytes)?;
        let max_runtime_counters =
            positive("controlPlane.maxRuntimeCounters", cp.max_runtime_counters)?;
        let max_concurrent_streams = positive(
            "controlPlane.maxConcurrentStreams",
            cp.max_concurrent_streams,
        )?;
        let tls = match cp.tls.mode.as_str() {
            "disabled" => {
                if !listen.ip().is_loopback() {
                    return Err(err(
                        "controlPlane.tls.mode",
                        "disabled is only allowed on a loopback listen address; use mtls",
                    ));
                }
                TlsMode::Disabled
            }
            "mtls" => {
                let t = &cp.tls;
                let need = |v: &Option<PathBuf>, key| {
                    v.clone().ok_or_else(|| err(key, "required for mtls"))
                };
                let server_cert = need(&t.server_cert, "controlPlane.tls.serverCert")?;
                let server_key = need(&t.server_key, "controlPlane.tls.serverKey")?;
                let client_ca = need(&t.client_ca, "controlPlane.tls.clientCA")?;
                let trust_domain = t
                    .trust_domain
                    .clone()
                    .ok_or_else(|| err("controlPlane.tls.trustDomain", "required for mtls"))?;
                if !valid_trust_domain(&trust_domain) {
                    return Err(err(
                        "controlPlane.tls.trustDomain",
                        "must be a lowercase DNS name without a port",
                    ));
                }
                let environment = t
                    .environment
                    .clone()
                    .ok_or_else(|| err("controlPlane.tls.environment", "required for mtls"))?;
                if !valid_environment(&environment) {
                    return Err(err(
                        "controlPlane.tls.environment",
                        "must be one URI path segment of at most 64 bytes",
                    ));
                }
                let reload = parse_duration("controlPlane.tls.reloadInterval", &t.reload_interval)?;
                TlsMode::Mtls {
                    server_cert,
                    server_key,
                    client_ca,
                    trust_domain,
                    environment,
                    reload: (!reload.is_zero()).then_some(reload),
                }
            }
            _ => return Err(err("controlPlane.tls.mode", "must be disabled or mtls")),
        };
        let redis = match &self.redis {
            Some(r) => {
                let timeout = match &r.wait_timeout {
                    Some(t) => parse_duration("redis.waitTimeout", t)?,
                    None => Duration::from_millis(100),
                };
                if r.wait_replicas > 0 && timeout.is_zero() {
                    return Err(err(
                        "redis.waitTimeout",
                        "must be positive (WAIT 0 would wait forever)",
                    ));
                }
                Some(RedisConfig {
                    target: bounded_http::redis::Target::parse(&r.url, r.cluster),
                    namespace: r.namespace.clone(),
                    durability: (r.wait_replicas > 0).then_some(crate::redis_store::Durability {
                        replicas: r.wait_replicas,
                        timeout,
                    }),
                })
            }
            None if cp.enabled => {
                return Err(err(
                    "redis.url",
                    "Redis is required when controlPlane.enabled",
                ));
            }
            None => None,
        };
        let admin = self
            .admin
            .as_ref()
            .map(|a| {
                a.listen
                    .parse()
                    .map_err(|_| err("admin.listen", "not an IP:port address"))
            })
            .transpose()?;
        Ok(Config {
            enabled: cp.enabled,
            listen,
            service: ServiceConfig {
                heartbeat_interval: heartbeat,
                session_ttl,
                max_stale_age,
                max_runtime_counters: usize::try_from(max_runtime_counters).unwrap_or(usize::MAX),
            },
            max_message_bytes: usize::try_from(max_message_bytes).unwrap_or(usize::MAX),
            max_concurrent_streams: u32::try_from(max_concurrent_streams).unwrap_or(u32::MAX),
            shutdown_timeout,
            min_ping_interval,
            tls,
            redis,
            admin,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    fn check(toml: &str) -> Result<Config, ConfigError> {
        File::parse(toml).unwrap().validate()
    }

    #[test]
    fn defaults_are_disabled_and_valid() {
        let c = check("").unwrap();
        assert!(!c.enabled);
        assert_eq!(c.listen, "127.0.0.1:8443".parse().unwrap());
        assert_eq!(c.service.session_ttl, Duration::from_secs(35));
        assert_eq!(c.max_message_bytes, 4 * 1024 * 1024);
        assert_eq!(c.tls, TlsMode::Disabled);
    }

    #[test]
    fn every_rule_names_its_key() {
        let cases = [
            ("[controlPlane]\nenabled = true\n", "redis.url"),
            (
                "[controlPlane]\nlisten = \"0.0.0.0:8443\"\n",
                "controlPlane.tls.mode",
            ),
            (
                "[controlPlane]\nsessionTTL = \"29s\"\n",
                "controlPlane.sessionTTL",
            ),
            (
                "[controlPlane]\nmaxStaleAge = \"9s\"\n",
                "controlPlane.maxStaleAge",
            ),
            (
                "[controlPlane]\nheartbeatInterval = \"10\"\n",
                "controlPlane.heartbeatInterval",
            ),
            (
                "[controlPlane]\nmaxMessageBytes = 0\n",
                "controlPlane.maxMessageBytes",
            ),
            (
                "[controlPlane]\nmaxRuntimeCounters = -1\n",
                "controlPlane.maxRuntimeCounters",
            ),
            (
                "[controlPlane]\nprotocolVersion = 2\n",
                "controlPlane.protocolVersion",
            ),
            (
                "[controlPlane.tls]\nmode = \"tls\"\n",
                "controlPlane.tls.mode",
            ),
            (
                "[controlPlane.tls]\nmode = \"mtls\"\n",
                "controlPlane.tls.serverCert",
            ),
        ];
        for (toml, key) in cases {
            assert_eq!(check(toml).unwrap_err().key, key, "{toml}");
        }
        let mtls = |td: &str, env: &str| {
            format!(
                "[controlPlane.tls]\nmode = \"mtls\"\nserverCert = \"c\"\nserverKey = \"k\"\nclientCA = \"ca\"\ntrustDomain = \"{td}\"\nenvironment = \"{env}\"\n"
            )
        };
        assert!(check(&mtls("proxypool.example", "prod")).is_ok());
        for td in ["Proxy.example", "proxypool.example:443", "", "a..b"] {
            assert_eq!(
                check(&mtls(td, "prod")).unwrap_err().key,
                "controlPlane.tls.trustDomain"
            );
        }
        for env in ["a/b", "", "..", &"x".repeat(65)] {
            assert_eq!(
                check(&mtls("td.example", env)).unwrap_err().key,
                "controlPlane.tls.environment"
            );
        }
        // Non-loopback needs mtls; with mtls it is fine.
        let remote = format!(
            "[controlPlane]\nlisten = \"0.0.0.0:8443\"\n{}",
            mtls("td.example", "prod")
        );
        assert!(check(&remote).is_ok());
        assert!(
            File::parse("[controlPlane]\nbogus = 1\n")
                .unwrap_err()
                .contains("bogus")
        );
    }
}
