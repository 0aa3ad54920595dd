"""xgrammar against llguidance on this CPU, for the default model's tokenizer (issue 20).

For each library: the one-off tokenizer setup, the compile time of a few realistic JSON
schemas, and the time to fill one row's token bitmask (49,152 tokens for SmolLM2) while a
JSON answer is generated token by token (the median and p99 over the steps of a document
the grammar accepts). llguidance is a dependency of sluice; xgrammar is not (it pulls
triton), so for its figures install it beside, e.g.

    .venv/bin/pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xgr .venv/bin/python benchmarks/grammar_libs.py

Without xgrammar importable, only llguidance is measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sluice.models.loader import resolve_model

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        },
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "items": {"type": "array", "minItems": 1, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                               "price": {"type": "number", "minimum": 0}},
                "required": ["sku", "qty", "price"]}},
            "shipping": {"anyOf": [
                {"type": "object", "properties": {"kind": {"const": "pickup"}, "store": {"type": "string"}},
                 "required": ["kind", "store"]},
                {"type": "object", "properties": {"kind": {"const": "post"}, "address": {"type": "string"},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["kind", "address", "zip"]}]},
        },
        "required": ["id", "status", "items", "shipping"],
    },
}
DOC = {"id": "A-1042", "status": "shipped",
       "items": [{"sku": "KB-7", "qty": 2, "price": 19.5}, {"sku": "MS-3", "qty": 1, "price": 7.25}],
       "shipping": {"kind": "post", "address": "12 Rue de la Paix, Paris", "zip": "75002"}}


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"median {1e6 * statistics.median(xs):.0f} us, p99 {1e6 * xs[int(0.99 * (len(xs) - 1))]:.0f} us"


def bench_llguidance(hf, vocab: int, doc_ids: list[int]) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    t = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    print(f"llguidance {llguidance.__version__}: tokenizer setup {time.perf_counter() - t:.2f} s")
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = llguidance.LLMatcher(tok, g)
        assert not m.is_error(), m.get_error()
        mask = lt.allocate_token_bitmask(1, vocab)
        lt.fill_next_token_bitmask(m, mask)  # the first mask is part of getting started
        print(f"  compile {name}: {1e3 * (time.perf_counter() - t):.1f} ms (matcher + first mask)")
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMAS["order"])))
    mask = lt.allocate_token_bitmask(1, vocab)
    times = []
    for tid in doc_ids:
        t = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask)
        times.append(time.perf_counter() - t)
        assert m.consume_token(tid), m.get_error()
    print(f"  mask per token over {len(doc_ids)} tokens of an 'order' document: {_stats(times)}")


def bench_xgrammar(hf, vocab: int, doc_ids: list[int]) -> None:
    try:
        import xgrammar as xgr
    except ImportError as e:
        print(f"xgrammar: not importable ({e}); skipped")
        return
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    from importlib.metadata import version
    print(f"xgrammar {version('xgrammar')}: tokenizer setup {time.perf_counter() - t:.2f} s")
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(schema))
        m = xgr.GrammarMatcher(cg)
        mask = xgr.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(mask)
        print(f"  compile {name}: {1e3 * (time.perf_counter() - t):.1f} ms (compile + first mask)")
    m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMAS["order"])))
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for tid in doc_ids:
        t = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t)
        assert m.accept_token(tid)
    print(f"  mask per token over {len(doc_ids)} tokens of an 'order' document: {_stats(times)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoTokenizer
    src = resolve_model(args.model)
    hf = (AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.path.name) if src.is_gguf
          else AutoTokenizer.from_pretrained(str(src.path)))
    vocab = len(hf)
    doc_ids = hf.encode(json.dumps(DOC), add_special_tokens=False)
    print(f"model {args.model}: vocabulary {vocab}, document {len(doc_ids)} tokens")
    bench_llguidance(hf, vocab, doc_ids)
    bench_xgrammar(hf, vocab, doc_ids)


if __name__ == "__main__":
    main()
