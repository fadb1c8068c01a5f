"""The projector pre-flight's child: libmtmd loads the projector and encodes one tiny image.

Run as ``python -m nbkv.media.probe TEXT_MODEL PROJECTOR`` by
:func:`nbkv.media.projector_check.preflight`, never in the kernel: a native abort here ends
only this process. The last line of its output is a JSON object, the projector's facts or
``{"error": ...}`` for a refusal libmtmd reported without aborting.
"""

from __future__ import annotations

import json
import logging
import sys

import numpy as np

from nbkv.core.errors import NbkvError

PROBE_SIZE = 32  # pixels per side of the probe image


def probe(model_path: str, projector_path: str) -> dict[str, object]:
    """Load the pair, tokenize and encode one image; what the parent needs to know."""
    from nbkv.llama.backend import Model
    from nbkv.media.images import Image
    from nbkv.media.projector import Projector

    model = Model(model_path)
    rng = np.random.default_rng(0)
    img = Image.from_rgb(rng.integers(0, 256, (PROBE_SIZE, PROBE_SIZE, 3), dtype=np.uint8))
    with Projector(projector_path, model, n_threads=1, preflight=False) as proj:
        with proj.tokenize(proj.marker, [img], use_cache=False) as prompt:
            chunks = prompt.image_chunks()
            if not chunks:
                return {"error": "libmtmd made no image chunk of the probe image"}
            for c in chunks:
                proj.encode_chunk(c)
            return {"n_embd_out": proj.n_embd, "tokens_per_tile": chunks[0].n_tokens,
                    "uses_mrope": proj.uses_mrope, "non_causal": proj.non_causal}


def main(argv: list[str]) -> int:
    """Entry point: print the probe's JSON line; 0 unless the arguments are wrong."""
    if len(argv) != 2:
        print("usage: python -m nbkv.media.probe TEXT_MODEL PROJECTOR", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    try:
        out = probe(*argv)
    except NbkvError as err:
        out = {"error": str(err)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
