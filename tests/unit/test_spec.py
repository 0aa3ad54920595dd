"""Speculative decoding without a model: draft lookup, the load gate, and the scheduler's
accounting of drafted KV slots (a fake runner decides what is accepted)."""
from __future__ import annotations

import pytest

from sluice.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.scheduler import SampledToken, Scheduler, StepResult
from sluice.request import Request, RequestStatus
from sluice.sampling_params import SamplingParams
from sluice.spec.gate import SpeculationGate, expected_tokens
from sluice.spec.proposers import NgramProposer, SuffixProposer, TokenIndex
from sluice.spec.speculator import Speculator

EOS = 0


def make_request(rid: str, prompt: list[int], max_tokens: int = 32, tenant: str = "", **params) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                   eos_token_ids={EOS}, max_tokens=max_tokens, tenant=tenant)


def test_token_index_finds_the_longest_most_recent_match():
    idx = TokenIndex()
    idx.extend([1, 2, 3, 9, 5, 2, 3, 4, 8, 2, 3, 4, 7])
    # "2 3" ends at 2, 6 and 10; "2 3 4" only at 7 and 11 (the latest wins: continuation 7).
    assert idx.match([4, 2, 3, 4]) == (3, 12)
    assert idx.match([9, 9, 2, 3]) == (2, 11)
    assert idx.match([5, 6]) == (0, -1)
    # A match must leave a token after it.
    assert idx.match([4, 7]) == (0, -1)


def test_ngram_drafts_what_followed_the_last_tokens_earlier():
    p = NgramProposer(min_match=2)
    req = make_request("a", [10, 11, 12, 13, 14, 10, 11])
    # A 2-token match drafts 2 tokens (draft_length: as many as matched).
    assert p.propose(req, 3) == [12, 13]
    req.output_token_ids += [12, 13]          # the index follows the request as it grows
    assert p.propose(req, 8) == [14, 10, 11, 12]   # now 4 tokens match
    assert p.propose(make_request("b", [1, 2, 3, 4]), 4) == []   # nothing repeats
    p.request_finished(req)
    assert "a" not in p._indexes


def test_min_match_is_honoured():
    req = make_request("a", [5, 6, 7, 1, 6, 7])
    assert NgramProposer(min_match=2).propose(req, 2) == [1, 6]
    assert NgramProposer(min_match=3).propose(req, 2) == []


def test_suffix_drafts_from_the_tenants_own_outputs_only():
    p = SuffixProposer(min_match=2)
    done = make_request("done", [1, 2, 3], tenant="alice")
    done.output_token_ids = [40, 41, 42, 43, 44, 45]
    p.request_finished(done)
    assert p.tenant_tokens("alice") > 0 and p.tenant_tokens("bob") == 0
    # Alice's next request repeats part of that output: the store drafts its continuation.
    mine = make_request("mine", [7, 8, 40, 41, 42], tenant="alice")
    assert p.propose(mine, 3) == [43, 44, 45]
    # Bob's identical request never sees Alice's text.
    theirs = make_request("theirs", [7, 8, 40, 41, 42], tenant="bob")
    assert p.propose(theirs, 3) == []
    # A draft never runs past the end of a stored output into the next one.
    assert p.propose(make_request("end", [9, 44, 45], tenant="alice"), 3) == []


def test_suffix_store_is_bounded():
    p = SuffixProposer(min_match=2, cache_tokens=100)
    for i in range(40):
        r = make_request(f"r{i}", [1], tenant="t")
        r.output_token_ids = list(range(1000 + 10 * i, 1010 + 10 * i))
        p.request_finished(r)
    assert 0 < p.tenant_tokens("t") <= 100
    # The newest output is kept.
    assert p.propose(make_request("q", [5, 1390, 1391], tenant="t"), 2) == [1392, 1393]


def test_gate_speculates_when_steps_cost_the_same_and_not_when_they_scale():
    flat = SpeculationGate()
    for n in (1, 8, 16):
        for _ in range(3):
            flat.observe_step(n, 0.007)
    assert flat.worth_drafting(1, 4)
    assert flat.choose(1, [(0.5, 4)]) == 1
    linear = SpeculationGate()
    for n in (32, 160):
        for _ in range(3):
            linear.observe_step(n, 0.001 * n)
    assert not linear.worth_drafting(32, 4)
    assert linear.choose(32, [(0.9, 4)] * 32) == 0
    assert SpeculationGate(always=True).choose(32, [(0.0, 4)] * 3) == 3


