//! The `openai_compat` adapter: provider raw tunnel to an HTTP API described by the instance's
//! protocol profile — an OpenAI-compatible server (`chat_only`, `openai` presets) or an
//! Anthropic-native one (`anthropic`: `x-api-key`, `anthropic-version`). The adapter is
//! dialect-blind: the Edge decides what to send and translates what comes back.
//!
//! Every request and health probe carries the profile's fixed headers and then the credential
//! — an opened lease (managed mode) or the key the Node holds for the instance (legacy mode) —
//! in its declared header, written at the last moment (`TunnelSink::inject_credential`).
//!
//! For a `ProviderTunnelRequest` it opens the upstream request (the path from the instance's
//! protocol profile for the named operation, or the request's fallback path), then streams the
//! provider's status and headers as RESPONSE_START and its body, byte for byte, as BODY frames
//! (SSE included: nothing is parsed out of or merged into the body). Usage is observed on the
//! side by `iop_dialect::usage::UsageScanner` (pure, fuzzed): `usage` objects in SSE `data:`
//! lines, or in a JSON body of at most 1 MiB, become USAGE frames; a stream's USAGE goes ahead of
//! the bytes that carry the stream's own end. Dropping the adapter's future (caller cancel,
//! deadline, session end) drops the HTTP response, which closes the upstream connection.
//!
//! HTTPS upstreams are verified against the platform's roots with rustls and the ring provider
//! (the client is `provider_http`). A provider's redirect is relayed to the caller, not
//! followed.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use iop_dialect::usage::{TokenUsage, UsageScanner};
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, Header, Operation, ProviderStatus,
    ProviderTunnelRequest, RunRequest, Usage,
};

use crate::adapter::{Adapter, AdapterError, RunCompletion, RunEvents, TunnelSink};
use crate::credential::UpstreamCredential;
use crate::provider_http::{self, BaseUrl, ProviderHttp};

/// The adapter type name in `AdapterConfig.type`.
pub const ADAPTER_TYPE: &str = "openai_compat";
/// Default upstream request timeout when the instance sets none.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(600);
/// Bound of a health probe.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// A health probe's model list is read up to this size (a provider cannot make it unbounded).
const MAX_PROBE_BODY: usize = 4 * 1024 * 1024;

/// Request and response headers never forwarded: hop-by-hop and framing headers.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
];

/// The OpenAI-compatible passthrough adapter.
#[derive(Clone, Debug)]
pub struct OpenAiCompatAdapter {
    client: ProviderHttp,
    base: BaseUrl,
    profile: ConcreteProtocolProfile,
    targets: Vec<String>,
}

impl OpenAiCompatAdapter {
    /// Builds an instance from its configuration.
    pub fn from_config(config: &AdapterConfig) -> Result<Self, String> {
        let AdapterSettings::OpenAiCompat(settings) = &config.settings else {
            return Err("openai_compat settings are required".into());
        };
        let timeout = match settings.request_timeout_sec {
            0 => DEFAULT_REQUEST_TIMEOUT,
            s => Duration::from_secs(u64::from(s)),
        };
        Ok(Self {
            base: BaseUrl::parse("openai_compat.base_url", &settings.base_url)?,
            client: ProviderHttp::new(Some(timeout))?,
            profile: settings.protocol_profile.clone(),
            targets: config.targets.clone(),
        })
    }

    /// The protocol profile's fixed headers (e.g. `anthropic-version`), replacing a caller's.
    fn profile_headers(&self, headers: &mut http::HeaderMap) {
        for h in &self.profile.headers {
            if let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(h.name.as_bytes()),
                http::HeaderValue::from_bytes(&h.value),
            ) {
                headers.insert(name, value);
            }
        }
    }

    /// The upstream URI: the profile's path for the named operation, or the request's own.
    fn uri(&self, operation: Option<Operation>, fallback: &str) -> Result<http::Uri, AdapterError> {
        let path = match operation {
            Some(op) => self
                .profile
                .operation_paths
                .get(&op)
                .ok_or(AdapterError::InvalidInput(
                    "operation not in the protocol profile",
                ))?
                .as_str(),
            None => fallback,
        };
        self.base.join(path)
    }
}

#[async_trait]
impl Adapter for OpenAiCompatAdapter {
    async fn run(
        &self,
        _request: RunRequest,
        _events: RunEvents,
    ) -> Result<RunCompletion, AdapterError> {
        // OpenAI-compatible providers are served through the raw tunnel (seed 000).
        Err(AdapterError::Unsupported)
    }

