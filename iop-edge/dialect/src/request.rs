//! Request translation, through OpenAI Chat Completions form.
//!
//! Every function takes the client's parsed JSON body and returns a new body; `model` is copied
//! as it is (the Edge puts the served target in afterwards). Fields with a counterpart are
//! mapped; fields that change nothing on the other side are dropped (listed per function);
//! anything else that cannot be represented is a [`TranslateError`] naming the field.

use serde_json::{Map, Value, json};

use crate::TranslateError;

/// `max_tokens` sent to an Anthropic upstream when a chat request gives none (Anthropic
/// requires it).
pub const DEFAULT_MAX_TOKENS: u64 = 4096;

type Result<T> = std::result::Result<T, TranslateError>;

fn object<'a>(v: &'a Value, field: &str) -> Result<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| TranslateError::invalid(field, "must be a JSON object"))
}

fn opt_str<'a>(v: &'a Value, key: &str, field: &str) -> Result<Option<&'a str>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(TranslateError::invalid(field, "must be a string")),
    }
}

fn copy(from: &Value, to: &mut Map<String, Value>, keys: &[(&str, &str)]) {
    for (src, dst) in keys {
        if let Some(v) = from.get(*src).filter(|v| !v.is_null()) {
            to.insert((*dst).to_owned(), v.clone());
        }
    }
}

fn stream_flags(from: &Value, to: &mut Map<String, Value>, include_usage: bool) {
    if from.get("stream").and_then(Value::as_bool) == Some(true) {
        to.insert("stream".into(), Value::Bool(true));
        if include_usage {
            to.insert("stream_options".into(), json!({ "include_usage": true }));
        }
    }
}

// === Responses → chat ===

