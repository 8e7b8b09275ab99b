//! The `ReportRuntime` decoder (`grpc::report::decode`) against its reference: prost's decode
//! of the generated message, then the counters through the service's builder
//! (`decode_reference`). For every input, both decode with equal results, or both refuse.
//!
//! The inputs: generated requests (valid and invalid ids, negative and huge counts, unsorted
//! and repeated proxies) encoded by prost, then extra raw fields spliced in (unknown fields of
//! every wire type, groups nested to prost's recursion limit and past it, repeated scalars,
//! known fields with the wrong wire type, bad UTF-8, bad keys), then random byte edits.
#![allow(clippy::unwrap_used, reason = "test")]

use proptest::prelude::*;
use proxypool_controller::domain::{CanonicalReportCommand, ServiceError};
use proxypool_controller::grpc::report::{decode, decode_reference};
use proxypool_controller::proto::controlplane as pb;

fn varint(mut v: u64, out: &mut Vec<u8>) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn key(tag: u32, wire: u8, out: &mut Vec<u8>) {
    varint((u64::from(tag) << 3) | u64::from(wire), out);
}

fn len_field(tag: u32, bytes: &[u8], out: &mut Vec<u8>) {
    key(tag, 2, out);
    varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

/// A group of `depth` nested groups under field `tag`, innermost holding one varint field.
fn groups(tag: u32, depth: usize, out: &mut Vec<u8>) {
    for _ in 0..depth {
        key(tag, 3, out);
    }
    key(1, 0, out);
    varint(7, out);
    for _ in 0..depth {
        key(tag, 4, out);
    }
}

/// Both decoders agree: equal values, or both refuse.
fn agree(buf: &[u8], max: usize) -> Result<Option<CanonicalReportCommand>, TestCaseError> {
    let ours = decode(buf, max);
    let reference = decode_reference(buf, max);
    match (&ours, &reference) {
        (Ok(a), Ok(b)) => {
            prop_assert_eq!(a, b);
            Ok(Some(a.clone()))
        }
        (Err(_), Err(_)) => Ok(None),
        _ => {
            prop_assert!(
                false,
                "disagree on {:02x?}: ours {:?}, prost {:?}",
                buf,
                ours.map(|_| ()),
                reference.map(|_| ())
            );
            Ok(None)
        }
    }
}

fn id() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z][a-z0-9._-]{0,12}",
        1 => Just(String::new()),
        1 => Just("x".repeat(129)),
        1 => Just("bad id".to_owned()),
        1 => Just("é".to_owned()),
        1 => Just("-lead".to_owned()),
    ]
}

fn count() -> impl Strategy<Value = i64> {
    prop_oneof![4 => 0..10i64, 1 => any::<i64>()]
}

fn request() -> impl Strategy<Value = pb::ReportRuntimeRequest> {
    (
        id(),
        prop::collection::vec(any::<u8>(), 0..20),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<i64>(),
        prop::collection::vec((id(), count(), count()), 0..12),
    )
        .prop_map(|(worker_id, sid, sequence, v, e, observed, counters)| {
            pb::ReportRuntimeRequest {
                worker_id,
                session_id: sid.into(),
                sequence,
                snapshot_version: v,
                ownership_epoch: e,
                observed_at_unix_ms: observed,
                counters: counters
                    .into_iter()
                    .map(
                        |(proxy_id, in_flight, open_connections)| pb::ProxyCounters {
                            proxy_id,
                            in_flight,
                            open_connections,
                        },
                    )
                    .collect(),
            }
        })
}

