"""Closing constrained output within a token budget (engine/grammar/closing.py, XGrammarConstraint.fit_budget).

No model: every state is reached by feeding the tokens of a valid output, and the model's
choices are played by those tokens. For every prefix state the closing plan must complete
the output into text that parses and validates; forcing it must end the output within
the budget; the fast path (plans reused across steps) must never close earlier than the
reference (every plan computed afresh).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.tokenizer import format_tool_call, parse_tool_calls
from engine.grammar import constraint_for_request
from engine.grammar.closing import closing_text
from engine.loader import load_tokenizer

PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 120},
        "score": {"type": "number"},
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                     "geo": {"type": "array", "items": {"type": "number"},
                                                             "minItems": 2, "maxItems": 2}},
                    "required": ["street", "geo"], "additionalProperties": False},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "vip": {"type": "boolean"},
    },
    "required": ["name", "age", "score", "city", "tags", "address"],
    "additionalProperties": False,
}
PROFILES = [
    {"name": "Ana María", "age": 31, "score": -12.5e3, "city": "Tokyo", "tags": ["a \"quoted\" tag", "x"],
     "address": {"street": "Rue de l'Été 5", "geo": [48.85, 2.35]}, "note": None, "vip": True},
    {"name": "Bo", "age": 120, "score": 0, "city": "Lima", "tags": ["z"],
     "address": {"street": "", "geo": [0, -1]}, "note": "tab\there"},
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "book_flight", "parameters": {
        "type": "object", "properties": {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                         "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "legs": {"type": "array", "minItems": 1, "items": {
                                             "type": "object", "properties": {"date": {"type": "string"}},
                                             "required": ["date"], "additionalProperties": False}}},
        "required": ["origin", "passengers", "legs"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALLS = [format_tool_call("get_weather", {"city": "Oslo", "unit": "fahrenheit"}),
         format_tool_call("book_flight", {"origin": "CDG", "passengers": 3, "legs": [{"date": "2026-05-01"}]})]
NAMED = {"type": "function", "function": {"name": "book_flight"}}


def _check_profile(text: str, prefix: str = "") -> None:
    jsonschema.validate(json.loads(text), PROFILE)


def _check_object(text: str, prefix: str = "") -> None:
    assert isinstance(json.loads(text), dict)


def _check_calls(text: str, prefix: str = "", name: str | None = None) -> None:
    content, calls = parse_tool_calls(text)
    assert content == prefix.strip() and len(calls) == 1, text
    assert name is None or calls[0].name == name
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


def _check_auto(text: str, prefix: str = "") -> None:
    """With tool_choice auto: one valid call after the free text, or free text alone (a call that
    could not fit was not started; the parser drops the start of its tag, as tested in test_chat)."""
    if "<tool_call>" in text:
        _check_calls(text, prefix)
    else:
        assert text.startswith(prefix)


# (request options, a valid output, its checker, text before the constrained part)
CASES = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PROFILE}}},
     json.dumps(PROFILES[0], ensure_ascii=False), _check_profile, ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PROFILE}}},
     json.dumps(PROFILES[1]), _check_profile, ""),
    ({"response_format": {"type": "json_object"}}, '{"a": [1, {"b": "c"}, -0.5], "d": {"e": null}}', _check_object, ""),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, CALLS[0], _check_calls, ""),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, CALLS[1], _check_calls, ""),
    ({"tools": TOOLS, "tool_choice": NAMED}, CALLS[1], lambda t, p="": _check_calls(t, p, "book_flight"), ""),
    ({"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False}, "Let me check. " + CALLS[0], _check_auto,
     "Let me check. "),
]
IDS = ["profile-0", "profile-1", "json_object", "required-weather", "required-flight", "named", "auto-started-call"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)[0]


def _ids(tokenizer, text, before):
    """The output's tokens: the free text before the call and the rest encoded apart."""
    return tokenizer.encode(before) + tokenizer.encode(text[len(before):])


def _at(tokenizer, options, ids):
    c = constraint_for_request(tokenizer, **options)
    assert all(c.accept(t) for t in ids)
    return c


def _run(c, proposals, budget, eos):
    """Play the engine loop: the model proposes ``proposals`` (then EOS); ``fit_budget`` decides."""
    out = []
    for step in range(budget):
        proposed = proposals[step] if step < len(proposals) else eos
        tok = c.fit_budget(proposed, budget - step)
        out.append(tok)
        assert c.accept(tok)
        if c.is_terminated():
            return out
    return out