/// A Responses API request as a chat completions request.
///
/// - `instructions` → a leading `system` message; `input` text → one `user` message; `input`
///   items: messages (`developer` becomes `system`; `input_text`/`output_text` parts become
///   text, `input_image` becomes `image_url`), `function_call` items → the assistant message's
///   `tool_calls` (consecutive calls are one message), `function_call_output` → `tool`
///   messages; `reasoning` items are dropped.
/// - `tools` (function tools only), `tool_choice`, `parallel_tool_calls`, `max_output_tokens`
///   (→ `max_tokens`), `temperature`, `top_p`, `user`, `text.format` (→ `response_format`),
///   `reasoning.effort` (→ `reasoning_effort`), `stream` (asking for usage in the stream).
/// - Dropped: `store`, `metadata`, `include`, `truncation`, `service_tier`, `background`.
/// - Refused: `previous_response_id` and `item_reference` items (the Edge stores nothing),
///   hosted tools (`web_search`, `file_search`, …), file and audio inputs.
pub fn responses_to_chat(req: &Value) -> Result<Value> {
    object(req, "(body)")?;
    if req
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(TranslateError::unsupported(
            "previous_response_id",
            "previous_response_id (this gateway stores no responses; send the whole input)",
        ));
    }
    let mut messages: Vec<Value> = Vec::new();
    if let Some(text) = opt_str(req, "instructions", "instructions")? {
        messages.push(json!({ "role": "system", "content": text }));
    }
    match req.get("input") {
        Some(Value::String(text)) => messages.push(json!({ "role": "user", "content": text })),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                response_item(item, i, &mut messages)?;
            }
        }
        _ => {
            return Err(TranslateError::invalid(
                "input",
                "must be text or an array of input items",
            ));
        }
    }
    let mut out = Map::new();
    copy(req, &mut out, &[("model", "model")]);
    out.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = req.get("tools").filter(|t| !t.is_null()) {
        let tools = tools
            .as_array()
            .ok_or_else(|| TranslateError::invalid("tools", "must be an array"))?;
        let mut mapped = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let field = format!("tools[{i}]");
            let kind = opt_str(t, "type", &format!("{field}.type"))?.unwrap_or("function");
            if kind != "function" {
                return Err(TranslateError::unsupported(
                    format!("{field}.type"),
                    &format!("the `{}` tool", crate::bounded(kind)),
                ));
            }
            let name = opt_str(t, "name", &format!("{field}.name"))?
                .ok_or_else(|| TranslateError::invalid(format!("{field}.name"), "is required"))?;
            let mut function = Map::new();
            function.insert("name".into(), Value::String(name.to_owned()));
            copy(
                t,
                &mut function,
                &[
                    ("description", "description"),
                    ("parameters", "parameters"),
                    ("strict", "strict"),
                ],
            );
            mapped.push(json!({ "type": "function", "function": function }));
        }
        if !mapped.is_empty() {
            out.insert("tools".into(), Value::Array(mapped));
        }
    }
    match req.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if matches!(s.as_str(), "auto" | "none" | "required") => {
            out.insert("tool_choice".into(), Value::String(s.clone()));
        }
        Some(c @ Value::Object(_)) if c["type"] == "function" => {
            let name = opt_str(c, "name", "tool_choice.name")?
                .ok_or_else(|| TranslateError::invalid("tool_choice.name", "is required"))?;
            out.insert(
                "tool_choice".into(),
                json!({ "type": "function", "function": { "name": name } }),
            );
        }
        Some(_) => {
            return Err(TranslateError::unsupported(
                "tool_choice",
                "a tool_choice other than auto, none, required or a function",
            ));
        }
    }
    copy(
        req,
        &mut out,
        &[
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("parallel_tool_calls", "parallel_tool_calls"),
            ("user", "user"),
        ],
    );
    if let Some(effort) = req.pointer("/reasoning/effort").filter(|v| !v.is_null()) {
        out.insert("reasoning_effort".into(), effort.clone());
    }
    if let Some(format) = req.pointer("/text/format").filter(|v| !v.is_null()) {
        match format["type"].as_str() {
            Some("text") => {}
            Some("json_object") => {
                out.insert("response_format".into(), json!({ "type": "json_object" }));
            }
            Some("json_schema") => {
                let mut schema = Map::new();
                copy(
                    format,
                    &mut schema,
                    &[
                        ("name", "name"),
                        ("schema", "schema"),
                        ("strict", "strict"),
                        ("description", "description"),
                    ],
                );
                out.insert(
                    "response_format".into(),
                    json!({ "type": "json_schema", "json_schema": schema }),
                );
            }
            _ => {
                return Err(TranslateError::invalid(
                    "text.format.type",
                    "must be text, json_object or json_schema",
                ));
            }
        }
    }
    stream_flags(req, &mut out, true);
    Ok(Value::Object(out))
}

fn response_item(item: &Value, i: usize, messages: &mut Vec<Value>) -> Result<()> {
    let field = format!("input[{i}]");
    object(item, &field)?;
    let kind = match opt_str(item, "type", &format!("{field}.type"))? {
        Some(k) => k,
        None if item.get("role").is_some() => "message",
        None => {
            return Err(TranslateError::invalid(
                format!("{field}.type"),
                "is required",
            ));
        }
    };
    match kind {
        "message" => {
            let role = match opt_str(item, "role", &format!("{field}.role"))? {
                Some("developer" | "system") => "system",
                Some("user") => "user",
                Some("assistant") => "assistant",
                _ => {
                    return Err(TranslateError::invalid(
                        format!("{field}.role"),
                        "must be user, assistant, system or developer",
                    ));
                }
            };
            let content = response_content(&item["content"], role, &format!("{field}.content"))?;
            messages.push(json!({ "role": role, "content": content }));
        }
        "function_call" => {
            let call_id =
                opt_str(item, "call_id", &format!("{field}.call_id"))?.ok_or_else(|| {
                    TranslateError::invalid(format!("{field}.call_id"), "is required")
                })?;
            let name = opt_str(item, "name", &format!("{field}.name"))?
                .ok_or_else(|| TranslateError::invalid(format!("{field}.name"), "is required"))?;
            let arguments =
                opt_str(item, "arguments", &format!("{field}.arguments"))?.unwrap_or("");
            let call = json!({
                "id": call_id,
                "type": "function",
                "function": { "name": name, "arguments": arguments },
            });
            push_tool_call(messages, call);
        }
        "function_call_output" => {
            let call_id =
                opt_str(item, "call_id", &format!("{field}.call_id"))?.ok_or_else(|| {
                    TranslateError::invalid(format!("{field}.call_id"), "is required")
                })?;
            let output = match &item["output"] {
                Value::String(s) => s.clone(),
                Value::Array(parts) => text_of_parts(parts, &format!("{field}.output"))?,
                _ => {
                    return Err(TranslateError::invalid(
                        format!("{field}.output"),
                        "must be text or text parts",
                    ));
                }
            };
            messages.push(json!({ "role": "tool", "tool_call_id": call_id, "content": output }));
        }
        "reasoning" => {}
        other => {
            return Err(TranslateError::unsupported(
                format!("{field}.type"),
                &format!("the `{}` input item", crate::bounded(other)),
            ));
        }
    }
    Ok(())
}