def test_gate_skips_the_first_step_of_a_size():
    g = SpeculationGate()
    g.observe_step(8, 5.0)        # kernel build
    assert 8 not in g.step_time
    g.observe_step(8, 0.01)
    assert g.step_time[8] == pytest.approx(0.01)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=17), "num_speculative_tokens"),
    (dict(speculative_method="eagle"), "speculative_method"),
    (dict(speculative_gate="sometimes"), "speculative_gate"),
    (dict(speculative_min_match=1), "speculative_min_match"),
    (dict(num_speculative_tokens=8, max_num_batched_tokens=8), "max_num_batched_tokens"),
])
def test_bad_speculative_settings_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(speculative_method="ngram", **kwargs) if "speculative_method" not in kwargs \
            else EngineConfig.from_kwargs(**kwargs)


def test_speculative_must_be_a_bool():
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")


# -- the scheduler's side ------------------------------------------------------

def spec_scheduler(num_blocks=32, block_size=4, budget=64, k=4):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    spec = Speculator(SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=k,
                                        speculative_gate="always"), max_model_len=num_blocks * block_size)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv, num_blocks * block_size, speculator=spec)
    return sched, kv


def run_step(sched, accept: dict[str, int], bonus: int = 99):
    """A fake runner step: each verifying request keeps its first accept[id] drafts."""
    plan = sched.schedule()
    sampled, accepted = {}, {}
    for e in plan.scheduled:
        if not e.needs_logits:
            continue
        a = accept.get(e.request_id, 0) if e.draft_token_ids else 0
        toks = e.draft_token_ids[:a] + [bonus]
        sampled[e.request_id] = SampledToken(toks[0])
        if len(toks) > 1:
            accepted[e.request_id] = [SampledToken(t) for t in toks[1:]]
    return plan, sched.update(plan, StepResult(sampled, accepted=accepted))


def test_drafts_take_kv_slots_and_only_accepted_ones_count_as_computed():
    sched, kv = spec_scheduler()
    prompt = [9, 10, 11, 12, 13, 14, 15, 9, 10, 11]
    req = make_request("a", prompt)
    sched.add_request(req)
    run_step(sched, {})                        # the prompt; first token 99
    req.output_token_ids[-1] = 12              # (as if the model had said 12: "9 10 11 12" repeats)
    plan, update = run_step(sched, {"a": 2})
    e = plan.scheduled[0]
    assert e.token_ids == [12] + e.draft_token_ids and e.draft_token_ids == [13, 14, 15, 9]
    # Room for the drafts was taken: blocks for every drafted position.
    assert len(e.block_ids) == kv.blocks_needed(e.start_pos + len(e.token_ids))
    # Two accepted, then the bonus: three tokens, and everything but the last computed.
    assert req.output_token_ids[-3:] == [13, 14, 99]
    assert update.num_new_tokens == {"a": 3}
    assert req.num_computed_tokens == req.num_tokens - 1
    st = sched.spec.stats
    assert (st.drafted, st.accepted, st.emitted) == (4, 2, 3)
    assert st.accepted_at == [1, 1, 0, 0]


def test_no_block_is_named_by_a_draft():
    sched, kv = spec_scheduler(block_size=4)
    req = make_request("a", [10, 11, 12, 13, 14, 15, 10, 11, 12])
    sched.add_request(req)
    run_step(sched, {})
    req.output_token_ids[-1] = 13
    run_step(sched, {})                        # every draft rejected
    named = kv.req_num_named["a"]
    # Only blocks wholly made of the request's real tokens carry a hash.
    assert named == req.num_computed_tokens // 4 or named * 4 <= req.num_tokens
    hashes = kv._hashes(req, named)
    assert all(kv.req_blocks["a"][0][i].block_hash == hashes[i] for i in range(named))


