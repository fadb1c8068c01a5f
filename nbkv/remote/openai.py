"""Any OpenAI-compatible server (vLLM, SGLang, llama-server's ``/v1``): its cache, its slots.

The server keeps its own prefix cache; nbkv shows what it did. Each record's reused tokens
are the server's ``usage.prompt_tokens_details.cached_tokens``. On vLLM nbkv also learns:

- its block size and cache counters from ``/metrics`` (:mod:`nbkv.remote.server_cache`):
  the KV map draws each request in the server's blocks, since vLLM caches whole blocks only;
  ``%kvcache stats`` adds its prefix-cache queries and hits;
- the prompt's and the reply's token ids (``return_token_ids``), and where each message
  ends (``/tokenize``), so a request's map shows which message the cached part ends in;
- with ``--kv-events-config``, the blocks it stores and evicts, live
  (:class:`~nbkv.remote.server_cache.KVEventListener`): which blocks of each conversation
  the server holds now.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbkv.core.api import request_totals
from nbkv.core.errors import (
    IncompleteReplyError,
    InvalidRequestError,
    MediaError,
    ServerError,
    ServerUnsupportedError,
)
from nbkv.core.events import (
    RequestRecord,
    RequestStarted,
    Segment,
    SlotsChanged,
)
from nbkv.core.messages import normalize
from nbkv.core.streams import SamplingParams
from nbkv.kv.slot_table import Conversation, SlotInfo, message_segments
from nbkv.media.messages import contains_images
from nbkv.remote.base import RemoteBase, RemoteJob
from nbkv.remote.http_client import ServerClient
from nbkv.remote.server_cache import (
    CacheFacts,
    KVEventListener,
    block_segments,
    cache_facts,
    cacheable,
    event_source,
    read_metrics,
    replay_endpoint,
    subscribe_endpoint,
)

log = logging.getLogger("nbkv.remote.connect")

#: message-prefix token counts kept (per engine) so a turn tokenizes only its new messages
ENDS_KEPT = 4096


@dataclass
class _Row:
    """One session's latest request on the server: the tokens it left there, and its map."""

    index: int
    session: str | None
    tokens: tuple[int, ...]
    ends: tuple[int, ...]
    segments: tuple[Segment, ...]
    request: int
    verified: bool
    note: str


