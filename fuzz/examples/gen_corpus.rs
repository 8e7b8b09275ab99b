//! Regenerates the committed seed corpora in `fuzz/corpus/<target>/`:
//!
//! ```sh
//! cd fuzz && cargo run --example gen_corpus
//! ```
//!
//! `frame_decoder` seeds are real encoded frames; `tunnel_sequencer` and `registry_ops` seeds
//! are readable operation lists written in `arbitrary`'s input format, each checked by parsing
//! it back. Every seed is also run through its target once.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use bytes::Bytes;
use iop_fuzz::seed::{self, ToSeed};
use iop_fuzz::{frame_decoder, registry_ops, tunnel_sequencer};
use iop_wire::codec::{FrameCodec, WireFrame};
use iop_wire::control::{
    ControlFrame, ControlMessage, EdgeHelloRequest, EdgeHelloResponse, EdgeNodeSnapshot,
    EdgeStatusResponse, EdgeUsageAck, EdgeUsageReport, ModelLimits, PrincipalLimits,
    PrincipalProjection, ProjectedPrincipal, ProjectedRoute, ProjectedToken, UsageRecord,
};
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, CancelRequest, ExecutionFailure, FailureEvidence, Fence,
    Header, HealthEvidence, NodeConfigPayload, NodeReadyRequest, NodeReadyResponse,
    NodeRuntimeConfig, OpenAiCompatSettings, Operation, ProviderTunnelRequest, RegisterRequest,
    RegisterResponse, RunEvent, RunEventKind, RunRequest, RuntimeFrame, RuntimeMessage,
    TunnelFrame, TunnelPayload, Usage,
};
use iop_wire::validate::ResponseStallTimeout;

/// Largest seed we commit.
const MAX_SEED: usize = 4096;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    frame_seeds(&root.join("frame_decoder"));
    tunnel_seeds(&root.join("tunnel_sequencer"));
    registry_seeds(&root.join("registry_ops"));
    lease_seeds(&root.join("lease_open"));
    signed_request_seeds(&root.join("signed_request"));
    stream_translate_seeds(&root.join("stream_translate"));
    report_decode_seeds(&root.join("report_decode"));
    ping_scanner_seeds(&root.join("ping_scanner"));
    usage_filter_seeds(&root.join("usage_filter"));
    trace_context_seeds(&root.join("trace_context"));
    passthrough_splice_seeds(&root.join("passthrough_splice"));
    usage_scan_seeds(&root.join("usage_scan"));
}

// === usage_scan ===

/// Provider responses as the Node's usage scanner reads them: each dialect's stream (chat with
/// `include_usage`, LF and CRLF; Anthropic with and without event lines, cache counts; the
/// Responses API), each dialect's JSON body, counts past `u64`, a text that mentions
/// `message_stop`, usage after `[DONE]`, an unterminated last line, lines that are not JSON, a
/// line at the small line bound, and a line and a body past the small bounds. Byte 0 is the read
/// size, byte 1's low bit says SSE and its next bit small bounds.
fn usage_scan_seeds(dir: &Path) {
    let dir = fresh_dir(dir);
    let cases: [(&str, u8, u8, &[u8]); 15] = [
        (
            "after_done",
            6,
            1,
            b"data: [DONE]\n\ndata: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n",
        ),
        (
            "anthropic_no_event_lines",
            3,
            1,
            b"data: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":2,\"output_tokens\":4}}\n\ndata: {\"type\":\"message_stop\",\"usage\":7}\n\n",
        ),
        (
            "anthropic_stream",
            11,
            1,
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":12,\"output_tokens\":1,\"cache_read_input_tokens\":70,\"cache_creation_input_tokens\":20}}}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hi\"}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        ),
        (
            "chat_stream",
            7,
            1,
            b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5,\"total_tokens\":8,\"prompt_tokens_details\":{\"cached_tokens\":2}}}\n\ndata: [DONE]\n\n",
        ),
        (
            "chat_stream_crlf",
            5,
            1,
            b"data: {\"choices\":[]}\r\n\r\ndata: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5}}\r\n\r\ndata: [DONE]\r\n\r\n",
        ),
        (
            "json_chat",
            16,
            0,
            b"{\"id\":\"x\",\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":5,\"total_tokens\":105,\"prompt_tokens_details\":{\"cached_tokens\":80}}}",
        ),
        (
            "json_huge_numbers",
            2,
            0,
            b"{\"usage\":{\"prompt_tokens\":18446744073709551615,\"completion_tokens\":18446744073709551615,\"prompt_tokens_details\":{\"cached_tokens\":99999999999999999999}}}",
        ),
        (
            "json_messages",
            16,
            0,
            b"{\"id\":\"m\",\"type\":\"message\",\"usage\":{\"input_tokens\":10,\"cache_read_input_tokens\":70,\"cache_creation_input_tokens\":20,\"output_tokens\":5}}",
        ),
        (
            "mentions_message_stop",
            9,
            1,
            b"data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"message_stop\"}}]}\n\n",
        ),
        (
            "not_json",
            1,
            1,
            b"data: not json\n\n: comment\n\nevent: message_stop\n\n",
        ),
        (
            "responses_stream",
            13,
            1,
            b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null}}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":5,\"output_tokens\":3,\"input_tokens_details\":{\"cached_tokens\":4}}}}\n\n",
        ),
        (
            "unterminated_last_line",
            4,
            1,
            b"data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5}}",
        ),
        (
            "small_bounds_long_line",
            5,
            3,
            b"data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5}}\n\ndata: {\"pad\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\",\"usage\":{\"prompt_tokens\":7}}\n\ndata: [DONE]\n\n",
        ),
        (
            "small_bounds_json",
            16,
            2,
            b"{\"id\":\"chatcmpl-1\",\"choices\":[{\"message\":{\"content\":\"a reply long enough to pass the small body bound of the fuzz target, which is two hundred and fifty-six bytes, so that the usage after it is not read\"}}],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}",
        ),
        (
            "small_bounds_line_at_bound",
            9,
            3,
            b"data:                              {\"usage\":{\"prompt_tokens\":7}}\ndata: [DONE]\n",
        ),
    ];
    for (name, read, mode, body) in cases {
        let mut s = vec![read, mode];
        s.extend_from_slice(body);
        iop_fuzz::usage_scan::run(&s);
        write(&dir, name, &s);
    }
}

