"""Remote engines: the same chat API, slots and events on a serving engine.

``nbkv.connect(url)`` detects the server kind and returns:

- :class:`LlamaServerEngine` for llama-server (``/props`` answers). nbkv keeps its own
  session → slot table and its IMC policy; it renders the chat template in the kernel (checked
  once against the server's ``/apply-template``), tokenizes with the server's ``/tokenize``
  (so token ids always agree), and sends ``/completion`` with the token prompt pinned to a
  slot (``id_slot``, ``cache_prompt``, ``n_cache_reuse: 0``). The server's
  ``timings.cache_n`` is what was reused; when it differs from what nbkv expected from its
  slot table, the record and the slot say "not verified", nothing is assumed.
- :class:`OpenAIEngine` for any OpenAI-compatible server (vLLM, SGLang, llama-server's
  ``/v1``): ``/v1/chat/completions`` with streaming and ``usage``; the reused tokens are
  ``usage.prompt_tokens_details.cached_tokens``; slots are the server's own business.

Each request runs on its own thread; interrupting the stream closes the HTTP connection (the
server cancels the task) and keeps the partial reply, as the in-kernel engine does.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import policy, reasons
from .chat_api import ChatAPI, TemplatedAPI, request_totals
from .engine import SlotInfo, thrashing
from .errors import (
    EngineClosedError,
    InvalidRequestError,
    MediaError,
    NbkvError,
    ServerError,
    ServerUnsupportedError,
    SlotTimeoutError,
    TemplateMismatchError,
)
from .events import (
    EventBus,
    Progress,
    RequestFinished,
    RequestRecord,
    RequestStarted,
    SlotsChanged,
    message_segments,
)
from .http_client import EventStream, ServerClient
from .media import contains_images
from .messages import normalize, prefix_hashes
from .prompt import Prompt, PromptBuilder
from .sampling import SamplingParams
from .streams import ChatStream
from .templates import ChatTemplate

log = logging.getLogger("nbkv.remote")

#: a KV position whose token the server did not send (decoded after an interrupt)
UNKNOWN = -1
#: seconds between two ``/slots`` polls (slot cards, "not verified" detection)
POLL_INTERVAL = 1.0
#: a conversation used to check the kernel's template rendering against the server's
PROBE = ({"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Name a colour."})


def connect(url: str, *, slots: int | None = None, api_key: str | None = None,
            kind: str | None = None, min_tokens: int = 100, timeout: float = 600.0
            ) -> LlamaServerEngine | OpenAIEngine:
    """A remote engine for the server at ``url``.

    ``kind``: ``"llama-server"`` or ``"openai"`` (default: detected; llama-server answers
    ``/props``). ``slots``: how many of llama-server's slots nbkv uses (default: all).
    ``api_key``: sent as a bearer token.
    """
    client = ServerClient(url, api_key, read_timeout=timeout)
    try:
        if kind not in (None, "llama-server", "openai"):
            raise InvalidRequestError(f"kind must be 'llama-server' or 'openai', not {kind!r}")
        props = None
        if kind in (None, "llama-server"):
            try:
                props = client.get("/props", timeout=10.0)
            except ServerUnsupportedError:
                if kind == "llama-server":
                    raise
            except ServerError as e:
                if e.status is None or kind == "llama-server":
                    raise  # nothing answers at all: say so, rather than guess another kind
        if isinstance(props, dict) and "total_slots" in props:
            return LlamaServerEngine(client, props, slots=slots, min_tokens=min_tokens)
        if kind == "llama-server":
            raise ServerUnsupportedError(f"{client.url}/props is not llama-server's")
        if slots is not None:
            raise InvalidRequestError("--slots applies to llama-server only: an OpenAI-"
                                      "compatible server manages its own cache")
        return OpenAIEngine(client)
    except BaseException:
        client.close()
        raise


class _Job:
    """A request in flight: what :class:`~nbkv.streams.ChatStream` reads."""

    _ids = itertools.count(1)

    def __init__(self, session: str | None, params: SamplingParams, timeout: float) -> None:
        self.id = next(self._ids)
        self.session = session
        self.params = params
        self.deadline = time.monotonic() + timeout
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.record: RequestRecord | None = None
        self.stream: EventStream | None = None
        self.t_submit = time.perf_counter()
        self.t_first = 0.0
        self.text = ""
        self.generated: list[int] = []


class _RemoteBase(ChatAPI):
    """Requests on threads, events, history, close: what both remote kinds share."""

    kind = "remote"

    def __init__(self, client: ServerClient) -> None:
        self.client = client
        self.url = client.url
        self.events = EventBus()
        self._cv = threading.Condition()
        self._jobs: set[_Job] = set()
        self._closed = False
        self.wait_timeout = 600.0
        self.last_save: Any = None  # reports of %kvcache save / restore (llama-server)
        self.last_restore: Any = None

    def chat(self, messages: Sequence[Mapping[str, Any]], session: str | None = None, *,
             stream: bool = False, overflow: str | None = None, timeout: float | None = None,
             **sampling: Any) -> Any:
        """Reply to ``messages``, like :meth:`nbkv.engine.Engine.chat`, on the server."""
        self._check_request(session, timeout)
        if self._closed:
            raise EngineClosedError("the remote engine was closed; connect again")
        t0 = time.perf_counter()
        params = SamplingParams.from_kwargs(**sampling)
        prepared = self._prepare(messages, overflow or "error", params.max_tokens)
        job = _Job(session, params, self.wait_timeout if timeout is None else timeout)
        job.t_submit = t0
        with self._cv:
            self._jobs.add(job)
        threading.Thread(target=self._run, args=(job, prepared), name="nbkv-remote",
                         daemon=True).start()
        s = ChatStream(self, job)  # type: ignore[arg-type]
        return s if stream else s.result()

    def _prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str,
                 max_tokens: int) -> Any:
        raise NotImplementedError

    def _serve(self, job: _Job, prepared: Any) -> RequestRecord:
        """Run the request; return its final record, or raise (the record set on ``job``)."""
        raise NotImplementedError

    def _run(self, job: _Job, prepared: Any) -> None:
        """The request's thread: serve it, then hand the record (or the error) to the stream."""
        error: BaseException | None = None
        try:
            self._serve(job, prepared)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's stream
            error = e
            log.debug("request %d failed: %s", job.id, e)
        finally:
            with self._cv:
                self._jobs.discard(job)
                self._cv.notify_all()
        if job.record is not None:
            self.events.publish(RequestFinished(job.record))
        job.out.put(("error", error) if error is not None else ("done", job.record))
        job.done.set()

    def _events(self, job: _Job, path: str, body: dict[str, Any]
                 ) -> Iterator[dict[str, Any]]:
        """The answer's events until the request is cancelled; the stream is closed after.

        Raises what reading raised (a named server error, or ``KeyboardInterrupt``).
        """
        try:
            job.stream = self.client.stream(path, body)
            for ev in job.stream:
                if job.cancel.is_set():
                    return
                yield ev
        finally:
            if job.stream is not None:
                job.stream.close()

    def _wake(self) -> None:
        """Close the HTTP streams of cancelled requests (called by ``ChatStream.close``)."""
        with self._cv:
            jobs = list(self._jobs)
        for j in jobs:
            if j.cancel.is_set() and j.stream is not None and not j.stream.closed:
                j.stream.close()

    def _delta(self, job: _Job, text: str) -> None:
        if text:
            if not job.t_first:
                job.t_first = time.perf_counter()
            job.text += text
            job.out.put(("delta", text))

    def close(self) -> None:
        """Cancel requests in flight and close the connection (the server keeps running)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._jobs)
        for j in jobs:
            j.cancel.set()
        self._wake()
        for j in jobs:
            j.done.wait(10.0)
        self.client.close()
        self.events.publish(SlotsChanged("closed"))

    def __enter__(self) -> _RemoteBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def explain(self, request: int | None = None) -> reasons.Explanation:
        """Why request ``request`` reused what it did (see :meth:`nbkv.engine.Engine.explain`)."""
        raise InvalidRequestError(f"explain needs nbkv's own slot table: not available for a "
                                  f"{self.kind} engine")


# ---------------------------------------------------------------------- llama-server


class ServerVocab:
    """The server's tokenizer, as :class:`~nbkv.prompt.PromptBuilder` uses a model's."""

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
class _Slot:
    """What nbkv knows of one server slot: the tokens it expects the server's KV to hold."""

    index: int
    capacity: int
    tokens: list[int] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)
    msg_ends: list[int] = field(default_factory=list)
    session: str | None = None
    last_used: int = 0
    pending: bool = False
    segments: tuple = ()
    last_request: int | None = None
    known: bool = True  # False after a failure: the server's content is not known
    verified: bool = True
    note: str = ""
    server_tokens: int | None = None  # n_prompt_tokens at the last /slots poll
    version: int = 0  # bumped when a request takes or leaves the slot (stale polls skip it)

    def snapshot(self) -> SlotInfo:
        return SlotInfo(self.index, self.index, self.capacity, self.session, tuple(self.tokens),
                        tuple(self.hashes), tuple(self.msg_ends), self.last_used, self.pending,
                        self.segments, self.last_request, len(self.tokens), memory="server",
                        verified=self.verified, note=self.note)

    def forget(self, note: str = "") -> None:
        self.tokens, self.hashes, self.msg_ends, self.segments = [], [], [], ()
        self.session = None
        self.known = not note
        self.verified = not note
        self.note = note
        self.version += 1


