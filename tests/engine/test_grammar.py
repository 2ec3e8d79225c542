"""engine.grammar with the real default tokenizer: masks, state, schema features, errors."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine.tokenizer import format_tool_call, parse_tool_calls
from engine.constraints import TokenConstraint
from engine.grammar import (TOOL_CALL_SUFFIX, GrammarCompilerCache, XGrammarConstraint, apply_constraints,
                            compiler_cache_for, constraint_for_request, tool_call_prefix)
from engine.loader import load_tokenizer
from engine.types import InvalidRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                     "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]

# Nested objects, arrays, enums, anyOf, $defs/$ref, additionalProperties false, required.
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "customer": {"$ref": "#/$defs/customer"},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]},
        "note": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
    },
    "required": ["id", "customer", "items", "status"],
    "additionalProperties": False,
    "$defs": {"customer": {"type": "object", "properties": {"name": {"type": "string"},
                                                            "vip": {"type": "boolean"}},
                           "required": ["name"], "additionalProperties": False}},
}
VALID_ORDERS = [
    {"id": 7, "customer": {"name": "Ann", "vip": True}, "items": [{"sku": "ABC-12", "qty": 2}], "status": "paid"},
    {"id": 1, "customer": {"name": "B"}, "items": [{"sku": "XYZ-00", "qty": 9}, {"sku": "QQQ-01", "qty": 1}],
     "status": "new", "note": None},
    {"id": 42, "customer": {"name": "Ça va"}, "items": [{"sku": "AAA-99", "qty": 3}], "status": "shipped",
     "note": "fragile"},
]
INVALID_ORDERS = [
    {"id": 7, "customer": {"name": "Ann"}, "items": [], "status": "paid"},                           # minItems
    {"id": 7, "customer": {"name": "Ann"}, "items": [{"sku": "abc-12", "qty": 2}], "status": "paid"},  # pattern
    {"id": 7, "customer": {"name": "Ann"}, "items": [{"sku": "ABC-12", "qty": 2}], "status": "lost"},  # enum
    {"id": 7, "customer": {"name": "Ann"}, "items": [{"sku": "ABC-12", "qty": 2}]},                    # required
    {"id": 7, "customer": {"name": "Ann", "age": 3}, "items": [{"sku": "ABC-12", "qty": 2}],
     "status": "new"},                                                                               # additionalProperties
    {"id": 7, "customer": {"name": "Ann"}, "items": [{"sku": "ABC-12", "qty": 2}], "status": "new",
     "note": "far too long a note"},                                                                 # anyOf/maxLength
    {"id": 0, "customer": {"name": "Ann"}, "items": [{"sku": "ABC-12", "qty": 2}], "status": "new"},  # minimum
]


def _schema_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": strict}}


def _feed(constraint: TokenConstraint, tokenizer, text: str) -> bool:
    """Accept ``text`` token by token; False at the first token the constraint refuses."""
    return all(constraint.accept(t) for t in tokenizer.encode(text))


def _complete(constraint: XGrammarConstraint, tokenizer, text: str) -> bool:
    """``text`` is a whole output of the grammar: accepted, and EOS (or nothing) may follow."""
    if not _feed(constraint, tokenizer, text):
        return False
    return constraint.is_terminated() or bool(constraint.allowed_mask(tokenizer.vocab_size)[2])


def _brute_force_mask(constraint: XGrammarConstraint, vocab_size: int, special: set[int]) -> torch.Tensor:
    """The oracle: a token is allowed iff a copy of the matcher accepts it."""
    out = torch.zeros(vocab_size, dtype=torch.bool)
    for t in range(vocab_size):
        if t not in special:
            out[t] = constraint._matcher.fork().accept_token(t)
    return out


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer alone (no weights): these tests never run the model."""
    return load_tokenizer(None)[0]


@pytest.fixture(scope="module")
def special_ids(tokenizer) -> set[int]:
    return {i for i, tok in tokenizer.hf.get_added_tokens_decoder().items()
            if tok.special and i not in tokenizer.eos_token_ids}


# -- masks: fast path == reference path == oracle ------------------------------------------
STATES = [  # (request options, text already generated)
    ({"response_format": _schema_format(ORDER)}, ""),
    ({"response_format": _schema_format(ORDER)}, '{"id": 3, "customer": {"name": "Jo'),     # dense: in a string
    ({"response_format": _schema_format(ORDER)}, '{"id": 3, "customer": {"name": "Jo"'),    # sparse: , or }
    ({"response_format": _schema_format(ORDER)}, '{"id": 3, "customer": {"name": "J"}, "items": [{"sku": "AB'),
    ({"response_format": {"type": "json_object"}}, '{"a": [1, '),
    ({"tools": TOOLS, "tool_choice": "required"}, ""),
    ({"tools": TOOLS, "tool_choice": "required"}, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "Let me check. "),
    ({"tools": TOOLS, "tool_choice": "auto"}, 'Sure <tool_call>\n{"name": "se'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}},
     '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'),       # only EOS left
]


