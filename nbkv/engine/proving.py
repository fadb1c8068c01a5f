"""Proving exactness in the background: the engine serves at once, exact once it is proven.

With ``calibration="background"`` (the default) and no signed measurement cached for this
model, build and CPU, the engine loads and serves from its first request with the unproven rule
(records ``exact=False``, the reason "not proven yet"), while :class:`BackgroundProof`
measures the rule (:func:`nbkv.kv.calibrate.calibrate`) on a thread of its own, in a
temporary context of its own: it never touches the engine's context or its sequences, and
it decodes only while the engine has nothing to do (its gate waits while the scheduler is
busy), so it does not slow replies down.

When the measurement ends, the scheduler thread adopts the rule in idle time
(:func:`adopt`): everything computed before is forgotten (slots, the shadow sequence, the
system-prompt store, and parked entries written since the proof began), since its KV was
grouped by the unproven rule; then the rule is swapped and one line is logged. Only replies
that start after that may say ``exact=True``: no proof is claimed that was not made. An
engine with ``exact=False`` groups prompts the lean way before and after: it keeps its cache.
With a measurement cached, nothing runs here: the load adopts it, exact from the first request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from nbkv.core.events import PROVEN, SlotsChanged
from nbkv.kv import calibrate
from nbkv.kv.invariance import PrefillRule

log = logging.getLogger("nbkv")

#: the reason records give while the proof runs
NOT_PROVEN = "not proven yet: nbkv is measuring this model's exact grouping in the background"


class _Stopped(Exception):
    """The engine closed: the measurement is abandoned."""


class _Owner(Protocol):
    """What the proof needs of its engine's resources (nbkv.engine.native.Resources)."""

    model: Any
    memory: Any
    settings: dict[str, Any]
    n_slots: int
    shadow_seq: int | None

    def checked(self, rule: PrefillRule) -> PrefillRule: ...


class BackgroundProof:
    """The calibration of one engine, run on its own thread while the engine serves."""

    def __init__(self, res: _Owner, busy: Callable[[], bool], wake: Callable[[], None],
                 cache: bool) -> None:
        self._res, self._busy, self._wake, self._cache = res, busy, wake, cache
        self._stop = threading.Event()
        self._adopted = threading.Event()
        #: the measured rule, once measured and until adopted
        self.rule: PrefillRule | None = None
        self.parked_before: dict[str, Any] = {}  # the parked entries when the proof began
        self.thread = threading.Thread(target=self._run, name="nbkv-proof", daemon=True)

    def start(self) -> None:
        """Begin measuring."""
        self.thread.start()

    def _gate(self) -> None:
        while self._busy():
            if self._stop.wait(0.02):
                break
        if self._stop.is_set():
            raise _Stopped

    def _run(self) -> None:
        res = self._res
        try:
            rule = calibrate.calibrate(
                res.model, n_seq=res.n_slots, can_trim=res.memory.can_trim,
                settings=res.settings, cache=self._cache, shadow=res.shadow_seq is not None,
                gate=self._gate)
        except _Stopped:
            return
        except Exception as e:  # noqa: BLE001 - a failed proof proves nothing
            rule = PrefillRule(2, 1, exact=False, reason=f"the calibration failed: {e}")
        self.rule = res.checked(rule)
        self._wake()

    def ready(self) -> bool:
        """A measured rule waits to be adopted."""
        return self.rule is not None and not self._adopted.is_set()

    def pending(self) -> bool:
        """The engine still serves with the unproven rule (not adopted, not stopped)."""
        return not self._adopted.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the rule is adopted (True), the engine closed or ``timeout`` passed."""
        return self._adopted.wait(timeout)

    def adopted(self) -> None:
        """The scheduler adopted the rule."""
        self._adopted.set()

    def stop(self) -> None:
        """Abandon the measurement (the engine closes); returns once the thread ended."""
        self._stop.set()
        self._adopted.set()  # nothing more will be adopted: waiters return
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join()


def forget(proof: BackgroundProof, table: Any, spc: Any, parking: Any, shadow: Any) -> int:
    """Drop what was computed with the unproven rule (scheduler thread, idle).

    The slots, the shadow sequence, the system-prompt store, and the parked entries that
    are not as they were when the proof began. Returns how many parked entries went.
    """
    with table.lock:  # the next turn of each says why its conversation was read again
        table.cleared(list(table), PROVEN)
    for slot in table:
        table.reset(slot)
    if shadow is not None:
        shadow.drop()
    spc.clear()
    dropped = 0
    if parking is not None:
        for info in parking.entries():
            if proof.parked_before.get(info.key) != info:
                dropped += parking.drop(info.key)
    return dropped


def adopt(proof: BackgroundProof, res: Any, table: Any, spc: Any, parking: Any,
          shadow: Any, events: Any) -> PrefillRule:
    """Swap the engine's rule for the proven one (scheduler thread, idle): see the module."""
    rule = proof.rule
    assert rule is not None
    # exact=False: the lean grouping either way, so nothing cached was grouped otherwise
    dropped = forget(proof, table, spc, parking, shadow) if res.exact else 0
    res.rule = rule
    res.model.prefill_rule = rule
    proof.rule = None
    proof.adopted()
    line = (f"nbkv proved {res.model.path.name} in the background in {rule.seconds:.1f} s: "
            f"{rule.describe()}" + ("; what was cached before is recomputed" if res.exact
                                    else "")
            + (f" ({dropped} parked entries dropped)" if dropped else ""))
    log.info("%s", line)
    events.publish(SlotsChanged(line))
    return rule
