//! Golden tests from the public API references' own examples.
//!
//! - Streams (`tests/golden/*.sse`: the OpenAI chat streaming and function-calling examples,
//!   Anthropic's basic and tool-use streaming examples) are translated into each client dialect
//!   and compared with the committed output in `tests/golden/out/` (`IOP_DIALECT_BLESS=1`
//!   rewrites it, to be read by a person before committing). The input is also split at every
//!   byte boundary and fed one byte at a time: the output must not change.
//! - An oracle independent of the snapshots: the client's output decoded again (chat and
//!   Messages with this crate's decoders, Responses from its `response.completed` object)
//!   says the same text, tool calls, finish reason and usage as the upstream.
//! - Requests and non-streamed bodies: the references' examples, translated, against the
//!   expected JSON written out here.
#![allow(clippy::unwrap_used, reason = "test scaffolding")]

use std::path::PathBuf;

use iop_dialect::decode::{
    ChatStreamDecoder, MessagesStreamDecoder, message_from_chat, message_from_messages,
};
use iop_dialect::encode::{
    ChatStreamEncoder, MessagesStreamEncoder, ResponsesStreamEncoder, chat_completion,
    messages_object, responses_echo, responses_object,
};
use iop_dialect::request::{chat_to_messages, messages_to_chat, responses_to_chat};
use iop_dialect::{
    Dialect, Encoder, Event, FinishReason, Message, Meta, StreamTranslator, ToolCall, Upstream,
    Usage,
};
use serde_json::{Value, json};

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn meta(dialect: Dialect) -> Meta {
    let id = match dialect {
        Dialect::Chat => "chatcmpl-7",
        Dialect::Responses => "resp_7",
        Dialect::Messages => "msg_7",
    };
    Meta {
        id: id.into(),
        model: "mesh-model".into(),
        created: 1_700_000_000,
    }
}

fn encoder(dialect: Dialect) -> Encoder {
    match dialect {
        Dialect::Chat => Encoder::Chat(ChatStreamEncoder::new(meta(dialect), true)),
        Dialect::Responses => Encoder::Responses(ResponsesStreamEncoder::new(
            meta(dialect),
            json!({ "tools": [] }),
        )),
        Dialect::Messages => Encoder::Messages(MessagesStreamEncoder::new(meta(dialect))),
    }
}

/// The client stream's bytes in `text/event-stream` form (`SseEvent::write_to`).
fn translate(upstream: Upstream, to: Dialect, chunks: &[&[u8]]) -> Vec<u8> {
    let mut t = StreamTranslator::new(upstream, encoder(to));
    let mut out = Vec::new();
    for c in chunks {
        t.feed(c, &mut out);
    }
    t.finish(&mut out);
    wire(&out)
}

fn wire(events: &[iop_dialect::sse::SseEvent]) -> Vec<u8> {
    let mut bytes = Vec::new();
    iop_dialect::sse::SseEvent::write_all(events, &mut bytes);
    bytes
}

/// The upstream's own meaning, folded.
fn fold_upstream(upstream: Upstream, bytes: &[u8]) -> Message {
    let mut events = Vec::new();
    match upstream {
        Upstream::Chat => {
            let mut d = ChatStreamDecoder::new();
            d.feed(bytes, &mut events).unwrap();
            d.finish(&mut events).unwrap();
        }
        Upstream::Messages => {
            let mut d = MessagesStreamDecoder::new();
            d.feed(bytes, &mut events).unwrap();
            d.finish(&mut events).unwrap();
        }
    }
    let mut m = Message::default();
    for e in &events {
        m.apply(e);
    }
    m
}

