//! The `ollama` adapter: native Ollama `/api/chat`, producing normalized RunEvents.
//!
//! Normalized input (`RunRequest.input`): a JSON object
//! `{"messages": [{"role": "...", "content": "..."}], "options": {...}, "tools": [...]}`
//! (`options` and `tools` optional), or plain UTF-8 text, which becomes one user message. The
//! adapter streams Ollama's NDJSON answer as DELTA text; on completion it reports usage
//! (`prompt_eval_count`, `eval_count`) and, when the model returned native tool calls, the
//! `openai_tool_calls` metadata key (a JSON array in OpenAI's shape, seed 000). It never parses
//! tool calls out of the assistant's text.
//!
//! Text tool-call fallback (seed 000): when the request declares `tools` and Ollama answers
//! 400 with an error that mentions tools (a model without tool support says "... does not
//! support tools"), the adapter retries once without `tools`/`tool_choice`, with the
//! instruction of [`iop_wire::text_tools`] merged into the leading system message, and marks
//! the `Complete` event `openai_text_tool_fallback = "true"`. Recovering calls from the text is
//! the Edge's job, and only for runs so marked. Any other 400 fails the run.
//!
//! Probe: `GET /api/tags` must list the exact target.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use iop_wire::runtime::{AdapterConfig, AdapterSettings, ProviderStatus, RunRequest, Usage};
use iop_wire::text_tools;
use serde_json::{Value, json};

use crate::adapter::{Adapter, AdapterError, RunCompletion, RunEvents};
use crate::credential::UpstreamCredential;
use crate::provider_http::{self, BaseUrl, Exchange, ProviderHttp};

/// The adapter type name in `AdapterConfig.type`.
pub const ADAPTER_TYPE: &str = "ollama";
/// Bound of a health probe.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest NDJSON line accepted from the provider.
const MAX_LINE: usize = 1024 * 1024;
/// Most bytes of an error answer read to classify it.
const MAX_ERROR_BODY: usize = 16 * 1024;
/// A health probe's model list is read up to this size.
const MAX_PROBE_BODY: usize = 4 * 1024 * 1024;

/// The Ollama adapter.
#[derive(Clone, Debug)]
pub struct OllamaAdapter {
    client: ProviderHttp,
    base: BaseUrl,
    targets: Vec<String>,
}

impl OllamaAdapter {
    /// Builds an instance from its configuration (`NativeAdapterConfig.base_url`, e.g.
    /// `http://127.0.0.1:11434`).
    pub fn from_config(config: &AdapterConfig) -> Result<Self, String> {
        let AdapterSettings::Native(settings) = &config.settings else {
            return Err("native settings with base_url are required".into());
        };
        Ok(Self {
            base: BaseUrl::parse("native.base_url", &settings.base_url)?,
            client: ProviderHttp::new(None)?,
            targets: config.targets.clone(),
        })
    }

    /// `POST /api/chat` with `body`, carrying `trace` as `traceparent`.
    async fn chat(
        &self,
        body: &Value,
        trace: Option<&iop_wire::trace::TraceContext>,
    ) -> Result<Exchange, AdapterError> {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        crate::adapter::trace_headers(&mut headers, trace);
        let body =
            Bytes::from(serde_json::to_vec(body).map_err(|_| AdapterError::InvalidInput("body"))?);
        let request = provider_http::request(
            http::Method::POST,
            self.base.join("/api/chat")?,
            headers,
            body,
        );
        Ok(self.client.send(request, None).await?)
    }
}

/// The Ollama request body for a normalized input.
fn chat_body(target: &str, input: &[u8]) -> Result<Value, AdapterError> {
    let mut body = json!({ "model": target, "stream": true });
    match serde_json::from_slice::<Value>(input) {
        Ok(Value::Object(obj)) => {
            let messages = obj
                .get("messages")
                .cloned()
                .ok_or(AdapterError::InvalidInput("messages"))?;
            if !messages.is_array() {
                return Err(AdapterError::InvalidInput("messages"));
            }
            body["messages"] = messages;
            for key in ["options", "tools", "format", "keep_alive"] {
                if let Some(v) = obj.get(key) {
                    body[key] = v.clone();
                }
            }
        }
        _ => {
            let text = std::str::from_utf8(input)
                .map_err(|_| AdapterError::InvalidInput("input is not UTF-8"))?;
            body["messages"] = json!([{ "role": "user", "content": text }]);
        }
    }
    Ok(body)
}

