"""Concurrent streaming completions through the official `openai` client
(AsyncOpenAI), optionally SIGKILLing the engine-core process once every
stream is under way.

Usage: recovery_client.py BASE_URL MODEL SPEC_JSON

SPEC_JSON: {"prompts": [...], "max_tokens": N, "kill_pid": PID or null,
"timeout_s": S}. Every prompt is streamed at once (greedy, `ignore_eos`).
With `kill_pid`, that process gets SIGKILL as soon as every stream has
received a chunk, so the kill lands while all of them are mid-decode.

Prints one JSON object and exits 0 whatever the streams did: the Rust test
(tests/recovery_engine_core.rs) judges them against an undisturbed run. Per
stream: the text, the finish reason, the chunks received before the kill and
in all, and the error the stream ended with, if any; and whether the kill was
sent, and when (Unix time). Every wait is bounded by `timeout_s`.
"""

import asyncio
import json
import os
import signal
import sys
import time

import openai

base_url, model, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
timeout_s = float(spec["timeout_s"])
# No retries: a retried request would hide the very failure under test.
client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)


async def one(prompt, state):
    out = {"text": "", "finish_reason": None, "chunks": 0, "chunks_before_kill": None, "error": None}
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=spec["max_tokens"], temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            out["text"] += choice.text
            out["chunks"] += 1
            if choice.finish_reason is not None:
                out["finish_reason"] = choice.finish_reason
            if not state["killed"]:
                out["chunks_before_kill"] = out["chunks"]
            if out["chunks"] == 1:
                state["started"] += 1
                if state["started"] == len(spec["prompts"]):
                    state["all_started"].set()
    except Exception as e:  # reported: the test asserts on it
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        # A stream that ended before its first chunk: the kill cannot land
        # as asked, so stop waiting for the others (the test fails on it).
        if out["chunks"] == 0:
            state["all_started"].set()
    return out


async def main():
    state = {"all_started": asyncio.Event(), "started": 0, "killed": False}
    tasks = [asyncio.create_task(one(p, state)) for p in spec["prompts"]]
    report = {"killed": False, "killed_at": None, "kill_error": None}
    if spec.get("kill_pid"):
        try:
            await asyncio.wait_for(state["all_started"].wait(), timeout_s)
            if state["started"] < len(spec["prompts"]):
                raise RuntimeError("a stream ended before every stream had a chunk")
            os.kill(int(spec["kill_pid"]), signal.SIGKILL)
            state["killed"] = report["killed"] = True
            report["killed_at"] = time.time()
        except Exception as e:  # reported: the test fails on it
            report["kill_error"] = f"{type(e).__name__}: {e}"
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    report["streams"] = [
        t.result() if t in done else {"error": f"no end within {timeout_s} s"} for t in tasks
    ]
    print(json.dumps(report))


asyncio.run(main())
