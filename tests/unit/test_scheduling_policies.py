"""Scheduling policies and sessions, driven by a fake runner (no model): exact admission
orders, victims, block ids, TTL expiry on a fake clock, the cap on pinned blocks."""
from __future__ import annotations

import pytest

from sluice.config import EngineConfig, SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.kv_offload import OffloadIndex
from sluice.core.scheduler import SampledToken, Scheduler, StepResult
from sluice.engine.llm_engine import check_scheduling_fields
from sluice.request import Request, RequestStatus
from sluice.sampling_params import SamplingParams

EOS = 0
TOK = 7
BS = 4


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 256, caching: bool = True,
         clock: Clock | None = None, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, **config)
    return Scheduler(cfg, kv, num_blocks * BS, clock=clock or Clock())


def req(rid: str, prompt: list[int] | int, max_tokens: int = 2, arrival: float = 0.0, **kw) -> Request:
    ids = prompt if isinstance(prompt, list) else [100 + i for i in range(prompt)]
    return Request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens), eos_token_ids={EOS},
                   max_tokens=max_tokens, arrival_time=arrival, **kw)


def step(s: Scheduler):
    plan = s.schedule()
    result = StepResult({e.request_id: SampledToken(TOK) for e in plan.scheduled if e.needs_logits})
    return plan, s.update(plan, result)


def admission_order(s: Scheduler) -> list[str]:
    """Run to the end; the order in which requests were first scheduled."""
    order: list[str] = []
    while s.has_unfinished_requests():
        plan, _ = step(s)
        order += [e.request_id for e in plan.scheduled if e.request_id not in order]
    return order


# -- policies ---------------------------------------------------------------------

def test_fcfs_is_arrival_order():
    s = make(max_num_seqs=1)
    for i, p in enumerate([3, 0, 5]):
        s.add_request(req(f"r{i}", 4, arrival=i, priority=p))
    assert admission_order(s) == ["r0", "r1", "r2"]


def test_priority_lower_first_ties_by_arrival():
    s = make(max_num_seqs=1, policy="priority")
    for rid, p, t in [("a", 5, 0), ("b", 0, 1), ("c", 5, 2), ("d", 1, 3)]:
        s.add_request(req(rid, 4, arrival=t, priority=p))
    assert admission_order(s) == ["b", "d", "a", "c"]


def test_priority_preempts_the_highest_value():
    # 6 blocks of 4: a (priority 0) and b (priority 9) both grow; when the pool runs dry the
    # victim is b, though a was admitted later (fcfs would take a).
    s = make(num_blocks=6, policy="priority")
    s.add_request(req("b", 8, max_tokens=12, arrival=0, priority=9))
    s.add_request(req("a", 8, max_tokens=12, arrival=1, priority=0))
    preempted = []
    while s.has_unfinished_requests():
        plan, _ = step(s)
        preempted += plan.preempted
    assert preempted and set(preempted) == {"b"}


def test_program_orders_by_attained_service_with_starvation_protection():
    clock = Clock()
    # (No pins: a pinned session's call would go first, test_program_admits_warm_calls_first.)
    s = make(max_num_seqs=1, policy="program", clock=clock, starvation_s=30.0, session_ttl_s=0)
    # Session "long" has been served 40 tokens by an earlier call.
    s.add_request(req("long-1", 36, max_tokens=4, arrival=clock.t, session_id="long"))
    admission_order(s)
    assert s.sessions.get(("", "long")).service == 36 + 3  # 36 prompt + 3 decode steps
    clock.t += 1
    s.add_request(req("long-2", 8, arrival=clock.t, session_id="long"))
    s.add_request(req("short-1", 8, arrival=clock.t + 0.5, session_id="short"))
    s.add_request(req("solo", 8, arrival=clock.t + 0.7))   # no session: a program of its own
    # The least-served programs first, though "long-2" came first.
    assert admission_order(s) == ["short-1", "solo", "long-2"]
    # Starvation: a call that has waited starvation_s goes ahead of newer, less-served ones.
    clock.t += 100
    s.add_request(req("long-3", 8, arrival=clock.t - 31, session_id="long"))
    s.add_request(req("short-2", 8, arrival=clock.t, session_id="short"))
    assert admission_order(s) == ["long-3", "short-2"]


