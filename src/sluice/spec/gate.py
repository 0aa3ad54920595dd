"""When speculation pays: a per-step choice from measured step times and acceptance rates.

A step's wall time grows with the tokens it carries. Drafting d tokens for a request adds
d query rows to the step; if each draft is accepted with probability a (the next only
after the one before), the request then emits E = 1 + a + ... + a^d tokens instead of 1.
On this CPU a step of 1 to ~8 rows reads every weight once and costs about the same, so
at low load E tokens come nearly for the price of one; a step of 32 decodes is bound by
arithmetic and 4 drafts each would make it cost ~3x for far fewer than 3x the tokens.

So each step the gate picks, among the running requests that have a draft (best
acceptance first), the number m that maximises the step's expected tokens per second,

    (R + sum_{i<m} (E_i - 1)) / t(R + sum_{i<m} d_i),     R = the decodes in the step,

m = 0 being plain decoding. t(n) is an exponentially weighted mean of the measured wall
time of steps of n tokens (n rounded to worker/shapes.bucket's sizes, the runner's padded
shapes where the backend pads); a size never
measured is interpolated between the measured sizes around it, or past them estimated
from the nearest, scaled by PRIOR (a + b n with the
ratio a/b measured on a 2-core Zen 4, docs/benchmarks.md "Speculative decoding"). The
first step of each size is not counted: it includes building that shape's kernels.
A request's acceptance rate is its own recent one, smoothed towards the method's overall
rate, so one lucky or unlucky step does not decide.
"""
from __future__ import annotations

from sluice.worker.shapes import bucket

# t(n) ~ PRIOR_A + n (in units of the per-token cost): a step of n tokens costs about
# (PRIOR_A + n) / (PRIOR_A + 1) times a single decode (bf16, 2026-12-02: 7.5 ms at 1 token,
# 12.7 ms at 16, 48 ms at 96; benchmarks/spec_crossover.py).
PRIOR_A = 16.0
# Weight of the past in each size's mean step time (a few dozen steps of memory).
DECAY = 0.9
# A request's drafted/accepted counts decay by this per step it speculates.
REQUEST_DECAY = 0.8
# Pseudo-drafts of the overall rate mixed into a request's own (its prior strength).
PRIOR_DRAFTS = 4.0
# The overall acceptance rate before anything was measured.
INITIAL_ACCEPTANCE = 0.5


def expected_tokens(alpha: float, d: int) -> float:
    """Tokens a request emits from d drafts each accepted with probability alpha in turn."""
    return float(d + 1) if alpha >= 1.0 else (1.0 - alpha ** (d + 1)) / (1.0 - alpha)


class SpeculationGate:
    def __init__(self, always: bool = False) -> None:
        self.always = always
        self.step_time: dict[int, float] = {}   # bucket(n) -> mean seconds
        self.acceptance = INITIAL_ACCEPTANCE     # the method's overall rate (EWMA per step)
        self._seen: set[int] = set()

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        key = bucket(num_tokens)
        if key not in self._seen:
            # The first step of a new size builds its kernels (oneDNN: ~100 ms): were it
            # counted, that size would look too dear to be chosen, and so never measured again.
            self._seen.add(key)
            return
        old = self.step_time.get(key)
        # One slow step (another process, a page fault) moves the mean at most 2x its share.
        self.step_time[key] = seconds if old is None else DECAY * old + (1 - DECAY) * min(seconds, 2 * old)

    def observe_acceptance(self, drafted: int, accepted: int) -> None:
        if drafted:
            w = min(1.0, drafted / 64)  # a step's weight grows with what it drafted
            self.acceptance = (1 - w * 0.1) * self.acceptance + w * 0.1 * (accepted / drafted)

    def estimate(self, n: int) -> float:
        """Estimated seconds of a step of n tokens (relative units when nothing is measured)."""
        key = bucket(n)
        t = self.step_time.get(key)
        if t is not None:
            return t
        if not self.step_time:
            return PRIOR_A + key
        below = [k for k in self.step_time if k < key]
        above = [k for k in self.step_time if k > key]
        if below and above:  # between two measured sizes: on the line through them
            lo, hi = max(below), min(above)
            w = (key - lo) / (hi - lo)
            return (1 - w) * self.step_time[lo] + w * self.step_time[hi]
        near = max(below) if below else min(above)
        return self.step_time[near] * (PRIOR_A + key) / (PRIOR_A + near)

    def request_alpha(self, accepted: float, drafted: float) -> float:
        return (accepted + PRIOR_DRAFTS * self.acceptance) / (drafted + PRIOR_DRAFTS)

    def worth_drafting(self, num_decodes: int, k: int) -> bool:
        """Whether speculation could pay at all this step (before any draft is looked up):
        every decode drafting k tokens, all accepted."""
        if self.always:
            return True
        return num_decodes * (k + 1) / self.estimate(num_decodes * (k + 1)) > num_decodes / self.estimate(num_decodes)

    def choose(self, num_decodes: int, candidates: list[tuple[float, int]]) -> int:
        """How many of `candidates` ((acceptance, drafts), best first) speculate this step."""
        if self.always:
            return len(candidates)
        tokens, extra = float(num_decodes), 0
        best_rate, best_m = num_decodes / self.estimate(num_decodes), 0
        for m, (alpha, d) in enumerate(candidates, start=1):
            tokens += expected_tokens(alpha, d) - 1.0
            extra += d
            rate = tokens / self.estimate(num_decodes + extra)
            if rate > best_rate:
                best_rate, best_m = rate, m
        return best_m
