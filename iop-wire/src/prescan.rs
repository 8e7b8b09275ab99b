//! Counts what an envelope would decode into, before prost builds it.
//!
//! prost decodes a frame whole before [`crate::validate`] can look at it, and a repeated field
//! costs far more decoded than on the wire: an empty `Header` is 2 bytes on the wire and a
//! 56-byte struct (an empty string and empty bytes) in a `Vec` that doubles as it grows. One 8 MB
//! `ProviderTunnelFrame` of empty headers peaked at 235 MB of heap (`cap`, debug build) before
//! validation refused its 129th header; an Edge reading many Nodes could hold that once per
//! Node at the same time. A status answer of empty provider snapshots cost the Control Plane
//! about 200 bytes each.
//!
//! [`runtime_envelope`] walks the protobuf bytes once, without allocating, and counts every
//! element of every repeated and map field of the runtime messages against the same bounds
//! validation applies (headers 128, metadata 64, adapters 256, ...). A frame over a bound is
//! refused with the error validation would have given ([`InvalidMessage::TooLong`] naming the
//! field), so the decoded size of anything that reaches prost is bounded by a small multiple of
//! its wire size. The same frame now costs 40 bytes beyond its own
//! (`tests/tests/frame_decode_memory.rs`). [`control_envelope`] does the same for the control
//! wire, whose status answers had no bound on their provider snapshots or adapters before
//! ([`crate::control::MAX_STATUS_PROVIDERS`], [`crate::control::MAX_STATUS_ADAPTERS`]).
//!
//! - **Counts are per frame.** prost merges a singular message field that appears twice, so a
//!   repeated field inside it is counted across both appearances. A repeated field nested in a
//!   repeated message (an adapter's targets) is counted over all its parents, against the
//!   per-parent bound times the parent's bound: the total, not the exact per-parent rule,
//!   which validation still applies after the decode.
//! - **What is not counted** costs no more decoded than on the wire: scalars, strings and bytes
//!   (a repeated singular field replaces its value), unknown fields (skipped).
//! - **Stricter than validation only for what no encoder of ours writes**: a map entry is
//!   counted as it comes, though prost keeps one per key; headers on a tunnel frame that is not
//!   a `RESPONSE_START`, and the config of a refused registration, count though validation
//!   ignores them; so does a oneof case replaced by a later one.
//! - **The worst a frame can still cost** is a table's product bound: 262,144 empty targets
//!   (256 adapters × 1024) are 512 KiB on the wire and about 6 MiB decoded.
//! - **Malformed bytes** end the scan without an error: prost refuses them itself, having built
//!   only what the scan already counted. Groups (wire types 3 and 4, never written by proto3)
//!   are refused here, since skipping them right would take the recursion prost does.
//!
//! The tables below follow `proto/runtime.proto` and `proto/control.proto`;
//! `every_repeated_runtime_field_is_counted` and its control twin check them against the proto
//! files, so a repeated field added there without a bound here fails the crate's tests.

use crate::error::InvalidMessage;
use crate::runtime::{
    MAX_ADAPTER_TARGETS as MAX_TARGETS, MAX_ADAPTER_TYPES, MAX_ADAPTERS, MAX_CAPABILITIES,
    MAX_HEADERS, MAX_ISSUER_KEY_IDS, MAX_METADATA_ENTRIES, MAX_PROFILE_HEADERS,
};

/// One field of a message that the scan looks into.
#[derive(Debug, PartialEq, Eq)]
enum Field {
    /// A singular message field: its own fields are scanned.
    Message {
        number: u32,
        fields: &'static [Self],
    },
    /// A repeated message, string or map field: every element counts against `max` (over the
    /// whole frame, in counter `slot`); a message element's fields are scanned too.
    Repeated {
        number: u32,
        name: &'static str,
        max: usize,
        slot: usize,
        elem: &'static [Self],
    },
}

use Field::{Message, Repeated};

/// A repeated field of strings or leaf messages, or a map: counted, not looked into.
const fn list(number: u32, name: &'static str, max: usize, slot: usize) -> Field {
    Repeated {
        number,
        name,
        max,
        slot,
        elem: &[],
    }
}

/// A singular message field, looked into.
const fn msg(number: u32, fields: &'static [Field]) -> Field {
    Message { number, fields }
}