def test_program_admits_warm_calls_first():
    clock = Clock()
    s = make(max_num_seqs=1, policy="program", clock=clock)   # first TTL: 30 s
    s.add_request(req("mid-1", [3000 + j for j in range(20)], max_tokens=4, arrival=clock.t, session_id="mid"))
    admission_order(s)
    clock.t += 20
    s.add_request(req("long-1", 36, max_tokens=4, arrival=clock.t, session_id="long"))
    s.add_request(req("x1", [6000 + j for j in range(14)], max_tokens=4, arrival=clock.t, session_id="x"))
    admission_order(s)
    assert [s.sessions.get(("", n)).num_pinned for n in ("long", "mid", "x")] == [9, 5, 4]
    clock.t += 15
    s.schedule()                                       # mid's pin expires, long's has not
    s.add_request(req("new-1", [4000 + j for j in range(8)], arrival=clock.t, session_id="new"))
    s.add_request(req("mid-2", [3000 + j for j in range(24)], arrival=clock.t, session_id="mid"))
    s.add_request(req("long-2", list(range(100, 136)) + [TOK] * 4 + [1, 2], arrival=clock.t + 1, session_id="long"))
    # x holds a pin, but its call does not re-send that history: cold.
    s.add_request(req("x2", [6100 + j for j in range(8)], arrival=clock.t, session_id="x"))
    # The warm call first though its program is the most served; then PLAS among the cold
    # (served so far: new 0, x 17, mid 23).
    assert admission_order(s) == ["long-2", "new-1", "x2", "mid-2"]
    assert s.sessions.stats.hits == 2 and s.sessions.stats.expired == 1   # (x2's admission took x's pin too)


def test_program_holds_new_programs_at_the_door_while_live_ones_fill_the_pin_budget():
    clock = Clock()
    # 16 blocks of 4; the pin budget (max_pinned_fraction 0.5) is 8 blocks.
    s = make(num_blocks=16, policy="program", clock=clock)
    s.add_request(req("a-1", [1000 + j for j in range(20)], max_tokens=8, arrival=clock.t, session_id="a"))
    step(s)                                            # a-1 holds 6 blocks
    s.add_request(req("b-1", [2000 + j for j in range(16)], max_tokens=2, arrival=clock.t, session_id="b"))
    s.add_request(req("solo", [3000 + j for j in range(4)], max_tokens=2, arrival=clock.t + 1))
    ran: list[str] = []
    while "a-1" in s.requests:
        plan, _ = step(s)
        ran += [e.request_id for e in plan.scheduled]
    # b (a new program, 4 blocks) waited: 6 live blocks + 4 > 8. A call without a session
    # passes the door.
    assert "solo" in ran and "b-1" not in ran
    assert s.sessions.stats.held_at_door == 1
    assert s.sessions.get(("", "a")).num_pinned == 6   # a-1's 27 computed tokens
    # a's next call is inside already; it is admitted (warm) while b still waits.
    s.add_request(req("a-2", [1000 + j for j in range(20)] + [TOK] * 8 + [5, 6], max_tokens=2,
                      arrival=clock.t + 2, session_id="a"))
    plan, _ = step(s)
    assert [e.request_id for e in plan.scheduled] == ["a-2"]
    admission_order(s)                                 # a-2 ends and pins 7 blocks; b-1 runs alone
    assert "b-1" not in s.requests and s.sessions.stats.held_at_door == 1
    # With nothing running the door is open whatever is pinned (work-conserving).
    s.add_request(req("c-1", [4000 + j for j in range(16)], max_tokens=2, arrival=clock.t + 3, session_id="c"))
    assert admission_order(s) == ["c-1"]


def test_auto_is_fcfs_without_sessions_and_program_while_session_calls_are_in():
    clock = Clock()
    s = make(max_num_seqs=1, clock=clock, session_ttl_s=0)
    assert s.config.policy == "auto" and s.policy == "fcfs"
    # A queued session call switches it to program, its end back to fcfs.
    s.add_request(req("long-1", 36, max_tokens=4, arrival=clock.t, session_id="long"))
    assert s.policy == "program"
    admission_order(s)
    assert s.policy == "fcfs" and s.num_session_calls == 0
    # test_program_orders_by_attained_service...'s queue: session calls are in, so PLAS
    # orders it (fcfs would admit long-2 first).
    s.add_request(req("long-2", 8, arrival=clock.t + 1, session_id="long"))
    s.add_request(req("short-1", 8, arrival=clock.t + 1.5, session_id="short"))
    s.add_request(req("solo", 8, arrival=clock.t + 1.7))
    assert admission_order(s) == ["short-1", "solo", "long-2"]
    assert s.policy == "fcfs" and s.num_session_calls == 0
    # Sessionless requests alone: arrival order again, whatever they have been served.
    for rid in ("x", "y", "z"):
        s.add_request(req(rid, 4, arrival=clock.t + 2))
    assert admission_order(s) == ["x", "y", "z"]
    # An aborted session call counts out too (the switch never sticks on program).
    s.add_request(req("gone", 8, arrival=clock.t + 3, session_id="short"))
    assert s.policy == "program"
    s.finish_request("gone", RequestStatus.FINISHED_ABORTED)
    assert s.policy == "fcfs" and s.num_session_calls == 0