// === passthrough_splice ===

/// Request bodies as clients send them (the OpenAI and Anthropic SDKs' compact form, pretty
/// printed, with a nested `model`), with and without `stream_options`, and the shapes the
/// splice declines: a second `model` or `stream`, an escaped name, another `stream_options`.
/// Byte 0 is the flags (bit 0 ask for usage, bits 1–2 the target).
fn passthrough_splice_seeds(dir: &Path) {
    let dir = fresh_dir(dir);
    let cases: [(&str, u8, &str); 11] = [
        (
            "chat",
            2,
            r#"{"model":"alias","messages":[{"role":"user","content":"hi"}],"temperature":0.5}"#,
        ),
        (
            "chat_stream_usage",
            3,
            r#"{"messages":[{"role":"user","content":"hi"}],"model":"alias","stream":true}"#,
        ),
        (
            "pretty_nested",
            4,
            "{\n  \"metadata\": {\"model\": \"x\"},\n  \"model\" : \"alias\",\n  \"max_tokens\": 1e1\n}",
        ),
        (
            "client_asked_usage",
            1,
            r#"{"model":"alias","stream":true,"stream_options":{ "include_usage" : true }}"#,
        ),
        (
            "other_stream_options",
            3,
            r#"{"model":"alias","stream_options":{"include_usage":false}}"#,
        ),
        (
            "second_model",
            2,
            r#"{"model":"cheap","messages":[],"model":"alias"}"#,
        ),
        (
            "second_stream",
            3,
            r#"{"model":"alias","stream":false,"stream":true}"#,
        ),
        (
            "escaped_name",
            2,
            r#"{"mod\u0065l":"cheap","model":"alias"}"#,
        ),
        (
            // Found by the fuzzer: a space inside a name is part of the name.
            "space_inside_name",
            0x2d,
            r#"{"model":"alias","ream":true,"stream_options":{ "include_usage ": true }}"#,
        ),
        (
            // Found by the fuzzer: numbers `serde_json` does not round-trip (the splice keeps
            // the client's spelling; the oracle compares values before serialising).
            "long_floats",
            2,
            r#"{"omdel":"cheapv","zzs":[8.888886666666,66666666666666666666666666666666666666666666666666666666666666668888888888888888888886666666666666666666,66666666666666666666666666666666886666666666666666666,666666666666666666666666666666666668],"model":")alias"}"#,
        ),
        (
            "anthropic",
            6,
            r#"{"max_tokens":16,"model":"alias","system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
        ),
    ];
    for (name, flags, body) in cases {
        let mut s = vec![flags];
        s.extend_from_slice(body.as_bytes());
        iop_fuzz::passthrough_splice::run(&s);
        write(&dir, name, &s);
    }
}

// === trace_context ===

