//! The guard every operators' page of the workspace sits behind (the Edge's status page,
//! `iop-cp`'s): an admin token, and the headers that keep a page same-origin and inert.
//!
//! - [`AdminToken`]: at least 16 printable characters, compared in constant time, never
//!   printed (`Debug` is redacted).
//! - [`guard`] wraps a router: a request needs the token as `Authorization: Bearer <token>` or
//!   as the password of HTTP Basic authentication (any user name: a browser asks for it once
//!   and sends it with the page's event stream too); anything else gets `401` with a Basic
//!   challenge and no page. Every response, `401` included, carries [`PAGE_CSP`],
//!   `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer`, `X-Frame-Options:
//!   DENY` and `Cache-Control: no-store`.
//! - [`confirmed_action`]: what a request that changes state needs besides the token: the
//!   [`ACTION_HEADER`] a page's script sets after the operator confirmed (a custom header: a
//!   page of another origin cannot send it without a CORS preflight, which is never
//!   answered, so a browser holding the Basic credential cannot be made to act from
//!   elsewhere), and no `Sec-Fetch-Site` other than `same-origin` or `none`.
//! - [`status_events`]: a page's live view as server-sent events, capped by [`EventStreams`].
//! - [`asset`]: a compiled-in file with its content type; [`page_assets`]: the files every
//!   page shares (`page.css`, `common.js` with the DOM helpers that build from text nodes only
//!   and the event-stream connection, `favicon.svg`), compiled in: a page loads nothing from
//!   anywhere else.

use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The Content-Security-Policy of every page: nothing but the page's own origin's script,
/// style, images and connections; no inline script or style, no framing, no form posts.
pub const PAGE_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                            connect-src 'self'; img-src 'self'; base-uri 'none'; \
                            form-action 'none'; frame-ancestors 'none'";

/// The header a state-changing request carries once the operator confirmed it
/// ([`confirmed_action`]); its value is `confirmed`.
pub const ACTION_HEADER: &str = "x-iop-confirm";

/// Whether a state-changing request may go ahead (the token is [`guard`]'s): it carries
/// [`ACTION_HEADER`]` = confirmed`, and a browser's `Sec-Fetch-Site` (if sent) says it came
/// from the page's own origin. `Err` is the answer to send: `403` with why.
#[expect(clippy::result_large_err, reason = "the error is the response to send")]
pub fn confirmed_action(headers: &HeaderMap) -> Result<(), Response> {
    let site = headers
        .get("sec-fetch-site")
        .map(|v| v.as_bytes().to_ascii_lowercase());
    if site.is_some_and(|s| s != b"same-origin" && s != b"none") {
        return Err((
            StatusCode::FORBIDDEN,
            "actions are taken from the page's own origin only\n",
        )
            .into_response());
    }
    if headers.get(ACTION_HEADER).map(HeaderValue::as_bytes) != Some(b"confirmed") {
        return Err((
            StatusCode::FORBIDDEN,
            "an action needs the operator's confirmation (header x-iop-confirm: confirmed)\n",
        )
            .into_response());
    }
    Ok(())
}

/// The admin credential: compared in constant time, never printed.
#[derive(Clone)]
pub struct AdminToken(Arc<str>);

impl AdminToken {
    /// A token (surrounding whitespace trimmed); `None` unless it is at least 16 printable
    /// ASCII characters without spaces.
    pub fn new(token: &str) -> Option<Self> {
        let t = token.trim();
        (t.len() >= 16 && t.bytes().all(|b| b.is_ascii_graphic())).then(|| Self(Arc::from(t)))
    }

    /// Whether `presented` is the token, in time independent of where they differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let want = self.0.as_bytes();
        presented.len() == want.len()
            && presented
                .iter()
                .zip(want)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(redacted)")
    }
}

/// The token a request presents, from `Authorization: Bearer` or Basic (the password).
pub fn presented(headers: &HeaderMap) -> Option<Vec<u8>> {
    use base64::Engine as _;
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, rest) = v.split_once(' ')?;
    if scheme.eq_ignore_ascii_case("bearer") {
        return Some(rest.trim().as_bytes().to_vec());
    }
    if !scheme.eq_ignore_ascii_case("basic") || rest.len() > 1024 {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(rest.trim())
        .ok()?;
    let colon = raw.iter().position(|b| *b == b':')?;
    Some(raw[colon + 1..].to_vec())
}

/// `router` behind `token` (see the module docs); `realm` names the page in the browser's
/// prompt.
pub fn guard(router: Router, token: AdminToken, realm: &'static str) -> Router {
    router
        .layer(axum::middleware::from_fn(
            move |request: Request, next: Next| {
                let token = token.clone();
                async move {
                    match presented(request.headers()) {
                        Some(t) if token.matches(&t) => next.run(request).await,
                        _ => unauthorized(realm),
                    }
                }
            },
        ))
        .layer(axum::middleware::from_fn(secure_headers))
}

