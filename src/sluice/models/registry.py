"""Architecture name (config.json `architectures` / GGUF general.architecture) -> model class."""
from __future__ import annotations

from sluice.distributed.parallel import SINGLE, TPShard, check_tp_size
from sluice.models.gemma3 import Gemma3Arch, Gemma3ForCausalLM
from sluice.models.llama import LlamaArch, LlamaForCausalLM
from sluice.models.moe import MoEForCausalLM

_MODELS = {
    "LlamaForCausalLM": (LlamaForCausalLM, LlamaArch),
    "Qwen2ForCausalLM": (LlamaForCausalLM, LlamaArch),
    "Qwen3ForCausalLM": (LlamaForCausalLM, LlamaArch),
    "MistralForCausalLM": (LlamaForCausalLM, LlamaArch),
    "Qwen3MoeForCausalLM": (MoEForCausalLM, LlamaArch),
    "MixtralForCausalLM": (MoEForCausalLM, LlamaArch),
    "OlmoeForCausalLM": (MoEForCausalLM, LlamaArch),
    "Gemma3ForCausalLM": (Gemma3ForCausalLM, Gemma3Arch),
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM"}


def _classes(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _MODEL_TYPES:
        archs = [_MODEL_TYPES[model_type]]
    for name in archs:
        if name in _MODELS:
            return _MODELS[name]
    raise ValueError(f"unsupported architecture {archs or model_type}; supported: {', '.join(_MODELS)}")


def model_spec(hf_config) -> tuple[type, object]:
    """(model class, architecture record) of this config's model: all that building it
    takes. Tensor-parallel ranks are handed it by rank 0 and never read the config
    themselves: transformers' config classes cost a fresh process ~2.7 s of imports
    (torch.distributed.tensor and sympy among them), which a rank would pay at every start."""
    model_cls, arch_cls = _classes(hf_config)
    return model_cls, arch_cls.from_hf_config(hf_config)


def build_model(spec: tuple[type, object], tp: TPShard = SINGLE):
    """The model of a model_spec; under tensor parallelism, rank tp.rank's part of it."""
    model_cls, arch = spec
    check_tp_size(tp.size, arch.num_kv_heads)
    if tp.size > 1 and getattr(arch, "qk_norm_full", False):
        raise ValueError("this model's q / k norms span every attention head (OLMoE): tensor parallelism would "
                         "split them; run it with tensor_parallel_size=1")
    return model_cls(arch, tp)
