"""Side-by-side benchmark of nbkv's caches (``python -m nbkv.bench``; see :mod:`.cli`).

One module per scenario family; each registers its scenarios with
``@scenario("name")`` (:mod:`.registry`). A full run plays them in the order the modules
are imported below: a new family is a new module, imported there.
"""

# isort: off
from . import text, vision, subagents, decode, families, restore, kv_types, remote  # noqa: F401
from . import thrash  # noqa: F401
from . import quants, back_to_back, dashboard  # noqa: F401
# isort: on

from .back_to_back import scenario_back_to_back
from .cli import main
from .conversations import (
    QUESTIONS,
    TOPICS,
    baselines,
    mean,
    paragraph,
    run_conversations,
    system_prompt,
)
from .dashboard import HeadlessComm, scenario_dashboard
from .decode import (
    DECODE_FOLLOWUP,
    DECODE_PROMPTS,
    DECODE_VARIANTS,
    scenario_decode,
    scenario_speculative,
)
from .families import FAMILIES, family_model, scenario_families
from .kv_types import scenario_kv_types
from .quants import QUANTS, scenario_quants
from .registry import SCENARIOS, Scenario, scenario
from .remote import scenario_remote
from .report import TARGETS, print_report, targets
from .restore import scenario_restore
from .runners import (
    MAX_TOKENS,
    HandlerRunner,
    LimitRunner,
    LlamaCacheRunner,
    LlamaCppRunner,
    LlamaDecodeRunner,
    NbkvRunner,
    RemoteRunner,
)
from .subagents import batching_ceiling, scenario_subagents
from .text import scenario_drift, scenario_interleaved, scenario_shared_system, scenario_single
from .thrash import scenario_thrash
from .vision import (
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