/// The recommendation's examples, with and without a `tracestate`, a later version with more
/// after it, and the shapes it refuses (all-zero ids, uppercase hex, version `ff`, a short one).
/// Byte 0 is where the `tracestate` starts.
fn trace_context_seeds(dir: &Path) {
    let dir = fresh_dir(dir);
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let cases: [(&str, &str, &str); 7] = [
        ("w3c_example", tp, ""),
        ("with_state", tp, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
        (
            "later_version",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00-x",
            "",
        ),
        (
            "zero_trace",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "",
        ),
        (
            "uppercase",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "",
        ),
        (
            "version_ff",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "",
        ),
        (
            "short",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "a=b",
        ),
    ];
    for (name, parent, state) in cases {
        let mut s = vec![u8::try_from(parent.len()).expect("short")];
        s.extend_from_slice(parent.as_bytes());
        s.extend_from_slice(state.as_bytes());
        iop_fuzz::trace_context::run(&s);
        write(&dir, name, &s);
    }
}

// === usage_filter ===

/// Chat streams as providers send them: with the usage chunk (LF and CRLF), without it, a text
/// that says "usage", an unterminated last event, and bare-CR events. Byte 0 is the read size.
fn usage_filter_seeds(dir: &Path) {
    let dir = fresh_dir(dir);
    let delta = |t: &str| {
        format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{t}\"}}}}]}}\n\n"
        )
    };
    let usage = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\n";
    let done = "data: [DONE]\n\n";
    let cases: Vec<(&str, u8, String)> = vec![
        (
            "with_usage",
            7,
            format!("{}{}{usage}{done}", delta("Hello"), delta(" world")),
        ),
        (
            "crlf",
            13,
            format!(
                "{}{}{done}",
                delta("a").replace("\n\n", "\r\n\r\n"),
                usage.replace("\n\n", "\r\n\r\n")
            ),
        ),
        ("no_usage", 64, format!("{}{done}", delta("hi"))),
        (
            "text_says_usage",
            5,
            format!("{}{usage}{done}", delta("\\\"usage\\\"")),
        ),
        ("unterminated", 3, format!("{}data: [DONE]", delta("x"))),
        ("bare_cr", 4, format!("{}\r\r", usage.trim_end())),
        (
            "usage_with_choices",
            200,
            "data: {\"choices\":[{\"index\":0,\"delta\":{}}],\"usage\":{\"total_tokens\":1}}\n\n"
                .to_owned(),
        ),
    ];
    for (name, read, body) in cases {
        let mut s = vec![read];
        s.extend_from_slice(body.as_bytes());
        iop_fuzz::usage_filter::run(&s);
        write(&dir, name, &s);
    }
}

// === ping_scanner ===

/// A client's HTTP/2 bytes: the preface, SETTINGS, a call (HEADERS, DATA), pings between
/// calls, a ping flood, acks of the server's pings, and bytes that are not HTTP/2. The first
/// byte is the read size, the second the clock step per read (ms).
fn ping_scanner_seeds(dir: &Path) {
    let dir = fresh_dir(dir);
    let frame = |kind: u8, flags: u8, payload: &[u8]| {
        let len = payload.len();
        let mut f = vec![0, (len >> 8) as u8, len as u8, kind, flags, 0, 0, 0, 1];
        f.extend_from_slice(payload);
        f
    };
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    let settings = frame(0x4, 0, &[0, 3, 0, 0, 0, 100]);
    let headers = frame(0x1, 0x4, &[0x83, 0x86]);
    let data = frame(0x0, 0x1, &[0, 0, 0, 0, 2, 8, 1]);
    let ping = frame(0x6, 0, &[7; 8]);
    let ack = frame(0x6, 0x1, &[1; 8]);
    let join = |parts: &[&[u8]]| parts.concat();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "call",
            join(&[&[64, 0], &preface, &settings, &headers, &data]),
        ),
        (
            "pings_between_calls",
            join(&[
                &[9, 0],
                &preface,
                &settings,
                &ping,
                &ping,
                &headers,
                &data,
                &ping,
                &ping,
                &headers,
            ]),
        ),
        (
            "ping_flood",
            join(&[
                &[1, 0],
                &preface,
                &settings,
                &ping,
                &ping,
                &ping,
                &ping,
                &ping,
            ]),
        ),
        (
            "slow_pings",
            join(&[&[9, 200], &preface, &ping, &ping, &ping, &ping]),
        ),
        (
            "server_ping_acks",
            join(&[&[17, 0], &preface, &ack, &ack, &ack, &ack]),
        ),
        (
            "not_http2",
            join(&[&[5, 0], b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"]),
        ),
    ];
    for (name, s) in cases {
        iop_fuzz::ping_scanner::run(&s);
        write(&dir, name, &s);
    }
}

// === report_decode ===

