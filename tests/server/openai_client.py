"""The official `openai` client against a running `host serve`.

Usage: openai_client.py BASE_URL API_KEY MODEL EXPECTED_JSON

EXPECTED_JSON holds the offline engine's greedy answers (computed by the Rust
test through a different frontend): {"prompt", "completion", "chat_user",
"chat"}, 16 tokens each. Prints one line per check and exits non-zero on the
first failure.
"""

import json
import sys

import openai

base_url, api_key, model, expected = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
checks = 0


def check(name, ok, detail=""):
    global checks
    if not ok:
        sys.exit(f"FAIL {name}: {detail}")
    checks += 1
    print(f"ok {name}")


# /v1/models
ids = [m.id for m in client.models.list().data]
check("models.list", ids == [model], ids)

# Completions, not streamed: the offline engine's greedy text.
r = client.completions.create(model=model, prompt=expected["prompt"], max_tokens=16, temperature=0)
check("completions text", r.choices[0].text == expected["completion"], (r.choices[0].text, expected["completion"]))
check("completions usage", r.usage.completion_tokens == 16 or r.choices[0].finish_reason == "stop", r.usage)
check("completions finish", r.choices[0].finish_reason in ("length", "stop"), r.choices[0].finish_reason)

# Completions, streamed.
stream = client.completions.create(
    model=model, prompt=expected["prompt"], max_tokens=16, temperature=0, stream=True
)
text = "".join(c.choices[0].text for c in stream if c.choices)
check("completions stream", text == expected["completion"], (text, expected["completion"]))

# vLLM's extra sampling fields through extra_body: top_k = 1 is greedy even at
# temperature 1.
r = client.completions.create(
    model=model, prompt=expected["prompt"], max_tokens=16, temperature=1.0,
    extra_body={"top_k": 1, "vllm_xargs": {"note": "passed to sampler plugins"}, "priority": 0},
)
check("extra_body top_k", r.choices[0].text == expected["completion"], r.choices[0].text)

# Chat, not streamed and streamed with a usage chunk.
messages = [{"role": "user", "content": expected["chat_user"]}]
r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
check("chat content", r.choices[0].message.content == expected["chat"], (r.choices[0].message.content, expected["chat"]))
check("chat role", r.choices[0].message.role == "assistant", r.choices[0].message.role)
stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
parts, usage, finish = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        parts.append(c.delta.content or "")
        finish = c.finish_reason or finish
check("chat stream", "".join(parts) == expected["chat"], ("".join(parts), expected["chat"]))
check("chat stream usage", usage is not None and usage.completion_tokens <= 16 and usage.prompt_tokens > 0, usage)
check("chat stream finish", finish in ("length", "stop"), finish)
# The same messages a second time: every full 16-token block before the
# prompt's last token came from the prefix cache.
details = usage.prompt_tokens_details
check("chat cached tokens", details is not None and details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16, usage)

# vLLM's request names: the body's `request_id`, or the header, which wins.
r = client.completions.create(model=model, prompt="Hi", max_tokens=1, extra_body={"request_id": "mine"})
check("request_id names the answer", r.id == "cmpl-mine", r.id)
r = client.chat.completions.create(
    model=model, messages=messages, max_tokens=1,
    extra_body={"request_id": "body"}, extra_headers={"X-Request-Id": "header"},
)
check("X-Request-Id wins", r.id == "chatcmpl-header", r.id)
# The server runs with --enable-request-id-headers: the header comes back.
raw = client.completions.with_raw_response.create(
    model=model, prompt="Hi", max_tokens=1, extra_headers={"X-Request-Id": "echoed"}
)
check("X-Request-Id echoed", raw.headers.get("x-request-id") == "echoed", dict(raw.headers))
check("raw response parses", raw.parse().id == "cmpl-echoed", raw.parse().id)

# vLLM's detokenization switches through extra_body; a text without special
# tokens is the same whatever they say.
r = client.completions.create(
    model=model, prompt=expected["prompt"], max_tokens=16, temperature=0,
    extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False},
)
check("spaces_between_special_tokens", r.choices[0].text == expected["completion"], r.choices[0].text)

# Logprobs.
r = client.chat.completions.create(
    model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
)
content = r.choices[0].logprobs.content
check("chat logprobs", len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content), content)
check("chat greedy logprob is the top one", all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4 for t in content))

# Seeded sampling is reproducible.
a = client.completions.create(model=model, prompt="Once", max_tokens=10, temperature=1.0, seed=7)
b = client.completions.create(model=model, prompt="Once", max_tokens=10, temperature=1.0, seed=7)
check("seed", a.choices[0].text == b.choices[0].text, (a.choices[0].text, b.choices[0].text))

# Errors come back as the client's typed exceptions, naming the field.
for name, kwargs, param in [
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens"),
    ("temperature", {"temperature": -2}, "temperature"),
    ("unknown model", {"model": "gpt-4o"}, "model"),
]:
    args = {"model": model, "prompt": "x", "max_tokens": 4} | kwargs
    try:
        client.completions.create(**args)
        check(name, False, "no error")
    except openai.BadRequestError as e:
        check(name, e.status_code == 400 and e.param == param, (e.status_code, e.param, e.message))

try:
    openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    check("wrong api key", False, "no error")
except openai.AuthenticationError as e:
    check("wrong api key", e.status_code == 401, e)

print(f"{checks} passed, 0 failed")
