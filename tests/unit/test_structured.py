"""Structured outputs without a model: the params' checks, the grammar compiler on
SmolLM2's tokenizer (masks, cache, errors), the bitmask layout and the sampler's mask."""
from __future__ import annotations

import json

import pytest
import torch

from sluice.sampling_params import SamplingParams
from sluice.structured.grammar import GrammarCompiler, allowed_tokens
from sluice.structured.params import StructuredOutputsParams
from sluice.worker.sampler import apply_grammar


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    return GrammarCompiler(hf_tokenizer, {2}, vocab_size=49152, cache_size=2)


def allowed_ids(compiler, grammar) -> set[int]:
    from sluice.structured.grammar import MaskFiller
    filler = MaskFiller(compiler.mask_width)
    mask = allowed_tokens(filler.finish(filler.start([grammar])), compiler.vocab_size)[0]
    return set(torch.nonzero(mask).flatten().tolist())


def test_params_shapes():
    p = SamplingParams(structured_outputs={"json": '{"type": "object"}'})
    assert p.structured_outputs.kind == "json" and p.structured_outputs.json == {"type": "object"}
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    same = [StructuredOutputsParams(json={"b": 1, "a": 2}), StructuredOutputsParams(json='{"a": 2, "b": 1}')]
    assert same[0].canonical() == same[1].canonical()
    for bad, match in [({}, "exactly one"), ({"regex": ""}, "regex"), ({"choice": ["a", 3]}, "choice"),
                       ({"json": [1]}, "JSON schema"), ({"json_object": "yes"}, "json_object"),
                       ({"grammar": "x" * 300_000}, "grammar")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams(structured_outputs="json")


def test_masks_follow_the_grammar(compiler, hf_tokenizer):
    g = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
    first = allowed_ids(compiler, g)
    assert hf_tokenizer.encode("yes", add_special_tokens=False)[0] in first
    assert hf_tokenizer.encode("no", add_special_tokens=False)[0] in first
    assert 2 not in first and len(first) < 20  # EOS is not allowed before a choice is complete
    for t in hf_tokenizer.encode("yes", add_special_tokens=False):
        assert g.accept(t)
    assert g.finished
    # Digits only, then EOS allowed too once one digit is in.
    g = compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
    digits = allowed_ids(compiler, g)
    assert all(hf_tokenizer.decode([t]).isdigit() for t in digits) and 2 not in digits
    assert g.accept(hf_tokenizer.encode("7", add_special_tokens=False)[0])
    assert 2 in allowed_ids(compiler, g) and not g.finished


def test_json_is_written_with_fixed_separators(compiler, hf_tokenizer):
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    for text, ok in [('{"a": 1}', True), ('{"a":1}', False), ('{ "a": 1}', False), ('{\n"a": 1}', False)]:
        g = compiler.compile(spec)
        assert g.matcher.consume_tokens(hf_tokenizer.encode(text, add_special_tokens=False)) == ok, text
    compact = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    g = compiler.compile(compact)
    assert g.matcher.consume_tokens(hf_tokenizer.encode('{"a":[1,2]}', add_special_tokens=False))


def test_cache_is_bounded_and_copies_are_independent(compiler, hf_tokenizer):
    specs = [StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+")]
    grammars = [compiler.compile(s) for s in specs]
    assert len(compiler._cache) == 2 and specs[0].canonical() not in compiler._cache
    again = compiler.compile(specs[2])  # a cache hit: a fresh copy, not the used one
    assert grammars[2].accept(hf_tokenizer.encode("c", add_special_tokens=False)[0])
    assert 2 not in allowed_ids(compiler, again) and 2 in allowed_ids(compiler, grammars[2])


@pytest.mark.parametrize("spec, match", [
    (dict(json={"type": "object", "properties": {"a": {"not": {}}}}), "not"),
    (dict(regex="a{"), "regex"),
    (dict(grammar='start: "a" ('), "grammar"),
    (dict(grammar="root ::= [a-"), "grammar"),
])
def test_compile_errors_name_the_field(compiler, spec, match):
    with pytest.raises(ValueError, match=match) as e:
        compiler.compile(StructuredOutputsParams(**spec))
    assert str(e.value).startswith("structured_outputs.")


def test_compile_async_refuses_past_its_time_limit(hf_tokenizer):
    import asyncio
    slow = GrammarCompiler(hf_tokenizer, {2}, vocab_size=49152, compile_timeout_s=1e-6)
    spec = StructuredOutputsParams(json={"type": "object", "properties": {
        f"k{i}": {"type": "string", "pattern": "^[a-z]{3}[0-9]{2}$"} for i in range(40)}})
    with pytest.raises(ValueError, match="longer than"):
        asyncio.run(slow.compile_async(spec))


def test_bitmask_layout_and_sampler_mask():
    # Bit j of word i is token 32 i + j (llguidance's layout).
    bm = torch.zeros((2, 3), dtype=torch.int32)
    bm[0, 0] = 1 << 5
    bm[1, 2] = -2**31  # bit 31 of word 2: token 95
    mask = allowed_tokens(bm, 90)
    assert mask.shape == (2, 90) and torch.nonzero(mask).tolist() == [[0, 5]]
    logits = torch.randn(3, 8)
    allowed = torch.zeros(2, 8, dtype=torch.bool)
    allowed[0, 3] = True
    allowed[1, [1, 2]] = True
    banned = logits.clone()
    banned[2, 1] = banned[2, 2] = float("-inf")  # a ban that leaves row 2's grammar nothing
    out = apply_grammar(banned, logits, torch.tensor([0, 2]), allowed)
    assert torch.equal(out[1], logits[1])
    assert torch.isfinite(out[0]).tolist() == [False, False, False, True] + [False] * 4
    assert torch.equal(out[2, 1:3], logits[2, 1:3]) and torch.isneginf(out[2, [0, 3, 4, 5, 6, 7]]).all()


def test_kernel_bitmask_matches_torch(isa_kernels):
    """The kernels' in-place apply_token_bitmask gives the torch path's logits, with
    all-zero, all-one and mixed words, a vocabulary that is not a multiple of 32, a mask
    narrower than the vocabulary, and rows in any order."""
    g = torch.Generator().manual_seed(0)
    for V, W in ((1000, 32), (1000, 30), (64, 2)):
        bm = torch.randint(-2**31, 2**31 - 1, (5, W), dtype=torch.int32, generator=g)
        bm[0, :3] = 0
        bm[1, :] = -1
        bm[2, 1] = -2**31  # only bit 31
        logits = torch.randn(8, V, generator=g)
        rows = torch.tensor([6, 0, 3, 7, 2])
        expect = apply_grammar(logits, logits, rows, allowed_tokens(bm, V))
        got = logits.clone()
        isa_kernels.apply_token_bitmask(got, bm, rows)
        assert torch.equal(got, expect)


def test_json_schema_options_are_not_dropped(compiler, hf_tokenizer):
    """additionalProperties false and an enum hold in the masks, not just in validation."""
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"c": {"enum": ["x"]}},
                                         "required": ["c"], "additionalProperties": False})
    g = compiler.compile(spec)
    assert not g.matcher.consume_tokens(hf_tokenizer.encode('{"d"', add_special_tokens=False))
    g = compiler.compile(spec)
    assert g.matcher.consume_tokens(hf_tokenizer.encode(json.dumps({"c": "x"}), add_special_tokens=False))
    assert g.finished