/// `ReportRuntimeRequest`s as workers send them (a heartbeat, sorted counters), and the shapes
/// the decoder must treat as prost does: unsorted and repeated proxies, unknown fields of each
/// wire type, a group, a repeated scalar, bad UTF-8. The first byte is `maxRuntimeCounters`.
fn report_decode_seeds(dir: &Path) {
    use prost::Message as _;
    use proxypool_controller::proto::controlplane::{ProxyCounters, ReportRuntimeRequest};
    let dir = fresh_dir(dir);
    let request = |ids: &[(&str, i64)]| ReportRuntimeRequest {
        worker_id: "worker-1".into(),
        session_id: vec![7; 16].into(),
        sequence: 42,
        snapshot_version: 3,
        ownership_epoch: 1,
        observed_at_unix_ms: 1_764_460_800_000,
        counters: ids
            .iter()
            .map(|(id, n)| ProxyCounters {
                proxy_id: (*id).into(),
                in_flight: *n,
                open_connections: 2,
            })
            .collect(),
    };
    let seed = |max: u8, body: Vec<u8>| {
        let mut s = vec![max];
        s.extend_from_slice(&body);
        s
    };
    let sorted = request(&[("proxy-00001", 1), ("proxy-00002", 0), ("proxy-00003", 9)]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("heartbeat", seed(16, request(&[]).encode_to_vec())),
        ("sorted", seed(16, sorted.encode_to_vec())),
        (
            "unsorted_repeated",
            seed(16, request(&[("b", 1), ("a", 2), ("b", 3)]).encode_to_vec()),
        ),
        ("over_limit", seed(2, sorted.encode_to_vec())),
        ("negative", seed(16, request(&[("a", -1)]).encode_to_vec())),
        ("unknown_fields", {
            let mut b = sorted.encode_to_vec();
            // Field 9 varint, field 10 fixed64, field 11 bytes, field 12 fixed32, field 13 group.
            b.extend_from_slice(&[0x48, 0x96, 0x01]);
            b.extend_from_slice(&[0x51, 1, 2, 3, 4, 5, 6, 7, 8]);
            b.extend_from_slice(&[0x5a, 0x02, 0xaa, 0xbb]);
            b.extend_from_slice(&[0x65, 1, 2, 3, 4]);
            b.extend_from_slice(&[0x6b, 0x08, 0x01, 0x6c]);
            seed(16, b)
        }),
        ("repeated_scalar", {
            let mut b = sorted.encode_to_vec();
            // sequence again: the last one wins.
            b.extend_from_slice(&[0x18, 0x2b]);
            seed(16, b)
        }),
        // Counters at the edge of the decoder's path for the usual encoding (`0a len id [10 n]
        // [18 n]`) and its general path: fields out of order, a count of two varint bytes, a
        // repeated id, a length written in two bytes, a non-ASCII id.
        ("fast_path_edges", {
            let mut b = vec![0x0a, 0x01, b'w'];
            b.extend_from_slice(&[0x3a, 0x06, 0x0a, 0x02, b'a', b'b', 0x10, 0x05]);
            b.extend_from_slice(&[0x3a, 0x07, 0x18, 0x01, 0x10, 0x02, 0x0a, 0x01, b'c']);
            b.extend_from_slice(&[0x3a, 0x06, 0x0a, 0x01, b'd', 0x10, 0xc8, 0x01]);
            b.extend_from_slice(&[0x3a, 0x06, 0x0a, 0x01, b'e', 0x0a, 0x01, b'f']);
            b.extend_from_slice(&[0x3a, 0x83, 0x00, 0x0a, 0x01, b'g']);
            b.extend_from_slice(&[0x3a, 0x05, 0x0a, 0x03, b'h', 0xc3, 0xa9]);
            seed(16, b)
        }),
        ("bad_utf8", {
            let mut b = request(&[("a", 1)]).encode_to_vec();
            let at = b.iter().rposition(|&c| c == b'a').expect("the id");
            b[at] = 0xff;
            seed(16, b)
        }),
    ];
    for (name, s) in cases {
        iop_fuzz::report_decode::run(&s);
        write(&dir, name, &s);
    }
}

// === stream_translate ===

/// The dialect crate's golden upstream streams (the API references' examples), each under
/// every client encoder, split in the middle.
fn stream_translate_seeds(dir: &Path) {
    let dir = fresh_dir(dir);
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("../iop-edge/dialect/tests/golden");
    for (name, upstream) in [
        ("chat_stream", 0u8),
        ("chat_tools_stream", 0),
        ("messages_stream", 1),
        ("messages_tools_stream", 1),
    ] {
        let body = fs::read(golden.join(format!("{name}.sse"))).expect("golden stream");
        for (encoder, label) in [(0u8, "chat"), (1, "responses"), (2, "messages")] {
            let mut seed = vec![upstream | (encoder << 1), 128];
            seed.extend_from_slice(&body);
            iop_fuzz::stream_translate::run(&seed);
            fs::write(dir.join(format!("{name}-to-{label}")), &seed).expect("write seed");
        }
    }
}

// === signed_request ===

fn signed_request_seeds(dir: &Path) {
    use iop_fuzz::signed_request::{NOW, encode, identity, key, run};
    use orbit_runtime::signing::sign;
    let dir = fresh_dir(dir);
    let cases: [(&str, &str, &str, &[u8]); 3] = [
        (
            "heartbeat",
            "POST",
            "/api/v1/edge-runtime/heartbeat",
            br#"{"reported_address":"203.0.113.7"}"#,
        ),
        (
            "desired_state",
            "GET",
            "/api/v1/edge-runtime/desired-state",
            b"",
        ),
        (
            "apply_result_query",
            "POST",
            "/api/v1/edge-runtime/apply-result?x=1",
            br#"{"version":3,"results":[]}"#,
        ),
    ];
    for (i, (name, method, target, body)) in cases.into_iter().enumerate() {
        let nonce = format!("{i:032x}");
        let h = sign(&key(), &identity(), method, target, body, NOW, &nonce);
        let seed = encode(&h, method, target, body);
        write(&dir, name, &seed);
        run(&seed);
    }
    // A valid request with the signature of another body: parses, fails verification.
    let h = sign(
        &key(),
        &identity(),
        "POST",
        "/x",
        b"a",
        NOW,
        &"f".repeat(32),
    );
    let seed = encode(&h, "POST", "/x", b"b");
    write(&dir, "digest_mismatch", &seed);
    run(&seed);
}