/// The client output's meaning, decoded independently of the encoder.
fn fold_client(dialect: Dialect, bytes: &[u8]) -> Message {
    match dialect {
        Dialect::Chat => fold_upstream(Upstream::Chat, bytes),
        Dialect::Messages => fold_upstream(Upstream::Messages, bytes),
        Dialect::Responses => {
            let text = std::str::from_utf8(bytes).unwrap();
            let mut last = None;
            for (sequence, block) in text.split("\n\n").filter(|b| !b.is_empty()).enumerate() {
                let (event, data) = block.split_once('\n').unwrap();
                let event = event.strip_prefix("event: ").unwrap();
                let data: Value =
                    serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(data["type"], event, "event name matches its type");
                assert_eq!(
                    data["sequence_number"], sequence,
                    "sequence numbers count up"
                );
                last = Some(data);
            }
            let last = last.unwrap();
            let response = &last["response"];
            let mut m = Message::default();
            for item in response["output"].as_array().unwrap() {
                match item["type"].as_str().unwrap() {
                    "message" => {
                        for part in item["content"].as_array().unwrap() {
                            m.text.push_str(part["text"].as_str().unwrap());
                        }
                    }
                    "function_call" => m.tool_calls.push(ToolCall {
                        id: item["call_id"].as_str().unwrap().into(),
                        name: item["name"].as_str().unwrap().into(),
                        arguments: item["arguments"].as_str().unwrap().into(),
                    }),
                    other => panic!("unexpected item {other}"),
                }
            }
            m.finish = Some(match last["type"].as_str().unwrap() {
                "response.completed" if m.tool_calls.is_empty() => FinishReason::Stop,
                "response.completed" => FinishReason::ToolCalls,
                "response.incomplete" => FinishReason::Length,
                other => panic!("unexpected end {other}"),
            });
            m.usage = Usage {
                input_tokens: response["usage"]["input_tokens"].as_u64(),
                output_tokens: response["usage"]["output_tokens"].as_u64(),
            };
            m
        }
    }
}

fn same_meaning(upstream: &Message, client: &Message) {
    assert_eq!(client.text, upstream.text);
    assert_eq!(client.tool_calls, upstream.tool_calls);
    // Dialects name the reasons differently; the category is what must survive.
    assert_eq!(
        client.finish_reason().chat(),
        upstream.finish_reason().chat()
    );
    assert_eq!(client.usage.input(), upstream.usage.input());
    assert_eq!(client.usage.output(), upstream.usage.output());
}

fn check_stream(fixture: &str, upstream: Upstream) {
    let input = std::fs::read(golden(fixture)).unwrap();
    let want = fold_upstream(upstream, &input);
    for to in [Dialect::Chat, Dialect::Responses, Dialect::Messages] {
        let whole = translate(upstream, to, &[&input]);
        let snapshot = golden(&format!("out/{fixture}.{}.sse", to.as_str()));
        if std::env::var_os("IOP_DIALECT_BLESS").is_some() {
            std::fs::create_dir_all(snapshot.parent().unwrap()).unwrap();
            std::fs::write(&snapshot, &whole).unwrap();
        }
        let committed = std::fs::read(&snapshot)
            .unwrap_or_else(|_| panic!("{} missing (IOP_DIALECT_BLESS=1)", snapshot.display()));
        assert!(
            whole == committed,
            "{fixture} → {}: output differs from {}:\n{}",
            to.as_str(),
            snapshot.display(),
            String::from_utf8_lossy(&whole)
        );
        for cut in 0..=input.len() {
            let split = translate(upstream, to, &[&input[..cut], &input[cut..]]);
            assert!(
                split == whole,
                "{fixture} → {}: split at {cut}",
                to.as_str()
            );
        }
        let bytes: Vec<&[u8]> = input.chunks(1).collect();
        assert!(
            translate(upstream, to, &bytes) == whole,
            "one byte at a time"
        );
        same_meaning(&want, &fold_client(to, &whole));
    }
}

#[test]
fn openai_chat_streaming_example() {
    check_stream("chat_stream.sse", Upstream::Chat);
}

#[test]
fn openai_function_calling_stream_example() {
    check_stream("chat_tools_stream.sse", Upstream::Chat);
}

#[test]
fn anthropic_streaming_example() {
    check_stream("messages_stream.sse", Upstream::Messages);
}

#[test]
fn anthropic_tool_use_streaming_example() {
    check_stream("messages_tools_stream.sse", Upstream::Messages);
}

#[test]
fn the_stream_examples_say_what_the_references_say() {
    let m = fold_upstream(
        Upstream::Messages,
        &std::fs::read(golden("messages_tools_stream.sse")).unwrap(),
    );
    assert_eq!(
        m.text,
        "Okay, let's check the weather for San Francisco, CA:"
    );
    assert_eq!(
        m.tool_calls,
        vec![ToolCall {
            id: "toolu_01T1x1fJ34qAmk2tNTrN7Up6".into(),
            name: "get_weather".into(),
            arguments: r#"{"location": "San Francisco, CA", "unit": "fahrenheit"}"#.into(),
        }]
    );
    assert_eq!(m.finish, Some(FinishReason::ToolCalls));
    assert_eq!((m.usage.input(), m.usage.output()), (472, 89));
    let m = fold_upstream(
        Upstream::Chat,
        &std::fs::read(golden("chat_stream.sse")).unwrap(),
    );
    assert_eq!(m.text, "Hello! How can I assist you today?");
    assert_eq!((m.usage.input(), m.usage.output()), (9, 12));
}

