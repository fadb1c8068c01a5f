"""An oracle that does not trust nbkv: its replies equal llama-cpp-python's own ``Llama``.

nbkv's rendering of the conversation is handed to ``llama_cpp.Llama`` as tokens
(``engine.tokenize_prompt``), so chat templates are out of the comparison. ``Llama`` then
prefills the whole prompt from position 0 in chunks of ``n_batch`` and generates one token
per decode with its greedy sampler: plain llama.cpp. nbkv must reply token for token the
same, whether it prefilled the prompt from scratch, reused most of it from a slot after
other sessions came and went, or reused part of it after an earlier message was edited.
"""

from __future__ import annotations

import os

import llama_cpp
import pytest
from llama_cpp import Llama

from conftest import SYSTEM
from nbkv import Engine
from nbkv.kv import policy
from nbkv.ui.figures import summary

N_BATCH = 256  # nbkv's default n_batch (= n_ubatch); Llama gets the same
N_CTX = 2048  # per slot in nbkv; Llama's one sequence gets the same
MAX_TOKENS = 32  # long enough for a near-tie to show as a different reply

COOK = (
    "You are a friendly kitchen assistant for people who are learning to cook at home. "
    "Answer in two or three short sentences of plain English. Prefer cheap, common "
    "ingredients that can be found in any supermarket, and give quantities in grams and "
    "in cups. Mention food safety whenever raw meat, raw eggs or leftovers are involved: "
    "cooking temperatures, how long food can stay out of the fridge, and how to store it. "
    "When a technique has a name, such as blanching, deglazing or folding, explain it in "
    "one sentence the first time it comes up. If a question is about baking, remind the "
    "cook that measuring by weight is more reliable than measuring by volume. Suggest a "
    "simple substitution when an ingredient is hard to find, and say how it changes the "
    "taste. Never recommend expensive equipment when a pot, a pan and a knife will do. If "
    "the cook sounds worried, reassure them that mistakes in the kitchen are normal and "
    "that most dishes can be rescued with a little salt, acid or patience. Do not invent "
    "recipes from famous restaurants, and say so if you are unsure how a dish is made. "
    "When the cook asks how long something takes, give the time for a typical home stove "
    "and explain how to tell by look, smell or touch when the food is done, because stoves "
    "and pans differ. Encourage tasting while cooking, and adjusting salt at the end."
)
TRAVEL = (
    "You are a calm travel guide who helps people plan short trips by train. Answer in at "
    "most three sentences. Mention the time a journey takes and one thing worth seeing at "
    "the destination. Keep prices approximate and say that they change with the season. "
    "If a plan looks too tight, suggest leaving an hour earlier instead of rushing."
)

SESSIONS = {"A": SYSTEM, "B": COOK, "C": TRAVEL}
QUESTIONS = {
    "A": ["What is a CPU?", "And what does memory do?",
          "Why is a cache faster than memory? My teacher said it has to do with distance and "
          "with how the chips are built, but I did not follow the explanation in class. "
          "Answer with one everyday example, please."],
    "B": ["How do I boil an egg so that the yolk stays soft?",
          "Can I keep the eggs in the fridge for a week after boiling them?"],
    "C": ["How long does the train from Paris to Lyon take?"],
}


@pytest.fixture(scope="module")
def llm(model_path):
    threads = os.cpu_count() or 1  # nbkv.llama.backend.Context: n_threads = n_threads_batch
    model = Llama(
        model_path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH,
        n_threads=threads, n_threads_batch=threads,
        flash_attn=False,  # -> flash_attn_type LLAMA_FLASH_ATTN_TYPE_DISABLED, as nbkv
        swa_full=True,  # as nbkv (SmolLM2 has no sliding window anyway)
        verbose=False,
    )
    p = model.context_params
    assert p.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert (p.n_batch, p.n_ubatch, p.n_threads, p.n_threads_batch) == (
        N_BATCH, N_BATCH, threads, threads)
    assert not p.kv_unified and p.n_seq_max == 1  # one private KV stream, like an nbkv slot
    yield model
    model.close()


@pytest.fixture
def engine(model_path):
    with Engine(model_path, n_slots=2, n_ctx=N_CTX, n_batch=N_BATCH,
                park_ram=0) as e:  # evictions lose the conversation, as in Llama
        assert e.ctx.n_batch == N_BATCH and e.ctx.n_ctx_seq == N_CTX
        assert e.exact and not e.speculative
        yield e


def llama_reply(llm, prompt):
    """Plain llama.cpp's greedy reply to ``prompt``: (tokens without the EOG, finish reason).

    ``reset()`` first sets ``n_tokens`` to 0, so ``generate`` skips its own prefix match with
    the previous comparison and ``eval`` removes the whole KV and prefills from position 0,
    in chunks ``range(0, len(prompt), n_batch)``. ``temp=0`` makes its sampler chain
    penalties (a no-op at repeat_penalty 1, frequency and presence 0) + greedy.
    """
    llm.reset()
    vocab = llm._model.vocab
    tokens: list[int] = []
    gen = llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)
    try:
        for tok in gen:
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                return tokens, "stop"
            tokens.append(tok)
            if len(tokens) >= MAX_TOKENS:
                return tokens, "length"
    finally:
        gen.close()
    raise AssertionError("Llama.generate ended without a token")