/// Appends a tool call to the trailing assistant message, or starts one.
fn push_tool_call(messages: &mut Vec<Value>, call: Value) {
    if let Some(last) = messages.last_mut()
        && last["role"] == "assistant"
    {
        match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
            Some(calls) => calls.push(call),
            None => last["tool_calls"] = Value::Array(vec![call]),
        }
        return;
    }
    messages.push(json!({ "role": "assistant", "content": null, "tool_calls": [call] }));
}

fn text_of_parts(parts: &[Value], field: &str) -> Result<String> {
    let mut text = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        match p["type"].as_str() {
            Some("input_text" | "output_text" | "text") => {
                text.push(p["text"].as_str().ok_or_else(|| {
                    TranslateError::invalid(format!("{field}[{j}].text"), "must be a string")
                })?);
            }
            _ => {
                return Err(TranslateError::unsupported(
                    format!("{field}[{j}].type"),
                    "a non-text part here",
                ));
            }
        }
    }
    Ok(text.join("\n"))
}

/// Responses message content as chat content: a string when it is all text (joined with LF),
/// parts when a user message carries images.
fn response_content(content: &Value, role: &str, field: &str) -> Result<Value> {
    let parts = match content {
        Value::String(s) => return Ok(Value::String(s.clone())),
        Value::Array(parts) => parts,
        _ => {
            return Err(TranslateError::invalid(
                field,
                "must be text or content parts",
            ));
        }
    };
    let mut out = Vec::with_capacity(parts.len());
    let mut all_text = true;
    for (j, p) in parts.iter().enumerate() {
        let pf = format!("{field}[{j}]");
        match p["type"].as_str() {
            Some("input_text" | "output_text" | "text") => {
                let text = opt_str(p, "text", &format!("{pf}.text"))?.unwrap_or("");
                out.push(json!({ "type": "text", "text": text }));
            }
            Some("refusal") => {
                let text = opt_str(p, "refusal", &format!("{pf}.refusal"))?.unwrap_or("");
                out.push(json!({ "type": "text", "text": text }));
            }
            Some("input_image") if role == "user" => {
                let Some(url) = opt_str(p, "image_url", &format!("{pf}.image_url"))? else {
                    return Err(TranslateError::unsupported(
                        format!("{pf}.file_id"),
                        "an image by file id",
                    ));
                };
                let mut image = Map::new();
                image.insert("url".into(), Value::String(url.to_owned()));
                copy(p, &mut image, &[("detail", "detail")]);
                out.push(json!({ "type": "image_url", "image_url": image }));
                all_text = false;
            }
            Some(other) => {
                return Err(TranslateError::unsupported(
                    format!("{pf}.type"),
                    &format!("the `{}` content part", crate::bounded(other)),
                ));
            }
            None => return Err(TranslateError::invalid(format!("{pf}.type"), "is required")),
        }
    }
    if all_text {
        let texts: Vec<&str> = out.iter().filter_map(|p| p["text"].as_str()).collect();
        return Ok(Value::String(texts.join("\n")));
    }
    Ok(Value::Array(out))
}

// === Anthropic Messages → chat ===

