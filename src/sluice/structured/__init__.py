"""Structured outputs: what a request's output must match (params.py) and the grammar
engine that turns that into token masks during continuous batching (grammar.py)."""
