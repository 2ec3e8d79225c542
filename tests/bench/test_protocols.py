"""benchmarks/protocols.py against the shared real server, on a tiny workload: every surface's
driver reads its own stream and usage shape (TTFT, prompt, cached and completion tokens), turns
2+ of every surface read most of their prompt from the cache, and the surfaces do not share
conversations (each has its own seed)."""

from __future__ import annotations

import asyncio

from benchmarks.protocols import SURFACES, run


def test_every_surface_is_measured_from_its_own_stream(agentrt_server):
    wl = {"sessions": 2, "turns": 3, "system_tokens": 200, "tool_result_tokens": 30, "reply_tokens": 4}
    results = asyncio.run(run(agentrt_server.url, None, wl, list(SURFACES), None))
    assert set(results) == set(SURFACES)
    for name, r in results.items():
        records = r["records"]
        assert len(records) == 6 and {(x["conversation"], x["turn"]) for x in records} == \
            {(s, t) for s in range(2) for t in range(3)}, name
        for x in records:
            assert 0 < x["ttft_s"] <= x["latency_s"], (name, x)
            assert x["prompt_tokens"] > 200 and 1 <= x["completion_tokens"] <= 4, (name, x)
            assert 0 <= x["cached_tokens"] < x["prompt_tokens"], (name, x)
        # each turn resends (or continues) the last one: its prompt grows, and its history is cached
        for s in range(2):
            rows = sorted((x for x in records if x["conversation"] == s), key=lambda x: x["turn"])
            assert rows[0]["prompt_tokens"] < rows[1]["prompt_tokens"] < rows[2]["prompt_tokens"], (name, rows)
        assert r["cached_fraction_turns2plus"] > 0.6, (name, r["cached_fraction_turns2plus"])
