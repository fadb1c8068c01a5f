"""llama-server driven by nbkv's slot table and IMC policy (see :mod:`nbkv.remote.connect`)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from nbkv.core.api import TemplatedAPI, request_totals, thrashing
from nbkv.core.errors import (
    EngineClosedError,
    MediaError,
    ServerError,
    ServerUnsupportedError,
    SlotTimeoutError,
    TemplateMismatchError,
)
from nbkv.core.events import (
    RequestRecord,
    RequestStarted,
    SlotsChanged,
)
from nbkv.core.messages import normalize
from nbkv.kv import admission, policy
from nbkv.kv.slot_table import SlotInfo, SlotState, SlotTable, message_segments
from nbkv.media.messages import contains_images
from nbkv.prompt.builder import Prompt, PromptBuilder
from nbkv.prompt.templates import ChatTemplate
from nbkv.remote import steering
from nbkv.remote.base import POLL_INTERVAL, PROBE, RemoteBase, RemoteJob
from nbkv.remote.exchange import Exchange
from nbkv.remote.facts import ServerFacts
from nbkv.remote.http_client import ServerClient
from nbkv.remote.server_slot import SERVER_RAM, ServerChecks, ServerSlot, ServerWatch
from nbkv.remote.settle import Settler
from nbkv.remote.steering import Ledger, Offered

log = logging.getLogger("nbkv.remote.connect")



class ServerVocab:
    """The server's tokenizer, as :class:`~nbkv.prompt.builder.PromptBuilder` uses a model's."""

    def __init__(self, client: ServerClient, bos_text: str) -> None:
        self._client = client
        self._pieces: dict[int, bytes] = {}
        self.bos_text = bos_text
        self.add_bos = bool(client.post("/tokenize", {"content": "", "add_special": True}
                                        )["tokens"])

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text`` (special tokens parsed), by the server's own vocabulary."""
        out = self._client.post("/tokenize", {"content": text, "add_special": add_special,
                                              "parse_special": True, "with_pieces": True})
        ids = []
        for t in out["tokens"]:
            piece = t["piece"]
            self._pieces[t["id"]] = piece.encode() if isinstance(piece, str) else bytes(piece)
            ids.append(t["id"])
        return ids

    def piece(self, token: int) -> bytes:
        """The bytes of one token (known from an earlier tokenization, else asked for)."""
        p = self._pieces.get(token)
        if p is None:
            p = self._pieces[token] = self.detokenize([token]).encode()
        return p

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Tokens back to text."""
        return self._client.post("/detokenize", {"tokens": list(tokens)})["content"]


class LlamaServerEngine(ServerChecks, TemplatedAPI, RemoteBase):
    """llama-server slots driven by nbkv's session table and IMC policy (see module doc).

    ``exact`` (default True): claim a reply exact only where it is proven, and steer the
    server so that it is (:mod:`nbkv.remote.steering`); requests then run on the server one
    at a time, since llama-server computes the slots it serves together in one batch. Where
    nothing can be proven (:meth:`nbkv.remote.facts.ServerFacts.exactness`), or with
    ``exact=False``, requests go as they are, at the same time, and records say
    ``exact=False`` with the reason.
    """

    kind = "llama-server"

    def __init__(self, client: ServerClient, props: Mapping[str, Any], *,
                 slots: int | None = None, min_tokens: int = 100,
                 poll_interval: float = POLL_INTERVAL, exact: bool = True) -> None:
        super().__init__(client)
        self.props = dict(props)
        total = int(props["total_slots"])
        n = total if slots is None else int(slots)
        if not 1 <= n <= total:
            raise ServerUnsupportedError(
                f"--slots {n}: the server has {total} slot(s); start it with -np {n} "
                f"(python -m nbkv.remote.server --slots {n})")
        self.n_ctx = int(props["default_generation_settings"]["n_ctx"])
        self.total_slots = total
        self.cache = "imc"
        self.cache_min_tokens = min_tokens
        self.model_path = str(props.get("model_path") or "")
        alias = str(props.get("model_alias") or "")
        self.model_name = (Path(alias).name if alias == self.model_path else alias) or Path(
            self.model_path).name or "?"
        self.build_info = str(props.get("build_info") or "")
        if (props.get("modalities") or {}).get("vision"):
            log.info("the server has a vision projector; nbkv sends text only for now")
        source = props.get("chat_template") or ""
        if not source:
            raise ServerUnsupportedError("the server reports no chat template")
        self.template = ChatTemplate(source, str(props.get("bos_token") or ""),
                                     str(props.get("eos_token") or ""))
        self.vocab = ServerVocab(client, str(props.get("bos_token") or ""))
        self.builder = PromptBuilder(self.vocab, self.template, None, self.n_ctx)  # type: ignore[arg-type]
        self.check_template()
        self.has_metrics = bool(props.get("endpoint_metrics", False))
        #: what the server's launcher states about its flags (nbkv.remote.facts)
        self.facts = ServerFacts.from_props(props)
        self.exact = bool(exact)
        rule, why = self.facts.exactness()
        #: the prefill rule steering follows; None when replies are not proven exact
        self.rule = rule if self.exact else None
        self.why_not_exact = why if self.exact else "exact=False: replies are not steered"
        if self.exact and rule is None:
            log.warning("nbkv cannot prove replies exact on %s: %s; it serves from cache "
                        "anyway and marks records exact=False", self.url, why)
        self.ledger = Ledger()  # states the server may hold in its --cache-ram
        self.watch = ServerWatch(client, self.facts, self.has_metrics)
        self._turn = threading.Lock()  # exact mode: one request on the server at a time
        self._waiting = 0  # requests waiting for their turn (an idle-time rewrite yields)
        self.draining: set[int] = set()  # slots still computing an answer nbkv closed
        self.restart_note = ""  # how the last restart of the server was noticed
        self.table: SlotTable[ServerSlot] = SlotTable(
            [ServerSlot(i, self.n_ctx) for i in range(n)], self._cv)
        self._poll_every = poll_interval
        self._last_poll = 0.0
        self._adopt()
        self._poller = threading.Thread(target=_poll_loop, args=(weakref.ref(self),),
                                        name="nbkv-remote-poll", daemon=True)
        self._poller.start()
        self.settler = Settler(self)

    @property
    def server_slots(self) -> list[dict[str, Any]]:
        """The server's last ``/slots`` answer."""
        return self.watch.raw

    @property
    def n_slots(self) -> int:
        """Slots nbkv uses (at most the server's ``total_slots``)."""
        return len(self.table.slots)

    def check_template(self) -> None:
        """Raise :class:`TemplateMismatchError` when the kernel renders unlike the server."""
        mine = self.render(PROBE)
        try:
            theirs = self.client.post("/apply-template", {"messages": list(PROBE)})["prompt"]
        except ServerUnsupportedError:
            log.info("the server has no /apply-template: rendering not checked")
            return
        if mine != theirs:
            k = policy.common_prefix(mine, theirs)
            raise TemplateMismatchError(
                f"the kernel renders the chat template differently from the server at "
                f"character {k}: kernel {mine[k:k + 40]!r} vs server {theirs[k:k + 40]!r}; "
                f"nbkv could not pin slots exactly")

    def slots(self) -> tuple[SlotInfo, ...]:
        """Nbkv's slot table, with what the last ``/slots`` poll said (never blocks on HTTP)."""
        return self.table.snapshots()

    def clear(self, slot: int | None = None) -> None:
        """Erase one slot (or all) on the server (``/slots/N?action=erase``) and in the table."""
        with self._cv:
            targets = self.table.clear_targets(slot)
        for s in targets:
            try:
                self.client.post(f"/slots/{s.index}", {}, timeout=30.0, action="erase")
            except ServerUnsupportedError as e:
                raise ServerUnsupportedError(
                    "the server cannot erase slots: start it with --slot-save-path DIR "
                    "(python -m nbkv.remote.server does)", e.status) from e
            with self._cv:
                self.table.cleared([s])
                s.forget()
        self.events.publish(SlotsChanged("cleared"))

    def export_slots(self) -> tuple[tuple[int, ...], list[SlotState]]:
        """Busy slots, and the idle slots whose content is known (``kv``: their tokens)."""
        with self._cv:
            busy = tuple(s.index for s in self.table if s.pending)
            return busy, [self.table.state_of(s, tuple(s.held)) for s in self.table
                          if not s.pending and s.known and s.held]

    def settled_of(self, index: int) -> int:
        """Leading positions of slot ``index`` whose KV is canonical (a save keeps it)."""
        with self._cv:
            return self.table[index].settled

    def busy_slots(self) -> list[int]:
        """Slots serving a request now."""
        with self._cv:
            return [s.index for s in self.table if s.pending]

    def forget_slot(self, index: int, note: str) -> None:
        """Mark slot ``index``'s content unknown (``note`` says why)."""
        with self._cv:
            self.table[index].forget(note)

    def import_slots(self, states: Sequence[SlotState],
                     settled: Mapping[int, int] | None = None) -> None:
        """Record that the server's slots now hold ``states`` (``kv``: their tokens).

        ``settled``: per slot, its canonical prefix as saved (0 where not known).
        """
        with self._cv:
            for st in states:
                slot = self.table[st.index]
                slot.held = list(st.kv)
                slot.settled = min((settled or {}).get(st.index, 0), len(slot.held))
                self.table.adopt(slot, st)
                slot.known, slot.verified, slot.note = True, True, ""
                slot.version += 1
                self.watch.loaded.add(st.index)

    def save(self, path: str | None = None, sessions: Any = None) -> Any:
        """Have the server save its slots, and nbkv its table (see :mod:`nbkv.remote.persist`).

        Pending rewrites of replies run first, so that what is saved is canonical.
        """
        from nbkv.remote.persist import save

        self.settle()
        return save(self, path, sessions)

    def restore(self, path: str | None = None, sessions: Any = None, *,
                trust: bool = False) -> Any:
        """Bring a save back into the server's slots and nbkv's table, checked first.

        A save not signed by your key is refused unless ``trust``.
        """
        from nbkv.remote.persist import restore

        return restore(self, path, sessions, trust=trust)

    def explain(self, request: int | None = None) -> admission.Explanation:
        """Why request ``request`` (default: the latest) reused what it did."""
        return self.table.explain(self.history, self.vocab.detokenize, request)

    def stats(self) -> dict[str, Any]:
        """Totals over the history, plus the server's own counters (``/metrics``)."""
        h = self.history
        return {**request_totals(h),
                "not_verified": sum(1 for r in h if not r.verified),
                "not_exact": sum(1 for r in h if not r.exact),
                "evictions": sum(1 for r in h if r.evicted_session is not None),
                **({f"server {k}": v for k, v in self.metrics().items()}),
                **thrashing(h, self.n_slots)}

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters (``--metrics``), e.g. ``prompt_tokens_total``."""
        if not self.has_metrics:
            return {}
        try:
            text = self.client.get("/metrics", timeout=5.0)
        except ServerError:
            return {}
        out = {}
        for line in str(text).splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            try:
                out[name.split(":", 1)[-1]] = float(value)
            except ValueError:
                continue
        return out

    # ------------------------------------------------------------------ a request

    def _prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str,
                 max_tokens: int) -> Prompt:
        if contains_images(normalize(messages)):
            raise MediaError("images over a llama-server engine are not supported yet: "
                             "connect with kind='openai' (the server's /v1 takes images), or "
                             "load the model in the kernel with --mmproj")
        return self.builder.prepare(messages, overflow, max_tokens)

    def _parked(self) -> list[Offered]:
        """Conversations the server may hold in its ``--cache-ram`` (not in a slot now)."""
        if self.facts.has_cache is False:
            return []
        with self._cv:
            in_slots = {tuple(s.held) for s in self.table.slots}
        return [e for e in self.ledger.entries()
                if e.session is not None and e.hashes and e.tokens not in in_slots]

    def _place(self, job: RemoteJob, p: Prompt
               ) -> tuple[ServerSlot, policy.Plan, SlotInfo | None]:
        """Wait for a free slot and choose it with nbkv's policy (no donor copies on a server)."""
        parked = self._parked()
        with self._cv:
            while True:
                if self.closed:
                    raise EngineClosedError("the remote engine was closed")
                snaps = self.table.snapshots()
                plan = self.table.place(snaps, p, job.session, cache="imc",
                                        min_tokens=self.cache_min_tokens, copies=False,
                                        parked=cast(Sequence[policy.ParkedLike], parked))
                if plan is not None:
                    break
                left = job.deadline - time.monotonic()
                if left <= 0:
                    raise SlotTimeoutError(f"every slot stayed busy for {self.wait_timeout} s")
                self._cv.wait(min(left, 0.5))
            slot = self.table[plan.slot]
            slot.pending = True
            slot.version += 1
        return slot, plan, self.table.own(snaps, job.session)

    def _serve(self, job: RemoteJob, p: Prompt) -> RequestRecord:
        slot, plan, own = self._place(job, p)
        try:
            if self.rule is None:
                return self._complete(job, p, slot, plan, own)
            left = max(job.deadline - time.monotonic(), 0.0)
            with self._cv:
                self._waiting += 1
            try:
                got = self._turn.acquire(timeout=left)
            finally:
                with self._cv:
                    self._waiting -= 1
            if not got:
                raise SlotTimeoutError(f"the server stayed busy with nbkv's other requests "
                                       f"for {self.wait_timeout} s (exact mode runs them "
                                       f"one at a time)")
            try:
                return self._complete(job, p, slot, plan, own)
            finally:
                self._turn.release()
        finally:
            with self._cv:
                slot.pending = False
                self._cv.notify_all()
            if self.rule is not None:
                self.settler.kick()

    def waiting(self) -> bool:
        """A request is waiting for its turn on the server (exact mode)."""
        with self._cv:
            return self._waiting > 0

    def settle(self, timeout: float = 60.0) -> None:
        """Rewrite every finished reply's KV on the server now (see :mod:`nbkv.remote.settle`)."""
        if self.rule is not None:
            self.settler.wait(timeout)

    # ------------------------------------------------------------------ helpers (Exchange)

    def offer_states(self, target: ServerSlot, sent: Sequence[int]) -> None:
        """A task with ``sent`` starts on ``target``: note what the server may cache now.

        llama-server copies every idle slot's state into its prompt cache when a task starts
        (``--cache-idle-slots``, its default), and the target slot's own state when the task
        keeps less than half of it, or no more than a tenth of its prompt (then it also
        looks there for a longer prefix; :func:`nbkv.remote.steering.route` plans for it).
        """
        if self.facts.has_cache is False:
            return
        with self._cv:
            states = []
            for s in self.table.slots:
                if not s.known or not s.held:
                    continue
                if s is target:
                    keep = policy.common_prefix(s.held, sent)
                    if not (2 * keep < len(s.held) or keep <= steering.SIMILARITY * len(sent)):
                        continue
                states.append(Offered(tuple(s.held), s.settled, s.session, tuple(s.hashes),
                                      tuple(s.msg_ends), s.last_used))
        for st in states:
            self.ledger.offer(st)

    def proven(self, sent: Sequence[int], told: int, held: Sequence[int]) -> int | None:
        """Rows of a server restore proven canonical (None: no restore can explain them)."""
        if told <= policy.common_prefix(held, sent) or self.facts.has_cache is False:
            return None
        return self.ledger.proven(sent, told)

    def steer_slot(self, slot: ServerSlot, sent: list[int], fresh: bool,
                   session: str | None) -> int:
        """Send one steering request (``sent`` ends with a junk token); its ``cache_n``.

        Updates what the slot holds and how much of it is canonical, from what the server
        says it kept (:func:`nbkv.remote.steering.observed`).
        """
        rule = self.rule
        assert rule is not None
        self.offer_states(slot, sent)
        body = {"prompt": sent, "id_slot": slot.index, "cache_prompt": not fresh,
                "n_predict": 0, "n_cache_reuse": 0, "stream": False, "temperature": 0.0,
                "return_tokens": False}
        try:
            ans = self.client.post("/completion", body)
        except BaseException as e:
            self.lose(slot, session, "a steering request failed")
            slot.failed = type(e).__name__
            raise
        t = ans.get("timings") or {}
        told = int(t["cache_n"]) if "cache_n" in t else 0
        held, settled = (slot.held, slot.settled) if slot.known else ([], 0)
        now, _ = steering.observed(sent, told, held, settled, rule, junk=True,
                                   ubatch=self.facts.plan_ubatch,
                                   proven=self.proven(sent, told, held))
        with self._cv:
            slot.hold(sent, now, junk=True)
        log.debug("steer slot[%d]: sent %d, kept %d, settled %d", slot.index, len(sent), told,
                  now)
        return told

    def lose(self, slot: ServerSlot, session: str | None, why: str) -> None:
        """A request on ``slot`` failed: its content is not known any more."""
        with self._cv:
            slot.forget(f"slot {slot.index}: {why}, so its content is not known; the next "
                        f"request re-verifies it")
            slot.session = session

    def _complete(self, job: RemoteJob, p: Prompt, slot: ServerSlot, plan: policy.Plan,
                  own: SlotInfo | None) -> RequestRecord:
        if self.rule is not None:  # an answer nbkv closed must not run beside this one
            self.drain(job.deadline)
        before, other_note = self._look(slot) if self.rule is not None else ({}, "")
        prev_len = len(slot.tokens)
        prev_prompt_len = slot.msg_ends[-1] if slot.msg_ends else prev_len
        settled_before = slot.settled
        entry = next((e for e in self._parked() if e.key == plan.parked), None) \
            if plan.parked is not None else None
        expected = plan.reuse if slot.known else None
        restored = (admission.Restored(entry.session, SERVER_RAM, admission.Cached(
            entry.tokens, entry.hashes, entry.msg_ends)) if entry is not None else None)
        why = self.table.reason(job.id, p, job.session, own, slot.tokens, reuse=plan.reuse,
                                wanted=plan.reuse, restored=restored)
        if self.facts.has_cache is not False and slot.known and slot.held:
            # the server may copy the slot's conversation to its cache as this request
            # starts: noted under its own session, before the slot changes hands
            self.ledger.offer(Offered(tuple(slot.held), slot.settled, slot.session,
                                      tuple(slot.hashes), tuple(slot.msg_ends),
                                      slot.last_used))
        self.table.claim(slot, job.id, job.session, p, plan.reuse, plan.evicted,
                         parked=bool(self.facts.has_cache))
        record = self.table.record(
            job.id, job.session, p, slot, plan, plan.reuse, why,
            prefilled_tokens=len(p.tokens) - plan.reuse,
            trimmed_tokens=max(prev_len - plan.reuse, 0),
            evicted_parked=SERVER_RAM if plan.evicted and self.facts.has_cache else "",
            segments=message_segments(p.messages, p.ends, len(p.tokens), plan.reuse,
                                      len(p.tokens), ""))
        self.events.publish(RequestStarted(record))
        ex = Exchange(self, job, p, slot)
        step = None
        try:
            if self.rule is not None:
                if entry is not None:  # have the server load it, up to its canonical end
                    upto = self._restore_point(p, entry, slot)
                    if upto:
                        ex.restore_from(upto)
                step = ex.steer()
        except BaseException as e:  # noqa: BLE001 - ends the request like a failed completion
            ex.out.error = e
            ex.out.finish = "cancelled" if isinstance(e, KeyboardInterrupt) else "error"
        held_at_send = list(slot.held) if slot.known else []
        settled_at_send = slot.settled if slot.known else 0
        if ex.out.error is None:
            ex.complete(step)
        ex.judge(held_at_send, settled_at_send)
        return ex.finish(plan, record, expected, entry,
                         (prev_len, prev_prompt_len, settled_before), before, other_note, own)

    def _restore_point(self, p: Prompt, entry: Offered, slot: ServerSlot) -> int:
        """Where to cut a conversation the server may restore: proven canonical, 0 if none."""
        rule = self.rule
        assert rule is not None
        n = len(p.tokens)
        have = policy.common_prefix(slot.held, p.tokens) if slot.known else 0
        q = min(entry.settled, policy.common_prefix(entry.tokens, p.tokens), n - 1)
        q = q // rule.align * rule.align
        while q > have:
            sent = [*p.tokens[:q], steering.junk_for(p.tokens, q)]
            if (q > steering.SIMILARITY * n and n - q >= rule.threshold
                    and steering.settles(q, n, rule, junk=False,
                                         ubatch=self.facts.plan_ubatch) is not None
                    and self.ledger.proven(sent, q) >= q):
                return q
            q -= rule.align
        return 0

    def describe(self) -> list[tuple[str, str]]:
        """Status rows: server, model, slots, cache, exactness."""
        ram = {None: "not stated", True: f"{self.facts.cache_ram} MiB", False: "off"}[
            self.facts.has_cache]
        rule = self.rule
        exact = (f"yes, steered: {rule.describe().removeprefix('exact: yes, ')}; one request "
                 f"on the server at a time" if rule is not None
                 else f"no ({self.why_not_exact})")
        return [("server", f"llama-server at {self.url} ({self.build_info})"),
                ("model", self.model_name),
                ("slots", f"{self.n_slots} of the server's {self.total_slots} x {self.n_ctx} "
                          f"tokens, pinned by nbkv (id_slot)"),
                ("cache", f"imc on the server's slots (min {self.cache_min_tokens} tokens); "
                          f"no prefix copies between slots (no server API); the server's "
                          f"--cache-ram: {ram}"),
                ("exact", exact)]


def _poll_loop(ref: weakref.ref[LlamaServerEngine]) -> None:
    """Poll ``/slots`` while the engine lives and is open, at most every POLL_INTERVAL s."""
    while True:
        eng = ref()
        if eng is None or eng.closed:
            return
        every = eng._poll_every
        due = eng._last_poll + every - time.monotonic()
        if due <= 0:
            try:
                eng.poll()
            except Exception as e:  # noqa: BLE001 - a poll must never kill the thread
                if eng.closed:
                    return  # closed mid-poll: nothing went wrong
                if isinstance(e, (ServerError, EngineClosedError)):
                    log.debug("poll failed: %s", e)
                else:
                    log.debug("poll failed", exc_info=True)
            due = every
        del eng
        time.sleep(min(max(due, 0.05), every))
