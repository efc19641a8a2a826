#!/usr/bin/env python3
"""Independent numpy reference of a GGUF llama-family forward pass.

Reads the model with the `gguf` package (GGUFReader, dequantized to float32 by
`gguf.quants.dequantize`) and runs the textbook computation in float32:
token embedding, RMSNorm, RoPE in GGUF's interleaved convention (llama.cpp's
"normal" rope rotates adjacent pairs (2i, 2i+1) by position * theta^(-2i/rope_dim)),
grouped-query attention with a causal mask, SwiGLU MLP, final RMSNorm and the
output projection (the embedding when tied).

It shares no code with the Rust runner, so agreement between the two is
evidence that both implement the model, not the same bug.

Usage:
    llama_ref.py MODEL.gguf [--input FILE | --json TEXT] [--max-tokens N]
    llama_ref.py MODEL.gguf [--input FILE | --json TEXT] --prompt-logprobs K

The input (a file, a JSON argument, or stdin) is either a list of prompts, each
a list of token ids, or {"prompts": [[...], ...], "max_tokens": N}. The output
is JSON: {"results": [{"logits": [...], "tokens": [...], "margins": [...],
"top": [...], "text": "..."}]} where `logits` are the last-position logits of
the prompt, `tokens` the greedy continuation of N tokens, `margins[i]` the gap
between the top-1 and top-2 logits at generation step i, `top[i]` the 8 best
[token, logit] pairs of step i, and `text` the decoded continuation (for
eyeballing). With --prompt-logprobs K it prints instead
{"results": [{"prompt_logprobs": [null, {"token": t, "logprob": x, "rank": r,
"top": [[t, x], ...]}, ...]}]}: vLLM's prompt logprobs of each prompt, from the
logits of every prompt position.
"""

import argparse
import json
import os
import sys

# One BLAS thread: the projections are memory-bound vectors-times-matrix, and
# OpenBLAS's spinning worker threads slow everything down several-fold when
# the cores are shared with other processes (as under `cargo test`).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize  # noqa: E402


