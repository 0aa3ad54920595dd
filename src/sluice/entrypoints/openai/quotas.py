"""Rate limits per tenant, answered as OpenAI answers them.

A tenant of the `--tenants` file may have:

    rpm              requests per minute
    tpm              tokens per minute (prompt + output)
    max_tokens       the most output tokens one request may ask for (the default where it
                     asks for none)
    max_concurrency  requests in flight at once

Each rate is a bucket that refills continuously (the limit over a minute) and holds at
most a minute's worth. A request is admitted when its tenant's buckets hold what it needs:
one request; its prompt tokens plus the output it may make (n x max_tokens, where given).
What it uses is then taken: the request and its prompt at admission, its output tokens
as it finishes (a bucket may go below zero, and the next request waits longer). Refused
requests get 429 with `Retry-After` (seconds until the bucket holds what the request
needs) and OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers, which
admitted requests carry too. A request that could never fit (more tokens than the tenant's
tpm, more output than its max_tokens) is a 400: retrying would not help.

Behind the data-parallel router the router holds the buckets, so the limits hold across
replicas (entrypoints/router/app.py): it counts requests and concurrency itself and
charges the tokens each replica reports having served per tenant.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TenantLimits:
    rpm: int | None = None
    tpm: int | None = None
    max_tokens: int | None = None
    max_concurrency: int | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.rpm, self.tpm, self.max_tokens, self.max_concurrency))


class Bucket:
    """`limit` per minute, refilled continuously, holding at most `limit`."""

    def __init__(self, limit: int, now: float):
        self.limit, self.level, self.t = limit, float(limit), now

    def refill(self, now: float) -> None:
        self.level = min(float(self.limit), self.level + (now - self.t) * self.limit / 60.0)
        self.t = now

    def seconds_until(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (0 if it does)."""
        return max(0.0, (amount - self.level) * 60.0 / self.limit)

    def reset_seconds(self) -> float:
        """Seconds until it is full again (OpenAI's x-ratelimit-reset-*)."""
        return self.seconds_until(self.limit)


class RateLimited(Exception):
    """Refused for now: `retry_after` seconds until it would be admitted."""

    def __init__(self, message: str, retry_after: float, headers: dict[str, str]):
        super().__init__(message)
        self.retry_after, self.headers = retry_after, headers


class NeverFits(ValueError):
    """A request no wait would admit (more than the tenant's limit allows at all)."""


@dataclass
class Ticket:
    """One admitted request: its hold on its tenant's concurrency (released once) and what
    admission took (given back if the engine refuses the request)."""
    tenant: str
    prompt_tokens: int = 0
    released: bool = False


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "250ms"."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    s = math.ceil(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


@dataclass
class _State:
    limits: TenantLimits
    requests: Bucket | None
    tokens: Bucket | None
    in_flight: int = 0
    refused: dict[str, int] = field(default_factory=dict)   # by limit: requests, tokens, concurrency


