"""The dashboard of ``agentrt up --workers 2``, rendered by headless Chromium.

Two sessions of three turns go through the router; once the cluster is quiet (every worker's KV events
applied: the router's index holds as many blocks for each worker as the worker's prefix cache), Chromium
opens ``/dashboard``, runs its script (which polls ``/dashboard/status``) and dumps the rendered DOM. Both
workers must appear, up, with the cached blocks and hit rate their own ``/metrics`` report and the indexed
blocks the router's ``/metrics`` reports; the routing table must show each session's first turn placed
by load or prefix and its later turns kept by affinity. A screenshot goes to ``out/dashboard.png``.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it when missing); without a Chromium
binary the test is skipped, saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
import redis

from agentrt.procs import tls_context
from router.config import RouterConfig
from tests.router import cluster as c

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary on PATH (chromium, chromium-browser "
                                                          "or google-chrome); .ci/run installs Debian's chromium")
SYSTEM = ("You are the on-call assistant of a build farm: you read failing CI steps and name the likely cause "
          "in a few words. ") * 6
WORKERS = ("worker-0", "worker-1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with c.redis_group(tmp_path_factory.mktemp("dashboard"), stop_timeout_s=60.0) as (group, server):
        up = c.up(group, server.url)
        client = redis.Redis.from_url(server.url)
        cfg = RouterConfig(redis_url=server.url)
        urls = {w: client.hget(cfg.worker_key(w), "url").decode() for w in WORKERS}
        client.close()
        yield up.url, urls


@pytest.fixture(scope="module")
def sessions(cluster):
    router, _ = cluster
    ids = []
    with httpx.Client(base_url=router, timeout=120) as http:
        for s in range(2):
            sid = http.post("/v1/sessions", json={"system": f"Shift {s}. " + SYSTEM}).json()["id"]
            for t in range(3):
                r = http.post(f"/v1/sessions/{sid}/turns", json={
                    "messages": [{"role": "user", "content": f"Step {t} failed on file {t}.py; why?"}],
                    "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
            ids.append(sid)
    return ids


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10, verify=tls_context()).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _quiet_figures(router: str, urls: dict[str, str]) -> dict[str, dict[str, float]] | None:
    """Each worker's cached blocks, prompt and hit tokens (its /metrics) and indexed blocks (the router's),
    once the router's index agrees with every worker; None while it does not."""
    rm = _metrics(router)
    out = {}
    for w, url in urls.items():
        m = _metrics(url)
        if m["agentrt_engine_running"] or m["agentrt_engine_waiting"]:
            return None
        indexed = rm.get(f'agentrt_router_worker_indexed_blocks{{worker="{w}"}}')
        if indexed != m["agentrt_kv_pages_cached"]:
            return None
        out[w] = {"cached": m["agentrt_kv_pages_cached"], "indexed": indexed,
                  "prompt": m["agentrt_prompt_tokens_total"], "hit": m["agentrt_prefix_cache_hit_tokens_total"],
                  "moves": httpx.get(url + "/internal/kv/stats", timeout=10, verify=tls_context()).json()}
    return out


