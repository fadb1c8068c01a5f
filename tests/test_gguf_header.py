"""The GGUF header reader (``nbkv.llama.gguf_header``) on a memory map: the same answers as
a sequential read, and a named ValueError wherever a header is cut. No model is loaded."""

from __future__ import annotations

import hashlib

import pytest

from nbkv.llama import gguf_header as g
from nbkv.llama.models import default_model_path


def _table_end(path):
    """Where the tensor table ends, read one field at a time (the plain way, as an oracle)."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f:
        def u(n):
            return int.from_bytes(f.read(n), "little")

        def skip(vtype):
            if vtype in sizes:
                f.seek(sizes[vtype], 1)
            elif vtype == 8:
                f.seek(u(8), 1)
            else:
                item, n = u(4), u(8)
                for _ in range(n):
                    skip(item)

        f.seek(8)
        n_tensors, n_kv = u(8), u(8)
        for _ in range(n_kv):
            f.seek(u(8), 1)
            skip(u(4))
        for _ in range(n_tensors):
            f.seek(u(8), 1)
            f.seek(8 * u(4) + 12, 1)
        return f.tell()


def test_fingerprint_hashes_every_byte_before_the_tensor_data():
    src = default_model_path()
    with open(src, "rb") as f:
        head = f.read(_table_end(src))
    assert g.gguf_fingerprint(src) == f"{src.stat().st_size}:{hashlib.sha256(head).hexdigest()}"
    assert g.data_end(src) == src.stat().st_size


@pytest.mark.parametrize("cut", [0, 3, 20, 1000, 200_000, 1 << 20])
def test_a_cut_header_is_a_value_error(tmp_path, cut):
    with open(default_model_path(), "rb") as f:
        data = f.read(cut)
    p = tmp_path / "cut.gguf"
    p.write_bytes(data)
    for fn in (g.data_end, g.read_metadata, g.gguf_fingerprint, g.check_complete):
        with pytest.raises(ValueError):
            fn(p)
