//! Tool calls on the OpenAI-compatible surface: native `openai_tool_calls` metadata, and the
//! text tool-call fallback (seed 000; the text form is defined in [`iop_wire::text_tools`]).
//!
//! Text calls are recovered only when the run's `Complete` event carries
//! `openai_text_tool_fallback = "true"`, and only calls that name a tool the request declared;
//! a span that is not one valid call stays in the content as text.

use std::collections::BTreeSet;

use iop_wire::runtime::RunEvent;
use iop_wire::text_tools;
use serde_json::{Value, json};

/// The function names a chat request declared in `tools` (empty when none).
pub(crate) fn declared(request: &Value) -> BTreeSet<String> {
    request["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The native tool calls of a `Complete` event, if any.
pub(crate) fn native(ev: &RunEvent) -> Option<Value> {
    ev.metadata
        .get(text_tools::META_TOOL_CALLS)
        .and_then(|t| serde_json::from_str::<Value>(t).ok())
        .filter(Value::is_array)
}

/// Whether the run used the text tool-call fallback.
pub(crate) fn used_text_fallback(ev: &RunEvent) -> bool {
    ev.metadata
        .get(text_tools::META_TEXT_TOOL_FALLBACK)
        .is_some_and(|v| v == "true")
}

/// The tool calls of a finished run and the content that remains: native calls as they are;
/// text calls recovered from `content` only under the fallback mark. `None` when there are no
/// calls (the content is then returned unchanged by the caller).
pub(crate) fn finish(
    ev: &RunEvent,
    content: &str,
    declared: &BTreeSet<String>,
) -> Option<(String, Value)> {
    if let Some(calls) = native(ev) {
        return Some((content.to_owned(), calls));
    }
    if !used_text_fallback(ev) {
        return None;
    }
    recover(content, declared)
}

/// Text tool calls in `content` naming a declared tool, in OpenAI's `tool_calls` shape, and the
/// text outside them (trimmed).
pub(crate) fn recover(content: &str, declared: &BTreeSet<String>) -> Option<(String, Value)> {
    let mut calls = Vec::new();
    let mut text = String::new();
    for segment in text_tools::segments(content) {
        match segment {
            text_tools::Segment::Text(t) => text.push_str(t),
            text_tools::Segment::Call { span, body } => match call(body, declared, calls.len()) {
                Some(c) => calls.push(c),
                // Not one valid call of a declared tool: it stays content, as written.
                None => text.push_str(span),
            },
        }
    }
    if calls.is_empty() {
        return None;
    }
    Some((text.trim().to_owned(), Value::Array(calls)))
}

fn call(body: &str, declared: &BTreeSet<String>, index: usize) -> Option<Value> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v["name"].as_str()?;
    if !declared.contains(name) {
        return None;
    }
    let arguments = match &v["arguments"] {
        Value::Object(_) => v["arguments"].to_string(),
        Value::Null => "{}".to_owned(),
        _ => return None,
    };
    Some(json!({
        "id": format!("call_{index}"),
        "type": "function",
        "function": { "name": name, "arguments": arguments },
    }))
}

/// Streaming content for a request that declared tools: text that might be a text tool call is
/// held back until `Complete` says whether the fallback was used.
#[derive(Debug, Default)]
pub(crate) struct HoldBack {
    pending: String,
}

impl HoldBack {
    /// Adds a delta; returns the content that can be sent now.
    pub(crate) fn push(&mut self, delta: &str) -> String {
        self.pending.push_str(delta);
        let n = text_tools::safe_prefix_len(&self.pending);
        let out = self.pending[..n].to_owned();
        self.pending.drain(..n);
        out
    }

    /// Everything still held.
    pub(crate) fn take(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use iop_wire::runtime::RunEventKind;

    fn names(n: &[&str]) -> BTreeSet<String> {
        n.iter().map(|s| (*s).to_owned()).collect()
    }

    fn complete(meta: &[(&str, &str)]) -> RunEvent {
        let mut ev = RunEvent::new(RunEventKind::Complete);
        ev.metadata = meta
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        ev
    }

    const TEXT: &str = "Let me check.\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>";

    #[test]
    fn text_calls_only_under_the_fallback_mark() {
        let tools = names(&["get_weather"]);
        assert!(finish(&complete(&[]), TEXT, &tools).is_none());
        assert!(
            finish(
                &complete(&[("openai_text_tool_fallback", "false")]),
                TEXT,
                &tools
            )
            .is_none()
        );
        let (text, calls) = finish(
            &complete(&[("openai_text_tool_fallback", "true")]),
            TEXT,
            &tools,
        )
        .unwrap();
        assert_eq!(text, "Let me check.");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(calls[0]["type"], "function");
    }

    #[test]
    fn undeclared_or_malformed_spans_stay_text() {
        let ev = complete(&[("openai_text_tool_fallback", "true")]);
        assert!(finish(&ev, TEXT, &names(&["other"])).is_none());
        let mixed = "a<tool_call>not json</tool_call>b<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>c";
        let (text, calls) = finish(&ev, mixed, &names(&["f"])).unwrap();
        assert_eq!(text, "a<tool_call>not json</tool_call>bc");
        assert_eq!(calls.as_array().unwrap().len(), 1);
        let bad_args = "<tool_call>{\"name\":\"f\",\"arguments\":[1]}</tool_call>";
        assert!(finish(&ev, bad_args, &names(&["f"])).is_none());
    }

    #[test]
    fn native_calls_win() {
        let ev = complete(&[(
            "openai_tool_calls",
            r#"[{"id":"call_0","type":"function","function":{"name":"f","arguments":"{}"}}]"#,
        )]);
        let (text, calls) = finish(&ev, "", &BTreeSet::new()).unwrap();
        assert_eq!(text, "");
        assert_eq!(calls[0]["id"], "call_0");
    }

    #[test]
    fn holdback_releases_plain_text_and_keeps_tags() {
        let mut h = HoldBack::default();
        let mut sent = String::new();
        for piece in [
            "Let me ",
            "check.\n<to",
            "ol_call>{\"name\"",
            ": \"f\"}</tool_call>",
        ] {
            sent.push_str(&h.push(piece));
        }
        assert_eq!(sent, "Let me check.\n");
        assert!(h.take().starts_with("<tool_call>"));
        let mut h = HoldBack::default();
        assert_eq!(h.push("a <"), "a ");
        assert_eq!(h.push("b>"), "<b>");
        assert_eq!(h.take(), "");
    }
}