fn unauthorized(realm: &'static str) -> Response {
    let challenge = HeaderValue::from_str(&format!("Basic realm=\"{realm}\", charset=\"UTF-8\""))
        .unwrap_or_else(|_| HeaderValue::from_static("Basic"));
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, challenge)],
        "the admin token is required (Authorization: Bearer, or Basic with the token as the password)\n",
    )
        .into_response()
}

async fn secure_headers(request: Request, next: Next) -> Response {
    let mut r = next.run(request).await;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(PAGE_CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// `GET /page.css`, `/common.js` and `/favicon.svg`: merge into a page's router (before
/// [`guard`]).
pub fn page_assets() -> Router {
    use axum::routing::get;
    Router::new()
        .route(
            "/page.css",
            get(|| async { asset("text/css; charset=utf-8", include_str!("page.css")) }),
        )
        .route(
            "/common.js",
            get(|| async { asset("text/javascript; charset=utf-8", include_str!("common.js")) }),
        )
        .route(
            "/favicon.svg",
            get(|| async { asset("image/svg+xml", include_str!("favicon.svg")) }),
        )
}

/// How often [`status_events`] looks for a change.
pub const EVENT_CHECK: std::time::Duration = std::time::Duration::from_millis(500);

/// A page's open event streams, capped ([`status_events`]).
#[derive(Debug)]
pub struct EventStreams {
    open: std::sync::atomic::AtomicUsize,
    max: usize,
}

impl EventStreams {
    /// At most `max` streams open at once.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            open: std::sync::atomic::AtomicUsize::new(0),
            max,
        })
    }
}

/// Releases a stream's place when the stream is dropped.
struct Place(Arc<EventStreams>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0
            .open
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A page's server-sent events: one `status` event with `view()` as JSON at once, then one each
/// time it changes (checked every [`EVENT_CHECK`]; a `None` view, a source briefly
/// unavailable, is skipped), a comment every 15 s otherwise. Over `streams`' cap: `503`.
pub fn status_events<V, F, Fut>(streams: &Arc<EventStreams>, view: F) -> Response
where
    V: serde::Serialize + PartialEq + Send + 'static,
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Option<V>> + Send,
{
    use axum::response::sse::{Event, KeepAlive, Sse};
    use std::sync::atomic::Ordering;
    if streams.open.fetch_add(1, Ordering::AcqRel) >= streams.max {
        streams.open.fetch_sub(1, Ordering::AcqRel);
        return (StatusCode::SERVICE_UNAVAILABLE, "too many pages open\n").into_response();
    }
    let place = Place(streams.clone());
    let stream = futures_util::stream::unfold(
        (place, view, None::<V>, true),
        |(place, view, last, first)| async move {
            if !first {
                tokio::time::sleep(EVENT_CHECK).await;
            }
            loop {
                if let Some(v) = view().await
                    && last.as_ref() != Some(&v)
                {
                    let event = Event::default()
                        .event("status")
                        .json_data(&v)
                        .unwrap_or_else(|_| Event::default().comment("unencodable"));
                    return Some((
                        Ok::<_, std::convert::Infallible>(event),
                        (place, view, Some(v), false),
                    ));
                }
                tokio::time::sleep(EVENT_CHECK).await;
            }
        },
    );
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(std::time::Duration::from_secs(15)))
        .into_response()
}

/// A compiled-in file served with `content_type`.
pub fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_and_never_printed() {
        assert!(AdminToken::new("short").is_none());
        assert!(AdminToken::new("has a space in it!!").is_none());
        let t = AdminToken::new("0123456789abcdefXYZ\n").unwrap();
        assert!(t.matches(b"0123456789abcdefXYZ"));
        assert!(!t.matches(b"0123456789abcdefXYz"));
        assert!(!t.matches(b"0123456789abcdefXY"));
        assert_eq!(format!("{t:?}"), "AdminToken(redacted)");
    }

    #[test]
    fn bearer_and_basic_present_the_token() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
        assert_eq!(presented(&h).unwrap(), b"abc");
        h.insert(header::AUTHORIZATION, "bearer abc".parse().unwrap());
        assert_eq!(
            presented(&h).unwrap(),
            b"abc",
            "the scheme is case-insensitive"
        );
        // "admin:s3cret:x": the password is everything after the first colon.
        h.insert(
            header::AUTHORIZATION,
            "Basic YWRtaW46czNjcmV0Ong=".parse().unwrap(),
        );
        assert_eq!(presented(&h).unwrap(), b"s3cret:x");
        h.insert(header::AUTHORIZATION, "Basic !!!!".parse().unwrap());
        assert_eq!(presented(&h), None);
        h.insert(header::AUTHORIZATION, "Basic YQ==".parse().unwrap());
        assert_eq!(presented(&h), None, "no colon");
        h.insert(header::AUTHORIZATION, "Digest abc".parse().unwrap());
        assert_eq!(presented(&h), None);
    }
}
