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


def test_live_pass_order_and_pooled_figures():
    from benchmarks.routing_live import pass_order, summarize

    assert pass_order(("agentrt", "sglang"), 3) == ["agentrt", "sglang", "sglang", "agentrt", "agentrt", "sglang"]
    assert pass_order(("sglang",), 2) == ["sglang", "sglang"]

    def turn(s, t, prompt, cached, ttft):
        return {"session": s, "turn": t, "prompt_tokens": prompt, "cached_tokens": cached, "ttft_s": ttft,
                "completion_tokens": 4}
    first = {"position": 0, "wall_s": 2.0, "share": [300, 100],
             "turns": [turn(0, 0, 100, 0, 1.0), turn(0, 1, 200, 96, 0.5)]}
    second = {"position": 3, "wall_s": 2.0, "share": [100, 100],
              "turns": [turn(0, 0, 100, 0, 3.0), turn(0, 1, 200, 192, 0.25)]}
    f = summarize("agentrt", [first, second])
    assert f["turns"] == 4 and f["hit_rate"] == (96 + 192) / 600
    assert f["worker_prompt_share"] == [0.667, 0.333]
    assert f["ttft_p99_s"] == 3.0 and f["throughput_tok_s"] == 16 / 4.0
    assert [r["hit_rate"] for r in f["runs"]] == [96 / 300, 192 / 300]
    assert [r["position"] for r in f["runs"]] == [0, 3]
    assert [(t["run"], t["turn"]) for t in f["per_turn"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_live_first_turns_per_worker():
    """Which worker took each session's first turn, its agent types and when its last first token came."""
    from benchmarks.routing_live import first_turns

    def turn(s, t, worker, start, ttft, prompt=1182, cached=1008):
        return {"session": s, "turn": t, "worker": worker, "start_s": start, "ttft_s": ttft,
                "prompt_tokens": prompt, "cached_tokens": cached}
    turns = [turn(0, 0, "w1", 0.0, 5.0, cached=0), turn(4, 0, "w1", 0.1, 9.0), turn(1, 0, "w0", 0.0, 4.0),
             turn(3, 0, None, 0.0, 2.0), turn(0, 1, "w1", 6.0, 30.0)]  # a later turn does not count
    assert first_turns(turns) == {
        "?": {"n": 1, "agents": [3], "uncached_tokens": 174, "last_first_token_s": 2.0},
        "w0": {"n": 1, "agents": [1], "uncached_tokens": 174, "last_first_token_s": 4.0},
        "w1": {"n": 2, "agents": [0], "uncached_tokens": 1182 + 174, "last_first_token_s": 9.1}}
