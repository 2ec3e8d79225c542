"""What a KV byte budget holds with 8-bit pages against 16-bit pages, on a multi-session agent workload.

Both sides get the same pool budget in bytes (``EngineConfig.kv_cache_memory_bytes``) and run the same
workload in-process on the default model: S agent sessions, each with its own system prompt, take turns
round-robin (session 0's turn t, session 1's turn t, ...), every turn appending a tool result to the
session's history and decoding a short greedy reply. The budget is sized so that the sessions' contexts
overflow the 16-bit pool. Reported per side:

- ``tokens_held``: tokens the pool holds at that budget;
- ``cached_fraction``: prompt tokens of turns 2+ served from the prefix cache over all their prompt tokens;
- ``sessions_warm``: per round from the second on, the sessions whose whole previous context (all but a
  partial last page) was still cached when their next turn came, averaged over rounds;
- ``prefill_tokens``: prompt tokens computed; ``wall_s``.

Both sides compute in float32 (bfloat16 matmuls are emulated, slowly, on CPUs without AVX512-BF16; the
comparison is about bytes): ``bfloat16`` stores the float32 activations' K/V rounded to bfloat16, ``int8``
as 8-bit values with a scale per token and KV head.

    python benchmarks/kv_capacity.py --json out/kv_capacity.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrt.bench.text import system_prompt  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.workload import AgenticWorkload  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.tokenizer import encode_chat  # noqa: E402
from engine.kv_pool import kv_bytes_per_token  # noqa: E402

SIDES = ("int8", "bfloat16")


def run_side(kv_cache_dtype: str, budget: int, wl: AgenticWorkload) -> dict:
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget,
                                    max_batched_tokens=256, speculative="off"))
    try:
        tok, P = engine.tokenizer, engine.config.page_size
        params = SamplingParams(max_tokens=wl.reply_tokens, temperature=0, ignore_eos=True)
        history = {s: [{"role": "system", "content": system_prompt(tok, wl.system_tokens, seed=s)}]
                   for s in range(wl.sessions)}
        last_len: dict[int, int] = {}
        later_prompt = later_cached = computed = 0
        warm_per_round = []
        start = time.perf_counter()
        for t in range(wl.turns):
            warm = 0
            for s in range(wl.sessions):
                history[s].extend(wl.turn_messages(tok, s, t))
                prompt = encode_chat(tok, history[s])
                [r] = engine.generate([prompt], params)
                computed += r.prompt_tokens - r.cached_tokens
                if t > 0:
                    later_prompt += r.prompt_tokens
                    later_cached += r.cached_tokens
                    warm += r.cached_tokens >= (last_len[s] // P) * P
                last_len[s] = len(prompt) + len(r.token_ids)
                history[s].append({"role": "assistant", "content": tok.decode(r.token_ids)})
            if t > 0:
                warm_per_round.append(warm)
        return {"tokens_held": engine.pool.capacity * P, "bytes_per_token": engine.kv.bytes_per_token,
                "pool_bytes": engine.pool.num_pages * P * engine.kv.bytes_per_token,
                "cached_fraction": round(later_cached / later_prompt, 4) if later_prompt else 0.0,
                "sessions_warm": round(sum(warm_per_round) / len(warm_per_round), 2) if warm_per_round else 0.0,
                "sessions_warm_per_round": warm_per_round, "sessions": wl.sessions,
                "working_set_tokens": sum(last_len.values()), "prefill_tokens": computed,
                "wall_s": round(time.perf_counter() - start, 1)}
    finally:
        engine.close()


def budget_for(wl: AgenticWorkload, fraction: float) -> int:
    """A byte budget whose 16-bit pool holds ``fraction`` of the sessions' final contexts (estimated
    from the workload's sizes, with ~30 tokens of chat template a turn), for the default model."""
    per_session = wl.system_tokens + wl.turns * (wl.tool_result_tokens + wl.reply_tokens + 30)
    return int(fraction * wl.sessions * per_session * kv_bytes_per_token(30, 3, 64, torch.bfloat16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(ap, repeats=None)
    ap.add_argument("--quick", action="store_true", help="4 sessions x 3 turns (a few minutes on 2 shared cores)")
    ap.add_argument("--fraction", type=float, default=0.6,
                    help="the 16-bit pool holds this fraction of the sessions' contexts")
    args = ap.parse_args()
    run = harness.Run(args, __file__)
    wl = (AgenticWorkload(sessions=4, turns=3, system_tokens=300, tool_result_tokens=100, reply_tokens=4)
          if args.quick else AgenticWorkload(sessions=8, turns=4, system_tokens=600, tool_result_tokens=150,
                                             reply_tokens=8))
    budget = budget_for(wl, args.fraction)
    result = {"pool_budget_bytes": budget, "activations": "float32", "workload": wl.__dict__}
    for side in SIDES:
        result[side] = run_side(side, budget, wl)
        print(side, json.dumps(result[side]), flush=True)
    result["tokens_held_ratio"] = round(result["int8"]["tokens_held"] / result["bfloat16"]["tokens_held"], 3)
    print(json.dumps(result, indent=2))
    run.write(result)


if __name__ == "__main__":
    main()
