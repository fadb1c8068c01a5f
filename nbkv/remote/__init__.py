"""Serving engines behind the same API.

llama-server driven by nbkv's slot table, any OpenAI-compatible server (vLLM,
SGLang), their saves, and the llama-server launcher (``python -m nbkv.remote.server``).
"""
