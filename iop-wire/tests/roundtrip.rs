//! Every message of both wires survives encode → bytes → decode unchanged, and invalid field
//! values are rejected with the documented typed error.
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use iop_wire::codec::{Decoded, FrameCodec, WireFrame};
use iop_wire::control::*;
use iop_wire::error::{FrameError, InvalidMessage};
use iop_wire::runtime::*;
use iop_wire::validate::{ResponseStallTimeout, StallTimeoutError};

fn roundtrip<F: WireFrame + PartialEq + Clone + std::fmt::Debug>(frame: &F) {
    let codec = FrameCodec::new();
    let bytes = codec.encode_to_bytes(frame).expect("encodes");
    // Encoding by value (moving fields into the envelope) writes the same bytes, and decoding
    // without a copy reads the same frame.
    let mut owned = bytes::BytesMut::new();
    codec
        .encode_owned(frame.clone(), &mut owned)
        .expect("encodes");
    assert_eq!(owned.freeze(), bytes, "encode_owned differs from encode");
    match codec.decode_bytes::<F>(&bytes).expect("decodes") {
        Decoded::Frame { frame: back, .. } => assert_eq!(&back, frame),
        Decoded::Incomplete { .. } => panic!("incomplete"),
    }
    match codec.decode_slice::<F>(&bytes).expect("decodes") {
        Decoded::Frame {
            frame: back,
            consumed,
        } => {
            assert_eq!(consumed, bytes.len());
            assert_eq!(&back, frame);
            // And the bytes are stable (maps are ordered, so encoding is deterministic).
            assert_eq!(codec.encode_to_bytes(&back).expect("encodes"), bytes);
        }
        Decoded::Incomplete { .. } => panic!("incomplete"),
    }
}

fn meta() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("openai_tool_calls".to_owned(), "[]".to_owned()),
        ("k".to_owned(), "v".to_owned()),
    ])
}

fn binding() -> CredentialLeaseBinding {
    CredentialLeaseBinding {
        principal_id: "p-1".into(),
        slot_id: "slot-1".into(),
        route_id: "route-1".into(),
        profile: "openai".into(),
        upstream_target: "gpt-4o-mini".into(),
        node_id: "node-1".into(),
        recipient_key_id: "rk-1".into(),
        credential_revision: 4,
        route_revision: 5,
        projection_generation: 6,
    }
}

fn lease() -> CredentialLease {
    CredentialLease {
        version: 1,
        lease_id: [7; 16],
        issuer_key_id: "issuer-1".into(),
        issued_at_unix_ms: 1_700_000_000_000,
        not_after_unix_ms: 1_700_000_030_000,
        enc: Bytes::from_static(&[1; 32]),
        recipient_public_key: Bytes::from_static(&[2; 32]),
        ciphertext: Bytes::from_static(b"sealed"),
        signature: Bytes::from_static(&[3; 64]),
    }
}

fn stall() -> ExecutionFailure {
    ExecutionFailure {
        health: HealthEvidence::Unavailable,
        idle_duration: Duration::from_millis(300_123),
        run_id: "run-1".into(),
        attempt_id: "att-2".into(),
        fence: Fence::Unconfirmed,
        adapter: "openai-a".into(),
        target: "gpt-4o-mini".into(),
        health_observation_seq: Some(9),
    }
}