def test_auto_holds_a_new_program_at_the_door_but_not_a_sessionless_request():
    clock = Clock()
    s = make(num_blocks=16, clock=clock)               # the default policy: auto
    s.add_request(req("a-1", [1000 + j for j in range(20)], max_tokens=8, arrival=clock.t, session_id="a"))
    step(s)
    s.add_request(req("b-1", [2000 + j for j in range(16)], max_tokens=2, arrival=clock.t, session_id="b"))
    s.add_request(req("solo", [3000 + j for j in range(4)], max_tokens=2, arrival=clock.t + 1))
    plan, _ = step(s)
    assert [e.request_id for e in plan.scheduled] == ["a-1", "solo"]
    assert s.sessions.stats.held_at_door == 1


@pytest.mark.parametrize("pins", [True, False])
def test_the_door_bounds_a_new_programs_wait_and_is_off_without_pins(pins):
    clock = Clock()
    s = make(num_blocks=16, policy="program", clock=clock, session_ttl_max_s=100.0,
             **({} if pins else {"session_ttl_s": 0.0}))
    s.add_request(req("a-1", [1000 + j for j in range(20)], max_tokens=30, arrival=clock.t, session_id="a"))
    step(s)
    s.add_request(req("b-1", [2000 + j for j in range(16)], max_tokens=2, arrival=clock.t, session_id="b"))
    plan, _ = step(s)
    assert [e.request_id for e in plan.scheduled] == (["a-1"] if pins else ["a-1", "b-1"])
    if pins:
        clock.t += 100          # b has waited session_ttl_max_s: it passes, though a-1 still runs
        plan, _ = step(s)
        assert [e.request_id for e in plan.scheduled] == ["a-1", "b-1"]
    assert s.sessions.stats.held_at_door == (1 if pins else 0)


@pytest.mark.parametrize("tier", [False, True])
def test_with_a_kv_tier_program_orders_cold_calls_by_arrival_not_service(tier):
    clock = Clock()
    kv = KVCacheManager(64, BS, enable_caching=True, offload=OffloadIndex(64, block_size=BS) if tier else None)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, policy="program", session_ttl_s=0),
                  kv, 256, clock=clock)
    s.add_request(req("long-1", 36, max_tokens=4, arrival=clock.t, session_id="long"))
    admission_order(s)
    clock.t += 1
    s.add_request(req("long-2", 8, arrival=clock.t, session_id="long"))
    s.add_request(req("short-1", 8, arrival=clock.t + 0.5, session_id="short"))
    s.add_request(req("solo", 8, arrival=clock.t + 0.7))
    # Without a tier PLAS: the least-served programs first. With one: arrival order.
    assert admission_order(s) == (["long-2", "short-1", "solo"] if tier else ["short-1", "solo", "long-2"])


@pytest.mark.parametrize("tier", [False, True])
def test_with_a_kv_tier_the_door_counts_running_calls_not_pins(tier):
    # 32 blocks of 4: the pin budget is 16 blocks; with a tier the door's is half of it, 8
    # blocks of running calls (a pin pushed out goes to the tier and comes back as a copy).
    clock = Clock()
    kv = KVCacheManager(32, BS, enable_caching=True, offload=OffloadIndex(64, block_size=BS) if tier else None)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, policy="program"), kv, 128, clock=clock)
    s.add_request(req("a-1", [1000 + j for j in range(20)], max_tokens=2, arrival=clock.t, session_id="a"))
    s.add_request(req("d-1", [2000 + j for j in range(24)], max_tokens=2, arrival=clock.t, session_id="d"))
    admission_order(s)
    assert s.sessions.num_pinned == 11
    held = s.sessions.stats.held_at_door
    s.add_request(req("c", [3000 + j for j in range(16)], max_tokens=12, arrival=clock.t))
    step(s)                                             # c (no session) holds 4 blocks
    s.add_request(req("b-1", [4000 + j for j in range(12)], max_tokens=2, arrival=clock.t, session_id="b"))
    plan, _ = step(s)
    # Without a tier, 11 pinned + 4 running + b's 3 > 16: b waits for c. With one, the pins
    # do not count: 4 + 3 <= 8.
    assert [e.request_id for e in plan.scheduled] == (["c", "b-1"] if tier else ["c"])
    assert s.sessions.stats.held_at_door == held + (0 if tier else 1)
    admission_order(s)
    if tier:
        # Running calls still shut it: 6 blocks running + e's 3 > 8.
        s.add_request(req("c2", [5000 + j for j in range(24)], max_tokens=12, arrival=clock.t))
        step(s)
        s.add_request(req("e-1", [6000 + j for j in range(12)], max_tokens=2, arrival=clock.t, session_id="e"))
        plan, _ = step(s)
        assert [e.request_id for e in plan.scheduled] == ["c2"]
        assert s.sessions.stats.held_at_door == held + 1
        assert admission_order(s)[-1] == "e-1"


