"""llama-server driven by nbkv's slot table and IMC policy (see :mod:`nbkv.remote.connect`)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nbkv.core.api import TemplatedAPI, request_totals, thrashing
from nbkv.core.errors import (
    EngineClosedError,
    IncompleteReplyError,
    MediaError,
    ServerError,
    ServerUnsupportedError,
    SlotTimeoutError,
    TemplateMismatchError,
)
from nbkv.core.events import (
    Progress,
    RequestRecord,
    RequestStarted,
    SlotsChanged,
)
from nbkv.core.messages import normalize
from nbkv.kv import policy, reasons
from nbkv.kv.segments import message_segments
from nbkv.kv.slot_table import SlotInfo, SlotState, SlotTable, TableSlot
from nbkv.media.messages import contains_images
from nbkv.prompt.builder import Prompt, PromptBuilder
from nbkv.prompt.templates import ChatTemplate
from nbkv.remote.base import POLL_INTERVAL, PROBE, UNKNOWN, RemoteBase, RemoteJob
from nbkv.remote.http_client import ServerClient

log = logging.getLogger("nbkv.remote.connect")

#: a KV position whose token the server did not send (decoded after an interrupt)


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


@dataclass
class _Slot(TableSlot):
    """What nbkv knows of one server slot: the tokens it expects the server's KV to hold."""

    held: list[int] = field(default_factory=list)
    known: bool = True  # False after a failure: the server's content is not known
    verified: bool = True
    note: str = ""
    server_tokens: int | None = None  # n_prompt_tokens at the last /slots poll
    version: int = 0  # bumped when a request takes or leaves the slot (stale polls skip it)

    @property
    def tokens(self) -> list[int]:
        return self.held

    def snapshot(self) -> SlotInfo:
        return SlotInfo(self.index, self.index, self.capacity, self.session, tuple(self.held),
                        tuple(self.hashes), tuple(self.msg_ends), self.last_used, self.pending,
                        self.segments, self.last_request, len(self.held), memory="server",
                        verified=self.verified, note=self.note)

    def forget(self, note: str = "") -> None:
        self.held = []
        self.forget_messages()
        self.known = not note
        self.verified = not note
        self.note = note
        self.version += 1