fn runtime_messages() -> Vec<RuntimeFrame> {
    let config = NodeConfigPayload {
        adapters: vec![
            AdapterConfig {
                name: "openai-a".into(),
                adapter_type: "openai_compat".into(),
                enabled: true,
                capacity: 8,
                long_context_capacity: 2,
                targets: vec!["gpt-4o-mini".into()],
                settings: AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                    base_url: "https://provider.invalid/v1".into(),
                    protocol_profile: ConcreteProtocolProfile {
                        name: "openai".into(),
                        operation_paths: BTreeMap::from([
                            (Operation::ChatCompletions, "/chat/completions".into()),
                            (Operation::Models, "/models".into()),
                        ]),
                        health_path: String::new(),
                        auth_header: "x-api-key".into(),
                        auth_prefix: String::new(),
                        headers: vec![Header {
                            name: "anthropic-version".into(),
                            value: Bytes::from_static(b"2023-06-01"),
                        }],
                    },
                    request_timeout_sec: 60,
                }),
            },
            AdapterConfig {
                name: String::new(),
                adapter_type: "ollama".into(),
                enabled: true,
                capacity: 1,
                long_context_capacity: 0,
                targets: vec!["llama3.1:8b".into()],
                settings: AdapterSettings::Native(NativeSettings {
                    base_url: "http://127.0.0.1:11434".into(),
                    options: meta(),
                }),
            },
        ],
        runtime: NodeRuntimeConfig { concurrency: 4 },
        revision: 12,
    };
    let run = RunRequest {
        run_id: "run-1".into(),
        adapter: "ollama".into(),
        target: "llama3.1:8b".into(),
        input: Bytes::from_static(b"{\"messages\":[]}"),
        metadata: meta(),
        response_stall_timeout: ResponseStallTimeout::from_wire_ms(45_000).unwrap(),
        timeout: Some(Duration::from_secs(600)),
        long_context: true,
        credential: Some(Box::new(ManagedCredential {
            lease: lease(),
            binding: binding(),
        })),
        trace: Some(Box::new(
            iop_wire::trace::TraceContext::parse(
                b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                Some(b"congo=t61rcWkgMzE"),
            )
            .unwrap(),
        )),
    };
    let tunnel = ProviderTunnelRequest {
        run_id: "run-2".into(),
        adapter: "openai-a".into(),
        target: "gpt-4o-mini".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        headers: vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }],
        body: Bytes::from_static(b"{\"stream\":true}"),
        stream: true,
        timeout: None,
        metadata: meta(),
        session_id: "sess".into(),
        long_context: false,
        operation: Some(Operation::ChatCompletions),
        response_stall_timeout: ResponseStallTimeout::DEFAULT,
        credential: None,
        trace: Some(Box::new(
            iop_wire::trace::TraceContext::parse(
                b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
                None,
            )
            .unwrap(),
        )),
        credit_window: 1 << 20,
    };
    let mut run_error = RunEvent::new(RunEventKind::Error);
    run_error.error = "response stalled".into();
    run_error.execution_failure = Some(FailureEvidence::Valid(stall()));
    let mut complete = RunEvent::new(RunEventKind::Complete);
    complete.metadata = meta();
    complete.usage = Some(Usage {
        prompt_tokens: 1,
        completion_tokens: 2,
        total_tokens: 3,
        cached_prompt_tokens: 1,
    });
    let frame = |sequence, payload| TunnelFrame {
        sequence,
        payload,
        metadata: BTreeMap::new(),
    };
    vec![
        RuntimeFrame::new(RuntimeMessage::RegisterRequest(RegisterRequest {
            node_id: "node-1".into(),
            version: "1.2.3".into(),
            adapter_types: vec!["openai_compat".into(), "demo".into()],
            recipient: Some(RecipientKey {
                key_id: "rk-1".into(),
                public_key: [9; 32],
            }),
            issuer_key_ids: vec!["p256:0011223344556677".into()],
            stream_credit: true,
        })),
        RuntimeFrame::new(RuntimeMessage::RegisterResponse(
            RegisterResponse::Accepted {
                node_id: "node-1".into(),
                config: config.clone(),
                heartbeat_interval: Some(Duration::from_secs(10)),
            },
        )),
        RuntimeFrame::new(RuntimeMessage::RegisterResponse(
            RegisterResponse::Rejected {
                reason: "no".into(),
            },
        )),
        RuntimeFrame::new(RuntimeMessage::NodeReadyRequest(NodeReadyRequest {
            node_id: "node-1".into(),
        })),
        RuntimeFrame::new(RuntimeMessage::NodeReadyResponse(NodeReadyResponse::Ready)),
        RuntimeFrame::new(RuntimeMessage::NodeReadyResponse(
            NodeReadyResponse::NotReady {
                reason: "superseded".into(),
            },
        )),
        RuntimeFrame::on_stream(1, RuntimeMessage::RunRequest(run)),
        RuntimeFrame::on_stream(1, RuntimeMessage::RunEvent(run_error)),
        RuntimeFrame::on_stream(1, RuntimeMessage::RunEvent(complete)),
        RuntimeFrame::on_stream(2, RuntimeMessage::ProviderTunnelRequest(tunnel)),
        RuntimeFrame::on_stream(
            2,
            RuntimeMessage::ProviderTunnelFrame(frame(
                1,
                TunnelPayload::ResponseStart {
                    status: 200,
                    headers: vec![Header {
                        name: "content-type".into(),
                        value: Bytes::from_static(b"text/event-stream"),
                    }],
                },
            )),
        ),
        RuntimeFrame::on_stream(
            2,
            RuntimeMessage::ProviderTunnelFrame(frame(
                2,
                TunnelPayload::Body(Bytes::from_static(b"data: {}\n\n")),
            )),
        ),
        RuntimeFrame::on_stream(
            2,
            RuntimeMessage::ProviderTunnelFrame(frame(3, TunnelPayload::Usage(Usage::default()))),
        ),
        RuntimeFrame::on_stream(
            2,
            RuntimeMessage::ProviderTunnelFrame(frame(4, TunnelPayload::End)),
        ),
        RuntimeFrame::on_stream(
            3,
            RuntimeMessage::ProviderTunnelFrame(frame(
                1,
                TunnelPayload::Error {
                    error: "response stalled".into(),
                    execution_failure: Some(FailureEvidence::Valid(stall())),
                },
            )),
        ),
        RuntimeFrame::new(RuntimeMessage::CancelRequest(CancelRequest {
            run_id: "run-2".into(),
            reason: "caller_disconnected".into(),
        })),
        RuntimeFrame::correlated(
            4,
            RuntimeMessage::NodeCommandRequest(NodeCommandRequest {
                kind: NodeCommandKind::Capabilities,
                adapter: "openai-a".into(),
                target: String::new(),
            }),
        ),
        RuntimeFrame::correlated(
            4,
            RuntimeMessage::NodeCommandResponse(NodeCommandResponse {
                ok: true,
                error: String::new(),
                capabilities: vec![Capability {
                    adapter_key: "openai-a".into(),
                    target: "gpt-4o-mini".into(),
                    provider_status: ProviderStatus::Available,
                    health_observation_seq: 10,
                    adapter: "openai_compat".into(),
                    instance_key: "openai-a".into(),
                }],
                result: BTreeMap::new(),
            }),
        ),
        RuntimeFrame::correlated(5, RuntimeMessage::NodeConfigRefreshRequest(config)),
        RuntimeFrame::correlated(
            5,
            RuntimeMessage::NodeConfigRefreshResponse(NodeConfigRefreshResponse {
                outcome: ConfigRefreshOutcome::RestartRequired,
                reason: "adapter type changed".into(),
                revision: 12,
            }),
        ),
        RuntimeFrame::correlated(6, RuntimeMessage::Ping),
        RuntimeFrame::correlated(6, RuntimeMessage::Pong),
        RuntimeFrame::on_stream(7, RuntimeMessage::StreamWindowUpdate(512 * 1024)),
    ]
}

