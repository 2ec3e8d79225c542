"""The router's pull-or-recompute decision (``RouterCore.kv_move``) on a real ``RouterCore`` (it reaches Redis
only when started): a turn routed away from the worker holding its prefix is told to pull from it when the
cost model, on the figures the workers reported, finds that faster; over a throttled link, with too little
to gain, a dead holder, moves off or no figures, it recomputes as before."""

from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.core import Route, RouterCore
from router.policy import RouteDecision, RouteRequest
from router.registry import LoadReport, WorkerInfo

HASHES = tuple(range(1000, 1040))      # a 640-token prompt's 40 blocks


def core(**config) -> RouterCore:
    c = RouterCore(RouterConfig(redis_url="redis://127.0.0.1:1/0", **config), "m")
    for wid in ("wa", "wb"):
        c.workers[wid] = WorkerInfo(wid, f"http://{wid}.internal:8100", "m")
        c.loads[wid] = LoadReport(kv_bytes_per_token=46080, prefill_tokens_per_s=600.0)
    c.index.stored("wa", HASHES)        # the holder
    c.index.stored("wb", HASHES[:4])    # the target has the first 4 blocks (a shared system prompt)
    return c


def route_to(c: RouterCore, wid: str = "wb") -> Route:
    request = RouteRequest("r1", HASHES, len(HASHES) * 16, 16)
    return Route(c.workers[wid], request, RouteDecision(wid, 4, "load"))


def test_a_turn_sent_away_from_its_holder_pulls_the_blocks_it_lacks():
    c = core()
    move = c.kv_move(route_to(c))
    assert move == {"url": "http://wa.internal:8100", "worker": "wa", "blocks": 40}
    # 36 blocks lacking: 576 tokens; 0.05 + 576 * 46080 / 2e8 = 0.18 s against 576 / 600 = 0.96 s
    assert c.moves["pull"] == 1 and c.moves["recompute"] == 0 and c.moves["pulled_tokens"] == 576
    assert c.moves["est_pull_s"] == pytest.approx(0.05 + 576 * 46080 / 2e8)
    assert c.moves["est_recompute_s"] == pytest.approx(576 / 600.0)


def test_a_throttled_link_recomputes():
    c = core()
    c.loads["wb"] = LoadReport(kv_bytes_per_token=46080, prefill_tokens_per_s=600.0, kv_pull_bytes_per_s=1e6)
    assert c.kv_move(route_to(c)) is None        # 26.6 s of transfer against 0.96 s of prefill
    assert c.moves["recompute"] == 1 and c.moves["pull"] == 0 and c.moves["pulled_tokens"] == 0


def test_the_targets_measured_prefill_decides():
    c = core()
    c.loads["wb"] = LoadReport(kv_bytes_per_token=46080, prefill_tokens_per_s=1e6, kv_pull_bytes_per_s=2e8)
    assert c.kv_move(route_to(c)) is None        # a GPU-fast prefill: 0.6 ms beats any transfer
    assert c.moves["recompute"] == 1


def test_no_move_without_a_holder_to_gain_from():
    c = core()
    assert c.kv_move(route_to(c, "wa")) is None  # sent to the holder itself
    c = core(kv_move_min_tokens=1024)
    assert c.kv_move(route_to(c)) is None        # 576 tokens are not worth a move here
    c = core()
    del c.workers["wa"]                          # the holder died: its sessions are recomputed
    assert c.kv_move(route_to(c)) is None
    c = core(kv_moves=False)
    assert c.kv_move(route_to(c)) is None
    c = core()
    c.loads = {}                                 # no worker reported its KV bytes per token yet
    assert c.kv_move(route_to(c)) is None
    assert c.moves == {"pull": 0, "recompute": 0, "est_pull_s": 0.0, "est_recompute_s": 0.0, "pulled_tokens": 0}
