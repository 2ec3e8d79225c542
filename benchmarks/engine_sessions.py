"""Agentic sessions on the engine vs. a baseline that recomputes every prompt.

S concurrent sessions share a ~1,500-token system prompt with tool definitions;
each runs T turns, every turn appending a ~200-token tool result and asking for a
32-token reply at temperature 0. Sessions are independent: each submits its next
turn as soon as its previous reply is complete (continuous batching mixes them).

The baseline runs the same workload with transformers ``generate`` on the same
GGUF weights, all sessions' turn t batched together (left padding), recomputing
the whole prompt every turn. Its TTFT is measured at the first call of a logits
processor, i.e. right after the prefill forward.

    python benchmarks/engine_sessions.py --json out/engine_sessions.json [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrt.bench.progress import bar  # noqa: E402
from benchmarks import harness  # noqa: E402
from agentrt.bench.text import system_prompt  # noqa: E402
from benchmarks.workload import AgenticWorkload, finished_turns  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.config import SPECULATIVE  # noqa: E402
from engine.types import SchedulingKey  # noqa: E402
from engine.tokenizer import encode_chat  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def run_engine(engine: LLMEngine, wl: AgenticWorkload, system: str) -> dict:
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=wl.reply_tokens, temperature=0, ignore_eos=True)
    history = {s: [{"role": "system", "content": system}] for s in range(wl.sessions)}
    turn = {s: 0 for s in range(wl.sessions)}
    live: dict[str, tuple[int, float, list[int], list[int]]] = {}  # rid -> (session, t0, prompt, out ids)
    ttft: dict[tuple[int, int], float] = {}
    replies: dict[tuple[int, int], list[int]] = {}
    computed = served = generated = prompt_total = 0

    def submit(s: int) -> None:
        history[s].extend(wl.turn_messages(tok, s, turn[s]))
        prompt = encode_chat(tok, history[s])
        # each turn names its session, as agentrt's serving layer does (the session scheduling policy reads it)
        rid = engine.add_request(prompt, params, key=SchedulingKey(session=f"s{s}", continuing=turn[s] > 0))
        live[rid] = (s, time.perf_counter(), prompt, [])

    start = time.perf_counter()
    progress = bar(wl.sessions * wl.turns, "engine", unit="turn")
    for s in range(wl.sessions):
        submit(s)
    while live:
        for s, out, ids in finished_turns(engine, live, turn, ttft, replies):
            prompt_total += out.prompt_tokens
            served += out.cached_tokens
            computed += out.prompt_tokens - out.cached_tokens
            generated += len(ids)
            history[s].append({"role": "assistant", "content": tok.decode(ids)})
            turn[s] += 1
            progress.update(1)
            if turn[s] < wl.turns:
                submit(s)
    wall = time.perf_counter() - start
    progress.close()
    return summarize(ttft, wl, wall, generated, prompt_total, computed, served) | {"_replies": replies}


def run_baseline(hf_model, tok, wl: AgenticWorkload, system: str) -> dict:
    """transformers generate, every session's turn t in one left-padded batch."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstCall(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    history = {s: [{"role": "system", "content": system}] for s in range(wl.sessions)}
    ttft: dict[tuple[int, int], float] = {}
    replies: dict[tuple[int, int], list[int]] = {}
    generated = prompt_total = 0
    start = time.perf_counter()
    for t in bar(wl.turns, "baseline", unit="turn", iterable=range(wl.turns)):
        prompts = []
        for s in range(wl.sessions):
            history[s].extend(wl.turn_messages(tok, s, t))
            prompts.append(encode_chat(tok, history[s]))
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        first = FirstCall()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=wl.reply_tokens,
                                    min_new_tokens=wl.reply_tokens, do_sample=False, pad_token_id=2,
                                    logits_processor=LogitsProcessorList([first]))
        for s in range(wl.sessions):
            ttft[(s, t)] = first.t - t0
            reply = out[s, width:].tolist()
            replies[(s, t)] = reply
            generated += len(reply)
            prompt_total += len(prompts[s])
            history[s].append({"role": "assistant", "content": tok.decode(reply)})
    wall = time.perf_counter() - start
    return summarize(ttft, wl, wall, generated, prompt_total, prompt_total, 0) | {"_replies": replies}


