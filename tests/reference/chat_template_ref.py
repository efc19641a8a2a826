#!/usr/bin/env python3
"""Reference chat-template rendering for tests/tokenizer_agreement.rs.

Renders the GGUF file's `tokenizer.chat_template` with Python's jinja2 set up
the way Hugging Face transformers renders chat templates (sandboxed,
trim_blocks, lstrip_blocks, loop controls, raise_exception), for every
conversation of CORPUS.json["conversations"].

Usage: chat_template_ref.py MODEL.gguf CORPUS.json
Prints a JSON list of the rendered prompts, in corpus order.
"""

import json
import sys

from gguf import GGUFReader
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def metadata_string(reader, key):
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def metadata_token(reader, key):
    field = reader.fields.get(key)
    if field is None:
        return ""
    tokens = reader.fields["tokenizer.ggml.tokens"]
    token_id = int(field.parts[field.data[0]][0])
    return bytes(tokens.parts[tokens.data[token_id]]).decode("utf-8")


def raise_exception(message):
    raise TemplateError(message)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model, corpus_path = sys.argv[1:]
    reader = GGUFReader(model)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(metadata_string(reader, "tokenizer.chat_template"))
    bos = metadata_token(reader, "tokenizer.ggml.bos_token_id")
    eos = metadata_token(reader, "tokenizer.ggml.eos_token_id")

    with open(corpus_path, encoding="utf-8") as f:
        conversations = json.load(f)["conversations"]
    rendered = [
        template.render(
            messages=c["messages"],
            add_generation_prompt=c["add_generation_prompt"],
            bos_token=bos,
            eos_token=eos,
        )
        for c in conversations
    ]
    json.dump(rendered, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
