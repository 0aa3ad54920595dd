"""Completions and chat through the `openai` client against a real server."""
from __future__ import annotations

import asyncio

import httpx
import openai

from tests.server.conftest import MODEL, StepGate, wait_all_blocks_free

GREEDY = {"ignore_eos": True}


def test_completion_non_streaming_with_exact_usage(client, server):
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                  extra_body=GREEDY)
    ids = server.llm.tokenizer.encode("The quick brown fox")
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(ids) + 12
    assert r.choices[0].text  # tiny random model: gibberish, but not empty


def test_completion_stream_equals_non_stream_and_reports_usage(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, extra_body=GREEDY)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_non_streaming_and_streaming(client):
    msgs = [{"role": "user", "content": "Say hello"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0,
                                       extra_body=GREEDY)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == r.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 10


def test_n2_stop_and_seed(client):
    r = client.completions.create(model=MODEL, prompt="Numbers:", n=2, max_tokens=8, temperature=1.0, seed=3,
                                  extra_body=GREEDY)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    again = client.completions.create(model=MODEL, prompt="Numbers:", n=2, max_tokens=8, temperature=1.0,
                                      seed=3, extra_body=GREEDY)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    full = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=20, temperature=0,
                                     extra_body=GREEDY).choices[0].text
    stop = full.strip()[3:6]
    assert stop
    cut = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body=GREEDY).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_prompt_forms_echo_and_logprobs(client, server):
    ids = server.llm.tokenizer.encode("Hello there")
    r = client.completions.create(model=MODEL, prompt=["Hello there", "General Kenobi"], max_tokens=4,
                                  temperature=0, extra_body=GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, extra_body=GREEDY)
    assert by_ids.choices[0].text == r.choices[0].text
    echo = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0, echo=True,
                                     logprobs=2, extra_body=GREEDY).choices[0]
    assert echo.text == "Hello there" + r.choices[0].text
    # Echoed prompt tokens carry logprobs too; the first has none (nothing precedes it).
    assert len(echo.logprobs.tokens) == len(ids) + 4
    assert echo.logprobs.token_logprobs[0] is None and echo.logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in echo.logprobs.token_logprobs[1:])
    assert all(len(t) == 2 for t in echo.logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body=GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_32_concurrent_streaming_chats_match_solo_runs(server):
    """32 clients at once: their steps interleave, and each text equals its solo run. No
    step runs until all 32 are queued (StepGate), so that they meet however slowly this
    machine sends them: each step then admits what its 256-token budget leaves (5-6 of
    these ~42-token prompts), and nobody finishes 24 tokens in three steps, even drafting
    8 tokens a step: at least 16 run at once."""
    from openai import AsyncOpenAI
    questions = [f"Question {i}: tell me about item {i * 7}" for i in range(32)]

    async def main():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def ask(q):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0,
                stream=True, extra_body=GREEDY)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        alone = [await ask(q) for q in questions]
        server.stats["max_running"] = 0
        with StepGate(server.engine) as gate:
            crowd = asyncio.gather(*(ask(q) for q in questions))
            await asyncio.to_thread(gate.wait_until, lambda e: e.scheduler.num_waiting == 32, "32 queued chats")
            gate.open()
            crowd = await crowd
        await client.close()
        return alone, list(crowd)

    alone, crowd = asyncio.run(main())
    assert crowd == alone
    assert server.stats["max_running"] >= 16, server.stats
    wait_all_blocks_free(server.llm)


def test_logit_bias_on_completions_and_chat(client, server):
    # OpenAI's form: token ids as JSON strings; +100 all but forces a token (the engine
    # tests check -100's ban and the neighbours).
    token_id = 4242
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=0,
                                      extra_body=GREEDY)
    assert plain.choices[0].logprobs.tokens != [server.llm.tokenizer.decode([token_id])] * 6
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
                                       logit_bias={str(token_id): 100}, extra_body=GREEDY)
    assert forced.choices[0].text == server.llm.tokenizer.decode([token_id] * 6)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0.8, seed=1, logit_bias={str(token_id): 100}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == \
        server.llm.tokenizer.decode([token_id] * 4)
    # vLLM's allowed_token_ids: one allowed token is the same as forcing it.
    only = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0.7,
                                     extra_body={**GREEDY, "allowed_token_ids": [token_id]})
    assert only.choices[0].text == forced.choices[0].text
    try:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1,
                                  extra_body={"allowed_token_ids": [5], "guided_regex": "a+"})
    except openai.BadRequestError as e:
        assert e.body["param"] == "allowed_token_ids", e.body
    else:
        raise AssertionError("allowed_token_ids with a grammar accepted")
    for bad in ({"x": 1}, {"5": 101}, {"-1": 1}, {"99999999": 1}):
        try:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, logit_bias=bad)
        except openai.BadRequestError as e:
            assert e.body["param"] == "logit_bias", e.body
        else:
            raise AssertionError(f"accepted {bad}")
    wait_all_blocks_free(server.llm)


