"""agentrt bench without a server: seeded workloads of real text, trace prefixes, figures, metrics parsing."""

from __future__ import annotations

import json
import random

import pytest

from agentrt.bench import prom
from agentrt.bench.ablation import LADDER, AblationOptions, factors
from agentrt.bench.bench import load_tokenizer
from agentrt.bench.summary import SLO, best_rate, percentile, summarize
from agentrt.bench.text import _words_encoding_each, words
from agentrt.bench.trace import BlockText, plan_trace
from agentrt.bench.workload import LogNormal, plan_sessions, preset


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_presets_are_seeded_and_text_round_trips(tokenizer):
    spec = preset("swe").with_overrides(max_turns=4, max_reply_tokens=16)
    a, b = plan_sessions(spec, 3, tokenizer, seed=7), plan_sessions(spec, 3, tokenizer, seed=7)
    assert a == b
    assert a != plan_sessions(spec, 3, tokenizer, seed=8)
    assert {p.system for p in a} == {a[0].system}  # one agent type: one shared template
    assert abs(len(tokenizer.encode(a[0].system)) - 1500) <= 2
    for p in a:
        assert 2 <= p.n_calls <= 4 and all(t.max_tokens <= 16 for t in p.turns)
        for t in p.turns:
            assert tokenizer.decode(tokenizer.encode(t.text)) == t.text
    assert [p.arrival_s for p in a] == sorted(p.arrival_s for p in a) and a[0].arrival_s == 0.0


