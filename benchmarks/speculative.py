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

Prompts are cached first (one token each, untimed), so the timed runs are decode: greedy,
EOS respected, ``--max-tokens`` at most. ``decode_tok_s`` is the tokens after each request's
first, over the time from the last first token to the end (batch 8: the workload's 8 requests
decode together; batch 1: the first ``--b1-prompts`` of them one at a time, summed). Greedy
output is the same with and without speculation token for token in float32; in bf16 a
verification's rows round differently from a decode step's (as a batch's other rows do), so a
reply may turn another way after some tokens: ``differing_replies`` gives, per batch size, each
reply that differs and the token where it first does, and ``off_b1_vs_b8_differing_replies`` the
same for speculation off between batch 1 and batch 8 (the size of that effect without drafts).

    python benchmarks/speculative.py --json out/speculative.json [--max-tokens 192] [--b1-prompts 8] [--device auto]

JSON: ``{"workloads": {NAME: {"off": {"decode_tok_s_b1", "decode_tok_s_b8"}, "on": {same,
"acceptance_rate", "mean_accepted_length"}}}, "speedup": {NAME: {"b1", "b8"}}, "config": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.config import SPECULATIVE  # noqa: E402
from engine.chat import encode_chat  # noqa: E402

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


def decode_rate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, batch: int):
    """(decode tok/s, token ids per prompt) running ``prompts`` ``batch`` at a time."""
    tokens, seconds, outputs = 0, 0.0, []
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        start = time.monotonic()
        res = engine.generate(group, params)
        end = time.monotonic() - start
        first = max(r.ttft_s for r in res)
        tokens += sum(len(r.token_ids) - 1 for r in res)
        seconds += end - first
        outputs.extend(r.token_ids for r in res)
    return tokens / seconds, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--max-tokens", type=int, default=192, help="most tokens per reply")
    ap.add_argument("--max-chars", type=int, default=2000, help="characters of each source file quoted")
    ap.add_argument("--b1-prompts", type=int, default=8, help="prompts of each workload run at batch 1")
    ap.add_argument("--num-speculative-tokens", type=int, default=EngineConfig.num_speculative_tokens)
    ap.add_argument("--speculative", default="suffix", choices=[m for m in SPECULATIVE if m != "off"],
                    help="the mode measured as 'on'")
    ap.add_argument("--workloads", default="quoting,non_quoting,fleet", help="comma-separated subset")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: the embedded model)")
    args = ap.parse_args()

    base = dict(model=args.model, device=args.device, dtype=args.dtype, kv_cache_tokens=16384,
                max_batched_tokens=512, turn_coalesce_max_s=0.0)
    engines = {"off": LLMEngine(EngineConfig(**base)),
               "on": LLMEngine(EngineConfig(**base, speculative=args.speculative,
                                            num_speculative_tokens=args.num_speculative_tokens))}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    work = workloads(engines["off"].tokenizer, args.max_chars)
    out: dict = {"workloads": {}, "speedup": {}}
    for name, (first, prompts_b1, prompts_b8) in work.items():
        if name not in args.workloads.split(","):
            continue
        res: dict = {}
        outputs = {}
        for mode, engine in engines.items():
            if first:
                engine.generate(first, params)                                     # the earlier sessions
            engine.generate(prompts_b1[:args.b1_prompts] + prompts_b8,
                            SamplingParams(max_tokens=1, temperature=0))            # cache the prompts
            before = engine.stats()
            b1, outputs[mode, 1] = decode_rate(engine, prompts_b1[:args.b1_prompts], params, 1)
            b8, outputs[mode, 8] = decode_rate(engine, prompts_b8, params, 8)
            after = engine.stats()
            res[mode] = {"decode_tok_s_b1": round(b1, 2), "decode_tok_s_b8": round(b8, 2)}
            if mode == "on":
                drafted = after.spec_draft_tokens_total - before.spec_draft_tokens_total
                accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
                verified = after.spec_verifications_total - before.spec_verifications_total
                res[mode]["acceptance_rate"] = round(accepted / drafted, 4) if drafted else 0.0
                res[mode]["mean_accepted_length"] = round((accepted + verified) / verified, 3) if verified else 0.0
        res["identical_greedy_output"] = all(outputs["off", b] == outputs["on", b] for b in (1, 8))
        # per batch size: replies that differ, and where each first differs (token index)
        res["differing_replies"] = {f"b{b}": [[i, next((j for j, (x, y) in enumerate(zip(s, t)) if x != y),
                                                       min(len(s), len(t)))]
                                              for i, (s, t) in enumerate(zip(outputs["off", b], outputs["on", b]))
                                              if s != t] for b in (1, 8)}
        if prompts_b1[:args.b1_prompts] == prompts_b8[:args.b1_prompts]:
            # the same prompts at batch 1 and batch 8 without speculation: a batch's other rows alone
            # change the rounding in reduced precision (what a verification's rows do, too)
            res["off_b1_vs_b8_differing_replies"] = [
                [i, next((j for j, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t)))]
                for i, (s, t) in enumerate(zip(outputs["off", 1], outputs["off", 8])) if s != t]
        res["generated_tokens"] = sum(len(t) for t in outputs["off", 1])
        out["workloads"][name] = res
        out["speedup"][name] = {f"b{b}": round(res["on"][f"decode_tok_s_b{b}"] / res["off"][f"decode_tok_s_b{b}"], 3)
                                for b in (1, 8)}
        print(name, json.dumps(res), flush=True)
    eng = engines["off"]
    out["config"] = {"model": eng.model_id, "device": eng.device, "dtype": eng.config.resolved_dtype(),
                     "weights": eng.quantization, "speculative": args.speculative,
                     "attention_backend": eng.backend_name, "max_tokens": args.max_tokens,
                     "num_speculative_tokens": args.num_speculative_tokens, "prompts_b8": len(SOURCES),
                     "prompts_b1": args.b1_prompts,
                     "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    print(json.dumps(out["speedup"]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
