#!/usr/bin/env python3
"""Reference streaming detokenization for tests/tokenizer_agreement.rs.

What vLLM's fast incremental detokenizer emits for a fast (`tokenizers`)
tokenizer: every token stepped through `tokenizers.decoders.DecodeStream`
with special tokens kept, under both values of `spaces_between_special_tokens`.
With `false`, vLLM writes a special token that follows another special token
as the token's own text, without anything the decoder put before it.

Usage: decode_stream_ref.py TOKENIZER.json SEQUENCES.json

SEQUENCES.json holds a list of token-id lists; prints JSON
{"spaced": [text, ...], "unspaced": [text, ...]}, one text per list.
"""

import json
import sys

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def stream(tok, special, ids, spaces_between_special_tokens):
    out = []
    decoder = DecodeStream(skip_special_tokens=False)
    last_special = False
    for i in ids:
        piece = decoder.step(tok, i) or ""
        is_special = i in special
        if not spaces_between_special_tokens and is_special and last_special:
            piece = special[i]
        last_special = is_special
        out.append(piece)
    return "".join(out)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    tok = Tokenizer.from_file(sys.argv[1])
    with open(sys.argv[2], encoding="utf-8") as f:
        sequences = json.load(f)
    special = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
    json.dump(
        {
            "spaced": [stream(tok, special, s, True) for s in sequences],
            "unspaced": [stream(tok, special, s, False) for s in sequences],
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
