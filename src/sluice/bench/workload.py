"""Seeded prompts over real English text (the standard library's own documentation), so
benchmarks need no download and are repeatable on any machine with the same Python."""
from __future__ import annotations

import importlib
import inspect
import random

_MODULES = ["argparse", "asyncio", "collections", "configparser", "csv", "dataclasses", "datetime",
            "email", "functools", "http.client", "json", "logging", "pathlib", "re", "subprocess",
            "threading", "typing", "unittest", "urllib.request", "zipfile"]


def corpus() -> str:
    parts = []
    for name in _MODULES:
        mod = importlib.import_module(name)
        for obj in [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(dict.fromkeys(parts))


def make_prompts(tokenizer, n: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """n windows of the corpus, each min_len..max_len tokens long, as token ids."""
    ids = tokenizer.encode(corpus(), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out
