//! The Node's HTTP client to its providers (the `openai_compat` tunnel, the `ollama` run, the
//! health probes): hyper-util's pooled client over hyper-rustls — the stack reqwest is built
//! on — without reqwest's client layers.
//!
//! Why not reqwest: a tunnel is a proxy, and reqwest is a user agent. It follows redirects (a
//! provider's `3xx` must reach the caller as it came; following it would also carry a
//! credential header reqwest does not strip, such as `x-api-key`, wherever the provider
//! points), it retries, and per request it re-parses the URL and wraps the response; those
//! layers were about a tenth of the Node's CPU per tunnel (`benches/README.md`, proc_load).
//!
//! What is kept: connection pooling and keep-alive (idle connections closed after
//! [`POOL_IDLE`]), HTTP/2 by ALPN on `https` upstreams, TCP_NODELAY, TLS with the platform's
//! verifier (ring provider), and a deadline over the whole exchange (headers and body), as
//! reqwest's `timeout` was. A base URL is parsed once; a request only parses its path.

use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Body as _;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::Instant;

use crate::adapter::AdapterError;

/// Idle keep-alive connections to a provider are closed after this long.
pub(crate) const POOL_IDLE: Duration = Duration::from_secs(90);

/// Why an exchange with a provider failed; the stable text goes on the wire (never the
/// provider's own error text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HttpFailure {
    /// The deadline passed.
    Timeout,
    /// No connection (refused, DNS, TLS).
    Connect,
    /// The response body broke off.
    Body,
    /// The request could not be sent or the response was not HTTP.
    Request,
}

impl HttpFailure {
    pub(crate) fn text(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Connect => "connect failed",
            Self::Body => "response body failed",
            Self::Request => "request failed",
        }
    }
}

impl From<HttpFailure> for AdapterError {
    fn from(f: HttpFailure) -> Self {
        Self::Provider(f.text().to_owned())
    }
}

/// A provider's base URL, parsed once.
#[derive(Clone, Debug)]
pub(crate) struct BaseUrl {
    scheme: Scheme,
    authority: Authority,
    /// The base path without a trailing `/` (`/v1`, or empty).
    path: String,
}

impl BaseUrl {
    /// `key` names the setting in errors.
    pub(crate) fn parse(key: &str, base_url: &str) -> Result<Self, String> {
        let invalid = || format!("{key} is not a valid URL");
        let uri: http::Uri = base_url
            .trim_end_matches('/')
            .parse()
            .map_err(|_| invalid())?;
        let scheme = uri.scheme().cloned().ok_or_else(invalid)?;
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(format!("{key} must be http or https"));
        }
        let authority = uri.authority().cloned().ok_or_else(invalid)?;
        if uri.query().is_some() {
            return Err(format!("{key} must not have a query"));
        }
        Ok(Self {
            scheme,
            authority,
            path: uri.path().trim_end_matches('/').to_owned(),
        })
    }

    /// The URI of `path` (which may carry a `?query`) under this base.
    pub(crate) fn join(&self, path: &str) -> Result<http::Uri, AdapterError> {
        let invalid = || AdapterError::InvalidInput("path");
        if !path.starts_with('/') {
            return Err(invalid());
        }
        let pq = PathAndQuery::from_maybe_shared(format!("{}{path}", self.path))
            .map_err(|_| invalid())?;
        http::Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
            .map_err(|_| invalid())
    }
}

/// A pooled client for one adapter instance.
#[derive(Clone, Debug)]
pub(crate) struct ProviderHttp {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// The deadline of an exchange unless the request names its own.
    timeout: Option<Duration>,
}

