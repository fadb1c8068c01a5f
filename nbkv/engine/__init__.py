"""The in-kernel engine: the facade, the scheduler thread and its parts.

``nbkv.Engine`` is :class:`nbkv.engine.facade.Engine`.
"""