// === lease_open ===

fn lease_seeds(dir: &Path) {
    use iop_fuzz::lease_open;
    let dir = fresh_dir(dir);
    let f = lease_open::fixture();
    // Mode 0: raw envelopes (a valid one, and one sealed to another binding).
    let mut valid = vec![0u8];
    valid.extend_from_slice(&f.valid.to_bytes());
    write(&dir, "valid_envelope", &valid);
    lease_open::run(&valid);
    let mut moved = f.valid.clone();
    moved.binding.route_revision += 1;
    f.issuer.resign(&mut moved).expect("resign");
    let mut moved_bytes = vec![0u8];
    moved_bytes.extend_from_slice(&moved.to_bytes());
    write(&dir, "resigned_other_binding", &moved_bytes);
    lease_open::run(&moved_bytes);
    // Mode 1/3: byte flips of the valid envelope, without and with re-signing.
    for (name, seed) in [
        ("flip_signature", vec![1u8, 250, 0x01]),
        ("flip_ciphertext_resigned", vec![3u8, 200, 0x80]),
        ("flip_binding_resigned", vec![3u8, 30, 0x02]),
        ("flip_timestamps_resigned", vec![3u8, 100, 0x10, 110, 0x01]),
    ] {
        write(&dir, name, &seed);
        lease_open::run(&seed);
    }
}

fn fresh_dir(dir: &Path) -> PathBuf {
    if dir.exists() {
        fs::remove_dir_all(dir).expect("remove old corpus");
    }
    fs::create_dir_all(dir).expect("create corpus dir");
    dir.to_owned()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    assert!(bytes.len() < MAX_SEED, "{name} is {} bytes", bytes.len());
    fs::write(dir.join(name), bytes).expect("write seed");
    println!("{:>5} B  {}/{name}", bytes.len(), dir.display());
}

// === frame_decoder ===

