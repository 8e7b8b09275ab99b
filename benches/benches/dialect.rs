//! The CPU cost of translating one streamed answer, beside its baseline in the same run.
//!
//! - `baseline/parse/<stream>`: what any consumer of the upstream stream pays at least: split
//!   the SSE events and parse each `data:` line as JSON (`serde_json::from_str`);
//! - `translate/<stream>-><dialect>`: `iop_dialect::StreamTranslator` over the same bytes
//!   (parse, decode into events, encode the client's SSE).
//!
//! Streams: the golden examples of `iop-edge/dialect/tests/golden/` (OpenAI's chat streaming
//! example, Anthropic's tool-use streaming example).
#![allow(clippy::unwrap_used, missing_docs, reason = "benchmark scaffolding")]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use iop_dialect::encode::{ChatStreamEncoder, MessagesStreamEncoder, ResponsesStreamEncoder};
use iop_dialect::{Encoder, Meta, StreamTranslator, Upstream};

fn golden(name: &str) -> Vec<u8> {
    std::fs::read(format!(
        "{}/../iop-edge/dialect/tests/golden/{name}.sse",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

fn encoder(to: &str) -> Encoder {
    let meta = Meta {
        id: "id".into(),
        model: "m".into(),
        created: 1,
    };
    match to {
        "chat" => Encoder::Chat(ChatStreamEncoder::new(meta, true)),
        "responses" => Encoder::Responses(ResponsesStreamEncoder::new(meta, serde_json::json!({}))),
        _ => Encoder::Messages(MessagesStreamEncoder::new(meta)),
    }
}

fn bench(c: &mut Criterion) {
    for (stream, upstream, targets) in [
        ("chat_stream", Upstream::Chat, ["responses", "messages"]),
        (
            "messages_tools_stream",
            Upstream::Messages,
            ["chat", "responses"],
        ),
    ] {
        let bytes = golden(stream);
        let mut g = c.benchmark_group(stream);
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        g.bench_function("baseline/parse", |b| {
            b.iter(|| {
                let text = std::str::from_utf8(black_box(&bytes)).unwrap();
                let mut n = 0;
                for line in text.lines() {
                    if let Some(d) = line.strip_prefix("data: ")
                        && let Ok(v) = serde_json::from_str::<serde_json::Value>(d)
                    {
                        n += usize::from(v.is_object());
                    }
                }
                n
            });
        });
        for to in targets {
            g.bench_function(format!("translate/{to}"), |b| {
                b.iter(|| {
                    let mut t = StreamTranslator::new(upstream, encoder(to));
                    let mut events = Vec::new();
                    t.feed(black_box(&bytes), &mut events);
                    t.finish(&mut events);
                    // The wire form too, as the earlier numbers (bytes out) measured it.
                    let mut out = Vec::with_capacity(8192);
                    iop_dialect::sse::SseEvent::write_all(&events, &mut out);
                    out
                });
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