class Trigrams:
    """A tokenizer whose count of a text is not the sum of its words' (a token every three characters, spaces
    included): ``words`` must notice and fall back to encoding every prefix."""

    def encode(self, text: str) -> list[int]:
        return list(range((len(text) + 2) // 3))


class Counting:
    """The real tokenizer, counting how many texts of more than one word it encoded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.texts = tokenizer, 0

    def encode(self, text: str) -> list[int]:
        self.texts += " " in text.removeprefix("the ")
        return self.tokenizer.encode(text)


@pytest.mark.parametrize("n_tokens", [1, 5, 31, 100, 1500])
def test_words_are_the_text_of_encoding_every_prefix(tokenizer, n_tokens):
    """The counted-by-word path (the real tokenizer) and the fallback (Trigrams) give the text, and leave the
    generator in the state, that encoding the whole text after every draw and every trim gives."""
    for tok in (tokenizer, Trigrams()):
        for seed in range(2):
            fast, slow = random.Random(seed), random.Random(seed)
            text = words(fast, tok, n_tokens)
            assert text == _words_encoding_each(slow, tok, n_tokens)
            assert fast.getstate() == slow.getstate()
            assert len(tok.encode(text)) <= n_tokens or " " not in text
    counting = Counting(tokenizer)
    words(random.Random(0), counting, n_tokens)
    assert counting.texts <= 4   # the decisive prefixes only: the words' counts decided the rest


def test_toolagent_mix(tokenizer):
    plans = plan_sessions(preset("toolagent"), 80, tokenizer, seed=1)
    share = {name: sum(p.agent == name for p in plans) / len(plans) for name in ("tool-6k", "tool-2.5k", "chat")}
    assert 0.4 < share["tool-6k"] < 0.7 and 0.04 < share["tool-2.5k"] < 0.26
    six = [p for p in plans if p.agent == "tool-6k"]
    assert abs(len(tokenizer.encode(six[0].system)) - 6000) <= 2
    assert sum(p.n_calls == 1 for p in six) / len(six) > 0.8  # mostly single-turn
    assert max(t.max_tokens for p in six for t in p.turns) <= 16


def test_lognormal_clamps():
    d = LogNormal(36, 0.6, 2, 200)
    rng = random.Random(0)
    xs = sorted(d.draw(rng) for _ in range(2001))
    assert 2 <= xs[0] and xs[-1] <= 200 and 30 <= xs[1000] <= 42
    with pytest.raises(ValueError):
        LogNormal(0)


def test_trace_blocks_share_prefixes(tokenizer, tmp_path):
    # block_tokens 50 scales input lengths by 50/512: 1024 -> 100 tokens, 717 -> 70, 205 -> 20
    records = [{"timestamp": 1000, "input_length": 1024, "output_length": 5, "hash_ids": [11, 12]},
               {"timestamp": 3000, "input_length": 717, "output_length": 900, "hash_ids": [11, 13]},
               {"timestamp": 4000, "input_length": 205, "output_length": 3, "hash_ids": [11]}]
    plans = plan_trace(records, tokenizer, block_tokens=50, time_scale=0.5, max_reply_tokens=64)
    t0, t1, t2 = (p.turns[0].text for p in plans)
    assert t0.startswith(t2) and t1.startswith(t2)  # hash id 11 is the same text everywhere
    first_block = BlockText(tokenizer, 50).text(11, 50)
    assert t0.startswith(first_block) and t1.startswith(first_block) and t0 != t1
    for text, n in ((t0, 100), (t1, 70), (t2, 20)):
        assert abs(len(tokenizer.encode(text)) - n) <= 2
    assert [p.arrival_s for p in plans] == [0.0, 1.0, 1.5]
    assert [p.turns[0].max_tokens for p in plans] == [5, 64, 3]


def _call(ttft, tpot, out, prompt=100, cached=50, ok=True, end=1.0):
    return {"ok": ok, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": ttft + (out - 1) * (tpot or 0), "end_s": end,
            "completion_tokens": out, "prompt_tokens": prompt, "cached_tokens": cached}


def test_summary_figures():
    calls = [_call(0.5, 0.1, 10), _call(3.0, 0.1, 10), _call(0.5, 0.5, 10), _call(0.2, None, 1, end=2.0),
             {"ok": False, "end_s": 2.0}]
    sessions = [{"ok": True, "jct_s": 4.0}, {"ok": False, "jct_s": 1.0}]
    s = summarize(calls, sessions, wall_s=2.0, slo=SLO(1.0, 0.2, 0.5), workers=2, price_per_worker_hour=3.6)
    assert (s["calls"], s["calls_ok"], s["calls_failed"]) == (5, 4, 1)
    assert s["slo_met_calls"] == 2 and s["goodput_rps"] == 1.0 and s["attainment"] == 0.4 and not s["meets_slo"]
    assert s["completion_tokens"] == 31 and s["prompt_tokens"] == 400 and s["hit_rate"] == 0.5
    assert s["output_tok_s"] == 15.5 and s["output_tok_s_per_worker"] == 7.75 and s["total_tok_s"] == 215.5
    assert s["cost"]["dollars"] == pytest.approx(3.6 * 2 * 2.0 / 3600)
    assert s["cost"]["per_million_output_tokens"] == pytest.approx(0.004 / 31 * 1e6)
    assert s["jct_s"]["p50"] == 4.0 and percentile([1, 2, 3, 4], 50) == 2.5
    assert best_rate([{"rate": 1, "summary": {"meets_slo": True}}, {"rate": 2, "summary": {"meets_slo": True}},
                      {"rate": 4, "summary": {"meets_slo": False}}]) == 2


def test_summary_without_usage():
    s = summarize([_call(0.5, 0.1, 10, prompt=None, cached=None)], [], 1.0, SLO())
    assert s["prompt_tokens"] is None and s["hit_rate"] is None and s["total_tok_s"] is None


def test_prometheus_counters():
    text = "\n".join([
        "# TYPE agentrt_prompt_tokens counter", "agentrt_prompt_tokens_total 120.0",
        "# TYPE agentrt_prefix_cache_hit_tokens counter", "agentrt_prefix_cache_hit_tokens_total 48.0",
        "# TYPE agentrt_generation_tokens counter", "agentrt_generation_tokens_total 9.0",
        "# TYPE agentrt_http_requests counter",
        'agentrt_http_requests_total{route="/v1/chat/completions",status="200"} 3.0',
        'agentrt_http_requests_total{route="/v1/chat/completions",status="429"} 1.0',
        'agentrt_http_requests_total{route="/health",status="200"} 7.0', ""])
    c = prom.parse_counters(text)
    assert c == {"prompt_tokens": 120.0, "cached_tokens": 48.0, "completion_tokens": 9.0, "requests_ok": 3.0}
    assert prom.delta(c, {**c, "prompt_tokens": 150.0})["prompt_tokens"] == 30.0
    assert prom.parse_counters("")["prompt_tokens"] is None


def test_ladder_and_factors():
    assert [s.name for s in LADDER] == ["rr-nocache", "rr-cache", "prefix-route", "sess-nopin", "sess-pin"]
    assert LADDER[0].worker_flags(1) == ("--enable-prefix-cache", "false")
    with pytest.raises(ValueError, match="unknown ladder steps"):
        AblationOptions(steps=("nope",)).ladder()
    run = lambda g, t, p99: {"run": {"summary": {"goodput_rps": g, "output_tok_s": t, "ttft_s": {"p99": p99}}}}
    steps = [{"step": s.__dict__, **run(g, t, p)} for s, (g, t, p) in
             zip(LADDER[:3], [(0.1, 10, 8.0), (0.2, 15, 4.0), (0.4, 30, 2.0)])]
    f = {(x["step"], x["base"]): x for x in factors(steps)}
    assert f[("rr-cache", "rr-nocache")]["goodput"] == 2.0
    assert f[("prefix-route", "rr-cache")]["throughput"] == 2.0
    assert f[("prefix-route", "rr-nocache")]["goodput"] == pytest.approx(4.0)
    assert f[("prefix-route", "rr-nocache")]["ttft_p99"] == 4.0
    json.dumps(factors(steps))
