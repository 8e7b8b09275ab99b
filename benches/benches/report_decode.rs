//! `ReportRuntime`'s decode into canonical counters (`proxypool_controller::grpc::report::
//! decode`), beside its baselines in the same run:
//!
//! - `report_decode/ours`: the controller's decoder on a 1000-counter request shaped as
//!   `proxypool_load` sends it (`proxy-00000` … `proxy-00999`, small counts, sorted);
//! - `report_decode/ours_unsorted`: the same counters in reverse order (the builder sorts once
//!   at the end);
//! - `report_decode/prost`: prost's decode of the generated message and the same checks
//!   (`decode_reference`), what the decoder replaced;
//! - `report_decode/sha256`: SHA-256 of the canonical counters, the one pass over them the
//!   controller makes anyway (the report's content digest);
//! - `report_decode/copy`: one copy of the request's bytes, the floor of reading them.
#![allow(clippy::unwrap_used, missing_docs, reason = "benchmark scaffolding")]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use proxypool_controller::domain::Report;
use proxypool_controller::grpc::report::{decode, decode_reference};
use proxypool_controller::proto::controlplane as pb;

const COUNTERS: usize = 1000;

fn request(reverse: bool) -> Vec<u8> {
    let mut counters: Vec<pb::ProxyCounters> = (0..COUNTERS)
        .map(|i| pb::ProxyCounters {
            proxy_id: format!("proxy-{i:05}"),
            in_flight: (i % 7) as i64,
            open_connections: (i % 3) as i64,
        })
        .collect();
    if reverse {
        counters.reverse();
    }
    let m = pb::ReportRuntimeRequest {
        worker_id: "worker-0001".into(),
        session_id: vec![7; 16].into(),
        sequence: 42,
        snapshot_version: 3,
        ownership_epoch: 1,
        observed_at_unix_ms: 1_764_460_800_000,
        counters,
    };
    prost::Message::encode_to_vec(&m)
}

fn bench(c: &mut Criterion) {
    let sorted = request(false);
    let reversed = request(true);
    let canonical = decode(&sorted, COUNTERS)
        .unwrap()
        .counters
        .unwrap()
        .canonical()
        .to_vec();
    // The two orders decode to the same canonical counters.
    assert_eq!(
        decode(&reversed, COUNTERS)
            .unwrap()
            .counters
            .unwrap()
            .canonical(),
        &canonical[..]
    );
    let mut g = c.benchmark_group("report_decode");
    g.throughput(Throughput::Elements(COUNTERS as u64));
    g.bench_function("ours", |b| {
        b.iter(|| decode(black_box(&sorted), COUNTERS).unwrap())
    });
    g.bench_function("ours_unsorted", |b| {
        b.iter(|| decode(black_box(&reversed), COUNTERS).unwrap())
    });
    g.bench_function("prost", |b| {
        b.iter(|| decode_reference(black_box(&sorted), COUNTERS).unwrap())
    });
    g.bench_function("sha256", |b| {
        b.iter(|| Report::digest_of(1_764_460_800_000, black_box(&canonical)))
    });
    g.bench_function("copy", |b| b.iter(|| black_box(&sorted).clone()));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
