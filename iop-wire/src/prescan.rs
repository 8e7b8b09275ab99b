//! Counts what a runtime envelope would decode into, before prost builds it.
//!
//! prost decodes a frame whole before [`crate::validate`] can look at it, and a repeated field
//! costs far more decoded than on the wire: an empty `Header` is 2 bytes on the wire and a
//! 48-byte struct (two empty strings) in a `Vec` that doubles as it grows. One 8 MB
//! `ProviderTunnelFrame` of empty headers peaked at 224 MB of heap (counting allocator, release
//! build) before validation refused its 129th header; an Edge reading many Nodes could hold that
//! once per Node at the same time.
//!
//! [`runtime_envelope`] walks the protobuf bytes once, without allocating, and counts every
//! element of every repeated and map field of the runtime messages against the same bounds
//! validation applies (headers 128, metadata 64, adapters 256, ...). A frame over a bound is
//! refused with the error validation would have given ([`InvalidMessage::TooLong`] naming the
//! field), so the decoded size of anything that reaches prost is bounded by a small multiple of
//! its wire size. The same frame now peaks under 1 MB.
//!
//! - **Counts are per frame.** prost merges a singular message field that appears twice, so a
//!   repeated field inside it is counted across both appearances. A repeated field nested in a
//!   repeated message (an adapter's targets) is counted over all its parents, against the
//!   per-parent bound times the parent's bound: the total, not the exact per-parent rule,
//!   which validation still applies after the decode.
//! - **What is not counted** costs no more decoded than on the wire: scalars, strings and bytes
//!   (a repeated singular field replaces its value), unknown fields (skipped).
//! - **Malformed bytes** end the scan without an error: prost refuses them itself, having built
//!   only what the scan already counted. Groups (wire types 3 and 4, never written by proto3)
//!   are refused here, since skipping them right would take the recursion prost does.
//!
//! The tables below follow `proto/runtime.proto`; `every_repeated_runtime_field_is_counted`
//! checks them against the proto file, so a repeated field added there without a bound here
//! fails the crate's tests.

use crate::error::InvalidMessage;
use crate::runtime::{
    MAX_ADAPTERS, MAX_HEADERS, MAX_ISSUER_KEY_IDS, MAX_METADATA_ENTRIES, MAX_PROFILE_HEADERS,
};

/// One field of a message that the scan looks into.
#[derive(Debug)]
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

/// Validation's bound on a registration's adapter types and on an adapter's targets, and on
/// what a command reports (`runtime::registration`, `runtime::config`, `runtime::commands`).
const MAX_ADAPTER_TYPES: usize = 64;
const MAX_TARGETS: usize = 1024;
const MAX_CAPABILITIES: usize = 4096;
/// An adapter's operation paths: validation takes only known operations, so a valid map has a
/// handful of keys; its entries on the wire are bounded like metadata.
const MAX_OPERATION_PATHS: usize = MAX_METADATA_ENTRIES;

const SLOTS: usize = 15;

