"""Constrained decoding end to end with the real default model, in the continuous batch, as a server
runs it (``served_engine``: its assertions parse and validate, they compare no two engines' tokens).

One ``generate`` call runs 50 ``json_schema`` requests, 50 ``tool_choice: required``
requests and 16 free ones together (sampled, seeded); others run constrained
requests alone, and through preemption. Every constrained output must parse and
validate with ``jsonschema``. The schemas bound their strings and arrays, and
``max_tokens`` leaves room for the model to fill them with multi-token
characters, so every constrained request must end with ``finish_reason ==
"stop"`` (the grammar completed), never ``"length"``.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine
from engine.tokenizer import TOOL_CALL_END, encode_chat, parse_tool_calls
from engine.grammar import constraint_for_request
from engine.types import SamplingParams
from tests.engine.served import SERVED

PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"$ref": "#/$defs/city"},
        "interests": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "contact": {"anyOf": [
            {"type": "object", "properties": {"email": {"type": "string", "maxLength": 32}},
             "required": ["email"], "additionalProperties": False},
            {"type": "null"}]},
    },
    "required": ["name", "age", "city", "interests", "contact"],
    "additionalProperties": False,
    "$defs": {"city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Other"]}},
}
PROFILE_FORMAT = {"type": "json_schema", "json_schema": {"name": "profile", "schema": PROFILE, "strict": True}}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 32},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 64},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query", "max_results"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "book_flight", "description": "Book a flight between two airports.",
        "parameters": {"type": "object", "properties": {
            "origin": {"$ref": "#/$defs/airport"}, "destination": {"$ref": "#/$defs/airport"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            "cabin": {"enum": ["economy", "business"]}},
            "required": ["origin", "destination", "passengers", "cabin"], "additionalProperties": False,
            "$defs": {"airport": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

PEOPLE = ["Ana", "Bilal", "Chen", "Dora", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jia"]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo"]
HOBBIES = ["chess", "hiking", "jazz", "painting", "football"]
TOOL_ASKS = ["What's the weather in {c} right now?", "Search the web for news about {h}.",
             "Book a flight from CDG to NRT for {n} people.", "Is it raining in {c}? Use fahrenheit.",
             "Find the best {h} clubs online, 5 results."]
N = 50


def _json_prompt(tok, i):
    who, city, hobby = PEOPLE[i % 10], CITIES[i % 5], HOBBIES[(i // 5) % 5]
    ask = f"Write a JSON profile for {who}, {20 + i} years old, from {city}, who likes {hobby}."
    return encode_chat(tok, [{"role": "user", "content": ask}])


def _tool_prompt(tok, i):
    ask = TOOL_ASKS[i % 5].format(c=CITIES[(i // 5) % 5], h=HOBBIES[(i // 3) % 5], n=1 + i % 4)
    return encode_chat(tok, [{"role": "user", "content": ask}], TOOLS)


def _check_json(result):
    assert result.finish_reason == "stop", result
    jsonschema.validate(json.loads(result.text), PROFILE)


def _check_tool_calls(result, max_calls=None):
    assert result.finish_reason == "stop", result
    content, calls = parse_tool_calls(result.text)
    assert content == "" and calls, result.text
    assert max_calls is None or len(calls) <= max_calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), TOOL_SCHEMAS[call.name])


def _params(i, max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1000 + i)


@pytest.mark.slow
def test_json_schema_and_required_tool_calls_mixed_with_free_requests(served_engine):
    tok = served_engine.tokenizer
    prompts, params, cons = [], [], []
    for i in range(N):
        prompts.append(_json_prompt(tok, i))
        params.append(_params(i, 384))
        cons.append(constraint_for_request(tok, response_format=PROFILE_FORMAT))
    for i in range(N):
        prompts.append(_tool_prompt(tok, i))
        params.append(_params(i, 256))
        cons.append(constraint_for_request(tok, tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    for i in range(16):
        prompts.append(encode_chat(tok, [{"role": "user", "content": f"Say something about {HOBBIES[i % 5]}."}]))
        params.append(_params(i, 24))
        cons.append(None)

    results = served_engine.generate(prompts, params, cons)

    for r in results[:N]:
        _check_json(r)
    for r in results[N:2 * N]:
        _check_tool_calls(r, max_calls=1)
    for r in results[2 * N:]:
        assert r.finish_reason in ("stop", "length") and r.text


@pytest.mark.slow
def test_constrained_requests_alone(served_engine):
    """JSON, required / named / parallel tool calls, without free requests in the batch."""
    tok = served_engine.tokenizer
    named = {"type": "function", "function": {"name": "book_flight"}}
    prompts = [_json_prompt(tok, i) for i in range(6)] + [_tool_prompt(tok, i) for i in range(10)]
    cons = ([constraint_for_request(tok, response_format=PROFILE_FORMAT) for _ in range(6)]
            + [constraint_for_request(tok, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
               for _ in range(6)]
            + [constraint_for_request(tok, tools=TOOLS, tool_choice=named) for _ in range(2)]
            + [constraint_for_request(tok, tools=TOOLS, tool_choice="required") for _ in range(2)])
    results = served_engine.generate(prompts, [_params(i, 384 if i < 14 else 96) for i in range(16)], cons)
    for r in results[:6]:
        _check_json(r)
    for r in results[6:14]:
        _check_tool_calls(r, max_calls=1)
    assert [parse_tool_calls(r.text)[1][0].name for r in results[12:14]] == ["book_flight"] * 2
    for r in results[14:]:
        # With parallel calls allowed SmolLM2 often goes on calling until max_tokens: every
        # complete call must be valid; a call cut off by the token limit is not one.
        complete = r.text[:r.text.rfind(TOOL_CALL_END) + len(TOOL_CALL_END)]
        _check_tool_calls(dataclasses.replace(r, text=complete, finish_reason="stop"))


@pytest.mark.slow
def test_auto_tool_choice_constrains_a_started_call(served_engine):
    """With "auto" the model writes free text; once it has written <tool_call> the call is constrained.

    SmolLM2 rarely starts a call on its own, so the assistant turn is begun for it
    (prompt and constraint both get "Let me check. <tool_call>").
    """
    tok = served_engine.tokenizer
    started = tok.encode("Let me check. " + "<tool_call>")
    prompts, cons = [], []
    for i in range(4):
        prompts.append(_tool_prompt(tok, i) + started)
        c = constraint_for_request(tok, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
        assert all(c.accept(t) for t in started)
        cons.append(c)
    results = served_engine.generate(prompts, [_params(i, 256) for i in range(4)], cons)
    for r in results:
        _check_tool_calls(dataclasses.replace(r, text="<tool_call>" + r.text), max_calls=1)


@pytest.mark.slow
def test_constraint_state_survives_preemption():
    """A KV pool too small for the batch forces recompute preemption mid-output."""
    engine = LLMEngine(EngineConfig(kv_cache_tokens=512, page_size=16, max_batched_tokens=256,
                                    enable_prefix_cache=False, **SERVED))
    tok = engine.tokenizer
    prompts = [_json_prompt(tok, i) for i in range(6)]
    cons = [constraint_for_request(tok, response_format=PROFILE_FORMAT) for _ in prompts]
    results = engine.generate(prompts, [_params(i, 384) for i in range(6)], cons)
    assert engine.scheduler.num_preemptions > 0
    for r in results:
        _check_json(r)