#[test]
fn a_mid_stream_upstream_error_becomes_each_dialects_error_event() {
    let input = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: {\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\"}}\n\n";
    let chat = String::from_utf8(translate(Upstream::Chat, Dialect::Chat, &[input])).unwrap();
    assert!(chat.ends_with("data: {\"error\":{\"code\":null,\"message\":\"overloaded\",\"param\":null,\"type\":\"server_error\"}}\n\n"), "{chat}");
    assert!(!chat.contains("[DONE]"));
    let messages =
        String::from_utf8(translate(Upstream::Chat, Dialect::Messages, &[input])).unwrap();
    assert!(messages.ends_with("event: error\ndata: {\"error\":{\"message\":\"overloaded\",\"type\":\"api_error\"},\"type\":\"error\"}\n\n"), "{messages}");
    assert!(!messages.contains("message_stop"));
    let responses =
        String::from_utf8(translate(Upstream::Chat, Dialect::Responses, &[input])).unwrap();
    assert!(
        responses.contains("event: response.failed\n"),
        "{responses}"
    );
    assert!(!responses.contains("response.completed"));
    // Not the dialect at all: a typed failure, rendered as the error event.
    let bad = translate(Upstream::Messages, Dialect::Chat, &[b"data: [1,2]\n\n"]);
    assert!(
        String::from_utf8(bad)
            .unwrap()
            .contains("not valid Anthropic stream event JSON")
    );
}

#[test]
fn interleaved_tool_arguments_are_refused_by_messages_and_rendered_by_responses() {
    let events = [
        Event::ToolCallStart {
            index: 0,
            id: "a".into(),
            name: "f".into(),
        },
        Event::ToolCallStart {
            index: 1,
            id: "b".into(),
            name: "g".into(),
        },
        Event::ToolCallArguments {
            index: 0,
            delta: "{}".into(),
        },
    ];
    let mut e = MessagesStreamEncoder::new(meta(Dialect::Messages));
    let mut out = Vec::new();
    for ev in &events {
        e.event(ev, &mut out);
    }
    assert!(e.is_done());
    let out = String::from_utf8(wire(&out)).unwrap();
    assert!(
        out.ends_with("cannot represent\",\"type\":\"api_error\"},\"type\":\"error\"}\n\n"),
        "{out}"
    );
    let mut e = ResponsesStreamEncoder::new(meta(Dialect::Responses), json!({}));
    let mut out = Vec::new();
    for ev in &events {
        e.event(ev, &mut out);
    }
    e.finish(&mut out);
    let m = fold_client(Dialect::Responses, &wire(&out));
    assert_eq!(m.tool_calls[0].arguments, "{}");
    assert_eq!(m.tool_calls[1].arguments, "");
}

// === Requests ===

#[test]
fn anthropic_tool_use_request_example_to_chat() {
    // The Messages API reference's tool use example, continued with the tool result.
    let request = json!({
        "model": "claude-opus-4-1-20250805",
        "max_tokens": 1024,
        "system": [{ "type": "text", "text": "You are a weather bot." }],
        "tools": [{
            "name": "get_weather",
            "description": "Get the current weather in a given location",
            "input_schema": {
                "type": "object",
                "properties": { "location": { "type": "string", "description": "The city and state, e.g. San Francisco, CA" } },
                "required": ["location"]
            }
        }],
        "tool_choice": { "type": "any", "disable_parallel_tool_use": true },
        "stop_sequences": ["\n\nHuman:"],
        "metadata": { "user_id": "u-1" },
        "stream": true,
        "messages": [
            { "role": "user", "content": "What's the weather like in San Francisco?" },
            { "role": "assistant", "content": [
                { "type": "text", "text": "I'll check." },
                { "type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "get_weather", "input": { "location": "San Francisco, CA", "unit": "celsius" } }
            ]},
            { "role": "user", "content": [
                { "type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9", "content": "15 degrees" },
                { "type": "text", "text": "And tomorrow?" },
                { "type": "image", "source": { "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo=" } }
            ]}
        ]
    });
    let chat = messages_to_chat(&request).unwrap();
    assert_eq!(
        chat,
        json!({
            "model": "claude-opus-4-1-20250805",
            "max_tokens": 1024,
            "stop": ["\n\nHuman:"],
            "user": "u-1",
            "stream": true,
            "stream_options": { "include_usage": true },
            "tool_choice": "required",
            "parallel_tool_calls": false,
            "tools": [{ "type": "function", "function": {
                "name": "get_weather",
                "description": "Get the current weather in a given location",
                "parameters": {
                    "type": "object",
                    "properties": { "location": { "type": "string", "description": "The city and state, e.g. San Francisco, CA" } },
                    "required": ["location"]
                }
            }}],
            "messages": [
                { "role": "system", "content": "You are a weather bot." },
                { "role": "user", "content": "What's the weather like in San Francisco?" },
                { "role": "assistant", "content": "I'll check.", "tool_calls": [{
                    "id": "toolu_01A09q90qw90lq917835lq9", "type": "function",
                    "function": { "name": "get_weather", "arguments": "{\"location\":\"San Francisco, CA\",\"unit\":\"celsius\"}" }
                }]},
                { "role": "tool", "tool_call_id": "toolu_01A09q90qw90lq917835lq9", "content": "15 degrees" },
                { "role": "user", "content": [
                    { "type": "text", "text": "And tomorrow?" },
                    { "type": "image_url", "image_url": { "url": "data:image/png;base64,iVBORw0KGgo=" } }
                ]}
            ]
        })
    );
    // And back: the chat request as Anthropic again keeps the conversation.
    let back = chat_to_messages(&chat).unwrap();
    assert_eq!(back["system"], "You are a weather bot.");
    assert_eq!(
        back["tool_choice"],
        json!({ "type": "any", "disable_parallel_tool_use": true })
    );
    assert_eq!(back["stop_sequences"], json!(["\n\nHuman:"]));
    assert_eq!(back["metadata"], json!({ "user_id": "u-1" }));
    assert_eq!(
        back["tools"][0]["input_schema"],
        request["tools"][0]["input_schema"]
    );
    let turns = back["messages"].as_array().unwrap();
    assert_eq!(
        turns.len(),
        3,
        "tool result and user text merge into one user turn"
    );
    assert_eq!(
        turns[1]["content"][1]["input"],
        json!({ "location": "San Francisco, CA", "unit": "celsius" })
    );
    assert_eq!(
        turns[2]["content"][0],
        json!({ "type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9", "content": "15 degrees" })
    );
    assert_eq!(
        turns[2]["content"][2]["source"],
        json!({ "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo=" })
    );
}

#[test]
fn responses_function_calling_example_to_chat() {
    // The Responses function-calling guide's example, after the call was made.
    let request = json!({
        "model": "gpt-4.1",
        "instructions": "Answer briefly.",
        "input": [
            { "role": "user", "content": "What is the weather like in Paris today?" },
            { "type": "function_call", "id": "fc_12345xyz", "call_id": "call_12345xyz", "name": "get_weather", "arguments": "{\"location\":\"Paris, France\"}" },
            { "type": "function_call_output", "call_id": "call_12345xyz", "output": "14" },
            { "type": "message", "role": "developer", "content": [{ "type": "input_text", "text": "Use Celsius." }] }
        ],
        "tools": [{
            "type": "function",
            "name": "get_weather",
            "description": "Get current temperature for a given location.",
            "parameters": { "type": "object", "properties": { "location": { "type": "string" } }, "required": ["location"], "additionalProperties": false },
            "strict": true
        }],
        "tool_choice": { "type": "function", "name": "get_weather" },
        "max_output_tokens": 200,
        "store": true,
        "text": { "format": { "type": "json_schema", "name": "w", "schema": { "type": "object" }, "strict": true } }
    });
    assert_eq!(
        responses_to_chat(&request).unwrap(),
        json!({
            "model": "gpt-4.1",
            "max_tokens": 200,
            "response_format": { "type": "json_schema", "json_schema": { "name": "w", "schema": { "type": "object" }, "strict": true } },
            "tool_choice": { "type": "function", "function": { "name": "get_weather" } },
            "tools": [{ "type": "function", "function": {
                "name": "get_weather",
                "description": "Get current temperature for a given location.",
                "parameters": { "type": "object", "properties": { "location": { "type": "string" } }, "required": ["location"], "additionalProperties": false },
                "strict": true
            }}],
            "messages": [
                { "role": "system", "content": "Answer briefly." },
                { "role": "user", "content": "What is the weather like in Paris today?" },
                { "role": "assistant", "content": null, "tool_calls": [{
                    "id": "call_12345xyz", "type": "function",
                    "function": { "name": "get_weather", "arguments": "{\"location\":\"Paris, France\"}" }
                }]},
                { "role": "tool", "tool_call_id": "call_12345xyz", "content": "14" },
                { "role": "system", "content": "Use Celsius." }
            ]
        })
    );
}

#[test]
fn what_cannot_be_represented_is_refused_naming_the_field() {
    let e =
        responses_to_chat(&json!({ "model": "m", "input": "x", "previous_response_id": "resp_1" }))
            .unwrap_err()
            .to_string();
    assert!(e.starts_with("`previous_response_id`:"), "{e}");
    let e = responses_to_chat(
        &json!({ "model": "m", "input": "x", "tools": [{ "type": "web_search" }] }),
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        e,
        "`tools[0].type`: the `web_search` tool is not supported by this model's provider"
    );
    let e = messages_to_chat(&json!({ "model": "m", "max_tokens": 5, "messages": [{ "role": "user", "content": [{ "type": "document", "source": {} }] }] }))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("`messages[0].content[0].type`:"), "{e}");
    let e = chat_to_messages(&json!({ "model": "m", "n": 2, "messages": [] })).unwrap_err();
    assert!(e.to_string().starts_with("`n`:"));
    let e = chat_to_messages(&json!({ "model": "m", "messages": [{ "role": "assistant", "tool_calls": [{ "id": "c", "function": { "name": "f", "arguments": "[1]" } }] }] }))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("`messages[0].tool_calls[0].function.arguments`:"),
        "{e}"
    );
    // Caller-controlled text in an error is bounded.
    let long = "x".repeat(10_000);
    let e = responses_to_chat(&json!({ "input": [{ "type": long }] }))
        .unwrap_err()
        .to_string();
    assert!(e.len() < 200, "{}", e.len());
}

