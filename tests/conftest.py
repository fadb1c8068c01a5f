"""Shared fixtures: the embedded model, engines, and the from-scratch oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from nbkv.core.errors import ContextOverflowError, MediaError
from nbkv.kv.oracle import scratch_logits
from nbkv.llama.backend import Batch, Context
from nbkv.llama.models import default_model_path
from nbkv.media.embeddings import ImageEmbedding
from nbkv.media.projector import Projector
from nbkv.media.prompt import MediaPrompt

# a system prompt of ~150 tokens, so that salvage thresholds (100 tokens) matter
SYSTEM = (
    "You are a patient tutor who explains how computers work to curious beginners. "
    "Always answer in plain English, in at most three short sentences, and use one concrete "
    "everyday example when it helps. Never use jargon without explaining it first. If the "
    "question is ambiguous, state the interpretation you chose. If you do not know the answer, "
    "say so honestly instead of guessing. Keep a friendly tone, avoid lists unless the user "
    "asks for one, and do not repeat the question back to the user. When numbers are "
    "involved, show the arithmetic in one line so the learner can check it."
)

QUESTIONS = [
    "What is a CPU?",
    "And what does memory do?",
    "Why is a cache faster than memory?",
    "How many bytes are in a kilobyte?",
    "What is a GPU good at?",
    "Summarize our talk in one sentence.",
]

MAX_TOKENS = 12

# the stateful simulation (tests/test_stateful.py): ``make test`` runs a fixed-seed, bounded
# profile; ``pytest tests/test_stateful.py --hypothesis-profile=long --timeout=0`` explores
# further (about an hour: past pytest-timeout's 900 s)
settings.register_profile("nbkv", max_examples=int(os.environ.get("NBKV_STATEFUL", 30)),
                          stateful_step_count=12, derandomize=True, deadline=None,
                          print_blob=True)
settings.register_profile("long", max_examples=150, stateful_step_count=40, derandomize=False,
                          deadline=None, print_blob=True)
settings.load_profile("nbkv")


class QuietComm:
    """A kernel comm stand-in that sends nothing (``comm.create_comm`` in widget tests)."""

    comm_id, kernel = "quiet", None

    def __init__(self, **kw):
        pass

    def __getattr__(self, name):
        return lambda *a, **kw: None


def ipython_shell():
    """The process-wide test IPython shell (start_ipython returns None once it exists)."""
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    return start_ipython() or get_ipython()


@pytest.fixture(scope="session")
def model_path():
    return str(default_model_path())


@pytest.fixture(scope="session", autouse=True)
def signing_key(tmp_path_factory):
    """Saves, parked entries and calibrations are signed with the tests' own key, never the
    user's (``$NBKV_SIGNING_KEY``: subprocesses and kernels the tests start use it too). It
    lives beside pytest's temporary folders, so that the calibrations one run signs in
    ``~/.cache/nbkv`` are trusted by the next instead of measured again."""
    from nbkv.core.signing import KEY_ENV

    old = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = str(tmp_path_factory.getbasetemp().parent / "nbkv-test-signing-key")
    yield os.environ[KEY_ENV]
    if old is None:
        os.environ.pop(KEY_ENV, None)
    else:
        os.environ[KEY_ENV] = old


def run_py(code, *args, timeout=300):
    """Run ``code`` (dedented) in a new Python process with ``args``; returns the JSON its
    last output line holds (the process must succeed)."""
    here = Path(__file__).parent  # run from tests/: ``import conftest`` is this file
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent)]))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=here)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def scratch_reply(model_path, messages, template=None, max_tokens=MAX_TOKENS, **engine):
    """The oracle: the same request in a brand-new engine (fresh context, nothing cached)."""
    from nbkv import Engine

    with Engine(model_path, n_slots=1, n_ctx=2048, cache="off", template=template,
                **engine) as e:
        return e.chat(messages, max_tokens=max_tokens, temperature=0).text


def assert_consistent(engine):
    """Every slot's KV holds exactly its recorded tokens, and no slot is left pending.

    Read on the scheduler thread between two steps: the engine rewrites finished replies
    in the background, so a read from this thread could fall between a trim and its record.
    """
    def read():
        return [(s, engine.ctx.seq_pos_min(s.seq_id), engine.ctx.seq_pos_max(s.seq_id))
                for s in engine.slots()]
    for s, lo, hi in engine.core.call(read):
        assert not s.pending, f"slot {s.index} left pending"
        assert hi + 1 == s.n_tokens - s.rewriting, f"slot {s.index} KV mismatch"
        if s.memory == "plain":
            assert lo == (0 if s.n_tokens else -1)


def fresh_probe(model, tokens, probe, **context):
    """Logits of ``probe`` after ``tokens``, decoded from scratch (never a lone-token batch).

    ``context``: :class:`~nbkv.llama.backend.Context` settings (KV types, flash attention).
    """
    return scratch_logits(model, tokens, probe, **context)


def eval_prompt(
    projector: Projector,
    ctx: Context,
    prompt: MediaPrompt,
    seq: int,
    pos: int = 0,
    *,
    start: int = 0,
    embeddings: dict[str, ImageEmbedding] | None = None,
) -> tuple[int, np.ndarray]:
    """Reference evaluation: decode ``prompt.chunks[start:]`` into ``seq`` from ``pos``.

    Returns (next position, logits).
    Text chunks go through a :class:`~nbkv.llama.backend.Batch` of ``ctx.n_batch`` tokens,
    image chunks through ``Projector.decode_chunk``. The logits are those of the prompt's last
    token or embedding (a copy). On failure, ``seq`` is trimmed back to ``pos``.
    """
    chunks = prompt.chunks[start:]
    if not chunks:
        raise MediaError("nothing to evaluate")
    embeddings = dict(embeddings or {})
    for c in chunks:  # before touching the sequence: an encoder failure leaves it as is
        if c.image is not None and c.image.hash not in embeddings:
            embeddings[c.image.hash] = projector.embedding(c.image, _prompt=prompt)
    logits: np.ndarray | None = None
    p0 = pos
    batch = Batch(ctx.n_batch)
    try:
        for ci, c in enumerate(chunks):
            last = ci == len(chunks) - 1
            if c.is_image:
                assert c.image is not None
                emb = embeddings[c.image.hash]
                if last:
                    logits = projector.decode_chunk_logits(ctx, c, seq, pos, embedding=emb)
                else:
                    projector.decode_chunk(ctx, c, seq, pos, embedding=emb)
                pos += c.n_pos
                continue
            toks = c.tokens
            if pos + len(toks) > ctx.n_ctx_seq:
                raise ContextOverflowError(pos + len(toks), ctx.n_ctx_seq)
            for off in range(0, len(toks), ctx.n_batch):
                part = toks[off : off + ctx.n_batch]
                batch.clear()
                end = last and off + len(part) == len(toks)
                i = batch.add_run(part, pos + off, seq, logits_last=end)
                ctx.decode(batch)
                if end:
                    logits = np.array(ctx.logits(i), dtype=np.float32)
            pos += len(toks)
    except BaseException:
        ctx.try_seq_rm(seq, p0, -1)
        raise
    finally:
        batch.close()
    assert logits is not None
    return pos, logits


def picture(seed, size=32):
    """A deterministic 32x32 RGB test picture: gradients plus seeded noise."""
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, size, dtype=np.uint8)
    a = np.stack([np.add.outer(base, base) // 2, np.tile(base, (size, 1)),
                  rng.integers(0, 256, (size, size), dtype=np.uint8)], axis=-1)
    return a.astype(np.uint8)


def talk(engine, msgs, text_or_msg, session, max_tokens=8):
    """Append a user turn (text or a whole message) to ``msgs``, chat, append the reply."""
    msgs.append(text_or_msg if isinstance(text_or_msg, dict)
                else {"role": "user", "content": text_or_msg})
    r = engine.chat(msgs, session=session, max_tokens=max_tokens, temperature=0)
    msgs.append(r.message)
    return r
