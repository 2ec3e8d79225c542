"""Speculative decoding from the request's own context: decode tok/s with it off and on.

Three workloads, each at batch 1 and batch 8, the same engine settings but ``speculative``
(``off`` against ``--speculative``, default ``suffix``):

* ``quoting``: "repeat this file" over real source files of this repository (the reply copies
  its context, as an agent quoting a file, a tool's output or its own earlier reply does);
* ``non_quoting``: open questions whose replies do not repeat the prompt (nothing to draft from
  the request's own context: this measures what speculation costs where it cannot help);
* ``fleet``: the same open questions asked again by other sessions of the same agent program
  (another system prompt wording per pass: batch 1 and batch 8 each ask with their own), after
  a first pass answered them (untimed, on both engines): the replies do not quote their prompt,
  but they repeat what the tenant's earlier sessions wrote (``suffix`` drafts from that).

Order and isolation: each batch size of each workload runs on a fresh pair of engines (off, on), so
no phase drafts from another phase's replies (``suffix`` drafts from the tenant's earlier outputs;
reused engines would let batch 8 replay batch 1's replies as drafts). Within a phase off and on take
turns, the side that goes first alternating (ABBA): per prompt at batch 1 (8 distinct prompts), per
``--repeats`` at batch 8. Prompts are cached first (one token each, untimed), so the timed runs are
decode: greedy, EOS respected, ``--max-tokens`` at most. ``decode_tok_s`` is the tokens after each
request's first, over the time from the last first token to the end (batch 8: the workload's 8
requests decode together; batch 1: the ``--b1-prompts`` prompts one at a time, summed). Greedy
output is the same with and without speculation token for token in float32; in bf16 a
verification's rows round differently from a decode step's (as a batch's other rows do), so a
reply may turn another way after some tokens: ``differing_replies`` gives, per batch size, each
reply that differs and the token where it first does, and ``off_b1_vs_b8_differing_replies`` the
same for speculation off between batch 1 and batch 8 (the size of that effect without drafts).

    python benchmarks/speculative.py --json out/speculative.json [--repeats 2] [--max-tokens 192] [--quick]

JSON: the harness header, then ``{"workloads": {NAME: {"runs": [{"b1": {"off", "on"}, "b8": ...,
"b1_first_side", "acceptance_rate", ...}], "decode_tok_s_b1": {"off": {runs, median, min, max}, "on": ...},
"decode_tok_s_b8": ...}}, "speedup": {NAME: {"b1", "b8"}} (median of the per-run ratios), "config": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.config import SPECULATIVE  # noqa: E402
from engine.tokenizer import encode_chat  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["engine/kv_pool.py", "engine/sampler.py", "engine/hashing.py", "engine/coalesce.py",
           "engine/constraints.py", "engine/attention/base.py", "engine/attention/reference.py",
           "engine/request.py"]
QUESTIONS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
             "Explain how vaccines train the immune system, for a curious teenager.",
             "Describe a walk through a busy market in a city you imagine.",
             "What are the trade-offs between trains and planes for a 500 km trip?",
             "Invent a recipe for a soup from five vegetables and explain each step.",
             "Give advice to someone starting to learn the violin as an adult.",
             "Describe the life cycle of a star, from nebula to its end.",
             "Write a letter from a cat to its owner about the new dog."]


def source_text(path: str, max_chars: int) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()[:max_chars]


FLEET_SYSTEMS = ["You are a helpful assistant.", "You are a helpful assistant for the writing team.",
                 "You are a helpful assistant for the support team."]


def workloads(tok, max_chars: int) -> dict[str, tuple[list[list[int]], list[list[int]], list[list[int]]]]:
    """Per workload: (untimed first pass, prompts at batch 1, prompts at batch 8)."""
    def chat(text, system="You are a careful coding assistant."):
        return encode_chat(tok, [{"role": "system", "content": system}, {"role": "user", "content": text}])
    quoting = [chat(f"Here is the file {p}:\n\n{source_text(p, max_chars)}\n\nRepeat this file exactly, "
                    "without any change.") for p in SOURCES]
    open_q = [chat(q) for q in QUESTIONS]
    fleet = [[chat(q, system) for q in QUESTIONS] for system in FLEET_SYSTEMS]
    return {"quoting": ([], quoting, quoting), "non_quoting": ([], open_q, open_q),
            "fleet": (fleet[0], fleet[1], fleet[2])}


def decode_group(engine: LLMEngine, group: list[list[int]], params: SamplingParams):
    """(tokens after each request's first, seconds from the last first token to the end, token ids)."""
    start = time.monotonic()
    res = engine.generate(group, params)
    end = time.monotonic() - start
    return sum(len(r.token_ids) - 1 for r in res), end - max(r.ttft_s for r in res), [r.token_ids for r in res]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def differing(xs: list[list[int]], ys: list[list[int]]) -> list[list[int]]:
    """[reply index, first token where it differs] for each reply that differs."""
    return [[i, first_difference(s, t)] for i, (s, t) in enumerate(zip(xs, ys)) if s != t]


def run_phase(make_engine, first: list[list[int]], prompts: list[list[int]], params: SamplingParams, batch: int,
              order: list[str]) -> dict:
    """One batch size of a workload on a fresh pair of engines (no phase drafts from another's replies):
    the earlier sessions (``first``, untimed), the prompts cached, then each group of ``batch`` prompts
    run on both engines, the side that goes first alternating with the group (``order``: the sides
    in turn, two per group)."""
    engines = {"off": make_engine("off"), "on": make_engine("on")}
    for engine in engines.values():
        if first:
            engine.generate(first, params)                                      # the earlier sessions
        engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))    # cache the prompts
    before = engines["on"].stats()
    tokens, seconds, outputs = {"off": 0, "on": 0}, {"off": 0.0, "on": 0.0}, {"off": [], "on": []}
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    for g, group in enumerate(groups):
        for side in order[2 * g:2 * g + 2]:
            n, sec, out = decode_group(engines[side], group, params)
            tokens[side] += n
            seconds[side] += sec
            outputs[side] += out
    after = engines["on"].stats()
    drafted = after.spec_draft_tokens_total - before.spec_draft_tokens_total
    accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
    verified = after.spec_verifications_total - before.spec_verifications_total
    return {"decode_tok_s": {side: round(tokens[side] / seconds[side], 2) for side in engines},
            "first_side": order[::2], "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "mean_accepted_length": round((accepted + verified) / verified, 3) if verified else 0.0,
            "outputs": outputs}


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_args(ap, repeats=1)
    ap.add_argument("--max-tokens", type=int, default=192, help="most tokens per reply")
    ap.add_argument("--max-chars", type=int, default=2000, help="characters of each source file quoted")
    ap.add_argument("--b1-prompts", type=int, default=8, help="prompts of each workload run at batch 1 (at least 8)")
    ap.add_argument("--num-speculative-tokens", type=int, default=EngineConfig.num_speculative_tokens,
                    help="draft tokens per verification with speculation on")
    ap.add_argument("--speculative", default="suffix", choices=[m for m in SPECULATIVE if m != "off"],
                    help="the mode measured as 'on'")
    ap.add_argument("--workloads", default="quoting,non_quoting,fleet", help="comma-separated subset")
    ap.add_argument("--device", default="auto", help="torch device (auto: cuda if available, else cpu)")
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto: what agentrt serve picks here)")
    ap.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: the embedded model)")
    ap.add_argument("--quick", action="store_true", help="smoke run: the non_quoting workload, 16-token replies")
    args = ap.parse_args(argv)
    if args.quick:
        args.workloads, args.max_tokens = "non_quoting", 16
    if not 8 <= args.b1_prompts <= len(QUESTIONS):
        ap.error(f"--b1-prompts must be between 8 and {len(QUESTIONS)}, got {args.b1_prompts}")
    unknown = set(args.workloads.split(",")) - {"quoting", "non_quoting", "fleet"}
    if unknown:
        ap.error(f"--workloads: unknown {sorted(unknown)}; allowed: quoting, non_quoting, fleet")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = harness.Run(args, __file__, argv)
    base = dict(model=args.model, device=args.device, dtype=args.dtype, kv_cache_tokens=16384,
                max_batched_tokens=512, turn_coalesce_max_s=0.0)

    def make_engine(side: str) -> LLMEngine:
        if side == "off":
            return LLMEngine(EngineConfig(**base, speculative="off"))
        return LLMEngine(EngineConfig(**base, speculative=args.speculative,
                                      num_speculative_tokens=args.num_speculative_tokens))

    probe = make_engine("off")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    work = workloads(probe.tokenizer, args.max_chars)
    out: dict = {"workloads": {}, "speedup": {}}
    for name, (first, prompts_b1, prompts_b8) in work.items():
        if name in args.workloads.split(","):
            out["workloads"][name] = run_workload(make_engine, first, prompts_b1[:args.b1_prompts], prompts_b8,
                                                  params, args)
            out["speedup"][name] = {b: harness.spread(r[b]["on"] / r[b]["off"] for r in
                                                      out["workloads"][name]["runs"])["median"] for b in ("b1", "b8")}
            print(name, json.dumps(out["speedup"][name]), flush=True)
    out["config"] = {"model": probe.model_id, "speculative": args.speculative, "max_tokens": args.max_tokens,
                     "num_speculative_tokens": args.num_speculative_tokens, "prompts_b8": len(SOURCES),
                     "prompts_b1": args.b1_prompts, "fresh_engines_per_phase": True}
    run.write(out, engine=probe)