/// An Anthropic Messages request as a chat completions request.
///
/// - `system` (text or text blocks) → a leading `system` message; `text` blocks → text;
///   `image` blocks (base64 → a `data:` URL, or a URL) → `image_url`; `tool_use` blocks → the
///   assistant message's `tool_calls` (the input serialized as the arguments); `tool_result`
///   blocks → `tool` messages placed before the rest of their user message.
/// - `tools` (client tools: `name`, `description`, `input_schema`), `tool_choice` (`auto`,
///   `any` → `required`, `tool` → a function, `none`; `disable_parallel_tool_use` →
///   `parallel_tool_calls: false`), `max_tokens`, `stop_sequences` (→ `stop`), `temperature`,
///   `top_p`, `metadata.user_id` (→ `user`), `stream` (asking for usage in the stream).
/// - Dropped: `thinking` blocks sent back, `thinking`, `top_k`, `service_tier`,
///   `cache_control` marks, a tool result's `is_error` flag.
/// - Refused: server tools (`web_search_…`, `bash_…`, …), `document` and other non-text,
///   non-image blocks, images inside tool results.
pub fn messages_to_chat(req: &Value) -> Result<Value> {
    object(req, "(body)")?;
    let mut messages: Vec<Value> = Vec::new();
    match req.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({ "role": "system", "content": s })),
        Some(Value::Array(blocks)) => {
            let text = text_blocks(blocks, "system")?;
            messages.push(json!({ "role": "system", "content": text }));
        }
        Some(_) => {
            return Err(TranslateError::invalid(
                "system",
                "must be text or text blocks",
            ));
        }
    }
    let list = req
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| TranslateError::invalid("messages", "must be an array"))?;
    for (i, m) in list.iter().enumerate() {
        anthropic_message(m, i, &mut messages)?;
    }
    let mut out = Map::new();
    copy(req, &mut out, &[("model", "model")]);
    out.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = req.get("tools").filter(|t| !t.is_null()) {
        let tools = tools
            .as_array()
            .ok_or_else(|| TranslateError::invalid("tools", "must be an array"))?;
        let mut mapped = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let field = format!("tools[{i}]");
            if let Some(kind) = opt_str(t, "type", &format!("{field}.type"))?
                && kind != "custom"
            {
                return Err(TranslateError::unsupported(
                    format!("{field}.type"),
                    &format!("the server tool `{}`", crate::bounded(kind)),
                ));
            }
            let name = opt_str(t, "name", &format!("{field}.name"))?
                .ok_or_else(|| TranslateError::invalid(format!("{field}.name"), "is required"))?;
            let mut function = Map::new();
            function.insert("name".into(), Value::String(name.to_owned()));
            copy(
                t,
                &mut function,
                &[
                    ("description", "description"),
                    ("input_schema", "parameters"),
                ],
            );
            mapped.push(json!({ "type": "function", "function": function }));
        }
        if !mapped.is_empty() {
            out.insert("tools".into(), Value::Array(mapped));
        }
    }
    if let Some(choice) = req.get("tool_choice").filter(|c| !c.is_null()) {
        let mapped = match choice["type"].as_str() {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                let name = opt_str(choice, "name", "tool_choice.name")?
                    .ok_or_else(|| TranslateError::invalid("tool_choice.name", "is required"))?;
                json!({ "type": "function", "function": { "name": name } })
            }
            _ => {
                return Err(TranslateError::invalid(
                    "tool_choice.type",
                    "must be auto, any, tool or none",
                ));
            }
        };
        out.insert("tool_choice".into(), mapped);
        if choice["disable_parallel_tool_use"] == true {
            out.insert("parallel_tool_calls".into(), Value::Bool(false));
        }
    }
    copy(
        req,
        &mut out,
        &[
            ("max_tokens", "max_tokens"),
            ("stop_sequences", "stop"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
        ],
    );
    if let Some(user) = req.pointer("/metadata/user_id").filter(|v| v.is_string()) {
        out.insert("user".into(), user.clone());
    }
    stream_flags(req, &mut out, true);
    Ok(Value::Object(out))
}

