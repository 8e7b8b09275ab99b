//! A passthrough request body: the client's own bytes with only `model` replaced.
//!
//! On a passthrough the Edge forwards the client's request to an upstream of the same dialect.
//! All it changes is `model` (the route's target) and, on a chat completions stream, it may ask
//! for the usage chunk (`"stream_options":{"include_usage":true}`). Re-serialising the parsed
//! body for that costs a walk of the whole value, an allocation per string, and changes the
//! client's bytes (member order, number spelling) for no reason. [`passthrough`] instead copies
//! the client's bytes once, with the `model` member's value replaced and, when asked, the
//! `stream_options` member put first; when `model` is already the target and nothing is
//! inserted, the client's buffer itself is forwarded (no copy).
//!
//! # When it declines
//!
//! The splice is only taken where the result provably means what the Edge parsed. It returns
//! `None`, and the caller re-serialises the parsed value instead, when:
//!
//! - a top-level member name appears twice. JSON parsers disagree on duplicates (`serde_json`
//!   keeps the last, others the first), so a second `model` or `stream` hiding behind the one
//!   the Edge read could send the upstream another model, or another mode, than the one the Edge
//!   admitted and charges for. Re-serialising leaves one of each: the one the Edge read;
//! - a top-level member name has an escape in it (`"mod\u0065l"` is `model`);
//! - the usage chunk must be asked for and the client sent a `stream_options` other than
//!   exactly `{"include_usage":true}` (merging into it is left to the re-serialiser);
//! - more than [`MAX_MEMBERS`] top-level members, or bytes that are not one JSON object whose
//!   `model` is a string (the caller parsed them first; this never trusts that).
//!
//! The scanner walks the top level only, without recursion, and holds one small vector of
//! member positions: its cost is one pass over the bytes. It is fuzzed (`fuzz/`,
//! `passthrough_splice`): whatever it returns parses to exactly the value the re-serialiser
//! would have sent, with no name twice.

use bytes::Bytes;
use serde_json::Value;
use std::ops::Range;

/// The most top-level members a body may have for the splice to be taken (a chat request has
/// about a dozen; beyond this the re-serialiser is used).
pub const MAX_MEMBERS: usize = 64;

/// What the Edge inserts to ask a chat completions stream for its usage chunk.
const ASK_USAGE: &[u8] = br#""stream_options":{"include_usage":true},"#;
/// A client's own `stream_options` that already asks for usage (whitespace aside).
const ASKED_USAGE: &[u8] = br#"{"include_usage":true}"#;

/// The body spliced for a passthrough.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spliced {
    /// The bytes to forward.
    pub body: Bytes,
    /// The Edge asked for the usage chunk and the client had not (the caller takes that chunk
    /// out of the client's stream, `sse::UsageChunkFilter`).
    pub asked_usage: bool,
}

/// The client's `raw` body with `model` set to `target`, and with the usage chunk asked for
/// when `ask_usage` and the client has not asked. `parsed` is `raw` as the Edge parsed it.
///
/// `None` when the splice cannot be shown to mean what `parsed` means (see the module docs);
/// the caller then sends [`reserialised`] instead.
pub fn passthrough(raw: &Bytes, parsed: &Value, target: &str, ask_usage: bool) -> Option<Spliced> {
    let object = parsed.as_object()?;
    object.get("model")?.as_str()?;
    let (open, members) = members(raw)?;
    // No name is escaped (`members` declines those), so the raw names are the parsed names
    // and the count differs exactly when a name appears twice (the parser folds duplicates).
    if members.len() != object.len() {
        return None;
    }
    let find = |name: &[u8]| members.iter().find(|m| raw[m.name.clone()] == *name);
    let model = find(b"model")?;
    if raw.get(model.value.start) != Some(&b'"') {
        return None;
    }
    let insert = match (ask_usage, find(b"stream_options")) {
        (false, _) => false,
        (true, None) => true,
        (true, Some(o)) if without_whitespace(&raw[o.value.clone()]) == ASKED_USAGE => false,
        (true, Some(_)) => return None,
    };
    let target = Value::String(target.to_owned()).to_string();
    if !insert && raw[model.value.clone()] == *target.as_bytes() {
        return Some(Spliced {
            body: raw.clone(),
            asked_usage: false,
        });
    }
    let mut out = Vec::with_capacity(
        raw.len() - model.value.len() + target.len() + if insert { ASK_USAGE.len() } else { 0 },
    );
    out.extend_from_slice(&raw[..=open]);
    if insert {
        out.extend_from_slice(ASK_USAGE);
    }
    out.extend_from_slice(&raw[open + 1..model.value.start]);
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(&raw[model.value.end..]);
    Some(Spliced {
        body: Bytes::from(out),
        asked_usage: insert,
    })
}

