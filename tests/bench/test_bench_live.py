"""``agentrt bench`` against a real ``agentrt serve``: its numbers equal the server's /metrics deltas."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agentrt.bench import prom
from agentrt.procs import tls_context

ROOT = Path(__file__).resolve().parents[2]


def _counters(url: str) -> dict:
    return prom.parse_counters(httpx.get(url + "/metrics", timeout=10, verify=tls_context()).text)


# gauges of work the server has in hand: the engine's running and queued requests, the HTTP layer's
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting", "agentrt_requests_in_flight")


def _wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the server has nothing in hand. The server is the session's: a turn an earlier test cut
    (tests/bench/test_bench_bounded.py) can still be computing there, and its prompt tokens would count
    in this test's deltas when its first token comes."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=10, verify=tls_context()).text
        busy = sum(s.value for f in text_string_to_metric_families(text) if f.name in BUSY for s in f.samples)
        if busy == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the server still has {busy} requests in hand after {timeout_s} s")
        time.sleep(0.2)


def test_bench_tiny_matches_server_metrics(start_agentrt_server, tmp_path):
    # a server of its own: on the session's shared one, the prompt tokens of turns other tests cut
    # (tests/bench/test_bench_bounded.py) landed in these deltas in some full-suite runs (2,350 vs 430)
    server = start_agentrt_server(tmp_path)
    try:
        _check_tiny_bench(server.url, tmp_path)
    finally:
        server.stop()


def _check_tiny_bench(url: str, tmp_path) -> None:
    _wait_idle(url)
    before = _counters(url)
    out = tmp_path / "tiny.json"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrt_cli", "bench", "--target", url, "--preset", "tiny", "--sessions", "2",
         "--json", str(out), "--price-per-worker-hour", "2.0", "--slo-ttft-s", "60", "--slo-tpot-s", "10",
         "--no-progress", "--no-estimate"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = _counters(url)
    result = json.loads(out.read_text())
    run = result["runs"][0]
    s = run["summary"]
    server = {k: after[k] - before[k] for k in after}

    # tiny: 2 sessions x 2 calls, all answered
    assert (s["calls"], s["calls_ok"], s["sessions_completed"]) == (4, 4, 2)
    assert server["requests_ok"] == 4
    assert s["prompt_tokens"] == server["prompt_tokens"]
    assert s["completion_tokens"] == server["completion_tokens"]
    assert s["cached_tokens"] == server["cached_tokens"]
    assert s["cached_tokens"] > 0  # the second call re-sends the first call's prompt
    assert s["hit_rate"] == s["cached_tokens"] / s["prompt_tokens"]
    # the bench's own scrape agrees with ours
    own = run["server_metrics"][url]
    assert {k: own[k] for k in server} == server
    # per-call records add up to the summary; every call hit the SLO (generous bounds)
    assert sum(c["completion_tokens"] for c in run["calls"]) == s["completion_tokens"]
    assert all(c["completion_tokens"] <= c["max_tokens"] == 4 for c in run["calls"])
    assert s["slo_met_calls"] == 4 and s["attainment"] == 1.0
    assert abs(s["goodput_rps"] - 4 / s["wall_s"]) < 1e-9
    dollars = 2.0 * 1 * s["wall_s"] / 3600
    assert abs(s["cost"]["per_million_output_tokens"] - dollars / s["completion_tokens"] * 1e6) < 1e-9
    # the Markdown report and its plots are written beside the JSON
    md = (tmp_path / "tiny.md").read_text()
    assert "| rate (sessions/s)" in md and "tiny-latency.png" in md
    assert (tmp_path / "tiny-latency.png").stat().st_size > 1000
    assert (tmp_path / "tiny-hits.png").stat().st_size > 1000
