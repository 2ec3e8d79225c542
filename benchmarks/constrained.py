"""Decode throughput with and without grammar constraints, in the same run.

Batch ``B`` requests decode ``T`` tokens each, first free (``ignore_eos``), then
each constrained by a JSON schema that cannot complete within ``T`` tokens (an
array of at least 1000 person records: keys, strings, enums, integers), so the
batch stays full and every step pays the mask. Prefill is excluded: the clock
starts once every request has its first token. Rounds alternate free /
constrained (the machine is shared and noisy); we report medians and the ratio.

    python benchmarks/constrained.py --json OUT [--batch 8] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine.chat import encode_chat
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.grammar import XGrammarConstraint, constraint_for_request
from engine.types import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "doctor", "teacher", "artist"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 1000}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA, "strict": True}}


class _MaskTimer(XGrammarConstraint):
    """Wraps a constraint's ``apply_to_logits`` to measure the time the mask costs."""

    def __init__(self, inner: XGrammarConstraint, sink: list[float]) -> None:
        self.__dict__.update(inner.__dict__)
        self._sink = sink

    def apply_to_logits(self, logits) -> None:
        t0 = time.perf_counter()
        super().apply_to_logits(logits)
        self._sink.append(time.perf_counter() - t0)


def decode_tokens_per_s(engine: LLMEngine, prompts: list[list[int]], tokens: int,
                        constraints: list | None) -> tuple[float, int]:
    """(decode tokens/s over the steps after every request's first token, tokens counted)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, constraint=constraints[i] if constraints else None)
           for i, p in enumerate(prompts)]
    started: set[str] = set()
    while len(started) < len(ids):
        for out in engine.step():
            if out.token_ids:
                started.add(out.request_id)
    t0, counted = time.perf_counter(), 0
    while engine.has_unfinished():
        for out in engine.step():
            counted += len(out.token_ids)
            if out.finished and out.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"request ended with {out.finish_reason}: {out.error}")
    return counted / (time.perf_counter() - t0), counted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="OUT", help="write the results here")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
                                    enable_prefix_cache=False))
    tok = engine.tokenizer
    prompts = [encode_chat(tok, [{"role": "user", "content": f"List people number {i} as JSON records."}])
               for i in range(args.batch)]
    t0 = time.perf_counter()
    constraint_for_request(tok, response_format=RESPONSE_FORMAT)
    compile_ms = (time.perf_counter() - t0) * 1e3
    decode_tokens_per_s(engine, prompts[:1], 4, None)  # warm-up

    free, constrained, mask_s = [], [], []
    for _ in range(args.rounds):
        free.append(decode_tokens_per_s(engine, prompts, args.tokens, None)[0])
        cons = [_MaskTimer(constraint_for_request(tok, response_format=RESPONSE_FORMAT), mask_s)
                for _ in prompts]
        constrained.append(decode_tokens_per_s(engine, prompts, args.tokens, cons)[0])
    result = {
        "model": engine.model_id, "device": args.device, "dtype": args.dtype,
        "batch": args.batch, "decode_tokens_per_request": args.tokens, "rounds": args.rounds,
        "unconstrained_tok_s": round(statistics.median(free), 2),
        "constrained_tok_s": round(statistics.median(constrained), 2),
        "ratio": round(statistics.median(constrained) / statistics.median(free), 4),
        "unconstrained_tok_s_all": [round(x, 2) for x in free],
        "constrained_tok_s_all": [round(x, 2) for x in constrained],
        "mask_us_per_request_step": round(statistics.median(mask_s) * 1e6, 1),
        "schema_compile_ms_first": round(compile_ms, 1),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
