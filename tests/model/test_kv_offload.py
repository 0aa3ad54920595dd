"""KV offloading end to end on the real engine: blocks the pool evicts go to the host tier
(and the disk tier below it), a later hit copies them back instead of recomputing them,
bit-exact in the exact form; corrupt or unwritable disk tiers degrade to recompute."""
from __future__ import annotations

import logging
import os
import random

import pytest
import torch

from sluice import LLM as _LLM
from sluice import SamplingParams
from sluice.metrics import Metrics
from tests.conftest import assert_all_blocks_free

GREEDY = dict(temperature=0, ignore_eos=True)


def LLM(**kwargs):
    """sluice.LLM with the offload index's cost model off: these tests count reloads, and
    whether a reload beats recomputing is the wall clock's call (the cost model has its
    own test on given costs, tests/unit/test_kv_offload_index.py)."""
    llm = _LLM(**kwargs)
    if llm.engine.kv.offload is not None:
        llm.engine.kv.offload.use_costs = False
    return llm


def snapshot(llm) -> dict[bytes, torch.Tensor]:
    """Every cached block's K/V bytes, by its name."""
    runner, pool = llm.engine.runner, llm.engine.kv.pool
    return {key: torch.stack([torch.stack((k[:, b.block_id], v[:, b.block_id])) for k, v in runner.kv_tensors]).clone()
            for key, b in pool.cached.items()}


def history_then_traffic(llm, seed: int = 0, session: str | None = None, prompt_len: int = 120,
                         traffic_len: int = 90):
    """A 120-token prompt, then traffic that cycles every block of a 24-block cache (6 x 6
    blocks), so that the prompt's 7 full blocks are evicted. Returns (prompt, its output,
    the snapshot of the cache right after it). (A 56-token prompt and traffic of 6 x 40
    tokens do the same to a 12-block cache with 3 full blocks.)"""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 400) for _ in range(prompt_len)]
    first = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY), session_id=session)[0]
    if session is not None:
        llm.release_session(session)  # its pins go back to the pool: evictable, so offloadable
    before = snapshot(llm)
    for _ in range(6):
        llm.generate([[rng.randrange(3, 400) for _ in range(traffic_len)]], SamplingParams(max_tokens=4, **GREEDY))
    return prompt, first, before


def reloaded_keys(llm, before) -> list[bytes]:
    return [k for k in before if k in llm.engine.kv.pool.cached]


@pytest.mark.parametrize("dtype,deterministic", [("float32", False), ("bfloat16", True)])
def test_evicted_blocks_come_back_from_the_host_tier_bit_exact(tiny_checkpoint, dtype, deterministic):
    path = str(tiny_checkpoint("llama"))
    llm = LLM(model=path, dtype=dtype, num_blocks=24, kv_offload_memory=0.01, deterministic=deterministic)
    store, index = llm.engine.offload_store, llm.engine.kv.offload
    assert not store.compress  # float32, and deterministic bf16: the exact form
    prompt, first, before = history_then_traffic(llm)
    assert len(before) >= 7 and index.num_blocks("host") >= 7 and not reloaded_keys(llm, before)
    again = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert again.num_cached_tokens == 112 and index.host.stats.hits == 7
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    after = snapshot(llm)
    keys = reloaded_keys(llm, before)
    assert len(keys) >= 7 and all(torch.equal(before[k], after[k]) for k in keys)
    assert_all_blocks_free(llm)

    # The tiers in /metrics.
    metrics = Metrics("m")
    metrics.observe_step(llm.engine, [], 0.01)
    text = metrics.registry and __import__("prometheus_client").generate_latest(metrics.registry).decode()
    assert f'sluice_kv_offload_blocks{{model_name="m",tier="host"}} {float(index.num_blocks("host"))}' in text
    assert 'sluice_kv_offload_blocks_moved_total{event="hit",model_name="m",tier="host"} 7.0' in text

    # Without the tier the same run recomputes everything.
    control = LLM(model=path, dtype=dtype, num_blocks=24, deterministic=deterministic)
    prompt, first_c, _ = history_then_traffic(control)
    assert control.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].num_cached_tokens == 0


