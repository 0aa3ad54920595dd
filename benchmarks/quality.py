"""Does a speed trick change outputs? Greedy agreement with float32 and perplexity on
held-out text, for float32, bfloat16, int8 weights, w8a8 (int8 weights and activations), w4a8
and gguf (the file's own quantized blocks) of the same model,
and bfloat16 and w8a8 with the int8 KV cache (`kv_cache_dtype="int8"`); on the CUDA backend,
FP8 weights (`quantization="fp8"`) and the FP8 KV cache (`kv_cache_dtype="fp8"`).

    python benchmarks/quality.py [--json benchmarks/results/quality.json]
    python benchmarks/quality.py --variants bfloat16,fp8,bf16+kvfp8,fp8+kvfp8   # FP8 rows

The FP8 variants run the CUDA backend on a GPU. Without one they are emulated in torch on
the CPU (`emulate_fp8`): the CUDA backend's roundings, not its kernels (the kernels run
the same roundings, checked against these torch functions in tests/unit/test_triton_fp8.py;
under Triton's interpreter a variant would take hours here): e4m3 weights with their
scale per output channel; activations rounded to e4m3 per token where a step has more
than 8 rows (the _scaled_mm path; the GEMV's few rows keep bf16 activations); K and V
rounded to e4m3 per token and head as the cache write does. Products in float32, the
scale applied after the sum; one extra bf16 rounding of each dequantized K/V value
(2^-9 relative, against e4m3's 2^-4).

Agreement: 32 greedy tokens on the test prompts (plain and chat), compared with float32:
identical sequences, and mean length of the common prefix; the same on 32 more prompts
cut from the benchmark corpus (20-200 tokens), since 8 sequences decide little when a
near-tie flips. Perplexity: 8 windows of 512 tokens of held-out English text (the
standard library's documentation), every position scored in one prefill through the
engine's own model and paged KV cache. On those 4,088 positions also, teacher-forced,
how often the variant's most likely next token is float32's and the mean KL divergence
of its next-token distribution from float32's: the measures of agreement that do not
hang on a handful of near-ties.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from sluice import LLM, SamplingParams
from sluice.backends import torch_ref
from sluice.bench.workload import make_prompts
from sluice.core.scheduler import ScheduledRequest, StepPlan
from sluice.request import Request

PROMPTS = [
    "Hello",
    "The history of the Roman Empire begins with",
    "In a small village by the sea, there lived an old fisherman who every morning walked to the "
    "harbour, checked his nets and talked to the gulls about the weather and the price of fish.",
    "def fibonacci(n):",
]
CHATS = ["What is the capital of France?", "Give me three tips for learning a language.",
         "Explain photosynthesis in one sentence.", "Write a haiku about autumn."]


@torch.inference_mode()
def window_logprobs(llm: LLM, windows: list[list[int]]):
    """Per window: next-token log-probabilities [len - 1, vocab] in float32, from one prefill."""
    engine = llm.engine
    for i, ids in enumerate(windows):
        req = Request(f"ppl{i}", ids, SamplingParams(max_tokens=1), set(), 1)
        engine.kv.allocate(req, len(ids))
        entry = ScheduledRequest(req.request_id, ids, 0, engine.kv.block_ids(req.request_id), True,
                                 req.params, ids, [], group_block_ids=engine.kv.group_block_ids(req.request_id))
        input_ids, positions, meta, _ = engine.runner._prepare(StepPlan([entry], len(ids)))
        hidden = engine.runner.model(input_ids, positions, meta, engine.runner.kv_caches)
        engine.kv.free(req)
        yield torch.log_softmax(engine.runner.model.compute_logits(hidden[:len(ids) - 1]).float(), dim=-1)


def window_metrics(llm: LLM, windows: list[list[int]], reference: LLM | None, ref_name: str = "float32") -> dict:
    """Perplexity, and against the reference model's (float32's) log-probabilities, computed
    window by window alongside, top-1 agreement and mean KL(reference || this)."""
    nll, count, top1, kl = 0.0, 0, 0, 0.0
    refs = window_logprobs(reference, windows) if reference is not None else None
    for i, logp in enumerate(window_logprobs(llm, windows)):
        targets = torch.tensor(windows[i][1:])
        nll -= float(logp.gather(1, targets[:, None]).sum())
        count += len(targets)
        if refs is not None:
            ref = next(refs)
            top1 += int((ref.argmax(-1) == logp.argmax(-1)).sum())
            kl += float((ref.exp() * (ref - logp)).sum())
    row = {"perplexity": math.exp(nll / count)}
    if reference is not None:
        row["teacher_forced_top1_agreement"] = top1 / count
        row[f"mean_kl_from_{ref_name}"] = kl / count
    return row


# The torch path's K/V write as sluice has it (emulate_fp8 wraps it for the FP8 variants).
EXACT_WRITE_KV = torch_ref.write_kv


class Fp8Emulated:
    """A linear layer's FP8 arithmetic in torch: e4m3 weights q (exact in bf16) with a
    scale per output channel; activations rounded to e4m3 per token above GEMV_ROWS rows."""
    GEMV_ROWS = 8

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q.float(), scale

    def __call__(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        from sluice.quantization.fp8 import quantize_rows_reference
        x2 = x.reshape(-1, x.shape[-1]).float()
        if x2.shape[0] > self.GEMV_ROWS:
            xq, xs = quantize_rows_reference(x2)
            x2 = xq.float() * xs[:, None]
        y = F.linear(x2, self.q) * self.scale
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], -1)


def emulate_fp8(llm: LLM, weights: bool, kv: bool) -> None:
    """The CUDA backend's FP8 roundings on a CPU engine running torch's ops (see the module
    docstring): weights (every linear layer but the head and routers), and K/V as written."""
    from sluice.quantization.fp8 import fp8_layers, quantize_rows_reference
    if weights:
        for _, module in fp8_layers(llm.engine.runner.model):
            q, s = quantize_rows_reference(module.weight.detach())
            module.method = Fp8Emulated(q, s)
    if not kv:
        torch_ref.write_kv = EXACT_WRITE_KV
        return

    def fp8_write(k_cache, v_cache, k, v, slot_mapping):
        def rounded(x):
            q, s = quantize_rows_reference(x)
            return (q.float() * s[..., None]).to(x.dtype)
        EXACT_WRITE_KV(k_cache, v_cache, rounded(k), rounded(v), slot_mapping)
    torch_ref.write_kv = fp8_write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default=None)
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of 512 tokens")
    ap.add_argument("--corpus-prompts", type=int, default=32, help="greedy prompts cut from the corpus")
    ap.add_argument("--variants", default="bfloat16,int8,w8a8,w4a8,bf16+kv8,w8a8+kv8,w4a8+kv8",
                    help="compared with float32 (+kv8: the int8 KV cache)")
    ap.add_argument("--cpu-isa", default="auto", help="kernel build for the variants (float32 runs torch's ops)")
    ap.add_argument("--reference", default="float32",
                    help="the variant the others are compared with (float32, or e.g. bfloat16: FP8 against bf16)")
    args = ap.parse_args()
    # bfloat16 rows say quantization=None: the automatic choice would quantize a GGUF.
    variants = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16", quantization=None),
                "int8": dict(dtype="bfloat16", quantization="int8"),
                "w8a8": dict(dtype="bfloat16", quantization="w8a8"),
                "w4a8": dict(dtype="bfloat16", quantization="w4a8"),
                "gguf": dict(dtype="bfloat16", quantization="gguf"),
                "bf16+kv8": dict(dtype="bfloat16", quantization=None, kv_cache_dtype="int8"),
                "w8a8+kv8": dict(dtype="bfloat16", quantization="w8a8", kv_cache_dtype="int8"),
                "w4a8+kv8": dict(dtype="bfloat16", quantization="w4a8", kv_cache_dtype="int8"),
                # torch's own ops in bf16: the emulated FP8 rows' own baseline without a GPU
                "bfloat16-torch": dict(dtype="bfloat16", quantization=None, cpu_isa="generic"),
                "fp8": dict(dtype="bfloat16", quantization="fp8", device="cuda"),
                "bf16+kvfp8": dict(dtype="bfloat16", quantization=None, kv_cache_dtype="fp8", device="cuda"),
                "fp8+kvfp8": dict(dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8", device="cuda")}
    if args.reference not in variants:
        raise SystemExit(f"--reference must be one of {', '.join(variants)}")
    variants = {args.reference: variants[args.reference],
                **{k: v for k, v in variants.items() if k in args.variants.split(",") and k != args.reference}}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens, extra_tokens, rows = {}, {}, {}
    reference = None  # the reference model (float32's by default), kept to score each window beside the variant
    ref = args.reference
    for name, kwargs in variants.items():
        emulate = kwargs.get("device") == "cuda" and not torch.cuda.is_available()
        if emulate:  # torch's ops on the CPU, the FP8 roundings added (emulate_fp8)
            fp8 = (kwargs["quantization"] == "fp8", kwargs.get("kv_cache_dtype") == "fp8")
            kwargs = dict(dtype="bfloat16", quantization=None, device="cpu", cpu_isa="generic")
        llm = LLM(model=args.model, kv_cache_memory=0.3, enable_prefix_caching=False,
                  **{"cpu_isa": args.cpu_isa, **kwargs})
        emulate_fp8(llm, *(fp8 if emulate else (False, False)))
        prompts = PROMPTS + [llm.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        extra = make_prompts(llm.tokenizer, args.corpus_prompts, 20, 200, seed=7)
        extra_tokens[name] = [o.outputs[0].token_ids for o in llm.generate(extra, params)]
        windows = make_prompts(llm.tokenizer, args.windows, 512, 512, seed=123)
        rows[name] = window_metrics(llm, windows, reference, ref)
        if reference is None:  # the reference comes first
            reference = llm
    for name, row in rows.items():
        for label, got in (("", tokens), ("corpus_", extra_tokens)):
            same = [a == b for a, b in zip(got[name], got[ref])]
            prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                      for a, b in zip(got[name], got[ref])]
            row[f"{label}identical_to_{ref}"] = f"{sum(same)}/{len(same)}"
            row[f"{label}mean_common_prefix_tokens"] = sum(prefix) / len(prefix)
        print(json.dumps({"variant": name, **row}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
