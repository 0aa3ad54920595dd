"""StructuredOutputsParams: what one request's output must match, validated when built.

vLLM's `structured_outputs` fields: exactly one of `json` (a JSON schema, as a dict or a
JSON string), `json_object` (any JSON object), `regex`, `choice` (one of these strings)
or `grammar` (a Lark grammar, the form llguidance takes; a GBNF grammar, written with
`::=`, is converted). Compiling it for a tokenizer is grammar.py's job: this module
checks shapes only, so SamplingParams can be built without a model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

# Bounds on what one request may send (the HTTP body limit applies too): a grammar or
# schema this large is far past any real one and costly to compile.
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | bool | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # JSON only: no whitespace at all between tokens ({"a":1,"b":[1,2]}), vLLM's flag.
    # By default JSON is written as json.dumps writes it ({"a": 1, "b": [1, 2]}): fixed
    # separators, since a small model allowed any whitespace can spend its whole token
    # budget on newlines, and the fixed form is what models emit anyway.
    disable_any_whitespace: bool = False

    def __init__(self, json=None, json_object: bool = False, regex: str | None = None, choice=None,
                 grammar: str | None = None, disable_any_whitespace: bool = False):
        set_ = object.__setattr__
        set_(self, "json", json)
        set_(self, "json_object", json_object)
        set_(self, "regex", regex)
        set_(self, "choice", tuple(choice) if isinstance(choice, (list, tuple)) else choice)
        set_(self, "grammar", grammar)
        set_(self, "disable_any_whitespace", disable_any_whitespace)
        self._validate()

    @classmethod
    def from_dict(cls, value, field: str = "structured_outputs") -> "StructuredOutputsParams":
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{field} must be an object with one of {', '.join(KINDS)}, got {type(value).__name__}")
        allowed = set(KINDS) | {"disable_any_whitespace"}
        unknown = sorted(map(str, set(value) - allowed))  # offline callers may pass any key type
        if unknown:
            raise ValueError(f"{field}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        return cls(**value)

    @property
    def kind(self) -> str:
        for k in KINDS:
            v = getattr(self, k)
            if v is not None and v is not False:
                return k
        raise AssertionError("validated params have a kind")

    def _validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        for flag in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"structured_outputs.{flag} must be true or false")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                if len(schema) > MAX_SPEC_CHARS:
                    raise ValueError(f"structured_outputs.json is longer than {MAX_SPEC_CHARS} characters")
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            object.__setattr__(self, "json", schema)
            if len(self.canonical()) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_outputs.json is longer than {MAX_SPEC_CHARS} characters")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or len(v) > MAX_SPEC_CHARS):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string of at most "
                                 f"{MAX_SPEC_CHARS} characters")
        if self.choice is not None:
            c = self.choice
            if (not isinstance(c, tuple) or not 0 < len(c) <= MAX_CHOICES
                    or any(not isinstance(s, str) or not s for s in c) or sum(map(len, c)) > MAX_SPEC_CHARS):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings")

    def canonical(self) -> str:
        """One string per distinct constraint: the compiled-grammar cache's key."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value if not isinstance(value, tuple) else list(value),
                           self.disable_any_whitespace], sort_keys=True, separators=(",", ":"))
