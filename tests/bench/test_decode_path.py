"""benchmarks/decode_path.py's arithmetic: a decode run's rate from its token times, the per-side medians
over runs, milliseconds per token and what each layer of the serving path adds."""

from __future__ import annotations

import pytest

from benchmarks.decode_path import prompts, rate, summarize


def test_rate_counts_tokens_after_the_first_over_the_time_between():
    assert rate([0.0, 0.01, 0.02, 0.05]) == pytest.approx(3 / 0.05)
    assert rate([1.0, 1.0]) is None and rate([1.0]) is None and rate([]) is None


def test_prompts_are_the_same_within_a_repeat_and_differ_between_repeats():
    assert prompts(0, 3) == prompts(0, 3) and len(set(prompts(0, 3))) == 3
    assert not set(prompts(0, 3)) & set(prompts(1, 3))


def test_summary_medians_ms_per_token_and_layer_costs():
    out = summarize({"engine": [[100.0, 140.0, 120.0], [130.0, None, 110.0]],
                     "async": [[100.0, 100.0, 100.0], [90.0, 110.0, 100.0]],
                     "http": [[80.0, 80.0, 90.0], [None, None, None]]})
    assert out["sides"]["engine"]["tok_s"] == {"runs": [120.0, 120.0], "median": 120.0, "min": 120.0, "max": 120.0}
    assert out["sides"]["http"]["tok_s"]["runs"] == [80.0, None]
    ms = out["ms_per_token"]
    assert ms == pytest.approx({"engine": 1000 / 120, "async": 10.0, "http": 12.5})
    assert out["ms_added"] == pytest.approx({"async_over_engine": 10.0 - 1000 / 120, "http_over_async": 2.5,
                                            "http_over_engine": 12.5 - 1000 / 120})
