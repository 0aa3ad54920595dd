"""LoRA adapters (lora/): PEFT folders made here with PEFT on the tiny random checkpoints,
served alone and mixed in one batch with the base model, against transformers + PEFT's
merged model in float32; prefix-cache isolation, slot eviction, bad adapters, and
deterministic mode's bits with adapters mixed."""
from __future__ import annotations

import json

import pytest
import torch

from sluice import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free
from tests.model.test_vs_transformers import hf_greedy

peft = pytest.importorskip("peft")

PROMPTS = ["Hello", "The history of the Roman Empire begins with",
           "In a small village by the sea, there lived an old fisherman who every morning walked to the harbour"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three shapes of adapter: every target; a few targets with rsLoRA; per-module rank and alpha.
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=ALL),
    "rs": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    "pattern": dict(r=16, lora_alpha=32, target_modules=["o_proj", "gate_proj", "up_proj", "k_proj"],
                    rank_pattern={"o_proj": 8}, alpha_pattern={"gate_proj": 4}),
}


def make_adapter(base_path, folder, seed: int, **config) -> None:
    """A random PEFT LoRA adapter for the checkpoint at base_path, saved in folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_path, torch_dtype=torch.float32)
    # init_lora_weights=False: B random too (PEFT's default zero B would make the adapter a no-op).
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **config))
    with torch.no_grad():  # deltas of the size of a trained adapter's, not of a fresh layer's init
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for seed, (name, cfg) in enumerate(ADAPTERS.items()):
        make_adapter(base, root / name, seed, **cfg)
        out[name] = str(root / name)
    return base, out


def merged_reference(base, folder):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    return PeftModel.from_pretrained(model, folder).merge_and_unload().eval()


@pytest.fixture(scope="module")
def lora_llm(adapters):
    base, folders = adapters
    return LLM(model=str(base), dtype="float32", num_blocks=128, lora_modules=folders, max_loras=2)


def test_adapters_alone_and_mixed_match_peft_merged(adapters, lora_llm):
    """Each adapter's greedy tokens equal transformers on PEFT's merged model, and its
    logprobs within float32 tolerance; the same when all three and the base model share
    one batch (with max_loras=2, so slots are swapped between steps' adapters)."""
    from transformers import AutoModelForCausalLM
    base, folders = adapters
    n = 16
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
    refs = {None: AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()}
    refs.update({name: merged_reference(base, folder) for name, folder in folders.items()})
    expected = {}
    for name, ref in refs.items():
        for prompt in PROMPTS:
            ids = lora_llm.tokenizer.encode(prompt)
            expected[name, prompt] = hf_greedy(ref, ids, n)
    # Each adapter alone (a batch of its three prompts).
    for name in folders:
        outs = lora_llm.generate(PROMPTS, params, lora=name)
        for prompt, out in zip(PROMPTS, outs):
            tokens, lps = expected[name, prompt]
            assert out.outputs[0].token_ids == tokens, (name, prompt)
            for step, (got, ref) in enumerate(zip(out.outputs[0].logprobs, lps)):
                for tid, lp in got.items():
                    assert abs(lp.logprob - float(ref[tid])) < 2e-4, (name, prompt, step)
    # The adapters differ from the base model (else the test above proves nothing).
    assert len({tuple(expected[name, PROMPTS[1]][0]) for name in refs}) == len(refs)
    # All mixed: 4 models x 3 prompts in one call, so in the same steps.
    names = [None, *folders]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [name for _ in PROMPTS for name in names]
    loads = lora_llm.engine.lora.loads
    outs = lora_llm.generate(prompts, params, lora=loras)
    for prompt, name, out in zip(prompts, loras, outs):
        assert out.outputs[0].token_ids == expected[name, prompt][0], (name, prompt)
    assert lora_llm.engine.lora.loads > loads  # three adapters through two slots
    assert_all_blocks_free(lora_llm)


def test_prefix_cache_is_per_adapter(lora_llm):
    """An adapter's cached prompt blocks serve the same adapter again, never another
    adapter or the base model (their K/V differ)."""
    prompt = "The history of the Roman Empire begins with " * 4
    params = SamplingParams(temperature=0, max_tokens=2)
    first = lora_llm.generate([prompt], params, lora="all")[0]
    assert lora_llm.generate([prompt], params, lora="all")[0].num_cached_tokens > 0
    assert lora_llm.generate([prompt], params, lora="rs")[0].num_cached_tokens == 0
    assert lora_llm.generate([prompt], params)[0].num_cached_tokens == 0
    assert first.num_cached_tokens == 0
    assert_all_blocks_free(lora_llm)


def test_load_and_unload_at_run_time(adapters, lora_llm, tmp_path):
    base, folders = adapters
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = lora_llm.generate(PROMPTS[:1], params, lora="rs")[0].outputs[0].token_ids
    lora_llm.load_lora("rs-again", folders["rs"])
    assert lora_llm.generate(PROMPTS[:1], params, lora="rs-again")[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="already loaded"):
        lora_llm.load_lora("rs-again", folders["rs"])
    lora_llm.unload_lora("rs-again")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'rs-again'"):
        lora_llm.generate(PROMPTS[:1], params, lora="rs-again")
    with pytest.raises(ValueError, match="no LoRA adapter named"):
        lora_llm.unload_lora("rs-again")
    assert_all_blocks_free(lora_llm)


def _broken(src, dst, edit_config=None, edit_tensors=None):
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        edit_config(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    return str(dst)


def test_bad_adapters_are_one_clear_error(adapters, lora_llm, tmp_path):
    """Each is refused naming the adapter and what is wrong; nothing loaded is touched."""
    _, folders = adapters
    src = tmp_path.parent / "x"
    from pathlib import Path
    src = Path(folders["all"])

    def wide(t):
        k = next(k for k in t if k.endswith("q_proj.lora_A.weight"))
        t[k] = torch.zeros(t[k].shape[0], t[k].shape[1] + 1)

    def lm_head(t):
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
        t["base_model.model.lm_head.lora_B.weight"] = torch.zeros(49152, 8)

    cases = {
        "missing": (str(tmp_path / "nowhere"), "no adapter_config.json"),
        "shape": (_broken(src, tmp_path / "shape", edit_tensors=wide), r"lora_A \(8, 65\).*another model"),
        "target": (_broken(src, tmp_path / "target", edit_tensors=lm_head), "target module 'lm_head' is not supported"),
        "dora": (_broken(src, tmp_path / "dora", edit_config=lambda c: c.update(use_dora=True)), "DoRA"),
        "rank": (_broken(src, tmp_path / "rank", edit_config=lambda c: c.update(r=4)), "its config says 4"),
    }
    before = dict(lora_llm.engine.lora_names())
    for name, (path, message) in cases.items():
        with pytest.raises(ValueError, match=message) as e:
            lora_llm.load_lora(name, path)
        assert repr(name) in str(e.value)
    assert lora_llm.engine.lora_names() == before
    with pytest.raises(ValueError, match="above max_lora_rank 4"):
        LLM(model=str(adapters[0]), dtype="float32", num_blocks=16, lora_modules={"all": folders["all"]},
            max_lora_rank=4)
    with pytest.raises(ValueError, match="serves none"):
        LLM(model=str(adapters[0]), dtype="float32", num_blocks=16).generate(["x"], lora="all")


def test_deterministic_mode_keeps_its_bits_with_adapters_mixed(adapters, kernel_isa):
    """bf16 on the batch-invariant kernels: a request's tokens and logprobs are the same
    bits alone as in a batch mixing adapters and the base model."""
    base, folders = adapters
    llm = LLM(model=str(base), dtype="bfloat16", num_blocks=128, deterministic=True, lora_modules=folders,
              max_loras=3, cpu_isa=kernel_isa, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)

    def result(out):
        return out.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in out.outputs[0].logprobs]

    names = [None, *folders]
    alone = {(name, p): result(llm.generate([p], params, lora=name)[0]) for name in names for p in PROMPTS[1:]}
    prompts = [p for p in PROMPTS[1:] for _ in names]
    loras = [name for _ in PROMPTS[1:] for name in names]
    model = llm.engine.runner.model
    stack = model.fast_forward
    assert stack is not None and stack.lora is llm.engine.lora  # the decoder stack takes the adapters
    for _ in range(2):  # the decoder stack, then the Python loop over the layers: the same bits
        mixed = llm.generate(prompts, params, lora=loras)
        for p, name, out in zip(prompts, loras, mixed):
            assert result(out) == alone[name, p], (name, p, model.fast_forward is None)
        model.fast_forward = None
    model.fast_forward = stack
    # A weight update rebuilds the stack; the adapters' slots go with it.
    llm.load_weights(str(base))
    assert model.fast_forward is not stack and model.fast_forward.lora is llm.engine.lora
    assert result(llm.generate([PROMPTS[1]], params, lora="all")[0]) == alone["all", PROMPTS[1]]
    assert_all_blocks_free(llm)


def test_gemma3_adapter_matches_peft_and_moe_experts_are_refused(tiny_checkpoint, tmp_path):
    """Another architecture through the same checkpoint map (Gemma 3: GeGLU, QK-norm); an
    adapter on a mixture of experts' experts is refused by name."""
    base = tiny_checkpoint("gemma3")
    make_adapter(base, tmp_path / "g", 1, r=8, lora_alpha=64, target_modules=ALL)
    llm = LLM(model=str(base), dtype="float32", num_blocks=64, lora_modules={"g": str(tmp_path / "g")})
    ids = llm.tokenizer.encode(PROMPTS[1])
    ref_tokens, ref_lps = hf_greedy(merged_reference(base, str(tmp_path / "g")), ids, 8)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5),
                       lora="g")[0].outputs[0]
    assert out.token_ids == ref_tokens
    for got, ref in zip(out.logprobs, ref_lps):
        assert max(abs(lp.logprob - float(ref[t])) for t, lp in got.items()) < 2e-4
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0].outputs[0].logprobs[0]
    assert max(abs(lp.logprob - float(ref_lps[0][t])) for t, lp in plain.items()) > 0.1  # the adapter matters
    moe = tiny_checkpoint("qwen3-moe")
    make_adapter(moe, tmp_path / "m", 1, r=4, lora_alpha=8, target_modules=ALL)
    with pytest.raises(ValueError, match=r"target module 'model\.layers\.0\.mlp\.experts' is not supported"):
        LLM(model=str(moe), dtype="float32", num_blocks=16, lora_modules={"m": str(tmp_path / "m")})


