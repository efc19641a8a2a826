"""Statistics of one tensor of a GGUF file, read and dequantized by the
`gguf` package (llama.cpp's own Python reader), independently of the
engine: the reference for the `engine:weight-tools` worker extension.

Usage: weight_stats.py MODEL.gguf TENSOR_NAME
Prints JSON: {"shape": [rows, cols], "dtype", "count", "min", "max",
"mean", "abs_mean"} (shape outermost first, as the engine reports it).
"""

import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main() -> None:
    path, name = sys.argv[1], sys.argv[2]
    reader = GGUFReader(path)
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        sys.exit(f"{path} has no tensor {name!r}")
    values = dequantize(tensor.data, tensor.tensor_type).astype(np.float64).ravel()
    print(json.dumps({
        "shape": [int(d) for d in reversed(tensor.shape.tolist())],
        "dtype": tensor.tensor_type.name,
        "count": int(values.size),
        "min": float(values.min()),
        "max": float(values.max()),
        "mean": float(values.mean()),
        "abs_mean": float(np.abs(values).mean()),
    }))


if __name__ == "__main__":
    main()
