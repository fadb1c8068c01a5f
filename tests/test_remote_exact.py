"""Exact replies on a real llama-server, proven or said (issue 38).

The oracle is the in-kernel engine with its cache off: every request computed from
scratch. A remote record that says ``exact=True`` must carry the oracle's reply, token for
token, whatever the flow: new turns, regenerates, edits a few turns back, more sessions
than slots (with and without the server's ``--cache-ram``), concurrent requests, an
interrupted reply. Where nbkv cannot prove it, the record says ``exact=False`` and why.
"""

from __future__ import annotations

import os
import random

import pytest

import nbkv
from nbkv import Engine
from nbkv.remote.server import LlamaServer, binary
from nbkv.ui.figures import summary

if binary() is None:
    if os.environ.get("NBKV_REQUIRE_SERVER"):
        raise RuntimeError("no llama-server binary, and NBKV_REQUIRE_SERVER is set: "
                           "run `make llama-server`")
    pytest.skip("no llama-server binary: run `make llama-server`", allow_module_level=True)

CTX = 1024
MAX_TOKENS = 8
WORDS = ("lighthouse", "storm", "keeper", "ship", "lamp", "night", "sea", "rocks", "fog",
         "bell", "island", "harbour", "gull", "wave", "captain", "rope", "map", "star")


@pytest.fixture(scope="module")
def oracle():
    e = Engine(n_slots=1, n_ctx=CTX, cache="off")
    yield e
    e.close()


def _want(oracle, memo, msgs, **kw):
    key = (repr(msgs), repr(sorted(kw.items())))
    if key not in memo:
        memo[key] = oracle.chat(msgs, max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw).text
    return memo[key]


def _server(**kw) -> LlamaServer:
    kw.setdefault("slots", 2)
    return LlamaServer(ctx=CTX, threads=2, **kw)


def test_the_lighthouse_keeper_and_a_regenerate_equal_cache_off(oracle):
    """The issue's two flows: five turns, then four turns and their last one again."""
    memo: dict = {}
    with _server(cache_ram=0) as srv:
        e = nbkv.connect(srv.url)
        try:
            assert e.rule is not None, e.why_not_exact
            conv = [{"role": "system", "content": "You are a lighthouse keeper. Answer in "
                                                  "one sentence."}]
            for q in ("Who are you?", "What do you see tonight?", "Is a storm coming?",
                      "Will you warn the ships?", "What happens at dawn?"):
                conv.append({"role": "user", "content": q})
                r = e.chat(conv, "keeper", max_tokens=MAX_TOKENS)
                assert r.record.exact, summary(r.record)
                assert r.text == _want(oracle, memo, conv), summary(r.record)
                conv.append(r.message)
            e.settle()  # the last reply's KV rewritten as a batch, in idle time
            s = e.slots()[r.record.slot]
            assert s.settled == s.n_tokens - 1  # all but the junk row after it
            planets = []
            for q in ("Name a planet.", "How big is it?", "What colour?", "Any moons?"):
                planets.append({"role": "user", "content": q})
                r = e.chat(planets, "planets", max_tokens=MAX_TOKENS)
                planets.append(r.message)
            again = e.chat(planets[:-1], "planets", max_tokens=MAX_TOKENS)
            assert again.record.exact and again.text == r.text == _want(
                oracle, memo, planets[:-1])
            assert again.record.reused_tokens >= again.record.prompt_tokens - 2
            assert "not proven exact" not in summary(again.record)
        finally:
            e.close()


