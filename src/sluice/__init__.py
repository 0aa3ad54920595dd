"""sluice: an LLM inference engine with continuous batching over a paged KV cache."""
from sluice.entrypoints.llm import LLM
from sluice.engine.llm_engine import LLMEngine
from sluice.outputs import CompletionOutput, RequestOutput
from sluice.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