def test_fair_interleaves_tenants_by_counter():
    # Each request costs 4 prompt tokens + 2 outputs x 2 = 8. Tenant A floods first; B
    # arrives after and is lifted to A's counter (0, nothing served yet); then the lower
    # counter goes next, ties by tenant name.
    s = make(max_num_seqs=1, policy="fair")
    for i in range(5):
        s.add_request(req(f"A{i}", 4, arrival=i, tenant="A"))
    for i in range(2):
        s.add_request(req(f"B{i}", 4, arrival=10 + i, tenant="B"))
    assert admission_order(s) == ["A0", "B0", "A1", "B1", "A2", "A3", "A4"]
    assert s.tenants.counter("A") == s.tenants.counter("B") * 5 / 2 == 40


def test_fair_weights_and_counter_lift():
    s = make(max_num_seqs=1, policy="fair", tenant_weights={"A": 2.0})
    for i in range(4):
        s.add_request(req(f"A{i}", 4, arrival=i, tenant="A"))
        s.add_request(req(f"B{i}", 4, arrival=i + 0.5, tenant="B"))
    # Weight 2: each A request adds 4 to A's counter, each B request 8.
    assert admission_order(s)[:6] == ["A0", "B0", "A1", "A2", "B1", "A3"]
    # An idle tenant arriving late starts at the backlogged tenants' lowest counter, not 0.
    for i in range(3):
        s.add_request(req(f"B{10 + i}", 4, arrival=100 + i, tenant="B"))
    step(s)
    s.add_request(req("C0", 4, arrival=200, tenant="C"))
    assert s.tenants.counter("C") == s.tenants.counter("B") > 0


def test_unknown_policy_and_bad_fields_are_refused():
    with pytest.raises(ValueError, match="policy must be one of"):
        EngineConfig.from_kwargs(policy="lottery")
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        EngineConfig.from_kwargs(max_pinned_fraction=1.5)
    with pytest.raises(ValueError, match="tenant_weights"):
        EngineConfig.from_kwargs(tenant_weights={"a": 0})
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="priority"):
            check_scheduling_fields(None, None, bad)
    with pytest.raises(ValueError, match="session_id must be at most 256"):
        check_scheduling_fields("x" * 257, None, 0)
    with pytest.raises(ValueError, match="session_id"):
        check_scheduling_fields("", None, 0)
    check_scheduling_fields("x" * 256, "t", 0)
    from sluice.config import parse_name_weights
    assert parse_name_weights(["a=2", "b=0.5"], "--tenant-weight") == {"a": 2.0, "b": 0.5}
    for bad in ("a", "=2", "a=0", "a=x"):
        with pytest.raises(ValueError, match="--tenant-weight takes NAME=WEIGHT"):
            parse_name_weights([bad], "--tenant-weight")


# -- sessions -----------------------------------------------------------------------

def flood(s: Scheduler, n: int, prefix: str = "other", tenant: str = "") -> None:
    """Unrelated traffic that takes every free block once (evicting LRU cached ones)."""
    for i in range(n):
        s.add_request(req(f"{prefix}{i}", [5000 + 100 * i + j for j in range(15)], max_tokens=1, tenant=tenant))
    admission_order(s)


@pytest.mark.parametrize("caching", [True, False])
def test_session_blocks_survive_other_traffic_and_are_reused(caching):
    s = make(num_blocks=16, caching=caching)
    history = list(range(200, 214))  # 14 tokens; + 2 outputs = 16, computed 15: 3 full blocks
    s.add_request(req("call-1", history, session_id="agent"))
    admission_order(s)
    sess = s.sessions.get(("", "agent"))
    pinned = [b.block_id for b in sess.blocks]
    assert len(pinned) == 3 and s.sessions.num_pinned == 3
    assert all(s.kv.pool.blocks[i].ref_cnt == 1 for i in pinned)
    assert not set(pinned) & set(s.kv.pool.free_queue.ids())
    flood(s, 4)  # 4 x 4 blocks: more than the 13 the pins leave free
    # The next call re-sends the history with the reply and a tool result.
    nxt = history + [TOK, TOK] + list(range(300, 306))
    r2 = req("call-2", nxt, session_id="agent")
    s.add_request(r2)
    plan, _ = step(s)
    assert r2.num_cached_tokens == 12 and s.kv.block_ids("call-2")[:3] == pinned
    assert plan.scheduled[0].start_pos == 12
    assert s.sessions.num_pinned == 0 and s.sessions.stats.hits == 1  # the call holds them now
    admission_order(s)
    assert s.sessions.num_pinned == 5  # (14 + 2 + 6 + 2 - 1) // 4 full computed blocks