def field(reader, key):
    """The scalar or string value of a metadata key."""
    f = reader.fields[key]
    return f.contents()


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character map (byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class Model:
    """Dequantized float32 weights and hyper-parameters of a llama GGUF."""

    def __init__(self, path):
        r = GGUFReader(path)
        arch = field(r, "general.architecture")
        p = arch + "."
        self.n_layers = int(field(r, p + "block_count"))
        self.hidden = int(field(r, p + "embedding_length"))
        self.n_heads = int(field(r, p + "attention.head_count"))
        self.n_kv = int(field(r, p + "attention.head_count_kv"))
        self.head_dim = self.hidden // self.n_heads
        self.rope_dim = int(field(r, p + "rope.dimension_count")) if p + "rope.dimension_count" in r.fields else self.head_dim
        self.theta = float(field(r, p + "rope.freq_base"))
        self.eps = float(field(r, p + "attention.layer_norm_rms_epsilon"))
        self.vocab = [str(t) for t in field(r, "tokenizer.ggml.tokens")]
        w = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32, copy=False) for t in r.tensors}
        self.embed = w["token_embd.weight"]
        # Matrices are stored [out, in]; keep them transposed so x @ W works.
        self.layers = []
        for i in range(self.n_layers):
            b = f"blk.{i}."
            self.layers.append(
                dict(
                    attn_norm=w[b + "attn_norm.weight"],
                    wqkv=np.ascontiguousarray(
                        np.concatenate([w[b + "attn_q.weight"], w[b + "attn_k.weight"], w[b + "attn_v.weight"]]).T
                    ),
                    wo=np.ascontiguousarray(w[b + "attn_output.weight"].T),
                    ffn_norm=w[b + "ffn_norm.weight"],
                    wgu=np.ascontiguousarray(np.concatenate([w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"]]).T),
                    wdown=np.ascontiguousarray(w[b + "ffn_down.weight"].T),
                )
            )
        self.final_norm = w["output_norm.weight"]
        out = w.get("output.weight", self.embed)
        self.out_t = np.ascontiguousarray(out.T)
        inv = self.theta ** (-np.arange(0, self.rope_dim, 2, dtype=np.float64) / self.rope_dim)
        self.inv_freq = inv  # [rope_dim / 2]

    def rms_norm(self, x, weight):
        x64 = x.astype(np.float64)
        scale = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + self.eps)
        return (x64 * scale).astype(np.float32) * weight

    def rope(self, x, positions):
        """Rotate adjacent pairs of the first rope_dim dims of x [T, H, D]."""
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]  # [T, rope_dim/2]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        out = x.copy()
        x0 = x[..., 0 : self.rope_dim : 2]
        x1 = x[..., 1 : self.rope_dim : 2]
        out[..., 0 : self.rope_dim : 2] = x0 * cos - x1 * sin
        out[..., 1 : self.rope_dim : 2] = x0 * sin + x1 * cos
        return out

    def forward(self, batch, all_rows=False):
        """Runs new tokens of several sequences in one pass.

        `batch` is a list of (tokens, cache) where `cache` is a list of (K, V)
        per layer, each [T_past, kv_heads, head_dim], extended in place. The
        projections run over all sequences' tokens at once (one weight read
        per step); attention runs per sequence. Returns the logits of each
        sequence's last new token, [len(batch), vocab], or with `all_rows`
        the logits of every new token of every sequence, [tokens, vocab]."""
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        group = nh // nkv
        spans, positions, masks = [], [], []
        start = 0
        for tokens, cache in batch:
            t = len(tokens)
            past = cache[0][0].shape[0] if cache else 0
            pos = np.arange(past, past + t)
            spans.append((start, start + t))
            positions.append(pos)
            # Causal mask for the new queries over all (past + new) keys.
            masks.append(np.where(np.arange(past + t)[None, :] <= pos[:, None], 0.0, -np.inf).astype(np.float32))
            start += t
        positions = np.concatenate(positions)
        h = self.embed[np.concatenate([np.asarray(tokens) for tokens, _ in batch])]
        n = h.shape[0]
        for li, L in enumerate(self.layers):
            x = self.rms_norm(h, L["attn_norm"])
            qkv = x @ L["wqkv"]
            q = self.rope(qkv[:, : nh * hd].reshape(n, nh, hd), positions)
            k = self.rope(qkv[:, nh * hd : (nh + nkv) * hd].reshape(n, nkv, hd), positions)
            v = qkv[:, (nh + nkv) * hd :].reshape(n, nkv, hd)
            attn = np.empty((n, nh * hd), dtype=np.float32)
            for (a, b), (_, cache), mask in zip(spans, batch, masks):
                if len(cache) <= li:
                    cache.append((k[a:b], v[a:b]))
                else:
                    pk, pv = cache[li]
                    cache[li] = (np.concatenate([pk, k[a:b]]), np.concatenate([pv, v[a:b]]))
                K, V = cache[li]
                # Query head j reads KV head j // group.
                Kh = np.repeat(K.transpose(1, 0, 2), group, axis=0)  # [nh, S, hd]
                Vh = np.repeat(V.transpose(1, 0, 2), group, axis=0)
                scores = q[a:b].transpose(1, 0, 2) @ Kh.transpose(0, 2, 1) / np.float32(np.sqrt(hd))  # [nh, t, S]
                scores = scores + mask[None]
                scores -= scores.max(axis=-1, keepdims=True)
                p = np.exp(scores)
                p /= p.sum(axis=-1, keepdims=True)
                attn[a:b] = (p @ Vh).transpose(1, 0, 2).reshape(b - a, nh * hd)
            h = h + attn @ L["wo"]
            x = self.rms_norm(h, L["ffn_norm"])
            gu = x @ L["wgu"]
            gate, up = gu[:, : gu.shape[1] // 2], gu[:, gu.shape[1] // 2 :]
            h = h + (gate / (1.0 + np.exp(-gate)) * up) @ L["wdown"]
        if all_rows:
            return self.rms_norm(h, self.final_norm) @ self.out_t
        last = self.rms_norm(h[[b - 1 for _, b in spans]], self.final_norm)
        return last @ self.out_t

    def decode_text(self, ids):
        """Byte-level BPE decoding of token ids (for eyeballing only)."""
        inv = {c: b for b, c in bytes_to_unicode().items()}
        data = bytearray()
        for i in ids:
            for ch in self.vocab[i]:
                if ch in inv:
                    data.append(inv[ch])
                else:
                    data.extend(ch.encode("utf-8"))
        return data.decode("utf-8", errors="replace")


# Best tokens reported per generation step (with their logits).
TOP_K = 8


def run(model, prompts, max_tokens):
    """First-token logits and greedy continuations of each prompt.

    Prompts are prefilled one by one (their lengths differ) and then decoded
    together, one token of every prompt per forward pass."""
    caches = [[] for _ in prompts]
    logits = np.stack([model.forward([(p, c)])[0] for p, c in zip(prompts, caches)])
    first = logits
    tokens = [[] for _ in prompts]
    margins = [[] for _ in prompts]
    tops = [[] for _ in prompts]
    for step in range(max_tokens):
        for i, row in enumerate(logits):
            best = np.argsort(row)[::-1][:TOP_K]
            margins[i].append(float(row[best[0]] - row[best[1]]))
            tops[i].append([[int(t), float(row[t])] for t in best])
            tokens[i].append(int(best[0]))
        if step + 1 < max_tokens:
            logits = model.forward([([t[-1]], c) for t, c in zip(tokens, caches)])
    return [
        dict(logits=[float(x) for x in f], tokens=t, margins=m, top=k, text=model.decode_text(t))
        for f, t, m, k in zip(first, tokens, margins, tops)
    ]


def prompt_logprobs(model, prompts, k):
    """vLLM's prompt logprobs of each prompt: None for the first token, then
    for token i its log-softmax under the logits of position i - 1 (in
    float64), its rank (1 + the tokens strictly more likely) and the k most
    likely [token, logprob] pairs there."""
    results = []
    for p in prompts:
        logits = model.forward([(p, [])], all_rows=True).astype(np.float64)
        m = logits.max(axis=-1, keepdims=True)
        lsm = logits - (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))
        entries = [None]
        for i in range(1, len(p)):
            row = lsm[i - 1]
            t = p[i]
            best = np.argsort(row)[::-1][:k]
            entries.append(
                dict(
                    token=int(t),
                    logprob=float(row[t]),
                    rank=int((row > row[t]).sum()) + 1,
                    top=[[int(b), float(row[b])] for b in best],
                )
            )
        results.append(dict(prompt_logprobs=entries))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="path of a llama-architecture GGUF file")
    ap.add_argument("--input", help="JSON file with the prompts (default: stdin)")
    ap.add_argument("--json", help="the prompts as a JSON string")
    ap.add_argument("--max-tokens", type=int, default=None, help="greedy tokens to generate (default 32)")
    ap.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="print each prompt's prompt logprobs with the K most likely tokens instead",
    )
    args = ap.parse_args()
    if args.json is not None:
        spec = json.loads(args.json)
    elif args.input is not None:
        with open(args.input) as f:
            spec = json.load(f)
    else:
        spec = json.load(sys.stdin)
    if isinstance(spec, list):
        spec = {"prompts": spec}
    prompts = spec["prompts"]
    max_tokens = args.max_tokens if args.max_tokens is not None else int(spec.get("max_tokens", 32))
    if not prompts or any(not p for p in prompts):
        sys.exit("every prompt needs at least one token id")
    model = Model(args.model)
    n_vocab = model.embed.shape[0]
    bad = [t for p in prompts for t in p if not 0 <= t < n_vocab]
    if bad:
        sys.exit(f"token ids out of range 0..{n_vocab}: {bad[:5]}")
    if args.prompt_logprobs is not None:
        json.dump({"results": prompt_logprobs(model, prompts, args.prompt_logprobs)}, sys.stdout)
        return
    json.dump({"results": run(model, prompts, max_tokens)}, sys.stdout)


if __name__ == "__main__":
    main()