def assert_offloaded_as_it_is(small: bool = False, **settings) -> None:
    """A one-byte cache (int8, FP8) goes to the tier as its bytes ('auto' does not compress
    it again, and 'int8' is refused for it): its blocks come back bit-exact. small: half
    the cache and the traffic (3 full blocks of history), for Triton's interpreter, which
    runs a kernel program by program in Python."""
    blocks, full = (12, 3) if small else (24, 7)
    sizes = dict(prompt_len=56, traffic_len=40) if small else {}
    llm = LLM(**settings, num_blocks=blocks, kv_offload_memory=0.01)
    assert not llm.engine.offload_store.compress
    prompt, first, before = history_then_traffic(llm, **sizes)
    assert not reloaded_keys(llm, before)
    again = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert again.num_cached_tokens == 16 * full and again.outputs[0].token_ids == first.outputs[0].token_ids
    after = snapshot(llm)
    keys = reloaded_keys(llm, before)
    assert len(keys) >= full and all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))
                                     for k in keys)
    with pytest.raises(ValueError, match=f"an {settings['kv_cache_dtype']} KV cache is offloaded as it is"):
        LLM(**settings, num_blocks=blocks, kv_offload_memory=0.01, kv_offload_dtype="int8")


def test_an_int8_cache_is_offloaded_as_it_is(tiny_checkpoint, best_kernel_isa):
    assert_offloaded_as_it_is(model=str(tiny_checkpoint("llama")), dtype="bfloat16", kv_cache_dtype="int8",
                              cpu_isa=best_kernel_isa)


def test_a_released_sessions_blocks_are_offloaded_with_caching_off(tiny_checkpoint):
    """With prefix caching off only sessions name blocks: the ones a session lets go are
    the ones the tier keeps, under the session's own salt."""
    path = str(tiny_checkpoint("llama"))
    llm = LLM(model=path, dtype="float32", num_blocks=24, kv_offload_memory=0.01, enable_prefix_caching=False,
              session_ttl_s=3600, session_ttl_max_s=3600)
    prompt, first, before = history_then_traffic(llm, session="agent")
    assert llm.engine.kv.offload.num_blocks("host") == 7
    # Another tenant's call with the same tokens finds nothing: the salt is the tenant's.
    other = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY), session_id="agent", tenant="b")[0]
    assert other.num_cached_tokens == 0
    again = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY), session_id="agent")[0]
    assert again.num_cached_tokens == 112 and again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.release_session("agent")
    llm.release_session("agent", tenant="b")
    assert_all_blocks_free(llm)


