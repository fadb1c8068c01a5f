"""An engine nobody references is released: its thread, model and context go."""

from __future__ import annotations

import gc
import os
import threading
import time

from nbkv import Engine


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _settle_threads(baseline: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return threading.active_count()


def test_dropped_engines_are_released(model_path):
    """Create and drop 5 engines (each answering once): threads and RSS return to baseline."""
    warm = Engine(model_path, n_slots=2, n_ctx=512)
    warm.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
    warm.close()
    del warm
    gc.collect()
    threads0 = threading.active_count()
    rss0 = _rss_mb()
    for _ in range(5):
        engine = Engine(model_path, n_slots=2, n_ctx=512)
        engine.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
        assert threading.active_count() == threads0 + 1  # its scheduler thread
        del engine  # no close(): garbage collection must release it
    assert _settle_threads(threads0) == threads0
    gc.collect()
    grown = _rss_mb() - rss0
    # one engine is ~100 MB here (model weights + KV); 5 leaked engines would add ~500 MB
    assert grown < 60, f"RSS grew by {grown:.0f} MB after 5 dropped engines"


def test_a_streaming_engine_stays_alive(model_path):
    """A stream keeps its engine: dropping the name mid-reply does not cut the reply."""
    engine = Engine(model_path, n_slots=1, n_ctx=512)
    stream = engine.chat([{"role": "user", "content": "Count to five."}], max_tokens=6,
                         stream=True)
    del engine
    gc.collect()
    text = "".join(stream)
    assert stream.record is not None and stream.record.finish_reason in ("stop", "length")
    assert text
