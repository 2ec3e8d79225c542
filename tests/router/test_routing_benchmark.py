"""The trace-replay simulator in quick mode: its oracle and the policies' ordering."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import routing  # noqa: E402

N = 1500


def records():
    return routing.load_trace(routing.DEFAULT_TRACE, N)


def test_one_infinite_cache_equals_ideal():
    recs = records()
    for policy in ("round_robin", "agentrt"):
        f = routing.simulate(recs, policy, 1, 10**9, routing.LatencyModel())
        assert abs(f["hit_rate"] - routing.ideal_hit_rate(recs)) < 1e-12


def test_quick_json_and_ordering(tmp_path):
    out = tmp_path / "routing.json"
    assert routing.main(["--quick", str(N), "--workers", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"round_robin", "least_load", "session_hash", "sglang_like",
                                     "agentrt"}
    for f in data["policies"].values():
        assert {"hit_rate", "load_max_mean", "ttft_p50_s", "ttft_p99_s"} <= set(f)
        assert 0 <= f["hit_rate"] <= data["ideal_hit_rate"] + 1e-12
        assert f["load_max_mean"] >= 1.0
    ours, rr = data["policies"]["agentrt"], data["policies"]["round_robin"]
    assert rr["hit_rate"] < ours["hit_rate"]
    assert ours["ttft_p50_s"] <= rr["ttft_p50_s"]


def test_cache_events_keep_index_exact():
    """The simulated workers' events must leave the router's index equal to their caches."""
    recs = records()
    index = routing.PrefixIndex()
    workers = [routing.SimWorker(f"w{i}", 200, routing._publisher(index, f"w{i}")) for i in range(2)]
    for i, r in enumerate(recs[:300]):
        w = workers[i % 2]
        w.enqueue(r["hash_ids"])
        w.insert(r["hash_ids"])
    for w in workers:
        assert index.blocks_of(w.worker_id) == len(w.blocks) <= 200
        assert all(w.worker_id in index.holders(h) for h in w.blocks)