class LlamaServerEngine(TemplatedAPI, RemoteBase):
    """llama-server slots driven by nbkv's session table and IMC policy (see module doc)."""

    kind = "llama-server"

    def __init__(self, client: ServerClient, props: Mapping[str, Any], *,
                 slots: int | None = None, min_tokens: int = 100,
                 poll_interval: float = POLL_INTERVAL) -> None:
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
        self.has_slots_endpoint = bool(props.get("endpoint_slots", True))
        self.has_metrics = bool(props.get("endpoint_metrics", False))
        self.table: SlotTable[_Slot] = SlotTable([_Slot(i, self.n_ctx) for i in range(n)],
                                                 self._cv)
        self.server_slots: list[dict[str, Any]] = []
        self._poll_every = poll_interval
        self._last_poll = 0.0
        self._adopt()
        self._poller = threading.Thread(target=_poll_loop, args=(weakref.ref(self),),
                                        name="nbkv-remote-poll", daemon=True)
        self._poller.start()

    def _adopt(self) -> None:
        """At connect: slots the server already fills hold what nbkv does not know."""
        self.poll()
        with self._cv:
            for s in self.table.slots:
                if s.server_tokens:
                    s.known, s.verified = False, False
                    s.note = (f"holds {s.server_tokens} tokens from before nbkv connected; "
                              f"the next request here re-verifies it")

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

    def busy_slots(self) -> list[int]:
        """Slots serving a request now."""
        with self._cv:
            return [s.index for s in self.table if s.pending]

    def forget_slot(self, index: int, note: str) -> None:
        """Mark slot ``index``'s content unknown (``note`` says why)."""
        with self._cv:
            self.table[index].forget(note)

    def import_slots(self, states: Sequence[SlotState]) -> None:
        """Record that the server's slots now hold ``states`` (``kv``: their tokens)."""
        with self._cv:
            for st in states:
                slot = self.table[st.index]
                slot.held = list(st.kv)
                self.table.adopt(slot, st)
                slot.known, slot.verified, slot.note = True, True, ""
                slot.server_tokens = len(slot.held)
                slot.version += 1

    def save(self, path: str | None = None, sessions: Any = None) -> Any:
        """Have the server save its slots, and nbkv its table (see :mod:`nbkv.remote.persist`)."""
        from nbkv.remote.persist import save

        return save(self, path, sessions)

    def restore(self, path: str | None = None, sessions: Any = None, *,
                trust: bool = False) -> Any:
        """Bring a save back into the server's slots and nbkv's table, checked first.

        A save not signed by your key is refused unless ``trust``.
        """
        from nbkv.remote.persist import restore

        return restore(self, path, sessions, trust=trust)

    def explain(self, request: int | None = None) -> reasons.Explanation:
        """Why request ``request`` (default: the latest) reused what it did."""
        return self.table.explain(self.history, self.vocab.detokenize, request)

    def stats(self) -> dict[str, Any]:
        """Totals over the history, plus the server's own counters (``/metrics``)."""
        h = self.history
        return {**request_totals(h),
                "not_verified": sum(1 for r in h if not r.verified),
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

    def poll(self) -> bool:
        """Read ``/slots`` now: mark slots whose server content differs from the table.

        Returns True when a slot's state changed. Called by the poller thread at most every
        ``POLL_INTERVAL`` seconds, and after each request.
        """
        if not self.has_slots_endpoint:
            return False
        with self._cv:
            versions = [s.version for s in self.table.slots]
        try:
            data = self.client.get("/slots", timeout=5.0)
        except ServerUnsupportedError:
            self.has_slots_endpoint = False
            return False
        except ServerError as e:
            log.debug("/slots poll failed: %s", e)
            return False
        self._last_poll = time.monotonic()
        changed = False
        with self._cv:
            stale = {s.index for s in self.table.slots if s.version != versions[s.index]}
            self.server_slots = list(data) if isinstance(data, list) else []
            for info in self.server_slots:
                i = info.get("id")
                if not isinstance(i, int) or not 0 <= i < len(self.table.slots):
                    continue
                s = self.table.slots[i]
                if i in stale:  # a request came or went while the answer was on its way
                    continue
                n = info.get("n_prompt_tokens")
                s.server_tokens = n if isinstance(n, int) else None
                if s.pending or not s.known:
                    continue
                if info.get("is_processing"):
                    note = "another client is using this slot"
                elif s.server_tokens is not None and s.server_tokens != len(s.tokens):
                    note = (f"the server holds {s.server_tokens} tokens where nbkv expects "
                            f"{len(s.tokens)}: another client or the server changed it")
                else:
                    continue
                if s.verified or s.note != note:
                    s.verified, s.note, changed = False, note, True
        if changed:
            self.events.publish(SlotsChanged("server"))
        return changed

    # ------------------------------------------------------------------ a request

    def _prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str,
                 max_tokens: int) -> Prompt:
        if contains_images(normalize(messages)):
            raise MediaError("images over a llama-server engine are not supported yet: "
                             "connect with kind='openai' (the server's /v1 takes images), or "
                             "load the model in the kernel with --mmproj")
        return self.builder.prepare(messages, overflow, max_tokens)

    def _place(self, job: RemoteJob, p: Prompt) -> tuple[_Slot, policy.Plan, SlotInfo | None]:
        """Wait for a free slot and choose it with nbkv's policy (no donor copies on a server)."""
        with self._cv:
            while True:
                if self.closed:
                    raise EngineClosedError("the remote engine was closed")
                snaps = self.table.snapshots()
                plan = self.table.place(snaps, p, job.session, cache="imc",
                                        min_tokens=self.cache_min_tokens, copies=False)
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
            return self._complete(job, p, slot, plan, own)
        finally:
            with self._cv:
                slot.pending = False
                self._cv.notify_all()

    def _complete(self, job: RemoteJob, p: Prompt, slot: _Slot, plan: policy.Plan,
                  own: SlotInfo | None) -> RequestRecord:
        prev_len = len(slot.tokens)
        expected = plan.reuse if slot.known else None
        why = self.table.reason(job.id, p, job.session, own, slot.tokens, reuse=plan.reuse,
                                wanted=plan.reuse)
        self.table.claim(slot, job.id, job.session, p, plan.reuse, plan.evicted)
        record = self.table.record(
            job.id, job.session, p, slot, plan, plan.reuse, why,
            prefilled_tokens=len(p.tokens) - plan.reuse,
            trimmed_tokens=max(prev_len - plan.reuse, 0),
            segments=message_segments(p.messages, p.ends, len(p.tokens), plan.reuse,
                                      len(p.tokens), ""))
        self.events.publish(RequestStarted(record))
        prm = job.params
        body: dict[str, Any] = {
            "prompt": list(p.tokens), "id_slot": slot.index, "cache_prompt": True,
            "stream": True, "return_progress": True, "return_tokens": True, "n_cache_reuse": 0,
            "n_predict": prm.max_tokens, "temperature": prm.temperature, "top_k": prm.top_k,
            "top_p": prm.top_p, "min_p": prm.min_p, "repeat_penalty": prm.repeat_penalty,
            "repeat_last_n": prm.repeat_last_n, "seed": prm.seed, "stop": list(prm.stop),
        }
        final: dict[str, Any] = {}
        seen_cache: int | None = None  # the server's cached count, from its progress events
        finish = "cancelled"
        error: BaseException | None = None
        try:
            for ev in self._events(job, "/completion", body):
                pp = ev.get("prompt_progress")
                if pp:  # (its "tokens" field is a placeholder, not a generated token)
                    seen_cache = int(pp["cache"])
                    done, total = pp["processed"] - pp["cache"], pp["total"] - pp["cache"]
                    self.events.publish(Progress(job.id, slot.index, "extend" if pp["cache"]
                                                 else "rebuild", done, total))
                    continue
                self._delta(job, ev.get("content") or "")
                job.generated.extend(ev.get("tokens") or ())
                if job.t_first and ev.get("tokens"):
                    self.events.publish(Progress(job.id, slot.index, "generate",
                                                 len(job.generated), prm.max_tokens))
                if ev.get("stop"):
                    final = ev
                    finish = {"limit": "length"}.get(ev.get("stop_type", ""), "stop")
                    break
        except BaseException as e:
            error = e
            finish = "cancelled" if isinstance(e, KeyboardInterrupt) else "error"
        if error is None and not final and not job.cancel.is_set():
            error = IncompleteReplyError(f"{self.url}/completion: the answer ended without "
                                         f"its final event (the server stopped?)", job.text)
            finish = "error"
        now = time.perf_counter()
        t = final.get("timings") or {}
        told = int(t["cache_n"]) if "cache_n" in t else seen_cache  # what the server said
        reused = plan.reuse if told is None else told
        verified, note, restored = True, "", {}
        if told is not None and expected is not None and expected < reused <= len(p.tokens):
            # the server found a longer prefix of this prompt in its --cache-ram (its host-
            # memory prompt cache, llama-server's parking lot) and loaded it into the slot
            note = (f"the server restored {reused:,} tokens from its --cache-ram into slot "
                    f"{slot.index}, which held {expected:,} of them")
            restored = dict(restored_from="server-ram", restored_tokens=reused,
                            reason=reasons.RESTORED, reason_text=note, divergence=None)
        elif told is not None and expected is not None and reused != expected:
            verified = False
            note = (f"the server reused {reused} tokens where nbkv expected {expected}: "
                    f"another client used slot {slot.index}, or the server cleared it")
        elif told is not None and expected is None:
            note = f"slot {slot.index}'s content was unknown (after an error); now known again"
        self._record_held(slot, p, job, final, error, reused, verified, note)
        rec = replace(
            record, reused_tokens=reused,
            prefilled_tokens=int(t.get("prompt_n", len(p.tokens) - reused)) if final else 0,
            trimmed_tokens=max(prev_len - reused, 0),
            generated_tokens=int(t.get("predicted_n", len(job.generated))) if final
            else len(job.generated),
            ttft_s=(job.t_first - job.t_submit) if job.t_first else 0.0,
            prefill_s=float(t.get("prompt_ms", 0.0)) / 1000,
            decode_s=float(t.get("predicted_ms", 0.0)) / 1000 if final else (
                now - job.t_first if job.t_first else 0.0),
            finish_reason=finish, verified=verified, note=note, **restored,
            error=None if error is None else f"{type(error).__name__}: {error}",
            segments=message_segments(p.messages, p.ends, len(p.tokens), reused,
                                      len(slot.tokens) if slot.known else len(p.tokens),
                                      job.text),
        )
        if not verified:
            log.warning("request %d: %s", job.id, note)
        job.record = rec
        if error is not None:
            raise error
        return rec

    def _record_held(self, slot: _Slot, p: Prompt, job: RemoteJob, final: Mapping[str, Any],
                error: BaseException | None, reused: int, verified: bool, note: str) -> None:
        """Record what the slot now holds: the prompt and the reply tokens the server decoded.

        The last sampled token is never decoded into the KV. After an interruption the count
        comes from ``/slots``; after a failure the slot is marked unknown.
        """
        held = list(p.tokens) + job.generated
        n: int | None = len(held) - 1 if final and job.generated else (
            len(p.tokens) if final else None)
        if not final and error is None and self.has_slots_endpoint:  # interrupted
            n = self._server_length(slot.index)
            if n is not None and n > len(held):
                # the server decoded a few more tokens before it saw the connection close:
                # they are in its KV but not known here, and match no prompt token (-1)
                held += [UNKNOWN] * (n - len(held))
        with self._cv:
            if error is not None and not isinstance(error, KeyboardInterrupt) or n is None \
                    or n > len(held):
                slot.forget(f"slot {slot.index}: the last request failed, so its content is "
                            f"not known; the next request re-verifies it")
                slot.session = job.session
                return
            slot.held = held[:n]
            self.table.replied(slot, p, job.text, n)
            slot.segments = message_segments(p.messages, p.ends, len(p.tokens),
                                              min(reused, n), n, job.text)
            slot.known, slot.verified, slot.note = True, verified, note if not verified else ""
            slot.server_tokens = n
            slot.version += 1
            for info in self.server_slots:  # what /slots will say, until the next poll
                if info.get("id") == slot.index:
                    info.update(n_prompt_tokens=n, is_processing=False)

    def _server_length(self, index: int, wait: float = 5.0) -> int | None:
        """The slot's cached token count once the server has let it go (``/slots``)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                data = self.client.get("/slots", timeout=5.0)
            except ServerError:
                return None
            info = next((s for s in data if s.get("id") == index), None)
            if info is None:
                return None
            if not info.get("is_processing"):
                n = info.get("n_prompt_tokens")
                return n if isinstance(n, int) else None
            time.sleep(0.05)
        return None

    def describe(self) -> list[tuple[str, str]]:
        """Status rows: server, model, slots."""
        return [("server", f"llama-server at {self.url} ({self.build_info})"),
                ("model", self.model_name),
                ("slots", f"{self.n_slots} of the server's {self.total_slots} x {self.n_ctx} "
                          f"tokens, pinned by nbkv (id_slot)"),
                ("cache", f"imc on the server's slots (min {self.cache_min_tokens} tokens); "
                          f"no prefix copies between slots (no server API)")]


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
            except Exception:  # noqa: BLE001 - a poll must never kill the thread
                log.debug("poll failed", exc_info=True)
            due = every
        del eng
        time.sleep(min(max(due, 0.05), every))
