"""Time preparing long histories (no engine, no decoding): PromptBuilder.prepare alone.

Usage: ``python tools/prompt_timing.py error:10000 slide:1000 error:1800:32768`` (each argument
``overflow:messages[:n_ctx]``, n_ctx 2048 by default), with the embedded model's tokenizer and
chat template. Prints the seconds each took and what came of it (kept or refused).
"""

import sys
import time

from nbkv.core.errors import ContextOverflowError
from nbkv.llama.backend import Model
from nbkv.llama.models import default_model_path
from nbkv.prompt.builder import PromptBuilder
from nbkv.prompt.templates import CHATML, ChatTemplate


def history(n):
    """A system prompt, then ``n - 1`` alternating messages, ending on a user message."""
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(n - 1):
        role = "user" if i % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": f"Message {i}: tell me about computing history."})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "And now?"})
    return msgs


def main(args):
    """Prepare one history per argument and print how long each took."""
    model = Model(str(default_model_path()))
    source = model.chat_template or CHATML
    for arg in args:
        overflow, n, *ctx = arg.split(":")
        b = PromptBuilder(model, ChatTemplate(source, model.bos_text, model.eos_text), None,
                          int(ctx[0]) if ctx else 2048)
        msgs = history(int(n))
        t = time.perf_counter()
        try:
            p = b.prepare(msgs, overflow=overflow, max_tokens=64)
            out = f"kept {len(p.messages)} ({len(p.tokens)} tokens), dropped {p.dropped}"
        except ContextOverflowError as e:
            out = f"refused: {e}"[:90]
        print(f"{arg:>16}: {time.perf_counter() - t:8.3f} s  {out}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
