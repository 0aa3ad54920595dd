"""The soak harness, short: a few hundred requests at well over the running capacity
(4 seats, 8 waiting places, 24 clients), with disconnects and the whole catalogue of
hostile bodies, against a real server. 0 5xx, 0 resets, 0 hangs, 0 malformed responses,
0 wrong token counts, nothing leaked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from sluice.entrypoints.openai.api_server import ServerConfig
from sluice.entrypoints.openai.serving import ServingLimits
from tests.server.conftest import MODEL, RunningServer, start_engine, wait_all_blocks_free


def test_short_soak_finds_nothing(tiny_checkpoint, tmp_path):
    aengine, metrics, _ = start_engine(str(tiny_checkpoint("llama")), num_blocks=128, max_num_seqs=4,
                                       max_model_len=256)
    srv = RunningServer(aengine, ServerConfig(served_model_name=MODEL, limits=ServingLimits(max_waiting=8),
                                              max_request_bytes=2**20), metrics)
    out = tmp_path / "soak.json"
    try:
        cmd = [sys.executable, "-m", "sluice.entrypoints.cli", "bench", "soak", "--url", srv.url, "--model", MODEL,
               "--requests", "300", "--concurrency", "24", "--duration", "75", "--max-tokens", "16",
               "--big-body-bytes", str(2**20 + 10), "--hang-timeout", "30", "--server-pid", str(os.getpid()),
               "--json", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        report = json.loads(out.read_text())
        assert res.returncode == 0, json.dumps({k: report[k] for k in ("statuses", "problems")}, indent=1)
        assert report["requests_sent"] >= 250
        assert report["server_errors_5xx"] == report["connection_resets"] == report["hangs"] == 0
        assert report["malformed_responses"] == report["wrong_token_counts"] == 0
        assert not report["leaked"] and report["after_kv_blocks_used"] == 0
        assert report["hostile_accepted"] == []
        statuses = report["statuses"]
        assert statuses.get("429", 0) > 0, statuses   # it really was overloaded
        assert statuses.get("200", 0) > 100 and report["ok"] > 100, statuses
        assert report["disconnected"] > 0
        # The worst waits and stalls clients saw are reported (what they are is the machine's).
        assert report["worst_first_token_s"] > 0 and report["worst_first_byte_s"] > 0
        assert report["worst_stream_gap_s"] > 0
        assert sum(v for k, v in statuses.items() if k.startswith("4")) > 30  # the hostile bodies were sent
        wait_all_blocks_free(aengine.engine)
    finally:
        srv.stop()
        aengine.shutdown()
