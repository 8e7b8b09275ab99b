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

use std::hint::black_box;

use bytes::BytesMut;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use iop_wire::codec::{Decoded, FrameCodec, LENGTH_PREFIX_LEN};
use iop_wire::runtime::RuntimeFrame;

mod common;
use common::frames;

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
