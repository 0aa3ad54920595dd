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


# -- a repetitive workload (speculative decoding, issue 21) ------------------------------
_CODE_MODULES = ["argparse", "csv", "dataclasses", "functools", "json", "pathlib", "shlex", "textwrap",
                 "configparser", "string", "fnmatch", "glob", "difflib", "calendar", "statistics"]


def _functions(max_lines: int = 40) -> list[str]:
    """Source of the standard library's module-level Python functions of 8-40 lines."""
    out = []
    for name in _CODE_MODULES:
        mod = importlib.import_module(name)
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                try:
                    src = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                if 8 <= src.count("\n") <= max_lines:
                    out.append(src)
    return out


def _agent_history(rng: random.Random) -> list[dict]:
    """A tool-calling agent's conversation: each call re-sends the growing history, and
    the assistant's next call follows the pattern of its earlier ones."""
    cities = ["Paris", "Lisbon", "Oslo", "Kyoto", "Lima", "Cairo", "Perth", "Quebec", "Seville", "Tallinn"]
    msgs = [{"role": "system", "content": "You are a travel agent. Call tools with one JSON object per line: "
                                          '{"tool": "weather", "city": ..., "days": ...}.'},
            {"role": "user", "content": "Check the weather for each city on my list, one call per city: "
                                        + ", ".join(rng.sample(cities, 8)) + "."}]
    for city in rng.sample(cities, rng.randint(3, 5)):
        days = rng.randint(2, 7)
        msgs.append({"role": "assistant", "content": f'{{"tool": "weather", "city": "{city}", "days": {days}}}'})
        temps = ", ".join(str(rng.randint(5, 30)) for _ in range(days))
        msgs.append({"role": "user", "content": f'Tool result: {{"city": "{city}", "days": {days}, '
                                                f'"max_c": [{temps}], "summary": "mostly dry"}}'})
    return msgs


def make_repetitive_prompts(tokenizer, n: int, seed: int = 0) -> list[str]:
    """n chat prompts (rendered with the model's template) whose answers repeat their own
    context, in turn: edit this code (a standard-library function, to be returned with
    one change), quote and summarise (a documentation passage, quoted in full first), and a
    tool-calling agent loop replaying its history (JSON calls in a fixed pattern)."""
    rng = random.Random(seed)
    funcs, docs = _functions(), [d for d in corpus().split("\n\n") if 300 < len(d) < 900]
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            src = rng.choice(funcs)
            msgs = [{"role": "user", "content": "Add a docstring to this function and return the whole function "
                                                f"otherwise unchanged:\n```python\n{src}```"}]
        elif kind == 1:
            doc = rng.choice(docs)
            msgs = [{"role": "user", "content": f"Quote the following passage word for word, then summarise it in "
                                                f"one sentence.\n\n{doc}"}]
        else:
            msgs = _agent_history(rng)
        out.append(tokenizer.apply_chat_template(msgs))
    return out
