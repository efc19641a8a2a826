#!/usr/bin/env python3
"""Reference tokenization for tests/tokenizer_agreement.rs.

Builds a tokenizer with the Python `tokenizers` package from the vocabulary
and merges in a GGUF file (read with the `gguf` package), configured the way
Hugging Face ships SmolLM2's tokenizer.json: a BPE model, the pre-tokenizer
Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)],
a ByteLevel decoder, and the control tokens (token type 3) as special tokens.

Usage: tokenize_ref.py MODEL.gguf CORPUS.json OUT_DIR

Encodes every text of CORPUS.json["texts"], saves the tokenizer to
OUT_DIR/tokenizer.json (plus a tokenizer_config.json naming BOS, EOS and the
chat template) and prints JSON:
{"ids": [[...], ...], "ids_with_special": [[...], ...], "decoded": [...],
 "bos_token_id": .., "eos_token_id": .., "vocab_size": .., "tokenizer_json": path}
"""

import json
import os
import sys

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3
USER_DEFINED = 4


def field_strings(reader, key):
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def field_ints(reader, key):
    field = reader.fields[key]
    return [int(field.parts[i][0]) for i in field.data]


def field_scalar(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    if len(field.types) == 1 and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value[0].item()


def build(reader):
    if field_scalar(reader, "tokenizer.ggml.model") != "gpt2":
        sys.exit("the reference only builds GPT-2 style byte-level BPE tokenizers")
    if field_scalar(reader, "tokenizer.ggml.pre") != "smollm":
        sys.exit("the reference is configured for the smollm pre-tokenizer")
    tokens = field_strings(reader, "tokenizer.ggml.tokens")
    types = field_ints(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in field_strings(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate tokens"

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    )
    return tok, tokens


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    model, corpus_path, out_dir = sys.argv[1:]
    reader = GGUFReader(model)
    tok, tokens = build(reader)
    bos = field_scalar(reader, "tokenizer.ggml.bos_token_id")
    eos = field_scalar(reader, "tokenizer.ggml.eos_token_id")
    add_bos = bool(field_scalar(reader, "tokenizer.ggml.add_bos_token", False))

    with open(corpus_path, encoding="utf-8") as f:
        texts = json.load(f)["texts"]
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    with_special = [([bos] if add_bos else []) + i for i in ids]
    decoded = [tok.decode(i, skip_special_tokens=False) for i in ids]

    os.makedirs(out_dir, exist_ok=True)
    tokenizer_json = os.path.join(out_dir, "tokenizer.json")
    tok.save(tokenizer_json)
    config = {
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "chat_template": field_scalar(reader, "tokenizer.chat_template"),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False)

    json.dump(
        {
            "ids": ids,
            "ids_with_special": with_special,
            "decoded": decoded,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "tokenizer_json": tokenizer_json,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