fn frame_seeds(dir: &Path) {
    let dir = fresh_dir(dir);
    let codec = FrameCodec::with_max_frame_len(frame_decoder::MAX_FRAME_LEN);
    let frame = |name: &str, f: &dyn Encode| {
        let bytes = f.encode(codec);
        frame_decoder::run(&bytes);
        write(&dir, name, &bytes);
    };

    let register = RegisterRequest {
        node_id: "node-1".into(),
        version: "0.1.0".into(),
        adapter_types: vec!["openai_compat".into(), "demo".into()],
        ..Default::default()
    };
    frame(
        "register_request",
        &rt(RuntimeMessage::RegisterRequest(register)),
    );

    let config = NodeConfigPayload {
        adapters: vec![AdapterConfig {
            name: "oai".into(),
            adapter_type: "openai_compat".into(),
            enabled: true,
            capacity: 4,
            long_context_capacity: 1,
            targets: vec!["gpt-4o-mini".into()],
            settings: AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                base_url: "http://127.0.0.1:8080/v1".into(),
                request_timeout_sec: 30,
                ..Default::default()
            }),
        }],
        runtime: NodeRuntimeConfig { concurrency: 8 },
        revision: 3,
    };
    let accepted = RegisterResponse::Accepted {
        node_id: "node-1".into(),
        config,
        heartbeat_interval: Some(Duration::from_secs(10)),
    };
    frame(
        "register_response",
        &rt(RuntimeMessage::RegisterResponse(accepted)),
    );
    let ready = NodeReadyRequest {
        node_id: "node-1".into(),
    };
    frame(
        "ready_request",
        &rt(RuntimeMessage::NodeReadyRequest(ready)),
    );
    frame(
        "ready_response",
        &rt(RuntimeMessage::NodeReadyResponse(NodeReadyResponse::Ready)),
    );

    let run = RunRequest {
        run_id: "run-42".into(),
        adapter: "oai".into(),
        target: "gpt-4o-mini".into(),
        input: Bytes::from_static(br#"{"messages":[{"role":"user","content":"hi"}]}"#),
        metadata: BTreeMap::from([("trace_id".into(), "abc123".into())]),
        response_stall_timeout: ResponseStallTimeout::from_wire_ms(30_000).expect("valid"),
        timeout: Some(Duration::from_secs(120)),
        long_context: false,
        credential: None,
        trace: iop_wire::trace::TraceContext::parse(
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some(b"congo=t61rcWkgMzE"),
        )
        .map(Box::new),
    };
    frame("run_request", &on_stream(RuntimeMessage::RunRequest(run)));
    let mut delta = RunEvent::new(RunEventKind::Delta);
    delta.delta = "Hello".into();
    frame(
        "run_event_delta",
        &on_stream(RuntimeMessage::RunEvent(delta)),
    );
    let stall = ExecutionFailure {
        health: HealthEvidence::Available,
        idle_duration: Duration::from_millis(30_000),
        run_id: "run-42".into(),
        attempt_id: "attempt-1".into(),
        fence: Fence::Confirmed,
        adapter: "oai".into(),
        target: "gpt-4o-mini".into(),
        health_observation_seq: Some(7),
    };
    let mut error = RunEvent::new(RunEventKind::Error);
    error.error = "response stalled".into();
    error.usage = Some(Usage {
        prompt_tokens: 10,
        completion_tokens: 2,
        total_tokens: 12,
        cached_prompt_tokens: 0,
    });
    error.execution_failure = Some(FailureEvidence::Valid(stall.clone()));
    frame(
        "run_event_error_stall",
        &on_stream(RuntimeMessage::RunEvent(error)),
    );
    // Evidence on a non-error event decodes as rejected evidence, kept raw.
    let mut rejected = RunEvent::new(RunEventKind::Complete);
    rejected.execution_failure = Some(FailureEvidence::Valid(stall));
    frame(
        "run_event_rejected_evidence",
        &on_stream(RuntimeMessage::RunEvent(rejected)),
    );

    let start = TunnelPayload::ResponseStart {
        status: 200,
        headers: vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"text/event-stream"),
        }],
    };
    let body = TunnelPayload::Body(Bytes::from_static(
        b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
    ));
    let usage = TunnelPayload::Usage(Usage {
        prompt_tokens: 5,
        completion_tokens: 1,
        total_tokens: 6,
        cached_prompt_tokens: 0,
    });
    let error = TunnelPayload::Error {
        error: "upstream reset".into(),
        execution_failure: None,
    };
    for (i, (name, payload)) in [
        ("tunnel_start", start),
        ("tunnel_body", body),
        ("tunnel_usage", usage),
        ("tunnel_end", TunnelPayload::End),
        ("tunnel_error", error),
    ]
    .into_iter()
    .enumerate()
    {
        let tf = TunnelFrame {
            sequence: i as u64 + 1,
            payload,
            metadata: BTreeMap::new(),
        };
        frame(name, &on_stream(RuntimeMessage::ProviderTunnelFrame(tf)));
    }
    let cancel = CancelRequest {
        run_id: "run-42".into(),
        reason: "client_disconnected".into(),
    };
    frame("cancel_request", &rt(RuntimeMessage::CancelRequest(cancel)));
    frame("ping", &RuntimeFrame::correlated(9, RuntimeMessage::Ping));
    // Per-stream credit: a Node that announces it, a tunnel opened with a window, an update.
    let credited = RegisterRequest {
        node_id: "node-2".into(),
        version: "0.1.0".into(),
        stream_credit: true,
        ..Default::default()
    };
    frame(
        "register_request_stream_credit",
        &rt(RuntimeMessage::RegisterRequest(credited)),
    );
    let tunnel = ProviderTunnelRequest {
        run_id: "run-43".into(),
        adapter: "openai-a".into(),
        target: "gpt-4o-mini".into(),
        method: "POST".into(),
        path: String::new(),
        headers: vec![Header {
            name: "content-type".into(),
            value: "application/json".into(),
        }],
        body: r#"{"model":"gpt-4o-mini","stream":true}"#.into(),
        stream: true,
        operation: Some(Operation::ChatCompletions),
        credit_window: 1 << 20,
        ..Default::default()
    };
    frame(
        "tunnel_request_credit_window",
        &on_stream(RuntimeMessage::ProviderTunnelRequest(tunnel)),
    );
    frame(
        "stream_window_update",
        &on_stream(RuntimeMessage::StreamWindowUpdate(512 * 1024)),
    );
    // One header more than validation takes: the codec counts it before prost builds any.
    let crowded = TunnelFrame {
        sequence: 1,
        payload: TunnelPayload::ResponseStart {
            status: 200,
            headers: vec![
                Header {
                    name: String::new(),
                    value: Bytes::new(),
                };
                iop_wire::runtime::MAX_HEADERS + 1
            ],
        },
        metadata: BTreeMap::new(),
    };
    frame(
        "tunnel_start_too_many_headers",
        &on_stream(RuntimeMessage::ProviderTunnelFrame(crowded)),
    );

    let hello = EdgeHelloRequest {
        edge_id: "edge-1".into(),
        version: "0.1.0".into(),
        managed: false,
        metadata: BTreeMap::from([("region".into(), "local".into())]),
        projection_parts: false,
        max_frame_len: 0,
    };
    frame(
        "control_hello",
        &ControlFrame::correlated(1, ControlMessage::EdgeHelloRequest(hello.clone())),
    );
    // A managed Edge that takes a projection in parts and reads frames of 1 MiB.
    frame(
        "control_hello_parts",
        &ControlFrame::correlated(
            1,
            ControlMessage::EdgeHelloRequest(EdgeHelloRequest {
                managed: true,
                projection_parts: true,
                max_frame_len: 1 << 20,
                ..hello
            }),
        ),
    );
    // A Control Plane's hello answer naming the largest frame it reads (an unmanaged Edge's:
    // no projection).
    frame(
        "control_hello_answer_frame_len",
        &ControlFrame::correlated(
            1,
            ControlMessage::EdgeHelloResponse(EdgeHelloResponse::Accepted {
                projection: None,
                heartbeat_interval_ms: Some(10_000),
                accepts_usage: true,
                max_frame_len: 1 << 20,
            }),
        ),
    );
    frame(
        "control_status_request",
        &ControlFrame::correlated(2, ControlMessage::EdgeStatusRequest),
    );
    frame(
        "control_ping",
        &ControlFrame::correlated(3, ControlMessage::Ping),
    );
    // Usage records (Edge → Control Plane) and their acknowledgement.
    frame(
        "control_usage_report",
        &ControlFrame::correlated(
            4,
            ControlMessage::EdgeUsageReport(EdgeUsageReport {
                records: vec![UsageRecord {
                    request_id: "req-0011223344556677-1".into(),
                    at_unix_ms: 1_780_000_000_000,
                    principal_id: "team-a".into(),
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
                }],
            }),
        ),
    );
    frame(
        "control_usage_ack",
        &ControlFrame::correlated(
            4,
            ControlMessage::EdgeUsageAck(EdgeUsageAck {
                stored: 1,
                duplicates: 0,
            }),
        ),
    );
    // A projection during an issuer key rotation (the staged key and its activation time).
    let projection = PrincipalProjection {
        generation: 42,
        principals: vec![ProjectedPrincipal {
            principal_id: "team-a".into(),
            display_name: "Team A".into(),
            enabled: true,
            limits: Some(PrincipalLimits {
                requests_per_minute: 60,
                tokens_per_minute: 100_000,
                concurrent: 4,
                budget_per_day_micro_usd: 5_000_000,
                budget_per_month_micro_usd: 20_000_000,
                models: vec![ModelLimits {
                    model: "gpt-4o-mini".into(),
                    requests_per_minute: 30,
                    tokens_per_minute: 0,
                    concurrent: 0,
                }],
            }),
        }],
        tokens: vec![ProjectedToken {
            token_id: "tok_0011223344556677".into(),
            principal_id: "team-a".into(),
            sha256_digest: [7; 32],
        }],
        routes: vec![ProjectedRoute {
            route_id: "r1".into(),
            principal_id: "team-a".into(),
            model: "gpt-4o-mini".into(),
            slot_id: "openai-prod".into(),
            profile: "openai".into(),
            upstream_target: "gpt-4o-mini".into(),
            selector: String::new(),
            route_revision: 3,
            credential_revision: 5,
        }],
        issuer_key_id: "p256:0011223344556677".into(),
        staged_issuer_key_id: "p256:8899aabbccddeeff".into(),
        staged_issuer_activates_at_unix_ms: 1_780_000_000_000,
        parts_before: 0,
    };
    frame(
        "control_projection_staged_issuer",
        &ControlFrame::correlated(
            4,
            ControlMessage::PrincipalProjectionApplyRequest(projection.clone()),
        ),
    );
    // A projection in parts: the second part, then the apply request completing it.
    frame(
        "control_projection_part",
        &ControlFrame::new(ControlMessage::PrincipalProjectionPart(
            PrincipalProjection {
                issuer_key_id: String::new(),
                staged_issuer_key_id: String::new(),
                staged_issuer_activates_at_unix_ms: 0,
                parts_before: 1,
                ..projection.clone()
            },
        )),
    );
    frame(
        "control_projection_completing",
        &ControlFrame::correlated(
            5,
            ControlMessage::PrincipalProjectionApplyRequest(PrincipalProjection {
                parts_before: 2,
                ..projection
            }),
        ),
    );
    // A status answer naming a refused Node and a warned one.
    let status = EdgeStatusResponse {
        edge_id: "edge-1".into(),
        nodes: vec![
            EdgeNodeSnapshot {
                node_id: "node-1".into(),
                connected: true,
                refused: "issuer key not trusted: the control plane signs leases with p256:8899aabbccddeeff now".into(),
                ..Default::default()
            },
            EdgeNodeSnapshot {
                node_id: "node-2".into(),
                connected: true,
                warning: "does not trust the staged issuer key p256:8899aabbccddeeff".into(),
                ..Default::default()
            },
        ],
        // As an Edge with more Nodes than one answer holds sends it.
        omitted_nodes: 1200,
    };
    frame(
        "control_status_response",
        &ControlFrame::correlated(5, ControlMessage::EdgeStatusResponse(status)),
    );
}

