"""Structured outputs through the official `openai` client against a running
`host serve` that loads the structured-output plugin.

Usage: structured_client.py BASE_URL API_KEY MODEL EXPECTED_JSON

Every output is checked by an independent judge: JSON against its schema with
the `jsonschema` package (formats included), regex outputs with Python's `re`,
choices by membership, pydantic models by the client's own parsing. Outputs
must end on their own (`finish_reason: "stop"`): the schemas bound every
string, array and number, and each request gets enough `max_tokens`, so a
truncated output counts as a failure rather than being left out. Requests
run concurrently, as the engine batches them. Prints one line per check and
exits non-zero if any failed.
"""

import concurrent.futures
import datetime
import json
import pathlib
import re
import sys

import jsonschema
import openai
import pydantic

from judge import Checks

base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
check = Checks()

# Enough for every schema of the corpus, whose strings, arrays and numbers
# are all bounded; whitespace between tokens is the only slack.
MAX_TOKENS = 256
CORPUS = json.loads((pathlib.Path(__file__).parent / "structured_schemas.json").read_text())
REGEX = r"(Paris|London|Rome) is [0-9]{1,4} km away\."
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/\n'

formats = jsonschema.FormatChecker()


@formats.checks("date-time", raises=ValueError)
def _date_time(value):
    # jsonschema checks date-time only with an optional package; RFC 3339
    # through the standard library instead.
    if not isinstance(value, str):
        return True
    if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", value, re.IGNORECASE):
        raise ValueError(value)
    datetime.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    return True



def schema_errors(schema, text):
    """Why `text` is not a JSON document valid under `schema` (empty if it is)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return [f"not JSON: {e}"]
    validator = jsonschema.Draft202012Validator(schema, format_checker=formats)
    return [e.message for e in validator.iter_errors(value)]


def chat(messages, stream=False, **kwargs):
    """Chat text and finish reason, streamed or not."""
    args = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS} | kwargs
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    parts, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(parts), finish


def complete(prompt, stream=False, **kwargs):
    """Completion text and finish reason, streamed or not."""
    args = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS} | kwargs
    if not stream:
        r = client.completions.create(**args)
        return r.choices[0].text, r.choices[0].finish_reason
    parts, finish = [], None
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            parts.append(c.text)
            finish = c.finish_reason or finish
    return "".join(parts), finish


def corpus_request(i, entry, temperature):
    """One corpus schema, by turns through response_format on chat,
    structured_outputs on chat, and structured_outputs on completions."""
    sampling = {"temperature": temperature, "seed": i}
    ask = f"{entry['ask']} Answer in JSON."
    so = {"structured_outputs": {"json": entry["schema"]}}
    if i % 3 == 0:
        fmt = {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}}
        return chat([{"role": "user", "content": ask}], response_format=fmt, **sampling)
    if i % 3 == 1:
        return chat([{"role": "user", "content": ask}], extra_body=so, **sampling)
    return complete(f"Question: {ask}\nAnswer: ", extra_body=so, **sampling)


def text_checks():
    """(name, request, judge) for regex, choice, grammar and json_object,
    on both endpoints, streamed and not."""
    out = []
    for stream in (False, True):
        for endpoint, run, prompt in (
            ("completions", complete, "Q: How far away is the city?\nA: "),
            ("chat", chat, [{"role": "user", "content": "How far away is the city?"}]),
        ):
            tag = f"{endpoint}{' stream' if stream else ''}"
            for kind, constraint, judge in (
                ("regex", {"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
                ("choice", {"choice": CHOICES}, lambda t: t in CHOICES),
            ):
                request = (run, prompt, {"stream": stream, "temperature": 0.8, "seed": 3,
                                         "extra_body": {"structured_outputs": constraint}})
                out.append((f"{tag} {kind}", request, judge))
    grammar = {"structured_outputs": {"grammar": GRAMMAR}}
    out.append(("chat grammar", (chat, [{"role": "user", "content": "What is 6 times 7?"}],
                                 {"temperature": 0, "extra_body": grammar}),
                lambda t: re.fullmatch(r"The answer is [0-9]{1,3}\.", t) is not None))
    # Any JSON object: nothing bounds its strings, so the prompt asks for a
    # short one (greedy, it ends well within MAX_TOKENS).
    point = "Give the coordinates of a point as a JSON object with keys x and y."
    is_object = lambda t: isinstance(json.loads(t), dict)
    out.append(("chat json_object", (chat, [{"role": "user", "content": point}],
                                     {"temperature": 0, "response_format": {"type": "json_object"}}),
                is_object))
    out.append(("completions json_object", (complete, f"Question: {point}\nAnswer: ",
                                            {"temperature": 0, "extra_body": {"structured_outputs": {"json_object": True}}}),
                is_object))
    return out


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=50_000_000)
    capital: bool


def parse_city():
    """`beta.chat.completions.parse` with a pydantic model, greedy."""
    parse = client.beta.chat.completions.parse
    return parse(model=model, messages=[{"role": "user", "content": "Describe Paris in JSON."}],
                 response_format=City, temperature=0, max_tokens=MAX_TOKENS)


def responses_person():
    """/v1/responses with text.format json_schema."""
    schema = CORPUS[0]["schema"]
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    r = client.responses.create(model=model, input="Describe a person in JSON.", temperature=0,
                                max_output_tokens=MAX_TOKENS, text={"format": fmt})
    return r, schema


with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
    corpus = [(entry, t, pool.submit(corpus_request, i, entry, t))
              for i, entry in enumerate(CORPUS) for t in (0.0, 0.8)]
    texts = [(name, judge, pool.submit(run, prompt, **kw)) for name, (run, prompt, kw), judge in text_checks()]
    city = pool.submit(parse_city)
    person = pool.submit(responses_person)

    for entry, temperature, future in corpus:
        text, finish = future.result()
        errors = schema_errors(entry["schema"], text)
        check(f"schema {entry['name']} at temperature {temperature}", finish == "stop" and not errors,
              (finish, errors, text))
    for name, judge, future in texts:
        text, finish = future.result()
        try:
            ok = judge(text)
        except ValueError:
            ok = False
        check(name, finish == "stop" and ok, (finish, text))

    r = city.result()
    message = r.choices[0].message
    check("parse pydantic", isinstance(message.parsed, City), message)
    check("parse validates", not schema_errors(City.model_json_schema(), message.content), message.content)

    r, schema = person.result()
    check("responses text.format", r.status == "completed" and not schema_errors(schema, r.output_text),
          (r.status, r.output_text))
    check("responses echoes text.format", r.text.format.type == "json_schema", r.text)

# A constraint that does not compile is a 400 before anything runs, naming
# the plugin and the problem, blaming the field that carried it.
broken_schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
for name, kwargs, param in (
    ("bad $ref", {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "b", "schema": broken_schema}}}, "response_format"),
    ("bad regex", {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
    ("bad grammar", {"extra_body": {"structured_outputs": {"grammar": "start: undefined_rule"}}},
     "structured_outputs"),
):
    try:
        chat([{"role": "user", "content": "x"}], **kwargs)
        check(name, False, "no error")
    except openai.BadRequestError as e:
        check(name, e.status_code == 400 and e.param == param and "structured-output" in e.message,
              (e.status_code, e.param, e.message))

check.finish()