fn text_blocks(blocks: &[Value], field: &str) -> Result<String> {
    let mut text = Vec::with_capacity(blocks.len());
    for (j, b) in blocks.iter().enumerate() {
        if b["type"] != "text" {
            return Err(TranslateError::unsupported(
                format!("{field}[{j}].type"),
                "a non-text block here",
            ));
        }
        text.push(b["text"].as_str().ok_or_else(|| {
            TranslateError::invalid(format!("{field}[{j}].text"), "must be a string")
        })?);
    }
    Ok(text.join("\n"))
}

fn anthropic_message(m: &Value, i: usize, messages: &mut Vec<Value>) -> Result<()> {
    let field = format!("messages[{i}]");
    object(m, &field)?;
    let Some(role @ ("user" | "assistant")) = m["role"].as_str() else {
        return Err(TranslateError::invalid(
            format!("{field}.role"),
            "must be user or assistant",
        ));
    };
    let blocks = match &m["content"] {
        Value::String(s) => {
            messages.push(json!({ "role": role, "content": s }));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        _ => {
            return Err(TranslateError::invalid(
                format!("{field}.content"),
                "must be text or content blocks",
            ));
        }
    };
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    let mut has_image = false;
    for (j, b) in blocks.iter().enumerate() {
        let bf = format!("{field}.content[{j}]");
        match (role, b["type"].as_str()) {
            (_, Some("text")) => {
                let text = opt_str(b, "text", &format!("{bf}.text"))?.unwrap_or("");
                parts.push(json!({ "type": "text", "text": text }));
            }
            ("user", Some("image")) => {
                parts.push(image_block_to_part(b, &bf)?);
                has_image = true;
            }
            ("user", Some("tool_result")) => {
                let id =
                    opt_str(b, "tool_use_id", &format!("{bf}.tool_use_id"))?.ok_or_else(|| {
                        TranslateError::invalid(format!("{bf}.tool_use_id"), "is required")
                    })?;
                let content = match &b["content"] {
                    Value::Null => String::new(),
                    Value::String(s) => s.clone(),
                    Value::Array(inner) => text_blocks(inner, &format!("{bf}.content"))?,
                    _ => {
                        return Err(TranslateError::invalid(
                            format!("{bf}.content"),
                            "must be text or text blocks",
                        ));
                    }
                };
                messages.push(json!({ "role": "tool", "tool_call_id": id, "content": content }));
            }
            ("assistant", Some("tool_use")) => {
                let id = opt_str(b, "id", &format!("{bf}.id"))?
                    .ok_or_else(|| TranslateError::invalid(format!("{bf}.id"), "is required"))?;
                let name = opt_str(b, "name", &format!("{bf}.name"))?
                    .ok_or_else(|| TranslateError::invalid(format!("{bf}.name"), "is required"))?;
                let input = match b.get("input") {
                    None | Some(Value::Null) => "{}".to_owned(),
                    Some(v) => v.to_string(),
                };
                calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": { "name": name, "arguments": input },
                }));
            }
            ("assistant", Some("thinking" | "redacted_thinking")) => {}
            (_, Some(other)) => {
                return Err(TranslateError::unsupported(
                    format!("{bf}.type"),
                    &format!("the `{}` block", crate::bounded(other)),
                ));
            }
            (_, None) => return Err(TranslateError::invalid(format!("{bf}.type"), "is required")),
        }
    }
    if role == "assistant" {
        let text: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        let content = if text.is_empty() {
            Value::Null
        } else {
            Value::String(text.join("\n"))
        };
        let mut msg = json!({ "role": "assistant", "content": content });
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        messages.push(msg);
    } else if !parts.is_empty() {
        let content = if has_image {
            Value::Array(parts)
        } else {
            let text: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
            Value::String(text.join("\n"))
        };
        messages.push(json!({ "role": "user", "content": content }));
    }
    Ok(())
}