def ask(engine, llm, messages, session):
    """nbkv's reply, checked token for token against plain llama.cpp's."""
    prompt = engine.tokenize_prompt(messages)
    # Llama's eval cuts the prompt at multiples of n_batch; a prompt of k*256+1 tokens would
    # leave it a lone last token, which llama.cpp's CPU kernels may round differently from
    # a batch (docs/concepts/exactness.md), while nbkv never decodes a lone prompt token (255+2).
    # That is a known, nameable difference, not one this oracle is after: the compared
    # prompts must avoid that length (change a question's wording if one lands on it).
    assert len(prompt) % N_BATCH != 1, f"prompt of {len(prompt)} tokens: reword a question"
    result = engine.chat(messages, session=session, max_tokens=MAX_TOKENS, temperature=0)
    rec = result.record
    assert rec.prompt_tokens == len(prompt)
    slot = engine.slots()[rec.slot]  # the slot holds the prompt, then the decoded reply
    assert list(slot.tokens[: len(prompt)]) == prompt

    expected, reason = llama_reply(llm, prompt)
    text = llm.detokenize(expected).decode("utf-8", errors="replace")
    assert result.text == text, f"{session}: nbkv and llama.cpp replies differ ({summary(rec)})"
    assert result.finish_reason == reason
    assert rec.generated_tokens == len(expected)
    # every generated token but a length-stopped reply's last one has been decoded into KV
    decoded = list(slot.tokens[len(prompt):])
    assert decoded == expected[: len(decoded)]
    assert len(decoded) >= len(expected) - 1
    return result


def turn(engine, llm, convs, session, question=None):
    """Ask ``session``'s next question (or ``question``) and append the exchange."""
    msgs = convs.setdefault(session, [{"role": "system", "content": SESSIONS[session]}])
    k = sum(m["role"] == "user" for m in msgs)
    msgs.append({"role": "user", "content": question or QUESTIONS[session][k]})
    result = ask(engine, llm, msgs, session)
    msgs.append(result.message)
    return result.record


def test_first_turns_equal_plain_llama_cpp(engine, llm):
    convs: dict = {}
    recs = [turn(engine, llm, convs, s) for s in ("A", "B")]
    assert [r.strategy for r in recs] == [policy.MISS, policy.MISS]
    assert all(r.reused_tokens == 0 for r in recs)
    # COOK's first turn takes two prefill chunks (256 + the rest), in Llama as in nbkv
    assert recs[1].prompt_tokens > N_BATCH


def test_cached_turn_after_interleaved_sessions_and_an_eviction(engine, llm):
    convs: dict = {}
    turn(engine, llm, convs, "A")
    turn(engine, llm, convs, "B")
    second = turn(engine, llm, convs, "A")
    assert second.strategy == policy.HASH_EXTEND and second.reused_tokens > 0
    third_session = turn(engine, llm, convs, "C")  # two slots: B's conversation goes
    assert third_session.evicted_session == "B"
    # the idle-time rewrite of A's second reply may or may not have run by now: either way
    # the reused KV must equal a batched prefill (the rewrite is absorbed otherwise)
    rec = turn(engine, llm, convs, "A")
    assert rec.strategy == policy.HASH_EXTEND and rec.slot == second.slot
    assert rec.reused_tokens > 0 and rec.prefilled_tokens >= 2
    # Llama prefills positions 0-256 then the rest; nbkv only what follows the reused
    # prefix, one chunk across position 256: the two KVs were cut differently
    assert rec.reused_tokens < N_BATCH < rec.prompt_tokens
    back = turn(engine, llm, convs, "B")  # rebuilt after its eviction
    assert back.strategy == policy.MISS and back.evicted_session == "C"


def test_turn_after_an_edited_earlier_message(engine, llm):
    convs: dict = {}
    for _ in range(2):
        turn(engine, llm, convs, "B")
    engine.settle()  # this time the reused replies are rewritten before the request comes
    msgs = convs["B"]
    assert msgs[1]["role"] == "user"
    msgs[1] = {"role": "user", "content": "How do I boil an egg so that the yolk gets firm?"}
    rec = turn(engine, llm, convs, "B", "And how long do they keep once peeled?")
    # the system prompt and the edited message's first words are reused, the rest is trimmed
    assert rec.strategy == policy.HASH_EXTEND and rec.matched_messages == 1
    assert 0 < rec.reused_tokens < rec.prompt_tokens and rec.trimmed_tokens > 0
    # nbkv's prefill starts past position 256, Llama's chunks are 0-256 and 256-end
    assert rec.reused_tokens > N_BATCH
