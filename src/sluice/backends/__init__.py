"""Backends: what this machine can run, and (later) which implementation runs each op.

`platform.py` is the one reader of the CPU's features; every "can this mode run here?"
question is answered from it, before any weight is loaded.
"""
