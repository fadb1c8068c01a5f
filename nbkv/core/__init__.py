"""Records, events, errors, settings and the chat API every engine shares.

The bottom floor: it imports nothing else of nbkv, and nothing here loads a model.
"""
