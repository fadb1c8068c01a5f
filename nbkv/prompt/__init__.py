"""From messages to tokens, and tokens back to text.

The model's chat template in a sandbox, the prompt builder, and the text stream.
"""