def test_vllm_chat_and_stop_fields(client, server):
    """vLLM's include_stop_str_in_output, skip_special_tokens, continue_final_message and
    chat_template_kwargs; OpenAI's suffix, refused as vLLM does."""
    tok = server.llm.tokenizer
    special = next(t for t in tok.hf.all_special_ids if t not in tok.eos_token_ids)
    for skip in (True, False):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0,
                                      logit_bias={str(special): 100},
                                      extra_body={**GREEDY, "skip_special_tokens": skip})
        assert r.choices[0].text == ("" if skip else tok.decode([special] * 2, skip_special_tokens=False))
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, extra_body=GREEDY)
    text = plain.choices[0].text
    stop = text[3:5] if text[3:5].strip() else text[4:6]
    cut = text[:text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                      stream=stream, extra_body={**GREEDY, "include_stop_str_in_output": True})
        got = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
        assert got == cut + stop
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]
    r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=3, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].finish_reason == "length"
    for body, param in (({"continue_final_message": True}, "continue_final_message"),
                        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": "x"}, "chat_template_kwargs")):
        try:
            client.chat.completions.create(model=MODEL, messages=conv, max_tokens=3, extra_body=body)
        except openai.BadRequestError as e:
            assert e.body["param"] == param, e.body
        else:
            raise AssertionError(f"accepted {body}")
    try:
        client.completions.create(model=MODEL, prompt="def f(", suffix="    return 1", max_tokens=3)
    except openai.BadRequestError as e:
        assert e.body["param"] == "suffix"
    else:
        raise AssertionError("suffix accepted")


def test_return_token_ids_streamed_or_not(client, server):
    """vLLM's return_token_ids: the prompt's ids and the output's, which decode to the text."""
    tok = server.llm.tokenizer
    body = {**GREEDY, "return_token_ids": True}
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0, extra_body=body)
    choice = r.choices[0]
    assert choice.prompt_token_ids == tok.encode("Hello there")
    assert len(choice.token_ids) == 6 and tok.decode(choice.token_ids) == choice.text
    chunks = [c for c in client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0,
                                                   stream=True, extra_body=body) if c.choices]
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    assert [t for c in chunks for t in c.choices[0].token_ids] == choice.token_ids
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                          extra_body=body)
    assert chat.prompt_token_ids == tok.encode_chat(messages)
    assert tok.decode(chat.choices[0].token_ids) == chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body=body))
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids
    assert [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])] == chat.choices[0].token_ids
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2)
    assert getattr(plain.choices[0], "token_ids", None) is None


def test_tokenize_and_detokenize(server):
    """vLLM's routes: a prompt as /v1/completions tokenizes it, messages as chat renders them."""
    tok = server.llm.tokenizer
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello there", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode("Hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.llm.max_model_len
    assert body["token_strs"] == tok.hf.convert_ids_to_tokens(body["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tok.encode_chat(messages) and chat["token_strs"] is None
    # What the chat route computes for the same messages: its usage counts the same prompt.
    done = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"]
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": chat["tokens"]}).json()
    assert back["prompt"] == tok.apply_chat_template(messages)
    for path, bad, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                             ("/detokenize", {"tokens": [10**9]}, "tokens"),
                             ("/tokenize", {"prompt": "a", "model": "other"}, "model")):
        r = httpx.post(f"{server.url}{path}", json=bad)
        assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, (path, bad, r.text)
    assert httpx.post(f"{server.keyed_url}/tokenize", json={"prompt": "a"}).status_code == 401
    keyed = httpx.post(f"{server.keyed_url}/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer sekret"})
    assert keyed.status_code == 200


