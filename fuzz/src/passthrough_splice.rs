//! A client's request body through `iop_dialect::splice::passthrough` (the Edge forwarding the
//! client's bytes with only `model` replaced).
//!
//! Input: byte 0 chooses whether the usage chunk is asked for (bit 0) and the target (bits 1–2:
//! the body's own model, a plain name, one with quotes and escapes, an empty one); the rest is
//! the body.
//!
//! Oracles: never panics, on any bytes (also against a parsed value that is not theirs). When
//! the body parses as a JSON object with a string `model` and the splice is taken, the spliced
//! bytes parse to exactly the value `splice::reserialised` sends (compared as values before it
//! serialises them: `serde_json` does not round-trip every float, and the splice keeps the
//! client's spelling), ask for usage exactly when it does, name each top-level member once (read by a parser that keeps every member, so a
//! duplicate `serde_json` would fold cannot hide), and are the client's own buffer when nothing
//! changed.

use bytes::Bytes;
use iop_dialect::splice::{ask_for_usage, passthrough};
use serde::de::{Deserializer as _, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;

/// One input.
pub fn run(data: &[u8]) {
    let [flags, body @ ..] = data else {
        return;
    };
    let raw = Bytes::copy_from_slice(body);
    let ask = flags & 1 == 1;
    // Whatever the bytes, against a value that is not theirs: no panic.
    let other = serde_json::json!({ "model": "m", "stream": true });
    let _ = passthrough(&raw, &other, "t", ask);

    let Ok(parsed) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    let Some(model) = parsed.get("model").and_then(Value::as_str) else {
        return;
    };
    let target = match (flags >> 1) & 3 {
        0 => model.to_owned(),
        1 => "gpt-4o".to_owned(),
        2 => "a \"quoted\" \\ name\u{1}\u{e9}".to_owned(),
        _ => String::new(),
    };
    let Some(spliced) = passthrough(&raw, &parsed, &target, ask) else {
        return;
    };
    // What `splice::reserialised` sends, before it is serialised (serialising would not
    // compare: `serde_json` does not round-trip every float; the splice keeps the client's
    // spelling).
    let mut want = parsed;
    want["model"] = Value::String(target.clone());
    let asked = ask && ask_for_usage(&mut want);
    let got: Value = serde_json::from_slice(&spliced.body).expect("the splice is JSON");
    assert_eq!(got, want, "the splice means another request");
    assert_eq!(spliced.asked_usage, asked);
    let names = top_level_names(&spliced.body).expect("the splice is an object");
    for (i, n) in names.iter().enumerate() {
        assert!(!names[..i].contains(n), "`{n}` twice in the splice");
    }
    if spliced.body == raw {
        assert_eq!(
            spliced.body.as_ptr(),
            raw.as_ptr(),
            "an unchanged body is not copied"
        );
    }
}

/// Every top-level member name of the object in `b`, duplicates kept, escapes decoded.
fn top_level_names(b: &[u8]) -> Option<Vec<String>> {
    struct Names;
    impl<'de> Visitor<'de> for Names {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some((k, IgnoredAny)) = map.next_entry::<String, IgnoredAny>()? {
                out.push(k);
            }
            Ok(out)
        }
    }
    serde_json::Deserializer::from_slice(b)
        .deserialize_map(Names)
        .ok()
}