const PROFILE: &[Field] = &[
    Repeated {
        number: 2,
        name: "adapters.openai_compat.protocol_profile.operation_paths",
        max: MAX_ADAPTERS * MAX_OPERATION_PATHS,
        slot: 0,
        elem: &[],
    },
    Repeated {
        number: 6,
        name: "adapters.openai_compat.protocol_profile.headers",
        max: MAX_ADAPTERS * MAX_PROFILE_HEADERS,
        slot: 1,
        elem: &[],
    },
];
const OPENAI_COMPAT: &[Field] = &[Message {
    number: 2,
    fields: PROFILE,
}];
const NATIVE: &[Field] = &[Repeated {
    number: 2,
    name: "adapters.native.options",
    max: MAX_ADAPTERS * MAX_METADATA_ENTRIES,
    slot: 2,
    elem: &[],
}];
const ADAPTER: &[Field] = &[
    Repeated {
        number: 6,
        name: "adapters.targets",
        max: MAX_ADAPTERS * MAX_TARGETS,
        slot: 3,
        elem: &[],
    },
    Message {
        number: 10,
        fields: OPENAI_COMPAT,
    },
    Message {
        number: 11,
        fields: NATIVE,
    },
];
const CONFIG_PAYLOAD: &[Field] = &[Repeated {
    number: 1,
    name: "adapters",
    max: MAX_ADAPTERS,
    slot: 4,
    elem: ADAPTER,
}];
const REGISTER_REQUEST: &[Field] = &[
    Repeated {
        number: 3,
        name: "adapter_types",
        max: MAX_ADAPTER_TYPES,
        slot: 5,
        elem: &[],
    },
    Repeated {
        number: 6,
        name: "issuer_key_ids",
        max: MAX_ISSUER_KEY_IDS,
        slot: 6,
        elem: &[],
    },
];
const REGISTER_RESPONSE: &[Field] = &[Message {
    number: 4,
    fields: CONFIG_PAYLOAD,
}];
const CONFIG_REFRESH_REQUEST: &[Field] = &[Message {
    number: 1,
    fields: CONFIG_PAYLOAD,
}];
const RUN_REQUEST: &[Field] = &[Repeated {
    number: 5,
    name: "metadata",
    max: MAX_METADATA_ENTRIES,
    slot: 7,
    elem: &[],
}];
const RUN_EVENT: &[Field] = &[Repeated {
    number: 4,
    name: "metadata",
    max: MAX_METADATA_ENTRIES,
    slot: 8,
    elem: &[],
}];
const TUNNEL_REQUEST: &[Field] = &[
    Repeated {
        number: 6,
        name: "headers",
        max: MAX_HEADERS,
        slot: 9,
        elem: &[],
    },
    Repeated {
        number: 10,
        name: "metadata",
        max: MAX_METADATA_ENTRIES,
        slot: 10,
        elem: &[],
    },
];
const TUNNEL_FRAME: &[Field] = &[
    Repeated {
        number: 4,
        name: "headers",
        max: MAX_HEADERS,
        slot: 11,
        elem: &[],
    },
    Repeated {
        number: 8,
        name: "metadata",
        max: MAX_METADATA_ENTRIES,
        slot: 12,
        elem: &[],
    },
];
const COMMAND_RESPONSE: &[Field] = &[
    Repeated {
        number: 3,
        name: "capabilities",
        max: MAX_CAPABILITIES,
        slot: 13,
        elem: &[],
    },
    Repeated {
        number: 4,
        name: "result",
        max: MAX_METADATA_ENTRIES,
        slot: 14,
        elem: &[],
    },
];
/// `Envelope`: the oneof cases that hold a repeated field somewhere below them.
const ENVELOPE: &[Field] = &[
    Message {
        number: 10,
        fields: REGISTER_REQUEST,
    },
    Message {
        number: 11,
        fields: REGISTER_RESPONSE,
    },
    Message {
        number: 14,
        fields: RUN_REQUEST,
    },
    Message {
        number: 15,
        fields: RUN_EVENT,
    },
    Message {
        number: 16,
        fields: TUNNEL_REQUEST,
    },
    Message {
        number: 17,
        fields: TUNNEL_FRAME,
    },
    Message {
        number: 20,
        fields: COMMAND_RESPONSE,
    },
    Message {
        number: 21,
        fields: CONFIG_REFRESH_REQUEST,
    },
];

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

/// Scans one message's bytes against `fields`. Malformed bytes end the scan with `Ok`.
fn scan(
    mut bytes: &[u8],
    fields: &[Field],
    counts: &mut [usize; SLOTS],
) -> Result<(), InvalidMessage> {
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

    /// Every `repeated` or `map` field of `runtime.proto` has a line in the tables: a field
    /// added to the proto without a bound here fails this test.
    #[test]
    fn every_repeated_runtime_field_is_counted() {
        let proto = include_str!("../proto/runtime.proto");
        let mut message = "";
        let mut found = Vec::new();
        for line in proto.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("message ") {
                message = rest.split_whitespace().next().unwrap();
            } else if line.starts_with("repeated ") || line.starts_with("map<") {
                let number: u32 = line
                    .rsplit('=')
                    .next()
                    .unwrap()
                    .trim()
                    .trim_end_matches(';')
                    .trim()
                    .parse()
                    .unwrap();
                found.push((message, number));
            }
        }
        let tables: &[(&str, &[Field])] = &[
            ("RegisterRequest", REGISTER_REQUEST),
            ("NodeConfigPayload", CONFIG_PAYLOAD),
            ("AdapterConfig", ADAPTER),
            ("ConcreteProtocolProfile", PROFILE),
            ("NativeAdapterConfig", NATIVE),
            ("RunRequest", RUN_REQUEST),
            ("RunEvent", RUN_EVENT),
            ("ProviderTunnelRequest", TUNNEL_REQUEST),
            ("ProviderTunnelFrame", TUNNEL_FRAME),
            ("NodeCommandResponse", COMMAND_RESPONSE),
        ];
        assert!(!found.is_empty());
        for (message, number) in found {
            let table = tables
                .iter()
                .find(|(m, _)| *m == message)
                .unwrap_or_else(|| panic!("{message} has a repeated field but no table"))
                .1;
            assert!(
                table
                    .iter()
                    .any(|f| matches!(f, Repeated { .. }) && f.number() == u64::from(number)),
                "{message}.{number} is repeated but not counted"
            );
        }
        // Every slot is used once, fits the counter array, and is reached from the envelope.
        let mut slots = Vec::new();
        for (_, table) in tables {
            for f in *table {
                if let Repeated { slot, .. } = f {
                    slots.push(*slot);
                }
            }
        }
        slots.sort_unstable();
        assert_eq!(slots, (0..SLOTS).collect::<Vec<_>>());
        fn reach(fields: &[Field], into: &mut Vec<usize>) {
            for f in fields {
                match f {
                    Message { fields, .. } => reach(fields, into),
                    Repeated { slot, elem, .. } => {
                        into.push(*slot);
                        reach(elem, into);
                    }
                }
            }
        }
        let mut reached = Vec::new();
        reach(ENVELOPE, &mut reached);
        reached.sort_unstable();
        reached.dedup();
        assert_eq!(reached, slots, "every table hangs off the envelope");
    }
}
