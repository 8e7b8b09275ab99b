"""Drives a running local mesh with the official OpenAI Python SDK.

Usage: python3 openai_sdk_check.py BASE_URL

Exits non-zero (with the failing assertion) if anything the SDK sees is wrong.
"""
import sys

from openai import OpenAI


def require(condition, what):
    """Fails the process when `condition` is false. Not `assert`, which `python -O` and
    PYTHONOPTIMIZE strip, and the check with it."""
    if not condition:
        sys.exit(f"check failed: {what}")


base = sys.argv[1]
client = OpenAI(base_url=base, api_key="local-mesh", max_retries=0, timeout=30)

models = client.models.list()
ids = [m.id for m in models.data]
require(ids == ["demo"], ids)

done = client.chat.completions.create(
    model="demo", messages=[{"role": "user", "content": "hello sdk"}]
)
require(done.object == "chat.completion", done)
require(done.choices[0].message.content == "echo: hello sdk", done.choices[0].message)
require(done.choices[0].finish_reason == "stop", 'done.choices[0].finish_reason == "stop"')
require(done.usage.total_tokens > 0, 'done.usage.total_tokens > 0')

chunks = list(
    client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "stream me"}],
        stream=True,
    )
)
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
require(text == "echo: stream me", text)
require(chunks[-1].choices[0].finish_reason == "stop", 'chunks[-1].choices[0].finish_reason == "stop"')

resp = client.responses.create(model="demo", input="hello responses")
require(resp.status == "completed", resp)
require(resp.output_text == "echo: hello responses", resp.output_text)

resp = client.responses.create(
    model="demo",
    instructions="be brief",
    input=[{"role": "user", "content": [{"type": "input_text", "text": "items"}]}],
)
require(resp.output_text == "echo: items", resp.output_text)

deltas = []
with client.responses.stream(model="demo", input="streamed responses") as stream:
    for event in stream:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
    final = stream.get_final_response()
require("".join(deltas) == "echo: streamed responses", deltas)
require(final.output_text == "echo: streamed responses", final.output_text)

try:
    client.chat.completions.create(model="missing", messages=[])
    raise AssertionError("unknown model accepted")
except Exception as e:  # the SDK's NotFoundError
    require(getattr(e, "status_code", None) == 404, e)

print("openai sdk: models, chat, chat stream, responses, responses stream, 404 ok")
