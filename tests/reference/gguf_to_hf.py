"""Converts a llama GGUF into a Hugging Face checkpoint directory, as an
independent fixture for the safetensors loader.

usage: gguf_to_hf.py MODEL.gguf OUTDIR {f32,bf16} SHARDS

Every tensor is dequantized with gguf.quants.dequantize, renamed to the
Hugging Face names, and the Q/K projections are permuted back from GGUF's
interleaved RoPE rows to Hugging Face's rotate-half rows (the inverse of
llama.cpp's convert_hf_to_gguf permutation). The safetensors files are
written by hand (8-byte little-endian header length, JSON header, data);
SHARDS > 1 also writes model.safetensors.index.json. config.json is built
from the GGUF metadata.
"""

import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name):
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    blk, layer, part, _ = name.split(".")
    assert blk == "blk", name
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.weight"


def unpermute(w, n_head):
    """Rows (head, half_dim, 2) -> (head, 2, half_dim): interleaved to rotate-half."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def to_bf16_bits(x):
    """float32 -> bfloat16 bit patterns, rounding to nearest even."""
    u = x.astype("<f4").view("<u4")
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype("<u2")


def write_safetensors(path, tensors, dtype):
    header, blobs, offset = {}, [], 0
    for name, array in tensors:
        blob = (to_bf16_bits(array) if dtype == "bf16" else array.astype("<f4")).tobytes()
        header[name] = {
            "dtype": "BF16" if dtype == "bf16" else "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def main():
    src, outdir, dtype, shards = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    reader = GGUFReader(src)
    meta = {k: f.contents() for k, f in reader.fields.items() if not f.types or f.types[0] != 9}
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": meta[f"{arch}.embedding_length"],
        "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_hidden_layers": meta[f"{arch}.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rope_theta": meta[f"{arch}.rope.freq_base"],
        "rms_norm_eps": meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        "max_position_embeddings": meta[f"{arch}.context_length"],
        "vocab_size": meta[f"{arch}.vocab_size"],
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "bfloat16" if dtype == "bf16" else "float32",
    }
    tensors = []
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype("<f4")
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, kv_heads)
        tensors.append((hf_name(t.name), w))
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if shards == 1:
        write_safetensors(os.path.join(outdir, "model.safetensors"), tensors, dtype)
        return
    weight_map = {}
    for i in range(shards):
        part = tensors[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(os.path.join(outdir, fname), part, dtype)
        weight_map.update({name: fname for name, _ in part})
    with open(os.path.join(outdir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


if __name__ == "__main__":
    main()