class RateLimiter:
    """The buckets of every tenant with limits (thread-safe: the engine thread charges the
    output tokens, the server's loop admits)."""

    def __init__(self, limits: dict[str, TenantLimits], clock=time.monotonic):
        self.clock = clock
        now = clock()
        self._lock = threading.Lock()
        self._tenants = {name: _State(lim, Bucket(lim.rpm, now) if lim.rpm else None,
                                      Bucket(lim.tpm, now) if lim.tpm else None)
                         for name, lim in limits.items() if lim.any}

    @classmethod
    def for_tenants(cls, tenants) -> "RateLimiter | None":
        """The limiter of a --tenants file's entries (TenantSpec), None where none has limits."""
        limited = {t.name: t.limits for t in tenants if t.limits.any}
        return cls(limited) if limited else None

    def limits(self, tenant: str) -> TenantLimits | None:
        st = self._tenants.get(tenant)
        return st.limits if st is not None else None

    def refused(self) -> dict[tuple[str, str], int]:
        """(tenant, limit) -> requests refused so far."""
        with self._lock:
            return {(t, k): n for t, st in self._tenants.items() for k, n in st.refused.items()}

    def _headers(self, st: _State) -> dict[str, str]:
        h = {}
        for kind, b in (("requests", st.requests), ("tokens", st.tokens)):
            if b is not None:
                h[f"x-ratelimit-limit-{kind}"] = str(b.limit)
                h[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(b.level)))
                h[f"x-ratelimit-reset-{kind}"] = _duration(b.reset_seconds())
        return h

    def headers(self, tenant: str) -> dict[str, str]:
        st = self._tenants.get(tenant)
        if st is None:
            return {}
        with self._lock:
            now = self.clock()
            for b in (st.requests, st.tokens):
                if b is not None:
                    b.refill(now)
            return self._headers(st)

    def admit(self, tenant: str, prompt_tokens: int, output_tokens: int, take_prompt: bool = True
              ) -> Ticket | None:
        """Admit one request of `prompt_tokens` that may make `output_tokens` (n x
        max_tokens; 0 where unbounded); take the request and its prompt (take_prompt=False:
        the prompt is an estimate, and what the request used is charged later, the
        router's way). RateLimited for now, NeverFits for good; None for a tenant without
        limits."""
        st = self._tenants.get(tenant)
        if st is None:
            return None
        lim = st.limits
        need = prompt_tokens + output_tokens
        if lim.tpm is not None and need > lim.tpm:
            raise NeverFits(f"this request needs {need} tokens (prompt {prompt_tokens} + output up to "
                            f"{output_tokens}) but tenant {tenant!r} may use {lim.tpm} tokens per minute: "
                            f"ask for fewer tokens")
        with self._lock:
            now = self.clock()
            waits = {}
            if st.requests is not None:
                st.requests.refill(now)
                waits["requests"] = st.requests.seconds_until(1)
            if st.tokens is not None:
                st.tokens.refill(now)
                waits["tokens"] = st.tokens.seconds_until(need)
            if lim.max_concurrency is not None and st.in_flight >= lim.max_concurrency:
                waits["concurrency"] = 1.0  # a slot frees when a request ends: unknown; retry soon
            kind, wait = max(waits.items(), key=lambda kv: kv[1], default=("", 0.0))
            if wait > 0:
                st.refused[kind] = st.refused.get(kind, 0) + 1
                headers = {**self._headers(st), "Retry-After": str(max(1, math.ceil(wait)))}
                if kind == "concurrency":
                    msg = (f"tenant {tenant!r} has {st.in_flight} requests in flight, its limit "
                           f"(max_concurrency {lim.max_concurrency}); retry when one ends")
                elif kind == "requests":
                    msg = (f"rate limit reached for tenant {tenant!r} on requests per min (RPM): limit "
                           f"{lim.rpm}; please try again in {_duration(wait)}")
                else:
                    msg = (f"rate limit reached for tenant {tenant!r} on tokens per min (TPM): limit {lim.tpm}, "
                           f"remaining {max(0, int(st.tokens.level))}, requested {need}; please try again in "
                           f"{_duration(wait)}")
                raise RateLimited(msg, wait, headers)
            if st.requests is not None:
                st.requests.level -= 1
            taken = prompt_tokens if take_prompt else 0
            if st.tokens is not None:
                st.tokens.level -= taken
            st.in_flight += 1
        return Ticket(tenant, taken)

    def release(self, ticket: Ticket | None) -> None:
        """The request ended (once per ticket, however often called)."""
        if ticket is None or ticket.released:
            return
        ticket.released = True
        st = self._tenants.get(ticket.tenant)
        with self._lock:
            st.in_flight -= 1

    def cancel(self, ticket: Ticket | None) -> None:
        """The request never ran (the engine refused it): release it and give back what
        admission took, so a bad request costs no quota."""
        if ticket is None or ticket.released:
            return
        self.release(ticket)
        st = self._tenants[ticket.tenant]
        with self._lock:
            if st.requests is not None:
                st.requests.level += 1
            if st.tokens is not None:
                st.tokens.level += ticket.prompt_tokens

    def charge(self, tenant: str, tokens: int) -> None:
        """Tokens a tenant used beyond what admission took (its requests' output)."""
        st = self._tenants.get(tenant)
        if st is None or st.tokens is None or tokens <= 0:
            return
        with self._lock:
            st.tokens.refill(self.clock())
            st.tokens.level -= tokens
