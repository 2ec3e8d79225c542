"""``agentrt bench --duration`` against a real ``agentrt serve``: a run that would take minutes stops,
says so, and its figures are those of the turns that completed; the planned volume and the estimate
computed by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrt.bench import BenchOptions, run_bench
from agentrt.bench.bench import build_workload, load_tokenizer
from agentrt.bench.estimate import (ProbeResult, SessionVolume, TurnVolume, Volume, describe, estimate_s,
                                    plan_volume)
from agentrt.bench.summary import SLO, percentile
from agentrt.bench.workload import AgentType, LogNormal, SessionPlan, TurnPlan, WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]


class WordTokenizer:
    """One token per whitespace-separated word, so the expected counts can be worked out by hand."""

    def encode(self, text: str) -> list[str]:
        return text.split()


def _turn(n_words: int, max_tokens: int, think_s: float) -> TurnPlan:
    return TurnPlan(" ".join(["word"] * n_words), max_tokens, think_s)


def test_plan_volume_and_estimate_by_hand():
    agent = AgentType("a", 1.0, 5, LogNormal(1), LogNormal(1), LogNormal(1), LogNormal(1))
    spec = WorkloadSpec("hand", (agent,), compact_at_tokens=15, compact_to_tokens=4)
    system = "s1 s2 s3 s4 s5"
    plans = [SessionPlan(0, "a", system, 0.0, (_turn(3, 2, 1.0), _turn(4, 2, 2.0), _turn(2, 3, 5.0))),
             SessionPlan(1, "a", system, 10.0, (_turn(1, 1, 0.0),))]
    v = plan_volume(plans, spec, WordTokenizer())
    a, b = v.sessions
    # session 0, turn 0: the template is new (5) + 3 words; prompt 5 + 3; context after it 8 + 2 = 10
    # turn 1: 4 new words; prompt 5 + (3 + 2) + 4 = 14; context 14 + 2 = 16 > 15, so turn 2 compacts:
    # the summary ("Summary of the work so far:" is 6 words, + 4) joins the 2 words: 12 new, prompt 5 + 12
    assert [(t.new_prompt_tokens, t.prompt_tokens, t.output_tokens, t.think_s) for t in a.turns] == \
        [(8, 8, 2, 1.0), (4, 14, 2, 2.0), (12, 17, 3, 0.0)]
    # session 1 shares the template, so only its own word is new
    assert [(t.new_prompt_tokens, t.prompt_tokens, t.output_tokens) for t in b.turns] == [(1, 6, 1)]
    assert (v.n_turns, v.new_prompt_tokens, v.prompt_tokens, v.output_tokens) == (4, 25, 45, 8)

    # 10 prefill tok/s, 2 decode tok/s: session 0 works 1.8 + 1.4 + 2.7 = 5.9 s, session 1 0.6 s;
    # serially 6.5 s, but session 1 arrives at 10 s: 10 + 0.6 = 10.6 s is the longer path
    rates = ProbeResult(prefill_tok_s=10.0, decode_tok_s=2.0, prompt_tokens=0, completion_tokens=0,
                        ttft_s=0.0, e2e_s=0.0)
    assert estimate_s(v, rates) == pytest.approx(10.6)
    # session 0's own path: 5.9 s of work + 3 s of pauses (none after its last turn) = 8.9 s
    early = Volume((a, SessionVolume(0.0, b.turns)))
    assert estimate_s(early, rates) == pytest.approx(8.9)
    # overlapping sessions with no pauses: the serial sum of the work dominates
    flat = Volume(tuple(SessionVolume(0.0, (TurnVolume(10, 10, 0, 0.0),)) for _ in range(3)))
    assert estimate_s(flat, rates) == pytest.approx(3.0)

    lines = describe(v, rates, 10.6, duration_s=60.0, grace_s=5.0)
    assert lines[0] == ("planned: 2 sessions, 4 turns, prompt tokens 25 new / 45 total, "
                        "output tokens up to 8 (max_tokens)")
    assert lines[1] == "estimated ~11 s (from probe: 10 prefill tok/s, 2.0 decode tok/s)"
    assert "60 s" in lines[2] and "65 s" in lines[2]
    assert describe(v, None, None, "HTTP 500: boom")[1] == "no estimate: the probe failed (HTTP 500: boom)"


def test_bounded_options_are_checked():
    with pytest.raises(ValueError, match="--duration must be > 0"):
        BenchOptions(target="http://x", duration_s=0)
    with pytest.raises(ValueError, match="--grace must be >= 0"):
        BenchOptions(target="http://x", duration_s=5, grace_s=-1)
    assert BenchOptions(target="http://x", preset="swe").sessions == 4  # the preset's default
    assert BenchOptions(target="http://x", preset="swe", sessions=9).sessions == 9


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _by_hand(calls: list[dict], wall_s: float, slo: SLO) -> dict:
    ok = [c for c in calls if c["ok"]]
    return {"ttft_p50": percentile([c["ttft_s"] for c in ok], 50),
            "tpot_p50": percentile([c["tpot_s"] for c in ok if c["tpot_s"] is not None], 50),
            "cached": sum(c["cached_tokens"] for c in ok), "prompt": sum(c["prompt_tokens"] for c in ok),
            "out": sum(c["completion_tokens"] for c in ok), "good": sum(1 for c in calls if slo.met(c)) / wall_s}


def test_duration_bounds_a_long_run(agentrt_server, tmp_path, tokenizer):
    url, duration = agentrt_server.url, 3.0
    # chat, 8 sessions arriving 4/s, short turns (a 120-token system prompt, 4-token replies) so some
    # complete even on a loaded CPU; the last two sessions are due after the bound and must never start
    flags = ["--preset", "chat", "--sessions", "8", "--rates", "4", "--max-turns", "40", "--think-scale", "0",
             "--max-reply-tokens", "4"]
    opts = BenchOptions(target=url, preset="chat", sessions=8, rates=(4.0,), max_turns=40, think_scale=0.0,
                        max_reply_tokens=4)
    _, plans = build_workload(opts, tokenizer, 4.0)
    assert sum(p.arrival_s >= duration for p in plans) == 2 and sum(p.n_calls for p in plans) == 38
    out = tmp_path / "bounded.json"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrt_cli", "bench", "--target", url, *flags, "--duration", str(duration),
         "--grace", "25", "--json", str(out), "--price-per-worker-hour", "2.0", "--slo-ttft-s", "60",
         "--slo-tpot-s", "10"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the plan and the estimate are printed on stderr at start; the report on stdout
    assert "planned: 8 sessions," in proc.stderr and "estimated ~" in proc.stderr, proc.stderr[-2000:]
    assert "prefill tok/s" in proc.stderr and "decode tok/s" in proc.stderr
    assert "planned:" not in proc.stdout and "\r" not in proc.stdout
    assert "--duration 3 s (grace 25 s), stopped early" in proc.stdout
    assert "the figures cover the completed turns only" in proc.stdout

    run = json.loads(out.read_text())["runs"][0]
    b, s, calls = run["bounded"], run["summary"], run["calls"]
    assert run["plan"]["volume"]["sessions"] == 8 and run["plan"]["probe"]["decode_tok_s"] > 0
    assert run["plan"]["estimate_s"] > plans[-1].arrival_s  # at least the last arrival
    assert b["duration_s"] == duration and b["stopped_early"] is True
    assert b["sessions_planned"] == 8 and b["sessions_started"] == len(run["sessions"]) < 8
    # no session and no turn started after the bound
    assert all(p["arrival_s"] < duration for p in run["sessions"])
    assert all(c["start_s"] < duration + 0.05 for c in calls)
    assert b["turns_completed"] == len(calls) == s["calls_ok"] > 0 and b["turns_failed"] == 0
    assert b["turns_completed"] + b["turns_cut"] + b["turns_not_started"] == b["turns_planned"]
    assert b["turns_not_started"] > 0 and b["sessions_completed"] <= b["sessions_started"]
    assert sum(x["calls"] for x in run["sessions"]) == b["turns_completed"]  # cut sessions count their turns
    assert s["wall_s"] < duration + 25 + 15  # stopped at the hard limit at the latest, not after the whole plan
    # every figure is of exactly the completed turns
    hand = _by_hand(calls, s["wall_s"], SLO(60, 10))
    assert s["ttft_s"]["p50"] == hand["ttft_p50"] and s["tpot_s"]["p50"] == hand["tpot_p50"]
    assert (s["cached_tokens"], s["prompt_tokens"], s["completion_tokens"]) == \
        (hand["cached"], hand["prompt"], hand["out"])
    assert s["goodput_rps"] == pytest.approx(hand["good"])
    worker_hours = s["wall_s"] / 3600
    assert s["cost"]["worker_hours_per_million_output_tokens"] == pytest.approx(worker_hours / hand["out"] * 1e6)
    assert s["cost"]["per_million_output_tokens"] == pytest.approx(2.0 * worker_hours / hand["out"] * 1e6)


def test_hard_limit_cuts_running_turns(agentrt_server, tokenizer):
    # no pauses and no grace: session 0 (a 1,500-token template, up to 40 turns) is mid-turn at the bound,
    # so that turn is cut; session 1 is due after the bound and never starts
    opts = BenchOptions(target=agentrt_server.url, preset="swe", sessions=2, rates=(0.05,), max_turns=40,
                        think_scale=0.0, max_reply_tokens=8, duration_s=2.0, grace_s=0.0, estimate=False,
                        progress=False, metrics_urls=())
    _, plans = build_workload(opts, tokenizer, 0.05)
    assert plans[1].arrival_s > 2.0 and plans[0].n_calls > 10
    run = run_bench(opts, tokenizer)["runs"][0]
    b = run["bounded"]
    assert b["stopped_early"] and b["turns_cut"] == 1 and b["sessions_started"] == 1
    (session,) = run["sessions"]
    assert session["cut"] and not session["ok"] and session["calls"] == b["turns_completed"] == len(run["calls"])
    assert all(c["ok"] for c in run["calls"])  # the cut turn is not a call (not a failure either)
    assert b["turns_not_started"] == b["turns_planned"] - b["turns_completed"] - 1
    assert run["plan"]["probe"] is None and run["plan"]["volume"]["turns"] == b["turns_planned"]