#[test]
fn every_runtime_message_round_trips() {
    let frames = runtime_messages();
    let names: std::collections::BTreeSet<_> = frames.iter().map(|f| f.message.name()).collect();
    assert_eq!(
        names.len(),
        16,
        "one of each of the 16 runtime messages: {names:?}"
    );
    for f in &frames {
        roundtrip(f);
        validates_by_value(f);
        // The run and tunnel messages, which `encode_owned` writes without an `Envelope`,
        // under ids of every varint length: the same bytes as prost's.
        if f.stream_id == 0 {
            continue;
        }
        for (correlation_id, stream_id) in [(0, 1), (u64::MAX, 1), (127, 128), (300, u64::MAX)] {
            let f = RuntimeFrame {
                correlation_id,
                stream_id,
                message: f.message.clone(),
            };
            roundtrip(&f);
            validates_by_value(&f);
        }
    }
}

/// Validating by value (moved into the protobuf form and back, what the Edge's registry does
/// with each request it sends) gives the frame back unchanged, with the length
/// `validated_len` and the encoder give.
fn validates_by_value(f: &RuntimeFrame) {
    let (back, len) = f.clone().into_validated().expect("valid");
    assert_eq!(&back, f);
    assert_eq!(f.validated_len(), Ok(len));
    assert_eq!(FrameCodec::new().encode_to_bytes(f).unwrap().len(), len + 4);
}

