"""The engine's fixed cost, counted: decode calls, rows computed, host time, bytes moved.

:class:`KVCounters` is kept by the llama.cpp context (:mod:`nbkv.llama.backend`): every
``llama_decode`` adds one call, its rows and the time spent inside llama.cpp; every state read
or write adds its bytes; every ``seq_cp`` one copy. The engine's parts wrap their host work in
:meth:`KVCounters.part` ("placement", "parking", "sampling", "lifecycle", "rewrite",
"shadow", "gc"; "step" is a step's own work outside those: its plan, its batch, the KV's
bookkeeping): the part's wall time less what llama.cpp spent inside it (and less
any part nested in it) is its *host time*. Work done while no request is queued or running (a
reply's rewrite, a park's copy made ahead, a garbage collection: ``idle=True``) is host time
too, but kept apart (``idle_host_s``): no request waits for it. The requests' host time is
also counted as CPU time of the scheduler thread (``host_cpu_s``, less its CPU time inside
``llama_decode``; a total, read by the outermost parts): the work alone, without the waits a
wall clock also sees (another thread holding the interpreter's lock, a core the OS gave
another process). :class:`RequestCounts` is one request's share: the decodes that carried its
rows and the host time and bytes of its own admission and sampling.

Counts, never timings, are what tests assert; the bench reports the times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

PARTS = ("placement", "parking", "sampling", "lifecycle", "rewrite", "shadow", "step", "gc")


@dataclass
class RequestCounts:
    """One request's share of the engine's work (mutable while the request runs)."""

    decode_calls: int = 0  # llama_decode calls that held rows of this request
    rows: int = 0  # rows of this request those calls computed (prompt, image and reply rows)
    prefill_calls: int = 0  # ... of the calls, those that read its prompt
    prefill_rows: int = 0  # ... and the rows they computed
    kv_bytes: int = 0  # state bytes moved between host RAM and the KV for it (reads + writes)
    host_s: dict[str, float] = field(default_factory=dict)  # host time by part

    def add_host(self, part: str, seconds: float) -> None:
        """Add ``seconds`` of host time to ``part``."""
        self.host_s[part] = self.host_s.get(part, 0.0) + seconds


@dataclass
class KVCounters:
    """What one llama.cpp context did since it was created (see the module's docstring)."""

    decode_calls: int = 0
    rows: int = 0  # rows computed by those calls (padding rows included)
    padded_rows: int = 0  # ... of which rows of the scratch sequence (fixed-shape decodes)
    llama_s: float = 0.0  # time spent inside llama_decode
    llama_cpu_s: float = 0.0  # ... and the CPU time of the thread that called it, inside it
    state_reads: int = 0
    state_writes: int = 0
    bytes_read: int = 0  # state bytes copied from the KV into host RAM
    bytes_written: int = 0  # ... and from host RAM into the KV
    copies: int = 0  # seq_cp calls: copies inside the KV, no host RAM
    host_s: dict[str, float] = field(default_factory=dict)  # host time by part
    idle_host_s: dict[str, float] = field(default_factory=dict)  # ... of idle-time work
    #: the requests' host time as CPU time of the thread doing it (all parts; not idle-time work)
    host_cpu_s: float = 0.0
    _stack: list[Part] = field(default_factory=list, repr=False)  # parts now open

    @property
    def bytes_moved(self) -> int:
        """State bytes moved between host RAM and the KV, both ways."""
        return self.bytes_read + self.bytes_written

    def decoded(self, rows: int, seconds: float, padded: int = 0, cpu: float = 0.0) -> None:
        """One ``llama_decode`` of ``rows`` rows took ``seconds`` (``cpu`` of its thread's)."""
        self.decode_calls += 1
        self.rows += rows
        self.padded_rows += padded
        self.llama_s += seconds
        self.llama_cpu_s += cpu

    def part(self, name: str, into: RequestCounts | tuple[RequestCounts, ...] | None = None,
             idle: bool = False) -> Part:
        """Count the host time of the block as ``name``, and into ``into``.

        ``into``: one request's counts, or several (one step's requests) in equal shares.

        ``idle``: the block runs while no request is queued or running; its time goes to
        ``idle_host_s`` instead.
        """
        return Part(self, name, into, idle)

    def snapshot(self) -> dict[str, Any]:
        """The counts as a plain dict (host times in seconds, by part)."""
        return {
            "decode_calls": self.decode_calls, "rows": self.rows,
            "padded_rows": self.padded_rows, "llama_s": self.llama_s,
            "state_reads": self.state_reads, "state_writes": self.state_writes,
            "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
            "bytes_moved": self.bytes_moved, "copies": self.copies,
            "host_s": dict(self.host_s), "host_total_s": sum(self.host_s.values()),
            "host_cpu_s": self.host_cpu_s, "llama_cpu_s": self.llama_cpu_s,
            "idle_host_s": dict(self.idle_host_s),
        }


class Part:
    """One block of host work counted as a part (:meth:`KVCounters.part`).

    Wall time by part; the CPU time of the thread running it only for an outermost part
    (a part nested in another is in its CPU time already): the wall time also holds waits
    (for the interpreter's lock while another thread runs Python, for a core the OS gave
    another process), the CPU time only the work. A plain context manager, not a
    generator: it runs around every generation step, where a clock read costs most.
    """

    __slots__ = ("counters", "name", "into", "idle", "start", "llama", "nested", "cpu",
                 "llama_cpu")

    def __init__(self, counters: KVCounters, name: str,
                 into: RequestCounts | tuple[RequestCounts, ...] | None, idle: bool) -> None:
        self.counters, self.name, self.into, self.idle = counters, name, into, idle
        self.start = self.llama = self.nested = 0.0  # set on entry
        self.cpu = -1.0  # the thread's CPU time on entry; -1: nested (not read)
        self.llama_cpu = 0.0

    def __enter__(self) -> None:
        c = self.counters
        stack = c._stack
        if not stack and not self.idle:
            self.llama_cpu = c.llama_cpu_s
            self.cpu = time.thread_time()
        stack.append(self)
        self.llama = c.llama_s
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter()
        c = self.counters
        inside = end - self.start - (c.llama_s - self.llama)
        stack = c._stack
        stack.pop()
        host = max(inside - self.nested, 0.0)  # the parts nested in it count as themselves
        name = self.name
        if self.idle:
            c.idle_host_s[name] = c.idle_host_s.get(name, 0.0) + host
        else:
            c.host_s[name] = c.host_s.get(name, 0.0) + host
            if self.cpu >= 0.0:
                cpu = time.thread_time() - self.cpu - (c.llama_cpu_s - self.llama_cpu)
                c.host_cpu_s += max(cpu, 0.0)
        into = self.into
        if isinstance(into, tuple):  # a step shared by its requests: equal shares
            for counts in into:
                counts.add_host(name, host / len(into))
        elif into is not None:
            into.add_host(name, host)
        if stack:
            stack[-1].nested += inside
