"""Incremental detokenization, including characters whose UTF-8 bytes span tokens."""
from __future__ import annotations

import random

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


class WindowsOnly(Tokenizer):
    """The same tokenizer without tokenizers' DecodeStream: windows decoded in Python."""

    def decode_stream(self, skip_special_tokens: bool = True):
        return None


def stream_and_windows_agree(tok: Tokenizer, texts: list[str], seed: int = 0) -> int:
    """Feeds the same ids to both paths, token by token, with a plain prompt and a chat
    prompt's tail, special tokens skipped and shown: the deltas and the flush must match.
    Returns how many sequences were compared."""
    assert tok.decode_stream() is not None
    windows = WindowsOnly(tok.hf, tok.eos_token_ids)
    rng = random.Random(seed)
    vocab, special = len(tok.hf), sorted(tok.hf.all_special_ids)
    cases = [tok.encode(t, add_special_tokens=False) for t in texts]
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(60)]  # bytes cut anywhere
    cases += [[rng.choice(special + [rng.randrange(vocab)]) for _ in range(12)] for _ in range(20)]
    prompts = [tok.encode("Say something:"), tok.encode_chat([{"role": "user", "content": "Hi"}])]
    compared = 0
    for skip in (True, False):
        for i, ids in enumerate(cases):
            prompt = prompts[i % 2]
            fast, slow = IncrementalDetokenizer(tok, prompt, skip), IncrementalDetokenizer(windows, prompt, skip)
            assert fast.stream is not None and slow.stream is None
            assert [fast.add(t) for t in ids] == [slow.add(t) for t in ids], (skip, ids)
            assert fast.flush() == slow.flush()
            compared += 1
    return compared


def test_decode_stream_gives_the_windows_text(hf_tokenizer):
    """SmolLM2's tokenizer through tokenizers' DecodeStream (Rust): the same text a token
    as decoding windows through transformers, and the same flush."""
    tok = Tokenizer(hf_tokenizer, {2})
    assert stream_and_windows_agree(tok, TEXTS) == 2 * (len(TEXTS) + 80)


def test_a_failing_stream_hands_over_to_the_windows(hf_tokenizer):
    """A sequence tokenizers refuses mid-stream: the windows go on from the stream's place."""
    tok = Tokenizer(hf_tokenizer, {2})
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Say something:"))

    class Refusing:
        def step(self, rust, token_id):
            raise RuntimeError("Invalid prefix encountered")

    half = len(ids) // 2
    deltas = [detok.add(t) for t in ids[:half]]
    detok.stream = (Refusing(), detok.stream[1])
    deltas += [detok.add(t) for t in ids[half:]]
    assert detok.stream is None
    assert "".join(deltas) + detok.flush() == tok.decode(ids)
