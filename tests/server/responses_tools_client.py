"""Function tools on the Responses API through the official `openai` client
and the OpenAI Agents SDK, against a running `host serve` that loads the
structured-output plugin.

Usage: responses_tools_client.py BASE_URL API_KEY MODEL EXPECTED_JSON

The judge is independent of the server: every call's arguments are
validated against the function's own schema with `jsonschema`; each
Responses conversation (flat tools, `function_call` and
`function_call_output` items, `previous_response_id`) is sent to
/v1/chat/completions too, in chat's own shapes (nested tools, an assistant
message's `tool_calls`, a `tool` message), and the greedy answers must be
the same; the Agents SDK runs its own loop and executes its tool with the
arguments the model wrote. Prints one line per check and exits non-zero
if any failed.
"""

import asyncio
import json
import sys
from typing import Literal

import jsonschema
import openai
import pydantic
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

import judge
from judge import Checks

base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
check = Checks()

# Strict as the Agents SDK sends its tools (every call is strict here).
WEATHER = {**judge.WEATHER, "strict": True}
ADD = {**judge.ADD, "strict": True}
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, ADD)}
# The same functions as each API writes them.
RESPONSES_TOOLS = [{"type": "function", **f} for f in (WEATHER, ADD)]
CHAT_TOOLS = [{"type": "function", "function": f} for f in (WEATHER, ADD)]

INSTRUCTIONS = "You are a helpful assistant."
QUESTION = "What is the weather in Paris, in celsius?"
RESULT = "18 degrees and sunny"
greedy = {"model": model, "temperature": 0}


def valid(name, arguments):
    try:
        jsonschema.validate(arguments, SCHEMAS[name])
        return True
    except (jsonschema.ValidationError, KeyError):
        return False


def responses_answer(r):
    """(text, [(name, arguments)]) of a response object."""
    calls = [(i.name, json.loads(i.arguments)) for i in r.output if i.type == "function_call"]
    return r.output_text, calls


def chat_answer(c):
    m = c.choices[0].message
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
    return m.content or "", calls


def respond(**kwargs):
    return client.responses.create(
        **{"instructions": INSTRUCTIONS, "tools": RESPONSES_TOOLS, "max_output_tokens": 64, **greedy, **kwargs}
    )


def chat(messages, **kwargs):
    messages = [{"role": "system", "content": INSTRUCTIONS}, *messages]
    return client.chat.completions.create(messages=messages, tools=CHAT_TOOLS, max_tokens=64, **greedy, **kwargs)


