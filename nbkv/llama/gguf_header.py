"""A GGUF file's header, read without loading the model: metadata values and fingerprints.

:func:`read_metadata` returns the scalar values and the numeric arrays (per-layer head counts
and the like) of a model's metadata, skipping the vocabulary; the memory plan reads it.
A model's fingerprint (what a saved KV cache is only valid for) is its file size plus the
SHA-256 of the GGUF header, metadata and tensor table (everything before the tensor data):
cheap to compute on a multi-gigabyte file, and different for any other model, quantization
or conversion. The weights themselves are not hashed; a file whose tensor data alone was
rewritten in place keeps its fingerprint. :func:`check_complete` tells a whole file from one
cut short (an interrupted download) by where its tensor table says the data ends.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

# GGUF value types (gguf.GGUFValueType) and the byte size of the fixed-size ones
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class _Reader:
    """Reads a GGUF header from a memory map, from its start (``pos``: bytes read so far)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def read(self, n: int) -> bytes:
        b = self.buf[self.pos:self.pos + n]
        if len(b) != n:
            raise ValueError("truncated GGUF header")
        self.pos += n
        return b

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def skip_string(self) -> None:
        n = self.u64()
        self.pos += n
        if self.pos > len(self.buf):
            raise ValueError("truncated GGUF header")

    def skip_strings(self, n: int) -> None:
        """Read past ``n`` strings (a vocabulary: one length read each, nothing copied)."""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(n):
            if pos + 8 > size:
                raise ValueError("truncated GGUF header")
            pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            raise ValueError("truncated GGUF header")
        self.pos = pos

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
        elif itype == _STRING:
            self.skip_strings(n)
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


@contextlib.contextmanager
def _reader(path: str | os.PathLike) -> Iterator[_Reader]:
    """A :class:`_Reader` over the file (ValueError for an empty one: no header at all)."""
    with Path(path).open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError("truncated GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            yield _Reader(buf)


#: ggml tensor types: (values per block, bytes per block); ``gguf.GGML_QUANT_SIZES``
_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
           8: (32, 34), 9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144),
           13: (256, 176), 14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74),
           18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
           23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
           29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
           40: (64, 36), 41: (128, 18)}

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


class _Scan(NamedTuple):
    """What one pass over a GGUF header finds (see :func:`_scan`)."""

    meta: dict[str, object]  # scalars, strings and numeric arrays of <= 4096 items
    fingerprint: str
    end: int  # bytes the file must have to hold every tensor


def _scan(path: str | os.PathLike) -> _Scan:
    """One pass over the header, memoized by path, size and modification time.

    A load reads the metadata, the fingerprint and the data's end, and the vocabulary is long.
    """
    p = Path(path).resolve()
    st = p.stat()
    return _scan_file(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _scan_file(path: str, size: int, mtime_ns: int) -> _Scan:
    meta: dict[str, object] = {}
    with _reader(path) as r:
        n_tensors, n_kv = r.header(path)
        align = 32
        for _ in range(n_kv):
            key = r.read(r.u64())
            v = r.value(r.u32(), 4096)
            if v is not None:
                meta[key.decode("utf-8", errors="replace")] = v
            if key == b"general.alignment" and isinstance(v, int) and v > 0:
                align = v
        end = 0
        for _ in range(n_tensors):
            r.skip_string()
            n_dims = r.u32()
            shape = struct.unpack(f"<{n_dims}Q", r.read(8 * n_dims))
            ttype, offset = struct.unpack("<IQ", r.read(12))
            count = 1
            for d in shape:
                count *= d
            block, nbytes = _BLOCKS.get(ttype, (1, 0))
            end = max(end, offset + -(-count // block) * nbytes)
        digest = hashlib.sha256(r.buf[:r.pos]).hexdigest()  # every byte read past
        end = -(-r.pos // align) * align + end if n_tensors else r.pos
    return _Scan(meta, f"{size}:{digest}", end)


def read_metadata(path: str | os.PathLike) -> dict[str, object]:
    """The metadata of a GGUF file: scalars, strings, and numeric arrays.

    Arrays of more than 4,096 items and string arrays (the vocabulary) are skipped.
    """
    return dict(_scan(path).meta)


def gguf_fingerprint(path: str | os.PathLike) -> str:
    """``"<size>:<sha256 of header + metadata + tensor table>"`` of a GGUF file (memoized)."""
    return _scan(path).fingerprint


def data_end(path: str | os.PathLike) -> int:
    """Bytes a GGUF file must have to hold every tensor its table lists.

    The tensor data starts after the table, aligned to ``general.alignment`` (32 by default);
    a tensor of a type unknown here counts up to its offset only. ValueError when the
    header itself is cut short or malformed.
    """
    return _scan(path).end


def check_complete(path: str | os.PathLike) -> None:
    """ValueError unless the file is as long as its tensor table says (not cut short)."""
    need, have = data_end(path), Path(path).stat().st_size
    if have < need:
        raise ValueError(f"truncated: its tensors need {need:,} bytes, the file has "
                         f"{have:,} (an interrupted download? fetch it again)")
