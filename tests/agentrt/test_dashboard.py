"""``/dashboard`` on ``agentrt serve``, without a browser: the page and script are static, self-contained
and open; ``/dashboard/status`` needs a key and reports the same numbers as ``/metrics`` and the replies'
usage, scoped to the caller's tenant where data belongs to a tenant.

One real server (module scope) with a tenants file: ``acme`` (isolated cache) runs one session of two
turns, ``globex`` opens two sessions and runs none.
"""

from __future__ import annotations

import json
import re
import tomllib

import httpx
import pytest
from agentrt_test_helpers import metric

from agentrt.dashboard import STATIC, sees_all
from agentrt.core.tenants import Tenant, TenantRegistry, hash_key

KEYS = {"acme": "acme-key-1", "globex": "globex-key-1"}
SYSTEM = "You are the build farm's on-call assistant. Name the likely cause of a failing CI step in a few words. " * 3


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_agentrt_server):
    tmp = tmp_path_factory.mktemp("dashboard")
    path = tmp / "tenants.json"
    path.write_text(json.dumps({"tenants": {name: {"key_sha256": [hash_key(key)]} for name, key in KEYS.items()}}))
    proc = start_agentrt_server(tmp, "--tenants-file", str(path))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def traffic(server):
    """acme: one session, two turns (the second reads the first from the cache); globex: two idle sessions."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        sid = http.post("/v1/sessions", json={"system": SYSTEM}, headers=_auth("acme")).json()["id"]
        turns = []
        for text in ("Step 1 failed on a.py; why?", "Step 2 failed on b.py; why?"):
            r = http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": text}],
                                                             "max_tokens": 4, "temperature": 0},
                          headers=_auth("acme"))
            assert r.status_code == 200, r.text
            turns.append(r.json()["usage"])
        for _ in range(2):
            assert http.post("/v1/sessions", json={}, headers=_auth("globex")).status_code == 201
    return turns


def test_page_and_script_are_open_static_and_load_nothing_from_elsewhere(server):
    for path, kind in (("/dashboard", "text/html"), ("/dashboard/app.js", "text/javascript")):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert "https://" not in r.text and "//cdn" not in r.text
        # the one absolute URL is the SVG namespace name, which nothing fetches
        assert set(re.findall(r"http://[^\"' ]+", r.text)) <= {"http://www.w3.org/2000/svg"}
    page = httpx.get(server.url + "/dashboard").text
    assert re.findall(r'<script[^>]*src="([^"]+)"', page) == ["dashboard/app.js"]
    assert '<link' not in page
    script = (STATIC / "dashboard.js").read_text()
    assert ".innerHTML" not in script and ".outerHTML" not in script and 'STATUS_URL = "dashboard/status"' in script


def test_the_wheel_carries_the_page_and_script():
    """pyproject's package data names both files (a wheel built from it ships them next to dashboard.py)."""
    root = STATIC.parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["agentrt"]
    shipped = {p.name for g in globs for p in (root / "agentrt").glob(g)}
    assert {"dashboard.html", "dashboard.js"} <= shipped


def test_status_needs_a_valid_key(server):
    r = httpx.get(server.url + "/dashboard/status")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/dashboard/status", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(server.url + "/dashboard/status", headers={"x-api-key": KEYS["acme"]}).status_code == 200


