"""Constrained tool calls in each family's own syntax (engine/grammar/call_syntax.py): whatever path a
sampler takes through the grammar, the finished text is read back by that family's parser
(engine/parsers) as calls of the right tools with arguments valid against their schemas."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from engine.grammar import constraint_for_request
from engine.grammar.call_syntax import CALL_FORMATS
from engine.loader import load_tokenizer
from engine.parsers import IN_FORMAT_MARKERS, TOOL_PARSERS, constrained_call_format, control_token_texts, parse_output
from engine.types import InvalidRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "days", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                                      "strict": {"type": "boolean"}},
                                     "required": ["query", "strict"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)[0]


def _walk(constraint, tokenizer, rng: random.Random, free_steps: int) -> str:
    """``free_steps`` tokens picked at random among those the grammar allows (no stop token), then the
    constraint's closing plan to the end: one of the many texts the grammar admits."""
    out: list[int] = []
    stops = set(tokenizer.eos_token_ids)
    for _ in range(free_steps):
        if constraint.is_terminated():
            break
        allowed = [t for t in torch.nonzero(constraint.allowed_mask(tokenizer.vocab_size)).flatten().tolist()
                   if t not in stops]
        if not allowed:
            break
        tok = rng.choice(allowed)
        assert constraint.accept(tok)
        out.append(tok)
    plan = constraint.closing_plan()
    assert plan is not None, f"no closing plan after {tokenizer.decode(out)!r}"
    for tok in plan:
        assert constraint.accept(tok)
        out.append(tok)
    assert constraint.is_terminated() or constraint.valid_prefix([tokenizer.eos_token_ids[0]]) == 1
    return tokenizer.decode([t for t in out if t not in stops])


def _calls(text: str, parser: str) -> list[tuple[str, dict]]:
    """The calls ``parser`` reads in ``text``, each checked: a tool of TOOLS, arguments valid for it."""
    parsed = parse_output(text, parser, tools=TOOLS)
    calls = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    for name, args in calls:
        assert name in SCHEMAS, (parser, name, text)
        jsonschema.validate(args, SCHEMAS[name])
    return calls


@pytest.mark.parametrize("call_format", CALL_FORMATS)
@pytest.mark.parametrize("seed", range(6))
def test_forced_calls_parse_back_in_the_family_format(tokenizer, call_format, seed):
    rng = random.Random(seed)
    named = {"type": "function", "function": {"name": "search"}}
    c = constraint_for_request(tokenizer, tools=TOOLS, tool_choice=named, call_format=call_format)
    text = _walk(c, tokenizer, rng, free_steps=rng.randint(0, 40))
    calls = _calls(text, call_format)
    assert [name for name, _ in calls] == ["search"], text
    c = constraint_for_request(tokenizer, tools=TOOLS, tool_choice="required", call_format=call_format)
    text = _walk(c, tokenizer, rng, free_steps=rng.randint(0, 60))
    calls = _calls(text, call_format)
    assert calls and all(name in SCHEMAS for name, _ in calls), text


@pytest.mark.parametrize("call_format", CALL_FORMATS)
def test_the_syntax_is_the_familys_not_hermes(tokenizer, call_format):
    """The shortest forced call, read by every parser: only its own family's (and, for Hermes-shaped
    families, Hermes') parser finds the call, so the grammar did not write Hermes for them all."""
    c = constraint_for_request(tokenizer, tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, call_format=call_format)
    text = tokenizer.decode([t for t in c.closing_plan() if t not in tokenizer.eos_token_ids])
    readers = {f for f in CALL_FORMATS
               if [c.name for c in parse_output(text, f, tools=TOOLS).tool_calls] == ["get_weather"]}
    assert call_format in readers, text
    assert ("hermes" in readers) == (call_format == "hermes"), (text, readers)


def test_auto_keeps_free_text_and_constrains_the_call_in_format(tokenizer):
    c = constraint_for_request(tokenizer, tools=TOOLS, tool_choice="auto", call_format="qwen3_coder")
    prefix = "Let me look.\n<tool_call>\n<function=search>\n"
    for tok in tokenizer.encode(prefix):
        assert c.accept(tok), prefix
    rest = tokenizer.decode([t for t in c.closing_plan() if t not in tokenizer.eos_token_ids])
    parsed = parse_output(prefix + rest, "qwen3_coder", tools=TOOLS)
    assert parsed.content.startswith("Let me look.")
    assert [t.name for t in parsed.tool_calls] == ["search"]
    fresh = constraint_for_request(tokenizer, tools=TOOLS, tool_choice="auto", call_format="qwen3_coder")
    unknown = tokenizer.encode("Let me look.\n<tool_call>\n<function=unknown>")
    assert fresh.valid_prefix(unknown) < len(unknown)   # free text, then a call of a tool not in tools: refused


def test_a_family_whose_markers_are_control_tokens_falls_back_to_hermes(tokenizer):
    assert set(IN_FORMAT_MARKERS) == set(CALL_FORMATS) and set(CALL_FORMATS) <= set(TOOL_PARSERS)
    assert constrained_call_format("qwen3_coder", set()) == "qwen3_coder"
    assert constrained_call_format("glm45", {"<tool_call>", "</tool_call>"}) == "hermes"
    assert constrained_call_format("llama3_json", {"<|python_tag|>"}) == "llama3_json"
    for parser in ("mistral", "deepseek_v31", "kimi_k2", "openai", None):
        assert constrained_call_format(parser, set()) == "hermes"
    controls = control_token_texts(tokenizer.hf)   # SmolLM2's: <|im_start|>, <|endoftext|>, ...
    assert "<|im_start|>" in controls and "<tool_call>" not in controls


def test_an_unknown_call_format_is_refused_with_the_choices(tokenizer):
    with pytest.raises(InvalidRequest, match="call_format must be one of hermes, llama3_json"):
        constraint_for_request(tokenizer, tools=TOOLS, tool_choice="required", call_format="yaml")
