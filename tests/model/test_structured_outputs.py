"""Structured outputs on the real engine: SmolLM2's JSON matches each of 20 schemas on
every sample, regexes, choices and grammars hold, a constrained request neither slows
nor changes its neighbours, bad specs are refused, and no block leaks."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sluice import SamplingParams
from tests.conftest import assert_all_blocks_free

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 60}},
     "required": ["ok", "reason"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["score"]},
    {"type": "object", "properties": {"temperature": {"type": "integer", "minimum": -50, "maximum": 60},
                                      "unit": {"const": "celsius"}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 30},
                                                    "last": {"type": "string", "maxLength": 30}},
                   "required": ["first", "last"]},
        "role": {"enum": ["admin", "user", "guest"]}}, "required": ["person", "role"]},
    {"type": "object", "properties": {"points": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"]}}}, "required": ["points"]},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000},
                                                           {"type": "string", "maxLength": 20}]}},
     "required": ["answer"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                      "status": {"enum": ["open", "closed"]},
                                      "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["id", "status", "priority"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 3, "maxItems": 5},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 3, "maxLength": 50},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 12},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}, "total": {"type": "number", "minimum": 0, "maximum": 1000}},
     "required": ["items", "total"]},
    {"type": "object", "properties": {"shipping": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "pickup"}, "store": {"type": "string", "maxLength": 30}},
         "required": ["kind", "store"]},
        {"type": "object", "properties": {"kind": {"const": "post"}, "zip": {"type": "string",
                                                                             "pattern": "^[0-9]{5}$"}},
         "required": ["kind", "zip"]}]}}, "required": ["shipping"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                                      "keywords": {"type": "array", "maxItems": 3,
                                                   "items": {"type": "string", "maxLength": 15}}},
     "required": ["sentiment", "confidence", "keywords"], "additionalProperties": False},
]


def ask(schema) -> list[dict]:
    return [{"role": "user", "content": "Reply with one JSON value matching this JSON schema, nothing else: "
                                        + json.dumps(schema)}]


def test_twenty_schemas_every_sample_validates(smollm2_llm):
    assert len(SCHEMAS) == 20
    params = [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=160,
                             structured_outputs={"json": s}) for i, s in enumerate(SCHEMAS)]
    outs = smollm2_llm.chat([ask(s) for s in SCHEMAS], params)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert_all_blocks_free(smollm2_llm)


def test_regex_choice_and_grammar(smollm2_llm):
    q = [{"role": "user", "content": "What is the phone number of the town hall?"}]
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,3}/'
    gbnf = 'root ::= "yes" | "no"'
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": r"\d{3}-\d{4}"}),
              SamplingParams(temperature=0.9, seed=3, max_tokens=30, structured_outputs={"regex": r"[A-Z][a-z]{2,8}"}),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs={"choice": ["maybe", "may", "no"]}),
              SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                             structured_outputs={"choice": ["a \"quoted\" one", "new\nline"]}),
              SamplingParams(temperature=0.7, seed=1, max_tokens=30, structured_outputs={"grammar": grammar}),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs={"grammar": gbnf}),
              SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json_object": True})]
    outs = [o.outputs[0] for o in smollm2_llm.chat([q] * len(params), params)]
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert re.fullmatch(r"\d{3}-\d{4}", outs[0].text)
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", outs[1].text)
    assert outs[2].text in ("maybe", "may", "no")
    assert outs[3].text in ("a \"quoted\" one", "new\nline")
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,3}\.", outs[4].text)
    assert outs[5].text in ("yes", "no")
    assert isinstance(json.loads(outs[6].text), dict)
    assert_all_blocks_free(smollm2_llm)


def test_neighbours_unchanged_and_n_samples_each_valid(smollm2_llm):
    """Greedy unconstrained requests give the same tokens beside constrained ones as
    alone (float32: exact); n=3 constrained samples are each complete and valid."""
    prompts = ["The capital of France is", "List three colours:", "def add(a, b):"]
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, free)]
    schema = SCHEMAS[2]
    mixed = smollm2_llm.generate(prompts + ["Pick a colour as JSON:"],
                                 [free] * 3 + [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40,
                                                              structured_outputs={"json": schema})])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert len(mixed[3].outputs) == 3
    for c in mixed[3].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    assert_all_blocks_free(smollm2_llm)


def test_length_limit_and_min_tokens(smollm2_llm):
    """A grammar that cannot finish in max_tokens ends with "length"; a grammar that is
    complete before min_tokens ends there (nothing else could follow)."""
    long_json = SamplingParams(temperature=0, max_tokens=3, structured_outputs={"json": SCHEMAS[0]})
    short = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs={"choice": ["yes"]})
    a, b = smollm2_llm.generate(["Describe a person:", "Say yes:"], [long_json, short])
    assert a.outputs[0].finish_reason == "length" and len(a.outputs[0].token_ids) == 3
    assert b.outputs[0].finish_reason == "stop" and b.outputs[0].text == "yes"
    assert_all_blocks_free(smollm2_llm)


@pytest.mark.parametrize("spec, match", [
    ({"json": {"type": "strin"}}, "structured_outputs.json"),
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(["}, "structured_outputs.regex"),
    ({"grammar": "start: missing_rule"}, "structured_outputs.grammar"),
    ({"choice": []}, "choice"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"jsn": {}}, "unknown field"),
])
def test_bad_specs_are_refused_and_nothing_leaks(smollm2_llm, spec, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        smollm2_llm.generate(["Hello"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert_all_blocks_free(smollm2_llm)
