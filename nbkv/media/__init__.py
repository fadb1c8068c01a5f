"""Images in prompts.

Loading pictures, the vision projector (libmtmd) and its pre-flight, image
embeddings, and media prompts.
"""