def test_without_a_session_the_same_traffic_evicts_the_history():
    s = make(num_blocks=16)
    history = list(range(200, 214))
    s.add_request(req("call-1", history))
    admission_order(s)
    flood(s, 4)
    r2 = req("call-2", history + [TOK, TOK] + list(range(300, 306)))
    s.add_request(r2)
    step(s)
    assert r2.num_cached_tokens == 0


def test_ttl_expiry_and_adaptive_ttl_on_a_fake_clock():
    clock = Clock()
    s = make(num_blocks=32, clock=clock, session_ttl_s=10.0, session_ttl_max_s=60.0)
    s.add_request(req("c1", 14, session_id="a"))
    admission_order(s)
    sess = s.sessions.get(("", "a"))
    assert sess.expires_at == clock.t + 10.0 and s.sessions.num_pinned == 3
    free_before = s.kv.num_free_blocks
    clock.t += 9.9
    s.schedule()
    assert s.sessions.num_pinned == 3
    clock.t += 0.2
    s.schedule()
    assert s.sessions.num_pinned == 0 and s.sessions.stats.expired == 1
    assert s.kv.num_free_blocks == free_before + 3
    # The gap the session showed (10.1 s) sets its next TTL: 1.5 x the longest recent gap.
    s.add_request(req("c2", 14, session_id="a"))
    admission_order(s)
    assert sess.gaps[-1] == pytest.approx(10.1)
    assert sess.expires_at == pytest.approx(clock.t + 15.15)
    # A session whose tool calls outlast the longest TTL gets no pin at all.
    clock.t += 70
    s.add_request(req("c3", 14, session_id="a"))
    admission_order(s)
    assert s.sessions.ttl(sess) == 0 and s.sessions.num_pinned == 0


def call(s: Scheduler, clock: Clock, rid: str, session: str, tools: list[str] | None = None, after: float = 0.0,
         tenant: str = "") -> Request:
    """A session's call arriving `after` seconds from now, run to its end; the server then
    says which tools it called."""
    clock.t += after
    r = req(rid, 14, session_id=session, tenant=tenant)
    s.add_request(r)
    admission_order(s)
    if tools:
        assert s.session_tool_called(tenant, session, tools)
    return r


def test_tool_aware_ttls_follow_each_tools_gaps_across_sessions():
    # Continuum's tool-aware TTL: "search" takes ~20 s, "calc" ~1 s, whichever session
    # calls them. Once seen, a call ending in a tool gets 1.5 x that tool's longest recent
    # gap; another session's first call ending in it gets the same.
    clock = Clock()
    s = make(num_blocks=64, clock=clock, session_ttl_s=5.0, session_ttl_max_s=60.0)
    call(s, clock, "a1", "a", ["search"])
    a = s.sessions.get(("", "a"))
    assert a.expires_at == pytest.approx(clock.t + 5.0)  # nothing seen yet: the default
    call(s, clock, "a2", "a", ["calc"], after=20.0)      # the search took 20 s (pin expired)
    assert a.expires_at == pytest.approx(clock.t + 30.0)  # the session's own gap: 1.5 x 20
    call(s, clock, "a3", "a", ["search"], after=1.0)     # calc: 1 s
    assert a.expires_at == pytest.approx(clock.t + 30.0)  # search: 1.5 x 20 (not the session's 1 s)
    # A new session, first call ending in calc: the tool's TTL (1.5 x 1 s), not the default.
    call(s, clock, "b1", "b", ["calc"])
    b = s.sessions.get(("", "b"))
    assert b.expires_at == pytest.approx(clock.t + 1.5)
    # Pins are pushed out (cap, room) in the order of the session's own TTLs, not the
    # tools': else the pin whose tool returns soonest went first, just before its call.
    assert b.release_order == pytest.approx(clock.t + 5.0)
    assert s.sessions.num_pinned > 0
    # Parallel calls wait for the slowest tool; a tool never seen falls back to the session.
    call(s, clock, "b2", "b", ["calc", "search"], after=1.0)
    assert b.expires_at == pytest.approx(clock.t + 30.0)
    call(s, clock, "b3", "b", ["new-tool"], after=1.0)
    assert b.expires_at == pytest.approx(clock.t + 1.5)   # b's own longest gap: 1 s
    # Another tenant's tools are its own: its "search" has no history.
    call(s, clock, "c1", "c", ["search"], tenant="t2")
    c = s.sessions.get(("t2", "c"))
    assert c.expires_at == pytest.approx(clock.t + 5.0)
    # A tool slower than the longest TTL: no pin (recomputing is cheaper than holding it).
    call(s, clock, "d1", "d", ["batch-job"])
    call(s, clock, "d2", "d", after=90.0)
    call(s, clock, "e1", "e", ["batch-job"])
    e = s.sessions.get(("", "e"))
    assert e.num_pinned == 0 and s.sessions.ttl(e) == 0
    assert not s.session_tool_called("", "nobody", ["search"])


