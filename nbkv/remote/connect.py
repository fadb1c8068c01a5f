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

from nbkv.core.errors import (
    InvalidRequestError,
    ServerError,
    ServerUnsupportedError,
)
from nbkv.remote.http_client import ServerClient
from nbkv.remote.llama_server import LlamaServerEngine, ServerVocab
from nbkv.remote.openai import OpenAIEngine

__all__ = ["LlamaServerEngine", "OpenAIEngine", "ServerVocab", "connect"]


def connect(url: str, *, slots: int | None = None, api_key: str | None = None,
            kind: str | None = None, min_tokens: int = 100, timeout: float = 600.0,
            exact: bool = True) -> LlamaServerEngine | OpenAIEngine:
    """A remote engine for the server at ``url``.

    ``kind``: ``"llama-server"`` or ``"openai"`` (default: detected; llama-server answers
    ``/props``). ``slots``: how many of llama-server's slots nbkv uses (default: all).
    ``api_key``: sent as a bearer token. ``exact``: on llama-server, steer it so that
    replies are proven exact where its launcher's flags allow (one request at a time; see
    :class:`LlamaServerEngine`).
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
            return LlamaServerEngine(client, props, slots=slots, min_tokens=min_tokens,
                                     exact=exact)
        if kind == "llama-server":
            raise ServerUnsupportedError(f"{client.url}/props is not llama-server's")
        if slots is not None:
            raise InvalidRequestError("--slots applies to llama-server only: an OpenAI-"
                                      "compatible server manages its own cache")
        return OpenAIEngine(client)
    except BaseException:
        client.close()
        raise
