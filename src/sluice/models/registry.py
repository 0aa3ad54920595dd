"""Architecture name (config.json `architectures` / GGUF general.architecture) -> model class."""
from __future__ import annotations

from sluice.models.llama import LlamaArch, LlamaForCausalLM

_MODELS = {
    "LlamaForCausalLM": (LlamaForCausalLM, LlamaArch),
    "Qwen2ForCausalLM": (LlamaForCausalLM, LlamaArch),
    "Qwen3ForCausalLM": (LlamaForCausalLM, LlamaArch),
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}


def build_model(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _MODEL_TYPES:
        archs = [_MODEL_TYPES[model_type]]
    for name in archs:
        if name in _MODELS:
            model_cls, arch_cls = _MODELS[name]
            return model_cls(arch_cls.from_hf_config(hf_config))
    raise ValueError(f"unsupported architecture {archs or model_type}; supported: {', '.join(_MODELS)}")
