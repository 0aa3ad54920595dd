"""Our model and loaders against transformers as the reference, in float32."""
from __future__ import annotations

import pytest
import torch

from sluice import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free

PROMPTS = [
    "Hello",
    "The history of the Roman Empire begins with",
    "In a small village by the sea, there lived an old fisherman who every morning walked to the "
    "harbour, checked his nets and talked to the gulls about the weather and the price of fish.",
]


def hf_greedy(model, prompt_ids: list[int], n: int):
    """Reference greedy decoding with transformers' own KV cache: tokens and logprobs. (Its
    tokens were checked equal to recomputing the whole sequence at every step, which took
    2.3x as long.) The prompt's logits are the last position's only, as the engine's are:
    Gemma 3's 262k-entry head over a 629-token prompt was most of its reference's time."""
    ids, logprobs = list(prompt_ids), []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        for _ in range(n):
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            ids.append(int(lp.argmax()))
            logprobs.append(lp)
            out = model(torch.tensor([ids[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return ids[len(prompt_ids):], logprobs


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen2", "qwen3", "mistral", "qwen2-yarn", "gemma3",
                                  "qwen3-moe", "mixtral", "olmoe"])
def test_tiny_checkpoint_matches_transformers(kind, tiny_checkpoint):
    """Greedy tokens identical and logprobs within fp32 tolerance, three prompts in one batch."""
    from transformers import AutoModelForCausalLM
    path = tiny_checkpoint(kind)
    ref = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    n = 24
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        ref_tokens, ref_lps = hf_greedy(ref, ids, n)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"{kind}: {prompt!r}"
        for step, (lp_dict, ref_lp) in enumerate(zip(got.logprobs, ref_lps)):
            for tid, lp in lp_dict.items():
                assert abs(lp.logprob - float(ref_lp[tid])) < 2e-4, (kind, step, tid)
            assert lp_dict[got.token_ids[step]].rank == 1
    assert_all_blocks_free(llm)


def test_smollm2_gguf_matches_transformers(smollm2_llm, hf_gguf_reference):
    """The default GGUF: our loader + model vs transformers loading the same file, 16 greedy
    tokens (the reference's own decoding, one prompt at a time, is most of this test's time)."""
    ref = hf_gguf_reference("smollm2-135m")
    n = 16
    chat = smollm2_llm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    prompts = PROMPTS + [chat]
    outs = smollm2_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = out.prompt_token_ids
        ref_tokens, _ = hf_greedy(ref, ids, n)
        assert out.outputs[0].token_ids == ref_tokens, f"{prompt!r}"
    assert "Paris" in outs[-1].outputs[0].text
    assert_all_blocks_free(smollm2_llm)


def test_sharded_safetensors_load_the_same(tiny_checkpoint, tmp_path):
    """A checkpoint split over several safetensors files (with an index) loads identically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = tiny_checkpoint("qwen2")
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    whole = LLM(model=str(src), dtype="float32", num_blocks=16).generate(PROMPTS, params)
    shards = LLM(model=str(tmp_path), dtype="float32", num_blocks=16).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in whole] == [o.outputs[0].token_ids for o in shards]


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "'dynamic' is not supported"),
    ({"architectures": ["FalconForCausalLM"]}, "unsupported architecture"),
])
def test_unsupported_config_fails_in_one_line(change, message, tiny_checkpoint, tmp_path):
    """A config naming what we cannot run is one ValueError at load, naming it and what is supported."""
    import json
    import shutil
    src = tiny_checkpoint("llama")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=16)


def test_chat_template_that_does_not_compile_fails_at_load(tiny_checkpoint, tmp_path):
    import json
    import shutil
    shutil.copytree(tiny_checkpoint("llama"), tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}"  # no endfor
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in tmp_path.glob("chat_template.j*"):
        f.unlink()
    with pytest.raises(ValueError, match="chat template does not compile"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=16)