/// An adapter's operation paths: validation takes only known operations, so a valid map has a
/// handful of keys; its entries on the wire are bounded like metadata.
const MAX_OPERATION_PATHS: usize = MAX_METADATA_ENTRIES;

const SLOTS: usize = 15;

const PROFILE: &[Field] = &[
    list(
        2,
        "adapters.openai_compat.protocol_profile.operation_paths",
        MAX_ADAPTERS * MAX_OPERATION_PATHS,
        0,
    ),
    list(
        6,
        "adapters.openai_compat.protocol_profile.headers",
        MAX_ADAPTERS * MAX_PROFILE_HEADERS,
        1,
    ),
];
const OPENAI_COMPAT: &[Field] = &[msg(2, PROFILE)];
const NATIVE: &[Field] = &[list(
    2,
    "adapters.native.options",
    MAX_ADAPTERS * MAX_METADATA_ENTRIES,
    2,
)];
const ADAPTER: &[Field] = &[
    list(6, "adapters.targets", MAX_ADAPTERS * MAX_TARGETS, 3),
    msg(10, OPENAI_COMPAT),
    msg(11, NATIVE),
];
const CONFIG_PAYLOAD: &[Field] = &[Repeated {
    number: 1,
    name: "adapters",
    max: MAX_ADAPTERS,
    slot: 4,
    elem: ADAPTER,
}];
const REGISTER_REQUEST: &[Field] = &[
    list(3, "adapter_types", MAX_ADAPTER_TYPES, 5),
    list(6, "issuer_key_ids", MAX_ISSUER_KEY_IDS, 6),
];
const REGISTER_RESPONSE: &[Field] = &[msg(4, CONFIG_PAYLOAD)];
const CONFIG_REFRESH_REQUEST: &[Field] = &[msg(1, CONFIG_PAYLOAD)];
const RUN_REQUEST: &[Field] = &[list(5, "metadata", MAX_METADATA_ENTRIES, 7)];
const RUN_EVENT: &[Field] = &[list(4, "metadata", MAX_METADATA_ENTRIES, 8)];
const TUNNEL_REQUEST: &[Field] = &[
    list(6, "headers", MAX_HEADERS, 9),
    list(10, "metadata", MAX_METADATA_ENTRIES, 10),
];
const TUNNEL_FRAME: &[Field] = &[
    list(4, "headers", MAX_HEADERS, 11),
    list(8, "metadata", MAX_METADATA_ENTRIES, 12),
];
const COMMAND_RESPONSE: &[Field] = &[
    list(3, "capabilities", MAX_CAPABILITIES, 13),
    list(4, "result", MAX_METADATA_ENTRIES, 14),
];
/// `Envelope`: the oneof cases that hold a repeated field somewhere below them.
const ENVELOPE: &[Field] = &[
    msg(10, REGISTER_REQUEST),
    msg(11, REGISTER_RESPONSE),
    msg(14, RUN_REQUEST),
    msg(15, RUN_EVENT),
    msg(16, TUNNEL_REQUEST),
    msg(17, TUNNEL_FRAME),
    msg(20, COMMAND_RESPONSE),
    msg(21, CONFIG_REFRESH_REQUEST),
];

/// The control wire's tables (`proto/control.proto`).
mod control {
    use super::Field::{self, Repeated};
    use super::{list, msg};
    use crate::control::{
        MAX_MODEL_LIMITS, MAX_PROJECTION_ENTRIES, MAX_STATUS_ADAPTERS, MAX_STATUS_NODES,
        MAX_STATUS_PROVIDERS, MAX_USAGE_RECORDS,
    };
    use crate::runtime::MAX_METADATA_ENTRIES;

    pub(super) const SLOTS: usize = 15;

    const fn metadata(number: u32, name: &'static str, slot: usize) -> Field {
        list(number, name, MAX_METADATA_ENTRIES, slot)
    }