def test_speculation_and_sessions_with_an_adapter(adapters, lora_llm):
    """Drafts verified on every step give the adapter's own tokens; a session's next call
    under the same adapter finds its history cached."""
    base, folders = adapters
    prompt = "one two three four five six seven eight nine ten one two three four five six seven eight"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = lora_llm.generate([prompt], params, lora="all")[0].outputs[0].token_ids
    spec = LLM(model=str(base), dtype="float32", num_blocks=128, lora_modules=folders, speculative_gate="always",
               num_speculative_tokens=4)
    # A random tiny model never repeats itself, so n-gram lookup finds nothing: the drafts
    # are the adapter's own next tokens, their last one wrong every other step.
    proposer = spec.engine.scheduler.spec.proposer

    def propose(req, k):
        n = req.num_output_tokens
        draft = list(want[n:n + k])
        if draft and n % 2:
            draft[-1] = (draft[-1] + 1) % 1000
        return draft
    proposer.propose = propose
    out = spec.generate([prompt], params, lora="all")[0]
    assert out.outputs[0].token_ids == want
    stats = spec.engine.scheduler.spec.stats
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # kept and rejected drafts, through the adapter
    first = lora_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), lora="rs", session_id="s1")[0]
    follow = first.prompt_token_ids + first.outputs[0].token_ids + lora_llm.tokenizer.encode(" and more")
    again = lora_llm.generate([follow], SamplingParams(temperature=0, max_tokens=4), lora="rs", session_id="s1")[0]
    assert again.num_cached_tokens >= len(first.prompt_token_ids) - 16
    assert lora_llm.release_session("s1") is not None
    assert_all_blocks_free(lora_llm)
    assert_all_blocks_free(spec)