@pytest.mark.parametrize("options,prefix", STATES)
def test_fast_mask_equals_reference_and_oracle(tokenizer, special_ids, options, prefix):
    c = constraint_for_request(tokenizer, **options)
    assert _feed(c, tokenizer, prefix)
    V = tokenizer.vocab_size
    logits = torch.randn(V, generator=torch.Generator().manual_seed(len(prefix)))
    fast, ref = logits.clone(), logits.clone()
    c.apply_to_logits(fast)                       # bitmask kernel / sparse keep-fill-restore
    TokenConstraint.apply_to_logits(c, ref)       # the interface's default: via allowed_mask
    assert torch.equal(fast, ref)
    mask = c.allowed_mask(V)
    assert torch.equal(mask, _brute_force_mask(c, V, special_ids))
    assert not mask[sorted(special_ids)].any()    # control tokens never appear in constrained text


def test_batch_apply_equals_row_by_row(tokenizer):
    V = tokenizer.vocab_size
    cons = [constraint_for_request(tokenizer, response_format=_schema_format(ORDER)), None,
            constraint_for_request(tokenizer, tools=TOOLS, tool_choice="required")]
    _feed(cons[0], tokenizer, '{"id": 3, "status')
    logits = torch.randn(3, V)
    rowwise, batched = logits.clone(), logits.clone()
    for i, c in enumerate(cons):
        if c is not None:
            c.apply_to_logits(rowwise[i])
    apply_constraints(batched, cons)
    assert torch.equal(rowwise, batched)
    assert torch.equal(batched[1], logits[1])


def test_logits_wider_than_vocab_mask_the_padding(tokenizer):
    c = constraint_for_request(tokenizer, response_format={"type": "json_object"})
    _feed(c, tokenizer, '{"a": "')
    row = torch.zeros(tokenizer.vocab_size + 64)
    c.apply_to_logits(row)
    assert torch.isinf(row[tokenizer.vocab_size:]).all()
    assert torch.isfinite(row[:tokenizer.vocab_size]).sum() > 40000


# -- state: accept, rollback, termination -------------------------------------------------
def test_accept_rollback_restores_masks(tokenizer):
    V = tokenizer.vocab_size
    c = constraint_for_request(tokenizer, response_format=_schema_format(ORDER))
    ids = tokenizer.encode(json.dumps(VALID_ORDERS[0]))
    masks = []
    for t in ids[:12]:
        masks.append(c.allowed_mask(V).clone())
        assert c.accept(t)
    assert c.num_accepted == 12
    c.rollback(5)
    assert c.num_accepted == 7
    assert torch.equal(c.allowed_mask(V), masks[7])
    for t in ids[7:]:
        assert c.accept(t)
    assert c.is_terminated()
    c.rollback(len(ids))
    assert torch.equal(c.allowed_mask(V), masks[0])
    with pytest.raises(ValueError, match="cannot roll back 1 tokens"):
        c.rollback(1)


def test_refused_token_leaves_state_unchanged(tokenizer):
    V = tokenizer.vocab_size
    c = constraint_for_request(tokenizer, response_format=_schema_format(ORDER))
    assert _feed(c, tokenizer, '{"id": 5, ')
    before = c.allowed_mask(V).clone()
    bad = tokenizer.encode("}")[0]
    assert not before[bad]
    assert not c.accept(bad)
    assert torch.equal(c.allowed_mask(V), before)


def test_eos_only_where_the_grammar_may_end(tokenizer):
    V, eos = tokenizer.vocab_size, tokenizer.eos_token_ids[0]
    c = constraint_for_request(tokenizer, response_format=_schema_format({"type": "integer"}))
    assert not c.allowed_mask(V)[eos]                   # nothing yet: EOS would be empty output
    assert _feed(c, tokenizer, "12")
    assert c.allowed_mask(V)[eos] and not c.is_terminated()  # "12" may end or go on ("123")
    assert c.accept(eos) and c.is_terminated()

    c = constraint_for_request(tokenizer, response_format=_schema_format(ORDER))
    assert _feed(c, tokenizer, '{"id": 1, "customer": {"name": "x"}')
    assert not c.allowed_mask(V)[eos]


