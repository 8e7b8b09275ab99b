//! Untrusted upstream bytes through `iop_dialect::StreamTranslator` (the Edge's translation of a
//! provider's SSE stream into the client's dialect).
//!
//! Input: byte 0 picks the upstream dialect (bit 0: chat or Anthropic) and the client encoder
//! (`/ 2 % 3`: chat, Responses, Messages); byte 1 is a split point (as a fraction of the body);
//! the rest is the upstream body.
//!
//! Oracles: never panics; the output does not depend on where the body is split (whole, at the
//! chosen point, one byte at a time for short bodies); the output is bounded (at most 64 bytes
//! per input byte plus 64 KiB: no amplification loop); it is UTF-8 SSE whose every `data:` line
//! is JSON (or chat's `[DONE]`); and when neither side reported an error, the client's output
//! decoded again says the same text as the upstream (chat and Messages outputs).

use iop_dialect::decode::{ChatStreamDecoder, MessagesStreamDecoder};
use iop_dialect::encode::{ChatStreamEncoder, MessagesStreamEncoder, ResponsesStreamEncoder};
use iop_dialect::{Encoder, Event, Message, Meta, StreamTranslator, Upstream};

fn encoder(which: u8) -> Encoder {
    let meta = Meta {
        id: "x".into(),
        model: "m".into(),
        created: 1,
    };
    match which % 3 {
        0 => Encoder::Chat(ChatStreamEncoder::new(meta, which & 4 != 0)),
        1 => Encoder::Responses(ResponsesStreamEncoder::new(
            meta,
            serde_json::Value::Object(Default::default()),
        )),
        _ => Encoder::Messages(MessagesStreamEncoder::new(meta)),
    }
}

fn translate(upstream: Upstream, which: u8, chunks: &[&[u8]]) -> Vec<u8> {
    let mut t = StreamTranslator::new(upstream, encoder(which));
    let mut out = Vec::new();
    for c in chunks {
        t.feed(c, &mut out);
    }
    t.finish(&mut out);
    let mut bytes = Vec::new();
    iop_dialect::sse::SseEvent::write_all(&out, &mut bytes);
    bytes
}

/// The meaning of a stream in `upstream`'s dialect: `None` when decoding failed or the stream
/// carried an error.
fn fold(upstream: Upstream, body: &[u8]) -> Option<Message> {
    let mut events = Vec::new();
    match upstream {
        Upstream::Chat => {
            let mut d = ChatStreamDecoder::new();
            d.feed(body, &mut events).ok()?;
            d.finish(&mut events).ok()?;
        }
        Upstream::Messages => {
            let mut d = MessagesStreamDecoder::new();
            d.feed(body, &mut events).ok()?;
            d.finish(&mut events).ok()?;
        }
    }
    if events.iter().any(|e| matches!(e, Event::Error(_))) {
        return None;
    }
    let mut m = Message::default();
    for e in &events {
        m.apply(e);
    }
    Some(m)
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let [select, split, body @ ..] = data else {
        return;
    };
    let upstream = if select & 1 == 0 {
        Upstream::Chat
    } else {
        Upstream::Messages
    };
    let which = select >> 1;
    let whole = translate(upstream, which, &[body]);
    let cut = usize::from(*split) * body.len() / 255;
    assert_eq!(
        translate(upstream, which, &[&body[..cut], &body[cut..]]),
        whole,
        "split at {cut}"
    );
    if body.len() <= 512 {
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(translate(upstream, which, &bytes), whole, "byte by byte");
    }
    assert!(
        whole.len() <= 64 * body.len() + 64 * 1024,
        "{} output bytes for {} input bytes",
        whole.len(),
        body.len()
    );
    let text = std::str::from_utf8(&whole).expect("output is UTF-8");
    let mut client_error = false;
    for line in text.lines() {
        if let Some(data) = line.strip_prefix("data: ") {
            if data == "[DONE]" {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data).expect("data is JSON");
            if v.get("error").is_some_and(|e| !e.is_null()) || v["type"] == "response.failed" {
                client_error = true;
            }
        } else {
            assert!(
                line.is_empty() || line.starts_with("event: "),
                "not SSE: {line}"
            );
        }
    }
    let decoder = match which % 3 {
        0 => Some(Upstream::Chat),
        2 => Some(Upstream::Messages),
        _ => None,
    };
    if let (false, Some(client), Some(want)) = (client_error, decoder, fold(upstream, body))
        && let Some(got) = fold(client, &whole)
    {
        assert_eq!(
            got.text, want.text,
            "the client hears what the upstream said"
        );
    }
}
