"""The dashboard's parts without a browser: the routing-decision kinds (from real policies' decisions and
through a real ``RouterCore`` over a real ``redis-server``), the decision ring, the router's fleet view of
registered workers that are down or unreachable, its per-worker ``/metrics``, and the TTFT / hit-rate
``Timeline``.
"""

from __future__ import annotations

import asyncio
import types

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, generate_latest

from agentrt.core.tenants import Tenant, TenantRegistry, hash_key
from agentrt.metrics import Timeline, quantile
from router.config import RouterConfig
from router.core import RouterCore
from router.dashboard import RouterStatus
from router.decisions import KINDS, DecisionLog, classify
from router.metrics import RouterCollector
from router.policies.agentrt import AgentrtPolicy
from router.policy import RouteRequest, WorkerState, make_policy
from router.registry import WorkerInfo, WorkerRegistry

B = 16
PROMPT = tuple(range(1, 71))  # 70 blocks


def _req(last_worker: str | None = None) -> RouteRequest:
    return RouteRequest("r", PROMPT, len(PROMPT) * B, B, "s" if last_worker else None, last_worker, 16)


@pytest.mark.parametrize("workers, last, rule, kind", [
    # the session's last worker still holds its prefix
    ([WorkerState("w0", 64), WorkerState("w1", 0)], "w0", "affinity", "affinity"),
    # nobody holds anything: least loaded
    ([WorkerState("w0", 0), WorkerState("w1", 0, running=1)], None, "fallback", "load"),
    # one worker holds the longest prefix and is not overloaded
    ([WorkerState("w0", 0), WorkerState("w1", 64)], None, "prefix", "prefix"),
    # the holder is overloaded: the prefix spills to the next-cheapest worker
    ([WorkerState("w0", 64, running=200), WorkerState("w1", 32), WorkerState("w2", 0)], None, "spill", "load"),
    # a worker with 4 blocks less but one queued request less is cheaper
    ([WorkerState("w0", 64, running=1), WorkerState("w1", 60), WorkerState("w2", 0)], None, "cost", "load"),
])
def test_agentrt_policy_rules_fold_into_kinds(workers, last, rule, kind):
    decision = AgentrtPolicy().select(_req(last), workers)
    assert decision.reason == rule
    assert classify(decision.reason, failed_over=False) == kind
    assert classify(decision.reason, failed_over=True) == "failover"


def test_every_builtin_policy_rule_has_a_kind():
    reqs = [_req(), _req("w1")]
    states = [[WorkerState("w0", 0), WorkerState("w1", 0)], [WorkerState("w0", 64), WorkerState("w1", 2)]]
    seen = {}
    for name in ("round_robin", "least_load", "session_hash", "sglang_like"):
        policy = make_policy(name)
        for req in reqs:
            for ws in states:
                seen[policy.select(req, ws).reason] = None
    assert {classify(r, False) for r in seen} <= set(KINDS)
    assert classify("round_robin", False) == classify("least_load", False) == "load"
    assert classify("session_hash", False) == "affinity" and classify("cache", False) == "prefix"
    assert classify("a_rule_nobody_wrote", False) == "load"


def test_decision_log_is_a_bounded_ring_newest_first_scoped_by_cache_salt():
    log = DecisionLog(maxlen=3)
    for i in range(5):
        log.record(f"r{i}", None, 10, "w0", i, "prefix" if i % 2 else "fallback",
                   failed={"w9"} if i == 4 else frozenset(), cache_salt="tenant:a" if i < 3 else "", ts=100.0 + i)
    assert len(log) == 3
    recent = log.recent()
    assert [r.request_id for r in recent] == ["r4", "r3", "r2"]
    assert [r.kind for r in recent] == ["failover", "prefix", "load"]
    assert log.counts == {"prefix": 2, "load": 2, "affinity": 0, "failover": 1}  # since start, not the ring
    assert [r.request_id for r in log.recent(cache_salts=frozenset({"tenant:a"}))] == ["r2"]
    assert [r.request_id for r in log.recent(1)] == ["r4"]
    assert recent[0].as_json() == {"ts": 104.0, "request_id": "r4", "session": None, "prompt_blocks": 10,
                                   "worker": "w0", "matched_blocks": 4, "kind": "failover", "rule": "fallback",
                                   "failed": ["w9"]}
    with pytest.raises(ValueError):
        DecisionLog(maxlen=0)