def test_an_interrupted_reply_never_runs_beside_the_next_request(oracle, monkeypatch):
    """llama-server stops an answer whose connection closed only when it next writes to it
    (on a loaded machine many seconds later: it then computes it beside the next request,
    in one batch). Here it is never seen to let go in time: the next request, on another
    slot, waits until it did, and is exact."""
    from nbkv.remote.exchange import Exchange

    monkeypatch.setattr(Exchange, "server_length", lambda self, wait=5.0: None)
    with _server(cache_ram=0) as srv:
        e = nbkv.connect(srv.url)
        try:
            bob = [{"role": "user", "content": "Name a ship."}]
            r = e.chat(bob, "bob", max_tokens=MAX_TOKENS)
            bob += [r.message, {"role": "user", "content": "Who sails it?"}]
            stream = e.chat([{"role": "user", "content": "Tell me a long story about the "
                                                         "sea."}], "ann", stream=True,
                            max_tokens=24)
            for i, _ in enumerate(stream):
                if i == 1:
                    break
            stream.close()
            r = e.chat(bob, "bob", max_tokens=MAX_TOKENS)
            assert r.record.slot != stream.record.slot
            assert r.record.exact, summary(r.record)
            assert r.text == _want(oracle, {}, bob)
        finally:
            e.close()


def _turn(rng, conv):
    words = rng.sample(WORDS, rng.randint(2, 4))
    return {"role": "user", "content": f"Tell me about the {' and the '.join(words)}."}


def _run_flows(e, oracle, rng, n_requests, memo):
    """Random flows on ``e``; returns (exact, replies that ran to their end) and asserts
    exact replies are right (an interrupted one is partial: never counted exact)."""
    convs = {name: [{"role": "system", "content": f"You are {name.title()}, a sailor. "
                                                  f"Answer briefly."}]
             for name in ("ann", "bob", "cat")}
    past: dict[str, list] = {name: [] for name in convs}  # the prompts each session sent
    done = ended = exact = 0

    def check(msgs, res):
        nonlocal done, ended, exact
        done += 1
        rec = res.record
        if rec.finish_reason == "cancelled":
            return
        ended += 1
        assert rec.verified, summary(rec)
        if rec.exact:
            exact += 1
            assert res.text == _want(oracle, memo, msgs), (summary(rec), msgs)
        else:
            assert "not proven exact: " in summary(rec)  # and says why

    while done < n_requests:
        op = rng.choice(("turn", "turn", "turn", "regenerate", "edit", "concurrent",
                         "interrupt"))
        name = rng.choice(sorted(convs))
        conv = convs[name]
        if op == "regenerate" and past[name]:
            msgs = past[name][-1]
            check(msgs, e.chat(msgs, name, max_tokens=MAX_TOKENS))
        elif op == "edit" and len(past[name]) >= 2:
            back = rng.randint(1, min(3, len(past[name])))
            head = past[name][-back][:-1]
            msgs = [*head, _turn(rng, head)]
            res = e.chat(msgs, name, max_tokens=MAX_TOKENS)
            check(msgs, res)
            convs[name] = [*msgs, res.message]
            past[name].append(msgs)
        elif op == "concurrent":
            names = rng.sample(sorted(convs), 2)
            batch = [[*convs[n], _turn(rng, convs[n])] for n in names]
            results = e.chat_many(batch, names, max_tokens=MAX_TOKENS)
            for n, msgs, res in zip(names, batch, results):
                check(msgs, res)
                convs[n] = [*msgs, res.message]
                past[n].append(msgs)
        elif op == "interrupt":
            msgs = [*conv, _turn(rng, conv)]
            stream = e.chat(msgs, name, stream=True, max_tokens=16)
            for i, _ in enumerate(stream):
                if i == 2:
                    break
            stream.close()
            check(msgs, stream)
            convs[name] = [*msgs, {"role": "assistant", "content": stream.text}]
            past[name].append(msgs)
        else:
            msgs = [*conv, _turn(rng, conv)]
            res = e.chat(msgs, name, max_tokens=MAX_TOKENS)
            check(msgs, res)
            convs[name] = [*msgs, res.message]
            past[name].append(msgs)
        if rng.random() < 0.3:
            e.settle()  # a pause while the user reads: the reply is rewritten meanwhile
    return exact, ended