class OpenAIEngine(RemoteBase):
    """An OpenAI-compatible server: the server keeps its own cache; nbkv shows what it did."""

    kind = "openai"
    cache = "server"
    cache_min_tokens = 0

    def __init__(self, client: ServerClient, model: str | None = None) -> None:
        super().__init__(client)
        models = self._probe(client)
        first = models[0] if models else {}
        self.model_name = model or str(first.get("id") or "")
        #: tokens a request may hold (vLLM's --max-model-len; 0: not said)
        self.n_ctx = int(first.get("max_model_len") or 0)
        self.reports_cache: bool | None = None  # does usage carry cached_tokens?
        self.server = self._server_name(first)
        self.facts = self.cache_facts()
        self.block_size = self.facts.block_size
        self.has_tokenize = self.server.startswith("vLLM")
        self._ends: OrderedDict[str, int] = OrderedDict()
        self._rows: dict[str | None, _Row] = {}
        self.listener: Any = None
        self.live_note = ""  # why there is no live block view, when there is none
        self._subscribe()

    def _server_name(self, model: Mapping[str, Any]) -> str:
        """``vLLM 0.32.0`` when the server says it is vLLM, else ``""``."""
        if model.get("owned_by") != "vllm":
            return ""
        try:
            ver = self.client.get("/version", timeout=5.0)
        except ServerError:
            ver = {}
        return f"vLLM {ver.get('version', '')}".strip() if isinstance(ver, dict) else "vLLM"

    @staticmethod
    def _probe(client: ServerClient) -> list[dict[str, Any]]:
        """The server's ``/v1/models`` list; refuse a server that is not OpenAI-compatible.

        A plain web server (a static file server, a notebook server) would otherwise be
        accepted here and fail at the first chat with an HTTP error that says nothing useful.
        """
        hint = ("is it an OpenAI-compatible LLM server (vLLM, SGLang, llama-server)? Check "
                "the URL and port")
        try:
            models = client.get("/v1/models", timeout=10.0)
        except ServerUnsupportedError as e:
            raise ServerUnsupportedError(
                f"{client.url} is not an OpenAI-compatible server: GET /v1/models answered "
                f"HTTP {e.status}; {hint}", e.status) from e
        data = models.get("data") if isinstance(models, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
            raise ServerUnsupportedError(
                f"{client.url} is not an OpenAI-compatible server: GET /v1/models answered "
                f"{str(models)[:60]!r}, not a model list; {hint}")
        return data

    @property
    def n_slots(self) -> int:
        """0: the server manages its own slots."""
        return 0

    def slots(self) -> tuple[SlotInfo, ...]:
        """No slots of nbkv's: the server manages them (sessions only)."""
        return ()

    def cache_rows(self) -> tuple[SlotInfo, ...]:
        """Per session, what its latest request left in the server's cache (the KV map's rows).

        ``index`` is the row (sessions in order of their first request), ``capacity`` the
        server's ``max_model_len``; with live KV events, ``server_cached`` is how many
        leading tokens the server's cache holds now.
        """
        with self._cv:
            rows = sorted(self._rows.values(), key=lambda r: r.index)
        mirror = self.listener.mirror if self.listener is not None else None
        return tuple(SlotInfo(
            r.index, -1, self.n_ctx, Conversation(r.session, r.tokens, (), r.ends, r.segments,
                                                  last_request=r.request), False,
            memory="server", verified=r.verified, note=r.note,
            server_cached=None if mirror is None else mirror.cached_prefix(r.tokens))
            for r in rows)

    def clear(self, slot: int | None = None) -> None:
        """Nothing to clear on nbkv's side: the server manages its cache."""
        raise InvalidRequestError("the server manages its own cache: nothing to clear here")

    def cache_facts(self) -> CacheFacts:
        """What the server's ``/metrics`` says of its cache now (empty when it has none)."""
        try:
            text = self.client.get("/metrics", timeout=5.0)
        except ServerError:
            return CacheFacts()
        return cache_facts(read_metrics(text)) if isinstance(text, str) else CacheFacts()

    def stats(self) -> dict[str, Any]:
        """Totals over the history, plus the server's prefix-cache counters (``/metrics``)."""
        out = {**request_totals(self.history), "server_reports_cache": self.reports_cache,
               **self.cache_facts().stats()}
        if self.listener is not None:
            m = self.listener.mirror
            out.update({"server blocks held now (KV events)": len(m),
                        "server blocks stored / evicted (KV events)": f"{m.stored} / "
                                                                      f"{m.removed}"})
        return out

    # ------------------------------------------------------------------ live KV events

    def _subscribe(self) -> None:
        """Follow the server's KV cache events when it publishes them (vLLM)."""
        if not self.server.startswith("vLLM"):
            return
        try:
            cfg = event_source(self.client.get("/kv_event_sources", timeout=5.0))
        except ServerError:
            cfg = None
        if cfg is None:
            self.live_note = ("start vLLM with --kv-events-config (docs/howto/vllm.md) for the "
                              "live block view")
            return
        endpoint, why = subscribe_endpoint(str(cfg["endpoint"]), self.url)
        if endpoint is None:
            self.live_note = why
            return
        try:
            self.listener = KVEventListener(endpoint, str(cfg.get("topic") or ""),
                                            on_change=self._blocks_changed,
                                            replay=replay_endpoint(cfg, self.url))
            self.listener.ready.wait(self.listener.replay_timeout + 1.0)
        except ImportError as e:
            self.live_note = f"the live block view needs pyzmq and msgpack ({e})"
        except Exception as e:  # noqa: BLE001 - the engine serves without its live view
            self.live_note = f"could not subscribe to {endpoint}: {e}"
        if self.listener is not None and self.block_size is None:
            self.block_size = self.listener.mirror.block_size

    def cached_now(self, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """How many tokens of ``messages``' prompt the server would reuse now (None: unknown).

        As its KV cache events tell: whole blocks, never the last prompt token. The prompt is
        tokenized by the server (``/tokenize``, with the generation prompt).
        """
        if self.listener is None or not self.has_tokenize:
            return None
        msgs = normalize(messages)
        try:
            ids = self.client.post("/tokenize", {
                "model": self.model_name, "messages": [_openai_message(m) for m in msgs],
                "add_generation_prompt": True}, timeout=10.0)["tokens"]
        except (ServerError, KeyError, TypeError):
            return None
        mirror = self.listener.mirror
        return min(mirror.cached_prefix(ids), cacheable(len(ids) - 1, mirror.block_size))

    def _blocks_changed(self) -> None:
        if self._rows:
            self.events.publish(SlotsChanged("server"))

    def close(self) -> None:
        """Cancel requests in flight, stop following KV events, close the connection."""
        super().close()
        if self.listener is not None:
            self.listener.close()

    # ------------------------------------------------------------------ a request

    def _prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str,
                 max_tokens: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        if overflow != "error":
            raise InvalidRequestError("overflow='slide' needs nbkv's tokenizer: not available "
                                      "on an OpenAI-compatible server")
        msgs = normalize(messages)
        return msgs, [_openai_message(m) for m in msgs]

    def _serve(self, job: RemoteJob, prepared: tuple[list[dict[str, Any]],
                                                     list[dict[str, Any]]]) -> RequestRecord:
        msgs, messages = prepared
        self.events.publish(RequestStarted(RequestRecord(
            job.id, job.session, "server", -1, 0, 0, 0, 0, started_at=time.time())))
        usage, prompt_ids, error, finish = self._stream(job, msgs, self._body(job, messages))
        rec, ends = self._record(job, msgs, usage, prompt_ids, error, finish)
        if rec.prompt_tokens and (error is None or job.t_first):
            with self._cv:
                row = self._rows.get(job.session)
                self._rows[job.session] = _Row(
                    row.index if row else len(self._rows), job.session,
                    tuple(prompt_ids or ()) + tuple(job.generated), ends, rec.segments,
                    job.id, rec.verified, rec.note)
        job.record = rec
        if error is not None:
            raise error
        return rec

    def _body(self, job: RemoteJob, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The streamed chat completion's request body."""
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
        if self.server.startswith("vLLM"):
            body["return_token_ids"] = True  # the prompt's ids, then each delta's
        return body

    def _stream(self, job: RemoteJob, msgs: list[dict[str, Any]], body: dict[str, Any]
                ) -> tuple[dict[str, Any], list[int] | None, BaseException | None, str]:
        """Stream the completion into ``job``: (usage, prompt ids, error, finish reason)."""
        usage: dict[str, Any] = {}
        prompt_ids: list[int] | None = None
        error: BaseException | None = None
        finish, ended = "cancelled", False
        try:
            for ev in self._events(job, "/v1/chat/completions", body):
                if isinstance(ev.get("prompt_token_ids"), list):
                    prompt_ids = ev["prompt_token_ids"]
                for choice in ev.get("choices") or ():
                    self._delta(job, (choice.get("delta") or {}).get("content") or "")
                    job.generated.extend(choice.get("token_ids") or ())
                    if choice.get("finish_reason"):
                        finish = "length" if choice["finish_reason"] == "length" else "stop"
                        ended = True
                if ev.get("usage"):
                    usage = ev["usage"]
            ended = ended or bool(job.stream is not None and job.stream.done)
        except ServerError as e:
            error = _media_error(e, self.model_name) if contains_images(msgs) else e
            finish = "error"
        except BaseException as e:
            error = e
            finish = "cancelled" if isinstance(e, KeyboardInterrupt) else "error"
        if error is None and not ended and not job.cancel.is_set():
            # the connection closed before the final event: the reply is cut short, not done
            error = IncompleteReplyError(
                f"{self.url}/v1/chat/completions: the answer ended without its final event "
                f"(no finish_reason, no [DONE]): the server stopped or dropped the connection "
                f"after {len(job.text)} characters; the partial reply is on this error's "
                f".text", text=job.text)
            finish = "error"
        return usage, prompt_ids, error, finish

    def _record(self, job: RemoteJob, msgs: list[dict[str, Any]], usage: dict[str, Any],
                prompt_ids: list[int] | None, error: BaseException | None, finish: str
                ) -> tuple[RequestRecord, tuple[int, ...]]:
        """The request's record from the server's usage report, and the messages' ends."""
        now = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if usage:
            self.reports_cache = cached is not None
        prompt = int(usage.get("prompt_tokens") or 0) or len(prompt_ids or ())
        reused = int(cached or 0)
        if cached is not None:
            note = ""
        elif usage:
            note = ("the server does not report cached tokens: start vLLM with "
                    "--enable-prompt-tokens-details, SGLang with --enable-cache-report")
        else:
            note = "the server reports cached tokens at the end of a reply: this one did not end"
        generated = int(usage.get("completion_tokens") or 0) or len(job.generated) or len(
            job.text.split())
        segments, ends = self._segments(msgs, prompt_ids, prompt, reused, generated, job.text)
        rec = RequestRecord(
            id=job.id, session=job.session, strategy="server", slot=-1, prompt_tokens=prompt,
            reused_tokens=reused, prefilled_tokens=max(prompt - reused, 0), trimmed_tokens=0,
            generated_tokens=generated,
            ttft_s=(job.t_first - job.t_submit) if job.t_first else 0.0,
            decode_s=(now - job.t_first) if job.t_first else 0.0, finish_reason=finish,
            started_at=time.time(), verified=cached is not None, note=note,
            reason="server", reason_text=self._reason_text(prompt, reused),
            exact=False, exact_note="the server reuses its own prefix cache unseen",
            error=None if error is None else f"{type(error).__name__}: {error}",
            segments=segments, capacity=self.n_ctx)
        return rec, ends

    def _reason_text(self, prompt: int, reused: int) -> str:
        text = "the server chose what to reuse (its own prefix cache)"
        if self.block_size and prompt:
            whole = (prompt - 1) // self.block_size * self.block_size
            text += (f"; it caches whole blocks of {self.block_size} tokens, so at most "
                     f"{whole} of these {prompt} could be reused")
        return text

    def _segments(self, msgs: list[dict[str, Any]], prompt_ids: list[int] | None, prompt: int,
                  reused: int, generated: int, reply: str
                  ) -> tuple[tuple[Segment, ...], tuple[int, ...]]:
        """The request's KV map in the server's blocks, per message where the ends are known."""
        if not prompt:
            return (), ()
        ends = self._message_ends(msgs, prompt_ids) if prompt_ids else None
        if ends is not None:
            segs = message_segments(msgs, ends, prompt, reused, prompt + generated, reply)
        else:  # one span for the whole prompt: the server did not say where messages end
            segs = message_segments([{"role": "other", "content": "(the whole prompt)"}],
                                    [prompt], prompt, reused, prompt + generated, reply)
        return block_segments(segs, self.block_size), tuple(ends or ())

    def _message_ends(self, msgs: list[dict[str, Any]], prompt_ids: Sequence[int]
                      ) -> tuple[int, ...] | None:
        """Where each message ends in the prompt's tokens (vLLM's ``/tokenize``), or None.

        Each conversation prefix is tokenized once per engine (a turn asks only for its new
        messages); None when the server cannot tokenize, or a prefix's tokens are not a
        prefix of the prompt's (a template that renders earlier turns differently).
        """
        if not self.has_tokenize or any(not isinstance(m.get("content"), str) for m in msgs):
            return None
        ends: list[int] = []
        for k in range(1, len(msgs) + 1):
            key = hashlib.sha256(json.dumps(msgs[:k], sort_keys=True).encode()).hexdigest()
            with self._cv:  # requests on other threads share the table
                end = self._ends.get(key)
            if end is None:
                try:
                    ids = self.client.post("/tokenize", {
                        "model": self.model_name, "messages": [_openai_message(m) for m in
                                                               msgs[:k]],
                        "add_generation_prompt": False}, timeout=10.0)["tokens"]
                except (ServerError, KeyError, TypeError) as e:
                    log.debug("no message ends: %s", e)
                    self.has_tokenize = not isinstance(e, ServerUnsupportedError)
                    return None
                if list(prompt_ids[:len(ids)]) != list(ids):
                    return None
                end = len(ids)
                with self._cv:
                    self._ends[key] = end
                    while len(self._ends) > ENDS_KEPT:
                        self._ends.popitem(last=False)
            ends.append(end)
        return tuple(ends)

    def describe(self) -> list[tuple[str, str]]:
        """Status rows: server, model, cache, live block view."""
        cache = {None: "not known yet whether it reports cached prompt tokens",
                 True: "it reports cached prompt tokens",
                 False: "it does not report cached prompt tokens"}[self.reports_cache]
        blocks = (f"blocks of {self.block_size} tokens"
                  + (f", {self.facts.capacity_tokens:,} tokens in all"
                     if self.facts.capacity_tokens else "") + "; "
                  if self.block_size else "")
        rows = [("server", f"{self.server or 'OpenAI-compatible'} at {self.url}"),
                ("model", self.model_name or "?"
                 + (f" (max {self.n_ctx:,} tokens)" if self.n_ctx else "")),
                ("slots", "managed by the server (sessions only)"),
                ("cache", f"the server's own prefix cache: {blocks}{cache}")]
        if self.listener is not None:
            whole = "" if self.listener.mirror.since_start else (
                " (blocks it stored before nbkv connected are not known: start it with a "
                "replay_endpoint too)")
            rows.append(("live blocks", f"following its KV cache events at "
                                        f"{self.listener.endpoint}{whole}"))
        elif self.live_note:
            rows.append(("live blocks", self.live_note))
        return rows


def _media_error(e: ServerError, model: str) -> ServerError | MediaError:
    """The server's refusal of images, said as such (a text-only model)."""
    text = str(e).lower()
    if e.status == 400 and ("multimodal" in text or "image" in text):
        err = MediaError(f"the server's model {model or ''} takes no images (it answered: "
                         f"{e}); send text only, or serve a vision model")
        err.__cause__ = e
        return err
    return e


def _openai_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message for ``/v1/chat/completions``: text, or parts with images as data URLs."""
    content = m.get("content")
    if isinstance(content, str):
        return {"role": m["role"], "content": content}
    from nbkv.media.messages import to_data_url

    parts = []
    for part in content or ():
        if part.get("type") == "text":
            parts.append({"type": "text", "text": part.get("text", "")})
        else:
            parts.append({"type": "image_url", "image_url": {"url": to_data_url(part)}})
    return {"role": m["role"], "content": parts}