# A named function: one function_call item, as chat calls it.
named = respond(input=QUESTION, tool_choice={"type": "function", "name": "get_weather"})
text, calls = responses_answer(named)
item = named.output[0]
check("named: one function_call item", len(named.output) == 1 and item.type == "function_call" and item.name == "get_weather", named.output)
check("named: completed, no text", named.status == "completed" and text == "", (named.status, text))
check("named: arguments follow the schema", valid(*calls[0]), calls)
check("named: ids", item.call_id.startswith("call_") and item.id.startswith("fc_") and item.status == "completed", item)
check("named: echo", named.tool_choice.type == "function" and [t.name for t in named.tools] == ["get_weather", "add"], named)
want = chat_answer(chat([{"role": "user", "content": QUESTION}], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
check("named: the call chat makes", (text, calls) == want, ((text, calls), want))

# Streamed: the call's events, its arguments adding up; the same call as
# not streamed and as chat.
asked = {"input": QUESTION, "tool_choice": "required", "parallel_tool_calls": False}
events = list(respond(stream=True, **asked))
types = [e.type for e in events]
# The arguments stream as the model writes them: several deltas.
arg_deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
check("stream: events", len(arg_deltas) > 1 and types == [
    "response.created", "response.in_progress", "response.output_item.added",
    *["response.function_call_arguments.delta"] * len(arg_deltas),
    "response.function_call_arguments.done", "response.output_item.done", "response.completed",
], types)
check("stream: sequence numbers", [e.sequence_number for e in events] == list(range(len(events))), events)
final = events[-1].response
deltas = "".join(e.delta for e in arg_deltas)
added, done, item_done = events[2], events[-3], events[-2]
check("stream: arguments add up", deltas == done.arguments == final.output[0].arguments and done.name == final.output[0].name, (deltas, done, final.output))
ids = {added.item.id, done.item_id, item_done.item.id, final.output[0].id} | {e.item_id for e in arg_deltas}
check("stream: one item id", len(ids) == 1, ids)
check("stream: item opens empty and closes whole", added.item.arguments == "" and added.item.name == done.name and item_done.item.arguments == deltas and item_done.item.status == "completed", (added.item, item_done.item))
plain = respond(**asked)
check("stream: the call not streamed", responses_answer(final) == responses_answer(plain), (final.output, plain.output))
want = chat_answer(chat([{"role": "user", "content": QUESTION}], tool_choice="required", parallel_tool_calls=False))
check("required: the call chat makes", responses_answer(plain) == want and valid(*want[1][0]), (plain.output, want))

# Cut short by max_output_tokens (five tokens before the end): the call
# keeps what was written, its item incomplete, streamed or not.
short_asked = {**asked, "max_output_tokens": max(1, plain.usage.output_tokens - 5)}
short = respond(**short_asked)
whole_args = plain.output[0].arguments
short_item = short.output[0] if short.output else None
check("cut short: an incomplete call, its arguments begun", short.status == "incomplete" and short_item is not None
      and short_item.type == "function_call" and short_item.status == "incomplete"
      and whole_args.startswith(short_item.arguments) and short_item.arguments != whole_args, short.output)
short_events = list(respond(stream=True, **short_asked))
short_args = "".join(e.delta for e in short_events if e.type == "response.function_call_arguments.delta")
short_done = [e.item for e in short_events if e.type == "response.output_item.done"]
check("cut short: streamed alike", short_item is not None and short_args == short_item.arguments
      and [i.status for i in short_done] == ["incomplete"] and short_events[-1].type == "response.incomplete",
      (short_args, short_done, short_events[-1].type))

# The call's result, then the answer: the same as chat's with the
# assistant's tool_calls and a tool message.
call = {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
output = {"type": "function_call_output", "call_id": item.call_id, "output": RESULT}
conversation = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "tool_calls": [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}]},
    {"role": "tool", "tool_call_id": item.call_id, "content": RESULT},
]
after = respond(input=[{"role": "user", "content": QUESTION}, call, output])
want = chat_answer(chat(conversation))
check("result: the answer chat gives", responses_answer(after) == want, (responses_answer(after), want))
check("result: an answer", after.status in ("completed", "incomplete") and (after.output_text or responses_answer(after)[1]), after)
# Under `none` the answer is text (the tools undescribed, the call and its
# result still in the conversation).
text_after = respond(input=[{"role": "user", "content": QUESTION}, call, output], tool_choice="none")
want_text = chat_answer(chat(conversation, tool_choice="none"))
check("result under none: the text chat gives", text_after.output_text and responses_answer(text_after) == want_text, (responses_answer(text_after), want_text))
# The items as the client returns them (ids, status) are taken back as is.
echoed = respond(input=[{"role": "user", "content": QUESTION}, item.model_dump(), output])
check("result: output items taken back as input", responses_answer(echoed) == want, (responses_answer(echoed), want))
# Continued from the stored call: only the output is sent.
cont = respond(input=[output], previous_response_id=named.id)
check("previous_response_id: the answer of the whole conversation", responses_answer(cont) == want, (responses_answer(cont), want))

# allowed_tools in the Responses API's flat shape: only `add` is callable.
allowed = respond(input=QUESTION, parallel_tool_calls=False, tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "add"}]})
text, calls = responses_answer(allowed)
check("allowed_tools: only add is called", calls and all(n == "add" and valid(n, a) for n, a in calls), allowed.output)

# A JSON format beside tools under auto: a text answer follows the format,
# a call its function's schema; chat's response_format the same. One
# question gets each (greedy), so both branches of the grammar are seen.
REPORT = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "temperature": {"type": "integer"}},
    "required": ["city", "temperature"],
    "additionalProperties": False,
}
report_format = {"type": "json_schema", "name": "report", "schema": REPORT, "strict": True}


def a_report(text):
    try:
        jsonschema.validate(json.loads(text), REPORT)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