def test_pinned_blocks_are_capped_soonest_to_expire_released_first():
    clock = Clock()
    s = make(num_blocks=32, clock=clock, max_pinned_fraction=0.25)  # at most 8 blocks
    for i, name in enumerate("abc"):
        s.add_request(req(f"{name}1", [1000 * (i + 1) + j for j in range(14)], session_id=name))
        admission_order(s)
        clock.t += 1
    # Three pins of 3 blocks: a's (the soonest to expire) went to keep 6 <= 8.
    assert [s.sessions.get(("", n)).num_pinned for n in "abc"] == [0, 3, 3]
    assert s.sessions.num_pinned == 6 and s.sessions.stats.evicted_for_cap == 1
    # A call bigger than the cap pins nothing.
    s.add_request(req("big", list(range(5000, 5040)), session_id="big"))
    admission_order(s)
    assert s.sessions.get(("", "big")).num_pinned == 0


def test_running_requests_take_pinned_blocks_before_anyone_is_preempted():
    s = make(num_blocks=12)
    s.add_request(req("c1", 14, session_id="a"))
    admission_order(s)
    assert s.sessions.num_pinned == 3
    # Two requests that grow to 5 blocks each: together they need 10 of the 9 free.
    s.add_request(req("x", [7000 + j for j in range(10)], max_tokens=10))
    s.add_request(req("y", [8000 + j for j in range(10)], max_tokens=10))
    admission_order(s)
    assert s.num_preemptions == 0 and s.sessions.num_pinned == 0
    assert s.sessions.stats.evicted_for_room == 1


def test_sessions_are_namespaced_by_tenant_and_released_by_delete():
    s = make(num_blocks=32)
    s.add_request(req("a1", 14, session_id="s", tenant="A"))
    admission_order(s)
    s.add_request(req("b1", [9000 + j for j in range(14)], session_id="s", tenant="B"))
    admission_order(s)
    a, b = s.sessions.get(("A", "s")), s.sessions.get(("B", "s"))
    assert a is not b and a.num_pinned == b.num_pinned == 3
    assert s.release_session("C", "s") is None
    assert s.release_session("B", "s") == 3
    assert s.sessions.get(("B", "s")) is None and a.num_pinned == 3
    assert s.sessions.num_pinned == 3


def test_an_aborted_call_pins_nothing_and_leaks_no_block():
    s = make(num_blocks=16)
    r = req("c1", 14, max_tokens=8, session_id="a")
    s.add_request(r)
    step(s)
    s.finish_request("c1", RequestStatus.FINISHED_ABORTED)
    assert s.sessions.num_pinned == 0 and s.kv.num_free_blocks == 16


def test_session_table_is_bounded():
    s = make(num_blocks=64, max_sessions=3)
    for i in range(5):
        s.add_request(req(f"c{i}", [100 * (i + 1) + j for j in range(6)], session_id=f"s{i}"))
        admission_order(s)
    assert list(k[1] for k in s.sessions.sessions) == ["s2", "s3", "s4"]
    assert s.sessions.stats.dropped_sessions == 2
    assert s.sessions.num_pinned == sum(x.num_pinned for x in s.sessions.sessions.values())


# -- latency target -------------------------------------------------------------------

