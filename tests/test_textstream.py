"""UTF-8 reassembly and stop strings, without a model."""

from nbkv.core.streams import TextStream


def feed(stream, pieces):
    return [stream.push(p) for p in pieces] + [stream.flush()]


def test_multibyte_split_across_tokens():
    data = "héllo 🙂!".encode()
    pieces = [data[i : i + 1] for i in range(len(data))]
    s = TextStream()
    out = feed(s, pieces)
    assert "".join(out) == "héllo 🙂!" and s.text == "héllo 🙂!"
    assert all("\ufffd" not in o for o in out)


def test_incomplete_utf8_at_end_becomes_replacement():
    s = TextStream()
    assert "".join(feed(s, [b"ok", "🙂".encode()[:2]])) == "ok\ufffd"


def test_stop_string_across_pieces_is_not_shown():
    s = TextStream(["STOP"])
    out = feed(s, [b"abc S", b"TO", b"P tail"])
    assert "".join(out) == "abc " and s.stopped == "STOP"
    assert s.push(b"more") == ""


def test_partial_stop_prefix_is_released_when_it_turns_out_not_to_stop():
    s = TextStream(["</end>"])
    assert s.push(b"a </") == "a "
    assert s.push(b"b>") == "</b>"
    assert s.flush() == ""


def test_earliest_of_several_stops_wins():
    s = TextStream(["xyz", "b"])
    assert "".join(feed(s, [b"aaxyzb"])) == "aa"
    assert s.stopped == "xyz"