def test_tokenizer_info_as_lm_eval_reads_it(server):
    """vLLM's GET /tokenizer_info: lm-eval's remote tokenizer takes the server's tokenizer
    when it answers with the special tokens (and /tokenize works); its chat template
    renders as the server's does."""
    import jinja2.sandbox
    tok = server.llm.tokenizer
    r = httpx.get(f"{server.url}/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == type(tok.hf).__name__
    assert info["eos_token"] == tok.hf.eos_token and info["eos_token_id"] == tok.hf.eos_token_id
    assert info["bos_token"] == tok.hf.bos_token and info["bos_token_id"] == tok.hf.bos_token_id
    assert set(info["eos_token_ids"]) == tok.eos_token_ids
    assert info["model_max_length"] == server.llm.max_model_len
    assert not any(k in info for k in ("name_or_path", "vocab_file", "tokenizer_file"))
    # lm-eval's RemoteTokenizer: eos_token_id is /tokenize of eos_token, no special tokens added.
    eos = httpx.post(f"{server.url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [tok.hf.eos_token_id]
    messages = [{"role": "user", "content": "hi"}]
    template = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        info["chat_template"])
    assert template.render(messages=messages, add_generation_prompt=True) == tok.apply_chat_template(messages)
    assert httpx.get(f"{server.keyed_url}/tokenizer_info").status_code == 401
    keyed = httpx.get(f"{server.keyed_url}/tokenizer_info", headers={"Authorization": "Bearer sekret"})
    assert keyed.status_code == 200 and keyed.json() == info


def test_continuous_usage_stats(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens so far."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = [c for c in client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                                   stream=True, stream_options=opts, extra_body=GREEDY)]
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted == sorted(counted) and counted[-1] == 5
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    chat = [c for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, stream=True, stream_options=opts)]
    assert all(c.usage is not None for c in chat)
    assert chat[0].usage.prompt_tokens == chat[-1].usage.prompt_tokens > 0
    plain = [c for c in client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True) if c.choices]
    assert all(c.usage is None for c in plain)


def test_truncate_prompt_tokens_keeps_the_end(client, server):
    long = "one two three four five six seven eight nine ten " * 3
    ids = server.llm.tokenizer.encode(long)
    r = client.completions.create(model=MODEL, prompt=long, max_tokens=3, temperature=0, logprobs=0,
                                  extra_body={**GREEDY, "truncate_prompt_tokens": 5})
    same = client.completions.create(model=MODEL, prompt=ids[-5:], max_tokens=3, temperature=0, logprobs=0,
                                     extra_body=GREEDY)
    assert r.usage.prompt_tokens == 5 and r.choices[0].text == same.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=long, max_tokens=1, echo=True,
                                       extra_body={"truncate_prompt_tokens": 5})
    assert echoed.choices[0].text.startswith(server.llm.tokenizer.decode(ids[-5:]))
    too_long = "word " * (server.llm.max_model_len + 10)
    with_all = client.completions.create(model=MODEL, prompt=too_long, max_tokens=1,
                                         extra_body={"truncate_prompt_tokens": server.llm.max_model_len - 1})
    assert with_all.usage.prompt_tokens == server.llm.max_model_len - 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage.prompt_tokens == 7
    for bad in (0, -2):
        try:
            client.completions.create(model=MODEL, prompt="a", max_tokens=1, extra_body={"truncate_prompt_tokens": bad})
        except openai.BadRequestError as e:
            assert e.body["param"] == "truncate_prompt_tokens"
        else:
            raise AssertionError(f"accepted {bad}")


def test_models_health_version_metrics(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    card = httpx.get(f"{server.url}/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model"
    missing = httpx.get(f"{server.url}/v1/models/org/other-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("sluice_num_requests_running", "sluice_num_requests_waiting", "sluice_kv_cache_usage_ratio",
                 "sluice_num_preemptions_total", "sluice_prompt_tokens_total", "sluice_generation_tokens_total",
                 "sluice_time_to_first_token_seconds_bucket", "sluice_time_per_output_token_seconds_bucket",
                 "sluice_e2e_request_latency_seconds_bucket", "sluice_request_queue_time_seconds_bucket"):
        assert name in text, name