class LlamaServerEngine(TemplatedAPI, _RemoteBase):
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
                f"(python -m nbkv.server --slots {n})")
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
        self._slots = [_Slot(i, self.n_ctx) for i in range(n)]
        self._clock = itertools.count(1)
        self._whereabouts: dict[str, reasons.Whereabouts] = {}
        self._compared: OrderedDict[int, tuple[tuple, tuple]] = OrderedDict()
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
            for s in self._slots:
                if s.server_tokens:
                    s.known, s.verified = False, False
                    s.note = (f"holds {s.server_tokens} tokens from before nbkv connected; "
                              f"the next request here re-verifies it")

    @property
    def n_slots(self) -> int:
        """Slots nbkv uses (at most the server's ``total_slots``)."""
        return len(self._slots)

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
        with self._cv:
            return tuple(s.snapshot() for s in self._slots)

    def clear(self, slot: int | None = None) -> None:
        """Erase one slot (or all) on the server (``/slots/N?action=erase``) and in the table."""
        if slot is not None and not 0 <= slot < len(self._slots):
            raise InvalidRequestError(f"no slot {slot}: slots are 0..{len(self._slots) - 1}")
        targets = self._slots if slot is None else [self._slots[slot]]
        with self._cv:
            if slot is not None and targets[0].pending:
                raise NbkvError(f"slot {slot} is serving a request; cancel it first")
            targets = [s for s in targets if not s.pending]
        for s in targets:
            try:
                self.client.post(f"/slots/{s.index}", {}, timeout=30.0, action="erase")
            except ServerUnsupportedError as e:
                raise ServerUnsupportedError(
                    "the server cannot erase slots: start it with --slot-save-path DIR "
                    "(python -m nbkv.server does)", e.status) from e
            with self._cv:
                if s.session is not None and s.tokens:
                    self._whereabouts[s.session] = reasons.Whereabouts(
                        s.last_request or 0, reasons.CLEARED)
                s.forget()
        self.events.publish(SlotsChanged("cleared"))

    def save(self, path: str | None = None, sessions: Any = None) -> Any:
        """Have the server save its slots, and nbkv its table (see :mod:`nbkv.remote_persist`)."""
        from .remote_persist import save

        return save(self, path, sessions)

    def restore(self, path: str | None = None, sessions: Any = None) -> Any:
        """Bring a save back into the server's slots and nbkv's table, checked first."""
        from .remote_persist import restore

        return restore(self, path, sessions)

    def explain(self, request: int | None = None) -> reasons.Explanation:
        """Why request ``request`` (default: the latest) reused what it did."""
        return reasons.explain_request(self.history, self._compared, self.vocab.detokenize,
                                       request)

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
            versions = [s.version for s in self._slots]
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
            stale = {s.index for s in self._slots if s.version != versions[s.index]}
            self.server_slots = list(data) if isinstance(data, list) else []
            for info in self.server_slots:
                i = info.get("id")
                if not isinstance(i, int) or not 0 <= i < len(self._slots):
                    continue
                s = self._slots[i]
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

    def _place(self, job: _Job, p: Prompt) -> tuple[_Slot, policy.Plan, SlotInfo | None]:
        """Wait for a free slot and choose it with nbkv's policy (no donor copies on a server)."""
        with self._cv:
            while True:
                if self._closed:
                    raise EngineClosedError("the remote engine was closed")
                snaps = [s.snapshot() for s in self._slots]
                plan = policy.select(snaps, p.tokens, p.hashes, job.session,
                                     self.cache_min_tokens)
                if plan is not None:
                    break
                left = job.deadline - time.monotonic()
                if left <= 0:
                    raise SlotTimeoutError(f"every slot stayed busy for {self.wait_timeout} s")
                self._cv.wait(min(left, 0.5))
            if plan.donor is not None:  # llama-server cannot copy a prefix between slots
                t = snaps[plan.slot]
                reuse = min(policy.common_prefix(t.tokens, p.tokens), max(len(p.tokens) - 1, 0))
                plan = policy.Plan(policy.MISS, t.index, reuse,
                                   evicted=t.session if t.tokens else None,
                                   evicted_tokens=len(t.tokens) - reuse if t.tokens else 0)
            slot = self._slots[plan.slot]
            slot.pending = True
            slot.version += 1
            own = max((s for s in snaps if s.session == job.session and s.tokens
                       and job.session is not None), key=lambda s: s.last_used, default=None)
        return slot, plan, own

    def _serve(self, job: _Job, p: Prompt) -> RequestRecord:
        slot, plan, own = self._place(job, p)
        try:
            return self._complete(job, p, slot, plan, own)
        finally:
            with self._cv:
                slot.pending = False
                self._cv.notify_all()

    def _complete(self, job: _Job, p: Prompt, slot: _Slot, plan: policy.Plan,
                  own: SlotInfo | None) -> RequestRecord:
        prev_len = len(slot.tokens)
        expected = plan.reuse if slot.known else None
        why = reasons.explain(
            session=job.session,
            trace=self._whereabouts.get(job.session) if job.session is not None else None,
            own=reasons.Cached(own.tokens, own.hashes, own.msg_ends) if own else None,
            tokens=p.tokens, hashes=p.hashes, ends=p.ends,
            roles=[m["role"] for m in p.messages], reuse=plan.reuse, wanted=plan.reuse,
            donor_session=None, dropped=p.dropped, can_trim=True)
        self._compared[job.id] = (tuple(own.tokens if own else slot.tokens), tuple(p.tokens))
        while len(self._compared) > reasons.EXPLAINED:
            self._compared.popitem(last=False)
        with self._cv:
            if plan.evicted is not None and plan.evicted != job.session:
                self._whereabouts[plan.evicted] = reasons.Whereabouts(
                    self._whereabouts.get(plan.evicted, reasons.Whereabouts(0)).request,
                    reasons.EVICTED, job.session, job.id)
            if job.session is not None:
                self._whereabouts[job.session] = reasons.Whereabouts(job.id)
            slot.session = job.session
            slot.last_used = next(self._clock)
            slot.last_request = job.id
        record = RequestRecord(
            id=job.id, session=job.session, strategy=plan.strategy, slot=slot.index,
            prompt_tokens=len(p.tokens), reused_tokens=plan.reuse,
            prefilled_tokens=len(p.tokens) - plan.reuse,
            trimmed_tokens=max(prev_len - plan.reuse, 0), evicted_session=plan.evicted,
            evicted_tokens=plan.evicted_tokens, matched_messages=plan.matched_messages,
            dropped_messages=p.dropped, capacity=slot.capacity, started_at=time.time(),
            segments=message_segments(p.messages, p.ends, len(p.tokens), plan.reuse,
                                      len(p.tokens), ""),
            reason=why.code, reason_text=why.text, divergence=why.divergence)
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
            error = ServerError(f"{self.url}/completion: the answer ended without its final "
                                f"event (the server stopped?)")
            finish = "error"
        now = time.perf_counter()
        t = final.get("timings") or {}
        told = int(t["cache_n"]) if "cache_n" in t else seen_cache  # what the server said
        reused = plan.reuse if told is None else told
        verified, note = True, ""
        if told is not None and expected is not None and reused != expected:
            verified = False
            note = (f"the server reused {reused} tokens where nbkv expected {expected}: "
                    f"another client used slot {slot.index}, or the server cleared it")
        elif told is not None and expected is None:
            note = f"slot {slot.index}'s content was unknown (after an error); now known again"
        self._settle(slot, p, job, final, error, reused, verified, note)
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
            finish_reason=finish, verified=verified, note=note,
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

    def _settle(self, slot: _Slot, p: Prompt, job: _Job, final: Mapping[str, Any],
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
            slot.tokens = held[:n]
            full = [h for h, e in zip(p.hashes, p.ends) if e <= n]
            if n >= len(p.tokens):
                full = prefix_hashes(p.messages + [{"role": "assistant", "content": job.text}],
                                     full)
                slot.msg_ends = p.ends + [len(p.tokens)]
            else:
                slot.msg_ends = p.ends[: len(full)]
            slot.hashes = full
            slot.segments = message_segments(p.messages, p.ends, len(p.tokens),
                                              min(reused, n), n, job.text)
            slot.known, slot.verified, slot.note = True, verified, note if not verified else ""
            slot.server_tokens = n
            slot.last_used = next(self._clock)
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
        if eng is None or eng._closed:
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


# ---------------------------------------------------------------------- OpenAI-compatible


class OpenAIEngine(_RemoteBase):
    """An OpenAI-compatible server: the server keeps its own cache; nbkv shows what it did."""

    kind = "openai"
    n_ctx = 0
    cache = "server"
    cache_min_tokens = 0

    def __init__(self, client: ServerClient, model: str | None = None) -> None:
        super().__init__(client)
        self.model_name = model or ""
        if not self.model_name:
            try:
                models = client.get("/v1/models", timeout=10.0)
                data = models.get("data") or [] if isinstance(models, dict) else []
                self.model_name = data[0]["id"] if data else ""
            except ServerUnsupportedError:
                pass
        self.reports_cache: bool | None = None  # does usage carry cached_tokens?

    @property
    def n_slots(self) -> int:
        """0: the server manages its own slots."""
        return 0

    def slots(self) -> tuple[SlotInfo, ...]:
        """No slots of nbkv's: the server manages them (sessions only)."""
        return ()

    def clear(self, slot: int | None = None) -> None:
        """Nothing to clear on nbkv's side: the server manages its cache."""
        raise InvalidRequestError("the server manages its own cache: nothing to clear here")

    def stats(self) -> dict[str, Any]:
        """Totals over the history."""
        return {**request_totals(self.history), "server_reports_cache": self.reports_cache}

    def _prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str,
                 max_tokens: int) -> list[dict[str, Any]]:
        if overflow != "error":
            raise InvalidRequestError("overflow='slide' needs nbkv's tokenizer: not available "
                                      "on an OpenAI-compatible server")
        return [_openai_message(m) for m in normalize(messages)]

    def _serve(self, job: _Job, messages: list[dict[str, Any]]) -> RequestRecord:
        prm = job.params
        body: dict[str, Any] = {
            "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": prm.max_tokens, "temperature": prm.temperature, "top_p": prm.top_p,
        }
        if self.model_name:
            body["model"] = self.model_name
        if prm.seed != SamplingParams().seed:
            body["seed"] = prm.seed
        if prm.stop:
            body["stop"] = list(prm.stop)
        self.events.publish(RequestStarted(RequestRecord(
            job.id, job.session, "server", -1, 0, 0, 0, 0, started_at=time.time())))
        usage: dict[str, Any] = {}
        finish, error = "cancelled", None
        try:
            for ev in self._events(job, "/v1/chat/completions", body):
                for choice in ev.get("choices") or ():
                    self._delta(job, (choice.get("delta") or {}).get("content") or "")
                    if choice.get("finish_reason"):
                        finish = "length" if choice["finish_reason"] == "length" else "stop"
                if ev.get("usage"):
                    usage = ev["usage"]
        except BaseException as e:
            error = e
            finish = "cancelled" if isinstance(e, KeyboardInterrupt) else "error"
        now = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if usage:
            self.reports_cache = cached is not None
        prompt = int(usage.get("prompt_tokens") or 0)
        reused = int(cached or 0)
        note = "" if cached is not None or not usage else (
            "the server does not report cached tokens: start vLLM with "
            "--enable-prompt-tokens-details, SGLang with --enable-cache-report")
        rec = RequestRecord(
            id=job.id, session=job.session, strategy="server", slot=-1, prompt_tokens=prompt,
            reused_tokens=reused, prefilled_tokens=max(prompt - reused, 0), trimmed_tokens=0,
            generated_tokens=int(usage.get("completion_tokens") or 0) or len(job.text.split()),
            ttft_s=(job.t_first - job.t_submit) if job.t_first else 0.0,
            decode_s=(now - job.t_first) if job.t_first else 0.0, finish_reason=finish,
            started_at=time.time(), verified=cached is not None, note=note,
            reason="server", reason_text="the server chose what to reuse (its own prefix cache)",
            error=None if error is None else f"{type(error).__name__}: {error}")
        job.record = rec
        if error is not None:
            raise error
        return rec

    def describe(self) -> list[tuple[str, str]]:
        """Status rows: server, model, cache."""
        cache = {None: "not known yet", True: "reports cached prompt tokens",
                 False: "does not report cached tokens"}[self.reports_cache]
        return [("server", f"OpenAI-compatible at {self.url}"),
                ("model", self.model_name or "?"),
                ("slots", "managed by the server (sessions only)"),
                ("cache", f"the server's own prefix cache; it {cache}")]


def _openai_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message for ``/v1/chat/completions``: text, or parts with images as data URLs."""
    content = m.get("content")
    if isinstance(content, str):
        return {"role": m["role"], "content": content}
    from .media import to_data_url

    parts = []
    for part in content or ():
        if part.get("type") == "text":
            parts.append({"type": "text", "text": part.get("text", "")})
        else:
            parts.append({"type": "image_url", "image_url": {"url": to_data_url(part)}})
    return {"role": m["role"], "content": parts}
