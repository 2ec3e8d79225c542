"""benchmarks/vs_llamacpp.py without servers or a build: the summary of hand-made records, the
ratios, the table, and the stream parser on a llama-server-shaped stream."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pathlib import Path

from benchmarks.vs_llamacpp import (cached_tokens_of, chat_body, compare, decode_tok_s, format_table,
                                    llama_threads, stream_chat, summarize_side)

USAGE_SRC = "usage.prompt_tokens_details.cached_tokens"


def rec(session, turn, ttft, e2e, prompt, cached, completion=32, source=USAGE_SRC):
    return {"session": session, "turn": turn, "ttft_s": ttft, "e2e_s": e2e, "prompt_tokens": prompt,
            "cached_tokens": cached, "cached_source": source if cached is not None else None,
            "completion_tokens": completion}


RECORDS = [
    rec(0, 0, 1.0, 2.0, 1000, 0), rec(1, 0, 3.0, 4.0, 1000, 500),
    rec(0, 1, 0.5, 1.5, 1800, 1000), rec(1, 1, 0.25, 1.25, 1800, 1600, completion=30),
    rec(0, 2, 0.75, 2.0, 2600, 1800), rec(1, 2, 1.25, 2.5, 2600, 2400),
]
DECODE = [{"completion_tokens": 256, "ttft_s": 0.5, "e2e_s": 5.6},    # 255 / 5.1 = 50
          {"completion_tokens": 121, "ttft_s": 1.0, "e2e_s": 3.0},    # 120 / 2 = 60
          {"completion_tokens": 41, "ttft_s": 0.0, "e2e_s": 1.0},     # 40
          {"completion_tokens": 1, "ttft_s": 0.2, "e2e_s": 0.2}]      # no rate from one token


def test_summary_of_hand_made_records():
    s = summarize_side(RECORDS, wall_s=10.0, decode_runs=DECODE)
    assert s["requests"] == 6
    assert s["ttft_p50_s_turns2plus"] == pytest.approx(0.625)     # (0.5 + 0.75) / 2
    assert s["ttft_p90_s_turns2plus"] == pytest.approx(1.1)       # 0.75 + 0.7 * 0.5
    assert s["ttft_p50_s_turn1"] == pytest.approx(2.0)
    assert s["e2e_p50_s_turns2plus"] == pytest.approx(1.75)
    assert s["decode_tok_s_b1_runs"] == pytest.approx([50.0, 60.0, 40.0])
    assert s["decode_tok_s_b1"] == pytest.approx(50.0)
    assert s["decode_completion_tokens"] == [256, 121, 41, 1]
    assert s["prompt_tokens_turns2plus"] == 8800
    assert s["cached_tokens_turns2plus"] == 6800
    assert s["cached_fraction"] == pytest.approx(6800 / 8800)
    assert s["cached_fraction_source"] == USAGE_SRC
    assert s["max_prompt_tokens"] == 2600
    assert s["completion_tokens"] == 190
    assert s["completion_tokens_per_reply"] == [30, 32]
    assert s["output_tok_s"] == pytest.approx(19.0)
    assert [t["turn"] for t in s["per_turn"]] == [1, 2, 3]
    assert [t["cached_fraction"] for t in s["per_turn"]] == pytest.approx([0.25, 2600 / 3600, 4200 / 5200])
    assert [t["ttft_p50_s"] for t in s["per_turn"]] == pytest.approx([2.0, 0.375, 1.0])
    assert [t["prompt_tokens_mean"] for t in s["per_turn"]] == pytest.approx([1000, 1800, 2600])


def test_cached_fraction_unavailable_when_a_server_does_not_report_it():
    records = [rec(0, 0, 1.0, 2.0, 1000, None), rec(0, 1, 0.5, 1.0, 1800, None)]
    s = summarize_side(records, wall_s=3.0, decode_runs=[])
    assert s["cached_fraction"] is None
    assert s["cached_tokens_turns2plus"] is None
    assert s["cached_fraction_source"] == "unavailable"
    assert s["decode_tok_s_b1"] is None
    assert s["prompt_tokens_turns2plus"] == 1800


def test_cached_tokens_prefers_usage_then_llama_timings():
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": 7}}, {"cache_n": 9}) == (7, USAGE_SRC)
    assert cached_tokens_of({"prompt_tokens": 10}, {"cache_n": 9, "prompt_n": 1}) == (9, "timings.cache_n")
    assert cached_tokens_of({"prompt_tokens": 10}, None) == (None, None)


def test_decode_rate_and_ratios_per_repeat():
    assert decode_tok_s(33, 1.0, 2.0) == pytest.approx(32.0)
    assert decode_tok_s(1, 1.0, 2.0) is None
    assert decode_tok_s(10, 2.0, 2.0) is None
    runs = {"agentrt": [{"wall_s": 30.0, "decode_tok_s_b1": 20.0}, {"wall_s": 10.0, "decode_tok_s_b1": 30.0}],
            "llama_server": [{"wall_s": 10.0, "decode_tok_s_b1": None}, {"wall_s": 20.0, "decode_tok_s_b1": 10.0}]}
    r = compare(runs)
    assert set(r) == {"agentrt"}
    assert r["agentrt"]["wall_s"] == {"runs": [3.0, 0.5], "median": 1.75, "min": 0.5, "max": 3.0}
    assert r["agentrt"]["decode_tok_s_b1"] == {"runs": [None, 3.0], "median": 3.0, "min": 3.0, "max": 3.0}
    assert compare({"agentrt": runs["agentrt"]}) == {}


def _result(sides_runs, peer=None):
    from benchmarks import harness
    from benchmarks.vs_llamacpp import FIGURES
    sides = {n: {"summary": {k: harness.spread(x.get(k) for x in rs) for k in FIGURES}, "runs": rs}
             for n, rs in sides_runs.items()}
    return {"sides": sides, "ratios": compare(sides_runs),
            "peer_flags": peer or {"flags": [], "why": None, "agentrt_equivalent": []}}


def test_table_shows_median_range_and_dashes_for_missing():
    a = summarize_side(RECORDS, 10.0, DECODE)
    b = dict(a, wall_s=14.0)
    text = format_table(_result({"agentrt": [a, dict(a, wall_s=12.0)]}))
    wall = next(line for line in text.splitlines() if line.startswith("wall (s)"))
    assert wall.split()[2:] == ["11.0", "[10.0-12.0]"]
    text = format_table(_result({"agentrt": [a], "llama_server": [b]}))
    wall = next(line for line in text.splitlines() if line.startswith("wall (s)"))
    assert wall.split()[2:] == ["10.0", "14.0", "0.71"]
    spec_off = next(line for line in text.splitlines() if line.startswith("decode b1 tok/s, spec off"))
    assert spec_off.split()[-3:] == ["-", "-", "-"]


def test_table_says_beside_the_figures_when_llama_server_ran_with_the_crash_fallback():
    a = summarize_side(RECORDS, 10.0, DECODE)
    peer = {"flags": ["--no-repack"], "why": "its defaults were killed by signal 11 at start-up",
            "agentrt_equivalent": ["--dtype", "float32"]}
    text = format_table(_result({"agentrt": [a], "llama_server": [a], "agentrt_float32": [a]}, peer))
    assert "llama_server (--no-repack)" in text.splitlines()[0]
    assert text.splitlines()[-1].startswith("llama-server ran with --no-repack (its defaults were killed by signal 11")
    assert "agentrt_float32 is agentrt with bf16 off" in text
    text = format_table(_result({"agentrt": [a], "llama_server": [a]}, peer))
    assert "NOT A HEADLINE" in text
    assert "ran with" not in format_table(_result({"agentrt": [a], "llama_server": [a]}))


def test_decode_prompts_are_distinct_over_repeats_and_runs():
    from benchmarks.vs_llamacpp import decode_prompts
    prompts = [p for r in range(4) for p in decode_prompts(r, 3)]
    assert len(set(prompts)) == 12 and decode_prompts(1, 3) == prompts[3:6]
    with pytest.raises(ValueError, match="distinct prompts"):
        decode_prompts(8, 3)


def test_side_commands_add_the_float32_side_only_when_llama_needs_its_fallback():
    import argparse
    from benchmarks.vs_llamacpp import EQUIVALENT_FLAGS, side_commands
    args = argparse.Namespace(model=None, only=None, agentrt_flag=[], llama_flag=[], concurrency=2, cpu="native")
    plain = side_commands(args, "llama-server", "m.gguf", {"flags": [], "agentrt_equivalent": []})
    assert list(plain) == ["agentrt", "llama_server"]
    equivalent = EQUIVALENT_FLAGS["--no-repack"]
    fb = side_commands(args, "llama-server", "m.gguf", {"flags": ["--no-repack"], "agentrt_equivalent": equivalent})
    assert list(fb) == ["agentrt", "llama_server", "agentrt_float32"]
    assert fb["llama_server"][-1] == "--no-repack" and fb["agentrt_float32"][-4:] == equivalent
    # like llama-server's unrepacked kernels: bf16 (AMX) off, the file's 4-bit blocks kept (not dense float32)
    assert equivalent == ["--dtype", "float32", "--quantization", "gguf"]


def test_avx2_target_runs_agentrt_as_an_avx2_cpu_would_and_builds_llama_server_without_avx512():
    """--cpu x86-64-v3: agentrt runs with its defaults under AVX2-capped kernels, torch, oneDNN and MKL (so its
    dtype auto sees no native bf16); llama-server's cmake turns ggml's native detection off and AVX-512 off."""
    import argparse
    from benchmarks.llamacpp_build import build_dir, cmake_flags
    from benchmarks.vs_llamacpp import CPU_TARGETS, side_commands
    args = argparse.Namespace(model=None, only=None, agentrt_flag=["--x"], llama_flag=[], concurrency=2,
                              cpu="x86-64-v3")
    cmds = side_commands(args, "llama-server", "m.gguf", {"flags": [], "agentrt_equivalent": []})
    assert cmds["agentrt"][-2:] == ["{port}", "--x"]
    env = CPU_TARGETS["x86-64-v3"][0]
    assert env == {"AGENTRT_KERNEL_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    from engine.config import EngineConfig
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        assert EngineConfig(dtype="auto").resolved_dtype() == "float32"   # on this host too, whatever it has
    avx2, native = cmake_flags("x86-64-v3"), cmake_flags("native")
    assert "-DGGML_NATIVE=OFF" in avx2 and "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AVX2=ON" in avx2
    assert "-DGGML_NATIVE=ON" in native and not any("AVX512" in f for f in native)
    assert build_dir(Path("r"), "native") != build_dir(Path("r"), "x86-64-v3")


def test_llama_threads_from_log():
    log = "0.00.312.167 I cmn          init: llama threadpool init, n_threads = 2\n"
    assert llama_threads(log) == 2
    assert llama_threads("system_info: n_threads = 3 (n_threads_batch = 3) / 4 | CPU : SSE3 = 1 |") == 3
    assert llama_threads("no such line") is None


def test_chat_body_asks_for_exactly_max_tokens_greedy_with_usage():
    body = chat_body("m", [{"role": "user", "content": "hi"}], 32)
    assert body["max_tokens"] == 32 and body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_stream_parser_on_a_llama_server_shaped_stream():
    """Content deltas, a finish chunk, then usage with cached tokens and llama's timings, then [DONE]."""
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
              {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
              {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 120, "completion_tokens": 2, "total_tokens": 122,
                                        "prompt_tokens_details": {"cached_tokens": 100}},
               "timings": {"cache_n": 100, "prompt_n": 20, "predicted_n": 2, "prompt_ms": 5.0}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def call():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await stream_chat(http, "http://x", chat_body("m", [{"role": "user", "content": "hi"}], 2))

    res = asyncio.run(call())
    assert seen["ignore_eos"] is True
    assert res["reply"] == "Hello"
    assert (res["prompt_tokens"], res["completion_tokens"], res["cached_tokens"]) == (120, 2, 100)
    assert res["cached_source"] == USAGE_SRC
    assert res["timings"] == {"prompt_n": 20, "cache_n": 100, "predicted_n": 2}
    assert 0 <= res["ttft_s"] <= res["e2e_s"]


def _stream_chat_answered(response: httpx.Response) -> dict:
    async def call():
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: response)) as http:
            return await stream_chat(http, "http://x", chat_body("m", [{"role": "user", "content": "hi"}], 2))

    return asyncio.run(call())


def test_stream_without_usage_is_an_error():
    body = 'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n'
    with pytest.raises(RuntimeError, match="no usage"):
        _stream_chat_answered(httpx.Response(200, text=body, headers={"content-type": "text/event-stream"}))


def test_an_answer_that_is_not_an_event_stream_is_an_error():
    body = 'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n'
    with pytest.raises(RuntimeError, match="text/event-stream"):
        _stream_chat_answered(httpx.Response(200, text=body))
