//! Frame codec micro-benchmarks: the domain codec (`FrameCodec` + validated domain types)
//! against raw prost on the same bytes, measured in the same run so the ratio survives a noisy
//! machine. See `benches/README.md`.
//!
//! Groups (throughput in envelope bytes, so all groups are comparable):
//! - `domain_encode/<frame>`: `FrameCodec::encode` (by reference: the frame is cloned into the
//!   envelope) into a reused `BytesMut`;
//! - `domain_decode/<frame>`: `FrameCodec::decode_bytes` (prefix, prost over the same `Bytes`,
//!   validation; no copy);
//! - `roundtrip/raw_prost/<frame>`: prost decode + `encode_to_vec` of the envelope, no domain
//!   conversion (the baseline);
//! - `roundtrip/domain/<frame>`: `decode_bytes` + `encode_owned` of the decoded frame (into a
//!   reused `BytesMut`), as the tokio codec does: it decodes from its read buffer without a copy
//!   and encodes the frames it is given by value.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use iop_wire::codec::{Decoded, FrameCodec, LENGTH_PREFIX_LEN};
use iop_wire::runtime::{RunRequest, RuntimeFrame, RuntimeMessage, TunnelFrame, TunnelPayload};
use iop_wire::validate::ResponseStallTimeout;

/// A provider tunnel BODY carrying ~1 KiB of OpenAI-style SSE chunks.
fn tunnel_body_1k() -> RuntimeFrame {
    let mut sse = Vec::with_capacity(1100);
    let mut i = 0;
    while sse.len() < 1024 {
        sse.extend_from_slice(
            format!(
                "data: {{\"id\":\"chatcmpl-9x\",\"object\":\"chat.completion.chunk\",\
                 \"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token {i}\"}}}}]}}\n\n"
            )
            .as_bytes(),
        );
        i += 1;
    }
    RuntimeFrame::on_stream(
        4711,
        RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
            sequence: 42,
            payload: TunnelPayload::Body(Bytes::from(sse)),
            metadata: BTreeMap::new(),
        }),
    )
}

/// A normalized run request with a chat input and the usual metadata.
fn run_request() -> RuntimeFrame {
    let input = br#"{"model":"gpt-4o-mini","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Summarise the attached meeting notes in three bullet points."}],"temperature":0.2,"max_tokens":512,"stream":true}"#;
    let metadata = [
        ("trace_id", "4bf92f3577b34da6a3ce929d0e0e4736"),
        ("span_id", "00f067aa0ba902b7"),
        ("principal_id", "principal-17"),
        ("route_id", "route-eu-1"),
        ("session_id", "sess-8c1d2e"),
        ("client", "iop-edge/0.1.0"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    RuntimeFrame::on_stream(
        4712,
        RuntimeMessage::RunRequest(RunRequest {
            run_id: "run-01HZX3K5M7".into(),
            adapter: "openai-main".into(),
            target: "gpt-4o-mini".into(),
            input: Bytes::from_static(input),
            metadata,
            response_stall_timeout: ResponseStallTimeout::from_wire_ms(60_000)
                .expect("60 s is a valid stall timeout"),
            timeout: Some(Duration::from_secs(300)),
            long_context: false,
            credential: None,
        }),
    )
}

fn frames() -> Vec<(&'static str, RuntimeFrame)> {
    vec![
        ("tunnel_body_1k", tunnel_body_1k()),
        ("run_request", run_request()),
    ]
}

fn bench(c: &mut Criterion) {
    let codec = FrameCodec::new();
    for (name, frame) in frames() {
        let framed = codec.encode_to_bytes(&frame).expect("bench frame encodes");
        let envelope = framed.slice(LENGTH_PREFIX_LEN..);
        let bytes = Throughput::Bytes(envelope.len() as u64);

        // Both paths must produce the same envelope, or the comparison is meaningless.
        let raw = iop_wire::__private::prost_roundtrip_runtime(&envelope)
            .expect("bench frame decodes with prost");
        assert_eq!(raw, envelope[..], "{name}: raw prost re-encoding differs");

        let mut group = c.benchmark_group("domain_encode");
        group.throughput(bytes.clone());
        let mut buf = BytesMut::with_capacity(framed.len());
        group.bench_with_input(BenchmarkId::from_parameter(name), &frame, |b, frame| {
            b.iter(|| {
                buf.clear();
                codec.encode(black_box(frame), &mut buf).expect("encodes");
                black_box(buf.len())
            });
        });
        group.finish();

        let mut group = c.benchmark_group("domain_decode");
        group.throughput(bytes.clone());
        group.bench_with_input(BenchmarkId::from_parameter(name), &framed, |b, framed| {
            b.iter(|| codec.decode_bytes::<RuntimeFrame>(black_box(framed)));
        });
        group.finish();

        let mut group = c.benchmark_group("roundtrip");
        group.throughput(bytes);
        group.bench_with_input(BenchmarkId::new("raw_prost", name), &envelope, |b, env| {
            b.iter(|| iop_wire::__private::prost_roundtrip_runtime(black_box(env)));
        });
        let mut out = BytesMut::with_capacity(framed.len());
        group.bench_with_input(BenchmarkId::new("domain", name), &framed, |b, framed| {
            b.iter(|| {
                let Ok(Decoded::Frame { frame, .. }) =
                    codec.decode_bytes::<RuntimeFrame>(black_box(framed))
                else {
                    panic!("bench frame decodes");
                };
                out.clear();
                codec.encode_owned(frame, &mut out).expect("encodes");
                black_box(out.len())
            });
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
