#!/usr/bin/env python3
"""Load generator for OpenAI-compatible servers (`host serve`, llama-server).

Sends N streaming /v1/completions requests, C at a time, each a prompt of
exactly P random token ids (seeded by its index, so every server gets the same
prompts and no two share a prefix) and max_tokens = M with ignore_eos, at
temperature 0. Measures, per request, the time to the first streamed token
(TTFT) and the gaps between later tokens (ITL), and for the run the output
tokens per second of wall time. Prints a one-line summary and writes JSON.

Standard library only (asyncio streams + a small HTTP/1.1 reader), so the
client costs little CPU beside the server on a 2-core machine.

Usage: bench_serve.py --url http://127.0.0.1:8000 [--label NAME] [--num-requests 64]
       [--concurrency 16] [--prompt-tokens 100] [--max-tokens 128] [--json out.json]
       [--duration SECONDS]   (soak: keep C clients busy this long instead of N requests)
       [--structured-outputs JSON]   (each request constrained by this vLLM
                                      structured_outputs object; EOS is then
                                      the constraint's, not ignored)
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from urllib.parse import urlparse

# Token ids drawn for the prompts: ordinary vocabulary, clear of the special
# tokens at the start of SmolLM2's (and most) vocabularies.
TOKEN_RANGE = (1000, 30000)


def prompt_ids(index, n):
    rng = random.Random(index)
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


async def read_chunked_events(reader):
    """Yields (arrival time, payload) for each SSE `data:` event of a chunked body."""
    buf = b""
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.strip().split(b";")[0] or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        now = time.perf_counter()
        buf += data[:-2]
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield now, line[5:].strip()


async def one_request(url, index, args):
    request = {
        "model": args.model,
        "prompt": prompt_ids(index, args.prompt_tokens),
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.structured_outputs:
        # A constraint decides where EOS may go; ignoring it could leave a
        # complete answer nothing to sample.
        request["structured_outputs"] = json.loads(args.structured_outputs)
        request["ignore_eos"] = False
    body = json.dumps(request).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    status = (await reader.readline()).decode().split(" ")[1]
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    result = {"index": index, "ok": False, "tokens": 0, "ttft": None, "itl": [], "error": None}
    if status != "200" or headers.get("transfer-encoding") != "chunked":
        result["error"] = f"HTTP {status}: {(await reader.read(500)).decode(errors='replace')}"
        writer.close()
        return result
    last = None
    async for now, payload in read_chunked_events(reader):
        if payload == b"[DONE]":
            result["ok"] = True
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            result["error"] = chunk["error"]
            break
        for choice in chunk.get("choices", []):
            if choice.get("text"):
                result["tokens"] += 1
                if last is None:
                    result["ttft"] = now - start
                else:
                    result["itl"].append(now - last)
                last = now
        if chunk.get("usage"):
            # Exact even when a chunk held no text (a partial UTF-8 character).
            result["tokens"] = chunk["usage"]["completion_tokens"]
    result["e2e"] = time.perf_counter() - start
    writer.close()
    return result


def pct(values, p):
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def run(args):
    url = urlparse(args.url)
    results = []
    next_index = 0
    deadline = time.perf_counter() + args.duration if args.duration else None

    def more():
        return next_index < args.num_requests if deadline is None else time.perf_counter() < deadline

    async def client():
        nonlocal next_index
        while more():
            index = next_index
            next_index += 1
            try:
                results.append(await asyncio.wait_for(one_request(url, index, args), args.timeout))
            except Exception as e:  # a hung or refused request is a failure, not a crash
                results.append({"index": index, "ok": False, "tokens": 0, "ttft": None, "itl": [],
                                "error": repr(e)})

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "label": args.label,
        "url": args.url,
        "num_requests": len(results),
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": [r["error"] for r in results if not r["ok"]][:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99), "mean": statistics.fmean(ttft) if ttft else None},
        "itl_s": {"p50": pct(itl, 50), "p99": pct(itl, 99), "mean": statistics.fmean(itl) if itl else None},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--label", default="server")
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--duration", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--json", default=None)
    ap.add_argument("--structured-outputs", default=None, help="a structured_outputs JSON object")
    args = ap.parse_args()
    summary = asyncio.run(run(args))
    ms = lambda s: "-" if s is None else f"{s * 1000:.0f} ms"
    print(
        f"{summary['label']}: {summary['completed']}/{summary['num_requests']} ok, "
        f"{summary['output_tok_s']:.1f} output tok/s, TTFT p50 {ms(summary['ttft_s']['p50'])} "
        f"p99 {ms(summary['ttft_s']['p99'])}, ITL p50 {ms(summary['itl_s']['p50'])} "
        f"p99 {ms(summary['itl_s']['p99'])}",
        file=sys.stderr,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    sys.exit(0 if summary["failed"] == 0 else 1)


if __name__ == "__main__":
    main()