SYSTEM = list(range(1000, 1000 + 40 * B))  # a 40-block agent prompt


async def _core(cfg: RouterConfig) -> RouterCore:
    client = aioredis.Redis.from_url(cfg.redis_url)
    registry = WorkerRegistry(client, cfg)
    for wid in ("w0", "w1", "w2"):  # registered records; port 9 refuses connections
        await registry.register(WorkerInfo(wid, f"http://127.0.0.1:9/{wid}", "m", 4, 512, cfg.block_size))
    await client.delete(cfg.heartbeat_key("w2"))  # w2: registered, heartbeat gone
    await client.aclose()
    core = RouterCore(cfg, "m")
    # The live workers and loads, as start() reads them; no KV-event consumer (nothing publishes here).
    await core.refresh(resync_joined=False)
    return core


def test_router_core_logs_each_dispatch_with_its_kind(redis_url):
    cfg = RouterConfig(redis_url=redis_url)

    async def body():
        core = await _core(cfg)
        try:
            assert sorted(core.workers) == ["w0", "w1"]
            first = await core.choose("req-1", SYSTEM + [1] * 40, 8, session_id="sess-a")
            await core.dispatched(first)
            holder = first.worker.worker_id
            other = ({"w0", "w1"} - {holder}).pop()
            second = await core.choose("req-2", SYSTEM + [2] * 40, 8)  # the same agent prompt, dispatched
            await core.dispatched(second)
            third = await core.choose("req-3", SYSTEM + [1] * 40 + [3] * 40, 8, session_id="sess-a",
                                      last_worker=holder)
            await core.dispatched(third)
            fourth = await core.choose("req-3", SYSTEM + [1] * 40 + [3] * 40, 8, session_id="sess-a",
                                       last_worker=holder, exclude=frozenset({holder}))  # holder failed
            await core.dispatched(fourth)
            recent = core.decision_log.recent()
            assert [(r.request_id, r.worker, r.kind, r.rule) for r in reversed(recent)] == [
                ("req-1", first.worker.worker_id, "load", "fallback"),
                ("req-2", holder, "prefix", "prefix"),
                ("req-3", holder, "affinity", "affinity"),
                ("req-3", other, "failover", fourth.decision.reason)]
            assert recent[0].failed == (holder,) and recent[1].failed == ()
            assert recent[3].session == "sess-a" and recent[2].session is None
            assert recent[2].matched_blocks == 40 and recent[2].prompt_blocks == len(second.request.hashes)
            assert core.decision_log.counts == {"prefix": 1, "load": 1, "affinity": 1, "failover": 1}
            for route in (first, second, third, fourth):
                core.completed(route, ok=False)
            await asyncio.gather(*list(core._background))
        finally:
            await core.stop()

    asyncio.run(body())


def test_router_fleet_view_and_metrics_show_down_and_unreachable_workers(redis_url):
    cfg = RouterConfig(redis_url=redis_url)

    async def body():
        core = await _core(cfg)
        try:
            core.index.stored("w0", [11, 12, 13])
            state = types.SimpleNamespace(tenants=TenantRegistry.from_config(None, ()))
            view = RouterStatus(state, core, timeout_s=1.0)
            workers = {w["id"]: w for w in await view.workers()}
            assert sorted(workers) == ["w0", "w1", "w2"]
            assert [workers[w]["state"] for w in ("w0", "w1", "w2")] == ["unreachable", "unreachable", "down"]
            assert workers["w0"]["indexed_blocks"] == 3 and workers["w1"]["indexed_blocks"] == 0
            assert workers["w0"]["url"] == "http://127.0.0.1:9/w0" and workers["w2"]["url"] == "http://127.0.0.1:9/w2"
            assert workers["w0"]["cached_blocks"] is None and workers["w0"]["hit_rate"] is None
            assert workers["w2"]["kv"] == {} and workers["w2"]["load"] is None

            registry = CollectorRegistry()
            registry.register(RouterCollector(core, types.SimpleNamespace(failovers=0)))
            text = generate_latest(registry).decode()
            assert 'agentrt_router_worker_indexed_blocks{worker="w0"} 3.0' in text
            assert 'agentrt_router_worker_indexed_blocks{worker="w1"} 0.0' in text and 'worker="w2"' not in text

            tenants = TenantRegistry([Tenant("a", key_sha256=(hash_key("ka"),)),
                                      Tenant("b", key_sha256=(hash_key("kb"),), share_cache=True)])
            scoped = RouterStatus(types.SimpleNamespace(tenants=tenants), core)
            core.decision_log.record("ra", None, 4, "w0", 1, "prefix", cache_salt="tenant:a")
            core.decision_log.record("rb", None, 4, "w1", 0, "fallback", cache_salt="")
            assert [d["request_id"] for d in scoped.routing(tenants.tenants["a"])["recent"]] == ["ra"]
            assert [d["request_id"] for d in scoped.routing(tenants.tenants["b"])["recent"]] == ["rb"]
            assert [d["request_id"] for d in view.routing(Tenant("default"))["recent"]] == ["rb", "ra"]
        finally:
            await core.stop()

    asyncio.run(body())


