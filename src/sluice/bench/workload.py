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
    """A tool-calling agent's conversation that re-sends its growing history: after each
    tool result the assistant writes its whole task list again, one item's status changed
    (the running-state pattern of planning agents), then its next call."""
    cities = ["Paris", "Lisbon", "Oslo", "Kyoto", "Lima", "Cairo", "Perth", "Quebec", "Seville", "Tallinn"]
    todo = rng.sample(cities, 6)
    status = {c: "pending" for c in todo}

    def plan() -> str:
        return "\n".join(f"- [{'x' if status[c] == 'done' else ' '}] weather for {c}: {status[c]}" for c in todo)

    msgs = [{"role": "system", "content": "You are a travel agent with a weather tool. After every tool result, "
                                          "write the task list again with the finished item checked, then the "
                                          'next call as {"tool": "weather", "city": ...}.'},
            {"role": "user", "content": "Check the weather for: " + ", ".join(todo) + "."}]
    for city in todo[:rng.randint(2, 4)]:
        msgs.append({"role": "assistant", "content": f'{plan()}\n{{"tool": "weather", "city": "{city}"}}'})
        status[city] = "done"
        msgs.append({"role": "user", "content": f'Tool result: {{"city": "{city}", "max_c": {rng.randint(5, 30)}, '
                                                f'"rain_mm": {rng.randint(0, 20)}}}'})
    return msgs


def make_repetitive_prompts(tokenizer, n: int, seed: int = 0) -> list[str]:
    """n chat prompts (rendered with the model's template) whose answers repeat their own
    context, in turn: edit this code (a standard-library function, returned whole with
    one name changed), proofread and quote (a documentation passage, returned whole and
    corrected), and a tool-calling agent loop replaying its history (its task list
    re-written after every call)."""
    rng = random.Random(seed)
    funcs, docs = _functions(), [d for d in corpus().split("\n\n") if 300 < len(d) < 900]
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            src = rng.choice(funcs)
            name = src.split("def ", 1)[1].split("(", 1)[0]
            ask = (f"Rename the function {name} to {name}_v2 and return the whole function, otherwise "
                   f"unchanged, in a code block:\n```python\n{src}```")
            msgs = [{"role": "user", "content": ask}]
        elif kind == 1:
            doc = rng.choice(docs)
            msgs = [{"role": "user", "content": "Proofread this passage and return it in full with any typos "
                                                f"fixed:\n\n{doc}"}]
        else:
            msgs = _agent_history(rng)
        out.append(tokenizer.apply_chat_template(msgs))
    return out