#[test]
fn openai_chat_request_example_to_anthropic() {
    let request = json!({
        "model": "gpt-4.1",
        "messages": [
            { "role": "developer", "content": "You are a helpful assistant." },
            { "role": "user", "content": [
                { "type": "text", "text": "What is in this image, and the weather in Boston?" },
                { "type": "image_url", "image_url": { "url": "https://upload.wikimedia.org/boardwalk.jpg" } }
            ]}
        ],
        "tools": [{ "type": "function", "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": { "type": "object", "properties": { "location": { "type": "string" } }, "required": ["location"] }
        }}],
        "tool_choice": "auto",
        "parallel_tool_calls": false,
        "stop": "END",
        "temperature": 0.5,
        "stream": true,
        "stream_options": { "include_usage": true }
    });
    assert_eq!(
        chat_to_messages(&request).unwrap(),
        json!({
            "model": "gpt-4.1",
            "max_tokens": 4096,
            "system": "You are a helpful assistant.",
            "messages": [{ "role": "user", "content": [
                { "type": "text", "text": "What is in this image, and the weather in Boston?" },
                { "type": "image", "source": { "type": "url", "url": "https://upload.wikimedia.org/boardwalk.jpg" } }
            ]}],
            "tools": [{
                "name": "get_current_weather",
                "description": "Get the current weather in a given location",
                "input_schema": { "type": "object", "properties": { "location": { "type": "string" } }, "required": ["location"] }
            }],
            "tool_choice": { "type": "auto", "disable_parallel_tool_use": true },
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "stream": true
        })
    );
}

