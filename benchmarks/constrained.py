"""Decode throughput with and without grammar constraints, in the same run.

Batch ``B`` requests decode ``T`` tokens each, first free (``ignore_eos``), then
each constrained by a JSON schema that cannot complete within ``T`` tokens (an
array of at least 1000 person records: keys, strings, enums, integers), so the
batch stays full and every step pays the mask. Prefill is excluded: the clock
starts once every request has its first token. Rounds alternate free /
constrained; throughput is ``batch / median step time`` of each mode (robust on a
shared, noisy machine), and the ratio is constrained / unconstrained. The
constraint's own cost (bitmask fill + masking) is timed per request and step.

    python benchmarks/constrained.py --json OUT [--batch 8] [--tokens 64] [--repeats 3] [--order alternate|fixed]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from engine.tokenizer import encode_chat
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.grammar import XGrammarConstraint, constraint_for_request
from engine.types import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable
from benchmarks import harness  # noqa: E402

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


class _TimedConstraint(XGrammarConstraint):
    """A constraint that adds the time of its engine-facing calls to ``sink[0]``."""

    def __init__(self, inner: XGrammarConstraint, sink: list[float]) -> None:
        self.__dict__.update(inner.__dict__)
        self._sink = sink

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self._sink[0] += time.perf_counter() - t0
        return out

    def apply_to_logits(self, logits) -> None:
        self._timed(super().apply_to_logits, logits)
        self._sink[1] += 1

    def accept(self, token_id: int) -> bool:
        return self._timed(super().accept, token_id)

    def is_terminated(self) -> bool:
        return self._timed(super().is_terminated)


def decode_run(engine: LLMEngine, prompts: list[list[int]], tokens: int, constraints: list | None
               ) -> tuple[float, list[float]]:
    """(decode tokens/s over the run, durations of the steps where the whole batch decoded).

    The clock starts once every request has its first token, so prefill is excluded.
    """
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, constraint=constraints[i] if constraints else None)
           for i, p in enumerate(prompts)]
    started: set[str] = set()
    while len(started) < len(ids):
        for out in engine.step():
            if out.token_ids:
                started.add(out.request_id)
    t0, counted, full_steps = time.perf_counter(), 0, []
    while engine.has_unfinished():
        ts = time.perf_counter()
        outs = engine.step()
        if len(outs) == len(ids) and all(len(o.token_ids) == 1 for o in outs):
            full_steps.append(time.perf_counter() - ts)
        for out in outs:
            counted += len(out.token_ids)
            if out.finished and out.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"request ended with {out.finish_reason}: {out.error}")
    return counted / (time.perf_counter() - t0), full_steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_args(ap, repeats=3)
    ap.add_argument("--batch", type=int, default=8, help="requests decoded together (max_num_seqs)")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    ap.add_argument("--device", default="cpu", help="torch device the engine runs on")
    ap.add_argument("--dtype", default="float32", help="engine dtype (float32 or bfloat16)")
    args = ap.parse_args(argv)
    run = harness.Run(args, __file__, argv)

    # The schema cannot complete within the run's tokens on purpose (the batch stays full), so the
    # engine must not refuse it or close it early: closing is off (benchmarks/constrained_budget.py measures it).
    engine = LLMEngine(EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
                                    enable_prefix_cache=False, close_constrained_outputs=False))
    tok = engine.tokenizer
    prompts = [encode_chat(tok, [{"role": "user", "content": f"List people number {i} as JSON records."}])
               for i in range(args.batch)]
    t0 = time.perf_counter()
    constraint_for_request(tok, response_format=RESPONSE_FORMAT)
    compile_ms = (time.perf_counter() - t0) * 1e3
    decode_run(engine, prompts[:1], 4, None)  # warm-up

    free, constrained, cost = [], [], [0.0, 0]  # cost: [seconds in the constraint, request-steps]
    free_steps, cons_steps = [], []
    for _, side in harness.ab_order(["unconstrained", "constrained"], args.repeats, args.order):
        if side == "unconstrained":
            rate, steps = decode_run(engine, prompts, args.tokens, None)
            free.append(rate)
            free_steps += steps
        else:
            cons = [_TimedConstraint(constraint_for_request(tok, response_format=RESPONSE_FORMAT), cost)
                    for _ in prompts]
            rate, steps = decode_run(engine, prompts, args.tokens, cons)
            constrained.append(rate)
            cons_steps += steps
    # The machine is shared: a round's wall clock absorbs other people's bursts. The median
    # step time of each mode is the robust figure; whole-round rates are kept for reference.
    free_step, cons_step = statistics.median(free_steps), statistics.median(cons_steps)
    result = {
        "model": engine.model_id, "device": args.device, "dtype": args.dtype,
        "batch": args.batch, "decode_tokens_per_request": args.tokens, "rounds": args.repeats,
        "unconstrained_tok_s": round(args.batch / free_step, 2),
        "constrained_tok_s": round(args.batch / cons_step, 2),
        "ratio": round(free_step / cons_step, 4),
        "median_step_ms": {"unconstrained": round(free_step * 1e3, 2), "constrained": round(cons_step * 1e3, 2)},
        "round_tok_s": {"unconstrained": [round(x, 2) for x in free],
                        "constrained": [round(x, 2) for x in constrained]},
        # mask + accept + is_terminated, per request and step; x batch / step time = the share
        # of a decode step the constraints cost, independent of other load on the machine
        "constraint_us_per_request_step": round(cost[0] / cost[1] * 1e6, 1),
        "constraint_share_of_unconstrained_step": round(args.batch * cost[0] / cost[1] / free_step, 4),
        "schema_compile_ms_first": round(compile_ms, 1),
    }
    print(json.dumps(result, indent=2))
    run.write(result, engine=engine)


if __name__ == "__main__":
    main()
