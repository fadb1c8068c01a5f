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

from nbkv.bench.back_to_back import scenario_back_to_back
from nbkv.bench.cli import main
from nbkv.bench.conversations import (
    QUESTIONS,
    TOPICS,
    baselines,
    mean,
    paragraph,
    run_conversations,
    system_prompt,
)
from nbkv.bench.dashboard import HeadlessComm, scenario_dashboard
from nbkv.bench.decode import (
    DECODE_FOLLOWUP,
    DECODE_PROMPTS,
    DECODE_VARIANTS,
    scenario_decode,
    scenario_speculative,
)
from nbkv.bench.families import FAMILIES, family_model, scenario_families
from nbkv.bench.kv_types import scenario_kv_types
from nbkv.bench.quants import QUANTS, scenario_quants
from nbkv.bench.registry import SCENARIOS, Scenario, scenario
from nbkv.bench.remote import scenario_remote
from nbkv.bench.report import TARGETS, print_report, targets
from nbkv.bench.restore import scenario_restore
from nbkv.bench.runners import (
    MAX_TOKENS,
    HandlerRunner,
    LimitRunner,
    LlamaCacheRunner,
    LlamaCppRunner,
    LlamaDecodeRunner,
    NbkvRunner,
    RemoteRunner,
)
from nbkv.bench.subagents import batching_ceiling, scenario_subagents
from nbkv.bench.text import (
    scenario_drift,
    scenario_interleaved,
    scenario_shared_system,
    scenario_single,
)
from nbkv.bench.thrash import scenario_thrash
from nbkv.bench.vision import (
    IMAGE_FOLLOWUPS,
    VISION_HANDLERS,
    VISION_PAIRS,
    scenario_vision,
    scenario_vision_families,
    scenario_vision_families_realistic,
    scenario_vision_realistic,
)

__all__ = [
    "DECODE_FOLLOWUP", "DECODE_PROMPTS", "DECODE_VARIANTS", "FAMILIES", "IMAGE_FOLLOWUPS",
    "MAX_TOKENS", "QUANTS", "QUESTIONS", "SCENARIOS", "TARGETS", "TOPICS", "VISION_HANDLERS",
    "VISION_PAIRS", "HandlerRunner", "HeadlessComm", "LimitRunner", "LlamaCacheRunner",
    "LlamaCppRunner", "LlamaDecodeRunner", "NbkvRunner", "RemoteRunner", "Scenario", "baselines",
    "batching_ceiling", "family_model", "main", "mean", "paragraph", "print_report",
    "run_conversations", "scenario", "scenario_back_to_back", "scenario_dashboard",
    "scenario_decode", "scenario_drift", "scenario_families", "scenario_interleaved",
    "scenario_kv_types", "scenario_quants", "scenario_remote", "scenario_restore",
    "scenario_shared_system", "scenario_single", "scenario_speculative", "scenario_subagents",
    "scenario_thrash",
    "scenario_vision", "scenario_vision_families", "scenario_vision_families_realistic",
    "scenario_vision_realistic", "system_prompt", "targets",
]