kinds = set()
for question in [QUESTION, "Tell me about London."]:
    asked = {"input": question, "parallel_tool_calls": False, "text": {"format": report_format},
             "include": ["message.output_text.logprobs"]}
    r = respond(**asked)
    text, calls = responses_answer(r)
    name = f"format beside tools ({question})"
    check(f"{name}: a report or a call", (not calls and a_report(text)) or (calls and not text and all(valid(*c) for c in calls)), r.output)
    kinds.add("call" if calls else "report")
    chat_format = {"type": "json_schema", "json_schema": {k: v for k, v in report_format.items() if k != "type"}}
    want = chat_answer(chat([{"role": "user", "content": question}], parallel_tool_calls=False, response_format=chat_format))
    check(f"{name}: the answer chat gives", (text, calls) == want, ((text, calls), want))
    events = list(respond(stream=True, **asked))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    streamed = responses_answer(events[-1].response)
    # A report streams as text, a call's arguments as they are written.
    arg_deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    pieces = arg_deltas if calls else deltas
    check(f"{name}: streamed", streamed == (text, calls) and "".join(deltas) == text and len(pieces) > 1, (streamed, deltas, arg_deltas))
    if not calls:
        # Every token's logprobs stream with its text, those of the text
        # held back while the report might still have opened a call too.
        tokens = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
        done = [[lp.token for lp in e.logprobs] for e in events if e.type == "response.output_text.done"]
        check(f"{name}: each token's logprobs streamed", done == [tokens] and "".join(tokens).startswith(text)
              and len(tokens) == events[-1].response.usage.output_tokens, (tokens, done, text))
        content, tokens = "", []
        for chunk in chat([{"role": "user", "content": question}], parallel_tool_calls=False,
                          response_format=chat_format, stream=True, logprobs=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                tokens += [lp.token for lp in (c.logprobs.content or [] if c.logprobs else [])]
        check(f"{name}: chat streams each token's logprobs", content == text and "".join(tokens).startswith(text)
              and len(tokens) == len(done[0] if done else []), (content, tokens))
check("format beside tools: both a report and a call", kinds == {"report", "call"}, kinds)

# Shapes refused, naming the field.
for name, kwargs, param in [
    ("chat's nested tool", {"tools": CHAT_TOOLS}, "tools[0].name"),
    ("hosted tool", {"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ("unknown named function", {"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ("call without call_id", {"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, "input[0].call_id"),
    ("arguments not JSON", {"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "{"}]}, "input[0].arguments"),
]:
    args = {"input": QUESTION, "instructions": INSTRUCTIONS, "tools": RESPONSES_TOOLS, "max_output_tokens": 8, **greedy} | kwargs
    try:
        client.responses.create(**args)
        check(name, False, "no error")
    except openai.BadRequestError as e:
        check(name, e.status_code == 400 and e.param == param, (e.status_code, e.param, e.message))

# The OpenAI Agents SDK: its loop calls the tool with the arguments the
# model wrote and, stopping on the first tool, answers with its result.
set_tracing_disabled(True)
ran = []


@function_tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    ran.append({"city": city, "unit": unit})
    return f"18 degrees {unit} in {city}"


agent = Agent(
    name="weather",
    instructions=INSTRUCTIONS,
    tools=[get_weather],
    model=OpenAIResponsesModel(model, openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)),
    model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64, parallel_tool_calls=False),
    tool_use_behavior="stop_on_first_tool",
)


class Report(pydantic.BaseModel):
    city: str
    temperature: int


# An output type beside the tools (text.format and tools in one request):
# the first turn calls the tool, whose result then stands as the answer.
reporter = agent.clone(output_type=Report)


async def run_agent():
    result = await Runner.run(agent, QUESTION, max_turns=2)
    streamed = Runner.run_streamed(agent, QUESTION, max_turns=2)
    kinds = [event.type async for event in streamed.stream_events()]
    reported = await Runner.run(reporter, QUESTION, max_turns=2)
    return result, streamed, kinds, reported


result, streamed, kinds, reported = asyncio.run(run_agent())
check("agents: the tool ran once a run", len(ran) == 3, ran)
args = ran[0] if ran else {}
check("agents: its arguments follow its schema", set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit") and 0 < len(args["city"]) <= 40, ran)
check("agents: the answer is the tool's result", result.final_output == f"18 degrees {args.get('unit')} in {args.get('city')}", result.final_output)
check("agents: streamed, the same call and answer", ran[1:2] == ran[:1] and streamed.final_output == result.final_output and "raw_response_event" in kinds, (ran, streamed.final_output, kinds[:5]))
check("agents: with an output type, the tool ran", len(ran) == 3 and reported.final_output == f"18 degrees {ran[2]['unit']} in {ran[2]['city']}", (ran, reported.final_output))

check.finish()
