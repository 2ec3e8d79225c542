"""A load report taken while a turn was queued can reach the router after the turn has ended (reports trail
their worker by up to a heartbeat and a refresh). The router takes the requests it saw end since the report
was taken off that report's queue (``InFlightTracker.ended_since``, ``RouterCore._queue``), so the worker
holding a conversation's prefix is not priced for a turn it has finished. A stale report of this kind sent a
67-token conversation away from its holder in CI (tests/router/test_kv_tier_cluster.py, 6c34c95)."""

from __future__ import annotations

import asyncio
import math
import random
import time

from router.config import RouterConfig
from router.core import RouterCore
from router.inflight import RECENT_S, InFlightTracker
from router.registry import LoadReport, WorkerInfo


def test_ended_since_counts_requests_sent_before_and_ended_after_the_report():
    t = InFlightTracker()
    t.dispatched("a", "w", 100, 10, now=10.0)
    t.dispatched("b", "w", 100, 10, now=11.5)        # sent after a report taken at 11: not in it
    t.dispatched("c", "v", 100, 10, now=10.0)        # another worker
    t.dispatched("d", "w", 100, 10, now=10.5)        # still in flight: the report rightly counts it
    assert t.ended_since("w", 11.0) == 0
    t.completed("a", now=12.0)
    t.completed("b", now=12.5)
    t.completed("c", now=12.0)
    assert t.ended_since("w", 11.0) == 1             # a only
    assert t.ended_since("w", 9.0) == 0              # taken before anything was sent
    assert t.ended_since("w", 12.2) == 1             # b: sent 11.5, ended 12.5
    assert t.ended_since("w", 13.0) == 0             # taken after both ended: it counts neither
    assert t.ended_since("v", 11.0) == 1 and t.ended_since("x", 11.0) == 0
    t.dispatched("e", "w", 1, 1, now=20.0)
    t.completed("e", now=12.0 + RECENT_S + 1)        # the ended requests of 12.0 are forgotten
    assert t.ended_since("w", 11.0) == 0
    t.forget("v")
    assert t.ended_since("v", 11.0) == 0
    assert t.count("w") == 1 and len(t) == 1         # d is still in flight


def test_ended_since_kept_up_to_date_equals_a_fresh_count():
    """The kept answer for a worker's latest report time, counted on as requests end, against a brute-force
    count over every request sent and ended, on random traffic to two workers."""
    rng = random.Random(4)
    t = InFlightTracker()
    log: list[tuple[str, float, float]] = []
    sent: dict[str, tuple[str, float]] = {}
    clock = 100.0
    reports = {"a": 99.0, "b": 99.0}
    for i in range(600):
        clock += rng.random() * 0.05
        if rng.random() < 0.55 or not sent:
            w = rng.choice("ab")
            t.dispatched(f"r{i}", w, 10, 1, now=clock)
            sent[f"r{i}"] = (w, clock)
        else:
            rid = rng.choice(sorted(sent))
            w, at = sent.pop(rid)
            t.completed(rid, now=clock)
            log.append((w, at, clock))
        if rng.random() < 0.1:                       # a new report, taken a little while ago
            reports[rng.choice("ab")] = clock - rng.random() * 1.5
        w = rng.choice("ab")                          # asked again and again between reports (kept answer)
        assert t.ended_since(w, reports[w]) == sum(1 for x, s0, e in log if x == w and s0 < reports[w] < e)


def _core() -> RouterCore:
    core = RouterCore(RouterConfig(redis_url="redis://127.0.0.1:1/0"), "m")   # never started: no Redis
    core.tentative._redis_down_until = math.inf      # local tentative entries only
    return core


async def _refresh(core: RouterCore, loads: dict[str, LoadReport]) -> None:
    """``refresh`` reading wa and wb live and ``loads`` from a stand-in registry."""
    async def live_workers():
        return [WorkerInfo(wid, f"http://{wid}", "m") for wid in ("wa", "wb")]

    async def read_loads(ids):
        return {wid: loads[wid] for wid in ids if wid in loads}
    core.registry.live_workers = live_workers
    core.registry.loads = read_loads
    await core.refresh(resync_joined=False)


def _now_ms() -> int:
    return int(time.time() * 1000)


def test_a_turn_that_ended_after_its_workers_report_does_not_send_the_next_turn_away():
    asyncio.run(_turns())


async def _turns() -> None:
    core = _core()
    first = list(range(1000, 1067))                  # 67 tokens: 4 whole blocks of 16
    await _refresh(core, {"wa": LoadReport(ts_ms=_now_ms()), "wb": LoadReport(ts_ms=_now_ms())})
    core.index.stored("wa", core.hashes(first)[:4])  # wa holds the conversation's prefix
    route = await core.choose("turn-1", first, 16)
    assert route.worker.worker_id == "wa"
    await core.dispatched(route)
    await asyncio.sleep(0.02)
    during = LoadReport(waiting=1, waiting_tokens=67, ts_ms=_now_ms())   # taken while turn 1 waited
    await asyncio.sleep(0.02)
    core.completed(route)
    await _refresh(core, {"wa": during, "wb": LoadReport(ts_ms=_now_ms())})   # ...and read after it ended

    assert core._state("wa")[2:4] == (0, 0)          # (running, waiting): the ended turn taken off
    load = next(w for w in core.state()["workers"] if w["id"] == "wa")["load"]
    assert (load["waiting"], load["ended_since_report"]) == (1, 1)   # the report as sent, and what came off
    prompt = first + [7] * 20
    # the kept fleet view, and the path that builds every state per decision (a retry's: exclude set)
    second = await core.choose("turn-2", prompt, 16)
    retry = await core.choose("turn-2r", prompt, 16, exclude=frozenset({"gone"}))
    for r in (second, retry):
        assert r.worker.worker_id == "wa", (r.decision, r.candidates)

    # A report taken after turn 2 was sent counts it, and a request this router did not see end (another
    # replica's, or one still running): it is taken as it is.
    await core.dispatched(second)
    await asyncio.sleep(0.02)
    await _refresh(core, {"wa": LoadReport(running=1, waiting=2, ts_ms=_now_ms()), "wb": LoadReport(ts_ms=_now_ms())})
    assert core._state("wa")[2:4] == (1, 2)
    core.completed(second)                           # ended after that report: one comes off, waiting first
    assert core._state("wa")[2:4] == (1, 1)