#[test]
fn encode_owned_refuses_what_encode_refuses() {
    // A run request whose envelope is exactly the limit, then one byte over: both encoders
    // agree on the length, accept the first and refuse the second without writing.
    let frame = |input: usize| {
        let mut f = runtime_messages()
            .into_iter()
            .find(|f| matches!(f.message, RuntimeMessage::RunRequest(_)))
            .unwrap();
        if let RuntimeMessage::RunRequest(r) = &mut f.message {
            r.input = Bytes::from(vec![b'x'; input]);
        }
        f.correlation_id = 1 << 40;
        f
    };
    let len = FrameCodec::new()
        .encode_to_bytes(&frame(300))
        .unwrap()
        .len()
        - 4;
    let codec = FrameCodec::with_max_frame_len(len);
    let mut out = bytes::BytesMut::new();
    codec.encode_owned(frame(300), &mut out).unwrap();
    assert_eq!(out.len(), len + 4);
    for encode_owned in [false, true] {
        let mut out = bytes::BytesMut::new();
        let e = if encode_owned {
            codec.encode_owned(frame(301), &mut out).unwrap_err()
        } else {
            codec.encode(&frame(301), &mut out).unwrap_err()
        };
        assert_eq!(
            e,
            FrameError::OutgoingTooLarge {
                len: len + 1,
                max: len
            }
        );
        assert!(out.is_empty());
    }
}

