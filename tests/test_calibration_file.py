"""The calibration cache file (``nbkv.kv.calibration_file``): signed entries, every field
checked when read, and any doubt measured again (logged), never an unnamed error. No model."""

from __future__ import annotations

import json
import logging

import pytest

from nbkv.kv import calibration_file as cf
from nbkv.kv.invariance import PrefillRule

GOOD = PrefillRule(8, 4, table=((1, False), (2, False), (4, False), (8, True), (12, True)),
                   seconds=1.5)


def body(**rule_fields):
    """A valid entry body with ``rule_fields`` replaced (``...`` removes a field)."""
    rule = {**GOOD.to_json(), **rule_fields}
    return {"rule": {k: v for k, v in rule.items() if v is not ...}, "gen_tested": 2}


BAD = [
    ("align 0", body(align=0), "align is 0"),
    ("align 3", body(align=3, threshold=9, table=[[9, True]]), "not a power of two"),
    ("threshold '8'", body(threshold="8"), "threshold is '8'"),
    ("threshold -4", body(threshold=-4), "threshold is -4"),
    ("threshold True", body(threshold=True), "threshold is True"),
    ("threshold 1e9", body(threshold=10**9), "threshold is 1000000000"),
    ("gen_rows 'x'", body(gen_rows="x"), "gen_rows is 'x'"),
    ("gen_rows 2.0", body(gen_rows=2.0), "gen_rows is 2.0"),
    ("exact 'no'", body(exact="no"), "exact is 'no'"),
    ("single_row 1", body(single_row=1), "single_row is 1"),
    ("mixed None", body(mixed=None), "mixed is None"),
    ("no exact", body(exact=...), "missing ['exact']"),
    ("no threshold", body(threshold=...), "missing ['threshold']"),
    ("unknown field", body(extra=1), "unknown ['extra']"),
    ("reason 3", body(reason=3), "reason or seconds"),
    ("seconds 'x'", body(seconds="x"), "reason or seconds"),
    ("table not a list", body(table="x"), "table"),
    ("table triple", body(table=[[8, True, 1]]), "table"),
    ("table rows '8'", body(table=[["8", True]]), "table"),
    ("table equal 'yes'", body(table=[[8, "yes"]]), "table"),
    ("rule a list", {"rule": [], "gen_tested": 1}, "not an object"),
    ("no rule", {"gen_tested": 1}, "not an object"),
    ("gen_tested 0", {**body(), "gen_tested": 0}, "gen_tested is 0"),
    ("gen_tested '2'", {**body(), "gen_tested": "2"}, "gen_tested is '2'"),
    ("no gen_tested", {"rule": body()["rule"]}, "gen_tested is None"),
    ("body a string", "x", "not an object"),
    # the rule contradicts its own table: a chunk size measured unequal is allowed
    ("threshold 2 align 1", body(threshold=2, align=1), "allows chunks of 2 rows"),
    ("single_row, 1 unequal", body(threshold=8, align=1, single_row=True,
                                   table=[[1, False], [8, True]]), "single_row"),
    ("single_row, align 4", body(single_row=True, table=[[1, True], [8, True]]), "single_row"),
]


@pytest.mark.parametrize("name,entry,why", BAD, ids=[b[0] for b in BAD])
def test_a_bad_entry_is_named(name, entry, why):
    found = cf.check_entry(entry)
    assert isinstance(found, str) and why in found, found


def test_a_good_entry_reads_back():
    rule, gen_tested = cf.check_entry(json.loads(json.dumps(body())))
    assert rule == GOOD and rule.table == GOOD.table and gen_tested == 2
    inexact = PrefillRule(2, 1, exact=False, reason="no grouping", table=((1, False),))
    assert cf.check_entry({"rule": inexact.to_json(), "gen_tested": 1}) == (inexact, 1)


def test_signed_entries_are_used_edited_ones_measured_again(tmp_path, caplog):
    path = tmp_path / cf.FILE
    cf.store("k1", GOOD, path, gen_tested=2)
    cf.store("k2", PrefillRule(2, 1, table=((1, True), (2, True))), path)
    assert cf.cached_entry("k1", path) == (GOOD, 2)
    data = json.loads(path.read_text())
    assert set(data["k1"]) == {"body", "signature"}

    def edit(fn):
        d = json.loads(path.read_text())
        fn(d)
        path.write_text(json.dumps(d))

    caplog.set_level(logging.WARNING, logger="nbkv")
    # a forged rule, consistent with a forged table: only the signature tells
    edit(lambda d: d["k1"]["body"]["rule"].update(
        threshold=2, align=1, table=[[2, True], [8, True]]))
    assert cf.cached_entry("k1", path) is None
    assert "does not match its contents" in caplog.text and "measuring again" in caplog.text
    caplog.clear()
    edit(lambda d: d.update(k1=d["k2"]))  # another key's entry, signed: bound to its key
    assert cf.cached_entry("k1", path) is None and "measuring again" in caplog.text
    caplog.clear()
    edit(lambda d: d.update(k2={"body": d["k2"]["body"]}))  # the signature removed
    assert cf.cached_entry("k2", path) is None and "not signed" in caplog.text
    caplog.clear()
    edit(lambda d: d.update(k2={**GOOD.to_json(), "gen_tested": 1}))  # calibration.json v2
    assert cf.cached_entry("k2", path) is None and "measuring again" in caplog.text
    assert cf.cached_entry("k3", path) is None  # not there: nothing to say


def test_a_signed_entry_with_bad_values_is_measured_again(tmp_path, caplog):
    """Signed by this user's key and still wrong (an older nbkv's bug, say): checked too."""
    path = tmp_path / cf.FILE
    cf.store("k", PrefillRule(8, 0), path)  # align 0: ZeroDivisionError in old code
    caplog.set_level(logging.WARNING, logger="nbkv")
    assert cf.cached_entry("k", path) is None and "align is 0" in caplog.text


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", '{"k": 3}', '{"k": {"body": 1}}'])
def test_garbage_files_are_measured_again(tmp_path, text):
    path = tmp_path / cf.FILE
    path.write_text(text)
    assert cf.cached_entry("k", path) is None
    cf.store("k", GOOD, path)  # and the file is made whole again
    assert cf.cached_entry("k", path) == (GOOD, 1)
