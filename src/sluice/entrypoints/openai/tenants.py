"""Tenants of the server: who a request is served for.

A tenant is named by its API key when the server has keys (`--api-key`, or the keys of a
`--tenants` file), else by the request's `user` field, else it is the one shared tenant
"". The tenant is the unit of fair shares (`--scheduling-policy fair`, with the weights
of the file) and the namespace of session ids and of the prefix cache: with keys, one
tenant can never reach another's session or cached blocks. Without keys the `user` field
is whatever the client says, so it separates sessions and shares but isolates nothing.

The file (JSON):

    {"tenants": [{"name": "alice", "api_key": "sk-alice", "weight": 2},
                 {"name": "bob", "api_key": "sk-bob", "rpm": 60, "tpm": 20000,
                  "max_tokens": 512, "max_concurrency": 4},
                 {"name": "batch-user", "weight": 0.5}]}

An entry without api_key names a `user` value (for weights without keys). rpm, tpm,
max_tokens and max_concurrency are the tenant's rate limits (quotas.py), each optional.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

MAX_TENANT_NAME = 128
LIMITS = ("rpm", "tpm", "max_tokens", "max_concurrency")


@dataclass(frozen=True)
class TenantSpec:
    name: str
    api_key: str | None = None
    weight: float = 1.0
    # Rate limits (quotas.py): requests and tokens per minute, the largest max_tokens, the
    # most requests in flight; None: unlimited.
    rpm: int | None = None
    tpm: int | None = None
    max_tokens: int | None = None
    max_concurrency: int | None = None

    @property
    def limits(self):
        from sluice.entrypoints.openai.quotas import TenantLimits
        return TenantLimits(self.rpm, self.tpm, self.max_tokens, self.max_concurrency)


def key_salt(api_key: str) -> str:
    """The prefix-cache namespace of a key's tenant (a hash: the key itself stays out of
    the cache's bookkeeping)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def load_tenants(path: str | Path) -> list[TenantSpec]:
    """The tenants of a --tenants file; ValueError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--tenants: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--tenants: {path} is not JSON: {e}") from None
    entries = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f'--tenants: {path} must be a JSON object with a "tenants" list')
    out: list[TenantSpec] = []
    names, keys = set(), set()
    for i, e in enumerate(entries):
        where = f"--tenants: {path}: tenants[{i}]"
        if not isinstance(e, dict) or set(e) - {"name", "api_key", "weight", *LIMITS}:
            raise ValueError(f"{where} must be an object with name, and optionally api_key, weight and the limits "
                             f"{', '.join(LIMITS)}")
        name, key, weight = e.get("name"), e.get("api_key"), e.get("weight", 1.0)
        for limit in LIMITS:
            v = e.get(limit)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{where}.{limit} must be an integer >= 1")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TENANT_NAME:
            raise ValueError(f"{where}.name must be a string of 1 to {MAX_TENANT_NAME} characters")
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"{where}.api_key must be a non-empty string")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{where}.weight must be a number > 0")
        if name in names:
            raise ValueError(f"{where}: the name {name!r} appears twice")
        if key is not None and key in keys:
            raise ValueError(f"{where}: an api_key appears twice")
        names.add(name)
        if key is not None:
            keys.add(key)
        out.append(TenantSpec(name, key, float(weight), **{k: e[k] for k in LIMITS if e.get(k) is not None}))
    return out