def run_workload(make_engine, first, prompts_b1, prompts_b8, params, args) -> dict:
    """Each repeat: batch 1 then batch 8, each on fresh engines, off and on in ABBA order (over the
    batch-1 prompts; over the repeats at batch 8): per-run rates, their median and range."""
    b1_order = [s for _, s in harness.ab_order(["off", "on"], len(prompts_b1) * args.repeats, args.order)]
    b8_order = [s for _, s in harness.ab_order(["off", "on"], args.repeats, args.order)]
    per_prompt = 2 * len(prompts_b1)
    runs, res = [], {}
    for r in range(args.repeats):
        one = run_phase(make_engine, first, prompts_b1, params, 1, b1_order[r * per_prompt:(r + 1) * per_prompt])
        eight = run_phase(make_engine, first, prompts_b8, params, 8, b8_order[2 * r:2 * r + 2])
        runs.append({"b1": one["decode_tok_s"], "b8": eight["decode_tok_s"],
                     "b1_first_side": one["first_side"], "b8_first_side": eight["first_side"],
                     "acceptance_rate": {"b1": one["acceptance_rate"], "b8": eight["acceptance_rate"]},
                     "mean_accepted_length": {"b1": one["mean_accepted_length"], "b8": eight["mean_accepted_length"]}})
        res = {"one": one, "eight": eight}
    one, eight = res["one"]["outputs"], res["eight"]["outputs"]
    summary = {f"decode_tok_s_{b}": {side: harness.spread(x[b][side] for x in runs) for side in ("off", "on")}
               for b in ("b1", "b8")}
    out = {"runs": runs, **summary,
           "identical_greedy_output": one["off"] == one["on"] and eight["off"] == eight["on"],
           "differing_replies": {"b1": differing(one["off"], one["on"]), "b8": differing(eight["off"], eight["on"])},
           "generated_tokens": sum(len(t) for t in one["off"])}
    if prompts_b1 == prompts_b8[:len(prompts_b1)]:
        # the same prompts at batch 1 and batch 8 without speculation: a batch's other rows alone
        # change the rounding in reduced precision (what a verification's rows do, too)
        out["off_b1_vs_b8_differing_replies"] = differing(one["off"], eight["off"])
    return out


if __name__ == "__main__":
    main()
