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

    def value(self, vtype: int, max_array: int = -1) -> object | None:
        """Read one value; returns it, or None for what is only read past.

        Scalars, strings and numeric arrays of up to ``max_array`` items are returned.
        """
        if vtype in _SCALAR:
            return struct.unpack(_SCALAR[vtype], self.read(_FIXED[vtype]))[0]
        if vtype == _STRING:
            return self.read(self.u64()).decode("utf-8", errors="replace")
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        itype, n = self.u32(), self.u64()
        if itype in _SCALAR and n <= max_array:
            return list(struct.unpack("<" + _SCALAR[itype][1] * n, self.read(_FIXED[itype] * n)))
        if itype in _FIXED:
            self.read(_FIXED[itype] * n)
        else:
            for _ in range(n):
                self.value(itype)
        return None

    def header(self, path: object) -> tuple[int, int]:
        """Check the magic and read the version; returns (tensor count, key-value count)."""
        if self.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        self.u32()  # version
        return self.u64(), self.u64()


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
        for _ in range(r.header(path)[1]):
            key = r.read(r.u64()).decode("utf-8", errors="replace")
            v = r.value(r.u32(), max_array)
            if v is not None:
                out[key] = v
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
            n_tensors, n_kv = r.header(p)
            for _ in range(n_kv):
                r.skip_string()
                r.value(r.u32())
            for _ in range(n_tensors):
                r.skip_string()
                r.read(8 * r.u32())  # dims
                r.read(4 + 8)  # type, offset
        fp = _memo[key] = f"{st.st_size}:{h.hexdigest()}"
    return fp