/// The retry body of the text tool-call fallback, when `body` declared tools: `tools` and
/// `tool_choice` removed, the instruction of [`text_tools::instruction`] merged into the
/// leading system message (a system message is inserted first when there is none, so the
/// backend never sees a system message after other roles).
fn text_tool_body(body: &Value) -> Option<Value> {
    let tools = body.get("tools")?;
    if tools.as_array().is_none_or(Vec::is_empty) {
        return None;
    }
    let instruction = text_tools::instruction(&tools.to_string());
    let mut retry = body.clone();
    let obj = retry.as_object_mut()?;
    obj.remove("tools");
    obj.remove("tool_choice");
    let messages = obj.get_mut("messages")?.as_array_mut()?;
    match messages.first_mut() {
        Some(first) if first["role"] == "system" => {
            let merged = match first["content"].as_str() {
                Some(existing) if !existing.is_empty() => format!("{existing}\n\n{instruction}"),
                _ => instruction,
            };
            first["content"] = Value::String(merged);
        }
        _ => messages.insert(0, json!({ "role": "system", "content": instruction })),
    }
    Some(retry)
}

/// At most `limit` bytes of a response body, lossily as text (for classification only).
async fn bounded_text(mut response: Exchange, limit: usize) -> String {
    let mut out = Vec::new();
    while out.len() < limit {
        match response.chunk().await {
            Some(Ok(chunk)) => {
                let take = chunk.len().min(limit - out.len());
                out.extend_from_slice(&chunk[..take]);
            }
            _ => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Ollama's native tool calls in OpenAI's `tool_calls` shape.
fn openai_tool_calls(calls: &[Value]) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let f = &c["function"];
                let arguments = match &f["arguments"] {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                json!({
                    "id": format!("call_{i}"),
                    "type": "function",
                    "function": { "name": f["name"].as_str().unwrap_or_default(), "arguments": arguments },
                })
            })
            .collect(),
    )
}

#[async_trait]
impl Adapter for OllamaAdapter {
    async fn run(
        &self,
        request: RunRequest,
        events: RunEvents,
    ) -> Result<RunCompletion, AdapterError> {
        if !self.targets.is_empty() && !self.targets.contains(&request.target) {
            return Err(AdapterError::UnknownTarget);
        }
        let body = chat_body(&request.target, &request.input)?;
        let fenced = || AdapterError::Provider("fenced".into());
        let mut response = tokio::select! {
            () = events.cancelled() => return Err(fenced()),
            r = self.chat(&body, request.trace.as_deref()) => r?,
        };
        let mut text_tool_fallback = false;
        if response.status() == http::StatusCode::BAD_REQUEST
            && let Some(fallback) = text_tool_body(&body)
        {
            // Only a rejection of the tool API itself (Ollama: "... does not support tools")
            // earns the one text-tool retry; the provider's text is read, bounded, and dropped.
            let rejected_tools = tokio::select! {
                () = events.cancelled() => return Err(fenced()),
                t = bounded_text(response, MAX_ERROR_BODY) => t.to_ascii_lowercase().contains("tool"),
            };
            if !rejected_tools {
                return Err(AdapterError::Provider("status 400".into()));
            }
            text_tool_fallback = true;
            response = tokio::select! {
                () = events.cancelled() => return Err(fenced()),
                r = self.chat(&fallback, request.trace.as_deref()) => r?,
            };
        }
        if !response.status().is_success() {
            return Err(AdapterError::Provider(format!(
                "status {}",
                response.status().as_u16()
            )));
        }
        let mut line = Vec::new();
        let mut tool_calls = Vec::new();
        let mut usage = None;
        loop {
            let next = tokio::select! {
                () = events.cancelled() => return Err(fenced()),
                next = response.chunk() => next,
            };
            let Some(chunk) = next else { break };
            let chunk = chunk?;
            for &b in chunk.iter() {
                if b != b'\n' {
                    if line.len() >= MAX_LINE {
                        return Err(AdapterError::Provider("response line too long".into()));
                    }
                    line.push(b);
                    continue;
                }
                let msg: Value = match serde_json::from_slice(&line) {
                    Ok(v) => v,
                    Err(_) if line.iter().all(u8::is_ascii_whitespace) => {
                        line.clear();
                        continue;
                    }
                    Err(_) => return Err(AdapterError::Provider("malformed response".into())),
                };
                line.clear();
                if msg.get("error").is_some() {
                    // The provider's text stays out of the wire error.
                    return Err(AdapterError::Provider("provider reported an error".into()));
                }
                if let Some(text) = msg["message"]["content"].as_str()
                    && !text.is_empty()
                    && !events.delta(text).await
                {
                    return Err(fenced());
                }
                if let Some(calls) = msg["message"]["tool_calls"].as_array() {
                    tool_calls.extend(calls.iter().cloned());
                }
                if msg["done"].as_bool() == Some(true) {
                    let prompt = msg["prompt_eval_count"].as_u64().unwrap_or(0);
                    let completion = msg["eval_count"].as_u64().unwrap_or(0);
                    usage = Some(Usage {
                        prompt_tokens: prompt,
                        completion_tokens: completion,
                        total_tokens: prompt + completion,
                        cached_prompt_tokens: 0,
                    });
                }
            }
        }
        if usage.is_none() {
            return Err(AdapterError::Provider("stream ended before done".into()));
        }
        let mut metadata = std::collections::BTreeMap::new();
        if text_tool_fallback {
            metadata.insert(
                text_tools::META_TEXT_TOOL_FALLBACK.to_owned(),
                "true".to_owned(),
            );
        }
        if !tool_calls.is_empty() {
            metadata.insert(
                text_tools::META_TOOL_CALLS.to_owned(),
                openai_tool_calls(&tool_calls).to_string(),
            );
        }
        Ok(RunCompletion { metadata, usage })
    }

