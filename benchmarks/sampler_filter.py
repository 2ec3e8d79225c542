"""Top-p on a vocabulary-sized row: the nucleus looked for among candidates against sorting the whole row.

    python benchmarks/sampler_filter.py --repeats 2 --json OUT

Two sides filter the logits rows of sampled requests (engine/sampler.py ``probabilities``):

- ``full_sort``: ``top_k_top_p_full_sort``, the plain reference (the whole row sorted);
- ``candidates``: ``_top_k_top_p``, the engine's (the nucleus among the best ``NUCLEUS_CANDIDATES``
  tokens, more only when it is broader).

Both run in one process on one engine (the default configuration), swapped in as the module's filter,
in ABBA order over ``--repeats``, on the same work:

- ``per_row``: the rows the model gave while generating the sampled replies below (captured once, each
  side then filters every captured row); milliseconds per row, median of the side's passes;
- ``generate``: ``--batch`` sampled requests (``--temperature``, ``--top-p``, a seed each, ``ignore_eos``,
  speculation off) of ``--tokens`` tokens in one ``generate`` call; its wall time over ``--tokens``
  (milliseconds per batched step, the prompts' prefill included), and whether the two sides produced
  the same tokens (same seeds: they must, unless a nucleus boundary fell on a rounding tie).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from benchmarks import harness  # noqa: E402

SIDES = ("full_sort", "candidates")
PROMPTS = ("Write a short story about a lighthouse keeper.", "Describe a desert caravan at night.",
           "Explain how a bicycle gear works.", "List some ideas for a rainy afternoon.",
           "Tell me about the history of tea.", "Describe a mountain monastery in winter.",
           "What makes a good cup of coffee?", "Write a poem about a harbour at dawn.")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sampled requests decoded together (default 8)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request (default 48)")
    parser.add_argument("--temperature", type=float, default=0.8, help="of every request (default 0.8)")
    parser.add_argument("--top-p", type=float, default=0.95, help="of every request (default 0.95)")
    harness.add_common_args(parser, repeats=2)
    args = parser.parse_args(argv)
    if not 1 <= args.batch <= len(PROMPTS):
        parser.error(f"--batch must be 1..{len(PROMPTS)}, got {args.batch}")
    if args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    if not args.temperature > 0:   # 0 is greedy: no row would reach the filter
        parser.error(f"--temperature must be > 0 (sampled replies), got {args.temperature}")
    if not 0 < args.top_p < 1:     # 1 keeps every token: the filter returns at once on both sides
        parser.error(f"--top-p must be in (0, 1), got {args.top_p}")
    run = harness.Run(args, __file__, argv)

    from engine import EngineConfig, LLMEngine, SamplingParams, sampler
    from engine.tokenizer import encode_chat

    filters = {"full_sort": sampler.top_k_top_p_full_sort, "candidates": sampler._top_k_top_p}
    engine = LLMEngine(EngineConfig(speculative="off"))
    prompts = [encode_chat(engine.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS[:args.batch]]

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=args.tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=1000 + i, ignore_eos=True)

    rows = []
    original = sampler.probabilities

    def capture(logits, p):
        rows.append(logits.detach().clone())
        return original(logits, p)

    sampler.probabilities = capture
    try:
        engine.generate(prompts, [params(i) for i in range(len(prompts))])
    finally:
        sampler.probabilities = original
    scaled = [r / args.temperature for r in rows]
    kept = [int((sampler._top_k_top_p(r, 0, args.top_p) != float("-inf")).sum()) for r in scaled]

    per_row: dict[str, list[float]] = {s: [] for s in SIDES}
    generate: dict[str, list[float]] = {s: [] for s in SIDES}
    outputs: dict[str, list] = {}
    for _, side in harness.ab_order(SIDES, args.repeats, args.order):
        fn = filters[side]
        t0 = time.perf_counter()
        for r in scaled:
            fn(r, 0, args.top_p)
        per_row[side].append((time.perf_counter() - t0) * 1000 / len(scaled))
        sampler._top_k_top_p = fn
        try:
            t0 = time.perf_counter()
            out = engine.generate(prompts, [params(i) for i in range(len(prompts))])
            generate[side].append((time.perf_counter() - t0) * 1000 / args.tokens)
        finally:
            sampler._top_k_top_p = filters["candidates"]
        outputs.setdefault(side, [o.token_ids for o in out])
    same = sum(a == b for a, b in zip(outputs["full_sort"], outputs["candidates"]))
    body = {
        "workload": {"batch": args.batch, "tokens": args.tokens, "temperature": args.temperature,
                     "top_p": args.top_p, "vocab": int(rows[0].shape[-1]), "rows_captured": len(rows),
                     "nucleus_size": {"median": statistics.median(kept), "min": min(kept), "max": max(kept)},
                     "candidates": sampler.NUCLEUS_CANDIDATES},
        "per_row_ms": {s: harness.spread(v) for s, v in per_row.items()},
        "generate_ms_per_step": {s: harness.spread(v) for s, v in generate.items()},
        "per_row_speedup": statistics.median(per_row["full_sort"]) / statistics.median(per_row["candidates"]),
        "generate_speedup": statistics.median(generate["full_sort"]) / statistics.median(generate["candidates"]),
        "same_tokens": f"{same}/{len(prompts)} requests",
    }
    print(f"per row: full sort {body['per_row_ms']['full_sort']['median']:.3f} ms, candidates "
          f"{body['per_row_ms']['candidates']['median']:.3f} ms ({body['per_row_speedup']:.2f}x); "
          f"generate, per step of {args.batch}: {body['generate_ms_per_step']['full_sort']['median']:.2f} vs "
          f"{body['generate_ms_per_step']['candidates']['median']:.2f} ms ({body['generate_speedup']:.2f}x); "
          f"same tokens {body['same_tokens']}; nucleus median {body['workload']['nucleus_size']['median']}")
    return run.write(body, engine=engine)


if __name__ == "__main__":
    main()
