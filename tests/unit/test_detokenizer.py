"""Incremental detokenization, including characters whose UTF-8 bytes span tokens."""
from __future__ import annotations

from sluice.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Ünïcödé: 日本語のテキスト, emoji 🎉🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "  leading spaces\n\nand\tcontrol characters",
]


def test_incremental_text_equals_full_decode(hf_tokenizer):
    tok = Tokenizer(hf_tokenizer, {2})
    prompt = tok.encode("Say something:")
    split_char_seen = False
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.add(t) for t in ids]
        out = "".join(deltas) + detok.flush()
        assert out == tok.decode(ids)
        assert "\ufffd" not in out
        split_char_seen |= "" in deltas
    # The multilingual text has characters made of several byte-level tokens.
    assert split_char_seen