#[test]
fn every_control_message_round_trips() {
    let projection = PrincipalProjection {
        generation: 3,
        issuer_key_id: "p256:0011223344556677".into(),
        staged_issuer_key_id: "p256:8899aabbccddeeff".into(),
        staged_issuer_activates_at_unix_ms: 1_780_000_000_000,
        parts_before: 0,
        principals: vec![
            ProjectedPrincipal {
                principal_id: "p-1".into(),
                display_name: "Team A".into(),
                enabled: true,
                limits: None,
            },
            ProjectedPrincipal {
                principal_id: "p-2".into(),
                display_name: "Team B".into(),
                enabled: true,
                limits: Some(PrincipalLimits {
                    requests_per_minute: 60,
                    tokens_per_minute: 100_000,
                    concurrent: 4,
                    budget_per_day_micro_usd: 0,
                    budget_per_month_micro_usd: 20_000_000,
                    models: vec![ModelLimits {
                        model: "gpt-4o".into(),
                        requests_per_minute: 10,
                        tokens_per_minute: 0,
                        concurrent: 1,
                    }],
                }),
            },
        ],
        tokens: vec![ProjectedToken {
            token_id: "t-1".into(),
            principal_id: "p-1".into(),
            sha256_digest: [5; 32],
        }],
        routes: vec![ProjectedRoute {
            route_id: "route-1".into(),
            principal_id: "p-1".into(),
            model: "gpt-4o-mini".into(),
            slot_id: "slot-1".into(),
            profile: "openai".into(),
            upstream_target: "gpt-4o-mini".into(),
            selector: "pool-a".into(),
            route_revision: 5,
            credential_revision: 4,
        }],
    };
    let snapshot = ProviderSnapshot {
        provider_id: "prov-1".into(),
        node_id: "node-1".into(),
        adapter: "openai-a".into(),
        target: "gpt-4o-mini".into(),
        category: "api".into(),
        status: "unavailable".into(),
        health: "offline".into(),
        enabled: true,
        ..Default::default()
    };
    let frames = vec![
        ControlFrame::new(ControlMessage::EdgeHelloRequest(EdgeHelloRequest {
            edge_id: "edge-1".into(),
            version: "1".into(),
            managed: true,
            metadata: meta(),
            projection_parts: true,
            max_frame_len: 65_536,
        })),
        ControlFrame::new(ControlMessage::EdgeHelloResponse(
            EdgeHelloResponse::Accepted {
                projection: Some(projection.clone()),
                heartbeat_interval_ms: Some(10_000),
                accepts_usage: true,
                max_frame_len: 1 << 20,
            },
        )),
        ControlFrame::new(ControlMessage::EdgeHelloResponse(
            EdgeHelloResponse::Rejected {
                reason: "empty edge_id".into(),
            },
        )),
        ControlFrame::correlated(1, ControlMessage::EdgeStatusRequest),
        ControlFrame::correlated(
            1,
            ControlMessage::EdgeStatusResponse(EdgeStatusResponse {
                edge_id: "edge-1".into(),
                nodes: vec![EdgeNodeSnapshot {
                    node_id: "node-1".into(),
                    connected: false,
                    config: EdgeNodeConfigSummary {
                        revision: 2,
                        adapters: vec![("openai-a".into(), "openai_compat".into())],
                    },
                    provider_snapshots: vec![snapshot],
                    refused: "issuer key not trusted: the control plane signs leases with p256:00"
                        .into(),
                    warning: "does not trust the staged issuer key p256:11".into(),
                }],
                omitted_nodes: 3,
            }),
        ),
        ControlFrame::correlated(
            2,
            ControlMessage::EdgeCommandRequest(EdgeCommandRequest {
                command_id: "c-1".into(),
                operation: "drain".into(),
                target_selector: "node-1".into(),
                args: meta(),
                metadata: BTreeMap::new(),
            }),
        ),
        ControlFrame::correlated(
            2,
            ControlMessage::EdgeCommandEvent(EdgeCommandEvent {
                command_id: "c-1".into(),
                phase: "running".into(),
                message: "draining".into(),
                metadata: BTreeMap::new(),
            }),
        ),
        ControlFrame::correlated(
            2,
            ControlMessage::EdgeCommandResponse(EdgeCommandResponse {
                command_id: "c-1".into(),
                ok: true,
                error: String::new(),
                result: meta(),
            }),
        ),
        ControlFrame::new(ControlMessage::EdgeNodeEvent(EdgeNodeEvent {
            kind: NodeEventKind::Connected,
            node_id: "node-1".into(),
            edge_id: "edge-1".into(),
            occurred_at_unix_ms: 1_700_000_000_000,
            metadata: BTreeMap::new(),
        })),
        // A part (added after the first release), then the apply request completing it.
        ControlFrame::new(ControlMessage::PrincipalProjectionPart(
            PrincipalProjection {
                parts_before: 0,
                issuer_key_id: String::new(),
                staged_issuer_key_id: String::new(),
                staged_issuer_activates_at_unix_ms: 0,
                ..projection.clone()
            },
        )),
        ControlFrame::correlated(
            3,
            ControlMessage::PrincipalProjectionApplyRequest(PrincipalProjection {
                parts_before: 1,
                ..projection.clone()
            }),
        ),
        ControlFrame::correlated(
            3,
            ControlMessage::PrincipalProjectionApplyRequest(projection),
        ),
        ControlFrame::correlated(
            3,
            ControlMessage::PrincipalProjectionApplyResponse(PrincipalProjectionApplyResponse {
                accepted: true,
                generation: 3,
                reason: String::new(),
            }),
        ),
        ControlFrame::correlated(
            4,
            ControlMessage::AcquireLeaseRequest(AcquireLeaseRequest {
                binding: binding(),
                recipient_public_key: [2; 32],
                trace: iop_wire::trace::TraceContext::parse(
                    b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                    None,
                ),
            }),
        ),
        ControlFrame::correlated(
            4,
            ControlMessage::AcquireLeaseResponse(AcquireLeaseResponse::Granted(lease())),
        ),
        ControlFrame::correlated(
            5,
            ControlMessage::AcquireLeaseResponse(AcquireLeaseResponse::Refused {
                reason: "stale generation".into(),
            }),
        ),
        ControlFrame::correlated(6, ControlMessage::Ping),
        ControlFrame::correlated(6, ControlMessage::Pong),
        ControlFrame::correlated(
            7,
            ControlMessage::EdgeUsageReport(EdgeUsageReport {
                records: vec![
                    UsageRecord {
                        request_id: "req-0011223344556677-1".into(),
                        at_unix_ms: 1_780_000_000_000,
                        principal_id: "p-1".into(),
                        model: "gpt-4o-mini".into(),
                        provider: "node-1/openai".into(),
                        input_tokens: 120,
                        output_tokens: 40,
                        cached_input_tokens: 100,
                        estimated: false,
                        cost_pico_usd: 58_000_000,
                        outcome: "completed".into(),
                        duration_us: 812_000,
                        first_byte_us: 95_000,
                        added_us: 310,
                    },
                    UsageRecord {
                        request_id: "req-0011223344556677-2".into(),
                        at_unix_ms: 1_780_000_000_500,
                        principal_id: "p-1".into(),
                        model: "gpt-4o-mini".into(),
                        outcome: "refused".into(),
                        ..UsageRecord::default()
                    },
                ],
            }),
        ),
        ControlFrame::correlated(
            7,
            ControlMessage::EdgeUsageAck(EdgeUsageAck {
                stored: 1,
                duplicates: 1,
            }),
        ),
    ];
    for f in &frames {
        roundtrip(f);
    }
}

