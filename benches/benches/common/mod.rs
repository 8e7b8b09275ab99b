//! The two runtime frames the codec benchmarks measure (shared by `frame_codec` and
//! `codec_paired`).

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use iop_wire::runtime::{RunRequest, RuntimeFrame, RuntimeMessage, TunnelFrame, TunnelPayload};
use iop_wire::validate::ResponseStallTimeout;

/// A provider tunnel BODY carrying ~1 KiB of OpenAI-style SSE chunks.
pub(crate) fn tunnel_body_1k() -> RuntimeFrame {
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
pub(crate) fn run_request() -> RuntimeFrame {
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
            trace: None,
        }),
    )
}

pub(crate) fn frames() -> Vec<(&'static str, RuntimeFrame)> {
    vec![
        ("tunnel_body_1k", tunnel_body_1k()),
        ("run_request", run_request()),
    ]
}