fn image_block_to_part(b: &Value, field: &str) -> Result<Value> {
    let source = &b["source"];
    let url = match source["type"].as_str() {
        Some("base64") => {
            let media = opt_str(source, "media_type", &format!("{field}.source.media_type"))?
                .ok_or_else(|| {
                    TranslateError::invalid(format!("{field}.source.media_type"), "is required")
                })?;
            let data =
                opt_str(source, "data", &format!("{field}.source.data"))?.ok_or_else(|| {
                    TranslateError::invalid(format!("{field}.source.data"), "is required")
                })?;
            format!("data:{media};base64,{data}")
        }
        Some("url") => opt_str(source, "url", &format!("{field}.source.url"))?
            .ok_or_else(|| TranslateError::invalid(format!("{field}.source.url"), "is required"))?
            .to_owned(),
        _ => {
            return Err(TranslateError::unsupported(
                format!("{field}.source.type"),
                "an image source other than base64 or url",
            ));
        }
    };
    Ok(json!({ "type": "image_url", "image_url": { "url": url } }))
}

// === chat → Anthropic Messages ===

/// A chat completions request as an Anthropic Messages request (for an Anthropic-native
/// upstream).
///
/// - `system` and `developer` messages (wherever they are) → `system`, joined with a blank
///   line; `user` text and `image_url` parts (a `data:` URL → a base64 source, else a URL
///   source) → blocks; assistant `content` → a text block and `tool_calls` → `tool_use` blocks
///   (arguments must be a JSON object); `tool` messages → `tool_result` blocks in a user turn.
///   Consecutive messages of one role are merged into one turn, as Anthropic requires.
/// - `tools` (functions: `parameters` → `input_schema`), `tool_choice` (`auto`, `none`,
///   `required` → `any`, a function → `tool`), `parallel_tool_calls: false` →
///   `disable_parallel_tool_use`, `max_completion_tokens` or `max_tokens` (default
///   [`DEFAULT_MAX_TOKENS`]), `stop` (→ `stop_sequences`), `temperature`, `top_p`, `user` (→
///   `metadata.user_id`), `stream`.
/// - Dropped: `stream_options` (Anthropic streams always carry usage), `seed`,
///   `frequency_penalty`, `presence_penalty`, `logit_bias`, `service_tier`, `store`.
/// - Refused: `n` above 1, `logprobs`, `response_format` other than text, audio and file parts.
pub fn chat_to_messages(req: &Value) -> Result<Value> {
    object(req, "(body)")?;
    if req.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err(TranslateError::unsupported("n", "more than one choice"));
    }
    if req.get("logprobs") == Some(&Value::Bool(true)) {
        return Err(TranslateError::unsupported("logprobs", "logprobs"));
    }
    if let Some(format) = req.get("response_format").filter(|v| !v.is_null())
        && format["type"] != "text"
    {
        return Err(TranslateError::unsupported(
            "response_format",
            "a structured response_format",
        ));
    }
    let list = req
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| TranslateError::invalid("messages", "must be an array"))?;
    let mut system: Vec<String> = Vec::new();
    let mut turns: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let field = format!("messages[{i}]");
        object(m, &field)?;
        let (role, blocks) = match m["role"].as_str() {
            Some("system" | "developer") => {
                system.push(chat_text(&m["content"], &format!("{field}.content"))?);
                continue;
            }
            Some("user") => (
                "user",
                user_blocks(&m["content"], &format!("{field}.content"))?,
            ),
            Some("assistant") => ("assistant", assistant_blocks(m, &field)?),
            Some("tool") => {
                let id = opt_str(m, "tool_call_id", &format!("{field}.tool_call_id"))?.ok_or_else(
                    || TranslateError::invalid(format!("{field}.tool_call_id"), "is required"),
                )?;
                let content = chat_text(&m["content"], &format!("{field}.content"))?;
                (
                    "user",
                    vec![json!({ "type": "tool_result", "tool_use_id": id, "content": content })],
                )
            }
            _ => {
                return Err(TranslateError::invalid(
                    format!("{field}.role"),
                    "must be system, developer, user, assistant or tool",
                ));
            }
        };
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some((last, existing)) if *last == role => existing.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    let mut out = Map::new();
    copy(req, &mut out, &[("model", "model")]);
    let max_tokens = req
        .get("max_completion_tokens")
        .or_else(|| req.get("max_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    out.insert("max_tokens".into(), json!(max_tokens));
    if !system.is_empty() {
        out.insert("system".into(), Value::String(system.join("\n\n")));
    }
    let messages = turns
        .into_iter()
        .map(|(role, blocks)| json!({ "role": role, "content": blocks }))
        .collect();
    out.insert("messages".into(), Value::Array(messages));
    let mut has_tools = false;
    if let Some(tools) = req.get("tools").filter(|t| !t.is_null()) {
        let tools = tools
            .as_array()
            .ok_or_else(|| TranslateError::invalid("tools", "must be an array"))?;
        let mut mapped = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let field = format!("tools[{i}]");
            if t["type"] != "function" {
                return Err(TranslateError::unsupported(
                    format!("{field}.type"),
                    "a tool other than a function",
                ));
            }
            let f = &t["function"];
            let name = opt_str(f, "name", &format!("{field}.function.name"))?.ok_or_else(|| {
                TranslateError::invalid(format!("{field}.function.name"), "is required")
            })?;
            let mut tool = Map::new();
            tool.insert("name".into(), Value::String(name.to_owned()));
            copy(f, &mut tool, &[("description", "description")]);
            let schema = f
                .get("parameters")
                .filter(|p| !p.is_null())
                .cloned()
                .unwrap_or_else(|| json!({ "type": "object", "properties": {} }));
            tool.insert("input_schema".into(), schema);
            mapped.push(Value::Object(tool));
        }
        has_tools = !mapped.is_empty();
        if has_tools {
            out.insert("tools".into(), Value::Array(mapped));
        }
    }
    let mut choice = match req.get("tool_choice") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Some(json!({ "type": "auto" })),
            "none" => Some(json!({ "type": "none" })),
            "required" => Some(json!({ "type": "any" })),
            _ => {
                return Err(TranslateError::invalid(
                    "tool_choice",
                    "must be auto, none, required or a function",
                ));
            }
        },
        Some(c) => {
            let name = c
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    TranslateError::invalid("tool_choice.function.name", "is required")
                })?;
            Some(json!({ "type": "tool", "name": name }))
        }
    };
    if req.get("parallel_tool_calls") == Some(&Value::Bool(false)) && has_tools {
        let c = choice.get_or_insert_with(|| json!({ "type": "auto" }));
        if c["type"] != "none" {
            c["disable_parallel_tool_use"] = Value::Bool(true);
        }
    }
    if let Some(c) = choice {
        out.insert("tool_choice".into(), c);
    }
    match req.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            out.insert("stop_sequences".into(), json!([s]));
        }
        Some(Value::Array(a)) => {
            out.insert("stop_sequences".into(), Value::Array(a.clone()));
        }
        Some(_) => return Err(TranslateError::invalid("stop", "must be text or an array")),
    }
    copy(
        req,
        &mut out,
        &[("temperature", "temperature"), ("top_p", "top_p")],
    );
    if let Some(user) = opt_str(req, "user", "user")? {
        out.insert("metadata".into(), json!({ "user_id": user }));
    }
    stream_flags(req, &mut out, false);
    Ok(Value::Object(out))
}