def test_terminates_when_only_eos_can_follow(tokenizer):
    """A closed object / the last permitted tool call ends the output without an EOS step."""
    c = constraint_for_request(tokenizer, response_format=_schema_format(ORDER))
    assert _feed(c, tokenizer, json.dumps(VALID_ORDERS[1])) and c.is_terminated()
    one_call = format_tool_call("search", {"query": "x"})
    c = constraint_for_request(tokenizer, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert _feed(c, tokenizer, one_call) and c.is_terminated()
    c = constraint_for_request(tokenizer, tools=TOOLS, tool_choice="required")  # parallel: may add a call
    assert _feed(c, tokenizer, one_call) and not c.is_terminated()


def test_a_draft_past_the_stop_token_counts_up_to_it_quietly(tokenizer, capfd):
    """A speculative draft that ends the output and goes on (the stop token, then a newline: the demo's
    tool calls drafted exactly that): ``valid_prefix`` counts up to the stop token, and asks xgrammar about
    nothing after it, which would print "The matcher has terminated ..." on the server's console."""
    eos, newline = tokenizer.eos_token_ids[0], tokenizer.encode("\n")
    c = constraint_for_request(tokenizer, response_format=_schema_format({"type": "integer"}))
    body = tokenizer.encode("12")
    assert c.valid_prefix(body + [eos] + newline + body) == len(body) + 1
    assert c.valid_prefix(body) == len(body) and not c.is_terminated()   # the state was not moved
    assert "terminated" not in capfd.readouterr().err


def test_clone_is_independent(tokenizer):
    V = tokenizer.vocab_size
    c = constraint_for_request(tokenizer, response_format=_schema_format(ORDER))
    _feed(c, tokenizer, '{"id": 2, ')
    before = c.allowed_mask(V).clone()
    twin = c.clone()
    assert twin.num_accepted == c.num_accepted
    assert torch.equal(twin.allowed_mask(V), before)
    assert _feed(twin, tokenizer, '"customer": {"name": "A')
    assert torch.equal(c.allowed_mask(V), before)
    assert not torch.equal(twin.allowed_mask(V), before)


# -- schema features -------------------------------------------------------------------------
@pytest.mark.parametrize("instance", VALID_ORDERS)
def test_schema_features_accept_valid_instances(tokenizer, instance):
    jsonschema.validate(instance, ORDER)
    c = constraint_for_request(tokenizer, response_format=_schema_format(ORDER))
    assert _complete(c, tokenizer, json.dumps(instance, ensure_ascii=False))


@pytest.mark.parametrize("instance", INVALID_ORDERS)
def test_schema_features_refuse_invalid_instances(tokenizer, instance):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(instance, ORDER)
    c = constraint_for_request(tokenizer, response_format=_schema_format(ORDER))
    assert not _complete(c, tokenizer, json.dumps(instance, ensure_ascii=False))


def test_recursive_ref_and_non_strict_schema(tokenizer):
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}}}
    c = constraint_for_request(tokenizer, response_format=_schema_format(tree, strict=False))
    assert _complete(c, tokenizer, '{"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3}]}')


def test_json_object_is_any_compact_object(tokenizer):
    fmt = {"type": "json_object"}
    assert _complete(constraint_for_request(tokenizer, response_format=fmt), tokenizer, '{"a": [1, {"b": null}]}')
    assert not _complete(constraint_for_request(tokenizer, response_format=fmt), tokenizer, "[1, 2]")
    assert constraint_for_request(tokenizer, response_format={"type": "text"}) is None
    assert constraint_for_request(tokenizer) is None
    assert constraint_for_request(tokenizer, tools=TOOLS, tool_choice="none") is None


# -- tool calls ------------------------------------------------------------------------------
def test_tool_call_text_is_what_format_tool_call_writes():
    args = {"city": "Paris", "unit": "celsius"}
    text = format_tool_call("get_weather", args)
    assert text == tool_call_prefix("get_weather") + json.dumps(args) + TOOL_CALL_SUFFIX
    content, calls = parse_tool_calls(text)
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == args