def test_step_time_model_fits_and_sizes_the_budget():
    from sluice.core.latency_target import StepTimeModel
    m = StepTimeModel(target_s=0.050)
    assert m.budget(256) == 256  # nothing measured yet: the configured budget
    for n in [32, 256, 64, 128, 33, 200, 40, 100, 32, 256] * 3:
        m.observe(n, 0.010 + 0.0005 * n, had_decodes=True)
    a, b = m.fit()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.0005)
    assert m.budget(256) == 80 and m.budget(64) == 64
    assert m.misses == sum(0.010 + 0.0005 * n > 0.050 for n in [256, 128, 200, 100, 256]) * 3


def test_a_target_shrinks_prompt_chunks_and_stops_admissions_that_would_break_it():
    s = make(num_blocks=256, budget=64, target_tpot_ms=20.0)
    # A machine where a step costs 2 ms + 0.5 ms per token: the target leaves 36 tokens.
    def timed_step():
        plan = s.schedule()
        s.observe_step(plan, 0.002 + 0.0005 * plan.num_batched_tokens)
        s.update(plan, StepResult({e.request_id: SampledToken(TOK) for e in plan.scheduled if e.needs_logits}))
        return plan
    for i in range(12):
        s.add_request(req(f"r{i}", 40, max_tokens=30, arrival=i))
    plans = [timed_step() for _ in range(40)]
    assert plans[0].num_batched_tokens == 64  # before the fit: the fixed budget
    later = plans[10:]
    assert all(p.num_batched_tokens <= 36 for p in later)
    # Decodes alone: 2 + 0.5 * (running + 1) <= 20 ms admits at most 35 running; here the
    # budget binds first, and every running request still decodes each step.
    assert max(len(p.scheduled) for p in later) <= 36
    assert s.step_model.decode_steps > 0


def test_a_pin_outlives_its_ttl_while_its_sessions_next_call_waits():
    clock = Clock()
    s = make(num_blocks=32, clock=clock, max_num_seqs=1, session_ttl_s=10.0)
    s.add_request(req("c1", 14, session_id="a"))
    admission_order(s)
    s.add_request(req("busy", 8, max_tokens=20))
    step(s)                                   # "busy" holds the only seat
    s.add_request(req("c2", list(range(100, 114)) + [TOK, TOK, 1, 2], session_id="a"))
    clock.t += 60                             # far past the TTL, with c2 queued
    step(s)
    assert s.sessions.num_pinned == 3 and s.sessions.stats.expired == 0
    order = admission_order(s)
    assert order[-1] == "c2" and s.requests == {} and s.sessions.stats.hits == 1


def test_while_pins_are_held_admissions_leave_a_block_per_running_request():
    s = make(num_blocks=16)
    s.add_request(req("c1", 14, session_id="a"))
    admission_order(s)                        # 3 blocks pinned, 13 free
    for i in range(4):
        s.add_request(req(f"x{i}", [6000 + 100 * i + j for j in range(11)], max_tokens=2))
    plan, _ = step(s)
    # Each takes 3 blocks; after three (9 taken, 4 free) a fourth would leave 1 < 3 running.
    assert [e.request_id for e in plan.scheduled] == ["x0", "x1", "x2"]
    assert s.sessions.num_pinned == 3


@pytest.mark.parametrize("policy", ["fcfs", "program"])
def test_with_nothing_running_pins_give_way_to_a_call_that_needs_their_room(policy):
    """A call bigger than the free pool, while pins hold the rest and nothing runs that
    could finish and make room: the pins go now (they waited out their TTL before, and
    the queue with them: minutes)."""
    s = make(num_blocks=16, budget=64, policy=policy, session_ttl_s=3600, session_ttl_max_s=3600)
    s.add_request(req("c1", 30, session_id="a"))
    admission_order(s)                        # 7 blocks pinned, 9 free
    assert s.sessions.num_pinned == 7
    s.add_request(req("big", [5000 + j for j in range(50)], max_tokens=2, session_id="b"))  # 13 blocks
    plan, _ = step(s)
    assert [e.request_id for e in plan.scheduled] == ["big"]
    assert s.sessions.num_pinned == 0 and any("nothing running" in d for d in s.last_decisions)


def test_a_tenant_flooding_sessions_pushes_out_its_own_pins_not_anothers():
    s = make(num_blocks=64, max_pinned_fraction=0.25, max_sessions=4)  # pins: at most 16 blocks
    s.add_request(req("a1", [9000 + j for j in range(14)], session_id="quiet", tenant="A"))
    admission_order(s)
    for i in range(8):  # tenant B: eight sessions of 3 pinned blocks each
        s.add_request(req(f"b{i}", [1000 * (i + 1) + j for j in range(14)], session_id=f"s{i}", tenant="B"))
        admission_order(s)
    assert s.sessions.get(("A", "quiet")).num_pinned == 3
    assert s.sessions.num_pinned <= 16 and len(s.sessions.sessions) == 4
    assert sum(k[0] == "B" for k in s.sessions.sessions) == 3