    pub(super) const HELLO_REQUEST: &[Field] = &[metadata(4, "metadata", 0)];
    pub(super) const SUMMARY: &[Field] = &[
        list(2, "nodes.config.adapter_names", MAX_STATUS_ADAPTERS, 1),
        list(3, "nodes.config.adapter_types", MAX_STATUS_ADAPTERS, 2),
    ];
    pub(super) const NODE_SNAPSHOT: &[Field] = &[
        msg(3, SUMMARY),
        list(4, "nodes.provider_snapshots", MAX_STATUS_PROVIDERS, 3),
    ];
    pub(super) const STATUS_RESPONSE: &[Field] = &[Repeated {
        number: 2,
        name: "nodes",
        max: MAX_STATUS_NODES,
        slot: 4,
        elem: NODE_SNAPSHOT,
    }];
    pub(super) const COMMAND_REQUEST: &[Field] =
        &[metadata(4, "args", 5), metadata(5, "metadata", 6)];
    pub(super) const COMMAND_RESPONSE: &[Field] = &[metadata(4, "result", 7)];
    pub(super) const COMMAND_EVENT: &[Field] = &[metadata(4, "metadata", 8)];
    pub(super) const NODE_EVENT: &[Field] = &[metadata(5, "metadata", 9)];
    pub(super) const USAGE_REPORT: &[Field] = &[list(1, "usage.records", MAX_USAGE_RECORDS, 10)];
    pub(super) const LIMITS: &[Field] = &[list(
        6,
        "projection.principals.limits.models",
        MAX_PROJECTION_ENTRIES * MAX_MODEL_LIMITS,
        11,
    )];
    pub(super) const PRINCIPAL: &[Field] = &[msg(4, LIMITS)];
    pub(super) const PROJECTION: &[Field] = &[
        Repeated {
            number: 2,
            name: "projection",
            max: MAX_PROJECTION_ENTRIES,
            slot: 12,
            elem: PRINCIPAL,
        },
        list(3, "projection", MAX_PROJECTION_ENTRIES, 13),
        list(4, "projection", MAX_PROJECTION_ENTRIES, 14),
    ];
    pub(super) const HELLO_RESPONSE: &[Field] = &[msg(3, PROJECTION)];
    pub(super) const APPLY_REQUEST: &[Field] = &[msg(1, PROJECTION)];
    /// `ControlEnvelope`: the oneof cases that hold a repeated field somewhere below them.
    pub(super) const ENVELOPE: &[Field] = &[
        msg(10, HELLO_REQUEST),
        msg(11, HELLO_RESPONSE),
        msg(13, STATUS_RESPONSE),
        msg(14, COMMAND_REQUEST),
        msg(15, COMMAND_RESPONSE),
        msg(16, COMMAND_EVENT),
        msg(17, NODE_EVENT),
        msg(18, APPLY_REQUEST),
        msg(24, USAGE_REPORT),
        msg(26, PROJECTION),
    ];
}

/// The refusal of a group: proto3 never writes one, and skipping it would take recursion.
const GROUP: InvalidMessage = InvalidMessage::InvalidValue {
    field: "envelope",
    rule: "protobuf groups are not part of this protocol",
};

/// Refuses a runtime `Envelope` whose repeated fields hold more elements than validation
/// allows, before it is decoded (see the module docs). `Ok` says nothing about whether the
/// bytes are valid protobuf: prost decides that.
pub(crate) fn runtime_envelope(bytes: &[u8]) -> Result<(), InvalidMessage> {
    let mut counts = [0usize; SLOTS];
    scan(bytes, ENVELOPE, &mut counts)
}

/// [`runtime_envelope`] for a `ControlEnvelope` (see the module docs for what its counts bound).
pub(crate) fn control_envelope(bytes: &[u8]) -> Result<(), InvalidMessage> {
    let mut counts = [0usize; control::SLOTS];
    scan(bytes, control::ENVELOPE, &mut counts)
}

/// Scans one message's bytes against `fields`. Malformed bytes end the scan with `Ok`.
fn scan(mut bytes: &[u8], fields: &[Field], counts: &mut [usize]) -> Result<(), InvalidMessage> {
    while !bytes.is_empty() {
        let Some(key) = varint(&mut bytes) else {
            return Ok(());
        };
        let number = key >> 3;
        match key & 7 {
            0 => {
                if varint(&mut bytes).is_none() {
                    return Ok(());
                }
            }
            1 => {
                let Some(rest) = bytes.get(8..) else {
                    return Ok(());
                };
                bytes = rest;
            }
            5 => {
                let Some(rest) = bytes.get(4..) else {
                    return Ok(());
                };
                bytes = rest;
            }
            2 => {
                let Some(len) = varint(&mut bytes).and_then(|l| usize::try_from(l).ok()) else {
                    return Ok(());
                };
                let Some(value) = bytes.get(..len) else {
                    return Ok(());
                };
                bytes = &bytes[len..];
                match fields.iter().find(|f| f.number() == number) {
                    None => {}
                    Some(Message { fields, .. }) => scan(value, fields, counts)?,
                    Some(Repeated {
                        name,
                        max,
                        slot,
                        elem,
                        ..
                    }) => {
                        // Within `counts` by construction (`every_repeated_*_field_is_counted`).
                        let count = &mut counts[*slot];
                        *count += 1;
                        if *count > *max {
                            return Err(InvalidMessage::TooLong(name));
                        }
                        if !elem.is_empty() {
                            scan(value, elem, counts)?;
                        }
                    }
                }
            }
            3 | 4 => return Err(GROUP),
            _ => return Ok(()),
        }
    }
    Ok(())
}