@pytest.mark.parametrize("options,text,check,before", CASES, ids=IDS)
def test_every_prefix_state_closes_into_valid_output(tokenizer, options, text, check, before):
    ids = _ids(tokenizer, text, before)
    for k in range(len(ids) + 1):
        c = _at(tokenizer, options, ids[:k])
        plan = c.closing_plan()
        assert plan is not None, k
        if "<tool_call>" not in tokenizer.decode(ids[:k]) and before:
            assert plan == []  # free text before a call may end where it is
            continue
        check(tokenizer.decode(ids[:k] + plan), before)


@pytest.mark.parametrize("options,text,check,before", CASES, ids=IDS)
def test_forced_closing_ends_valid_within_the_budget(tokenizer, options, text, check, before):
    """From each prefix state, with a budget of exactly its plan's length, the model going on with
    the valid output is overruled as soon as going on no longer fits, and the output ends, valid,
    within the budget."""
    ids = _ids(tokenizer, text, before)
    eos = tokenizer.eos_token_ids[0]
    for k in range(0, len(ids)):
        c = _at(tokenizer, options, ids[:k])
        plan = c.closing_plan()
        if not plan:
            continue
        out = _run(c, ids[k:], len(plan), eos)
        assert len(out) <= len(plan) and c.is_terminated()
        assert c.closed_by_budget or out == ids[k:k + len(out)]
        check(tokenizer.decode(ids[:k] + out), before)


@pytest.mark.parametrize("options,text,check,before", CASES, ids=IDS)
def test_budget_decisions_fast_path_against_reference(tokenizer, options, text, check, before):
    """For every budget from the shortest valid reply up, the result always validates within the
    budget, and reusing plans (the fast path) keeps at least as many of the model's tokens as
    computing each afresh (the reference); with room to spare the model's output is untouched."""
    prefix_ids = tokenizer.encode(before)
    rest = tokenizer.encode(text[len(before):])
    eos = tokenizer.eos_token_ids[0]
    shortest = len(_at(tokenizer, options, prefix_ids).closing_plan())
    for budget in list(range(max(1, shortest), len(rest) + 2, 2)) + [len(rest) + 100]:
        kept = {}
        for reuse in (True, False):
            c = _at(tokenizer, options, prefix_ids)
            c.reuse_plans = reuse
            out = _run(c, rest, budget, eos)
            assert len(out) <= budget and (c.is_terminated() or c._matcher.is_completed())
            check(tokenizer.decode(prefix_ids + out), before)
            kept[reuse] = next((i for i, (a, b) in enumerate(zip(out, rest)) if a != b), min(len(out), len(rest)))
        assert kept[True] >= kept[False], budget
        if budget >= len(rest) + 100:
            assert kept[True] == kept[False] == len(rest)  # room to spare: the model's own output, untouched
        if budget < len(rest) and not before:
            assert c.closed_by_budget  # (with free text first, the call may just not be started)


def test_plan_reused_after_an_accepted_token_is_a_valid_closing(tokenizer):
    """The plan carried from one state to the next (the fast path) completes the output from there."""
    options, text = CASES[0][0], CASES[0][1]
    c = constraint_for_request(tokenizer, **options)
    for t in tokenizer.encode(text):
        assert c.fit_budget(t, 10 ** 6) == t and c.accept(t)
        plan = c.closing_plan()
        fork = c._matcher.fork()
        assert all(fork.accept_token(p) for p in plan) and fork.is_completed()
    assert not c.closed_by_budget


@pytest.mark.slow
def test_too_long_a_minimum_gives_no_plan(tokenizer):
    schema = {"type": "array", "items": {"type": "string", "minLength": 8}, "minItems": 1000}
    c = constraint_for_request(tokenizer, response_format={"type": "json_schema", "json_schema": {
        "name": "big", "schema": schema}})
    assert c.closing_plan() is None
    bracket = tokenizer.encode("[")[0]
    assert c.fit_budget(bracket, 50) == bracket  # nothing to force: the sampled token stands


def test_shortest_branch_picks_the_short_tool_and_enum_value(tokenizer):
    c = constraint_for_request(tokenizer, tools=TOOLS, tool_choice="required")
    assert tokenizer.decode(c.closing_plan()) == format_tool_call("get_weather", {"city": "", "unit": "celsius"})


def test_closing_text_of_a_finished_grammar_is_empty(tokenizer):
    c = constraint_for_request(tokenizer, response_format={"type": "json_object"})
    assert closing_text(c._matcher) == b"{}"
    assert all(c.accept(t) for t in tokenizer.encode('{"a": 1}'))
    assert closing_text(c._matcher) == b"" and c.closing_plan() == []
