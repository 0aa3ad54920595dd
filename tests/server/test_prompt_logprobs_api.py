"""prompt_logprobs (vLLM's extension) and echo + logprobs through the `openai` client."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.server.conftest import MODEL, wait_all_blocks_free
from tests.server.test_errors import assert_error, post

GREEDY = {"ignore_eos": True}
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def reference(server):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(server.model_path, torch_dtype=torch.float32).eval()

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0].float(), dim=-1)
    return ref


def test_completion_prompt_logprobs_in_vllm_shape(client, server, reference):
    ids = server.llm.tokenizer.encode(PROMPT)
    ref = reference(ids)
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=3, temperature=0,
                                  extra_body={"prompt_logprobs": 1, **GREEDY})
    first, second = r.choices
    plp = first.prompt_logprobs
    assert plp == second.prompt_logprobs  # one prompt, the same for every sample
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry, tid = plp[p], ids[p]
        assert str(tid) in entry and len(entry) in (1, 2), (p, entry)
        for key, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert abs(value["logprob"] - float(ref[p - 1, int(key)])) <= 1e-5, (p, key)
            assert value["decoded_token"] == server.llm.tokenizer.decode([int(key)], skip_special_tokens=False)
        best = [k for k, v in entry.items() if v["rank"] == 1]
        assert len(best) == 1 and float(ref[p - 1].max() - ref[p - 1, int(best[0])]) <= 1e-5
        assert entry[str(tid)]["rank"] == int((ref[p - 1] > ref[p - 1, tid]).sum()) + 1
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, extra_body=GREEDY)
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None
    assert plain.choices[0].text == first.text
    wait_all_blocks_free(server.llm)


def test_echo_with_logprobs_scores_the_prompt_tokens(client, server):
    ids = server.llm.tokenizer.encode(PROMPT)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    echo = client.completions.create(**kwargs, extra_body={"prompt_logprobs": 0, **GREEDY}).choices[0]
    lp = echo.logprobs
    # prompt_logprobs keeps to its own k (0: the prompt token alone), whatever echo needs.
    assert echo.prompt_logprobs[0] is None
    assert [list(e) for e in echo.prompt_logprobs[1:]] == [[str(t)] for t in ids[1:]]
    assert echo.text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[len(ids)] == len(PROMPT)  # completion tokens sit after the echoed prompt
    # The echoed tokens carry exactly the prompt logprobs.
    plp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2, **GREEDY}).choices[0].prompt_logprobs
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - plp[p][str(ids[p])]["logprob"]) <= 1e-5
    # Streaming sends the same logprobs, the prompt's in the first chunk.
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=GREEDY))
    assert len(chunks[0].choices[0].logprobs.tokens) >= len(ids)
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(lp.token_logprobs)
    assert all(abs(a - b) <= 1e-5 for a, b in zip(streamed[1:], lp.token_logprobs[1:]))
    offsets = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    # Offsets of the echoed tokens, and the completion's start after them. (Later streamed
    # offsets follow the text sent so far, non-streamed ones the decoded tokens.)
    assert offsets[:len(ids) + 1] == lp.text_offset[:len(ids) + 1]
    wait_all_blocks_free(server.llm)


def test_chat_prompt_logprobs_at_response_level(server):
    r = post(server.url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 2,
        "temperature": 0, "prompt_logprobs": 0, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    plp = body["prompt_logprobs"]
    assert len(plp) == body["usage"]["prompt_tokens"] and plp[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["logprob"] <= 0 for entry in plp[1:])
    wait_all_blocks_free(server.llm)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "many"}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1, "echo": True, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 21}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": -2}),
])
def test_bad_prompt_logprobs_are_400(server, path, body):
    assert_error(post(server.url, path, {"model": MODEL, "max_tokens": 2, **body}), 400, "prompt_logprobs")
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_stream_accepts_prompt_logprobs_zero_as_vllm_does(server):
    r = post(server.url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True,
                                             "prompt_logprobs": 0})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    wait_all_blocks_free(server.llm)


def lm_eval_loglikelihood(choice: dict, ctxlen: int, generated: int) -> tuple[float, bool]:
    """What lm-eval's local-completions does with a choice: the continuation's logprobs
    summed (the tokens after the context, less the generated ones), and whether each was
    the top choice."""
    lp = choice["logprobs"]
    end = len(lp["token_logprobs"]) - generated
    tokens, logprobs, tops = lp["tokens"][ctxlen:end], lp["token_logprobs"][ctxlen:end], lp["top_logprobs"][ctxlen:end]
    return sum(logprobs), all(max(top, key=top.get) == tok for tok, top in zip(tokens, tops))


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_payload_matches_transformers(server, reference, max_tokens):
    """lm-eval's loglikelihood request as it sends it (a batch of token-id prompts, echo,
    logprobs 1, greedy, a seed), and the scoring scripts' max_tokens 0: the continuation's
    summed logprob equals transformers' in float32."""
    tok = server.llm.tokenizer
    pairs = [("The capital of France is", " Paris"), ("One, two, three,", " four, five"),
             ("Water boils at", " one hundred degrees")]
    prompts, ctxlens = [], []
    for ctx, cont in pairs:
        ctx_ids = tok.encode(ctx)
        prompts.append(ctx_ids + tok.encode(cont, add_special_tokens=False))
        ctxlens.append(len(ctx_ids))
    r = post(server.url, "/v1/completions", {"model": MODEL, "prompt": prompts, "temperature": 0,
                                             "max_tokens": max_tokens, "logprobs": 1, "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for ids, ctxlen, choice in zip(prompts, ctxlens, body["choices"]):
        ref = reference(ids)
        want = sum(float(ref[p - 1, ids[p]]) for p in range(ctxlen, len(ids)))
        got, greedy = lm_eval_loglikelihood(choice, ctxlen, max_tokens)
        assert abs(got - want) <= 1e-4, (got, want)
        assert greedy == all(int(ref[p - 1].argmax()) == ids[p] for p in range(ctxlen, len(ids)))
        assert len(choice["logprobs"]["tokens"]) == len(ids) + max_tokens
        if max_tokens == 0:
            assert choice["finish_reason"] == "length" and choice["text"] == tok.decode(ids)
    prompt_tokens = sum(len(ids) for ids in prompts)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == max_tokens * len(prompts)
    wait_all_blocks_free(server.llm)


def test_max_tokens_0_with_echo_streams_the_prompt_alone(server, reference):
    ids = server.llm.tokenizer.encode(PROMPT)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 1,
            "stream": True, "stream_options": {"include_usage": True}}
    r = post(server.url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == PROMPT
    assert choices[-1]["finish_reason"] == "length"
    lp = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    ref = reference(ids)
    assert len(lp) == len(ids) and lp[0] is None
    assert all(abs(lp[p] - float(ref[p - 1, ids[p]])) <= 1e-5 for p in range(1, len(ids)))
    plp = [c["prompt_logprobs"] for c in choices if c.get("prompt_logprobs")]
    assert len(plp) == 1 and len(plp[0]) == len(ids)
    assert events[-1]["usage"]["completion_tokens"] == 0 and events[-1]["usage"]["prompt_tokens"] == len(ids)
    wait_all_blocks_free(server.llm)


def test_streamed_prompt_logprobs_equal_the_response_s(client, server):
    """In a stream, each choice's prompt logprobs come once (completions: in the choice's
    chunk; chat: at the chunk's top level, as the response has them), equal to the
    non-streamed ones, n > 1 too."""
    kwargs = dict(model=MODEL, prompt=PROMPT, n=2, max_tokens=3, temperature=0)
    want = client.completions.create(**kwargs, extra_body={"prompt_logprobs": 2, **GREEDY}).choices[0].prompt_logprobs
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"prompt_logprobs": 2, **GREEDY}))
    got = {c.choices[0].index: c.choices[0].prompt_logprobs for c in chunks
           if c.choices and getattr(c.choices[0], "prompt_logprobs", None)}
    assert got == {0: want, 1: want}
    messages = [{"role": "user", "content": "Say hello"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "n": 2, "prompt_logprobs": 1, **GREEDY}
    whole = post(server.url, "/v1/chat/completions", body).json()
    r = post(server.url, "/v1/chat/completions", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    sent = [(e["choices"][0]["index"], e["prompt_logprobs"]) for e in events if e.get("prompt_logprobs")]
    assert sorted(i for i, _ in sent) == [0, 1] and all(p == whole["prompt_logprobs"] for _, p in sent)
    wait_all_blocks_free(server.llm)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "stream": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
])
def test_max_tokens_0_only_with_echo(server, path, body, param):
    r = post(server.url, path, {"model": MODEL, **body})
    assert_error(r, 400, param)
    if body.get("max_tokens") == 0 and "echo" not in body and path == "/v1/completions":
        assert "echo" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
