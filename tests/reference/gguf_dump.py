"""Independent view of a GGUF file through the `gguf` package's GGUFReader.

usage: gguf_dump.py MODEL.gguf OUTDIR [TENSOR ...]

Prints JSON to stdout: the version, every metadata key (scalars as values,
arrays as their length plus first and last items), and every tensor's name,
GGML type, ne (innermost first), absolute data offset and byte count. Each
named TENSOR is dequantized with gguf.quants.dequantize and written to
OUTDIR/<name>.f32 as little-endian float32, row-major.
"""

import json
import os
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize


def field_value(field):
    """A JSON-friendly summary of one metadata field."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        items = [field.contents(i) for i in range(len(field.data))] if field.data else []
        return {"array_len": len(field.data), "first": items[:3], "last": items[-3:]}
    value = field.contents()
    if isinstance(value, float):
        return {"float": value}
    return {"scalar": value}


def main():
    path, outdir, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    reader = GGUFReader(path)
    version = int(reader.fields["GGUF.version"].contents())
    metadata = {
        key: field_value(field)
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")
    }
    tensors = [
        {
            "name": t.name,
            "type": int(t.tensor_type),
            "ne": [int(d) for d in t.shape],
            "data_offset": int(t.data_offset),
            "n_bytes": int(t.n_bytes),
        }
        for t in reader.tensors
    ]
    by_name = {t.name: t for t in reader.tensors}
    os.makedirs(outdir, exist_ok=True)
    for name in names:
        t = by_name[name]
        values = dequantize(t.data, t.tensor_type).astype("<f4")
        values.tofile(os.path.join(outdir, name + ".f32"))
    json.dump({"version": version, "metadata": metadata, "tensors": tensors}, sys.stdout)


if __name__ == "__main__":
    main()