def test_status_reports_what_metrics_and_usage_report(server, traffic):
    s = httpx.get(server.url + "/dashboard/status", headers=_auth("acme")).json()
    assert (s["mode"], s["model"], s["tenant"], s["scope"]) == ("serve", "SmolLM2-135M-Instruct", "acme", "tenant")
    (w,) = s["workers"]
    assert (w["id"], w["state"], w["url"]) == ("local", "up", None)
    assert w["load"] == {"running": 0, "waiting": 0, "waiting_tokens": 0, "waiting_by_priority": {}, "in_flight": 0}
    dev = w["kv"]["device"]
    assert set(w["kv"]) == {"device"}
    assert dev["pages_total"] == metric(server.url, "agentrt_kv_pages_capacity")
    assert dev["pages_used"] == metric(server.url, "agentrt_kv_pages_used") > 0
    assert dev["pages_pinned"] == metric(server.url, "agentrt_kv_pages_pinned") > 0  # the session's pin
    assert dev["pages_used"] + dev["pages_free"] == dev["pages_total"] and dev["page_size"] == 16
    assert dev["bytes_per_token"] == metric(server.url, "agentrt_kv_cache_bytes_per_token") > 0
    assert w["cached_blocks"] == dev["pages_cached"] == metric(server.url, "agentrt_kv_pages_cached") > 0
    assert w["pins"] == metric(server.url, "agentrt_kv_pins") == 1
    prompt = sum(u["prompt_tokens"] for u in traffic)
    cached = sum(u["cached_tokens"] for u in traffic)
    assert cached > 0  # the second turn read the first from the cache
    assert w["prompt_tokens_total"] == prompt == metric(server.url, "agentrt_prompt_tokens_total")
    assert w["cached_tokens_total"] == cached == metric(server.url, "agentrt_prefix_cache_hit_tokens_total")
    assert w["hit_rate"] == pytest.approx(cached / prompt)
    assert s["totals"] == {"prompt_tokens_total": prompt, "cached_tokens_total": cached,
                           "hit_rate": pytest.approx(cached / prompt)}
    assert s["routing"] == {"policy": None, "counts": {}, "recent": []}

    series = s["series"]
    assert series["interval_s"] == 5.0 and len(series["points"]) == 120
    points = series["points"]
    assert all(b["t"] - a["t"] == 5.0 for a, b in zip(points, points[1:]))
    assert sum(p["requests"] for p in points) == 2 and sum(p["ttft_count"] for p in points) == 2
    assert sum(p["prompt_tokens"] for p in points) == prompt and sum(p["cached_tokens"] for p in points) == cached
    # the latency SLO: each of the two turns met it or missed it, as /metrics counts them
    slo = {o: _labelled(server.url, f'agentrt_requests_slo_total{{outcome="{o}"}}') for o in ("met", "missed")}
    assert sum(slo.values()) == 2
    assert sum(p["slo_met"] for p in points) == slo["met"] and sum(p["slo_missed"] for p in points) == slo["missed"]
    assert (s["slo"]["ttft_s"], s["slo"]["tpot_s"]) == (2.0, 0.25)
    assert s["slo"]["last_minute"]["sessions_ended"] == 0  # no session ended yet
    for p in points:
        if p["ttft_count"]:
            assert 0 < p["ttft_p50_s"] <= p["ttft_p95_s"] <= p["ttft_max_s"]
        if p["prompt_tokens"]:
            assert p["hit_rate"] == pytest.approx(p["cached_tokens"] / p["prompt_tokens"])


def _labelled(url: str, sample: str) -> float:
    """A labelled sample of the server's /metrics (0 when absent: a counter no event touched yet)."""
    try:
        return metric(url, sample)
    except KeyError:
        return 0.0


def test_sessions_are_scoped_to_the_callers_tenant(server, traffic):
    acme = httpx.get(server.url + "/dashboard/status", headers=_auth("acme")).json()["sessions"]
    assert acme == {"count": 1, "pinned": 1, "scanned": 1, "by_tenant": [{"tenant": "acme", "count": 1, "pinned": 1}]}
    globex = httpx.get(server.url + "/dashboard/status", headers=_auth("globex")).json()
    assert globex["sessions"] == {"count": 2, "pinned": 0, "scanned": 2,
                                  "by_tenant": [{"tenant": "globex", "count": 2, "pinned": 0}]}
    assert globex["workers"][0]["prompt_tokens_total"] > 0  # fleet numbers are everyone's


def test_one_tenant_servers_show_every_tenant():
    assert sees_all(TenantRegistry.from_config(None, ()))  # open
    assert sees_all(TenantRegistry.from_config(None, ("k",)))  # --api-key keys: all default's
    assert not sees_all(TenantRegistry([Tenant("a", key_sha256=(hash_key("ka"),))]))