@pytest.mark.slow
@pytest.mark.parametrize("seed,cache_ram", [(1, 0), (2, 64), (3, 64)])
def test_random_flows_never_claim_exact_for_a_reply_that_differs(oracle, seed, cache_ram):
    """New turns, regenerates, edits 1-3 turns back, three sessions on two slots,
    concurrent requests and interrupts: every reply whose record says exact equals the
    cache-off engine's; nearly all of them are exact."""
    memo: dict = {}
    with _server(cache_ram=cache_ram) as srv:
        e = nbkv.connect(srv.url)
        try:
            exact, ended = _run_flows(e, oracle, random.Random(seed), 40, memo)
            recs = e.history
            restored = [r for r in recs if r.restored_from]
            if cache_ram:
                assert restored, "three sessions on two slots: the server restores some"
            else:
                assert not restored
        finally:
            e.close()
    # nearly every reply that ran to its end is proven exact (seed 1: 34 of 34, at load 10-16;
    # before an interrupted answer was waited for, the request after it often ran beside it
    # on the server and said so: 80-83% of all requests, interrupted ones included)
    assert exact >= 0.9 * ended, (exact, ended)


def test_flags_the_server_does_not_state_are_said_on_every_record(oracle):
    """A llama-server nbkv's launcher did not start says nothing of -b/-ub/-fa: the replies
    come from cache all the same, and every record says it is not proven exact, and why."""
    with _server(cache_ram=0, advertise=False) as srv:
        e = nbkv.connect(srv.url)
        try:
            assert e.rule is None and "does not report how it computes" in e.why_not_exact
            r = e.chat([{"role": "user", "content": "Hi!"}], "ann", max_tokens=4)
            assert not r.record.exact
            assert "not proven exact: llama-server does not report" in summary(r.record)
            assert any(k == "exact" and v.startswith("no (") for k, v in e.describe())
        finally:
            e.close()
    with _server(cache_ram=0) as srv:
        e = nbkv.connect(srv.url, exact=False)
        try:
            r = e.chat([{"role": "user", "content": "Hi!"}], "ann", max_tokens=4)
            assert not r.record.exact and "exact=False" in summary(r.record)
        finally:
            e.close()


def test_a_repeat_penalty_samples_as_in_the_kernel(oracle):
    """repeat_penalty looks back over the same window on both sides (the prompt's last
    repeat_last_n tokens, then the reply's), on a fresh prompt and on a cached turn."""
    msgs = [{"role": "user", "content": "Write one sentence about a dog."}]
    with _server(cache_ram=0) as srv:
        e = nbkv.connect(srv.url)
        try:
            for penalty, last_n in ((1.3, 64), (1.5, 8), (1.2, 256)):
                kw = dict(repeat_penalty=penalty, repeat_last_n=last_n, max_tokens=10)
                got = e.chat(msgs, "dog", **kw)
                assert got.text == oracle.chat(msgs, **kw).text, (penalty, last_n)
                more = [*msgs, got.message, {"role": "user", "content": "And a cat?"}]
                again = e.chat(more, "dog", **kw)
                assert again.record.exact and again.record.reused_tokens > 0
                assert again.text == oracle.chat(more, **kw).text, (penalty, last_n)
        finally:
            e.close()


def test_at_the_context_edge_both_engines_stop_alike(oracle):
    """A prompt two tokens short of the context: the same reply length on both engines."""
    with _server(cache_ram=0) as srv:
        e = nbkv.connect(srv.url)
        try:
            def msgs(k):
                return [{"role": "system", "content": "note " * k},
                        {"role": "user", "content": "Write a sentence about the sea."}]

            base = len(e.tokenize_prompt(msgs(10))) - 10  # one token per " note"
            k = CTX - 2 - base
            while len(e.tokenize_prompt(msgs(k))) > CTX - 2:
                k -= 1
            assert len(e.tokenize_prompt(msgs(k))) == CTX - 2
            got = e.chat(msgs(k), "edge", max_tokens=8)
            want = oracle.chat(msgs(k), max_tokens=8)
            assert got.record.generated_tokens == want.record.generated_tokens == 2
            assert got.text == want.text
            assert got.record.finish_reason == want.record.finish_reason == "length"
        finally:
            e.close()