/// The text of chat content (a string, or text parts joined with LF).
fn chat_text(content: &Value, field: &str) -> Result<String> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                if p["type"] != "text" {
                    return Err(TranslateError::unsupported(
                        format!("{field}[{j}].type"),
                        "a non-text part here",
                    ));
                }
                text.push(p["text"].as_str().ok_or_else(|| {
                    TranslateError::invalid(format!("{field}[{j}].text"), "must be a string")
                })?);
            }
            Ok(text.join("\n"))
        }
        _ => Err(TranslateError::invalid(
            field,
            "must be text or content parts",
        )),
    }
}

fn user_blocks(content: &Value, field: &str) -> Result<Vec<Value>> {
    match content {
        Value::String(s) => Ok(vec![json!({ "type": "text", "text": s })]),
        Value::Array(parts) => {
            let mut blocks = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let pf = format!("{field}[{j}]");
                match p["type"].as_str() {
                    Some("text") => {
                        let text = opt_str(p, "text", &format!("{pf}.text"))?.unwrap_or("");
                        blocks.push(json!({ "type": "text", "text": text }));
                    }
                    Some("image_url") => {
                        let url = p
                            .pointer("/image_url/url")
                            .and_then(Value::as_str)
                            .ok_or_else(|| {
                                TranslateError::invalid(
                                    format!("{pf}.image_url.url"),
                                    "is required",
                                )
                            })?;
                        blocks.push(image_url_to_block(url));
                    }
                    Some(other) => {
                        return Err(TranslateError::unsupported(
                            format!("{pf}.type"),
                            &format!("the `{}` content part", crate::bounded(other)),
                        ));
                    }
                    None => {
                        return Err(TranslateError::invalid(format!("{pf}.type"), "is required"));
                    }
                }
            }
            Ok(blocks)
        }
        _ => Err(TranslateError::invalid(
            field,
            "must be text or content parts",
        )),
    }
}

