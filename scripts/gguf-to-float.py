"""Writes a float copy of a GGUF model: every quantized tensor dequantized
and stored as F16, BF16 or F32, all metadata (tokenizer included) kept, so
that llama.cpp and host can be measured on the same float file
(`MODEL=... bash scripts/bench-vs-llamacpp.sh`).

usage: python3 scripts/gguf-to-float.py IN.gguf OUT.gguf {f16,bf16,f32}

Needs the `gguf` package (tests/reference/requirements.txt).
"""

import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

# The tensor type each choice writes, and the file type the header names.
TARGETS = {
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
}
FLOATS = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[3] not in TARGETS:
        sys.exit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    target, file_type = TARGETS[sys.argv[3]]
    reader = GGUFReader(src)
    arch = reader.get_field("general.architecture").contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        # The writer adds the architecture and the GGUF.* header itself.
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        value = int(file_type) if field.name == "general.file_type" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        shape = [int(d) for d in reversed(t.shape)]
        if t.tensor_type in FLOATS and len(shape) == 1:
            # Norm weights stay as they are (F32 in every llama GGUF).
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        values = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        data = quantize(values, target)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
