"""benchmarks/protocols.py against the shared real server, on a tiny workload: every surface's
driver reads its own stream and usage shape (TTFT, prompt, cached and completion tokens), turns
2+ of every surface read most of their prompt from the cache, every surface's replies run to
exactly max_tokens (``ignore_eos`` on each), and the surfaces do not share conversations (on a
shared server each has its own seed, which the JSON says)."""

from __future__ import annotations

import json

from benchmarks.protocols import SURFACES, main


def test_every_surface_is_measured_from_its_own_stream(agentrt_server, tmp_path):
    out = tmp_path / "protocols.json"
    assert main(["--url", agentrt_server.url, "--sessions", "2", "--turns", "3", "--system-tokens", "200",
                 "--tool-result-tokens", "30", "--reply-tokens", "4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["header"]["schema"] == "agentrt-bench/1" and doc["headline"] is False
    assert doc["seeds"] == {name: 1 + i for i, name in enumerate(SURFACES)}
    results = doc["surfaces"]
    assert set(results) == set(SURFACES)
    for name, r in results.items():
        assert len(r["runs"]) == 1 and r["completion_tokens"]["runs"] == [24], name   # 6 replies x 4 tokens
        r = r["runs"][0]
        records = r["records"]
        assert len(records) == 6 and {(x["conversation"], x["turn"]) for x in records} == \
            {(s, t) for s in range(2) for t in range(3)}, name
        for x in records:
            assert 0 < x["ttft_s"] <= x["latency_s"], (name, x)
            assert x["prompt_tokens"] > 200 and x["completion_tokens"] == 4, (name, x)
            assert 0 <= x["cached_tokens"] < x["prompt_tokens"], (name, x)
        # each turn resends (or continues) the last one: its prompt grows, and its history is cached
        for s in range(2):
            rows = sorted((x for x in records if x["conversation"] == s), key=lambda x: x["turn"])
            assert rows[0]["prompt_tokens"] < rows[1]["prompt_tokens"] < rows[2]["prompt_tokens"], (name, rows)
        assert r["cached_fraction_turns2plus"] > 0.6, (name, r["cached_fraction_turns2plus"])


def test_surfaces_alternate_over_repeats_and_ratios_pair_runs():
    from benchmarks import harness
    from benchmarks.protocols import summarize_runs
    order = [s for _, s in harness.ab_order(list(SURFACES), 2, "alternate")]
    assert order[:4] == list(SURFACES) and order[4:] == list(reversed(SURFACES))   # sessions not always first
    runs = {"sessions": [{"ttft_p50_s_turns2plus": 1.0}, {"ttft_p50_s_turns2plus": 2.0}],
            "chat": [{"ttft_p50_s_turns2plus": 1.5}, {"ttft_p50_s_turns2plus": 2.0}]}
    for rs in runs.values():
        for r in rs:
            r.update(ttft_p99_s_turns2plus=0.0, cached_fraction_turns2plus=0.9, wall_s=1.0, completion_tokens=4)
    out = summarize_runs(runs)
    assert out["chat"]["ttft_ratio_vs_sessions"] == {"runs": [1.5, 1.0], "median": 1.25, "min": 1.0, "max": 1.5}
    assert out["sessions"]["ttft_p50_s_turns2plus"]["median"] == 1.5