fn image_url_to_block(url: &str) -> Value {
    if let Some(rest) = url.strip_prefix("data:")
        && let Some((media, data)) = rest.split_once(";base64,")
    {
        return json!({
            "type": "image",
            "source": { "type": "base64", "media_type": media, "data": data },
        });
    }
    json!({ "type": "image", "source": { "type": "url", "url": url } })
}

fn assistant_blocks(m: &Value, field: &str) -> Result<Vec<Value>> {
    let mut blocks = Vec::new();
    let text = chat_text(&m["content"], &format!("{field}.content"))?;
    if !text.is_empty() {
        blocks.push(json!({ "type": "text", "text": text }));
    }
    if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
        let calls = calls.as_array().ok_or_else(|| {
            TranslateError::invalid(format!("{field}.tool_calls"), "must be an array")
        })?;
        for (j, c) in calls.iter().enumerate() {
            let cf = format!("{field}.tool_calls[{j}]");
            let id = opt_str(c, "id", &format!("{cf}.id"))?
                .ok_or_else(|| TranslateError::invalid(format!("{cf}.id"), "is required"))?;
            let name = c
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    TranslateError::invalid(format!("{cf}.function.name"), "is required")
                })?;
            let args = c
                .pointer("/function/arguments")
                .and_then(Value::as_str)
                .unwrap_or("");
            let input = if args.trim().is_empty() {
                json!({})
            } else {
                match serde_json::from_str::<Value>(args) {
                    Ok(v @ Value::Object(_)) => v,
                    _ => {
                        return Err(TranslateError::invalid(
                            format!("{cf}.function.arguments"),
                            "must be a JSON object",
                        ));
                    }
                }
            };
            blocks.push(json!({ "type": "tool_use", "id": id, "name": name, "input": input }));
        }
    }
    Ok(blocks)
}

// === Token estimate ===

/// A token estimate for a chat request, for `count_tokens` when no upstream counts: one token
/// per four bytes of text (message content, tool-call arguments and tool definitions), rounded
/// up, plus four per message and 85 per image (the commonly published rules of thumb). It is
/// an estimate, and the Edge marks it as one.
pub fn estimate_tokens(chat: &Value) -> u64 {
    let mut bytes = 0usize;
    let mut extra = 0u64;
    if let Some(messages) = chat["messages"].as_array() {
        for m in messages {
            extra += 4;
            match &m["content"] {
                Value::String(s) => bytes += s.len(),
                Value::Array(parts) => {
                    for p in parts {
                        match p["text"].as_str() {
                            Some(t) => bytes += t.len(),
                            None => extra += 85,
                        }
                    }
                }
                _ => {}
            }
            if let Some(calls) = m["tool_calls"].as_array() {
                for c in calls {
                    bytes += c
                        .pointer("/function/name")
                        .and_then(Value::as_str)
                        .map_or(0, str::len);
                    bytes += c
                        .pointer("/function/arguments")
                        .and_then(Value::as_str)
                        .map_or(0, str::len);
                }
            }
        }
    }
    if let Some(tools) = chat["tools"].as_array() {
        bytes += tools.iter().map(|t| t.to_string().len()).sum::<usize>();
    }
    (bytes as u64).div_ceil(4) + extra
}
