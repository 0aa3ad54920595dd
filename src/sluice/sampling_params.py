"""SamplingParams: how one request samples and when it stops. Validated when constructed."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from sluice.structured.params import StructuredOutputsParams

INT32_MAX = 2**31 - 1
# Temperatures in (0, MIN_TEMPERATURE) are raised to it (vLLM does the same).
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 1e4
MAX_REPETITION_PENALTY = 1e4
MAX_STOP = 64
MAX_STOP_LEN = 1024
MAX_STOP_TOKEN_IDS = 1024
# logit_bias: OpenAI's range per token; at most this many tokens per request.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_ALLOWED_TOKEN_IDS = 65536


def _int(name: str, value, low: int, high: int = INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value}")
    return value


def _float(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or not (low < value if low_open else low <= value) or value > high:
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")
    return value


def _logit_bias(value) -> dict[int, float]:
    """{token id: bias} with integer ids >= 0 (their bound, the vocabulary, is the
    engine's to check) and finite biases in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a map of token ids to biases, got {value!r}")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias must name at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(value)}")
    out = {}
    for t, b in value.items():
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) \
                or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {b!r} for token {t}")
        out[t] = float(b)
    return out


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 means greedy, exactly argmax
    top_p: float = 1.0
    top_k: int = -1                   # -1 disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # multiplicative, over prompt and output tokens
    presence_penalty: float = 0.0     # additive, over output tokens
    frequency_penalty: float = 0.0    # additive per occurrence, over output tokens
    seed: int | None = None
    # None: up to the model's context length; 0: nothing is generated, the prompt is only
    # computed (and scored, with prompt_logprobs), as a scoring client asks with echo.
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # True: a stop string that ends the output stays at its end (vLLM's field).
    include_stop_str_in_output: bool = False
    # False: special tokens the model emits (other than the one that stops it) are in the text.
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to the logits before any
    # other transform (-100 in effect bans a token, +100 all but forces it). Logprobs stay
    # those of the model's own distribution, as for every other transform.
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: sample only among these tokens (applied with logit_bias,
    # before every other transform). Not with structured_outputs (the two could leave none).
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None       # None: none; k: the chosen token plus the top k
    # None: none; k: per prompt token (after the first) its logprob and rank plus the top k.
    prompt_logprobs: int | None = None
    # What the output must match (a JSON schema, a regex, a choice, a grammar): a
    # StructuredOutputsParams, or a dict of its fields. None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # False: never speculate for this request (where the engine runs speculative decoding;
    # its output is the same either way, only its speed differs).
    speculative: bool = True

    def __init__(self, **kwargs):
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}; "
                             f"allowed: {', '.join(sorted(names))}")
        for f in dataclasses.fields(self):
            if f.name in kwargs:
                value = kwargs[f.name]
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            setattr(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        """Every field's type and range, so that no value that passes can fail inside an
        engine step (where it would fail every request of the batch): integers within
        what torch's int64 tensors hold, floats finite, lists bounded."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError("stop must be a string or a list of strings, stop_token_ids a list of token ids")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _int("n", self.n, 1)
        _float("temperature", self.temperature, 0, MAX_TEMPERATURE)
        if 0 < self.temperature < MIN_TEMPERATURE:
            # As vLLM: logits / 1e-9 overflow float32 to inf and the draw to NaN.
            self.temperature = MIN_TEMPERATURE
        _float("top_p", self.top_p, 0, 1, low_open=True)
        if _int("top_k", self.top_k, -1) == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        _float("min_p", self.min_p, 0, 1)
        _float("repetition_penalty", self.repetition_penalty, 0, MAX_REPETITION_PENALTY, low_open=True)
        _float("presence_penalty", self.presence_penalty, -2, 2)
        _float("frequency_penalty", self.frequency_penalty, -2, 2)
        if self.seed is not None:
            _int("seed", self.seed, -2**63, 2**64 - 1)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 0)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_LEN
                                            for s in self.stop):
            raise ValueError(f"stop must be a list of at most {MAX_STOP} non-empty strings of at most "
                             f"{MAX_STOP_LEN} characters")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or len(ids) > MAX_ALLOWED_TOKEN_IDS or any(
                    isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} "
                                 f"token ids >= 0, got {ids!r}"[:300])
            self.allowed_token_ids = sorted(set(ids))
            if self.structured_outputs is not None:
                raise ValueError("allowed_token_ids cannot be combined with structured_outputs (together they "
                                 "could allow no token at all)")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def only_argmax(self) -> bool:
        """Whether the token is the argmax of the logits (a grammar's mask and the step's
        banned ids apart): greedy, without logprobs, penalties, logit bias or allowed tokens.
        The runner then takes the backend's greedy path without building sampling metadata."""
        return (self.temperature == 0 and self.logprobs is None and not self.has_penalties
                and not self.logit_bias and self.allowed_token_ids is None)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(changes)
        return SamplingParams(**values)
