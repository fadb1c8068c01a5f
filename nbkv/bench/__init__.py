"""Side-by-side benchmark of nbkv's caches (``python -m nbkv.bench``; see :mod:`.cli`).

One module per scenario family; each registers its scenarios with
``@scenario("name")`` (:mod:`.registry`). A full run plays them in the order the modules
are imported below: a new family is a new module, imported there.
"""

# isort: off
from nbkv.bench import text, vision, subagents, decode, families, restore, kv_types, remote  # noqa: F401
from nbkv.bench import thrash  # noqa: F401
from nbkv.bench import quants, back_to_back, dashboard, load, lean  # noqa: F401
# isort: on

from nbkv.bench.cli import main
from nbkv.bench.decode import DECODE_PROMPTS
from nbkv.bench.registry import SCENARIOS, scenario

__all__ = ["DECODE_PROMPTS", "SCENARIOS", "main", "scenario"]