def test_timeline_buckets_ttft_and_hit_rate_over_a_bounded_window():
    now = [1000.0]
    tl = Timeline(interval_s=5.0, window_s=20.0, sample_size=4, clock=lambda: now[0])
    for v in (0.1, 0.2, 0.3):
        tl.observe_ttft(v)
    tl.observe_request(100, 60)
    now[0] = 1007.0  # the next interval
    tl.observe_request(50, 0)
    for v in range(1, 11):  # 10 values, a reservoir of 4
        tl.observe_ttft(float(v))
    pts = tl.points()
    assert [p["t"] for p in pts] == [990.0, 995.0, 1000.0, 1005.0]
    assert pts[0]["requests"] == 0 and pts[0]["hit_rate"] is None and pts[0]["ttft_p50_s"] is None
    a, b = pts[2], pts[3]
    assert a["ttft_count"] == 3 and a["ttft_mean_s"] == pytest.approx(0.2) and a["ttft_max_s"] == 0.3
    assert a["ttft_p50_s"] == 0.2 and a["ttft_p95_s"] == 0.3
    assert (a["requests"], a["prompt_tokens"], a["cached_tokens"], a["hit_rate"]) == (1, 100, 60, 0.6)
    assert b["ttft_count"] == 10 and b["ttft_mean_s"] == pytest.approx(5.5) and b["ttft_max_s"] == 10.0
    assert b["hit_rate"] == 0.0 and 1.0 <= b["ttft_p50_s"] <= 10.0
    now[0] = 1031.0  # both observed intervals have left the 20 s window
    assert all(p["requests"] == 0 and p["ttft_count"] == 0 for p in tl.points())
    assert len(tl.points()) == 4
    assert quantile([], 0.5) is None and quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    with pytest.raises(ValueError):
        Timeline(interval_s=10, window_s=5)


def test_timeline_counts_the_latency_slo_and_goodput_per_interval_and_over_the_last_minute():
    now = [1000.0]
    tl = Timeline(interval_s=5.0, window_s=120.0, clock=lambda: now[0])
    assert tl.slo_summary()["requests_in_slo_ratio"] is None and tl.slo_summary()["goodput_sessions_per_min"] is None
    for met in (True, True, False):
        tl.observe_slo(met)
    tl.observe_session_end(True)
    now[0] = 1030.0
    tl.observe_slo(False)
    tl.observe_session_end(True)
    tl.observe_session_end(False)
    pts = {p["t"]: p for p in tl.points()}
    a, b = pts[1000.0], pts[1030.0]
    assert (a["slo_met"], a["slo_missed"], a["slo_ratio"]) == (2, 1, pytest.approx(2 / 3))
    assert (a["sessions_met"], a["sessions_missed"], a["goodput_sessions_per_min"]) == (1, 0, 12.0)  # 1 in 5 s
    assert (b["slo_ratio"], b["goodput_sessions_per_min"]) == (0.0, 12.0)
    assert pts[1005.0]["slo_ratio"] is None and pts[1005.0]["goodput_sessions_per_min"] is None
    last = tl.slo_summary(60.0)
    assert (last["requests"], last["requests_in_slo"], last["sessions_ended"], last["sessions_in_slo"]) == (4, 2, 3, 2)
    assert last["requests_in_slo_ratio"] == 0.5 and last["goodput_sessions_per_min"] == 2.0
    now[0] = 1061.0  # the interval at 1000 began more than a minute before the current one's end
    last = tl.slo_summary(60.0)
    assert (last["requests"], last["sessions_ended"], last["goodput_sessions_per_min"]) == (1, 2, 1.0)