# -- stalls -----------------------------------------------------------------------

def stream_gaps(s: Scheduler, clock: Clock, dt: float = 0.1) -> tuple[float, dict[str, list[str]]]:
    """Run to the end, dt of fake clock a step: the longest gap between two tokens of a
    stream, and each request's history of 'preempted' / 'token' events."""
    last: dict[str, float] = {}
    events: dict[str, list[str]] = {}
    worst = 0.0
    while s.has_unfinished_requests():
        clock.t += dt
        plan, upd = step(s)
        for rid in plan.preempted:
            events.setdefault(rid, []).append("preempted")
        for r in upd.with_new_token:
            events.setdefault(r.request_id, []).append("token")
            if r.request_id in last:
                worst = max(worst, clock.t - last[r.request_id])
            last[r.request_id] = clock.t
    return worst, events


def streams(s: Scheduler, n: int = 12, max_tokens: int = 40) -> list[Request]:
    rs = [req(f"r{i}", 4 + i, max_tokens=max_tokens, arrival=i * 0.01) for i in range(n)]
    for r in rs:
        s.add_request(r)
    return rs


@pytest.mark.parametrize("policy", ["fcfs", "priority", "program", "fair"])
def test_max_stream_stall_bounds_the_gap_between_a_streams_tokens(policy):
    # 12 streams of up to 55 tokens in 64 slots: a few fit at once, the rest are preempted
    # over and over. Unbounded, a stream waited 13-16 s between two tokens (the test's
    # fake clock, 0.1 s a step); with a 2 s bound, never more than the bound and two steps.
    clock = Clock(0.0)
    s = make(num_blocks=16, budget=64, clock=clock, policy=policy, session_ttl_s=0)
    streams(s)
    unbounded, _ = stream_gaps(s, clock)
    assert unbounded > 10.0

    clock = Clock(0.0)
    s = make(num_blocks=16, budget=64, clock=clock, policy=policy, session_ttl_s=0, max_stream_stall_s=2.0)
    rs = streams(s)
    worst, events = stream_gaps(s, clock)
    assert worst <= 2.0 + 0.2 + 1e-9
    assert s.num_stall_resumptions > 0
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 40 for r in rs)
    assert s.kv.num_free_blocks == 16 and not s.running and not s.waiting
    # Rotation makes progress: between two preemptions, a request samples a token.
    for history in events.values():
        assert "preempted,preempted" not in ",".join(history)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "program", "fair"])
def test_siblings_of_one_stream_share_its_stall_bound(policy):
    # n = 2: the client reads the two children as one stream. A child still queued when
    # its sibling has finished (or was preempted) is that stream's gap: unbounded 4-5 s
    # here; with the bound, the child is resumed like a preempted one.
    def run(bound):
        clock = Clock(0.0)
        s = make(num_blocks=16, budget=64, clock=clock, policy=policy, session_ttl_s=0, max_stream_stall_s=bound)
        for g in range(6):
            pair = [req(f"g{g}#{i}", 4 + g, max_tokens=40 - 15 * i, arrival=g * 0.01) for i in range(2)]
            for r in pair:
                r.siblings, r.share_key = pair, f"g{g}"
                s.add_request(r)
        last: dict[str, float] = {}
        worst = 0.0
        while s.has_unfinished_requests():
            clock.t += 0.1
            _, upd = step(s)
            for r in upd.with_new_token:
                if r.share_key in last:
                    worst = max(worst, clock.t - last[r.share_key])
                last[r.share_key] = clock.t
        assert s.kv.num_free_blocks == 16
        return worst
    assert run(None) > 3.5
    assert run(2.0) <= 2.0 + 0.1 + 1e-9


def test_a_resumed_request_is_not_preempted_again_before_it_samples():
    # fcfs preempts the latest admitted: without the rule, that was often the request just
    # resumed, still recomputing its context in chunks (6 times in this run), its work
    # thrown away again; now a request preempted twice has sampled in between.
    clock = Clock(0.0)
    s = make(num_blocks=16, budget=32, clock=clock)
    rs = streams(s)
    _, events = stream_gaps(s, clock)
    assert s.num_preemptions > 0
    assert all(r.num_output_tokens == 40 for r in rs)
    for history in events.values():
        assert "preempted,preempted" not in ",".join(history)


def test_max_stream_stall_must_be_positive():
    with pytest.raises(ValueError, match="max_stream_stall_s"):
        EngineConfig.from_kwargs(model="x", max_stream_stall_s=0).validate()
