"""Image conversation scenarios: nbkv against llama-cpp-python's multimodal chat handlers."""

from __future__ import annotations

from typing import Any

from nbkv.bench.conversations import mean
from nbkv.bench.registry import scenario
from nbkv.bench.runners import HandlerRunner, NbkvRunner


def _png_data_uri(seed: int, size: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(a).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGE_FOLLOWUPS = ["Describe its colours.", "Is it a photo?", "What is two plus two?",
                   "Back to the picture: is it bright?", "Summarize."]


def _vision_runner(variant: str, path: str, mmproj: str) -> Any:
    """nbkv (``"imc"``, or ``"off"`` with its embedding cache off too), else the
    llama-cpp-python chat handler of that name."""
    from nbkv.media.embeddings import EmbeddingCache

    if variant not in ("imc", "off"):
        return HandlerRunner(path, mmproj, variant, 4096)
    return NbkvRunner(path, variant, 1, 4096, settle=False, mmproj=mmproj, n_batch=1024,
                      embedding_cache=EmbeddingCache(0 if variant == "off" else 256 << 20))


def _image_chat(runner: Any, kind: str, n_turns: int) -> list[dict[str, Any]]:
    """A picture (32 px for ``"tiny"`` projectors, else 512), then text follow-ups about it:
    each turn's figures (``runner.turn``)."""
    uri = _png_data_uri(7, 32 if kind == "tiny" else 512)
    first = {"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": uri}}]}
    hist: list[dict] = [{"role": "system", "content": "You describe pictures briefly."}]
    out = []
    try:
        for t in range(n_turns):
            hist.append(first if t == 0 else {"role": "user", "content": IMAGE_FOLLOWUPS[t - 1]})
            r = runner.turn(hist, "v")
            hist.append({"role": "assistant", "content": r["text"]})
            out.append(r)
    finally:
        runner.close()
    return out


@scenario("vision")
def scenario_vision(path: str, quick: bool, kind: str = "tiny") -> dict[str, Any]:
    """An image conversation of 6 turns: nbkv IMC vs. llama-cpp's Llava15ChatHandler vs. off."""
    from nbkv.fixtures import make_mmproj

    projector = "mlp" if kind == "tiny" else "gemma3"
    mmproj = str(make_mmproj(kind=kind, projector=projector))
    n_turns = 3 if quick else 6
    variants = {"imc": "imc", "off": "off", "llava-handler": "Llava15ChatHandler"}
    results = {name: _image_chat(_vision_runner(v, path, mmproj), kind, n_turns)
               for name, v in variants.items()}
    final = {v: rs[-1]["ttft"] for v, rs in results.items()}
    return {
        "projector": f"{kind} {projector}", "turns": n_turns,
        "first_turn_prompt_positions": results["imc"][0]["prompt"],
        "ttft_s_per_turn": {v: [r["ttft"] for r in rs] for v, rs in results.items()},
        "encoder_runs": {v: sum(r["encoder_runs"] for r in rs) for v, rs in results.items()},
        "mean_ttft_s": {v: mean([r["ttft"] for r in rs[1:]]) for v, rs in results.items()},
        "ratios": {"imc_vs_handler_final_turn_ttft": final["llava-handler"] / final["imc"],
                   "imc_vs_off_final_turn_ttft": final["off"] / final["imc"]},
    }


@scenario("vision-realistic")
def scenario_vision_realistic(path: str, quick: bool) -> dict[str, Any]:
    """The same with a SmolVLM-sized projector (768 wide, 12 blocks, 512-px images)."""
    return scenario_vision(path, quick, kind="realistic")


#: (text family, projector type) of the generated vision pairs (tests/test_vision_families.py)
VISION_PAIRS = (("gemma3", "gemma3"), ("lfm2", "lfm2"), ("llama", "idefics3"),
                ("qwen2vl", "qwen2vl_merger"), ("qwen2vl", "qwen2.5vl_merger"),
                ("qwen3vl", "qwen3vl_merger"))
#: llama-cpp-python's chat handler for a projector type; the others get its LLaVA-1.5 handler,
#: which runs any libmtmd projector (its ``MTMDChatHandler`` needs a chat template that takes
#: content lists, which SmolLM2's, copied into the generated text models, does not)
VISION_HANDLERS = {"qwen2vl_merger": "Qwen25VLChatHandler",
                   "qwen2.5vl_merger": "Qwen25VLChatHandler"}


@scenario("vision-families")
def scenario_vision_families(path: str, quick: bool, kind: str = "tiny") -> dict[str, Any]:
    """The 6-turn image conversation on every generated vision pair: TTFT of nbkv IMC against
    llama-cpp-python's chat handler for the pair (``VISION_HANDLERS``) and nbkv
    ``cache="off"``, both of which re-encode and re-prefill every turn.

    The text models are tiny (64 wide) and so is the text prefill: what is measured is the
    image's cost. ``kind="tiny"`` (32-px images, 2-block ViT) shows the mechanism;
    ``"realistic"`` (SigLIP-B-sized, 512-px images: seconds per encode) the speed-up a user
    sees. ``path`` is unused (each pair brings its own text model).
    """
    from nbkv.fixtures import make_mmproj, make_text_model

    n_turns = 3 if quick else 6
    out: dict[str, Any] = {"turns": n_turns, "projectors": kind, "pairs": {}, "ratios": {}}
    for family, proj in VISION_PAIRS:
        text = str(make_text_model(family, vision=proj))
        mmproj = str(make_mmproj(kind=kind, projector=proj, text_width=64))
        handler = VISION_HANDLERS.get(proj, "Llava15ChatHandler")
        runs = {v: _image_chat(_vision_runner(v, text, mmproj), kind, n_turns)
                for v in ("imc", "off", handler)}
        per: dict[str, Any] = {v: {"ttft_s_per_turn": [r["ttft"] for r in rs],
                                   "encoder_runs": sum(r["encoder_runs"] for r in rs)}
                               for v, rs in runs.items()}
        per["final_prompt_positions"] = runs["imc"][-1]["prompt"]
        name = f"{family}+{proj}"
        out["pairs"][name] = per
        final = per["imc"]["ttft_s_per_turn"][-1]
        out["ratios"][f"{name}_imc_vs_handler_final_turn_ttft"] = (
            per[handler]["ttft_s_per_turn"][-1] / final)
        out["ratios"][f"{name}_imc_vs_off_final_turn_ttft"] = (
            per["off"]["ttft_s_per_turn"][-1] / final)
    return out


@scenario("vision-families-realistic")
def scenario_vision_families_realistic(path: str, quick: bool) -> dict[str, Any]:
    """The same with SigLIP-B-sized projectors (768 wide, 12 blocks, 512-px images)."""
    return scenario_vision_families(path, quick, kind="realistic")
