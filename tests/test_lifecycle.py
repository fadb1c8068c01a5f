"""An engine nobody references is released: its thread, model and context go."""

from __future__ import annotations

import gc
import threading

from nbkv import Engine

SCHEDULER = "nbkv-scheduler"


def _schedulers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == SCHEDULER}


def test_dropped_engines_are_released(model_path):
    """Create and drop 3 engines (each answering once): each one's thread and memory go.

    Counted, not measured: each engine's own scheduler thread ends, and the native model and
    context it held are freed (their pointers cleared), whatever else the process runs.
    """
    others = _schedulers()  # engines other tests keep
    for _ in range(3):
        before = _schedulers()
        engine = Engine(model_path, n_slots=2, n_ctx=512)
        engine.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
        (thread,) = _schedulers() - before  # its scheduler thread, and only one
        native = (engine.model, engine.ctx)  # the wrappers only: they hold no engine
        del engine  # no close(): garbage collection must release it
        gc.collect()
        thread.join(timeout=60)  # woken by the engine's finalizer, it frees what it held
        assert not thread.is_alive(), "the dropped engine's scheduler thread is still running"
        assert [n.ptr for n in native] == [None, None], "the model or context was not freed"
    assert _schedulers() <= others  # no scheduler thread of these engines is left


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
