"""Rewriting a reply's KV on llama-server in idle time (exact mode): the server's rewrite.

A reply is decoded one row at a time, which rounds differently from a batched prefill, so
the next turn cannot keep it as it is (:mod:`nbkv.engine.rewrite` explains why). In the
kernel the scheduler rewrites it in idle time; on a server, nbkv does the same with
steering requests (:func:`nbkv.remote.steering.rewrite_route`): cut the slot back to its
canonical prefix, then prefill the reply's rows again as a batch, 64 rows per request.
The next turn then keeps the whole conversation and prefills only its new message.

A request always goes first: the rewrite stops between two of its requests when one is
waiting for the server, or when the slot is taken; what it did so far stays (the slot is
consistent after every step), and the request reads the rest itself.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING

from nbkv.core.events import SlotRewritten
from nbkv.remote import steering
from nbkv.remote.server_slot import ServerSlot

if TYPE_CHECKING:
    from nbkv.remote.llama_server import LlamaServerEngine

log = logging.getLogger("nbkv.remote.connect")


class Settler:
    """A thread that rewrites finished replies on the server while nothing else runs."""

    def __init__(self, engine: LlamaServerEngine) -> None:
        self._ref = weakref.ref(engine)
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="nbkv-remote-settle",
                                         daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """A request finished: look for a reply to rewrite."""
        self._idle.clear()
        self._wake.set()

    def wait(self, timeout: float = 30.0) -> bool:
        """Block until no rewrite is pending (``engine.settle()``); False on timeout."""
        self.kick()
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            eng = self._ref()
            if eng is None or eng.closed:
                self._idle.set()
                return
            try:
                while self._one(eng):
                    pass
            except Exception:  # noqa: BLE001 - a rewrite must never kill the thread
                log.debug("a rewrite on the server failed", exc_info=True)
            if not self._wake.is_set():
                self._idle.set()
            del eng

    @staticmethod
    def _pick(eng: LlamaServerEngine) -> tuple[ServerSlot, list[steering.Step]] | None:
        rule = eng.rule
        if rule is None:
            return None
        with eng._cv:
            for s in eng.table.slots:
                if s.pending or not s.known:
                    continue
                held = s.held[:-1] if s.junk else s.held
                steps = steering.rewrite_route(held, s.settled, rule,
                                               ubatch=eng.facts.plan_ubatch)
                if steps:
                    return s, steps
        return None

    def _one(self, eng: LlamaServerEngine) -> bool:
        """Rewrite one slot's reply (or as much as it can before a request comes)."""
        found = self._pick(eng)
        if found is None or eng.waiting():
            return False
        slot, steps = found
        if not eng._turn.acquire(blocking=False):
            return False  # a request runs: it kicks again when it ends
        t0 = time.perf_counter()
        held = list(slot.held[:-1] if slot.junk else slot.held)
        request = slot.last_request
        with eng._cv:
            slot.rewriting = True
        try:
            if not eng.drain(time.monotonic()):  # a closed answer still runs: not now
                return False
            for step in steps:
                with eng._cv:
                    if slot.pending or slot.held[: step.start] != held[: step.start]:
                        return False
                if eng.waiting() or eng.closed:
                    return False
                junk = step.junk if step.junk is not None else steering.junk_for(held, step.end)
                eng.steer_slot(slot, [*held[: step.end], junk], False, slot.session)
        finally:
            seen = eng.watch.read()  # the slot's last task is nbkv's own, not another client's
            if seen is not None:
                eng.watch.note_own(slot.index, seen.get(slot.index))
            with eng._cv:
                slot.rewriting = False
            eng._turn.release()
        s = time.perf_counter() - t0
        n = len(held) - steps[0].start
        eng.events.publish(SlotRewritten(slot.index, request, n, s))
        log.debug("slot[%d]: rewrote %d positions on the server in %.0f ms", slot.index, n,
                  s * 1000)
        return True
