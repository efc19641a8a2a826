"""logit_bias, allowed_token_ids and bad_words through the official `openai`
client against a running `host serve`.

Usage: logit_bias_client.py BASE_URL API_KEY MODEL EXPECTED_JSON

EXPECTED_JSON holds {"vocab_size"}, read by the Rust test from the model
file's own tokenizer. Every other expectation comes from this server's
unconstrained greedy answer to the same prompt, taken first: the token
greedy picks, the runner-up in the raw logprobs, a word the answer writes.

Tokens are compared by their text as the logprobs show it (one token's
decoded text) after checking, through /tokenize and /detokenize, that the
token in question is exactly one id whose text maps back to it: a byte-level
vocabulary holds each byte string once, so another text is another id.
Prints one line per check and exits non-zero on the first failure.
"""

import json
import sys
import urllib.request

import openai

base_url, api_key, model, expected = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
root = base_url.removesuffix("/v1")
vocab_size = expected["vocab_size"]
checks = 0


def check(name, ok, detail=""):
    global checks
    if not ok:
        sys.exit(f"FAIL {name}: {detail}")
    checks += 1
    print(f"ok {name}")


def post(path, body):
    request = urllib.request.Request(
        root + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.load(r)


def ids_of(text):
    return post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]


def token_id(text):
    """The id of the one token whose text is `text`."""
    ids = ids_of(text)
    check(f"{text!r} is one token", len(ids) == 1, ids)
    back = post("/detokenize", {"tokens": ids})["prompt"]
    check(f"{text!r} round-trips", back == text, back)
    return ids[0]


def ranked(top):
    """A position's top logprobs, most likely first."""
    return sorted(top, key=top.get, reverse=True)


PROMPT = "The capital of France is"


def complete(max_tokens=16, **kwargs):
    """Greedy (unless kwargs say otherwise) completion tokens and top logprobs."""
    args = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 5}
    r = client.completions.create(**(args | kwargs))
    lp = r.choices[0].logprobs
    return lp.tokens, lp.top_logprobs


# The unconstrained greedy answer: what every constraint below is measured against.
tokens, tops = complete()
first = tokens[0]
check("greedy takes the raw argmax", ranked(tops[0])[0] == first, (first, tops[0]))
first_id = token_id(first)
runner_up, least = ranked(tops[0])[1], ranked(tops[0])[-1]

# logit_bias -100 on greedy's first token: the answer differs at once, takes
# the runner-up, and never holds that token; the logprobs stay the raw model
# output's (vLLM's default), where it is still the most likely.
banned, banned_tops = complete(logit_bias={str(first_id): -100})
check("-100: the first token differs", banned[0] != first, banned)
check("-100: the runner-up is taken", banned[0] == runner_up, (banned[0], runner_up))
check("-100: the token never appears", first not in banned, banned)
check("-100: the logprobs are the raw output's", ranked(banned_tops[0])[0] == first, banned_tops[0])

# logit_bias +100 on the least likely of the top five: greedy picks it, at
# every step.
least_id = token_id(least)
forced, _ = complete(logit_bias={str(least_id): 100})
check("+100: greedy picks the token", forced[0] == least, (forced[0], least))
check("+100: at every step", forced == [least] * len(forced), forced)

# allowed_token_ids: greedy takes the most likely allowed token; a random
# draw never leaves the set.
dot = "."
allowed_texts = {runner_up, least, dot}
allowed = [token_id(runner_up), least_id, token_id(dot)]
only, _ = complete(extra_body={"allowed_token_ids": allowed})
check("allowed: greedy takes the best allowed", only[0] == runner_up, only)
check("allowed: every greedy token is allowed", set(only) <= allowed_texts, only)
drawn, _ = complete(max_tokens=24, temperature=1.0, seed=11, extra_body={"allowed_token_ids": allowed})
check("allowed: every drawn token is allowed", set(drawn) <= allowed_texts, drawn)
check("allowed: the draw used more than one", len(set(drawn)) > 1, drawn)

