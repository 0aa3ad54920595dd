"""The checks of a request that depend on the model alone (its vocabulary, its context
length, its KV capacity, its adapters), as a small picklable value: the engine runs them
as it adds a request, and the API server runs the same ones before admission, in its own
process when the engine runs in an engine-core process (engine/core_process.py)."""
from __future__ import annotations

from dataclasses import dataclass

from sluice.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestChecks:
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    capacity_tokens: int        # the longest sequence the KV pool can hold
    num_blocks: int
    # Served adapters by name, or None when the engine serves no LoRA adapters.
    lora_names: frozenset[str] | None = None

    def check(self, ids: list[int], params: SamplingParams, lora: str | None = None) -> int:
        """The resolved max_tokens; ValueError naming what is wrong. (The adapter's own
        object is the engine's to resolve; this checks its name.)"""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self.check_lora(lora)
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt must not be empty")
        self.check_vocab(params)
        return self.check_fits(len(ids), params)

    def check_lora(self, name: str | None) -> None:
        if name is None:
            return
        if not isinstance(name, str):
            raise ValueError(f"lora must be an adapter's name, got {type(name).__name__}")
        if self.lora_names is None:
            raise ValueError(f"LoRA adapter {name!r} asked for, but this engine serves none "
                             "(start it with lora_modules or enable_lora)")
        if name not in self.lora_names:
            loaded = ", ".join(sorted(self.lora_names)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")

    def check_vocab(self, params: SamplingParams) -> None:
        """The fields whose bound is this model's vocabulary (a token id past it would
        fail inside the step, for every request in the batch)."""
        vocab = self.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}) for this model")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}) for this model, "
                             f"got {max(params.logit_bias)}")
        allowed = params.allowed_token_ids
        if allowed is not None:
            if allowed[-1] >= vocab:
                raise ValueError(f"allowed_token_ids must be token ids in [0, {vocab}) for this model, "
                                 f"got {allowed[-1]}")
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            if params.min_tokens > 0 and set(allowed) <= stops:
                raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens forbids at first: "
                                 "no token could be sampled")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {k}")

    def check_fits(self, prompt_len: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        max_tokens = params.max_tokens
        if max_tokens == 0:  # the prompt is only computed: it may fill the context
            if prompt_len > limit:
                raise ValueError(f"prompt is {prompt_len} tokens, but max_model_len is {limit}: "
                                 f"{prompt_len - limit} tokens too long")
        elif prompt_len >= limit:
            raise ValueError(f"prompt is {prompt_len} tokens, but max_model_len is {limit}: "
                             f"{prompt_len - limit + 1} tokens too long (at least one must be generated)")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                             f"{prompt_len + max_tokens} exceeds max_model_len {limit} by "
                             f"{prompt_len + max_tokens - limit}")
        # The longest sequence the pool can hold (sliding-window groups hold their window's
        # blocks, however long it grows; a prompt chunk is at most a step's budget).
        capacity = self.capacity_tokens
        if prompt_len + max_tokens > capacity:
            if params.max_tokens is None and prompt_len < capacity:
                return capacity - prompt_len
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                             f"{prompt_len + max_tokens} can never fit the KV cache of {capacity} "
                             f"tokens ({self.num_blocks} blocks): over by {prompt_len + max_tokens - capacity}")
        return max_tokens
