"""Drives an IOP Edge with the official OpenAI and Anthropic Python SDKs.

Usage: python3 sdk_check.py ROOT_URL API_KEY MODEL

ROOT_URL is the Edge's HTTP root (http://host:port); the OpenAI SDK uses ROOT_URL/v1, the
Anthropic SDK ROOT_URL. The fake upstreams the tests run answer deterministically ("echo: ..."
and a get_weather tool call), so every check compares exact values. Prints one line per SDK and
exits non-zero on the first failure, naming it.
"""
import json
import sys

import anthropic
import openai

root, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
checks = {"openai": 0, "anthropic": 0}

WEATHER_FN = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def ok(sdk, what, cond, detail=""):
    if not cond:
        raise SystemExit(f"{sdk}: {what} failed {detail}")
    checks[sdk] += 1


# === OpenAI ===
oa = openai.OpenAI(base_url=root + "/v1", api_key=key, max_retries=0, timeout=30)

ids = [m.id for m in oa.models.list().data]
ok("openai", "models", model in ids, ids)

done = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello sdk"}])
ok("openai", "chat", done.choices[0].message.content == "echo: hello sdk", done)
ok("openai", "chat finish", done.choices[0].finish_reason == "stop", done)
ok("openai", "chat usage", done.usage is not None and done.usage.total_tokens > 0, done.usage)

chunks = list(
    oa.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "stream me"}],
        stream=True,
        stream_options={"include_usage": True},
    )
)
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
ok("openai", "chat stream", text == "echo: stream me", text)
ok("openai", "chat stream usage", chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0, chunks[-1])

calls = oa.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    tools=[WEATHER_FN],
)
msg = calls.choices[0].message
ok("openai", "chat tools", calls.choices[0].finish_reason == "tool_calls" and msg.tool_calls, calls)
ok("openai", "chat tool name", msg.tool_calls[0].function.name == "get_weather", msg)
ok("openai", "chat tool args", json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}, msg)
followup = oa.chat.completions.create(
    model=model,
    messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"},
    ],
    tools=[WEATHER_FN],
)
ok("openai", "chat tool result", followup.choices[0].message.content == "It is sunny in Paris.", followup)

stream_calls = list(
    oa.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "weather please"}],
        tools=[WEATHER_FN],
        stream=True,
    )
)
args = "".join(
    tc.function.arguments or ""
    for c in stream_calls
    if c.choices and c.choices[0].delta.tool_calls
    for tc in c.choices[0].delta.tool_calls
)
ok("openai", "chat tools stream", json.loads(args) == {"city": "Paris"}, args)

resp = oa.responses.create(model=model, input="hello responses")
ok("openai", "responses", resp.status == "completed" and resp.output_text == "echo: hello responses", resp)
ok("openai", "responses usage", resp.usage is not None and resp.usage.total_tokens > 0, resp.usage)

resp = oa.responses.create(
    model=model,
    instructions="be brief",
    input=[{"role": "user", "content": [{"type": "input_text", "text": "items"}]}],
)
ok("openai", "responses items", resp.output_text == "echo: items", resp.output_text)

deltas = []
with oa.responses.stream(model=model, input="streamed responses") as stream:
    for event in stream:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
    final = stream.get_final_response()
ok("openai", "responses stream", "".join(deltas) == "echo: streamed responses", deltas)
ok("openai", "responses stream final", final.output_text == "echo: streamed responses", final)

tools = [{
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}]
resp = oa.responses.create(model=model, input="What is the weather in Paris?", tools=tools)
fc = [o for o in resp.output if o.type == "function_call"]
ok("openai", "responses tools", fc and fc[0].name == "get_weather" and json.loads(fc[0].arguments) == {"city": "Paris"}, resp.output)
resp2 = oa.responses.create(
    model=model,
    input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": fc[0].call_id, "name": "get_weather", "arguments": fc[0].arguments},
        {"type": "function_call_output", "call_id": fc[0].call_id, "output": "rainy"},
    ],
    tools=tools,
)
ok("openai", "responses tool result", resp2.output_text == "It is rainy in Paris.", resp2.output_text)
with oa.responses.stream(model=model, input="weather now?", tools=tools) as stream:
    for _ in stream:
        pass
    final = stream.get_final_response()
fc = [o for o in final.output if o.type == "function_call"]
ok("openai", "responses tools stream", fc and json.loads(fc[0].arguments) == {"city": "Paris"}, final.output)

