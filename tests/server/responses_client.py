"""The official `openai` client's Responses API against a running `host serve`.

Usage: responses_client.py BASE_URL API_KEY MODEL EXPECTED_JSON

EXPECTED_JSON holds the offline engine's greedy chat answers (computed by the
Rust test through a different frontend), 16 tokens each: {"question",
"answer", "instructions", "answer_with_instructions", "follow_up",
"follow_up_answer"}. Prints one line per check and exits non-zero on the first
failure.
"""

import json
import sys
import time

import openai

base_url, api_key, model, expected = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
checks = 0
greedy = {"model": model, "max_output_tokens": 16, "temperature": 0}


def check(name, ok, detail=""):
    global checks
    if not ok:
        sys.exit(f"FAIL {name}: {detail}")
    checks += 1
    print(f"ok {name}")


def finished_status(r):
    # 16 tokens without an end: incomplete (max_output_tokens); fewer: completed.
    want = "incomplete" if r.usage.output_tokens == 16 else "completed"
    return r.status == want and (want == "completed") == (r.incomplete_details is None)


question, answer = expected["question"], expected["answer"]

# Not streamed: the offline engine's greedy chat answer.
r = client.responses.create(input=question, **greedy)
check("create text", r.output_text == answer, (r.output_text, answer))
check("create object", r.object == "response" and r.id.startswith("resp_") and r.model == model, r)
check("create status", finished_status(r), (r.status, r.incomplete_details, r.usage))
check("create usage", r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage)
check("create echo", r.max_output_tokens == 16 and r.temperature == 0 and r.store is True, r)
first = r

# Streamed: the documented events, numbered, adding up to the same text.
events = list(client.responses.create(input=question, stream=True, **greedy))
types = [e.type for e in events]
head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
check("stream order", types[:4] == head and types[-4:-1] == tail and types[-1] in ("response.completed", "response.incomplete"), types)
check("stream deltas", all(t == "response.output_text.delta" for t in types[4:-4]) and len(types) > 8, types)
check("stream sequence numbers", [e.sequence_number for e in events] == list(range(len(events))), [e.sequence_number for e in events])
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
check("stream text", deltas == answer, (deltas, answer))
check("stream text done", events[-4].text == answer, events[-4])
final = events[-1].response
check("stream final response", final.output_text == answer and final.status == types[-1].split(".")[1], final)
check("stream created", events[0].response.status == "in_progress" and events[0].response.output == [], events[0])
item_id = events[2].item.id
check("stream item ids", all(getattr(e, "item_id", item_id) == item_id for e in events), events)
# The item and part open empty: a client appends every delta to them.
check("stream opens empty", events[2].item.content[0].text == "" and events[3].part.text == "", (events[2], events[3]))

# Logprobs (include + top_logprobs): chat's for the same conversation, one
# entry per generated token; greedy, each token is its own first
# alternative. Streamed, the deltas carry them in the same order.
def entries(logprobs):
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in logprobs]


asked = {"input": question, "include": ["message.output_text.logprobs"], "top_logprobs": 2, **greedy}
r = client.responses.create(**asked)
got = entries(r.output[0].content[0].logprobs)
c = client.chat.completions.create(
    messages=[{"role": "user", "content": question}], logprobs=True, top_logprobs=2,
    model=model, max_tokens=16, temperature=0,
)
check("logprobs: chat's", r.output_text == answer and got == entries(c.choices[0].logprobs.content), (got, c.choices[0].logprobs))
check("logprobs: one per token", len(got) == r.usage.output_tokens and "".join(t for t, _, _ in got) == answer, got)
check("logprobs: greedy picks the first alternative", all(len(top) == 2 and top[0][0] == t for t, _, top in got), got)
check("logprobs: echo", r.top_logprobs == 2, r.top_logprobs)
events = list(client.responses.create(stream=True, **asked))
streamed = [e for ev in events if ev.type == "response.output_text.delta" for e in entries(ev.logprobs)]
check("logprobs: streamed", streamed == got and entries(events[-1].response.output[0].content[0].logprobs) == got, streamed)
r = client.responses.create(input=question, **greedy)
check("logprobs: none unless asked", r.output[0].content[0].logprobs == [], r.output[0].content[0])

