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


def test_token_text_is_each_tokens_own_decode_once(hf_tokenizer, monkeypatch):
    """A logprob entry's text: the token decoded alone with special tokens shown, decoded
    once per id however many positions name it."""
    tok = Tokenizer(hf_tokenizer, {2})
    ids = tok.encode("Ünïcödé 🎉 text", add_special_tokens=False) + [0, 1, 2]
    for tid in ids:
        assert tok.token_text(tid) == hf_tokenizer.decode([tid], skip_special_tokens=False)
    calls = []
    real = hf_tokenizer.decode
    monkeypatch.setattr(hf_tokenizer, "decode", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert [tok.token_text(t) for t in ids] == [real([t], skip_special_tokens=False) for t in ids]
    assert calls == []