fn rt(message: RuntimeMessage) -> RuntimeFrame {
    RuntimeFrame::new(message)
}

fn on_stream(message: RuntimeMessage) -> RuntimeFrame {
    RuntimeFrame::on_stream(1, message)
}

/// Object-safe encoding of either frame type.
trait Encode {
    fn encode(&self, codec: FrameCodec) -> Vec<u8>;
}

impl<F: WireFrame> Encode for F {
    fn encode(&self, codec: FrameCodec) -> Vec<u8> {
        codec.encode_to_bytes(self).expect("seed encodes").to_vec()
    }
}

// === operation lists ===

/// Writes `ops` in `arbitrary`'s format, checks it parses back to `ops`, and runs it.
fn ops_seed<'a, T>(dir: &Path, name: &str, ops: &[T], bytes_buf: &'a mut Vec<u8>, run: fn(&[T]))
where
    T: ToSeed + Arbitrary<'a> + PartialEq + Debug,
{
    *bytes_buf = seed::ops(ops);
    let parsed = Vec::<T>::arbitrary_take_rest(Unstructured::new(bytes_buf)).expect("parses");
    assert_eq!(parsed, ops, "{name} does not parse back");
    run(ops);
    write(dir, name, bytes_buf);
}

fn tunnel_seeds(dir: &Path) {
    use tunnel_sequencer::Kind::{Body, End, Error, Start, Usage};
    use tunnel_sequencer::Op::{self, Close, Frame, Open};
    let dir = fresh_dir(dir);
    let f = |stream, sequence, kind| Frame {
        stream,
        sequence,
        kind,
    };
    let seeds: Vec<(&str, Vec<Op>)> = vec![
        (
            "happy_stream",
            vec![
                Open(1),
                f(1, 1, Start),
                f(1, 2, Body),
                f(1, 3, Usage),
                f(1, 4, End),
            ],
        ),
        (
            "violations",
            vec![
                Open(1),
                f(1, 1, Body),
                Open(2),
                f(2, 3, Start),
                f(2, 3, Body),
                Open(3),
                f(3, 1, Usage),
                f(3, 2, Start),
                Open(4),
                f(4, 1, End),
            ],
        ),
        (
            "error_then_reopen",
            vec![
                Open(5),
                f(5, 1, Error),
                f(5, 2, End),
                Open(5),
                f(5, 1, Start),
                Close(5),
            ],
        ),
        (
            "stream_limit",
            (0..10).map(Open).chain([Close(0), Open(9)]).collect(),
        ),
        (
            "interleaved",
            vec![
                Open(1),
                Open(2),
                f(1, 1, Start),
                f(2, 1, Start),
                f(2, 2, Body),
                f(1, 2, Body),
                f(1, 9, End),
                f(2, 3, Error),
                f(1, 10, Body),
            ],
        ),
    ];
    for (name, ops) in seeds {
        let mut buf = Vec::new();
        ops_seed(&dir, name, &ops, &mut buf, tunnel_sequencer::run);
    }
}

