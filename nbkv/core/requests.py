"""A request as every engine sees it: its sampling parameters, output queue and record."""

from __future__ import annotations

import itertools
import math
import numbers
import queue
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

from nbkv.core.errors import InvalidRequestError
from nbkv.core.events import RequestRecord


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature=0`` is greedy (deterministic)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: random
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "stop":
                stop = (v,) if isinstance(v, str) else v
                if not isinstance(stop, (list, tuple)) or not all(
                        isinstance(x, str) for x in stop):
                    raise InvalidRequestError(
                        f"stop must be a string or a list of strings, not {v!r}")
                object.__setattr__(self, "stop", tuple(stop))
                continue
            want = float if f.type in ("float", float) else int
            ok = isinstance(v, numbers.Real if want is float else numbers.Integral)
            if not ok or isinstance(v, bool):
                raise InvalidRequestError(
                    f"{f.name} must be {'a number' if want is float else 'an integer'}, "
                    f"not {v!r}")
            if want is float and not math.isfinite(v):  # inf passes ">= 0"; nan fails all
                raise InvalidRequestError(f"{f.name} must be a finite number, not {v!r}")
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0 (1 disables it)"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequestError(msg)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> SamplingParams:
        """Build from keyword arguments, rejecting unknown names with a clear error."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling argument(s) {unknown}; known: {sorted(names)}"
            )
        return cls(**kwargs)  # type: ignore[arg-type]


class Request:
    """What every engine's request has: its id, deadline, output queue and record.

    ``out`` carries ``("delta", text)``, then ``("done", record)`` or ``("error", exc)``.
    """

    _ids = itertools.count(1)

    def __init__(self, session: str | None, params: SamplingParams, timeout: float) -> None:
        self.id = next(self._ids)
        self.session = session
        self.params = params
        self.deadline = time.monotonic() + timeout
        self.out: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.record: RequestRecord | None = None
        self.t_submit = time.perf_counter()
        self.t_first = 0.0
        self.generated: list[int] = []