impl Field {
    fn number(&self) -> u64 {
        match self {
            Message { number, .. } | Repeated { number, .. } => u64::from(*number),
        }
    }
}

/// Reads one base-128 varint from the front of `bytes`; `None` when it is cut short or longer
/// than ten bytes.
fn varint(bytes: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            *bytes = &bytes[i + 1..];
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;
    use crate::proto::runtime as pb;
    use prost::Message as _;
    use std::collections::HashMap;

    fn frame(message: pb::envelope::Message) -> Vec<u8> {
        pb::Envelope {
            correlation_id: 1,
            stream_id: 7,
            message: Some(message),
        }
        .encode_to_vec()
    }

    fn tunnel_frame(headers: usize) -> Vec<u8> {
        frame(pb::envelope::Message::ProviderTunnelFrame(
            pb::ProviderTunnelFrame {
                headers: vec![pb::Header::default(); headers],
                ..Default::default()
            },
        ))
    }

    #[test]
    fn a_frame_within_the_bounds_passes_and_one_beyond_is_refused_naming_the_field() {
        assert_eq!(runtime_envelope(&tunnel_frame(MAX_HEADERS)), Ok(()));
        assert_eq!(
            runtime_envelope(&tunnel_frame(MAX_HEADERS + 1)),
            Err(InvalidMessage::TooLong("headers"))
        );
    }

    #[test]
    fn a_singular_message_sent_twice_is_counted_across_both() {
        // prost merges the two tunnel frames into one with every header of both.
        let mut bytes = tunnel_frame(100);
        bytes.extend(tunnel_frame(100));
        let merged = pb::Envelope::decode(bytes.as_slice()).unwrap();
        let Some(pb::envelope::Message::ProviderTunnelFrame(f)) = merged.message else {
            panic!("a tunnel frame");
        };
        assert_eq!(f.headers.len(), 200, "prost merges the repeats");
        assert_eq!(
            runtime_envelope(&bytes),
            Err(InvalidMessage::TooLong("headers"))
        );
    }

    #[test]
    fn nested_repeated_fields_are_counted_through_their_parents() {
        let adapter = pb::AdapterConfig {
            r#type: "openai_compat".into(),
            targets: vec![String::new(); MAX_TARGETS],
            ..Default::default()
        };
        let config = |adapters: usize| {
            frame(pb::envelope::Message::NodeConfigRefreshRequest(
                pb::NodeConfigRefreshRequest {
                    config: Some(pb::NodeConfigPayload {
                        adapters: vec![adapter.clone(); adapters],
                        ..Default::default()
                    }),
                },
            ))
        };
        assert_eq!(runtime_envelope(&config(MAX_ADAPTERS)), Ok(()));
        assert_eq!(
            runtime_envelope(&config(MAX_ADAPTERS + 1)),
            Err(InvalidMessage::TooLong("adapters"))
        );
        // One adapter carrying every target the bound allows over all adapters, and one more.
        let one = |targets: usize| {
            frame(pb::envelope::Message::NodeConfigRefreshRequest(
                pb::NodeConfigRefreshRequest {
                    config: Some(pb::NodeConfigPayload {
                        adapters: vec![pb::AdapterConfig {
                            targets: vec![String::new(); targets],
                            ..Default::default()
                        }],
                        ..Default::default()
                    }),
                },
            ))
        };
        assert_eq!(runtime_envelope(&one(MAX_ADAPTERS * MAX_TARGETS)), Ok(()));
        assert_eq!(
            runtime_envelope(&one(MAX_ADAPTERS * MAX_TARGETS + 1)),
            Err(InvalidMessage::TooLong("adapters.targets"))
        );
    }

    #[test]
    fn malformed_bytes_are_left_to_prost_and_groups_are_refused() {
        let whole = tunnel_frame(3);
        for cut in 0..whole.len() {
            assert_eq!(runtime_envelope(&whole[..cut]), Ok(()), "cut at {cut}");
        }
        assert_eq!(runtime_envelope(&[0xff; 11]), Ok(()), "an over-long varint");
        // An unknown group (field 99, start-group) before a frame of too many headers.
        let mut grouped = vec![0x9b, 0x06, 0x9c, 0x06];
        grouped.extend(tunnel_frame(MAX_HEADERS + 1));
        assert_eq!(runtime_envelope(&grouped), Err(GROUP));
        assert!(
            pb::Envelope::decode(grouped.as_slice()).is_ok(),
            "prost skips groups"
        );
    }

    /// `proto`'s messages: each field's number, type (without its package) and whether it is
    /// repeated (a map counts as repeated).
    fn schema(proto: &str) -> HashMap<String, Vec<(u64, String, bool)>> {
        let mut messages: HashMap<String, Vec<(u64, String, bool)>> = HashMap::new();
        let (mut message, mut depth, mut in_enum) = (String::new(), 0usize, None::<usize>);
        for line in proto.lines().map(|l| l.split("//").next().unwrap().trim()) {
            if depth == 0 && line.starts_with("message ") {
                message = line.split_whitespace().nth(1).unwrap().to_owned();
                messages.entry(message.clone()).or_default();
            }
            if line.starts_with("enum ") {
                in_enum = Some(depth);
            }
            let field = line
                .strip_suffix(';')
                .filter(|_| depth >= 1 && in_enum.is_none());
            if let Some((decl, number)) = field.and_then(|f| f.split_once('=')) {
                let words: Vec<&str> = decl.split_whitespace().collect();
                if let Ok(number) = number.trim().parse::<u64>() {
                    let (ty, repeated) = match words.as_slice() {
                        ["repeated", ty, _] => (*ty, true),
                        [map, ..] if map.starts_with("map<") => ("map", true),
                        ["optional", ty, _] | [ty, _] => (*ty, false),
                        other => panic!("unparsed field {other:?}"),
                    };
                    let ty = ty.rsplit('.').next().unwrap().to_owned();
                    messages
                        .get_mut(&message)
                        .unwrap()
                        .push((number, ty, repeated));
                }
            }
            depth += line.matches('{').count();
            depth -= line.matches('}').count();
            if in_enum.is_some_and(|d| d == depth) && line.contains('}') {
                in_enum = None;
            }
        }
        messages
    }

    /// The tables against the protos: every message that holds a repeated or map field, itself
    /// or below it, has a table; its table counts each of its repeated fields and descends
    /// into each of its message fields that holds one, by the right number and into the right
    /// table, and has nothing else; every slot is used once and fits `slots`. A field added to
    /// a proto without its line here fails.
    fn check_tables(proto: &str, tables: &[(&str, &[Field])], slots: usize) {
        let schema = schema(proto);
        fn holds(schema: &HashMap<String, Vec<(u64, String, bool)>>, ty: &str) -> bool {
            schema
                .get(ty)
                .is_some_and(|fs| fs.iter().any(|(_, t, rep)| *rep || holds(schema, t)))
        }
        let table = |name: &str| -> &[Field] {
            tables
                .iter()
                .find(|(m, _)| *m == name)
                .unwrap_or_else(|| panic!("{name} holds a repeated field but has no table"))
                .1
        };
        for (message, fields) in &schema {
            if !holds(&schema, message) {
                assert!(
                    tables.iter().all(|(m, _)| m != message),
                    "{message} needs no table"
                );
                continue;
            }
            let t = table(message);
            let mut expected = 0;
            for (number, ty, repeated) in fields {
                let inner: &[Field] = if holds(&schema, ty) { table(ty) } else { &[] };
                let entry = t.iter().find(|f| f.number() == *number);
                if *repeated {
                    expected += 1;
                    match entry {
                        Some(Repeated { elem, .. }) => {
                            assert_eq!(*elem, inner, "{message}.{number} descends into {ty}");
                        }
                        other => panic!("{message}.{number} is repeated, counted as {other:?}"),
                    }
                } else if !inner.is_empty() {
                    expected += 1;
                    match entry {
                        Some(Message { fields, .. }) => {
                            assert_eq!(*fields, inner, "{message}.{number} descends into {ty}");
                        }
                        other => panic!("{message}.{number} holds a {ty}, scanned as {other:?}"),
                    }
                }
            }
            assert_eq!(
                t.len(),
                expected,
                "{message}'s table has lines the proto does not"
            );
        }
        let mut used = Vec::new();
        for (_, table) in tables {
            for f in *table {
                if let Repeated { slot, .. } = f {
                    used.push(*slot);
                }
            }
        }
        used.sort_unstable();
        assert_eq!(used, (0..slots).collect::<Vec<_>>(), "slots used once each");
    }

    #[test]
    fn every_repeated_runtime_field_is_counted() {
        check_tables(
            include_str!("../proto/runtime.proto"),
            &[
                ("Envelope", ENVELOPE),
                ("RegisterRequest", REGISTER_REQUEST),
                ("RegisterResponse", REGISTER_RESPONSE),
                ("NodeConfigRefreshRequest", CONFIG_REFRESH_REQUEST),
                ("NodeConfigPayload", CONFIG_PAYLOAD),
                ("AdapterConfig", ADAPTER),
                ("OpenAICompatAdapterConfig", OPENAI_COMPAT),
                ("ConcreteProtocolProfile", PROFILE),
                ("NativeAdapterConfig", NATIVE),
                ("RunRequest", RUN_REQUEST),
                ("RunEvent", RUN_EVENT),
                ("ProviderTunnelRequest", TUNNEL_REQUEST),
                ("ProviderTunnelFrame", TUNNEL_FRAME),
                ("NodeCommandResponse", COMMAND_RESPONSE),
            ],
            SLOTS,
        );
    }

    #[test]
    fn every_repeated_control_field_is_counted() {
        let control_proto = include_str!("../proto/control.proto");
        check_tables(
            control_proto,
            &[
                ("ControlEnvelope", control::ENVELOPE),
                ("EdgeHelloRequest", control::HELLO_REQUEST),
                ("EdgeHelloResponse", control::HELLO_RESPONSE),
                ("EdgeStatusResponse", control::STATUS_RESPONSE),
                ("EdgeNodeSnapshot", control::NODE_SNAPSHOT),
                ("EdgeNodeConfigSummary", control::SUMMARY),
                ("EdgeCommandRequest", control::COMMAND_REQUEST),
                ("EdgeCommandResponse", control::COMMAND_RESPONSE),
                ("EdgeCommandEvent", control::COMMAND_EVENT),
                ("EdgeNodeEvent", control::NODE_EVENT),
                ("PrincipalProjection", control::PROJECTION),
                ("PrincipalProjectionApplyRequest", control::APPLY_REQUEST),
                ("ProjectedPrincipal", control::PRINCIPAL),
                ("PrincipalLimits", control::LIMITS),
                ("EdgeUsageReport", control::USAGE_REPORT),
            ],
            control::SLOTS,
        );
        // The runtime messages the control wire carries hold no repeated field (the check
        // above sees control.proto alone, so it would not know).
        let runtime = schema(include_str!("../proto/runtime.proto"));
        for fields in schema(control_proto).values() {
            for (_, ty, _) in fields {
                if let Some(inner) = runtime.get(ty) {
                    assert!(
                        inner.iter().all(|(_, _, repeated)| !repeated),
                        "the control wire carries {ty}, which holds a repeated field"
                    );
                }
            }
        }
    }

    #[test]
    fn a_status_answer_of_empty_snapshots_is_refused_before_it_is_built() {
        use crate::proto::control as cp;
        let status = |snapshots: usize| {
            cp::ControlEnvelope {
                correlation_id: 3,
                message: Some(cp::control_envelope::Message::EdgeStatusResponse(
                    cp::EdgeStatusResponse {
                        edge_id: "edge-1".into(),
                        nodes: vec![cp::EdgeNodeSnapshot {
                            node_id: "node-1".into(),
                            provider_snapshots: vec![pb::ProviderSnapshot::default(); snapshots],
                            ..Default::default()
                        }],
                        omitted_nodes: 0,
                    },
                )),
            }
            .encode_to_vec()
        };
        assert_eq!(control_envelope(&status(16)), Ok(()));
        assert_eq!(
            control_envelope(&status(crate::control::MAX_STATUS_PROVIDERS + 1)),
            Err(InvalidMessage::TooLong("nodes.provider_snapshots"))
        );
    }
}
