"""Parking a slot's conversation, and restoring a parked one into a slot (scheduler thread).

The engine side of :mod:`nbkv.store.parking`: what leaves a slot is its proven KV only (a reply
whose batched rewrite has not run is cut back to the settled prefix first: cheaper than
rewriting it, and what a returning request would keep anyway), with the message hashes and
boundaries that still lie inside it. Sliding-window memory is always parked at its settled
end, the position the next turn resumes from: the state put back holds only the window
before its end and is not cut again unless the prompt diverges (then a checkpoint serves).
A restore puts the whole state back (checkpoints too) and checks that the memory holds
exactly the parked positions; otherwise the slot is emptied and the request rebuilds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nbkv.core.errors import InvalidRequestError, NbkvError
from nbkv.engine.slots import SlotPhase
from nbkv.kv import policy
from nbkv.kv.invariance import valid_start
from nbkv.kv.policy import restore_point
from nbkv.kv.slot_kv import SWA, KVSnapshot
from nbkv.kv.slot_table import SlotState
from nbkv.store.parked import ParkedEntry, ParkedInfo

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.engine.decoder import Replays
    from nbkv.engine.native import Resources
    from nbkv.engine.slots import EngineSlot, EngineTable
    from nbkv.prompt.builder import PromptBuilder
    from nbkv.store.parking import ParkingLot

log = logging.getLogger("nbkv")


class Parker:
    """Parks slots' conversations and restores parked ones into slots (scheduler thread).

    Given the engine's resources, serve settings, slot table, parking lot (None: parking
    off), the prompt builder (how a conversation's next turn renders) and the
    :class:`~nbkv.engine.decoder.Replays` (whose replies a cut would lose).
    """

    @property
    def exact_path(self) -> bool:
        """Exact mode on a proven grouping (else the lean path: nothing is cut back)."""
        return self.settings.exactness.exact and not self.res.lean

    def __init__(self, res: Resources, settings: EngineSettings, table: EngineTable,
                 parking: ParkingLot | None, prompts: PromptBuilder | None,
                 replays: Replays) -> None:
        self.res = res
        self.settings = settings
        self.table = table
        self.parking = parking
        self.prompts = prompts
        self.replays = replays

    def park_slot(self, slot: EngineSlot, drop: bool = True,
                  branch: bool = False) -> ParkedInfo | None:
        """Park what ``slot`` holds; returns the entry (None: nothing to park, or not kept).

        The slot is left as it is for the caller to reuse or empty, less the tail of a reply
        whose rewrite had not run. ``drop=False``: an entry no tier can hold is not dropped, and
        stays in the slot (:meth:`nbkv.store.parking.ParkingLot.park`). ``branch``: parked as an
        unnamed conversation (:func:`park_branch`), not as the slot's session's.
        """
        lot, kv = self.parking, slot.kv
        if lot is None or not (kv.tokens or slot.redo):
            return None
        t0 = time.perf_counter()
        self.cut_for_park(slot)
        n = len(kv)
        if not n or not kv.verify():
            return None
        held = slot.conversation().cut(n)  # the messages and map its KV holds
        snap = self.take_preparked(slot) or kv.snapshot()
        info = lot.park(ParkedEntry.from_snapshot(
            snap, session=None if branch else slot.session, hashes=held.hashes,
            msg_ends=held.msg_ends, segments=held.segments, last_request=slot.last_request,
            last_used=slot.last_used, used_at=slot.used_at,
            branch_of=slot.session if branch else None), drop=drop)
        log.debug("parked slot[%d] (%s): %d tokens to %s in %.1f ms", slot.index, slot.session, n,
                  info.tier if info else "nowhere", 1000 * (time.perf_counter() - t0))
        return info

    def cut_for_park(self, slot: EngineSlot) -> None:
        """Cut ``slot`` back to what its parked state keeps.

        Its proven KV; on sliding-window memory, the point where the next turn resumes
        (:meth:`resume_point`). A sliding-window state put back whole cannot be cut (only the
        window before its end is saved) and continues exactly only from a
        :func:`nbkv.kv.policy.restorable` end: parked whole at any other length, it would go
        back to its newest checkpoint when put back.
        """
        kv = slot.kv
        at = self.resume_point(slot) if kv.memory.kind == SWA else None
        if at is not None and at < len(kv) + len(slot.redo):
            self.table.cut_back(slot, self.res.rule, at)
        elif slot.redo or (self.exact_path and kv.needs_rewrite):
            # the rewrite is abandoned: park the proven prefix
            self.table.cut_back(slot, self.res.rule)

    def park_branch(self, slot: EngineSlot, at: int) -> ParkedInfo | None:
        """Before its own session's request cuts ``slot`` back to ``at``: keep the branch it cuts.

        An edited turn is served in its session's own slot, which is cut at the edit: the
        replies after it (the old branch) leave KV, so running their cells again (a second
        "Run All") would decode them again. When the cut loses a reply that could be replayed
        (:meth:`nbkv.kv.replies.ReplyBook.cut_by`), a copy of the slot's proven KV is parked
        first, as an unnamed conversation: the session's own parked entry (its newest
        conversation) stays, and a request that goes back to the old branch restores a copy
        of it and is replayed. Not when a parked conversation already holds all of it. Returns
        the entry, or None when nothing was parked.
        """
        lot, kv = self.parking, slot.kv
        if lot is None or at >= len(kv) or not self.replays.proven():
            return None  # nothing is cut (a plain continuation), or nothing would be replayed
        rule = self.res.rule
        # a replay needs its prompt as far as the cache keeps one (nbkv.engine.decoder.match)
        if not any(at < valid_start(kv.tokens[:m.n_prompt], policy.reuse_limit(m.n_prompt), rule)
                   for m in self.replays.replies.cut_by(kv.tokens, at)):
            return None
        held = tuple(kv.tokens)
        if any(i.tokens[:len(held)] == held for i in lot.entries()):
            return None  # parked already (a branch restored from a copy, cut again)
        return self.park_slot(slot, branch=True)

    def keep_branch(self, entry: ParkedEntry, at: int, prompt: Sequence[Any], replay: bool
                    ) -> ParkedInfo | None:
        """Before its own session's request cuts a parked conversation it took back to ``at``.

        ``entry`` was restored into the session's slot for ``prompt`` and the request is no
        replay: as :meth:`park_branch` does for an edit in the slot, ``entry`` is parked again,
        unchanged, as the session's earlier branch (unnamed); its state is then the branch's
        (the caller does not recycle it: the slot holds a copy). Only for an edit (``prompt``
        leaves the entry) or a request that asks for replays (a notebook cell: the cells after
        it may run again); a request that only goes back to an earlier turn moves on from
        there. Not when the cut loses no reply that could be replayed, or a parked
        conversation already holds all of it. Returns the branch's info, or None.
        """
        lot, toks = self.parking, tuple(entry.tokens)
        if lot is None or at >= len(toks) or not self.replays.proven():
            return None
        if not replay and policy.common_prefix(toks, prompt) >= min(len(toks), len(prompt)):
            return None  # no edit, and no replay asked for
        rule = self.res.rule
        if not any(at < valid_start(toks[:m.n_prompt], policy.reuse_limit(m.n_prompt), rule)
                   for m in self.replays.replies.cut_by(toks, at)):
            return None
        if any(tuple(i.tokens[:len(toks)]) == toks for i in lot.entries()):
            return None  # parked already
        return lot.park(ParkedEntry(
            None, toks, entry.hashes, entry.msg_ends, entry.state, entry.checkpoints,
            entry.segments, entry.settled, entry.exact_len, entry.last_request,
            entry.last_used, used_at=entry.used_at, branch_of=entry.session))

    def resume_point(self, slot: EngineSlot) -> int | None:
        """Where the next turn of ``slot``'s conversation will resume in its KV; None: no cut.

        The settled end (exact mode: what stays exact whatever follows), and no further than
        the conversation as its next prompt renders it: the reply as text, re-tokenized, can
        differ from the generated tokens at its start (merged with the template's last token)
        or its end (a template that trims it). In exact mode, rounded down to where a
        canonical chunk ends and a window put back continues exactly
        (:func:`nbkv.kv.policy.restore_point`).
        """
        kv, rule = slot.kv, self.res.rule
        units = [*kv.tokens, *slot.redo]
        at = kv.settled if self.exact_path else len(units)
        turn, prompts = slot.last_turn, self.prompts
        if turn is not None and prompts is not None and turn[0].media is None:
            prompt, reply = turn
            try:
                nxt = prompts.prepare([*prompt.messages, {"role": "assistant", "content": reply}])
            except NbkvError:  # too long to render again: the settled end it is
                nxt = None
            if nxt is not None:
                at = min(at, policy.common_prefix(nxt.tokens, units))
        if self.exact_path:  # and where its window, put back, continues exactly
            at = restore_point(units, at, rule, kv.memory.kind, kv.memory.n_swa)
        return at if at < len(units) else None

    def prepark_slot(self, busy: bool) -> EngineSlot | None:
        """The slot the next new conversation would park, if its copy can be made now.

        When every slot holds a conversation, the least recently used idle one is parked by
        the next request that needs a slot; in idle time its KV can be copied out already, so
        that the request pays nothing for it. Only a slot parked whole (no cut back first).
        ``busy``: requests are queued or running (then not now).
        """
        if self.parking is None or self.settings.slots.cache != "imc" or busy:
            return None
        table = self.table
        if any(s.phase in (SlotPhase.EMPTY, SlotPhase.SERVING, SlotPhase.REWRITING)
               for s in table):
            return None
        slot = min(table, key=lambda s: (s.last_used, s.index))
        if slot.preparked is not None and slot.preparked[0] == slot.kv.version:
            return None  # copied out already (or found not to be parked whole)
        if self.exact_path and slot.phase is SlotPhase.UNSETTLED:
            return None
        return slot

    def prepark(self, slot: EngineSlot) -> None:
        """Copy out ``slot``'s KV for its park (idle time, scheduler thread).

        A sliding-window slot parked cut back (:func:`resume_point`) is copied when it is
        parked; it is only marked as looked at.
        """
        t0 = time.perf_counter()
        kv = slot.kv
        self.take_preparked(slot)  # a stale copy's memory is reused
        whole = not (kv.memory.kind == SWA and self.resume_point(slot) is not None)
        slot.preparked = (kv.version, kv.snapshot() if whole and kv.verify() else None)
        log.debug("slot[%d]: KV copied out for its park in %.1f ms", slot.index,
                  1000 * (time.perf_counter() - t0))

    def take_preparked(self, slot: EngineSlot) -> KVSnapshot | None:
        """``slot``'s idle-time copy if it still shows its KV, else None.

        A stale copy's memory goes back to the state buffers.
        """
        pre, slot.preparked = slot.preparked, None
        if pre is None:
            return None
        version, snap = pre
        if snap is None:
            return None
        if version == slot.kv.version:
            return snap
        state = snap.state
        del pre, snap
        self.res.ctx.recycle(state)
        return None

    def restore_into(self, slot: EngineSlot, entry: ParkedEntry) -> int:
        """Put ``entry``'s state into ``slot``'s KV; returns the positions it now holds.

        All of them, or (sliding-window memory: a state parked whole where its window does not
        continue exactly, e.g. a slot that a restore displaced) its first ones, up to the
        newest checkpoint that does (:meth:`nbkv.kv.slot_kv.SlotKV.put_back`): what the
        placement counted on (:class:`nbkv.kv.policy.Judge`). 0: the state did not restore
        (the slot is emptied).
        """
        kv = slot.kv
        kv.put_back(KVSnapshot.of(entry.state, entry.tokens, entry.settled or 0,
                                  entry.exact_len or 0, entry.checkpoints))
        n = len(kv)
        if n and kv.memory.kind == SWA and n < len(entry.tokens) \
                and list(kv.tokens) == list(entry.tokens[:n]):
            log.debug("slot[%d]: the parked state of %s went back to its checkpoint at %d of %d",
                      slot.index, entry.session, n, len(entry.tokens))
            return n
        if n != len(entry.tokens):
            log.warning("slot[%d]: the parked state of %s did not restore; rebuilding", slot.index,
                        entry.session)
            kv.clear()
            return 0
        return n

    def park_sessions(self, lot: ParkingLot, session: str | None, every: bool
                      ) -> str:
        """Park ``session``'s idle slot (every idle slot that holds something with ``every``).

        A conversation no tier can hold stays in its slot (said so). The figures are the
        parked entry's: a reply whose rewrite had not run is cut back to its proven part.
        """
        done = []
        for s in self.table:
            if s.pending or not s.tokens or not (every or s.session == session):
                continue
            who, n = s.session or f"slot {s.index}", len(s.tokens)
            info = self.park_slot(s, drop=False)
            if info is None:
                done.append(f"{who}: stays in slot {s.index} (no parking tier could hold its "
                            f"{n:,} tokens{_why_not(lot)})")
                continue
            self.table.reset(s)
            cut = n - info.n_tokens
            note = (f" ({cut} token{'s' if cut != 1 else ''} of its last reply, not yet "
                    "rewritten, left out: its next turn reads them again)" if cut > 0 else "")
            done.append(f"{who}: {info.n_tokens:,} tokens to {info.tier}{note}")
        if not done:
            raise InvalidRequestError("no idle slot holds a conversation" if every
                                      else f"no idle slot holds session {session!r}")
        st = lot.stats()
        return (f"parked {'; '.join(done)} (RAM: {st['ram_bytes'] / 2**20:.1f} of "
                f"{st['ram_budget'] / 2**20:.0f} MiB in use)")

    def unpark_sessions(self, lot: ParkingLot, session: str | None, every: bool
                        ) -> str:
        """Restore ``session``'s parked conversation (all, with ``every``) into slots.

        Each goes into an empty slot, else the least recently used one (whose conversation is
        parked in turn); at most one per slot.
        """
        table = self.table
        wanted = [i for i in lot.entries() if every or i.session == session][: len(table)]
        if not wanted:
            raise InvalidRequestError("nothing is parked" if every
                                      else f"session {session!r} is not parked")
        done = []
        for info in wanted:
            free = [s for s in table if not s.pending and not s.kv.copy_queued]
            if not free:
                break
            slot = next((s for s in free if not s.tokens), None) or min(
                free, key=lambda s: (s.last_used, s.index))
            entry = lot.take(info.key)
            if entry is None:
                continue
            self.park_slot(slot)
            self.table.reset(slot)
            n = self.restore_into(slot, entry)
            who = entry.session or "an unnamed conversation"
            if not n:
                lot.park(entry)  # llama.cpp refused the state: it stays parked
                done.append(f"{who}: could not be restored into slot {slot.index} (still parked)")
                continue
            # the messages it holds (n: maybe fewer than parked)
            table.adopt(slot, SlotState(slot.index, entry.conversation.cut(n), None))
            done.append(f"{who}: {n:,} tokens from {entry.tier} into slot {slot.index}")
        return "unparked " + ("; ".join(done) or "nothing")

    def spill_all(self) -> int:
        """Before a close: park every idle slot's conversation, then write RAM's to disk.

        The slots are left as they are (the engine is closing); rewrite their replies first
        (``settle_all``) to park them whole. Returns the entries written.
        """
        lot = self.parking
        if lot is None or lot.disk is None:
            return 0
        for s in self.table:
            if not s.pending and (s.tokens or s.redo):
                try:
                    self.park_slot(s)
                except Exception:  # noqa: BLE001 - one slot's failure never keeps the others
                    log.exception("slot[%d] (%s): could not be parked at close", s.index,
                                  s.session)
        return lot.spill_all()


def _why_not(lot: ParkingLot) -> str:
    gone = lot.stats()["disk_gone"]
    return f"; the disk tier is gone: {gone}" if gone else ""
