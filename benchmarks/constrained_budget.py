"""Constrained replies under a tight max_tokens: do they all parse and validate?

``--requests`` requests (default 200) mix ``json_schema`` (a profile with nested required
fields, an enum, an array and an anyOf), ``tool_choice: "required"`` (three tools, one
call) and a named tool call; ``max_tokens`` is drawn from ``[--min-tokens, --max-tokens]``
and the temperature from {0, 1} by a seeded generator (every draw is in the JSON). All run
through one in-process engine with the default model, twice:

- **closing on** (the engine default): a request whose ``max_tokens`` cannot hold any valid
  reply is refused at submission (``InvalidRequest``, a 400 over HTTP); the others must all
  parse and validate (``jsonschema``), those closed under budget pressure included
  (``stop_reason == "max_tokens_closed"``);
- **closing off** (``EngineConfig(close_constrained_outputs=False)``, the behaviour before):
  every request runs and is cut at ``max_tokens``.

Reported: the fraction that parse and validate in each mode, how many were refused and
closed, finish reasons, and the mean µs per budget check (``fit_budget``, timed per call).

    python benchmarks/constrained_budget.py --json OUT [--requests 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

import jsonschema

from engine.tokenizer import OutputProcessor, encode_chat, parse_tool_calls
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.grammar import XGrammarConstraint, constraint_for_request
from engine.types import CLOSED_BY_BUDGET, InvalidRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable
from benchmarks import harness  # noqa: E402

PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Other"]},
        "interests": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "zip"], "additionalProperties": False},
        "contact": {"anyOf": [{"type": "object", "properties": {"email": {"type": "string"}},
                               "required": ["email"], "additionalProperties": False}, {"type": "null"}]},
    },
    "required": ["name", "age", "city", "interests", "address", "contact"],
    "additionalProperties": False,
}
PROFILE_FORMAT = {"type": "json_schema", "json_schema": {"name": "profile", "schema": PROFILE, "strict": True}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"},
                                         "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query", "max_results"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "book_flight", "parameters": {
        "type": "object", "properties": {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                         "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                         "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["origin", "destination", "passengers"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
KINDS = ("json_schema", "required", "named")
ASKS = ["What's the weather in Oslo?", "Search the web for chess openings.", "Book a flight from CDG to NRT for 2.",
        "Is it raining in Lima?", "Find 3 jazz clubs in Paris."]


class _TimedConstraint(XGrammarConstraint):
    """A constraint that adds the time of each ``fit_budget`` call to ``sink`` ([seconds, calls])."""

    def __init__(self, inner: XGrammarConstraint, sink: list) -> None:
        self.__dict__.update(inner.__dict__)
        self._sink = sink

    def fit_budget(self, token_id: int, budget: int) -> int:
        t0 = time.perf_counter()
        out = super().fit_budget(token_id, budget)
        self._sink[0] += time.perf_counter() - t0
        self._sink[1] += 1
        return out


def draw_requests(n: int, seed: int, lo: int, hi: int) -> list[dict]:
    """The seeded draws: kind, max_tokens, temperature and prompt index of each request."""
    rng = random.Random(seed)
    return [{"kind": KINDS[i % 3], "max_tokens": rng.randint(lo, hi), "temperature": rng.choice([0.0, 1.0]),
             "prompt": rng.randrange(len(ASKS)), "seed": seed * 100003 + i} for i in range(n)]


def prompt_and_constraint(tok, draw: dict):
    if draw["kind"] == "json_schema":
        ask = f"Write a JSON profile of person number {draw['prompt']} (name, age, city, interests, address)."
        return encode_chat(tok, [{"role": "user", "content": ask}]), \
            constraint_for_request(tok, response_format=PROFILE_FORMAT)
    choice = "required" if draw["kind"] == "required" else \
        {"type": "function", "function": {"name": TOOLS[draw["prompt"] % 3]["function"]["name"]}}
    return encode_chat(tok, [{"role": "user", "content": ASKS[draw["prompt"]]}], TOOLS), \
        constraint_for_request(tok, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)


def valid(kind: str, text: str) -> bool:
    """Whether a reply parses and validates: the profile schema, or exactly one valid tool call."""
    try:
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), PROFILE)
            return True
        content, calls = parse_tool_calls(text)
        if content or len(calls) != 1 or calls[0].name not in SCHEMAS:
            return False
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_mode(engine: LLMEngine, draws: list[dict]) -> dict:
    """Submit every draw (refusals counted), run them to the end, check each reply."""
    tok, sink, ids, text = engine.tokenizer, [0.0, 0], {}, {}
    refused = collections.Counter()
    for d in draws:
        prompt, constraint = prompt_and_constraint(tok, d)
        params = SamplingParams(max_tokens=d["max_tokens"], temperature=d["temperature"], seed=d["seed"])
        try:
            rid = engine.add_request(prompt, params, constraint=_TimedConstraint(constraint, sink))
        except InvalidRequest:
            refused[d["kind"]] += 1
        else:
            ids[rid], text[rid] = d, OutputProcessor(tok, params, tok.eos_token_ids)
    texts, outs = collections.defaultdict(str), {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            out = text[out.request_id].process(out)
            texts[out.request_id] += out.text
            if out.finished:
                outs[out.request_id] = out
    wall = time.perf_counter() - t0
    ok = [valid(ids[r]["kind"], texts[r]) for r in ids]
    closed = [r for r in ids if outs[r].stop_reason == CLOSED_BY_BUDGET]
    return {
        "submitted": len(draws), "refused_max_tokens_too_small": sum(refused.values()),
        "refused_by_kind": dict(refused), "ran": len(ids),
        "parse_and_validate": sum(ok), "fraction_valid_of_ran": round(sum(ok) / len(ids), 4) if ids else None,
        "fraction_valid_of_submitted": round(sum(ok) / len(draws), 4),
        "closed_under_budget": len(closed),
        "closed_by_kind": dict(collections.Counter(ids[r]["kind"] for r in closed)),
        "finish_reasons": dict(collections.Counter(outs[r].finish_reason for r in ids)),
        "completion_tokens_mean": round(sum(outs[r].completion_tokens for r in ids) / max(1, len(ids)), 1),
        "budget_checks": sink[1], "budget_check_us_mean": round(sink[0] / sink[1] * 1e6, 1) if sink[1] else None,
        "wall_s": round(wall, 1),
        "invalid_examples": [{"kind": ids[r]["kind"], "max_tokens": ids[r]["max_tokens"], "text": texts[r][-160:]}
                             for r, good in zip(ids, ok) if not good][:5],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_args(ap, repeats=None)
    ap.add_argument("--requests", type=int, default=200, help="constrained requests per mode")
    ap.add_argument("--min-tokens", type=int, default=8, help="smallest max_tokens drawn for a request")
    ap.add_argument("--max-tokens", type=int, default=256, help="largest max_tokens drawn for a request")
    ap.add_argument("--seed", type=int, default=0, help="seed of the drawn requests (both modes get the same)")
    ap.add_argument("--batch", type=int, default=64, help="max_num_seqs")
    ap.add_argument("--device", default="cpu", help="torch device the engine runs on")
    ap.add_argument("--dtype", default="float32", help="engine dtype (float32 or bfloat16)")
    args = ap.parse_args(argv)
    run = harness.Run(args, __file__, argv)

    draws = draw_requests(args.requests, args.seed, args.min_tokens, args.max_tokens)
    result = {"requests": args.requests, "seed": args.seed, "max_tokens_range": [args.min_tokens, args.max_tokens],
              "device": args.device, "dtype": args.dtype, "batch": args.batch, "draws": draws}
    for mode, close in (("closing_on", True), ("closing_off", False)):
        engine = LLMEngine(EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
                                        close_constrained_outputs=close))
        result["model"] = engine.model_id
        result[mode] = run_mode(engine, draws)
        print(mode, json.dumps({k: v for k, v in result[mode].items() if k != "invalid_examples"}), flush=True)
    run.write(result, engine=engine)


if __name__ == "__main__":
    main()