/// What [`passthrough`] declines to splice, the other way: `parsed` with `model` set to
/// `target` (and the usage chunk asked for when `ask_usage`), serialised. Each name appears
/// once, with the value the Edge read.
pub fn reserialised(mut parsed: Value, target: &str, ask_usage: bool) -> Spliced {
    if let Some(o) = parsed.as_object_mut() {
        o.insert("model".into(), Value::String(target.to_owned()));
    }
    let asked_usage = ask_usage && ask_for_usage(&mut parsed);
    Spliced {
        body: Bytes::from(parsed.to_string()),
        asked_usage,
    }
}

/// Asks a chat completions stream for its usage chunk (`stream_options.include_usage`), so
/// that it is charged exactly; `true` when the client had not asked (the chunk is then taken
/// out of a passthrough, [`crate::sse::UsageChunkFilter`]). A non-object `stream_options` is
/// replaced.
pub fn ask_for_usage(body: &mut Value) -> bool {
    if body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true)
    {
        return false;
    }
    let Some(o) = body.as_object_mut() else {
        return false;
    };
    match o.get_mut("stream_options") {
        Some(Value::Object(options)) => {
            options.insert("include_usage".into(), Value::Bool(true));
        }
        _ => {
            o.insert(
                "stream_options".into(),
                serde_json::json!({ "include_usage": true }),
            );
        }
    }
    true
}

/// One top-level member: where its name is (without the quotes) and where its value is.
#[derive(Debug)]
struct Member {
    name: Range<usize>,
    value: Range<usize>,
}

/// The position of the opening brace and the members of the one JSON object in `b`. `None`
/// for anything else, for an escaped name, or for more than [`MAX_MEMBERS`] members.
fn members(b: &[u8]) -> Option<(usize, Vec<Member>)> {
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    let open = i;
    i = skip_ws(b, i + 1);
    let mut out = Vec::new();
    if b.get(i) == Some(&b'}') {
        return (skip_ws(b, i + 1) == b.len()).then_some((open, out));
    }
    loop {
        if out.len() == MAX_MEMBERS || b.get(i) != Some(&b'"') {
            return None;
        }
        let name_end = string_end(b, i)?;
        let name = i + 1..name_end - 1;
        if b[name.clone()].contains(&b'\\') {
            return None;
        }
        i = skip_ws(b, name_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_ws(b, i + 1);
        let end = value_end(b, start)?;
        out.push(Member {
            name,
            value: start..end,
        });
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return (skip_ws(b, i + 1) == b.len()).then_some((open, out)),
            _ => return None,
        }
    }
}

fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).copied().is_some_and(is_ws) {
        i += 1;
    }
    i
}

/// The index just past the string that opens at `i` (a `"`).
///
/// Jumps from one quote or backslash to the next with `memchr` (a prompt is mostly one long
/// string: byte by byte, this scan was 6 % of the Edge's instructions per request).
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        j += memchr::memchr2(b'"', b'\\', b.get(j..)?)?;
        if b[j] == b'"' {
            return Some(j + 1);
        }
        j += 2;
    }
}