fn decode_err(frame: &RuntimeFrame) -> InvalidMessage {
    // Encoding does not validate (domain values are trusted); decoding does.
    let codec = FrameCodec::new();
    let bytes = codec.encode_to_bytes(frame).unwrap();
    let e = match codec.decode_slice::<RuntimeFrame>(&bytes) {
        Err(FrameError::Invalid(e)) => e,
        other => panic!("expected an invalid message, got {other:?}"),
    };
    // The sender's checks refuse it as its receiver does.
    assert_eq!(frame.validated_len(), Err(e.clone()));
    assert_eq!(frame.clone().into_validated(), Err(e.clone()));
    e
}

#[test]
fn invalid_values_get_typed_errors_without_echoing_them() {
    let secret = "sk-live-SECRET";
    let bad_node = RuntimeFrame::new(RuntimeMessage::NodeReadyRequest(NodeReadyRequest {
        node_id: format!("{secret} x"),
    }));
    let e = decode_err(&bad_node);
    assert_eq!(e, InvalidMessage::InvalidCharacters("node_id"));
    assert!(!e.to_string().contains("SECRET"));

    let RuntimeMessage::RunRequest(mut run) = runtime_messages().swap_remove(6).message else {
        unreachable!()
    };
    run.credential = None;
    run.target = String::new();
    let e = decode_err(&RuntimeFrame::on_stream(
        1,
        RuntimeMessage::RunRequest(run.clone()),
    ));
    assert_eq!(e, InvalidMessage::MissingField("target"));

    // A stream message without a stream id, a connection message with one.
    run.target = "t".into();
    assert_eq!(
        decode_err(&RuntimeFrame::new(RuntimeMessage::RunRequest(run))),
        InvalidMessage::StreamId("missing on a stream message")
    );
    assert_eq!(
        decode_err(&RuntimeFrame::on_stream(9, RuntimeMessage::Ping)),
        InvalidMessage::StreamId("set on a connection-level message")
    );

    // A header that would inject a second header line.
    let RuntimeMessage::ProviderTunnelRequest(mut tunnel) =
        runtime_messages().swap_remove(9).message
    else {
        unreachable!()
    };
    tunnel.headers = vec![Header {
        name: "x-a".into(),
        value: Bytes::from_static(b"1\r\nAuthorization: x"),
    }];
    assert_eq!(
        decode_err(&RuntimeFrame::on_stream(
            2,
            RuntimeMessage::ProviderTunnelRequest(tunnel)
        )),
        InvalidMessage::InvalidCharacters("header.value")
    );

    // A lease without its binding is not a managed pair.
    let RuntimeMessage::RunRequest(mut run) = runtime_messages().swap_remove(6).message else {
        unreachable!()
    };
    if let Some(c) = run.credential.as_mut() {
        c.binding.node_id = String::new();
    }
    assert_eq!(
        decode_err(&RuntimeFrame::on_stream(1, RuntimeMessage::RunRequest(run))),
        InvalidMessage::MissingField("credential_binding.node_id")
    );
}

