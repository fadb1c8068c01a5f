"""How nbkv steers llama-server's prompt cache (nbkv.remote.steering): pure logic, no server.

A small model of llama-server's slot (keep the common prefix, at least one row computed,
the rest in pieces of the physical batch) checks that every planned route makes the real
request compute each row as a canonical prefill would, and that the canonical prefix nbkv
records is the true one, over random turns, regenerates and edits.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nbkv.kv.invariance import PrefillRule
from nbkv.remote import steering
from nbkv.remote.steering import Ledger, Offered, Step, pieces, route, settles

Q4_1 = PrefillRule(2, 1)  # the embedded SmolLM2 (docs/concepts/exactness.md)
Q4_K = PrefillRule(8, 4)  # Q4_K_M: 4-aligned chunks of 8+ rows


class FakeServer:
    """One llama-server slot, modelled: which rows of its KV are canonical.

    A row is ``"block"`` (computed as every canonical prefill computes it: settled),
    ``"tail"`` (a remainder row of an aligned chunk of ``threshold`` rows or more: exact for
    that very prompt only) or ``"bad"`` (anything else: a one-row decode, a short or
    misaligned chunk, a row beside a junk row's remainder).
    """

    def __init__(self, rule: PrefillRule, ubatch: int = steering.UBATCH) -> None:
        self.rule, self.ubatch = rule, ubatch
        self.tokens: list[int] = []
        self.kind: list[str] = []
        self.requests = 0

    def complete(self, prompt: list[int], cache_prompt: bool = True) -> int:
        """Serve a request; returns its cache_n (rows kept)."""
        self.requests += 1
        keep = steering.common_prefix(self.tokens, prompt) if cache_prompt else 0
        if keep == len(prompt):
            keep -= 1  # llama-server evaluates at least one row
        self.tokens, self.kind = self.tokens[:keep], self.kind[:keep]
        a, t = self.rule.align, self.rule.threshold
        for lo, hi in pieces(keep, len(prompt), self.ubatch):
            rows = hi - lo
            ok = lo % a == 0 and (rows >= t or (lo == 0 and hi == len(prompt)))
            for i in range(lo, hi):
                block = ok and i < lo + rows // a * a
                self.kind.append("block" if block else "tail" if ok else "bad")
            self.tokens += prompt[lo:hi]
        return keep

    def generate(self, reply: list[int]) -> None:
        """The reply's tokens, one-row decodes (all but the last sampled token)."""
        self.tokens += reply[:-1]
        self.kind += ["bad"] * (len(reply) - 1)


def run(server: FakeServer, steps: list[Step], prompt: list[int]) -> int:
    """Send ``steps``; returns the real request's cache_n."""
    got = None
    for s in steps:
        sent = prompt[:s.end] + ([s.junk] if s.junk is not None else [])
        got = server.complete(sent, cache_prompt=not s.fresh)
        assert got == s.start, (s, got)
    return got


def exact(server: FakeServer, n: int, start: int) -> bool:
    """Every row of the real request is canonical: settled before it, or computed by it
    (its last piece's remainder rows are exact for this very prompt)."""
    return all(k == "block" or (k == "tail" and i >= start)
               for i, k in enumerate(server.kind[:n]))


def test_pieces_and_what_they_settle():
    assert pieces(0, 600) == [(0, 256), (256, 512), (512, 600)]
    assert settles(0, 600, Q4_1, junk=False) == 600
    assert settles(0, 257, Q4_1, junk=False) is None  # a one-row last piece
    assert settles(3, 40, Q4_K, junk=False) is None  # not 4-aligned
    assert settles(8, 45, Q4_K, junk=False) == 44  # rows 44 is a remainder row
    # a junk row: its chunk's remainder is not settled, and the junk row never is
    assert settles(8, 44, Q4_K, junk=True) == 44
    assert settles(8, 46, Q4_K, junk=True) == 44
    assert settles(0, 255, Q4_1, junk=True) == 255
    assert settles(0, 4, Q4_K, junk=True) == 0  # 5 rows: below the threshold


def test_a_continued_conversation_drops_the_reply_and_reads_from_the_prompts_end():
    prompt = list(range(10, 60))
    held = prompt[:40] + [7, 8, 9]  # the last turn: 40 prompt rows, then its reply
    steps = route(prompt, held, 40, Q4_1, guard_restore=False)
    assert steps == [Step(50, None, 40, 50)]  # the reply differs: the server cuts it itself
    held = prompt[:45]  # the reply's first rows re-tokenize as this prompt's
    steps = route(prompt, held, 40, Q4_1)
    assert steps[0] == Step(40, 0, 40, 40) and steps[-1] == Step(50, None, 40, 50)


def test_a_regenerate_reads_the_last_rows_again_as_a_batch():
    prompt = list(range(10, 90))
    held = prompt + [5, 6]  # the same prompt and the reply it got
    steps = route(prompt, held, 80, Q4_1)
    assert [s.end for s in steps] == [78, 80] and steps[-1].start == 78
    steps = route(prompt, held, 80, Q4_K)
    assert steps[-1].start == 72 and steps[-1].settled == 80


def test_a_prompt_ending_a_row_past_the_batch_is_split_so_every_piece_is_a_chunk():
    prompt = list(range(100, 357))  # 257 tokens: 256 + 1 from scratch
    steps = route(prompt, [], 0, Q4_1)
    assert steps == [Step(255, 0, 0, 255, fresh=True), Step(257, None, 255, 257)]


def test_the_real_request_never_leaves_room_for_a_restore():
    prompt = list(range(10, 110))
    other = prompt[:30] + list(range(500, 600))  # another conversation: 30 shared rows
    steps = route(prompt, other, 130, Q4_1)
    # keeps 30 of 130 rows: the server would look in its cache; a steering request first
    assert steps[0] == Step(30, 0, 30, 30) and steps[-1].start == 30
    # ... unless it knows there is no cache
    assert route(prompt, other, 130, Q4_1, guard_restore=False) == [Step(100, None, 30, 100)]
    # keeping 10% or less of the prompt: computed from scratch, where no load can reach
    long = list(range(10, 400))
    assert route(long, long[:30], 30, Q4_1)[-1].fresh


def test_rewrite_route_rebuilds_a_reply_as_a_batch():
    held = list(range(10, 70))  # 50 prompt rows + a 10-token reply
    steps = steering.rewrite_route(held, 50, Q4_1)
    assert steps == [Step(50, 0, 50, 50), Step(60, 0, 50, 60)]
    held = list(range(10, 210))  # 50 + a 150-token reply: in pieces of 64 rows
    steps = steering.rewrite_route(held, 50, Q4_1)
    assert [(s.start, s.end) for s in steps] == [(50, 50), (50, 114), (114, 178), (178, 200)]
    assert steering.rewrite_route(held, 200, Q4_1) is None  # nothing to gain
    assert steering.rewrite_route([*held[:-1], -1], 50, Q4_1) is None  # unknown rows


def test_the_ledger_proves_a_restore_by_its_least_canonical_candidate():
    led = Ledger(size=3)
    a = tuple(range(10, 60))
    led.offer(Offered(a, 40, "ann"))
    led.offer(Offered(a[:45] + (1, 2), 45, "ann"))
    sent = list(a[:45]) + [0]
    assert led.proven(sent, 45) == 40  # two states fit: the first is canonical to 40 only
    assert led.proven(list(range(900, 950)), 20) == 0  # no state nbkv knows
    for i in range(5):
        led.offer(Offered((i,) * 5, 5, None))
    assert len(led) == 3


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_steered_requests_are_exact_and_the_recorded_prefix_is_true(data):
    rule = data.draw(st.sampled_from([Q4_1, Q4_K, PrefillRule(4, 2)]))
    ubatch = data.draw(st.sampled_from([16, 32, 256]))
    server = FakeServer(rule, ubatch)
    held: list[int] = []
    settled = 0
    convo: list[int] = []
    prompts = []
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["turn", "turn", "regenerate", "edit", "other",
                                        "rewrite"]))
        if op == "regenerate" and prompts:
            prompt = prompts[-1]
        elif op == "edit" and prompts:
            back = prompts[data.draw(st.integers(0, len(prompts) - 1))]
            cut = data.draw(st.integers(0, len(back)))
            prompt = back[:cut] + data.draw(st.lists(st.integers(3, 99), min_size=1,
                                                     max_size=40))
        elif op == "other":
            prompt = data.draw(st.lists(st.integers(3, 99), min_size=1, max_size=70))
        elif op == "rewrite":
            steps = steering.rewrite_route(held, settled, rule, ubatch=ubatch,
                                           chunk=data.draw(st.sampled_from([8, 16, 64])))
            if steps:
                run(server, steps, held)
                held, settled = held + [steps[-1].junk], steps[-1].settled
                assert all(k == "block" for k in server.kind[:settled])
            continue
        else:
            prompt = convo + data.draw(st.lists(st.integers(3, 99), min_size=1,
                                                max_size=90))
        steps = route(prompt, held, settled, rule, ubatch=ubatch,
                      guard_restore=data.draw(st.booleans()))
        assert steps is not None and len(steps) <= 2
        start = run(server, steps, prompt)
        assert exact(server, len(prompt), start), (rule, ubatch, steps, server.kind)
        settled = steps[-1].settled
        assert all(k == "block" for k in server.kind[:settled]), (steps, server.kind)
        reply = data.draw(st.lists(st.integers(3, 99), min_size=1, max_size=12))
        server.generate(reply)
        held = list(server.tokens)
        prompts.append(prompt)
        convo = prompt + reply