    async fn probe(
        &self,
        target: &str,
        _credential: Option<&UpstreamCredential>,
    ) -> ProviderStatus {
        let Ok(uri) = self.base.join("/api/tags") else {
            return ProviderStatus::Unknown;
        };
        let request =
            provider_http::request(http::Method::GET, uri, http::HeaderMap::new(), Bytes::new());
        let Ok(response) = self.client.send(request, Some(PROBE_TIMEOUT)).await else {
            return ProviderStatus::Unavailable;
        };
        if !response.status().is_success() {
            return ProviderStatus::Unavailable;
        }
        let tags = response
            .bytes(MAX_PROBE_BODY)
            .await
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
        match tags {
            Some(v) => {
                let listed = v["models"].as_array().is_some_and(|ms| {
                    ms.iter().any(|m| {
                        m["name"].as_str() == Some(target) || m["model"].as_str() == Some(target)
                    })
                });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_forms() {
        let b = chat_body("m", b"hello").unwrap();
        assert_eq!(b["messages"][0]["content"], "hello");
        let b = chat_body(
            "m",
            br#"{"messages":[{"role":"system","content":"s"}],"options":{"temperature":0}}"#,
        )
        .unwrap();
        assert_eq!(b["messages"][0]["role"], "system");
        assert_eq!(b["options"]["temperature"], 0);
        assert_eq!(b["model"], "m");
        assert!(chat_body("m", br#"{"messages":"x"}"#).is_err());
    }

    #[test]
    fn text_tool_retry_body() {
        let body = json!({"model":"m","stream":true,"tools":[{"type":"function","function":{"name":"f"}}],
            "tool_choice":"auto","messages":[{"role":"user","content":"hi"}]});
        let retry = text_tool_body(&body).unwrap();
        assert!(retry.get("tools").is_none() && retry.get("tool_choice").is_none());
        assert_eq!(retry["messages"][0]["role"], "system");
        assert!(
            retry["messages"][0]["content"]
                .as_str()
                .unwrap()
                .contains("<tool_call>")
        );
        assert_eq!(retry["messages"][1]["content"], "hi");
        // An existing leading system message is extended, not duplicated.
        let body = json!({"tools":[{}],"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]});
        let retry = text_tool_body(&body).unwrap();
        let system = retry["messages"][0]["content"].as_str().unwrap();
        assert!(system.starts_with("be brief\n\n") && system.contains("\"name\":"));
        assert_eq!(retry["messages"].as_array().unwrap().len(), 2);
        // No tools: no fallback.
        assert!(text_tool_body(&json!({"messages":[]})).is_none());
        assert!(text_tool_body(&json!({"tools":[],"messages":[]})).is_none());
    }

    #[test]
    fn tool_calls_take_openai_shape() {
        let v = openai_tool_calls(&[
            json!({"function":{"name":"get_weather","arguments":{"city":"Seoul"}}}),
        ]);
        assert_eq!(v[0]["type"], "function");
        assert_eq!(v[0]["function"]["name"], "get_weather");
        assert_eq!(v[0]["function"]["arguments"], "{\"city\":\"Seoul\"}");
    }
}