fn registry_seeds(dir: &Path) {
    use registry_ops::Op::{self, Accept, AdvanceTime, AppFrame, Close, Ready, Register};
    let dir = fresh_dir(dir);
    // Connection indexes count accepts from 0; node 0 is "node-a", 1 "node-b", 2 "node-c".
    let seeds: Vec<(&str, Vec<Op>)> = vec![
        (
            "ready_then_close",
            vec![
                Accept(Some(0)),
                Register { conn: 0, node: 0 },
                Ready { conn: 0, node: 0 },
                AppFrame(0),
                Close(0),
                AppFrame(0),
            ],
        ),
        (
            "supersede",
            vec![
                Accept(Some(0)),
                Register { conn: 0, node: 0 },
                Ready { conn: 0, node: 0 },
                Accept(Some(0)),
                Register { conn: 1, node: 0 },
                Ready { conn: 0, node: 0 },
                Ready { conn: 1, node: 0 },
                AppFrame(1),
            ],
        ),
        (
            "heartbeat_timeout",
            vec![
                Accept(None),
                Register { conn: 0, node: 1 },
                Ready { conn: 0, node: 1 },
                AdvanceTime(15_000),
                AppFrame(0),
                AdvanceTime(20_000),
                AdvanceTime(20_000),
                AdvanceTime(20_000),
                AppFrame(0),
            ],
        ),
        (
            "rejections",
            vec![
                Accept(Some(0)),
                Register { conn: 0, node: 1 },
                Accept(None),
                AppFrame(1),
                Accept(None),
                Register { conn: 2, node: 2 },
                Register { conn: 2, node: 1 },
                Ready { conn: 2, node: 1 },
            ],
        ),
        (
            "two_nodes",
            vec![
                Accept(None),
                Accept(None),
                Register { conn: 0, node: 0 },
                Register { conn: 1, node: 1 },
                Ready { conn: 1, node: 1 },
                Ready { conn: 0, node: 0 },
                Ready { conn: 0, node: 0 },
                AppFrame(0),
                AppFrame(1),
                Ready { conn: 0, node: 2 },
            ],
        ),
    ];
    for (name, ops) in seeds {
        let mut buf = Vec::new();
        ops_seed(&dir, name, &ops, &mut buf, registry_ops::run);
    }
}
