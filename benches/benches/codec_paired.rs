//! `codec_paired`: the frame codec's domain round trip against raw prost, measured in
//! alternating batches in one process, for a ratio that holds on a shared machine.
//!
//! ```text
//! cargo bench -p iop-benches --bench codec_paired
//! ```
//!
//! The same two paths as `frame_codec`'s `roundtrip` group (`decode_bytes` + `encode_owned`
//! into a reused buffer, against prost `Envelope::decode` + `encode_to_vec`), the same frames.
//! Criterion measures each benchmark for seconds, one after the other, so on this shared
//! machine the two sides of a ratio land in different load (per-run ratios moved by ±10 %).
//! Here each round times one batch of each path (≈ 5 ms, the order flipped every round), the
//! ratio is taken per round, and the median of `ROUNDS` rounds is reported with the median
//! time per operation of each path.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "bench"
)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use iop_wire::codec::{Decoded, FrameCodec, LENGTH_PREFIX_LEN};
use iop_wire::runtime::RuntimeFrame;

mod common;

const ROUNDS: usize = 61;
const BATCH: Duration = Duration::from_millis(5);

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let codec = FrameCodec::new();
    println!(
        "| frame | raw prost (baseline) | domain | raw ÷ domain, median of {ROUNDS} paired rounds [quartiles] |"
    );
    println!("|---|---:|---:|---:|");
    for (name, frame) in common::frames() {
        let framed = codec.encode_to_bytes(&frame).expect("bench frame encodes");
        let envelope = framed.slice(LENGTH_PREFIX_LEN..);
        let mut raw = || {
            black_box(iop_wire::__private::prost_roundtrip_runtime(black_box(
                &envelope,
            )));
        };
        let mut out = BytesMut::with_capacity(framed.len());
        let mut domain = || {
            let Ok(Decoded::Frame { frame, .. }) =
                codec.decode_bytes::<RuntimeFrame>(black_box(&framed))
            else {
                panic!("bench frame decodes");
            };
            out.clear();
            codec.encode_owned(frame, &mut out).expect("encodes");
            black_box(out.len());
        };
        // Same bytes out, or the comparison means nothing.
        assert_eq!(
            iop_wire::__private::prost_roundtrip_runtime(&envelope).unwrap(),
            envelope[..]
        );
        // Batch size: about BATCH of the raw path; warm both up.
        let t = Instant::now();
        let mut n = 0u64;
        while t.elapsed() < Duration::from_millis(200) {
            raw();
            domain();
            n += 1;
        }
        let per = t.elapsed().as_secs_f64() / n as f64 / 2.0;
        let batch = ((BATCH.as_secs_f64() / per) as u64).max(100);
        let (mut ratios, mut raw_ns, mut dom_ns) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let time = |f: &mut dyn FnMut()| {
                let t = Instant::now();
                for _ in 0..batch {
                    f();
                }
                t.elapsed().as_secs_f64() * 1e9 / batch as f64
            };
            let (r, d) = if round % 2 == 0 {
                let r = time(&mut raw);
                (r, time(&mut domain))
            } else {
                let d = time(&mut domain);
                (time(&mut raw), d)
            };
            ratios.push(r / d);
            raw_ns.push(r);
            dom_ns.push(d);
        }
        let mut sorted = ratios.clone();
        sorted.sort_by(f64::total_cmp);
        let (q1, q3) = (sorted[ROUNDS / 4], sorted[3 * ROUNDS / 4]);
        println!(
            "| {name} | {:.0} ns | {:.0} ns | **{:.3}×** [{q1:.3}, {q3:.3}] |",
            median(&mut raw_ns),
            median(&mut dom_ns),
            median(&mut ratios)
        );
    }
}
