"""benchmarks/agents_sim.py: the agent load replayed through the real scheduler in
simulated time (how the `program` policy's door was chosen before it was measured)."""
from __future__ import annotations

import argparse
import copy
import importlib.util
from pathlib import Path

import pytest

SIM_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "agents_sim.py"
# A step-time model of the fitted form: 12 ms a step, 1.1 ms a token, 0.8 ms per 1k
# attention pairs, 1.4 ms a sampled row (this box's fit, rounded).
COEF = [0.012, 0.0011, 0.0008, 0.0014]


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("agents_sim", SIM_PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def args(**kw) -> argparse.Namespace:
    base = dict(tokenizer="smollm2-135m", programs=12, program_rate=2.0, tool_median=1.0, output_len=8,
                kv_gib=0.05, policy="fcfs", sessions=False, starvation_s=30.0, max_pinned_fraction=0.5,
                max_num_batched_tokens=256, seed=0, variant=None, slowdown=1.0, tool_sigma=1.0, tools=0,
                tool_hints=False, short_frac=0.7, tool_len=(60, 120), offload_gib=0.0, offload_dtype="int8",
                offload_save_us=362.0, offload_load_us=274.0, isolated=False)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture(scope="module")
def programs(sim):
    return sim.load(args())


@pytest.mark.parametrize("kw", [dict(), dict(policy="program", sessions=True),
                                dict(policy="program", sessions=True, variant="nodoor"),
                                dict(policy="program", sessions=True, tools=4, tool_hints=True),
                                dict(policy="program", sessions=True, offload_gib=0.05),
                                dict(policy="program", sessions=True, offload_gib=0.05, variant="pindoor")])
def test_every_program_finishes_and_no_block_leaks(sim, programs, kw):
    a = args(**kw)
    if a.tools:
        programs = sim.load(a)
        names = {n for p in programs for n in p["tool_names"]}
        assert names and names <= {f"tool-{k}" for k in range(4)}
        assert all(len(p["tool_names"]) == len(p["gaps"]) for p in programs)
    s = sim.Sim(a, COEF)
    runs = [copy.deepcopy(programs) for _ in range(2)]
    report = s.run(runs[0])
    programs = runs[0]
    assert all(p["jct"] > 0 and len(p["calls"]) == len(p["tools"]) + 1 for p in programs)
    assert report["jct_p99_s"] >= report["jct_p50_s"] > 0
    assert report["output_tok_per_s"] > 0 and 0 <= report["prefix_hit_rate"] <= 1
    # Only pins (sessions) may still hold blocks once every call has ended.
    assert s.kv.num_free_blocks + s.sched.sessions.num_pinned == s.kv.num_blocks
    assert not s.sched.has_unfinished_requests()
    if a.offload_gib:
        assert report["offload_hits"] > 0  # the cache is small enough that histories come back from the tier
    if a.tool_hints:
        assert s.sched.sessions.tool_gaps  # the tools' gaps were learned
    # Same seed, same flags: the same run, to the step.
    again = sim.Sim(a, COEF).run(runs[1])
    assert again == report


def test_each_program_alone_bounds_every_programs_job_time(sim, programs):
    # --isolated: each program on an idle server. No program finishes sooner under a load,
    # so the bound's percentiles are under every policy's (the sweep's headroom column).
    a = args(policy="program", sessions=True)
    alone = sim.alone_jcts(a, COEF, copy.deepcopy(programs))
    loaded = copy.deepcopy(programs)
    sim.Sim(args(), COEF).run(loaded)
    assert len(alone) == len(loaded)
    for x, y in zip(alone, loaded):
        assert 0 < x <= y["jct"] + 1e-9
    bound = sim.isolated(a, COEF, copy.deepcopy(programs))
    assert 0 < bound["jct_p50_s"] <= bound["jct_p99_s"]