#[test]
fn stall_timeout_is_validated_on_the_wire() {
    assert_eq!(
        ResponseStallTimeout::from_wire_ms(-5),
        Err(StallTimeoutError::Negative)
    );
    assert_eq!(
        ResponseStallTimeout::DEFAULT.effective(),
        Duration::from_millis(300_000)
    );
}

#[test]
fn rejected_stall_evidence_keeps_the_terminal_and_reencodes_verbatim() {
    // Evidence without its run id: the ERROR terminal still decodes, the
    // evidence is marked rejected, and a relay re-encodes exactly what arrived.
    let mut bad = stall();
    bad.run_id = String::new();
    let mut ev = RunEvent::new(RunEventKind::Error);
    ev.execution_failure = Some(FailureEvidence::Valid(bad));
    let frame = RuntimeFrame::on_stream(1, RuntimeMessage::RunEvent(ev));
    let codec = FrameCodec::new();
    let bytes = codec.encode_to_bytes(&frame).unwrap();
    let Decoded::Frame { frame: back, .. } = codec.decode_slice::<RuntimeFrame>(&bytes).unwrap()
    else {
        panic!()
    };
    let RuntimeMessage::RunEvent(ev) = &back.message else {
        panic!()
    };
    assert_eq!(ev.kind, RunEventKind::Error);
    match &ev.execution_failure {
        Some(FailureEvidence::Rejected(r)) => assert_eq!(
            r.error,
            InvalidMessage::MissingField("execution_failure.run_id")
        ),
        other => panic!("expected rejected evidence, got {other:?}"),
    }
    assert_eq!(codec.encode_to_bytes(&back).unwrap(), bytes);

    // Evidence on a non-error event is rejected too.
    let mut ev = RunEvent::new(RunEventKind::Complete);
    ev.execution_failure = Some(FailureEvidence::Valid(stall()));
    let bytes = codec
        .encode_to_bytes(&RuntimeFrame::on_stream(1, RuntimeMessage::RunEvent(ev)))
        .unwrap();
    let Decoded::Frame { frame: back, .. } = codec.decode_slice::<RuntimeFrame>(&bytes).unwrap()
    else {
        panic!()
    };
    let RuntimeMessage::RunEvent(ev) = back.message else {
        panic!()
    };
    assert!(matches!(
        ev.execution_failure,
        Some(FailureEvidence::Rejected(_))
    ));
}

