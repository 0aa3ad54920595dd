"""What the engine returns: RequestOutput with one CompletionOutput per sample."""
from __future__ import annotations

from dataclasses import dataclass, field

from sluice.request import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop", "length", "abort", "error", or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestTimes:
    """time.monotonic() stamps of the request (the earliest over its samples)."""
    arrival: float
    first_scheduled: float | None
    first_token: float | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    times: RequestTimes | None = None
    num_cached_tokens: int = 0   # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt
    # token {token_id: Logprob} with that token and the top-N (shared by all n samples).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when the request was ended by a failure inside the engine (finish_reason "error").
    error: str | None = None
    tenant: str = ""             # who it was served for (LLMEngine.add_request)
    # The engine's weight version (LLMEngine.update_weights) when this output was made.
    weight_version: str = "0"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