/// The index just past the value that starts at `i`: a string, an object or array (matched
/// brackets, strings skipped, no recursion), or a literal or number (up to a delimiter).
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match *b.get(j)? {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while b
                .get(j)
                .is_some_and(|&c| !is_ws(c) && !matches!(c, b',' | b'}' | b']'))
            {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// `b` without the whitespace between tokens (inside strings it stays: `"include_usage "` is
/// another name).
fn without_whitespace(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    let (mut in_string, mut escaped) = (false, false);
    for &c in b {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_string = false;
            }
        } else if c == b'"' {
            in_string = true;
        } else if is_ws(c) {
            continue;
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splice(raw: &str, target: &str, ask_usage: bool) -> Option<(String, bool)> {
        let parsed: Value = serde_json::from_str(raw).unwrap();
        passthrough(
            &Bytes::copy_from_slice(raw.as_bytes()),
            &parsed,
            target,
            ask_usage,
        )
        .map(|s| (String::from_utf8(s.body.to_vec()).unwrap(), s.asked_usage))
    }

    #[test]
    fn only_the_model_value_changes() {
        let raw = r#"{ "messages": [{"role":"user","content":"a \"model\": x"}],
            "model" : "alias", "temperature": 1.50, "n": 1e0 }"#;
        let (out, asked) = splice(raw, "gpt-4o", false).unwrap();
        assert!(!asked);
        assert_eq!(out, raw.replace(r#""alias""#, r#""gpt-4o""#));
    }

    #[test]
    fn the_target_is_escaped_as_json() {
        let (out, _) = splice(r#"{"model":"a"}"#, "x\"y\\z\u{1}", false).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["model"], "x\"y\\z\u{1}");
    }

    #[test]
    fn an_unchanged_body_is_the_clients_own_buffer() {
        let raw = Bytes::from_static(br#"{"model":"m","stream":true}"#);
        let parsed: Value = serde_json::from_slice(&raw).unwrap();
        let s = passthrough(&raw, &parsed, "m", false).unwrap();
        assert_eq!(s.body.as_ptr(), raw.as_ptr(), "forwarded without a copy");
    }

    #[test]
    fn usage_is_asked_for_once() {
        let (out, asked) = splice(r#"{"model":"a","stream":true}"#, "b", true).unwrap();
        assert!(asked);
        assert_eq!(
            out,
            r#"{"stream_options":{"include_usage":true},"model":"b","stream":true}"#
        );
        let raw = r#"{"model":"a","stream_options": { "include_usage" : true }}"#;
        let (out, asked) = splice(raw, "b", true).unwrap();
        assert!(!asked, "the client asked itself");
        assert_eq!(out, raw.replace(r#""a""#, r#""b""#));
        // Any other stream_options is merged by the re-serialiser.
        assert_eq!(
            splice(
                r#"{"model":"a","stream_options":{"include_usage":false}}"#,
                "b",
                true
            ),
            None
        );
        assert_eq!(
            splice(
                r#"{"model":"a","stream_options":{"include_usage":true,"x":1}}"#,
                "b",
                true
            ),
            None
        );
        // Whitespace inside a name is part of it (found by the fuzzer).
        assert_eq!(
            splice(
                r#"{"model":"a","stream_options":{"include_usage ":true}}"#,
                "b",
                true
            ),
            None
        );
    }

    #[test]
    fn a_hidden_second_model_is_refused() {
        // serde_json reads the last `model`; a first-wins upstream would read the first.
        assert_eq!(splice(r#"{"model":"cheap","model":"a"}"#, "b", false), None);
        assert_eq!(
            splice(r#"{"model":"a","stream":false,"stream":true}"#, "b", false),
            None
        );
        assert_eq!(
            splice(r#"{"mod\u0065l":"cheap","model":"a"}"#, "b", false),
            None
        );
        assert_eq!(
            splice(r#"{"model":"a","\u0073tream":true}"#, "b", false),
            None
        );
    }

    #[test]
    fn nested_names_are_not_members() {
        let raw = r#"{"metadata":{"model":"x","model":"y"},"model":"a","tools":[{"model":1}]}"#;
        let (out, _) = splice(raw, "b", false).unwrap();
        assert_eq!(out, raw.replace(r#""model":"a""#, r#""model":"b""#));
    }

    #[test]
    fn anything_but_one_object_is_declined() {
        let v: Value = serde_json::from_str(r#"{"model":"a"}"#).unwrap();
        for raw in [
            &b""[..],
            b"[]",
            br#"{"model":"a"} {}"#,
            br#"{"model":"a""#,
            br#"{"model":"a",}"#,
            br#"{"model":}"#,
            br#"{"model" "a"}"#,
            br#"{"model":"a}"#,
            br#"{"model":"a","x":[}"#,
        ] {
            assert_eq!(
                passthrough(&Bytes::from_static(raw), &v, "b", false),
                None,
                "{raw:?}"
            );
        }
        let many: String = (0..=MAX_MEMBERS)
            .map(|i| format!(r#""k{i}":{i},"#))
            .collect::<String>();
        assert_eq!(
            splice(&format!(r#"{{{many}"model":"a"}}"#), "b", false),
            None
        );
    }
}