def test_drafts_take_only_the_budget_prompt_work_leaves():
    """A draft in a step that prompt chunks fill would push a prompt token into a later
    step: drafts get what the prompts (prefilling or admissible) leave of the budget."""
    sched, _ = spec_scheduler(num_blocks=64, budget=16, k=4)
    req = make_request("a", [9, 10, 11, 12, 13, 14, 15, 9, 10, 11])
    sched.add_request(req)
    run_step(sched, {})                        # a's prompt; first token 99
    req.output_token_ids[-1] = 12              # "9 10 11 12" repeats: a has 4 drafts
    sched.add_request(make_request("b", list(range(20, 34))))  # 14 prompt tokens
    plan, _ = run_step(sched, {})
    by_id = {e.request_id: e for e in plan.scheduled}
    # 16 = a's token + b's 14 + one draft (before: four drafts, and b's prompt cut to 11).
    assert by_id["a"].draft_token_ids == [13] and len(by_id["b"].token_ids) == 14
    # More room beside the prompt: all four drafts.
    sched2, _ = spec_scheduler(num_blocks=64, budget=24, k=4)
    req2 = make_request("a", [9, 10, 11, 12, 13, 14, 15, 9, 10, 11])
    sched2.add_request(req2)
    run_step(sched2, {})
    req2.output_token_ids[-1] = 12
    sched2.add_request(make_request("b", list(range(20, 34))))
    plan, _ = run_step(sched2, {})
    by_id = {e.request_id: e for e in plan.scheduled}
    assert by_id["a"].draft_token_ids == [13, 14, 15, 9] and len(by_id["b"].token_ids) == 14


def test_max_tokens_caps_the_drafts():
    sched, _ = spec_scheduler()
    req = make_request("a", [1, 2, 3, 1, 2], max_tokens=3)
    sched.add_request(req)
    run_step(sched, {})
    req.output_token_ids[-1] = 3
    plan, _ = run_step(sched, {"a": 5})
    # Two tokens left to emit: one draft and the token after it.
    assert len(plan.scheduled[0].draft_token_ids) == 1
    assert req.num_output_tokens == 3 and req.status is RequestStatus.FINISHED_LENGTH


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    sched, kv = spec_scheduler()
    req = make_request("a", [3, 8, 4, 5, EOS, 6, 7, 3, 8, 4])
    sched.add_request(req)
    run_step(sched, {})
    req.output_token_ids[-1] = 5                # "3 8 4 5" again: the draft is EOS, 6, 7, 3
    plan, update = run_step(sched, {"a": 3})
    assert plan.scheduled[0].draft_token_ids == [EOS, 6, 7, 3]
    assert req.output_token_ids[-1] == EOS and req.status is RequestStatus.FINISHED_STOPPED
    assert update.finished == [req]
    assert kv.num_free_blocks == kv.num_blocks
    # Only the first kept token was emitted (EOS): nothing after it counts as accepted.
    assert req.output_token_ids[-2:] == [5, EOS] and sched.spec.stats.accepted == 0


def test_opted_out_and_penalised_requests_never_draft():
    sched, _ = spec_scheduler()
    a = make_request("a", [1, 2, 3, 1, 2], speculative=False)
    b = make_request("b", [1, 2, 3, 1, 2], repetition_penalty=1.2)
    for r in (a, b):
        sched.add_request(r)
    run_step(sched, {})
    for r in (a, b):
        r.output_token_ids[-1] = 3
    plan, _ = run_step(sched, {})
    assert all(not e.draft_token_ids for e in plan.scheduled)


def test_aborting_or_preempting_a_verifying_request_leaks_nothing():
    sched, kv = spec_scheduler(num_blocks=8, block_size=4)
    reqs = [make_request(f"r{i}", [1, 2, 3, 4, 1, 2, 3], max_tokens=20) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_step(sched, {})
    for r in reqs:
        r.output_token_ids[-1] = 4
    plan = sched.schedule()
    assert any(e.draft_token_ids for e in plan.scheduled)
    sched.finish_request("r0", RequestStatus.FINISHED_ABORTED)   # while the step "runs"
    sched.update(plan, StepResult({e.request_id: SampledToken(7) for e in plan.scheduled}))
    # Keep going until the pool runs dry and someone is preempted, then finish everyone.
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        run_step(sched, {r.request_id: 4 for r in reqs}, bonus=1)
    assert sched.num_preemptions > 0
    for r in list(sched.requests):
        sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.req_blocks
