"""Which nbkv modules a text request crosses from ``Engine.chat`` to its first token.

Usage: ``python tools/request_path.py [--turns N]``. The engine is loaded and warmed first
(a first request, whose path includes one-time work), then the measured request is a new
turn of that conversation, streamed; every call into an nbkv function, on any thread, is
recorded until the first text chunk arrives. Prints the modules in order of first call and
their count (issue 44: a request's path a newcomer can walk).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from nbkv import Engine

SEEN: dict[str, None] = {}
ON = threading.Event()


def _prof(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call" and ON.is_set():
        mod = frame.f_globals.get("__name__", "")
        if mod.startswith("nbkv.") and mod not in SEEN:
            SEEN[mod] = None


def trace(engine: Engine, messages: list[dict[str, str]]) -> list[str]:
    """The modules called (any thread) from ``engine.chat`` until the first text chunk."""
    SEEN.clear()
    sys.setprofile(_prof)
    try:
        ON.set()
        stream = engine.chat(messages, session="walk", max_tokens=4, stream=True)
        for _chunk in stream:
            ON.clear()
            break
        stream.close()
    finally:
        ON.clear()
        sys.setprofile(None)
    return list(SEEN)


def main() -> None:
    """Warm an engine, then list the modules of one new turn."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-ctx", type=int, default=1024)
    args = ap.parse_args()
    hook: Callable[..., Any] = _prof
    threading.setprofile(hook)  # the engine's threads, started below, carry the hook
    with Engine(n_slots=2, n_ctx=args.n_ctx, calibration="cached") as engine:  # no proof thread
        msgs = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
        first = engine.chat(msgs, session="walk", max_tokens=4)
        msgs += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "And another?"}]
        mods = trace(engine, msgs)
    for m in mods:
        print(m)
    print(f"{len(mods)} modules")


if __name__ == "__main__":
    main()