#[test]
fn principal_limits_name_each_model_once() {
    let limits = |models: &[&str]| PrincipalLimits {
        requests_per_minute: 60,
        models: models
            .iter()
            .map(|m| ModelLimits {
                model: (*m).into(),
                requests_per_minute: 1,
                ..ModelLimits::default()
            })
            .collect(),
        ..PrincipalLimits::default()
    };
    let frame = |l: PrincipalLimits| {
        ControlFrame::new(ControlMessage::PrincipalProjectionApplyRequest(
            PrincipalProjection {
                generation: 2,
                principals: vec![ProjectedPrincipal {
                    principal_id: "p-1".into(),
                    display_name: String::new(),
                    enabled: true,
                    limits: Some(l),
                }],
                ..PrincipalProjection::default()
            },
        ))
    };
    let codec = FrameCodec::new();
    let decode = |f: &ControlFrame| {
        let bytes = codec.encode_to_bytes(f).unwrap();
        codec.decode_slice::<ControlFrame>(&bytes)
    };
    let ok = frame(limits(&["a", "b"]));
    assert!(matches!(decode(&ok), Ok(Decoded::Frame { frame, .. }) if frame == ok));
    match decode(&frame(limits(&["a", "a"]))) {
        Err(FrameError::Invalid(e)) => assert_eq!(
            e,
            InvalidMessage::InvalidValue {
                field: "projection.principals.limits.models.model",
                rule: "unique per principal",
            }
        ),
        other => panic!("a repeated model must be refused, got {other:?}"),
    }
    match decode(&frame(limits(&["bad model"]))) {
        Err(FrameError::Invalid(e)) => {
            assert!(matches!(e, InvalidMessage::InvalidCharacters(_)), "{e:?}")
        }
        other => panic!("a model with a space must be refused, got {other:?}"),
    }
}

#[test]
fn usage_records_are_validated_without_echoing_them() {
    let codec = FrameCodec::new();
    let record = UsageRecord {
        request_id: "req-1".into(),
        principal_id: "p-1".into(),
        model: "m".into(),
        outcome: "completed".into(),
        ..UsageRecord::default()
    };
    let decode = |r: UsageRecord| {
        let f = ControlFrame::correlated(
            3,
            ControlMessage::EdgeUsageReport(EdgeUsageReport { records: vec![r] }),
        );
        let bytes = codec.encode_to_bytes(&f).unwrap();
        match codec.decode_slice::<ControlFrame>(&bytes) {
            Err(FrameError::Invalid(e)) => Some(e),
            Ok(_) => None,
            Err(e) => panic!("{e:?}"),
        }
    };
    assert_eq!(decode(record.clone()), None);
    let secret = "sk-live-SECRET";
    let e = decode(UsageRecord {
        principal_id: format!("{secret} x"),
        ..record.clone()
    })
    .unwrap();
    assert_eq!(e, InvalidMessage::InvalidCharacters("usage.principal_id"));
    assert!(!e.to_string().contains("SECRET"));
    assert!(matches!(
        decode(UsageRecord {
            cached_input_tokens: 5,
            input_tokens: 4,
            ..record.clone()
        }),
        Some(InvalidMessage::InvalidValue { field: "usage", .. })
    ));
    assert!(matches!(
        decode(UsageRecord {
            output_tokens: u64::MAX,
            ..record.clone()
        }),
        Some(InvalidMessage::InvalidValue { field: "usage", .. })
    ));
    // More records than one report may hold.
    let f = ControlFrame::correlated(
        3,
        ControlMessage::EdgeUsageReport(EdgeUsageReport {
            records: vec![record; MAX_USAGE_RECORDS + 1],
        }),
    );
    let bytes = codec.encode_to_bytes(&f).unwrap();
    assert!(matches!(
        codec.decode_slice::<ControlFrame>(&bytes),
        Err(FrameError::Invalid(InvalidMessage::TooLong(
            "usage.records"
        )))
    ));
}
