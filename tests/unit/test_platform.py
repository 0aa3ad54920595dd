"""The machine's features and the modes they allow: a mode the CPU cannot run is refused
in one line before anything loads, on whichever kind of machine the suite runs (the other
kind's CPU is described here by hand), and kernel builds survive a killed build."""
from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import torch

from sluice.backends import platform
from sluice.backends.platform import CpuInfo

ZEN3 = CpuInfo("AMD EPYC 7B13 64-Core Processor", "avx2", frozenset({"avx2", "fma", "f16c"}), False)
ZEN4 = CpuInfo("AMD EPYC 9B14 96-Core Processor", "avx512",
               frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                          "avx512_vnni"}), True)


@pytest.fixture
def as_cpu(monkeypatch):
    def use(info: CpuInfo):
        monkeypatch.setattr(platform, "cpu", lambda: info)
    return use


def test_this_machine_is_read_within_torchs_own_isa():
    info = platform.cpu()
    cap = torch.backends.cpu.get_cpu_capability()
    assert info.isa == {"AVX512": "avx512", "AVX2": "avx2"}.get(cap, "generic")
    if info.isa != "avx512":
        assert not any(f.startswith("avx512") for f in info.flags)
        assert "-mno-avx512f" in info.kernel_build_flags()
    assert info.describe()


@pytest.mark.parametrize("mode, kwargs, missing, instead", [
    ("deterministic mode", dict(deterministic=True), "AVX-512 BF16", "the default (non-deterministic) mode"),
    ("quantization='w8a8'", dict(quantization="w8a8"), "AVX-512 BF16 and AVX-512 VNNI", "quantization='int8'"),
    ("kv_cache_dtype='int8'", dict(kv_cache_dtype="int8"), "AVX-512 BF16 and AVX-512 VNNI",
     "kv_cache_dtype='auto'"),
])
def test_avx2_cpu_refuses_avx512_modes_in_one_line_before_loading(as_cpu, monkeypatch, mode, kwargs, missing,
                                                                   instead):
    from sluice.engine import llm_engine
    from sluice.worker import kernels

    def must_not_run(*_):
        raise AssertionError("the refusal came after loading began")
    monkeypatch.setattr(llm_engine, "resolve_model", must_not_run)
    monkeypatch.setattr(kernels, "load", must_not_run)
    as_cpu(ZEN3)
    with pytest.raises(ValueError) as e:
        llm_engine.LLMEngine.from_kwargs(dtype="bfloat16", **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    assert msg.startswith(f"{mode} needs a CPU with {missing}, which AMD EPYC 7B13")
    assert f"what works here: {instead}" in msg


def test_avx512_cpu_accepts_those_modes(as_cpu):
    as_cpu(ZEN4)
    platform.check_modes("cpu", "w8a8", "int8", True)
    as_cpu(ZEN3)
    platform.check_modes("cuda", "w8a8", "int8", True)  # not a CPU question
    platform.check_modes("cpu", "int8", "auto", False)  # int8 weights run on torch's kernels


def test_dtype_auto_and_prepacking_follow_the_cpu(as_cpu):
    from sluice.config import resolve_dtype
    from sluice.models.linear import can_prepack
    as_cpu(ZEN3)
    assert resolve_dtype("auto", "cpu") == torch.float32
    # oneDNN cannot prepack bf16 weights without AVX-512 BW/VL/DQ (its error, raised at start,
    # was the whole message a user saw): such layers keep F.linear.
    assert not can_prepack(torch.device("cpu"), torch.bfloat16)
    as_cpu(ZEN4)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16


def test_kernel_flags_stay_within_the_isa():
    assert ZEN3.kernel_build_flags() == ["-march=native", "-mno-avx512f"]
    assert ZEN4.kernel_build_flags() == ["-march=native"]


def test_stale_build_lock_is_broken_with_a_log_line(tmp_path, caplog):
    """A build killed midway leaves torch's lock file; the next load removes it (holding
    our flock, no live build can own it) instead of waiting forever."""
    from sluice.worker.kernels import _build_lock
    (tmp_path / "lock").write_text("")
    with caplog.at_level(logging.WARNING, logger="sluice.worker.kernels"):
        with _build_lock(tmp_path):
            assert not (tmp_path / "lock").exists()
    assert "stale kernel build lock" in caplog.text


def test_a_live_build_is_waited_for_and_said(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(tmp_path / 'sluice.flock')!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(1.0)")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    from sluice.worker.kernels import _build_lock
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sluice.worker.kernels"):
        with _build_lock(tmp_path):
            waited = time.monotonic() - t0
    holder.wait(5)
    assert "waiting for another process's build" in caplog.text
    assert waited > 0.3  # it did wait for the holder (who held it ~1 s), not barge in