// === Non-streamed bodies ===

#[test]
fn openai_function_calling_response_example_in_each_dialect() {
    let body = json!({
        "id": "chatcmpl-abc123", "object": "chat.completion", "created": 1699896916, "model": "gpt-4o-mini",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": null, "tool_calls": [{
            "id": "call_abc123", "type": "function",
            "function": { "name": "get_current_weather", "arguments": "{\n\"location\": \"Boston, MA\"\n}" }
        }]}, "logprobs": null, "finish_reason": "tool_calls" }],
        "usage": { "prompt_tokens": 82, "completion_tokens": 17, "total_tokens": 99 }
    });
    let m = message_from_chat(&body).unwrap();
    let anthropic = messages_object(&m, &meta(Dialect::Messages));
    assert_eq!(
        anthropic,
        json!({
            "id": "msg_7", "type": "message", "role": "assistant", "model": "mesh-model",
            "content": [{ "type": "tool_use", "id": "call_abc123", "name": "get_current_weather", "input": { "location": "Boston, MA" } }],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": { "input_tokens": 82, "output_tokens": 17 }
        })
    );
    let responses = responses_object(&m, &meta(Dialect::Responses), &json!({}));
    assert_eq!(responses["status"], "completed");
    assert_eq!(
        responses["output"],
        json!([{ "id": "fc_7_0", "type": "function_call", "status": "completed",
                 "arguments": "{\n\"location\": \"Boston, MA\"\n}", "call_id": "call_abc123", "name": "get_current_weather" }])
    );
    assert_eq!(responses["usage"]["total_tokens"], 99);
    // And back to chat: the same completion, with our id and model.
    let chat = chat_completion(&m, &meta(Dialect::Chat));
    assert_eq!(
        chat["choices"],
        body["choices"]
            .as_array()
            .map(|c| {
                let mut c = c[0].clone();
                c["message"]["refusal"] = Value::Null;
                json!([c])
            })
            .unwrap()
    );
    assert_eq!(chat["usage"], body["usage"]);
}