def test_tool_choice_required_named_and_auto(tokenizer):
    weather = format_tool_call("get_weather", {"city": "Oslo", "unit": "celsius"})
    search = format_tool_call("search", {"query": "news"})

    def accepts(text, **options):
        return _complete(constraint_for_request(tokenizer, tools=TOOLS, **options), tokenizer, text)

    assert accepts(weather, tool_choice="required")
    assert accepts(weather + "\n" + search, tool_choice="required")
    assert not accepts("Sure! " + weather, tool_choice="required")               # a call from the first token
    assert not accepts(format_tool_call("get_weather", {"city": "Oslo"}), tool_choice="required")  # required arg
    assert not accepts(format_tool_call("get_weather", {"city": "Oslo", "unit": "kelvin"}), tool_choice="required")
    assert not accepts(format_tool_call("delete_all", {}), tool_choice="required")  # not a tool
    assert not accepts(weather + "\n" + search, tool_choice="required", parallel_tool_calls=False)
    named = {"type": "function", "function": {"name": "search"}}
    assert accepts(search, tool_choice=named)
    assert not accepts(weather, tool_choice=named)
    assert accepts("The weather is nice.", tool_choice="auto")
    assert accepts("Checking. " + weather, tool_choice="auto")
    assert not accepts("Checking. <tool_call>\nget_weather(Oslo)", tool_choice="auto")  # a started call is checked


def test_tool_without_parameters_takes_empty_arguments(tokenizer):
    tools = [{"type": "function", "function": {"name": "now"}}]
    assert _complete(constraint_for_request(tokenizer, tools=tools, tool_choice="required"), tokenizer,
                     format_tool_call("now", {}))


def test_auto_with_response_format_is_content_or_calls(tokenizer):
    fmt = _schema_format({"type": "object", "properties": {"answer": {"type": "string"}},
                          "required": ["answer"], "additionalProperties": False})
    assert _complete(constraint_for_request(tokenizer, response_format=fmt, tools=TOOLS), tokenizer,
                     '{"answer": "4"}')
    assert _complete(constraint_for_request(tokenizer, response_format=fmt, tools=TOOLS), tokenizer,
                     format_tool_call("search", {"query": "2+2"}))
    assert not _complete(constraint_for_request(tokenizer, response_format=fmt, tools=TOOLS), tokenizer,
                         "four")


# -- errors: 400 naming the part ---------------------------------------------------------------
@pytest.mark.parametrize("options,needle", [
    ({"response_format": _schema_format({"type": "object", "properties": {"x": {"type": "foo"}}})}, '"foo"'),
    ({"response_format": _schema_format({"type": "string", "pattern": "(?<=a)b"})}, "Lookbehind"),
    ({"response_format": _schema_format({"$ref": "#/$defs/missing"})}, "$defs"),
    ({"response_format": _schema_format({"type": "object", "properties": {"x": {"not": {"type": "string"}}}})},
     "'not' at #/properties/x/not"),
    ({"response_format": _schema_format({"type": "array", "uniqueItems": True})}, "uniqueItems"),
    ({"response_format": _schema_format({"allOf": [{"type": "object"}, {"required": ["a"]}]})}, "allOf"),
    ({"response_format": _schema_format({"type": "object", "if": {}, "then": {}})}, "'if'"),
    ({"response_format": _schema_format([1])}, "must be a JSON schema object"),
    ({"response_format": {"type": "json_schema"}}, "'json_schema' object"),
    ({"response_format": {"type": "yaml"}}, "'yaml'"),
    ({"response_format": "json"}, "response_format must be an object"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "'launch'"),
    ({"tool_choice": "required"}, "needs at least one tool"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "'sometimes'"),
    ({"tools": [{"type": "code_interpreter"}]}, "only tools of type 'function'"),
    ({"tools": [WEATHER, WEATHER]}, "defined twice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls must be a boolean"),
])
def test_unsupported_requests_raise_invalid_request(tokenizer, options, needle):
    with pytest.raises(InvalidRequest) as info:
        constraint_for_request(tokenizer, **options)
    assert needle in str(info.value)


# -- the compiler cache --------------------------------------------------------------------------
def test_compiled_grammars_are_cached_by_spec_text(tokenizer):
    cache = GrammarCompilerCache(tokenizer, max_entries=2)
    for _ in range(3):
        constraint_for_request(cache, response_format=_schema_format(ORDER))
    constraint_for_request(cache, tools=TOOLS, tool_choice="required")
    constraint_for_request(cache, tools=[dict(WEATHER, function=dict(WEATHER["function"], description="other")),
                                         SEARCH], tool_choice="required")  # descriptions do not matter
    assert (cache.misses, cache.hits, len(cache)) == (2, 3, 2)
    constraint_for_request(cache, response_format={"type": "json_object"})
    assert len(cache) == 2  # bounded: the least recently used entry went
    assert compiler_cache_for(tokenizer) is compiler_cache_for(tokenizer)
