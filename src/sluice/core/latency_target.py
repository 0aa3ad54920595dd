"""A step-time target (`--target-tpot-ms`): each step's token budget sized so that the
step, and so every running request's time per output token, holds the target.

Every running request gets one token per step it decodes in, so a step's wall time is the
TPOT of everyone decoding in it. That time grows with the tokens the step carries (prompt
chunks, and the decodes themselves), close to linearly on both CPU and GPU: t = a + b * n.
The engine reports each step's (tokens, seconds); the model fits a and b by least squares
with exponential forgetting (recent steps weigh most, so the fit follows the machine's
load and the context lengths), and the scheduler asks it for the largest n with
a + b * n + 2 sigma <= target, sigma being the spread of recent steps around the fit: a
budget sized to the fit alone put half the full-budget steps over the target (measured:
16.8% of all decode steps over a 70 ms target). A step that carries only decodes already over the target cannot be
helped by a smaller budget: then no new request is admitted (the batch does not grow)
until requests finish, unless nothing runs at all (something must). Steps over the
target are counted (`misses`), for /metrics.

The trade-off this makes a setting: a lower target gives faster tokens to the running
requests, fewer tokens of prompts per step (so longer TTFT) and less throughput.
"""
from __future__ import annotations

from dataclasses import dataclass

# Weight kept by the past at each new step: ~50 steps of memory.
DECAY = 0.98
# Steps observed before the fit is used (the first steps include warm-up).
MIN_STEPS = 8


@dataclass
class StepTimeModel:
    target_s: float
    s1: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    steps: int = 0
    var: float = 0.0                # EWMA of squared residuals around the fit
    misses: int = 0                 # steps that ran decodes and took longer than the target
    decode_steps: int = 0           # steps that ran decodes

    def observe(self, num_tokens: int, seconds: float, had_decodes: bool) -> None:
        if num_tokens <= 0:
            return
        predicted = self.predict(num_tokens)
        if predicted is not None:
            self.var = DECAY * self.var + (1 - DECAY) * (seconds - predicted) ** 2
        d = DECAY
        self.s1 = d * self.s1 + 1.0
        self.sx = d * self.sx + num_tokens
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + num_tokens * num_tokens
        self.sxy = d * self.sxy + num_tokens * seconds
        self.steps += 1
        if had_decodes:
            self.decode_steps += 1
            if seconds > self.target_s:
                self.misses += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of t = a + b * n, or None until there is enough to fit."""
        if self.steps < MIN_STEPS:
            return None
        var = self.s1 * self.sxx - self.sx * self.sx
        mean_t = self.sy / self.s1
        if var <= 1e-9 * max(1.0, self.sxx * self.s1):
            # Every step had the same size: all of the time is per token.
            mean_n = self.sx / self.s1
            return 0.0, mean_t / mean_n
        b = (self.s1 * self.sxy - self.sx * self.sy) / var
        a = (self.sy - b * self.sx) / self.s1
        if b <= 0:  # noise: no measurable cost per token; fall back to the mean
            return 0.0, mean_t / (self.sx / self.s1)
        return max(a, 0.0), b

    def predict(self, num_tokens: int) -> float | None:
        f = self.fit()
        return None if f is None else f[0] + f[1] * num_tokens

    def budget(self, default: int) -> int:
        """The most tokens a step may carry to hold the target (at least 1, at most default)."""
        f = self.fit()
        if f is None:
            return default
        a, b = f
        margin = 2.0 * self.var ** 0.5
        return max(1, min(default, int((self.target_s - a - margin) / b + 1e-6)))  # (float noise at exact fits)
