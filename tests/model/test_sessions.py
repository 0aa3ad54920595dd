"""Sessions end to end on the real engine: a program's history stays cached across other
traffic between its calls, the outputs do not change, nothing leaks once released."""
from __future__ import annotations

import random

import pytest

from sluice import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free

GREEDY = dict(temperature=0, ignore_eos=True)


def agent_run(path: str, session: bool, **kwargs):
    """Call 1, then traffic that cycles the whole cache, then call 2 (history + reply + a
    tool result). Returns (llm, call 2's output)."""
    # 384 tokens of KV. The pin's TTL (wall-clock seconds) far above what the traffic
    # between the calls takes on any machine, so that only the traffic decides.
    llm = LLM(model=path, dtype="float32", num_blocks=24, session_ttl_s=3600, session_ttl_max_s=3600, **kwargs)
    rng = random.Random(0)
    history = [rng.randrange(3, 400) for _ in range(120)]
    sid = "agent-1" if session else None
    first = llm.generate([history], SamplingParams(max_tokens=8, **GREEDY), session_id=sid)[0]
    # Other users, one after another: each fits beside the pin, and together they cycle
    # every unpinned block through the LRU list (6 x 6 blocks > the 24 of the cache).
    for _ in range(6):
        llm.generate([[rng.randrange(3, 400) for _ in range(90)]], SamplingParams(max_tokens=4, **GREEDY))
    tool_result = [rng.randrange(3, 400) for _ in range(20)]
    second = llm.generate([history + first.outputs[0].token_ids + tool_result],
                          SamplingParams(max_tokens=8, **GREEDY), session_id=sid)[0]
    return llm, second


@pytest.mark.parametrize("caching", [True, False])
def test_a_sessions_history_survives_other_traffic(tiny_checkpoint, caching):
    path = str(tiny_checkpoint("llama"))
    llm, second = agent_run(path, session=True, enable_prefix_caching=caching)
    _, control = agent_run(path, session=False, enable_prefix_caching=caching)
    # Call 1 computed 127 tokens: 7 full blocks of 16 stayed pinned through the traffic.
    assert second.num_cached_tokens == 112 and control.num_cached_tokens == 0
    assert second.outputs[0].token_ids == control.outputs[0].token_ids
    sessions = llm.engine.scheduler.sessions
    assert sessions.stats.hits == 1 and sessions.num_pinned > 0
    pinned = sessions.num_pinned
    assert llm.release_session("agent-1") == pinned
    assert sessions.num_pinned == 0 and llm.release_session("agent-1") is None
    assert_all_blocks_free(llm)


def test_bad_scheduling_fields_are_refused_offline(tiny_llm):
    with pytest.raises(ValueError, match="priority"):
        tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), priority=-1)
    with pytest.raises(ValueError, match="session_id"):
        tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), session_id="s" * 300)
    assert_all_blocks_free(tiny_llm)


def test_running_requests_take_pins_before_preempting(tiny_checkpoint):
    """Traffic that needs the whole cache at once gets the pinned blocks (the pin goes, no
    running request is preempted for it), and its outputs are those of a fresh engine."""
    path = str(tiny_checkpoint("llama"))
    llm = LLM(model=path, dtype="float32", num_blocks=24)
    rng = random.Random(1)
    llm.generate([[rng.randrange(3, 400) for _ in range(120)]], SamplingParams(max_tokens=8, **GREEDY),
                 session_id="s")
    sessions = llm.engine.scheduler.sessions
    assert sessions.num_pinned == 7
    # Two requests admitted into the 17 free blocks (6 each), growing to 10 each: 20.
    crowd = [[rng.randrange(3, 400) for _ in range(90)] for _ in range(2)]
    outs = llm.generate(crowd, SamplingParams(max_tokens=60, **GREEDY))
    assert sessions.num_pinned == 0 and sessions.stats.evicted_for_room == 1
    assert llm.engine.scheduler.num_preemptions == 0
    fresh = LLM(model=path, dtype="float32", num_blocks=24).generate(crowd, SamplingParams(max_tokens=60, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fresh]
    assert_all_blocks_free(llm)
