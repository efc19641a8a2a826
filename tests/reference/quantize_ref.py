"""Quantizes float32 data with the `gguf` package's reference quantizers.

usage: quantize_ref.py INPUT.f32 OUTDIR

INPUT.f32 holds little-endian float32 values, a whole number of 32-value
blocks. Writes OUTDIR/{q8_0,q4_0,q4_1}.bin: the quantized blocks, in ggml's
byte layout, as gguf.quants.quantize produces them.
"""

import os
import sys

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize


def main():
    src, outdir = sys.argv[1], sys.argv[2]
    values = np.fromfile(src, dtype="<f4").reshape(-1, 32)
    for name in ("Q8_0", "Q4_0", "Q4_1"):
        blocks = quantize(values, GGMLQuantizationType[name])
        blocks.tofile(os.path.join(outdir, name.lower() + ".bin"))


if __name__ == "__main__":
    main()
