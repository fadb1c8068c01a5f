"""The KV layer: what a slot holds and which slot a request gets.

A slot's KV per memory class, the slot table, the pure cache policy, the system prompt
cache, batch invariance and its calibration, and the from-scratch oracle.
"""
