"""A GGUF file's header, read without loading the model: metadata values and fingerprints.

:func:`read_metadata` returns the scalar values and the numeric arrays (per-layer head counts
and the like) of a model's metadata, skipping the vocabulary; the memory plan reads it.
A model's fingerprint (what a saved KV cache is only valid for) is its file size plus the
SHA-256 of the GGUF header, metadata and tensor table (everything before the tensor data):
cheap to compute on a multi-gigabyte file, and different for any other model, quantization
or conversion. The weights themselves are not hashed; a file whose tensor data alone was
rewritten in place keeps its fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

# GGUF value types (gguf.GGUFValueType) and the byte size of the fixed-size ones
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9

_memo: dict[tuple[str, int, int], str] = {}


class _Reader:
    def __init__(self, f, h) -> None:
        self.f = f
        self.h = h

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise ValueError("truncated GGUF header")
        self.h.update(b)
        return b

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def skip_string(self) -> None:
        self.read(self.u64())

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED:
            self.read(_FIXED[vtype])
        elif vtype == _STRING:
            self.skip_string()
        elif vtype == _ARRAY:
            itype, n = self.u32(), self.u64()
            if itype in _FIXED:
                self.read(_FIXED[itype] * n)
            else:
                for _ in range(n):
                    self.skip_value(itype)
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")


class _NoHash:
    def update(self, b: bytes) -> None:
        pass


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


def read_metadata(path: str | os.PathLike, max_array: int = 4096) -> dict[str, object]:
    """The metadata of a GGUF file: scalars, strings, and numeric arrays.

    Arrays of more than ``max_array`` items and string arrays (the vocabulary) are skipped.
    """
    out: dict[str, object] = {}
    with Path(path).open("rb") as f:
        r = _Reader(f, _NoHash())
        if r.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        r.u32()
        r.u64()
        for _ in range(r.u64()):
            key = r.read(r.u64()).decode("utf-8", errors="replace")
            vtype = r.u32()
            if vtype in _SCALAR:
                out[key] = struct.unpack(_SCALAR[vtype], r.read(_FIXED[vtype]))[0]
            elif vtype == _STRING:
                out[key] = r.read(r.u64()).decode("utf-8", errors="replace")
            elif vtype == _ARRAY:
                itype, n = r.u32(), r.u64()
                if itype in _SCALAR and n <= max_array:
                    fmt = "<" + _SCALAR[itype][1] * n
                    out[key] = list(struct.unpack(fmt, r.read(_FIXED[itype] * n)))
                elif itype in _FIXED:
                    r.read(_FIXED[itype] * n)
                else:
                    for _ in range(n):
                        r.skip_value(itype)
            else:
                raise ValueError(f"unknown GGUF value type {vtype}")
    return out


def gguf_fingerprint(path: str | os.PathLike) -> str:
    """``"<size>:<sha256 of header + metadata + tensor table>"`` of a GGUF file (memoized)."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    fp = _memo.get(key)
    if fp is None:
        h = hashlib.sha256()
        with p.open("rb") as f:
            r = _Reader(f, h)
            if r.read(4) != b"GGUF":
                raise ValueError(f"{p} is not a GGUF file")
            r.u32()  # version
            n_tensors, n_kv = r.u64(), r.u64()
            for _ in range(n_kv):
                r.skip_string()
                r.skip_value(r.u32())
            for _ in range(n_tensors):
                r.skip_string()
                r.read(8 * r.u32())  # dims
                r.read(4 + 8)  # type, offset
        fp = _memo[key] = f"{st.st_size}:{h.hexdigest()}"
    return fp