def summarize(ttft, wl, wall, generated, prompt_total, computed, served) -> dict:
    later = [v for (s, t), v in ttft.items() if t >= 1]
    per_turn = {t: [ttft[(s, t)] for s in range(wl.sessions)] for t in range(wl.turns)}
    return {
        "ttft_p50_s_turn1": statistics.median(per_turn[0]),
        "ttft_p50_s_turns2plus": statistics.median(later) if later else None,
        "ttft_p99_s_turns2plus": pct(later, 99) if later else None,
        "ttft_p50_s_by_turn": [statistics.median(per_turn[t]) for t in range(wl.turns)],
        "ttft_p99_s_by_turn": [pct(per_turn[t], 99) for t in range(wl.turns)],
        "prompt_tokens": prompt_total,
        "prompt_tokens_computed": computed,
        "prompt_tokens_from_cache": served,
        "cached_token_fraction": served / prompt_total if prompt_total else 0.0,
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "total_tokens_per_s": (generated + prompt_total) / wall,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap, repeats=None, json_required=True)
    ap.add_argument("--quick", action="store_true", help="4 sessions x 3 turns")
    ap.add_argument("--sessions", type=int, default=8, help="agent sessions in the workload")
    ap.add_argument("--turns", type=int, default=8, help="turns per session")
    ap.add_argument("--system-tokens", type=int, default=1500, help="tokens of the shared system prompt")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="engine dtype")
    ap.add_argument("--speculative", default="suffix", choices=list(SPECULATIVE),
                    help="speculative decoding (default: what agentrt serve runs)")
    ap.add_argument("--no-baseline", action="store_true", help="engine only")
    ap.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "session"],
                    help="the engine's admission order (EngineConfig.scheduling_policy; default: agentrt's)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for both runs (default: torch's choice); 1 keeps "
                         "figures meaningful on a machine shared with other jobs")
    args = ap.parse_args(argv)
    run = harness.Run(args, __file__, argv)
    if args.quick:
        args.sessions, args.turns = 4, 3
    if args.threads:
        torch.set_num_threads(args.threads)
    wl = AgenticWorkload(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens)
    engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_tokens=131072, max_batched_tokens=512,
                                    speculative=args.speculative, scheduling_policy=args.scheduling_policy))
    system = system_prompt(engine.tokenizer, wl.system_tokens)
    print(f"workload: {wl}; torch threads {torch.get_num_threads()}", flush=True)
    ours = run_engine(engine, wl, system)
    print(f"engine:   TTFT p50 turns 2+ {ours['ttft_p50_s_turns2plus']:.3f}s, "
          f"cached {ours['cached_token_fraction']:.1%}, {ours['tokens_per_s']:.1f} tok/s", flush=True)
    result = {"workload": vars(wl), "dtype": args.dtype, "speculative": args.speculative,
              "scheduling_policy": args.scheduling_policy, "engine": ours}
    if not args.no_baseline:
        import transformers
        from engine.loader.gguf_loader import default_model_path
        path = default_model_path()
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path),
            dtype=torch.float32 if args.dtype == "float32" else torch.bfloat16).eval()
        base = run_baseline(hf, engine.tokenizer, wl, system)
        # greedy parity: the first turn of every session has the same prompt in both runs
        same = [ours["_replies"][(s, 0)] == base["_replies"][(s, 0)] for s in range(wl.sessions)]
        all_same = sum(ours["_replies"][k] == base["_replies"][k] for k in ours["_replies"])
        result |= {
            "baseline": base,
            "parity_ok": all(same),
            "parity_first_turns_identical": sum(same),
            "parity_all_turns_identical": all_same,
            "ttft_speedup_turns2plus": base["ttft_p50_s_turns2plus"] / ours["ttft_p50_s_turns2plus"],
            "throughput_speedup": ours["tokens_per_s"] / base["tokens_per_s"],
        }
        print(f"baseline: TTFT p50 turns 2+ {base['ttft_p50_s_turns2plus']:.3f}s, {base['tokens_per_s']:.1f} tok/s")
        print(f"TTFT speedup (turns 2+) {result['ttft_speedup_turns2plus']:.1f}x, "
              f"throughput speedup {result['throughput_speedup']:.1f}x, parity_ok {result['parity_ok']} "
              f"({all_same}/{len(ours['_replies'])} replies identical)")
    for part in ("engine", "baseline"):
        if part in result:
            result[part].pop("_replies")
    run.write(result, engine=engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
