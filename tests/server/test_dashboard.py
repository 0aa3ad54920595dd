"""The live dashboard in a real browser: Debian's chromium, headless, driven over the
DevTools protocol (aiohttp's websocket). The page is loaded, traffic runs, and the numbers
the page shows are checked against /metrics; its screenshot is what docs/img/dashboard.png
shows (`python -m tests.server.test_dashboard URL PNG` takes one of any server)."""
from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Browser:
    """Headless chromium on one page; `evaluate` runs JavaScript in it."""

    def __init__(self, url: str):
        self.profile = tempfile.mkdtemp(prefix="sluice-chromium-")
        self.proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
                                      "--window-size=1280,900", url],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = None
        deadline = time.time() + 60  # a hang guard: chromium prints its port as it starts
        while port is None:
            assert time.time() < deadline, "chromium did not start"
            line = self.proc.stderr.readline()
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            port = int(m.group(1)) if m else None
        self.port = port
        while True:
            pages = [p for p in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if p["type"] == "page"]
            if pages:
                break
            assert time.time() < deadline, "chromium opened no page"
            time.sleep(0.1)
        self.ws_url = pages[0]["webSocketDebuggerUrl"]
        self._id = 0

    def _call(self, method: str, **params) -> dict:
        async def go():
            import aiohttp
            async with aiohttp.ClientSession() as s, s.ws_connect(self.ws_url, max_msg_size=0) as ws:
                self._id += 1
                await ws.send_str(json.dumps({"id": self._id, "method": method, "params": params}))
                async for msg in ws:
                    data = json.loads(msg.data)
                    if data.get("id") == self._id:
                        return data
        data = asyncio.run(go())
        assert "error" not in data, data
        return data["result"]

    def evaluate(self, expression: str):
        return self._call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def screenshot(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(base64.b64decode(self._call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


def metric_sum(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith(name + "{"))


def wait_for(browser: Browser, expression: str, what: str, timeout: float = 60.0):
    deadline = time.time() + timeout  # a hang guard: the page updates twice a second
    while True:
        value = browser.evaluate(expression)
        if value:
            return value
        assert time.time() < deadline, f"the page never showed {what}"
        time.sleep(0.1)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt install chromium)")
def test_the_page_shows_the_engine_in_a_real_browser(server, tmp_path):
    from tests.server.conftest import MODEL, wait_all_blocks_free
    browser = Browser(f"{server.url}/dashboard")
    try:
        wait_for(browser, "document.getElementById('status').textContent.startsWith('live')", "a live snapshot")
        for i in range(6):  # traffic of two tenants
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": f"dashboard request {i}", "max_tokens": 8, "ignore_eos": True,
                "user": "dash-a" if i % 3 else "dash-b"})
            assert r.status_code == 200
        wait_all_blocks_free(server.llm)
        finished = metric_sum(server.url, "sluice_requests_finished_total")
        # Once the engine is idle, the page's numbers are /metrics' numbers.
        wait_for(browser, f"document.getElementById('finished').textContent === '{int(finished)}'",
                 f"{int(finished)} finished requests")
        page = browser.evaluate("""(() => {
            const t = (id) => document.getElementById(id).textContent;
            const rows = [...document.querySelectorAll('#tenants tr[data-tenant]')].map(
                r => [r.dataset.tenant, Number(r.cells[1].textContent)]);
            return {total: t('kv-total'), used: t('kv-used'), running: t('running'), waiting: t('waiting'),
                    steps: Number(t('steps')), ttft: t('ttft-p50'), tenants: Object.fromEntries(rows),
                    bars: document.getElementById('batch').toDataURL().length};
        })()""")
        assert int(page["total"]) == metric_sum(server.url, "sluice_kv_cache_blocks_total")
        assert int(page["used"]) == metric_sum(server.url, "sluice_kv_cache_blocks_used")
        assert page["running"] == "0" and page["waiting"] == "0"
        assert page["steps"] >= metric_sum(server.url, "sluice_engine_steps_total") > 0
        assert float(page["ttft"]) > 0
        for tenant in ("dash-a", "dash-b"):
            served = sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                         if re.match(rf'sluice_tenant_(prompt|generation)_tokens_total{{.*tenant="{tenant}"', line))
            assert page["tenants"][tenant] == served > 0
        browser.screenshot(str(tmp_path / "dashboard.png"))
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    finally:
        browser.close()


def test_the_page_and_its_events_need_a_key_where_keys_are_set(server):
    assert httpx.get(f"{server.keyed_url}/dashboard").status_code == 401
    assert httpx.get(f"{server.keyed_url}/dashboard?key=sekret").status_code == 200
    with httpx.stream("GET", f"{server.keyed_url}/dashboard/events", headers={"Authorization": "Bearer sekret"},
                      timeout=30) as s:
        line = next(line for line in s.iter_lines() if line.startswith("data: "))
    snap = json.loads(line[6:])
    assert {"running", "waiting", "kv", "tenants", "latency_ms", "recent_steps", "adapters"} <= set(snap)


if __name__ == "__main__":  # python -m tests.server.test_dashboard URL PNG: a screenshot of a running server's page
    b = Browser(f"{sys.argv[1]}/dashboard")
    try:
        wait_for(b, "document.getElementById('status').textContent.startsWith('live')", "a live snapshot")
        time.sleep(2)
        b.screenshot(sys.argv[2])
    finally:
        b.close()
