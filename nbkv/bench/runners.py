"""What the scenarios time: nbkv engines and their alternatives, each behind ``turn()``."""

from __future__ import annotations

import time
from typing import Any, cast

from nbkv.core.events import SlotRewritten
from nbkv.engine.facade import Engine
from nbkv.kv.policy import common_prefix
from nbkv.llama.backend import Batch, Context, Model, default_threads
from nbkv.llama.hardware import gpu_offload

MAX_TOKENS = 16


class NbkvRunner:
    """An nbkv engine in one cache mode.

    ``settle=True`` (default): after each reply, finish its rewrite at once
    (``engine.settle()``, timed as ``settle_s``), as the engine does in idle time while a
    user reads; the next turn then never absorbs it. ``False`` (agents that send the next
    request at once): the rewrite runs in whatever idle time there is, or the next request
    absorbs it.
    """

    def __init__(self, path: str, cache: str, slots: int, n_ctx: int, template: str | None = None,
                 max_tokens: int = MAX_TOKENS, settle: bool = True, **engine_kw: Any) -> None:
        self.max_tokens = max_tokens
        self.settle = settle
        self.engine = Engine(path, n_slots=slots, n_ctx=n_ctx, cache=cache, template=template,
                             **engine_kw)
        self.rewrites: list[SlotRewritten] = []
        self.engine.subscribe(self._on_event)

    def _on_event(self, ev: object) -> None:
        if isinstance(ev, SlotRewritten):
            self.rewrites.append(ev)

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        res = self.engine.chat(messages, session=session, max_tokens=self.max_tokens,
                               temperature=0)
        settle_s = 0.0
        if self.settle:
            t0 = time.perf_counter()
            self.engine.settle()
            settle_s = time.perf_counter() - t0
        r = res.record
        return {"ttft": r.ttft_s, "prompt": r.prompt_tokens, "reused": r.reused_tokens,
                "prefilled": r.prefilled_tokens, "generated": r.generated_tokens,
                "strategy": r.strategy, "restore_s": r.restore_s, "decode_s": r.decode_s,
                "guesses": r.draft_tokens, "accepted": r.draft_accepted, "slot": r.slot,
                "checkpoint_pos": r.checkpoint_pos, "reprefilled": r.reprefilled_tokens,
                "rewrite_absorbed": r.rewrite_absorbed, "rewrite_mixed": r.rewrite_mixed,
                "wait_s": r.wait_s, "settle_s": settle_s, "id": r.id,
                "encoder_runs": r.encoder_runs, "park_s": r.park_s,
                "restored_from": r.restored_from, "restored_tokens": r.restored_tokens,
                "unpark_s": r.unpark_s, "evicted_parked": r.evicted_parked,
                "finish": r.finish_reason, "text": res.text}

    def rewrite_summary(self) -> dict[str, float]:
        """The rewrites the engine has published so far: how many, positions, seconds."""
        return {"rewrites": len(self.rewrites),
                "positions": sum(e.tokens for e in self.rewrites),
                "seconds": sum(e.seconds for e in self.rewrites)}

    def close(self) -> None:
        self.engine.close()



