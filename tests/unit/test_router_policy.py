"""The data-parallel router's choices (entrypoints/router/policy.py), with no Ray: exact
replicas for each policy, session and response affinity, the load-balance switch, and the
routing text and merged metrics of entrypoints/router/app.py."""
from __future__ import annotations

import pytest

from sluice.entrypoints.router.app import merge_metrics, routing_text
from sluice.entrypoints.router.policy import CHUNK, RouterPolicy, chunk_hashes

DOC = "".join(f"section {i}: the quick brown fox jumps over the lazy dog. " for i in range(40))


def test_round_robin_and_least_loaded():
    rr = RouterPolicy(3, "round_robin")
    assert [rr.pick([0, 1, 2])[0] for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [rr.pick([0, 2])[0] for _ in range(2)] == [0, 2]  # only the healthy ones
    ll = RouterPolicy(3, "least_loaded")
    ll.inflight[:] = [3, 1, 2]
    assert ll.pick([0, 1, 2]) == (1, "least_loaded")
    assert ll.pick([0, 2]) == (2, "least_loaded")


def test_cache_aware_sends_a_shared_prefix_to_the_replica_that_saw_it():
    p = RouterPolicy(2, "cache_aware")
    first, why = p.pick([0, 1], DOC + "question one?")
    assert why == "cache_miss"
    for q in ("two", "three", "four"):
        assert p.pick([0, 1], DOC + f"question {q}?") == (first, "cache_hit")
    # Another document: nothing matches, so the replica with the smaller tree gets it.
    other = "".join(f"chapter {i}: a completely different text, about whales and ships. " for i in range(40))
    assert p.pick([0, 1], other) == (1 - first, "cache_miss")
    # Under the threshold: a short shared head of a long text is not a hit.
    assert p.pick([0, 1], DOC[:CHUNK] + "x" * 2000)[1] == "cache_miss"
    # The replica holding the prefix is down: another one takes it.
    assert p.pick([1 - first], DOC + "question five?")[0] == 1 - first
    # Texts too short for one piece match nothing and fill no tree: they take turns.
    assert sorted(p.pick([0, 1], f"hi {i}")[0] for i in range(4)) == [0, 0, 1, 1]


def test_cache_aware_balances_when_load_is_lopsided():
    p = RouterPolicy(2, "cache_aware", balance_abs=4, balance_rel=1.5)
    r, _ = p.pick([0, 1], DOC + "a")
    p.inflight[r] = 10
    p.inflight[1 - r] = 2
    assert p.pick([0, 1], DOC + "b") == (1 - r, "balance")
    # 10 vs 7: within the relative threshold, so by the cache again; both replicas have
    # seen the document by now, and the less loaded one wins the tie.
    p.inflight[1 - r] = 7
    assert p.pick([0, 1], DOC + "c") == (1 - r, "cache_hit")


def test_sessions_and_stored_responses_keep_their_replica():
    p = RouterPolicy(3, "round_robin")
    r, _ = p.pick([0, 1, 2], "hi", session=("acme", "s1"))
    assert all(p.pick([0, 1, 2], "more", session=("acme", "s1")) == (r, "session") for _ in range(4))
    # The same id under another tenant is another session.
    assert p.pick([0, 1, 2], "hi", session=("other", "s1"))[1] == "round_robin"
    p.stored("resp_abc", 2)
    assert p.pick([0, 1, 2], "x", response_id="resp_abc") == (2, "response")
    # A replica that restarted lost its sessions, responses and cache.
    p.forget(r)
    assert p.pick([0, 1, 2], "again", session=("acme", "s1"))[1] == "round_robin"
    p.forget(2)
    assert p.pick([0, 1, 2], "x", response_id="resp_abc")[1] == "round_robin"


def test_bad_policy_settings():
    with pytest.raises(ValueError, match="router policy must be one of"):
        RouterPolicy(2, "random")
    with pytest.raises(ValueError, match="cache_threshold"):
        RouterPolicy(2, "cache_aware", cache_threshold=2)


def test_routing_text_extends_turn_by_turn():
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "and then?"}]
    a, b = routing_text("/v1/chat/completions", {"messages": turn1}), routing_text("/v1/chat/completions",
                                                                                  {"messages": turn2})
    assert b.startswith(a) and len(b) > len(a)
    assert routing_text("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_text("/v1/completions", {"prompt": [[1, 2], [3]]}) == "1,2"
    assert routing_text("/v1/responses", {"input": "q", "instructions": "i"}).startswith("i")
    assert routing_text("/v1/completions", {"prompt": None}) == ""
    assert chunk_hashes("x" * (3 * CHUNK + 5))[:2] == chunk_hashes("x" * (2 * CHUNK))


def test_merged_metrics_label_every_replica():
    text = ('# HELP sluice_engine_steps_total Engine steps\n# TYPE sluice_engine_steps_total counter\n'
            'sluice_engine_steps_total{model_name="m"} 3.0\n'
            '# HELP sluice_num_requests_running Requests\n# TYPE sluice_num_requests_running gauge\n'
            'sluice_num_requests_running{model_name="m"} 1.0\n')
    merged = merge_metrics({0: text, 1: text.replace("3.0", "5.0"), 2: None}).decode()
    assert 'sluice_engine_steps_total{model_name="m",replica="0"} 3.0' in merged
    assert 'sluice_engine_steps_total{model_name="m",replica="1"} 5.0' in merged
    assert merged.count("# TYPE sluice_num_requests_running gauge") == 1
