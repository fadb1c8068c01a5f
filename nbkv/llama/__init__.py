"""The only code that touches ``llama_cpp``.

The model and context, sampling, hardware options, the memory plan, GGUF headers,
and where model files come from.
"""
