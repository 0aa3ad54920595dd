"""The grammar engine: StructuredOutputsParams -> per-request matchers -> token masks.

Built on llguidance (docs/design.md says why it and not xgrammar). One GrammarCompiler per
engine holds the tokenizer's llguidance form (built on first use, ~0.7 s for SmolLM2) and
a bounded LRU of compiled grammars; each request gets its own copy of one (a Grammar,
its parser state). Compiling is fast (llguidance builds its lexer lazily, as tokens come),
yet a server compiles off its event loop and engine thread, with a time limit
(`compile_async`), so a slow schema holds up no one else; the engine thread then finds
it in the cache.

Per step, MaskFiller fills the constrained rows' token bitmasks on a thread while the
forward pass runs (llguidance drops the GIL); the sampler applies them before any other
transform (the kernels' apply_token_bitmask, else `allowed_tokens` and torch's ops).
Each mask step is bounded by llguidance's parser limits (its "lexer fuel": ~15 ms at
most at the defaults).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from sluice.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# The separators of JSON output (params.py says why fixed): json.dumps' by default, none
# with disable_any_whitespace. JSON_SPACED is also the style of tool calls' bodies.
JSON_SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _llguidance():
    import llguidance
    return llguidance


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for a spec. Raises ValueError for a JSON
    schema llguidance cannot read; other errors surface when the grammar is compiled."""
    LLMatcher = _llguidance().LLMatcher
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else {"type": "object"}
        options = _JSON_COMPACT if spec.disable_any_whitespace else JSON_SPACED
        try:
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        except Exception as e:  # llguidance raises ValueError or RuntimeError on a bad schema
            raise ValueError(f"structured_outputs.json: the schema cannot be used: {e}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes, so any choice text is one literal.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    text = spec.grammar
    if "::=" in text:  # GBNF (llama.cpp's grammars): llguidance converts it to Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            text = gbnf_to_lark(text)
        except Exception as e:
            raise ValueError(f"structured_outputs.grammar: not a valid GBNF grammar: {e}") from None
    return LLMatcher.grammar_from_lark(text)


def schema_error(schema: dict) -> str | None:
    """Why llguidance cannot use this JSON schema (an unsupported keyword, a bad type or
    pattern), else None. Needs no tokenizer: for checking tools' parameters up front."""
    LLMatcher = _llguidance().LLMatcher
    try:
        source = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_SPACED)
    except Exception as e:
        return str(e)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(source)
    return _first_line(messages[0]) if is_error else None


class Grammar:
    """One request's place in its grammar: the tokens it may sample next, fed the ones it did."""
    __slots__ = ("matcher",)

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refused it (then it is in error)."""
        return self.matcher.consume_token(token_id)

    @property
    def finished(self) -> bool:
        """Nothing but end-of-sequence can follow (the grammar is complete, or in error)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def copy(self) -> "Grammar":
        return Grammar(self.matcher.deep_copy())


class GrammarCompiler:
    def __init__(self, hf_tokenizer, eos_token_ids: set[int], vocab_size: int,
                 cache_size: int = 64, compile_timeout_s: float = 10.0):
        self.hf_tokenizer = hf_tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        # The model's logits width (may exceed the tokenizer's: padded embeddings).
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self._llg_tokenizer = None
        self._lock = threading.Lock()          # the tokenizer's first build, and the cache
        self._cache: OrderedDict[str, object] = OrderedDict()  # canonical spec -> pristine matcher
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sluice-grammar")
        self.compiles = 0                 # cache misses compiled, and their seconds (for /metrics)
        self.compile_seconds = 0.0

    @property
    def llg_tokenizer(self):
        with self._lock:
            if self._llg_tokenizer is None:
                import llguidance.hf
                t = time.perf_counter()
                n_vocab = max(self.vocab_size, len(self.hf_tokenizer))
                self._llg_tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=n_vocab, eos_token=self.eos_token_ids or None)
                logger.info("grammar engine: llguidance tokenizer of %d tokens ready in %.2f s", n_vocab,
                            time.perf_counter() - t)
            return self._llg_tokenizer

    @property
    def mask_width(self) -> int:
        """int32 words per row of a bitmask (llguidance's layout: bit j of word i = token 32 i + j)."""
        return (max(self.vocab_size, len(self.hf_tokenizer)) + 31) // 32

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """A fresh Grammar for `spec` (from the cache when it was compiled before). Raises
        ValueError, naming the field, for a spec llguidance refuses."""
        key = spec.canonical()
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                return Grammar(pristine.deep_copy())
        llg = _llguidance()
        tokenizer = self.llg_tokenizer
        t = time.perf_counter()
        source = grammar_source(spec)
        matcher = llg.LLMatcher(tokenizer, source, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind}: {_first_line(matcher.get_error())}")
        elapsed = time.perf_counter() - t
        with self._lock:
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.compiles += 1
            self.compile_seconds += elapsed
        return Grammar(matcher.deep_copy())

    async def compile_async(self, spec: StructuredOutputsParams) -> None:
        """Compile on this compiler's threads, so the caller's loop goes on; the result
        waits in the cache for the engine. ValueError past compile_timeout_s (the thread
        finishes, or fails, on its own: nothing else waits for it)."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.compile, spec)
        try:
            await asyncio.wait_for(asyncio.shield(future), self.compile_timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(f"structured_outputs.{spec.kind}: the grammar took longer than "
                             f"{self.compile_timeout_s:g} s to compile; simplify it") from None


def _first_line(message: str) -> str:
    lines = [s for s in message.strip().splitlines() if s.strip()]
    return " ".join(lines[:4]) if lines else "invalid grammar"


class MaskFiller:
    """Fills the token bitmasks of a step's constrained rows on a thread, so that the work
    overlaps the forward pass, and hands them over as a boolean mask."""

    def __init__(self, mask_width: int):
        self.mask_width = mask_width
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-mask")
        self._executor = None
        self.fill_seconds = 0.0   # on the thread, summed
        self.wait_seconds = 0.0   # the step waited for the thread, summed
        self.rows = 0

    def start(self, grammars: list[Grammar]) -> Future:
        if self._executor is None:
            # One thread: the forward pass has the cores; a mask is ~0.1 ms per row.
            self._executor = _llguidance().LLExecutor(num_threads=1)
        bitmask = torch.empty((len(grammars), self.mask_width), dtype=torch.int32)
        self.rows += len(grammars)
        return self._pool.submit(self._fill, [g.matcher for g in grammars], bitmask)

    def _fill(self, matchers, bitmask: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                               bitmask.shape[1] * 4, bitmask.shape[0])
        self.fill_seconds += time.perf_counter() - t
        return bitmask

    def finish(self, future: Future) -> torch.Tensor:
        """The step's [R, W] int32 bitmasks, once the thread has filled them."""
        t = time.perf_counter()
        bitmask = future.result()
        self.wait_seconds += time.perf_counter() - t
        return bitmask


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmasks -> [R, vocab_size] bool, True where the token may be sampled
    (numpy's unpackbits: 7x faster than shifting in torch). Tokens past the mask: False."""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits).view(torch.bool)
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    return allowed[:, :vocab_size]