def _stream_turn(llm: Any, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy reply from a llama-cpp-python ``Llama``: its TTFT and text."""
    t0 = time.perf_counter()
    ttft, text = None, ""
    chunks: Any = llm.create_chat_completion(cast(Any, messages), stream=True,
                                             max_tokens=max_tokens, temperature=0)
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"].get("content")
        if delta:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += delta
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "text": text}

def peer_gpu_layers() -> int:
    """Layers a peer ``Llama`` offloads: all of them on a GPU build, as nbkv's default does.

    ``Llama``'s own default is 0 (CPU only), which on a GPU machine would compare nbkv on the GPU
    against its peer on the CPU.
    """
    return -1 if gpu_offload() else 0


class LlamaCppRunner:
    """llama-cpp-python's high-level ``Llama``: one sequence, prefix reuse built in."""

    def __init__(self, path: str, n_ctx: int, max_tokens: int = MAX_TOKENS) -> None:
        from llama_cpp import Llama

        self.max_tokens = max_tokens
        self.llm = Llama(path, n_ctx=n_ctx, n_batch=256, n_ubatch=256, verbose=False,
                         flash_attn=False, n_threads=default_threads(),
                         n_gpu_layers=peer_gpu_layers())

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        return _stream_turn(self.llm, messages, self.max_tokens)

    def close(self) -> None:
        self.llm.close()


class LlamaCacheRunner(LlamaCppRunner):
    """``Llama`` with llama-cpp-python's ``LlamaRAMCache`` (``llm.set_cache``).

    After every reply ``Llama`` saves its whole context state under the conversation's
    tokens; a prompt whose longest cached prefix is longer than what the context holds
    loads that state back first. Timed here: the load (``restore_s``, inside the first-token
    time), the save (``park_s``, after the reply) and, from the first ``eval`` of a turn,
    what was reused.
    """

    def __init__(self, path: str, n_ctx: int, capacity_bytes: int,
                 max_tokens: int = MAX_TOKENS) -> None:
        from llama_cpp import LlamaRAMCache

        super().__init__(path, n_ctx, max_tokens)
        self.cache = LlamaRAMCache(capacity_bytes=capacity_bytes)
        self.llm.set_cache(self.cache)
        self._t: dict[str, Any] = {}
        llm = self.llm
        load, save, evaluate = llm.load_state, llm.save_state, llm.eval

        def timed(fn: Any, key: str) -> Any:
            def call(*a: Any) -> Any:
                t0 = time.perf_counter()
                out = fn(*a)
                self._t[key] = self._t.get(key, 0.0) + time.perf_counter() - t0
                if key == "restore_s":
                    self._t["restored_tokens"] = a[0].n_tokens
                return out
            return call

        def first_eval(tokens: Any) -> Any:
            if "prompt" not in self._t:  # the prompt's uncached rest, after the reused part
                self._t.update(reused=llm.n_tokens, prompt=llm.n_tokens + len(tokens))
            return evaluate(tokens)

        setattr(llm, "load_state", timed(load, "restore_s"))  # noqa: B010 - patching methods
        setattr(llm, "save_state", timed(save, "park_s"))  # noqa: B010
        setattr(llm, "eval", first_eval)  # noqa: B010

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        self._t = {}
        r = super().turn(messages, session)
        t = self._t
        return {**r, "prompt": t.get("prompt", 0), "reused": t.get("reused", 0),
                "restore_s": t.get("restore_s", 0.0), "park_s": t.get("park_s", 0.0),
                "restored_tokens": t.get("restored_tokens", 0),
                "restored_from": "ram" if "restore_s" in t else ""}


class LimitRunner:
    """The physical floor: decode only the new tokens, on a context already holding the rest."""

    def __init__(self, path: str, n_ctx: int) -> None:
        self.model = Model(path)
        self.ctx = Context(self.model, n_ctx, 1, 256, flash_attn=0)
        self.batch = Batch(256)
        self.tokens: list[int] = []

    def _decode(self, tokens: list[int]) -> int:
        last = -1
        for i in range(0, len(tokens), 255):
            chunk = tokens[i : i + 255]
            self.batch.clear()
            last = self.batch.add_run(chunk, len(self.tokens), 0, True)
            if len(chunk) == 1:  # never a lone prompt token, as in nbkv (docs: exactness)
                self.batch.add(chunk[0], len(self.tokens) + 1, 0, False)
            self.ctx.decode(self.batch)
            self.ctx.seq_rm(0, len(self.tokens) + len(chunk), -1)
            self.tokens.extend(chunk)
        return last

    def turn(self, prompt: list[int], new: int) -> float:
        keep = common_prefix(self.tokens, prompt[: len(prompt) - new])
        self.ctx.seq_rm(0, keep, -1)
        del self.tokens[keep:]
        self._decode(prompt[keep : len(prompt) - new])  # untimed: the cached part
        t0 = time.perf_counter()
        last = self._decode(prompt[len(prompt) - new :])
        max(self.ctx.logits(last))  # read the logits, as a greedy sampler would
        return time.perf_counter() - t0

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()


class LlamaDecodeRunner:
    """llama-cpp-python's high-level ``Llama`` generating from prompt tokens, greedy.

    ``generate`` yields each sampled token, then decodes it alone before sampling the next:
    plain llama.cpp, one row per step. It does not stop at an end-of-generation token;
    :meth:`reply` stops there, as nbkv does (that token is neither counted nor decoded).
    """

    def __init__(self, path: str, n_ctx: int, n_threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(path, n_ctx=n_ctx, n_batch=256, n_ubatch=256, n_threads=n_threads,
                         n_threads_batch=n_threads, flash_attn=False, verbose=False,
                         n_gpu_layers=peer_gpu_layers())
        self.vocab = self.llm._model.vocab

    def reply(self, prompt: list[int], max_tokens: int, fresh: bool = True) -> dict[str, Any]:
        """Generate up to ``max_tokens`` after ``prompt``. ``fresh``: prefill it all from
        position 0; else reuse the longest common prefix with what the context holds."""
        import llama_cpp

        if fresh:
            self.llm.reset()
        tokens: list[int] = []
        reason = "length"
        t0 = time.perf_counter()
        t_first = t_last = 0.0
        gen = self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)
        try:
            for tok in gen:
                t_last = time.perf_counter()
                if not t_first:
                    t_first = t_last
                if llama_cpp.llama_vocab_is_eog(self.vocab, tok):
                    reason = "stop"
                    break
                tokens.append(tok)
                if len(tokens) >= max_tokens:
                    break
        finally:
            gen.close()
        text = self.llm.detokenize(tokens).decode("utf-8", errors="replace")
        # as RequestRecord: decode_s runs from the first token to the last sampled one
        return {"ttft": t_first - t0, "decode_s": t_last - t_first, "reply_s": t_last - t0,
                "generated": len(tokens), "finish": reason, "text": text}

    def close(self) -> None:
        self.llm.close()


class HandlerRunner:
    """A llama-cpp-python multimodal chat handler by name (``llama_chat_format``): every turn
    clears the KV cache, re-encodes every image and re-prefills the whole prompt."""

    def __init__(self, path: str, mmproj: str, handler: str, n_ctx: int) -> None:
        from llama_cpp import Llama, llama_chat_format

        self.handler = getattr(llama_chat_format, handler)(clip_model_path=mmproj,
                                                           verbose=False)
        # all cores, as nbkv (Llama's default is half of them, which its handlers' image
        # encoder inherits)
        self.llm = Llama(path, chat_handler=self.handler, n_ctx=n_ctx, n_batch=1024,
                         n_ubatch=1024, verbose=False, flash_attn=False,
                         n_threads=default_threads(), n_gpu_layers=peer_gpu_layers())
        self.max_tokens = MAX_TOKENS
        init = getattr(self.handler, "_init_mtmd_context", None)
        if init is not None:  # load the projector now, as nbkv's Engine does, not in turn 1
            init(self.llm)

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        r = _stream_turn(self.llm, messages, self.max_tokens)  # the same TTFT measurement
        r["encoder_runs"] = 1  # the image of the conversation, again every turn
        return r

    def close(self) -> None:
        self.llm.close()


class RemoteRunner:
    """nbkv's remote engine on a llama-server: ``pin`` (nbkv's policy, ``id_slot``) or not.

    Unpinned is the same client without ``id_slot``: llama-server picks the slot itself (the
    idle slot whose cached prompt is most similar, else the least recently used).
    ``exact``: steer the server for exact replies (:mod:`nbkv.remote.steering`);
    ``settle``: after each reply, wait for its idle-time rewrite on the server (timed as
    ``settle_s``), as happens while a user reads.
    """

    def __init__(self, url: str, pin: bool, max_tokens: int = MAX_TOKENS, *,
                 exact: bool = True, settle: bool = True) -> None:
        from nbkv.remote.connect import connect

        self.engine = connect(url, exact=exact)
        self.engine.clear()
        self.pin = pin
        self.max_tokens = max_tokens
        # the idle-time rewrite exists on llama-server only (an OpenAI server has none)
        from nbkv.remote.llama_server import LlamaServerEngine

        eng = self.engine
        self.settle = eng.settle if settle and isinstance(eng, LlamaServerEngine) else None

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        if self.pin:
            res = self.engine.chat(messages, session=session, max_tokens=self.max_tokens,
                                   temperature=0)
            settle_s = 0.0
            if self.settle is not None:
                t0 = time.perf_counter()
                self.settle()
                settle_s = time.perf_counter() - t0
            r = res.record
            return {"ttft": r.ttft_s, "prompt": r.prompt_tokens, "reused": r.reused_tokens,
                    "prefilled": r.prefilled_tokens, "server_prefill_s": r.prefill_s,
                    "slot": r.slot, "verified": r.verified, "restored_from": r.restored_from,
                    "exact": r.exact, "steer_s": r.restore_s, "settle_s": settle_s,
                    "reprefilled": r.reprefilled_tokens,
                    "rewrite_absorbed": r.rewrite_absorbed, "text": res.text}
        from nbkv.remote.llama_server import LlamaServerEngine

        if not isinstance(self.engine, LlamaServerEngine):
            raise TypeError("an unpinned run needs a llama-server (it sends /completion)")
        tokens = self.engine.tokenize_prompt(messages)
        body = {"prompt": tokens, "cache_prompt": True, "stream": True, "n_cache_reuse": 0,
                "n_predict": self.max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        ttft, text, final = 0.0, "", {}
        for ev in self.engine.client.stream("/completion", body):
            if ev.get("content") and not ttft:
                ttft = time.perf_counter() - t0
            text += ev.get("content") or ""
            if ev.get("stop"):
                final = ev
        t = final.get("timings") or {}
        return {"ttft": ttft, "prompt": len(tokens), "reused": int(t.get("cache_n", 0)),
                "prefilled": int(t.get("prompt_n", 0)),
                "server_prefill_s": float(t.get("prompt_ms", 0.0)) / 1000,
                "slot": final.get("id_slot"), "verified": True, "text": text}

    def close(self) -> None:
        self.engine.close()


class OpenAIRunner:
    """nbkv's OpenAI-compatible engine on a server that keeps its own prefix cache (vLLM).

    The server chooses what to reuse: whole blocks of its prefix cache, shared by every
    session (no slots to pin).
    """

    def __init__(self, url: str, max_tokens: int = MAX_TOKENS) -> None:
        from nbkv.remote.connect import connect
        from nbkv.remote.openai import OpenAIEngine

        engine = connect(url, kind="openai")
        assert isinstance(engine, OpenAIEngine)
        self.engine = engine
        self.max_tokens = max_tokens

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        res = self.engine.chat(messages, session=session, max_tokens=self.max_tokens,
                               temperature=0)
        r = res.record
        return {"ttft": r.ttft_s, "prompt": r.prompt_tokens, "reused": r.reused_tokens,
                "prefilled": r.prefilled_tokens, "server_prefill_s": 0.0, "slot": -1,
                "verified": r.verified, "text": res.text}

    def close(self) -> None:
        self.engine.close()
