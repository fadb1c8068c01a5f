"""The IPython layer: magics, commands, sessions and turns, settings.

The top floor: ``%load_ext nbkv`` loads :mod:`nbkv.notebook.magics`.
"""