def test_int8_offload_keeps_each_row_within_its_rounding(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    llm = LLM(model=path, dtype="float32", num_blocks=24, kv_offload_memory=0.01, kv_offload_dtype="int8")
    store = llm.engine.offload_store
    assert store.compress and store.block_bytes < offload_exact_bytes(llm)
    prompt, first, before = history_then_traffic(llm)
    again = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert again.num_cached_tokens == 112
    after = snapshot(llm)
    for k in reloaded_keys(llm, before):
        x, y = before[k], after[k]
        step = x.abs().amax(-1, keepdim=True) / 127  # one int8 step of the row's scale
        assert ((x - y).abs() <= step / 2 + 1e-6).all()
    assert_all_blocks_free(llm)


def offload_exact_bytes(llm) -> int:
    from sluice.worker.kv_offload_store import offload_block_bytes
    return offload_block_bytes(llm.engine.runner.kv_tensors, False)


def disk_llm(path, tmp_path, **kwargs):
    # Host memory for one block: the rest of the evicted history spills to disk.
    return LLM(model=path, dtype="float32", num_blocks=24, kv_offload_memory=1e-6,
               kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk_size=0.01, **kwargs)


def test_the_disk_tier_takes_what_the_host_tier_lets_go(tiny_checkpoint, tmp_path):
    llm = disk_llm(str(tiny_checkpoint("llama")), tmp_path)
    index = llm.engine.kv.offload
    assert index.host.slots == 1 and index.disk is not None
    prompt, first, before = history_then_traffic(llm)
    assert index.num_blocks("disk") >= 7
    assert os.listdir(tmp_path / "kv") == []  # the file is unlinked once open
    again = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert again.num_cached_tokens == 112 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert index.disk.stats.hits >= 6
    after = snapshot(llm)
    assert all(torch.equal(before[k], after[k]) for k in reloaded_keys(llm, before))
    assert_all_blocks_free(llm)
    llm.engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_corrupt_disk_block_is_detected_and_recomputed(tiny_checkpoint, tmp_path, caplog, overlap):
    """Also under asynchronous scheduling: a step with reloads is collected before the next
    is planned, so the requests that read a bad block are recomputed before they go on."""
    llm = disk_llm(str(tiny_checkpoint("llama")), tmp_path, async_scheduling=overlap)
    assert llm.engine.overlap == overlap
    index, store = llm.engine.kv.offload, llm.engine.offload_store
    prompt, first, _ = history_then_traffic(llm)
    spilled = index.num_blocks("disk")
    assert spilled >= 7
    for slot in range(len(store.crc)):  # every slot's first bytes overwritten behind the store's back
        os.pwrite(store.fd, b"\x5a" * 64, slot * store.block_bytes)
    with caplog.at_level(logging.WARNING):
        again = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert "fails its checksum" in caplog.text
    assert index.disk.stats.failed >= 1
    # Recomputed, not read as K/V: the same tokens as the first call.
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_blocks_free(llm)
    llm.engine.shutdown()


def test_a_full_disk_degrades_to_recompute_with_one_warning(tiny_checkpoint, tmp_path, caplog, monkeypatch):
    llm = disk_llm(str(tiny_checkpoint("llama")), tmp_path)
    import sluice.worker.kv_offload_store as mod

    def no_space(fd, data, offset):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(mod.os, "pwrite", no_space)
    with caplog.at_level(logging.WARNING):
        prompt, first, _ = history_then_traffic(llm)
        again = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert caplog.text.count("the disk tier cannot be written") == 1
    assert llm.engine.kv.offload.disk is None  # off from then on
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_an_unusable_offload_dir_leaves_the_host_tier_working(tiny_checkpoint, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=24, kv_offload_memory=0.01,
                  kv_offload_dir=str(blocker / "kv"))
    assert "the disk tier cannot be written" in caplog.text
    assert llm.engine.kv.offload.disk is None
    prompt, first, _ = history_then_traffic(llm)
    assert llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].num_cached_tokens == 112


def test_offload_settings_are_checked(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="deterministic"):
        LLM(model=path, dtype="float32", num_blocks=24, kv_offload_memory=0.01, kv_offload_dtype="int8",
            deterministic=True)
    with pytest.raises(ValueError, match="kv_offload_memory > 0"):
        LLM(model=path, dtype="float32", num_blocks=24, kv_offload_dir="/tmp/x")
    with pytest.raises(ValueError, match="kv_offload_memory must be >= 0"):
        LLM(model=path, dtype="float32", num_blocks=24, kv_offload_memory=-1)
    with pytest.raises(ValueError, match="kv_offload_dtype"):
        LLM(model=path, dtype="float32", num_blocks=24, kv_offload_memory=0.01, kv_offload_dtype="fp4")


def test_a_crowd_on_a_small_cache_gets_the_same_tokens_with_offloading(tiny_checkpoint):
    """Shared prefixes, preemptions and reloads in one batch: greedy outputs equal a run
    without the tier, more tokens come from the cache, nothing leaks."""
    path = str(tiny_checkpoint("llama"))
    rng = random.Random(3)
    stems = [[rng.randrange(3, 400) for _ in range(48)] for _ in range(4)]
    prompts = [stems[i % 4] + [rng.randrange(3, 400) for _ in range(rng.randrange(4, 20))] for i in range(16)]

    def run(**kwargs):
        llm = LLM(model=path, dtype="float32", num_blocks=20, max_num_batched_tokens=64, **kwargs)
        outs = []
        for wave in (prompts[:8], prompts[8:], prompts[:8]):
            outs += llm.generate(wave, SamplingParams(max_tokens=24, **GREEDY))
        assert_all_blocks_free(llm)
        return llm, outs

    plain, base = run()
    offl, outs = run(kv_offload_memory=0.01)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert offl.engine.kv.offload.host.stats.hits > 0
    assert offl.engine.kv.hit_tokens > plain.engine.kv.hit_tokens
