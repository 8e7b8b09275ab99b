//! The text tool-call fallback contract shared by Node adapters and the Edge surface (seed
//! `000`, `RunEvent.metadata["openai_text_tool_fallback"]`).
//!
//! When a provider rejects the native tool API, an adapter may retry once without `tools` /
//! `tool_choice`, with an instruction merged into the leading system message asking the model
//! to write each tool call as text. It then marks the `Complete` event with
//! [`META_TEXT_TOOL_FALLBACK`] = `"true"`. Only for such runs may the Edge recover tool calls
//! from the assistant's content; otherwise the content is returned as it is, whatever it looks
//! like (the seed forbids synthesising `tool_calls` from ordinary text).
//!
//! # The text form (our choice; the seed names no syntax)
//!
//! One call is `<tool_call>{"name": "<function>", "arguments": {...}}</tool_call>`: the tags are
//! literal and case-sensitive, the body is one JSON object with a string `name` and an object
//! `arguments` (whitespace around the JSON is allowed). This is the form used by Hermes- and
//! Qwen-style chat templates, so many local models already produce it. Text outside the tags
//! stays assistant content. The JSON itself is checked by the Edge (this crate has no JSON
//! dependency); [`segments`] and [`split`] only find the tagged spans.
//!
//! Bounds: at most [`MAX_TEXT_TOOL_CALLS`] calls are recovered from one answer; the rest of the
//! text stays content.

/// Metadata key of native tool calls on `Complete`: a JSON array in OpenAI's `tool_calls` shape.
pub const META_TOOL_CALLS: &str = "openai_tool_calls";
/// Metadata key set to `"true"` on `Complete` when the adapter used the text tool-call fallback.
pub const META_TEXT_TOOL_FALLBACK: &str = "openai_text_tool_fallback";
/// Opening tag of a text tool call.
pub const OPEN: &str = "<tool_call>";
/// Closing tag of a text tool call.
pub const CLOSE: &str = "</tool_call>";
/// Most calls recovered from one answer.
pub const MAX_TEXT_TOOL_CALLS: usize = 64;

/// The instruction an adapter merges into the leading system message, given the declared tools
/// as JSON text (the request's `tools` array, serialized).
#[must_use]
pub fn instruction(tools_json: &str) -> String {
    format!(
        "You can call tools. To call a tool, answer with one line per call of the exact form \
         {OPEN}{{\"name\": \"<tool name>\", \"arguments\": {{...}}}}{CLOSE} and nothing else \
         on that line. Only use these tools: {tools_json}"
    )
}

/// A piece of assistant content: text, or one complete `<tool_call>…</tool_call>` span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment<'a> {
    /// Text outside the tags (an unclosed opening tag, and anything after the
    /// [`MAX_TEXT_TOOL_CALLS`]th span, stays text).
    Text(&'a str),
    /// A complete span: `span` is the whole tagged text, `body` what is between the tags.
    Call {
        /// The span as written, tags included.
        span: &'a str,
        /// The text between the tags.
        body: &'a str,
    },
}

/// The content cut into [`Segment`]s, in order (at most [`MAX_TEXT_TOOL_CALLS`] calls).
pub fn segments(content: &str) -> impl Iterator<Item = Segment<'_>> {
    let mut rest = content;
    let mut calls = 0;
    let mut pending_call: Option<Segment<'_>> = None;
    std::iter::from_fn(move || {
        if let Some(call) = pending_call.take() {
            return Some(call);
        }
        if rest.is_empty() {
            return None;
        }
        let found = (calls < MAX_TEXT_TOOL_CALLS)
            .then(|| rest.find(OPEN))
            .flatten()
            .and_then(|start| {
                let body_start = start + OPEN.len();
                let len = rest[body_start..].find(CLOSE)?;
                Some((
                    start,
                    body_start,
                    body_start + len,
                    body_start + len + CLOSE.len(),
                ))
            });
        let Some((start, body_start, body_end, end)) = found else {
            return Some(Segment::Text(std::mem::take(&mut rest)));
        };
        calls += 1;
        let call = Segment::Call {
            span: &rest[start..end],
            body: &rest[body_start..body_end],
        };
        let text = &rest[..start];
        rest = &rest[end..];
        if text.is_empty() {
            Some(call)
        } else {
            pending_call = Some(call);
            Some(Segment::Text(text))
        }
    })
}

/// The assistant content split into its text outside the tags and the bodies of complete
/// `<tool_call>…</tool_call>` spans ([`segments`], collected).
#[must_use]
pub fn split(content: &str) -> (String, Vec<&str>) {
    let mut text = String::new();
    let mut calls = Vec::new();
    for segment in segments(content) {
        match segment {
            Segment::Text(t) => text.push_str(t),
            Segment::Call { body, .. } => calls.push(body),
        }
    }
    (text, calls)
}

/// How many leading bytes of `pending` can be emitted as content while streaming, before the
/// run's `Complete` says whether the fallback was used: everything before the first opening tag,
/// or before a suffix that could still become one. The rest must be held back.
#[must_use]
pub fn safe_prefix_len(pending: &str) -> usize {
    if let Some(start) = pending.find(OPEN) {
        return start;
    }
    // The longest suffix of `pending` that is a proper prefix of OPEN.
    for k in (1..OPEN.len()).rev() {
        if pending.len() >= k && pending.is_char_boundary(pending.len() - k) {
            let suffix = &pending[pending.len() - k..];
            if OPEN.starts_with(suffix) {
                return pending.len() - k;
            }
        }
    }
    pending.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_finds_complete_spans_only() {
        let (text, calls) = split("a<tool_call>{\"x\":1}</tool_call>b<tool_call>{}</tool_call>");
        assert_eq!(text, "ab");
        assert_eq!(calls, vec!["{\"x\":1}", "{}"]);
        let (text, calls) = split("plain <tool_call>{unclosed");
        assert_eq!(text, "plain <tool_call>{unclosed");
        assert!(calls.is_empty());
        let (text, calls) = split("no tags");
        assert_eq!((text.as_str(), calls.len()), ("no tags", 0));
    }

    #[test]
    fn split_is_bounded() {
        let many = "<tool_call>{}</tool_call>".repeat(MAX_TEXT_TOOL_CALLS + 3);
        let (text, calls) = split(&many);
        assert_eq!(calls.len(), MAX_TEXT_TOOL_CALLS);
        assert_eq!(text, "<tool_call>{}</tool_call>".repeat(3));
    }

    #[test]
    fn safe_prefix_holds_back_possible_tags() {
        assert_eq!(safe_prefix_len("hello"), 5);
        assert_eq!(safe_prefix_len("hello <"), 6);
        assert_eq!(safe_prefix_len("hello <tool_"), 6);
        assert_eq!(safe_prefix_len("hi <tool_call>{"), 3);
        assert_eq!(safe_prefix_len("a <b"), 4);
        assert_eq!(safe_prefix_len("é<"), "é".len());
        assert_eq!(safe_prefix_len(""), 0);
    }
}
