"""What a llama-server computes with, as its launcher states it, and what nbkv can prove on it.

llama-server's ``/props`` does not report the flags that decide its arithmetic and its
cache (``-b``, ``-ub``, ``-fa``, ``--cache-ram``, ``--kv-unified``, threads) nor when it
started. nbkv's launcher (:class:`nbkv.remote.server.LlamaServer`, ``python -m
nbkv.remote.server``) therefore states them in the one free-form field ``/props`` echoes,
``ui_settings`` (``--ui-config``), under ``"nbkv"``: the flags it passed, the prefill rule
it calibrated on the server's machine with the same llama.cpp and the same flags
(:mod:`nbkv.kv.calibrate`), the model's memory class and its start time.

A remote engine reads them back (:class:`ServerFacts`) and claims exact replies only where
they make a proof possible (:meth:`ServerFacts.exactness`); any other server is served
from cache all the same, with ``exact=False`` and the reason on every record.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbkv.kv.invariance import PrefillRule
from nbkv.remote.steering import UBATCH

log = logging.getLogger("nbkv.remote.connect")

KEY = "nbkv"  # under /props ui_settings
VERSION = 1
#: llama-server's own defaults, where a flag is not given
DEFAULTS = {"batch": 2048, "ubatch": 512, "flash_attn": "auto", "cache_ram": 8192,
            "kv_unified": False, "threads": None}
#: flags that change the arithmetic or the cache in ways nbkv does not model
UNMODELLED = ("-md", "--model-draft", "--lora", "--lora-scaled", "--control-vector",
              "-ctk", "--cache-type-k", "-ctv", "--cache-type-v", "--cache-reuse", "--swa-full",
              "--spec-type", "-sps", "--slot-prompt-similarity", "-nocb", "--no-cont-batching")
_ALIASES = {"-b": "batch", "--batch-size": "batch", "-ub": "ubatch", "--ubatch-size": "ubatch",
            "-fa": "flash_attn", "--flash-attn": "flash_attn", "--cache-ram": "cache_ram",
            "-cram": "cache_ram", "-t": "threads", "--threads": "threads"}


def flags_of(argv: Sequence[str]) -> dict[str, Any]:
    """The flags of a llama-server command line that nbkv models (the last one wins)."""
    out: dict[str, Any] = dict(DEFAULTS)
    unmodelled = []
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        name, _, inline = a.partition("=")
        if name in _ALIASES:
            value = inline or (argv[i + 1] if i + 1 < len(argv) else "")
            if not inline:
                next(it, None)
            key = _ALIASES[name]
            out[key] = value if key == "flash_attn" else int(value)
        elif name in ("-kvu", "--kv-unified"):
            out["kv_unified"] = True
        elif name == "--no-kv-unified":
            out["kv_unified"] = False
        elif name in UNMODELLED:
            unmodelled.append(name)
    out["unmodelled"] = sorted(set(unmodelled))
    return out


def advert(argv: Sequence[str], rule: PrefillRule | None, memory: str, build: str,
           same_build: bool) -> str:
    """The ``--ui-config`` JSON a launcher passes: its flags, rule, memory class, start."""
    body = {**flags_of(argv), "version": VERSION, "started": time.time(), "memory": memory,
            "rule": rule.to_json() if rule is not None else None, "build": build,
            "same_build": same_build}
    return json.dumps({KEY: body}, separators=(",", ":"))


@dataclass(frozen=True)
class ServerFacts:
    """What a server's launcher stated about it (``declared=False``: nothing)."""

    declared: bool = False
    batch: int | None = None
    ubatch: int | None = None
    flash_attn: str | None = None
    cache_ram: int | None = None  # MiB; None: not known (llama-server's default is 8192)
    kv_unified: bool | None = None
    threads: int | None = None
    started: float | None = None  # the launcher's clock when it started this server
    memory: str | None = None
    rule: PrefillRule | None = None
    unmodelled: tuple[str, ...] = ()
    same_build: bool = False

    @classmethod
    def from_props(cls, props: Mapping[str, Any]) -> ServerFacts:
        """Read what ``/props`` says under ``ui_settings.nbkv`` (nothing, for other servers)."""
        d = (props.get("ui_settings") or {}).get(KEY) if isinstance(
            props.get("ui_settings"), Mapping) else None
        if not isinstance(d, Mapping) or d.get("version") != VERSION:
            return cls()
        try:
            rule = PrefillRule.from_json(d["rule"]) if d.get("rule") else None
            return cls(True, int(d["batch"]), int(d["ubatch"]), str(d["flash_attn"]),
                       int(d["cache_ram"]), bool(d["kv_unified"]),
                       int(d["threads"]) if d.get("threads") else None,
                       float(d["started"]), str(d.get("memory") or ""), rule,
                       tuple(d.get("unmodelled") or ()), bool(d.get("same_build")))
        except (KeyError, TypeError, ValueError) as e:
            log.info("the server's /props ui_settings.nbkv is not readable: %s", e)
            return cls()

    @property
    def plan_ubatch(self) -> int:
        """The physical batch to plan steering for (:data:`nbkv.remote.steering.UBATCH` or less)."""
        ub = min(self.ubatch or UBATCH, self.batch or UBATCH)
        return min(ub, UBATCH)

    @property
    def has_cache(self) -> bool | None:
        """Whether the server keeps a host-memory prompt cache (None: not known)."""
        return None if self.cache_ram is None else self.cache_ram != 0

    def exactness(self) -> tuple[PrefillRule | None, str]:
        """The rule to steer by, or None and why nothing can be proven on this server."""
        if not self.declared:
            return None, ("llama-server does not report how it computes (-b, -ub, -fa) nor "
                          "what it caches: start it with python -m nbkv.remote.server, which "
                          "states its flags in /props")
        rule = self.rule
        if not self.same_build:
            return None, ("the server's binary is not the llama.cpp build nbkv calibrated "
                          "($NBKV_LLAMA_SERVER or another llama-server)")
        if self.memory != "plain":
            return None, (f"llama-server saves checkpoints of {self.memory or 'this'} memory "
                          f"in pieces nbkv does not steer")
        if self.unmodelled:
            return None, f"the server runs with {', '.join(self.unmodelled)}"
        if self.kv_unified:
            return None, "the server shares one KV buffer between slots (--kv-unified)"
        if self.flash_attn == "auto":
            return None, "flash attention is 'auto': which kernel runs is not known (-fa off)"
        if rule is None or not rule.exact:
            return None, (rule.reason if rule is not None else "the model was not calibrated")
        ub = min(self.ubatch or UBATCH, self.batch or UBATCH)
        if ub & (ub - 1) or (self.batch or ub) % ub or ub < max(
                2 * rule.threshold + rule.align - 2, rule.min_chunk):
            return None, (f"-b {self.batch} -ub {self.ubatch}: nbkv plans for a physical batch "
                          f"that is a power of two dividing -b, of {rule.min_chunk}+ rows")
        return rule, ""
