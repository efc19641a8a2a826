"""The official `openai` client sending a predicted output to `host serve`
started with speculative decoding.

Usage: prediction_client.py BASE_URL API_KEY MODEL EXPECTED_JSON

EXPECTED_JSON holds {"question", "code", "answer", "max_tokens"}: the answer
is the offline engine's greedy one, computed without a prediction. Prints
one line per check and exits non-zero if any failed.
"""

import json
import sys

import openai

from judge import Checks

base_url, api_key, model, expected = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
check = Checks()

r = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": expected["question"]}],
    max_tokens=expected["max_tokens"],
    temperature=0,
    prediction={"type": "content", "content": expected["code"]},
)
check("answer", r.choices[0].message.content == expected["answer"], r.choices[0].message.content)
details = r.usage.completion_tokens_details
check("details parsed", details is not None, r.usage)
if details is not None:
    check("kept", details.accepted_prediction_tokens > 0, details)
    check("not kept parsed", isinstance(details.rejected_prediction_tokens, int), details)

try:
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        prediction={"type": "content", "content": 7},
    )
    check("bad prediction", False, "no error")
except openai.BadRequestError as e:
    check("bad prediction", e.status_code == 400 and "prediction.content" in str(e), e)

check.finish()