    async fn tunnel(
        &self,
        request: ProviderTunnelRequest,
        frames: TunnelSink,
    ) -> Result<(), AdapterError> {
        if !self.targets.is_empty() && !self.targets.contains(&request.target) {
            return Err(AdapterError::UnknownTarget);
        }
        let uri = self.uri(request.operation, &request.path)?;
        let method = http::Method::from_bytes(request.method.as_bytes())
            .map_err(|_| AdapterError::InvalidInput("method"))?;
        let mut headers = http::HeaderMap::new();
        for h in &request.headers {
            if HOP_BY_HOP.contains(&h.name.to_ascii_lowercase().as_str()) {
                continue;
            }
            let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(h.name.as_bytes()),
                http::HeaderValue::from_bytes(&h.value),
            ) else {
                return Err(AdapterError::InvalidInput("header"));
            };
            headers.append(name, value);
        }
        // The profile's fixed headers, then the credential (an opened lease or the Node's own
        // key) in its declared header, right before the call.
        self.profile_headers(&mut headers);
        crate::adapter::trace_headers(&mut headers, request.trace.as_deref());
        frames.inject_credential(&mut headers);
        let outgoing = provider_http::request(method, uri, headers, request.body);
        let fenced = || AdapterError::Provider("fenced".into());
        let mut response = tokio::select! {
            () = frames.cancelled() => return Err(fenced()),
            r = self.client.send(outgoing, request.timeout) => r?,
        };
        let status = response.status().as_u16();
        let sse = response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let out_headers = response
            .headers()
            .iter()
            .filter(|(n, _)| !HOP_BY_HOP.contains(&n.as_str()))
            .map(|(n, v)| Header {
                name: n.as_str().to_owned(),
                value: Bytes::copy_from_slice(v.as_bytes()),
            })
            .collect();
        if !frames.start(status, out_headers).await {
            return Ok(());
        }
        let mut scanner = UsageScanner::new(sse);
        loop {
            // Dropping the response (on return) closes the upstream connection.
            let next = tokio::select! {
                () = frames.cancelled() => return Err(fenced()),
                next = response.chunk() => next,
            };
            let Some(chunk) = next else { break };
            let chunk = chunk?;
            scanner.feed(&chunk);
            if let Some(usage) = scanner.update()
                && !frames.usage(wire_usage(usage)).await
            {
                return Ok(());
            }
            if !frames.body(chunk).await {
                return Ok(());
            }
        }
        if let Some(usage) = scanner.finish() {
            frames.usage(wire_usage(usage)).await;
        }
        Ok(())
    }

    async fn probe(&self, target: &str, credential: Option<&UpstreamCredential>) -> ProviderStatus {
        let path = if self.profile.health_path.is_empty() {
            self.profile
                .operation_paths
                .get(&Operation::Models)
                .map_or("/models", String::as_str)
        } else {
            self.profile.health_path.as_str()
        };
        let mut headers = http::HeaderMap::new();
        self.profile_headers(&mut headers);
        if let Some(c) = credential {
            c.inject(&mut headers);
        }
        let Ok(uri) = self.base.join(path) else {
            return ProviderStatus::Unknown;
        };
        let request = provider_http::request(http::Method::GET, uri, headers, Bytes::new());
        let Ok(response) = self.client.send(request, Some(PROBE_TIMEOUT)).await else {
            return ProviderStatus::Unavailable;
        };
        if !response.status().is_success() {
            return ProviderStatus::Unavailable;
        }
        // Exact target: the models list must name it; an unreadable list proves nothing.
        let listed = response
            .bytes(MAX_PROBE_BODY)
            .await
            .ok()
            .and_then(|body| serde_json::from_slice::<serde_json::Value>(&body).ok());
        match listed {
            Some(v) => {
                let listed = v["data"]
                    .as_array()
                    .is_some_and(|models| models.iter().any(|m| m["id"].as_str() == Some(target)));
                if listed {
                    ProviderStatus::Available
                } else {
                    ProviderStatus::Unavailable
                }
            }
            None => ProviderStatus::Unknown,
        }
    }
}

/// The scanner's counts as the wire's USAGE frame.
fn wire_usage(u: TokenUsage) -> Usage {
    Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        total_tokens: u.total_tokens,
        cached_prompt_tokens: u.cached_prompt_tokens,
    }
}
