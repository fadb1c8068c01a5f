"""Prompt-lookup drafter: pure logic, no model."""

from nbkv.engine.drafts import NgramDrafter
from nbkv.media.units import MediaKey, MediaUnit


def test_no_guess_without_an_earlier_match():
    assert NgramDrafter().draft() is None
    assert NgramDrafter([1, 2, 3]).draft() is None


def test_guess_is_the_token_after_the_latest_match():
    d = NgramDrafter([5, 1, 7, 5, 1, 8, 5, 1])
    assert d.draft() == 8  # "5 1" was last followed by 8, not 7


def test_longest_match_wins():
    # the 1-gram (2) was last followed by 9; the 3-gram (0 1 2) by 4
    d = NgramDrafter([0, 1, 2, 4, 3, 2, 9, 0, 1, 2])
    assert d.draft() == 4


def test_history_grows_with_generated_tokens():
    d = NgramDrafter([10, 11, 12, 13])
    d.append(10)
    assert d.draft() == 11
    d.append(11)
    assert d.draft() == 12
    d.append(99)
    assert d.draft() is None


def test_image_positions_are_matched_but_never_proposed():
    key = MediaKey("h", 0, 2, 2)
    units = [3, MediaUnit(key, 0), MediaUnit(key, 1), 4, 3]
    d = NgramDrafter(units)
    assert d.draft() is None  # 3 was followed by an image position
    d.append(MediaUnit(key, 0))
    d.append(MediaUnit(key, 1))
    assert d.draft() == 4


def test_matches_only_up_to_max_n():
    # "2 3 4" was followed by 5; the later "3 4" (after a 7) by 8
    history = [2, 3, 4, 5, 7, 3, 4, 8, 2, 3, 4]
    assert NgramDrafter(history, max_n=3).draft() == 5  # the 3-gram wins when it may match
    assert NgramDrafter(history, max_n=2).draft() == 8  # at most 2 tokens are matched
    assert NgramDrafter(history, max_n=1).draft() == 8
    # the same when the history grows token by token (generated tokens)
    two, three = NgramDrafter(history[:8], max_n=2), NgramDrafter(history[:8], max_n=3)
    for t in history[8:]:
        two.append(t)
        three.append(t)
    assert (two.draft(), three.draft()) == (8, 5)