impl ProviderHttp {
    /// A client verifying servers with the platform's verifier.
    pub(crate) fn new(timeout: Option<Duration>) -> Result<Self, String> {
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls_platform_verifier::Verifier::new(provider.clone())
            .map_err(|_| "platform certificate verifier unavailable".to_owned())?;
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|_| "TLS configuration failed".to_owned())?
            .dangerous()
            .with_custom_certificate_verifier(std::sync::Arc::new(verifier))
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.enforce_http(false);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE)
            .build(https);
        Ok(Self { client, timeout })
    }

    /// Sends `request`; the response once its head arrived. The deadline (`timeout`, else the
    /// client's) covers the body too: read it with [`Exchange::chunk`].
    pub(crate) async fn send(
        &self,
        request: http::Request<Full<Bytes>>,
        timeout: Option<Duration>,
    ) -> Result<Exchange, HttpFailure> {
        let deadline = timeout.or(self.timeout).map(|t| Instant::now() + t);
        let sent = self.client.request(request);
        let response = match deadline {
            Some(d) => tokio::time::timeout_at(d, sent)
                .await
                .map_err(|_| HttpFailure::Timeout)?,
            None => sent.await,
        };
        let response = response.map_err(|e| {
            if e.is_connect() {
                HttpFailure::Connect
            } else {
                HttpFailure::Request
            }
        })?;
        Ok(Exchange { response, deadline })
    }
}

/// A response being read.
#[derive(Debug)]
pub(crate) struct Exchange {
    response: http::Response<Incoming>,
    deadline: Option<Instant>,
}

impl Exchange {
    pub(crate) fn status(&self) -> http::StatusCode {
        self.response.status()
    }

    pub(crate) fn headers(&self) -> &http::HeaderMap {
        self.response.headers()
    }

    /// The next piece of the body, `None` at its end.
    pub(crate) async fn chunk(&mut self) -> Option<Result<Bytes, HttpFailure>> {
        loop {
            // A body of known length that has all arrived ends here, without asking hyper's
            // connection task for its end: one round through another task less per response.
            if self.response.body().is_end_stream() {
                return None;
            }
            let frame = self.response.body_mut().frame();
            let frame = match self.deadline {
                Some(d) => match tokio::time::timeout_at(d, frame).await {
                    Ok(f) => f,
                    Err(_) => return Some(Err(HttpFailure::Timeout)),
                },
                None => frame.await,
            };
            match frame? {
                Ok(frame) => {
                    // Trailers are not relayed.
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        return Some(Ok(data));
                    }
                }
                Err(_) => return Some(Err(HttpFailure::Body)),
            }
        }
    }

    /// The whole body, at most `limit` bytes (more is a [`HttpFailure::Body`]).
    pub(crate) async fn bytes(mut self, limit: usize) -> Result<Bytes, HttpFailure> {
        let mut out = Vec::new();
        while let Some(chunk) = self.chunk().await {
            let chunk = chunk?;
            if out.len() + chunk.len() > limit {
                return Err(HttpFailure::Body);
            }
            out.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(out))
    }
}

/// A request with `headers` and a complete body.
pub(crate) fn request(
    method: http::Method,
    uri: http::Uri,
    headers: http::HeaderMap,
    body: Bytes,
) -> http::Request<Full<Bytes>> {
    let mut r = http::Request::new(Full::new(body));
    *r.method_mut() = method;
    *r.uri_mut() = uri;
    *r.headers_mut() = headers;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_join_paths_and_queries() {
        let b = BaseUrl::parse("k", "http://127.0.0.1:8080/v1/").unwrap();
        assert_eq!(
            b.join("/chat/completions").unwrap().to_string(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            b.join("/models?limit=5").unwrap().to_string(),
            "http://127.0.0.1:8080/v1/models?limit=5"
        );
        let root = BaseUrl::parse("k", "https://api.example.com").unwrap();
        assert_eq!(
            root.join("/v1/messages").unwrap().to_string(),
            "https://api.example.com/v1/messages"
        );
        assert!(b.join("no-slash").is_err());
        assert!(b.join("/bad path").is_err());
        for bad in ["ftp://x/y", "not a url", "/relative", "http://h/p?q=1"] {
            assert!(BaseUrl::parse("base_url", bad).is_err(), "{bad}");
        }
        assert_eq!(
            BaseUrl::parse("openai_compat.base_url", "ftp://x").unwrap_err(),
            "openai_compat.base_url must be http or https"
        );
    }
}