bad = openai.OpenAI(base_url=root + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
try:
    bad.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    ok("openai", "invalid key refused", False)
except openai.AuthenticationError as e:
    body = e.response.json()
    ok("openai", "invalid key 401", e.status_code == 401, e)
    ok("openai", "invalid key shape", body["error"]["type"] == "authentication_error", body)

try:
    oa.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    ok("openai", "unknown model refused", False)
except openai.NotFoundError as e:
    body = e.response.json()
    ok("openai", "unknown model 404", e.status_code == 404 and "no-such-model" in body["error"]["message"], body)

try:
    oa.responses.create(model="no-such-model", input="x")
    ok("openai", "unknown model refused (responses)", False)
except openai.NotFoundError as e:
    ok("openai", "unknown model 404 (responses)", e.status_code == 404, e)

# === Anthropic ===
an = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0, timeout=30)

ids = [m.id for m in an.models.list().data]
ok("anthropic", "models", model in ids, ids)

m = an.messages.create(
    model=model,
    max_tokens=64,
    system="be brief",
    messages=[{"role": "user", "content": "hello claude"}],
)
ok("anthropic", "messages", m.type == "message" and m.content[0].text == "echo: hello claude", m)
ok("anthropic", "messages stop", m.stop_reason == "end_turn", m)
ok("anthropic", "messages usage", m.usage.input_tokens > 0 and m.usage.output_tokens > 0, m.usage)

events = list(
    an.messages.create(
        model=model,
        max_tokens=64,
        messages=[{"role": "user", "content": [{"type": "text", "text": "raw stream"}]}],
        stream=True,
    )
)
kinds = [e.type for e in events]
ok("anthropic", "stream framing", kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds)
text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
ok("anthropic", "stream text", text == "echo: raw stream", text)

with an.messages.stream(
    model=model, max_tokens=64, messages=[{"role": "user", "content": "stream helper"}]
) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
ok("anthropic", "stream helper", streamed == "echo: stream helper", streamed)
ok("anthropic", "stream helper final", final.content[0].text == "echo: stream helper" and final.stop_reason == "end_turn", final)
ok("anthropic", "stream helper usage", final.usage.output_tokens > 0, final.usage)

count = an.messages.count_tokens(model=model, messages=[{"role": "user", "content": "count these tokens"}])
ok("anthropic", "count_tokens", count.input_tokens > 0, count)

tools = [{
    "name": "get_weather",
    "description": "Weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}]
m = an.messages.create(
    model=model,
    max_tokens=64,
    tools=tools,
    messages=[{"role": "user", "content": "What is the weather in Paris?"}],
)
use = [b for b in m.content if b.type == "tool_use"]
ok("anthropic", "tool_use", m.stop_reason == "tool_use" and use and use[0].input == {"city": "Paris"}, m)
m2 = an.messages.create(
    model=model,
    max_tokens=64,
    tools=tools,
    messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "foggy"}]},
    ],
)
ok("anthropic", "tool_result", m2.content[0].text == "It is foggy in Paris.", m2)
with an.messages.stream(
    model=model, max_tokens=64, tools=tools, messages=[{"role": "user", "content": "weather?"}]
) as stream:
    final = stream.get_final_message()
use = [b for b in final.content if b.type == "tool_use"]
ok("anthropic", "tool_use stream", use and use[0].input == {"city": "Paris"} and final.stop_reason == "tool_use", final)

bad = anthropic.Anthropic(base_url=root, api_key="sk-wrong", max_retries=0, timeout=30)
try:
    bad.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "x"}])
    ok("anthropic", "invalid key refused", False)
except anthropic.AuthenticationError as e:
    body = e.response.json()
    ok("anthropic", "invalid key 401", e.status_code == 401, e)
    ok("anthropic", "invalid key shape", body["type"] == "error" and body["error"]["type"] == "authentication_error", body)

try:
    an.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    ok("anthropic", "unknown model refused", False)
except anthropic.NotFoundError as e:
    body = e.response.json()
    ok("anthropic", "unknown model 404", e.status_code == 404, e)
    ok("anthropic", "unknown model shape", body["type"] == "error" and body["error"]["type"] == "not_found_error", body)

print(f"sdk check: openai {checks['openai']} checks ok, anthropic {checks['anthropic']} checks ok")