/// A raw field to splice into a message (top level or inside a counter).
fn extra() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // Unknown fields of every wire type.
        (8u32..40, any::<u64>()).prop_map(|(t, v)| {
            let mut o = Vec::new();
            key(t, 0, &mut o);
            varint(v, &mut o);
            o
        }),
        (8u32..40, any::<[u8; 8]>()).prop_map(|(t, v)| {
            let mut o = Vec::new();
            key(t, 1, &mut o);
            o.extend_from_slice(&v);
            o
        }),
        (8u32..40, any::<[u8; 4]>()).prop_map(|(t, v)| {
            let mut o = Vec::new();
            key(t, 5, &mut o);
            o.extend_from_slice(&v);
            o
        }),
        (8u32..40, prop::collection::vec(any::<u8>(), 0..6)).prop_map(|(t, v)| {
            let mut o = Vec::new();
            len_field(t, &v, &mut o);
            o
        }),
        // Groups around prost's recursion limit.
        (8u32..40, prop_oneof![1usize..4, 97usize..103]).prop_map(|(t, d)| {
            let mut o = Vec::new();
            groups(t, d, &mut o);
            o
        }),
        // A stray end group.
        (1u32..40).prop_map(|t| {
            let mut o = Vec::new();
            key(t, 4, &mut o);
            o
        }),
        // Known fields again (last one wins), or with another wire type.
        (1u32..8, any::<u64>(), 0u8..6).prop_map(|(t, v, w)| {
            let mut o = Vec::new();
            match w {
                0 => {
                    key(t, 0, &mut o);
                    varint(v, &mut o);
                }
                2 => len_field(t, &v.to_le_bytes()[..(v % 9) as usize], &mut o),
                1 => {
                    key(t, 1, &mut o);
                    o.extend_from_slice(&v.to_le_bytes());
                }
                _ => {
                    key(t, 5, &mut o);
                    o.extend_from_slice(&v.to_le_bytes()[..4]);
                }
            }
            o
        }),
        // Strings that are not UTF-8, in a known string field.
        (
            prop_oneof![Just(1u32)],
            prop::collection::vec(0x80u8..0xff, 1..4)
        )
            .prop_map(|(t, v)| {
                let mut o = Vec::new();
                len_field(t, &v, &mut o);
                o
            }),
        // Long varints in known and unknown fields: the tenth byte must be below 2.
        (
            prop_oneof![3u32..7, Just(20u32)],
            0u8..4,
            prop_oneof![8usize..=9, Just(10usize)]
        )
            .prop_map(|(t, last, n)| {
                let mut o = Vec::new();
                key(t, 0, &mut o);
                o.extend(std::iter::repeat_n(0xff, n));
                o.push(last);
                o
            }),
        // Bad keys: field 0, wire types 6 and 7, keys above u32::MAX.
        prop_oneof![
            Just(vec![0x00, 0x01]),
            Just(vec![0x0e]),
            Just(vec![0x0f]),
            Just(vec![0x80, 0x80, 0x80, 0x80, 0x10, 0x00]),
        ],
    ]
}

