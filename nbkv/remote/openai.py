"""Any OpenAI-compatible server (vLLM, SGLang, llama-server's ``/v1``): its cache, its slots."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from nbkv.core.api import request_totals
from nbkv.core.errors import (
    InvalidRequestError,
    ServerUnsupportedError,
)
from nbkv.core.events import (
    RequestRecord,
    RequestStarted,
)
from nbkv.core.messages import normalize
from nbkv.core.requests import SamplingParams
from nbkv.kv.slot_table import SlotInfo
from nbkv.remote.base import RemoteBase, RemoteJob
from nbkv.remote.http_client import ServerClient

log = logging.getLogger("nbkv.remote.connect")

#: a KV position whose token the server did not send (decoded after an interrupt)


class OpenAIEngine(RemoteBase):
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

    def _serve(self, job: RemoteJob, messages: list[dict[str, Any]]) -> RequestRecord:
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
            exact=False, exact_note="the server reuses its own prefix cache unseen",
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
    from nbkv.media.messages import to_data_url

    parts = []
    for part in content or ():
        if part.get("type") == "text":
            parts.append({"type": "text", "text": part.get("text", "")})
        else:
            parts.append({"type": "image_url", "image_url": {"url": to_data_url(part)}})
    return {"role": m["role"], "content": parts}