# bad_words, one token: greedy's first token, as a word (vLLM bans it with
# and without its leading space).
word = first.strip()
check("the unconstrained answer writes the word", first in tokens and word.isalpha(), tokens)
spellings = {first, word}
clean, _ = complete(extra_body={"bad_words": [word]})
check("bad word: never written", not spellings & set(clean), clean)
check("bad word: the first token differs", clean[0] != first, clean)

# bad_words, two tokens: a two-word phrase of the unconstrained answer. Only
# the last token is banned, and only after the first: the answer is the
# unconstrained one up to the phrase's first word, then turns away.
pairs = [
    (i, a, b)
    for i, (a, b) in enumerate(zip(tokens, tokens[1:]))
    if a.startswith(" ") and a[1:].isalpha() and b.startswith(" ") and b[1:].isalpha()
]
check("the unconstrained answer has a two-word phrase", pairs, tokens)
i, a, b = pairs[0]
phrase = (a + b).strip()
check("the phrase tokenizes as written", ids_of(" " + phrase) == [token_id(a), token_id(b)], phrase)
turned, _ = complete(extra_body={"bad_words": [phrase]})
check("two-token bad word: same answer up to its first word", turned[: i + 1] == tokens[: i + 1], (turned, tokens))
check("two-token bad word: its last token is not taken there", turned[i + 1] != b, turned)
check(
    "two-token bad word: never written",
    all((x, y) != (a, b) for x, y in zip(turned, turned[1:])),
    turned,
)

# Chat, and streamed: the same ban on the chat endpoint's greedy first token.
messages = [{"role": "user", "content": "What is the capital of France?"}]
r = client.chat.completions.create(
    model=model, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
)
content = r.choices[0].logprobs.content
chat_first = content[0].token
chat_runner_up = content[0].top_logprobs[1].token
chat_id = token_id(chat_first)
stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=12, temperature=0, logprobs=True, stream=True,
    logit_bias={str(chat_id): -100},
)
streamed = [t.token for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
check("chat -100: the runner-up is taken", streamed[0] == chat_runner_up, (streamed, chat_runner_up))
check("chat -100: the token never appears", chat_first not in streamed, streamed)

# Bad values are 400s naming the field.
too_many = {str(t): 1 for t in range(301)}
for name, kwargs, param, says in [
    ("bias 101", {"logit_bias": {str(first_id): 101}}, "logit_bias", "[-100, 100]"),
    ("bias -100.5", {"logit_bias": {str(first_id): -100.5}}, "logit_bias", "[-100, 100]"),
    ("non-integer key", {"logit_bias": {"Paris": 1}}, "logit_bias", "not a token id"),
    ("key 1.5", {"logit_bias": {"1.5": 1}}, "logit_bias", "not a token id"),
    (
        "bias id past the vocabulary",
        {"logit_bias": {str(vocab_size + 3): 1}},
        "logit_bias",
        f"vocabulary size {vocab_size}, got {vocab_size + 3}",
    ),
    ("too many biases", {"logit_bias": too_many}, "logit_bias", "max_logit_bias"),
    (
        "allowed id past the vocabulary",
        {"extra_body": {"allowed_token_ids": [1, vocab_size]}},
        "allowed_token_ids",
        f"vocabulary size {vocab_size}, got {vocab_size}",
    ),
    ("no allowed ids", {"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids", "non-empty"),
    ("empty bad word", {"extra_body": {"bad_words": ["Paris", " "]}}, "bad_words[1]", "empty"),
    ("too many bad words", {"extra_body": {"bad_words": ["w"] * 65}}, "bad_words", "at most 64"),
]:
    try:
        complete(**kwargs)
        check(name, False, "no error")
    except openai.BadRequestError as e:
        check(name, e.status_code == 400 and e.param == param and says in e.message, (e.param, e.message))
try:
    client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, logit_bias={str(chat_id): 101}
    )
    check("chat bias 101", False, "no error")
except openai.BadRequestError as e:
    check("chat bias 101", e.status_code == 400 and e.param == "logit_bias", (e.param, e.message))

print(f"{checks} passed, 0 failed")