/// A counter message with raw fields spliced in.
fn raw_counter() -> impl Strategy<Value = Vec<u8>> {
    (
        id(),
        count(),
        count(),
        prop::collection::vec(extra(), 0..3),
        any::<bool>(),
    )
        .prop_map(|(id, f, o, extras, extras_first)| {
            let mut body = Vec::new();
            let mut fields = Vec::new();
            len_field(1, id.as_bytes(), &mut fields);
            key(2, 0, &mut fields);
            varint(f as u64, &mut fields);
            key(3, 0, &mut fields);
            varint(o as u64, &mut fields);
            let extras = extras.concat();
            if extras_first {
                body.extend_from_slice(&extras);
                body.extend_from_slice(&fields);
            } else {
                body.extend_from_slice(&fields);
                body.extend_from_slice(&extras);
            }
            let mut out = Vec::new();
            len_field(7, &body, &mut out);
            out
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Well-formed requests: both decode, to the same command (counters included: the same
    /// canonical bytes, or the same error for them).
    #[test]
    fn encoded_requests_decode_the_same(r in request(), max in 0usize..16) {
        let buf = prost::Message::encode_to_vec(&r);
        let decoded = agree(&buf, max)?;
        prop_assert!(decoded.is_some() || std::str::from_utf8(r.worker_id.as_bytes()).is_err());
    }

    /// Raw fields spliced in at field boundaries, at the top level and inside counters.
    #[test]
    fn spliced_fields_decode_the_same(
        r in request(),
        extras in prop::collection::vec(extra(), 0..4),
        counters in prop::collection::vec(raw_counter(), 0..4),
        at in any::<prop::sample::Index>(),
        max in 0usize..16,
    ) {
        let mut fields: Vec<Vec<u8>> = Vec::new();
        let base = prost::Message::encode_to_vec(&r);
        // Split prost's encoding at its top-level field boundaries (it writes each field whole).
        let mut rest = &base[..];
        while !rest.is_empty() {
            let n = field_len(rest);
            fields.push(rest[..n].to_vec());
            rest = &rest[n..];
        }
        for (i, e) in extras.into_iter().chain(counters).enumerate() {
            let pos = (at.index(fields.len() + 1) + i) % (fields.len() + 1);
            fields.insert(pos, e);
        }
        agree(&fields.concat(), max)?;
    }

    /// Byte edits of an encoding: flips, truncation, insertion.
    #[test]
    fn mutated_requests_decode_the_same(
        r in request(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..4),
        max in 0usize..16,
    ) {
        let mut buf = prost::Message::encode_to_vec(&r);
        for (at, byte, op) in edits {
            if buf.is_empty() {
                buf.push(byte);
                continue;
            }
            let i = at.index(buf.len());
            match op {
                0 => buf[i] ^= byte | 1,
                1 => buf.truncate(i),
                _ => buf.insert(i, byte),
            }
        }
        agree(&buf, max)?;
    }
}

/// The length of the well-formed top-level field at the start of `buf` (prost's own output).
fn field_len(buf: &[u8]) -> usize {
    let read = |buf: &[u8], at: &mut usize| -> u64 {
        let mut v = 0u64;
        let mut shift = 0;
        loop {
            let b = buf[*at];
            *at += 1;
            v |= u64::from(b & 0x7f) << shift;
            shift += 7;
            if b < 0x80 {
                return v;
            }
        }
    };
    let mut at = 0;
    let key = read(buf, &mut at);
    match key & 7 {
        0 => {
            read(buf, &mut at);
        }
        2 => {
            let n = read(buf, &mut at);
            at += usize::try_from(n).unwrap();
        }
        w => panic!("prost wrote wire type {w}"),
    }
    at
}

#[test]
fn recursion_limit_is_prosts() {
    // Top level: 99 nested groups around a field are skipped, 100 are refused (the innermost
    // field spends the last level of the budget of 100); inside a counter, one level less.
    for (depth, ok) in [(99, true), (100, false), (101, false)] {
        let mut buf = Vec::new();
        groups(9, depth, &mut buf);
        let d = decode(&buf, 10);
        assert_eq!(d.is_ok(), ok, "top level, depth {depth}");
        assert_eq!(d.is_ok(), decode_reference(&buf, 10).is_ok());
    }
    for depth in [97, 98, 99, 100] {
        let mut body = Vec::new();
        len_field(1, b"p-1", &mut body);
        groups(9, depth, &mut body);
        let mut buf = Vec::new();
        len_field(7, &body, &mut buf);
        assert_eq!(
            decode(&buf, 10).is_ok(),
            decode_reference(&buf, 10).is_ok(),
            "counter, depth {depth}"
        );
    }
}

#[test]
fn counters_are_checked_as_the_service_checks_them() {
    let req = |ids: &[&str], f: i64| pb::ReportRuntimeRequest {
        worker_id: "w1".into(),
        counters: ids
            .iter()
            .map(|id| pb::ProxyCounters {
                proxy_id: (*id).into(),
                in_flight: f,
                open_connections: 1,
            })
            .collect(),
        ..Default::default()
    };
    let counters = |r: &pb::ReportRuntimeRequest, max| {
        decode(&prost::Message::encode_to_vec(r), max)
            .unwrap()
            .counters
    };
    let ok = counters(&req(&["b", "a", "c"], 2), 3).unwrap();
    assert_eq!(ok.canonical(), b"a 2 1\nb 2 1\nc 2 1\n");
    assert_eq!(
        counters(&req(&["b", "a", "c"], 2), 2),
        Err(ServiceError::Invalid("counters"))
    );
    assert_eq!(
        counters(&req(&["a", "a"], 2), 3),
        Err(ServiceError::Invalid("duplicate proxy_id"))
    );
    assert_eq!(
        counters(&req(&["a", "b c"], 2), 3),
        Err(ServiceError::Invalid("proxy_id"))
    );
    assert_eq!(
        counters(&req(&["a"], -1), 3),
        Err(ServiceError::Invalid("counter"))
    );
}

#[test]
fn bad_utf8_is_a_decode_error_even_where_the_id_would_be_refused_anyway() {
    let mut body = Vec::new();
    len_field(1, &[0xff, 0xfe], &mut body);
    let mut buf = Vec::new();
    len_field(7, &body, &mut buf);
    assert!(decode(&buf, 10).is_err());
    assert!(decode_reference(&buf, 10).is_err());
    // The error names the field, never the bytes.
    let e = decode(&buf, 10).unwrap_err().to_string();
    assert_eq!(
        e,
        "ProxyCounters.proxy_id: invalid string value: data is not UTF-8 encoded"
    );
}