class _Dom(HTMLParser):
    """The rendered rows: workers (data-worker, under #workers) and decisions (data-request)."""

    def __init__(self) -> None:
        super().__init__()
        self.table: str | None = None
        self.row: dict | None = None
        self.workers: dict[str, dict] = {}
        self.decisions: list[dict] = []
        self.loaded = False
        self.slo: dict[str, object] = {}  # the latency SLO summary's fields (#slo-summary)
        self._in_slo = False
        self._field: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "body" and a.get("data-loaded") == "true":
            self.loaded = True
        if tag == "div" and a.get("id") == "slo-summary":
            self._in_slo = True
        elif tag == "span" and self._in_slo and "data-field" in a:
            self.slo[a["data-field"]] = json.loads(a["data-value"]) if a.get("data-value") else None
        if tag == "table":
            self.table = a.get("id")
        elif tag == "tr" and self.table == "workers" and "data-worker" in a:
            self.row = self.workers[a["data-worker"]] = {"state": a.get("data-state")}
        elif tag == "tr" and self.table == "decisions" and "data-request" in a:
            self.row = {"request": a["data-request"], "worker": a["data-worker"], "kind": a["data-kind"]}
            self.decisions.append(self.row)
        elif tag == "td" and self.row is not None and "data-field" in a:
            self._field = a["data-field"]
            if a.get("data-value"):
                self.row[self._field] = json.loads(a["data-value"])

    def handle_data(self, data: str) -> None:
        if self._field is not None and self.row is not None and self._field not in self.row:
            self.row[self._field] = data

    def handle_endtag(self, tag: str) -> None:
        if tag == "div":
            self._in_slo = False
        if tag == "td":
            self._field = None
        elif tag == "tr":
            self.row = None
        elif tag == "table":
            self.table = None


def _chromium(tmp: Path, *args: str) -> str:
    run = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={tmp}", "--virtual-time-budget=6000", *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_the_rendered_dashboard_shows_both_workers_as_their_metrics_do(cluster, sessions, tmp_path):
    router, urls = cluster
    figures = c.wait_for(lambda: _quiet_figures(router, urls), timeout_s=30, interval_s=0.5,
                         what="the router's index to match every worker's cache")
    dom = _Dom()
    dom.feed(_chromium(tmp_path / "profile", "--dump-dom", router + "/dashboard"))
    assert dom.loaded, "the page's script never drew a status"
    assert sorted(dom.workers) == list(WORKERS)
    assert figures == _quiet_figures(router, urls)  # nothing moved while the page was rendered
    for w in WORKERS:
        row, f = dom.workers[w], figures[w]
        assert row["state"] == "up"
        assert row["waiting"] == 0  # quiet: nothing queued, in any priority class
        assert row["cached_blocks"] == f["cached"] and row["indexed_blocks"] == f["indexed"]
        assert row["tokens"] == [f["prompt"], f["hit"]]
        moved = f["moves"]   # the worker's own /internal/kv/stats: KV pages pulled in and served out
        assert row["kv_moves"] == [moved["pulled_bytes"], moved["served_bytes"], moved["pulls"], moved["pull_failures"]]
        assert row["hit_rate"] == pytest.approx(f["hit"] / f["prompt"], abs=1e-12) if f["prompt"] else \
            row["hit_rate"] is None
    assert sum(figures[w]["prompt"] for w in WORKERS) > 0 and sum(figures[w]["hit"] for w in WORKERS) > 0
    # the latency SLO row: the router judged its six generations (met or missed, by /metrics), no session ended
    rm = _metrics(router)
    judged = sum(rm.get(f'agentrt_requests_slo_total{{outcome="{o}"}}', 0.0) for o in ("met", "missed"))
    assert judged == 6 and set(dom.slo) == {"goodput_sessions_per_min", "sessions_in_slo", "requests_in_slo_ratio"}
    assert dom.slo["sessions_in_slo"] == [0, 0] and dom.slo["goodput_sessions_per_min"] is None

    # six turns, newest first; each session's later turns stay with its first turn's worker
    assert len(dom.decisions) == 6 and all(d["kind"] in ("prefix", "load", "affinity") for d in dom.decisions)
    for sid in sessions:
        mine = [d for d in reversed(dom.decisions) if d["session"] == sid]
        assert len(mine) == 3 and mine[0]["kind"] in ("load", "prefix"), mine
        assert [d["kind"] for d in mine[1:]] == ["affinity", "affinity"], mine
        assert {d["worker"] for d in mine} == {mine[0]["worker"]}

    shot = ROOT / "out" / "dashboard.png"
    shot.parent.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)
    _chromium(tmp_path / "profile", "--window-size=1400,1000", f"--screenshot={shot}", router + "/dashboard")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
