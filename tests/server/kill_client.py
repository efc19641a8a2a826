"""Concurrent streaming completions through the official `openai` client,
optionally SIGKILLing one process (a worker, the engine-core process) once
every stream is under way; tests/recovery.rs, tests/recovery_engine_core.rs
and scripts/bench-recovery.sh drive it through tests/server/kill.rs.

Usage: kill_client.py BASE_URL MODEL SPEC_JSON

SPEC_JSON: {"prompts": [...], "max_tokens": N, "kill_pid": PID or null,
"timeout_s": S}. Every prompt is streamed at once (greedy, `ignore_eos`, usage
in a last chunk). With `kill_pid`, the process is sent SIGKILL as soon as
every stream has received a chunk, so the kill lands mid-decode of all of them.

Prints one JSON object on stdout and exits 0 whatever the streams did: the
caller judges them against an undisturbed run. Per stream: the text, the
finish reason, the usage's completion tokens, the content chunks and their
arrival times (wall clock, to set beside the server's log timestamps), how
many chunks came before the kill, and the error the stream ended with, if
any. Also when the requests were sent and the kill's wall-clock time. Every wait is bounded by `timeout_s`.
"""

import asyncio
import json
import os
import signal
import sys
import time

import openai

base_url, model, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
timeout_s = float(spec.get("timeout_s", 120))
# No retries: a retried request would hide exactly the failure under test.
client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)


async def one(prompt, started, state):
    out = {"text": "", "finish_reason": None, "usage_completion_tokens": None,
           "chunks": 0, "chunk_times": [], "chunks_before_kill": None, "error": None}
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=spec["max_tokens"], temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                out["usage_completion_tokens"] = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            out["text"] += choice.text
            out["chunks"] += 1
            out["chunk_times"].append(time.time())
            if choice.finish_reason is not None:
                out["finish_reason"] = choice.finish_reason
            if out["chunks"] == 1:
                started.add(prompt)
                if len(started) == len(spec["prompts"]):
                    state["all_started"].set()
            if state["killed_at"] is None:
                out["chunks_before_kill"] = out["chunks"]
    except Exception as e:  # the caller asserts on it; the other streams carry on
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        # A stream that ended before every stream started means the kill can
        # no longer land as asked: stop waiting for it (the kill is skipped).
        if prompt not in started:
            state["all_started"].set()
    return out


async def main():
    state = {"all_started": asyncio.Event(), "killed_at": None}
    started = set()
    report = {"started_at": time.time(), "killed_at": None, "kill_error": None}
    tasks = [asyncio.create_task(one(p, started, state)) for p in spec["prompts"]]
    if spec.get("kill_pid"):
        try:
            await asyncio.wait_for(state["all_started"].wait(), timeout_s)
            if len(started) < len(spec["prompts"]):
                raise RuntimeError("a stream ended before every stream had a chunk")
            state["killed_at"] = time.time()
            os.kill(int(spec["kill_pid"]), signal.SIGKILL)
            report["killed_at"] = state["killed_at"]
        except Exception as e:  # reported, and the caller fails the test on it
            report["kill_error"] = f"{type(e).__name__}: {e}"
    # Bounded: a stream that never ends is reported as such, not waited on forever.
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    report["streams"] = [
        t.result() if t in done else {"error": f"no end within {timeout_s} s"} for t in tasks
    ]
    report["finished_at"] = time.time()
    print(json.dumps(report))


asyncio.run(main())
