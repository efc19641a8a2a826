"""Tool calls through the official `openai` client against a running
`host serve` that loads the structured-output plugin.

Usage: tools_client.py BASE_URL API_KEY MODEL EXPECTED_JSON

The judge is independent of the server: every call's arguments are parsed
with `json` and validated against the function's own parameter schema with
the `jsonschema` package, names against the tools offered, and the streamed
calls are reassembled from their `delta.tool_calls` as a client would
(arguments in several pieces, adding up to the same call not streamed); a
Pydantic model's tool (`openai.pydantic_function_tool`, nested models under
`$defs`) is called with arguments that parse back into the model.
Prints one line per check and exits non-zero if any failed.
"""

import concurrent.futures
import json
import sys

import jsonschema
import openai
import pydantic

import judge
from judge import Checks

base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
check = Checks()

WEATHER = {"type": "function", "function": judge.WEATHER}
ADD = {"type": "function", "function": judge.ADD}
TOOLS = [WEATHER, ADD]


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


class Shipment(pydantic.BaseModel):
    sender: Address
    recipient: Address
    weight_kg: int = pydantic.Field(ge=1, le=50)


# As the SDK writes a Pydantic model's tool: nested models under `$defs`,
# reached by `$ref`, which must still resolve inside the server's schema.
SHIP = openai.pydantic_function_tool(Shipment, name="ship", description="Ships a parcel")
ASK_SHIP = [{"role": "user", "content": "Ship a 3 kg parcel from Paris, France to Rome, Italy."}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS + [SHIP]}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
ASK_SUM = [{"role": "user", "content": "What is 12 plus 30?"}]



def valid_call(name, fn_name, arguments, allowed):
    """A call names an offered function and its arguments follow its schema."""
    check(f"{name}: names an offered function", fn_name in allowed, fn_name)
    try:
        args = json.loads(arguments)
        jsonschema.validate(args, SCHEMAS[fn_name])
        check(f"{name}: arguments follow the schema", True)
    except (ValueError, KeyError, jsonschema.ValidationError) as e:
        check(f"{name}: arguments follow the schema", False, f"{arguments!r}: {e}")


def named(fn):
    return {"type": "function", "function": {"name": fn}}


ALLOW_ADD = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [named("add")]}}


def non_streamed(name, messages, choice, allowed, parallel=False, tools=TOOLS):
    r = client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice=choice,
        parallel_tool_calls=parallel, temperature=0, max_tokens=96,
    )
    c = r.choices[0]
    calls = c.message.tool_calls or []
    check(f"{name}: finish_reason tool_calls", c.finish_reason == "tool_calls", c.finish_reason)
    check(f"{name}: one call", len(calls) == 1, c.message)
    check(f"{name}: no content beside the call", c.message.content is None, c.message.content)
    for call in calls:
        check(f"{name}: a function call with an id", call.type == "function" and call.id, call)
        valid_call(name, call.function.name, call.function.arguments, allowed)
    return r


def streamed(name, messages, choice, allowed, tools=TOOLS):
    kwargs = dict(
        model=model, messages=messages, tools=tools, tool_choice=choice,
        parallel_tool_calls=False, temperature=0, max_tokens=96,
    )
    calls, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
                check(f"{name}: the id and name come first, once", bool(d.id) == (slot["id"] is None) and bool(d.function.name) == (slot["id"] is None), (d, slot))
                slot["id"] = d.id or slot["id"]
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
                slot["pieces"] += bool(d.function.arguments)
            finish = c.finish_reason or finish
    check(f"{name}: finish_reason tool_calls", finish == "tool_calls", finish)
    check(f"{name}: one call and no content", len(calls) == 1 and content == "", (calls, content))
    for slot in calls.values():
        check(f"{name}: the call has an id", bool(slot["id"]), slot)
        # The arguments stream as the model writes them, not whole at the end.
        check(f"{name}: the arguments come in pieces", slot["pieces"] > 1, slot)
        valid_call(name, slot["name"], slot["arguments"], allowed)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    check(f"{name}: the call not streamed", [(c.function.name, c.function.arguments) for c in whole] == [(s["name"], s["arguments"]) for s in calls.values()], (whole, calls))
    return calls


def pydantic_model(name, stream):
    """A call of a Pydantic model's tool parses back into the model."""
    if stream:
        calls = streamed(name, ASK_SHIP, named("ship"), ["ship"], tools=[SHIP, WEATHER])
        arguments = [c["arguments"] for c in calls.values()]
    else:
        r = non_streamed(name, ASK_SHIP, named("ship"), ["ship"], tools=[SHIP, WEATHER])
        arguments = [c.function.arguments for c in r.choices[0].message.tool_calls or []]
    for a in arguments:
        try:
            Shipment.model_validate_json(a)
            check(f"{name}: the arguments are a Shipment", True)
        except pydantic.ValidationError as e:
            check(f"{name}: the arguments are a Shipment", False, f"{a!r}: {e}")