# instructions: a system message first; the same as message items with the
# developer role and input_text parts.
want = expected["answer_with_instructions"]
r = client.responses.create(input=question, instructions=expected["instructions"], **greedy)
check("instructions", r.output_text == want and r.instructions == expected["instructions"], (r.output_text, want))
items = [
    {"role": "developer", "content": expected["instructions"]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]},
]
r = client.responses.create(input=items, **greedy)
check("input items", r.output_text == want, (r.output_text, want))

# previous_response_id: the stored conversation and answer come first.
r = client.responses.create(input=expected["follow_up"], previous_response_id=first.id, **greedy)
check("previous_response_id", r.output_text == expected["follow_up_answer"], (r.output_text, expected["follow_up_answer"]))
check("previous_response_id echo", r.previous_response_id == first.id, r.previous_response_id)

# Retrieve; store: false is not kept.
got = client.responses.retrieve(first.id)
check("retrieve", got.id == first.id and got.output_text == answer and got.status == first.status, got)
r = client.responses.create(input=question, store=False, **greedy)
check("store false answers", r.output_text == answer and r.store is False, r)
try:
    client.responses.retrieve(r.id)
    check("store false is not kept", False, "retrieved")
except openai.NotFoundError as e:
    check("store false is not kept", e.status_code == 404, e)

# Background: answered at once, polled to the same text.
r = client.responses.create(input=question, background=True, **greedy)
check("background starts", r.status == "in_progress" and r.background is True, r)
deadline = time.time() + 120
while r.status == "in_progress" and time.time() < deadline:
    time.sleep(0.05)
    r = client.responses.retrieve(r.id)
check("background finishes", r.output_text == answer and finished_status(r), r)

# Cancel a long background response; it stays cancelled.
long = client.responses.create(
    model=model, input="Count from one to one thousand.", max_output_tokens=2000, temperature=0,
    background=True, extra_body={"ignore_eos": True},
)
c = client.responses.cancel(long.id)
check("cancel", c.status == "cancelled" and c.id == long.id, c)
time.sleep(0.5)
got = client.responses.retrieve(long.id)
check("cancelled stays", got.status == "cancelled" and got.usage.output_tokens < 2000, got)
try:
    client.responses.cancel(first.id)
    check("cancel a finished response", False, "no error")
except openai.BadRequestError as e:
    check("cancel a finished response", e.status_code == 400 and first.status in e.message, e.message)

# Delete.
client.responses.delete(long.id)
try:
    client.responses.retrieve(long.id)
    check("delete", False, "retrieved")
except openai.NotFoundError:
    check("delete", True)

# What is not implemented is refused, naming the field.
for name, kwargs, param in [
    ("hosted tool", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("text verbosity", {"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text"),
    ("text format type", {"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ("reasoning", {"reasoning": {"effort": "high"}}, "reasoning"),
    ("include other", {"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ("top_logprobs 21", {"top_logprobs": 21}, "top_logprobs"),
    ("unknown previous", {"previous_response_id": "resp_nope"}, "previous_response_id"),
    ("max_output_tokens 0", {"max_output_tokens": 0}, "max_output_tokens"),
    ("reasoning item", {"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ("prompt truncation", {"extra_body": {"truncate_prompt_tokens": 5}}, "truncate_prompt_tokens"),
]:
    args = {"input": question, **greedy} | kwargs
    try:
        client.responses.create(**args)
        check(name, False, "no error")
    except openai.BadRequestError as e:
        check(name, e.status_code == 400 and e.param == param, (e.status_code, e.param, e.message))

try:
    openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).responses.create(input=question, **greedy)
    check("wrong api key", False, "no error")
except openai.AuthenticationError as e:
    check("wrong api key", e.status_code == 401, e)

print(f"{checks} passed, 0 failed")
