"""Write a GGUF holding a model's first N layers (its own weights, types and tokenizer).

Used by tools/gpu/prepare.sh: one device call carries 64 MiB at most, so the embedded
SmolLM2 (98 MB) travels as its first layers. Usage: python truncate.py SRC DST N_LAYERS
"""

from __future__ import annotations

import re
import sys

import gguf


def truncate(src: str, dst: str, n_layers: int) -> None:
    """Copy ``src`` into ``dst`` with only blocks ``0..n_layers-1`` and its block count set."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    count_key = f"{arch}.block_count"
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = n_layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    block = re.compile(r"^blk\.(\d+)\.")
    kept = [t for t in reader.tensors
            if not (m := block.match(t.name)) or int(m.group(1)) < n_layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


if __name__ == "__main__":
    truncate(sys.argv[1], sys.argv[2], int(sys.argv[3]))