#[test]
fn anthropic_message_response_example_in_each_dialect() {
    let body = json!({
        "content": [
            { "type": "text", "text": "I'll check the current weather in San Francisco for you." },
            { "type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "get_weather", "input": { "location": "San Francisco, CA", "unit": "celsius" } }
        ],
        "id": "msg_01Aq9w938a90dw8q", "model": "claude-sonnet-4-5", "role": "assistant",
        "stop_reason": "tool_use", "stop_sequence": null, "type": "message",
        "usage": { "input_tokens": 2095, "output_tokens": 503 }
    });
    let m = message_from_messages(&body).unwrap();
    let chat = chat_completion(&m, &meta(Dialect::Chat));
    assert_eq!(chat["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(
        chat["choices"][0]["message"]["content"],
        "I'll check the current weather in San Francisco for you."
    );
    assert_eq!(
        chat["choices"][0]["message"]["tool_calls"],
        json!([{ "id": "toolu_01A09q90qw90lq917835lq9", "type": "function",
                 "function": { "name": "get_weather", "arguments": "{\"location\":\"San Francisco, CA\",\"unit\":\"celsius\"}" } }])
    );
    assert_eq!(
        chat["usage"],
        json!({ "prompt_tokens": 2095, "completion_tokens": 503, "total_tokens": 2598 })
    );
    let r = responses_object(
        &m,
        &meta(Dialect::Responses),
        &responses_echo(
            &json!({ "tools": [{ "type": "function", "name": "get_weather" }], "instructions": "x" }),
        ),
    );
    assert_eq!(
        r["output"][0]["content"][0]["text"],
        "I'll check the current weather in San Francisco for you."
    );
    assert_eq!(r["output"][1]["type"], "function_call");
    assert_eq!(r["instructions"], "x");
    assert_eq!(r["tools"][0]["name"], "get_weather");
    assert_eq!(r["store"], false);
    // Max tokens: incomplete, with the reason.
    let cut = Message {
        finish: Some(FinishReason::Length),
        text: "partial".into(),
        ..Message::default()
    };
    let r = responses_object(&cut, &meta(Dialect::Responses), &json!({}));
    assert_eq!(r["status"], "incomplete");
    assert_eq!(
        r["incomplete_details"],
        json!({ "reason": "max_output_tokens" })
    );
    assert_eq!(
        messages_object(&cut, &meta(Dialect::Messages))["stop_reason"],
        "max_tokens"
    );
}

#[test]
fn the_first_error_in_the_stream_is_the_one_reported_however_it_is_split() {
    // Found by the stream_translate fuzz target: an event that is not JSON, then a line that is
    // not UTF-8. Whether both arrive in one read or two, the client hears about the first.
    let input = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {not json\n\ndata: \xed\xed\n\n";
    let whole = translate(Upstream::Chat, Dialect::Chat, &[input]);
    assert!(String::from_utf8_lossy(&whole).contains("not valid chat chunk JSON"));
    for cut in 0..=input.len() {
        let split = translate(
            Upstream::Chat,
            Dialect::Chat,
            &[&input[..cut], &input[cut..]],
        );
        assert!(split == whole, "split at {cut}");
    }
}