def round_trip(name, stream):
    """call -> tool result -> final answer, as an agent loop does."""
    first = non_streamed(f"{name} call", ASK_WEATHER, named("get_weather"), ["get_weather"])
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = ASK_WEATHER + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})},
    ]
    kwargs = dict(model=model, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=48)
    if stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                text += c.delta.content or ""
                check(f"{name}: no call under tool_choice none", not c.delta.tool_calls, c.delta)
                finish = c.finish_reason or finish
    else:
        r = client.chat.completions.create(**kwargs)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        check(f"{name}: no call under tool_choice none", not r.choices[0].message.tool_calls, r)
    check(f"{name}: a final answer in text", isinstance(text, str) and text.strip() != "", repr(text))
    check(f"{name}: it ends as text does", finish in ("stop", "length"), finish)


def auto(name, messages):
    """Under `auto` the answer is text, or calls that validate."""
    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=64,
    )
    c = r.choices[0]
    if c.message.tool_calls:
        check(f"{name}: calls end with tool_calls", c.finish_reason == "tool_calls", c.finish_reason)
        for call in c.message.tool_calls:
            valid_call(name, call.function.name, call.function.arguments, list(SCHEMAS))
    else:
        text = c.message.content or ""
        check(f"{name}: text that is not a call", not text.lstrip().startswith("{"), text)


def cut_short(name):
    """A call cut short by max_tokens is still a call: its arguments are
    what was written (a proper prefix of the whole call's), finish_reason
    `length`, streamed or not."""
    kwargs = dict(model=model, messages=ASK_WEATHER, tools=TOOLS,
                  tool_choice=named("get_weather"), temperature=0)
    whole = client.chat.completions.create(max_tokens=96, **kwargs)
    arguments = whole.choices[0].message.tool_calls[0].function.arguments
    # Five tokens before the end: inside the call's closing or arguments.
    cut = max(1, whole.usage.completion_tokens - 5)
    c = client.chat.completions.create(max_tokens=cut, **kwargs).choices[0]
    calls = c.message.tool_calls or []
    check(f"{name}: finish_reason length", c.finish_reason == "length", c.finish_reason)
    check(f"{name}: a call, its arguments begun", len(calls) == 1 and calls[0].function.name == "get_weather"
          and arguments.startswith(calls[0].function.arguments) and calls[0].function.arguments != arguments,
          (calls, arguments))
    streamed_args, finish = "", None
    for chunk in client.chat.completions.create(max_tokens=cut, stream=True, **kwargs):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                streamed_args += d.function.arguments or ""
            finish = ch.finish_reason or finish
    check(f"{name}: streamed alike", finish == "length" and calls and streamed_args == calls[0].function.arguments,
          (finish, streamed_args))


def call_logprobs(name):
    """Streamed with logprobs, a call's chunks carry every token's entry
    once, in order: the same tokens the answer not streamed lists."""
    kwargs = dict(model=model, messages=ASK_WEATHER, tools=TOOLS, tool_choice=named("get_weather"),
                  temperature=0, max_tokens=96, logprobs=True)
    whole = client.chat.completions.create(**kwargs)
    want = [lp.token for lp in whole.choices[0].logprobs.content]
    tokens, arguments = [], ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            tokens += [lp.token for lp in (c.logprobs.content or [] if c.logprobs else [])]
            arguments += "".join(d.function.arguments or "" for d in c.delta.tool_calls or [])
    check(f"{name}: every token's entry, in order", tokens == want and len(want) == whole.usage.completion_tokens,
          (tokens, want))
    check(f"{name}: the same call", arguments == whole.choices[0].message.tool_calls[0].function.arguments, arguments)


def refused(name, status, **kwargs):
    try:
        client.chat.completions.create(model=model, max_tokens=8, **kwargs)
        check(name, False, "accepted")
    except openai.APIStatusError as e:
        check(name, e.status_code == status, f"{e.status_code} {e.message}")


jobs = [
    lambda: non_streamed("named", ASK_WEATHER, named("get_weather"), ["get_weather"]),
    lambda: non_streamed("named add", ASK_SUM, named("add"), ["add"]),
    lambda: non_streamed("required", ASK_SUM, "required", list(SCHEMAS)),
    # OpenAI's allowed_tools: every tool stays offered, only `add` callable.
    lambda: non_streamed("allowed tools", ASK_WEATHER, ALLOW_ADD, ["add"]),
    lambda: streamed("streamed named", ASK_SUM, named("add"), ["add"]),
    lambda: streamed("streamed required", ASK_WEATHER, "required", list(SCHEMAS)),
    lambda: pydantic_model("pydantic model", stream=False),
    lambda: pydantic_model("streamed pydantic model", stream=True),
    lambda: round_trip("round trip", stream=False),
    lambda: round_trip("streamed round trip", stream=True),
    lambda: cut_short("cut short"),
    lambda: call_logprobs("call logprobs"),
    lambda: auto("auto weather", ASK_WEATHER),
    lambda: auto("auto greeting", [{"role": "user", "content": "Say hello."}]),
    lambda: refused("an unknown named function is a 400", 400, messages=ASK_SUM, tools=TOOLS, tool_choice=named("mul")),
    lambda: refused("tools beside a regex is a 400", 400, messages=ASK_SUM, tools=TOOLS,
                    extra_body={"structured_outputs": {"regex": "[a-z]+"}}),
]
with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
    for f in [pool.submit(j) for j in jobs]:
        try:
            f.result()
        except Exception as e:  # a crash in one job is a failure, not an abort
            check("job raised", False, repr(e))

check.finish()
