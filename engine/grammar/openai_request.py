"""OpenAI request options -> a grammar constraint for one request.

Supported (chat completions):

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
  Strict or not, the output is constrained to the schema (a strict grammar never
  loses validity, and a small model needs the help).
- ``tools`` + ``tool_choice``: ``"required"`` (one or more tool calls, nothing else),
  ``{"type": "function", "function": {"name": N}}`` (exactly one call of N),
  ``"auto"`` (free text; once the model writes ``<tool_call>`` the call is
  constrained), ``"none"`` (tools are not constrained). ``parallel_tool_calls:
  false`` allows at most one call.

A tool call is written in the syntax ``call_format`` names (engine/grammar/call_syntax.py: the
model family's own where it is plain text, else Hermes, the text ``format_tool_call`` writes in
engine/tokenizer.py)::

    <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>

with NAME one of the tools and ARGS compact JSON matching that tool's
``parameters`` (or the family's XML parameters). Parallel calls are joined by the
syntax's separator. JSON is compact (``", "`` and ``": "`` separators, no newlines):
a small model given free whitespace can loop on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import (GrammarFormat, OrFormat, StructuralTag, TagFormat,
                                     TagsWithSeparatorFormat, TriggeredTagsFormat)

from engine.grammar.call_syntax import TOOL_CALL_SUFFIX, CallSyntax, syntax_for, tool_call_prefix  # noqa: F401 (re-exported)
from engine.grammar.compiler import GrammarCompilerCache, compiler_cache_for, xgrammar_error_text
from engine.grammar.constraint import XGrammarConstraint
from engine.grammar.schema_check import check_schema
from engine.tokenizer import Tokenizer
from engine.types import InvalidRequest

_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class _Tool:
    name: str
    parameters: dict[str, Any] | bool
    where: str  # "tools[2].function.parameters", for error messages


# -- parsing the request -----------------------------------------------------------------
def _parse_tools(tools: Any) -> list[_Tool]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest(f"tools must be a list, got {type(tools).__name__}")
    out: list[_Tool] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise InvalidRequest(f"tools[{i}]: only tools of type 'function' are supported, got {kind!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is None:
            params = _EMPTY_PARAMETERS
        elif not isinstance(params, (dict, bool)):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        if any(t.name == fn["name"] for t in out):
            raise InvalidRequest(f"tools[{i}].function.name {fn['name']!r} is defined twice")
        out.append(_Tool(fn["name"], params, f"tools[{i}].function.parameters"))
    return out


def _parse_tool_choice(tool_choice: Any, tools: list[_Tool]) -> str | _Tool:
    """'none' | 'auto' | 'required' | the one tool a named choice forces."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs at least one tool in tools")
        return tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice {'type': 'function'} needs function.name (a string)")
        for tool in tools:
            if tool.name == name:
                return tool
        known = ", ".join(t.name for t in tools) or "none"
        raise InvalidRequest(f"tool_choice names the function {name!r}, which is not in tools (tools: {known})")
    raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")


def _parse_response_format(response_format: Any) -> tuple[str, Any] | None:
    """None | ('json_object', None) | ('json_schema', schema)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidRequest("response_format must be an object such as {'type': 'json_object'}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", None)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest("response_format json_schema needs a 'json_schema' object "
                                 "({'name': ..., 'schema': {...}, 'strict': true})")
        if "name" in spec and not isinstance(spec["name"], str):
            raise InvalidRequest("response_format.json_schema.name must be a string")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise InvalidRequest("response_format.json_schema.strict must be a boolean")
        schema = spec.get("schema", _ANY_OBJECT)
        check_schema(schema, "response_format.json_schema.schema")
        return ("json_schema", schema)
    raise InvalidRequest(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


# -- grammars ----------------------------------------------------------------------------
def _json_ebnf(schema: Any, strict: bool, what: str) -> str:
    """EBNF of compact JSON matching ``schema`` (to embed in a structural tag)."""
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema, ensure_ascii=False), any_whitespace=False,
                                               strict_mode=strict)
    except Exception as exc:  # xgrammar's conversion errors are the schema's fault
        raise InvalidRequest(f"{what} is not supported: {xgrammar_error_text(exc)}") from exc
    return str(grammar)


def _tool_tag(tool: _Tool, syntax: CallSyntax) -> TagFormat:
    check_schema(tool.parameters, tool.where)
    return syntax.tag(tool.name, tool.parameters, lambda schema: _json_ebnf(schema, True, tool.where))


def _content_ebnf(fmt: tuple[str, Any]) -> str:
    kind, schema = fmt
    if kind == "json_object":
        return _json_ebnf(_ANY_OBJECT, False, "response_format json_object")
    return _json_ebnf(schema, True, "response_format.json_schema.schema")


def _tools_tag(choice: str | _Tool, tools: list[_Tool], fmt: tuple[str, Any] | None,
               parallel: bool, syntax: CallSyntax) -> StructuralTag:
    if isinstance(choice, _Tool):
        return StructuralTag(format=_tool_tag(choice, syntax))
    tags = [_tool_tag(t, syntax) for t in tools]
    calls = TagsWithSeparatorFormat(tags=tags, separator=syntax.separator, at_least_one=True,
                                    stop_after_first=not parallel)
    if choice == "required":
        return StructuralTag(format=calls)
    if fmt is not None:  # auto + a response format: either the formatted content or tool calls
        return StructuralTag(format=OrFormat(elements=[GrammarFormat(grammar=_content_ebnf(fmt)), calls]))
    return StructuralTag(format=TriggeredTagsFormat(triggers=[syntax.trigger], tags=tags,
                                                    stop_after_first=not parallel))


def constraint_for_request(tokenizer: Tokenizer | GrammarCompilerCache, response_format: Any = None,
                           tools: Any = None, tool_choice: Any = None,
                           parallel_tool_calls: Any = True, call_format: str = "hermes") -> XGrammarConstraint | None:
    """The constraint an OpenAI chat request asks for, or None when its output is free.

    Raises :class:`InvalidRequest` (a 400) naming the offending field for malformed
    options, unknown function names, ``tool_choice: required`` without tools, and
    schemas that cannot be compiled or enforced. Tool calls are written in ``call_format``'s
    syntax (engine/grammar/call_syntax.py). Compiled grammars are cached per
    tokenizer, keyed by the schema / tool-spec text; a fresh matcher is cheap.
    """
    cache = compiler_cache_for(tokenizer)
    try:
        syntax = syntax_for(call_format)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    tool_list = _parse_tools(tools)
    choice = _parse_tool_choice(tool_choice, tool_list)
    fmt = _parse_response_format(response_format)
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    if not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest(f"parallel_tool_calls must be a boolean, got {parallel_tool_calls!r}")

    if choice != "none" and tool_list:
        label = f"tool_choice={choice.name if isinstance(choice, _Tool) else choice}"
        key = json.dumps({"choice": choice.name if isinstance(choice, _Tool) else choice, "syntax": syntax.name,
                          "parallel": parallel_tool_calls, "content": fmt,
                          "tools": [[t.name, t.parameters] for t in tool_list]}, ensure_ascii=False)
        compiled = cache.structural_tag(
            key, lambda: _tools_tag(choice, tool_list, fmt, parallel_tool_calls, syntax), "tools")
    elif fmt is not None and fmt[0] == "json_object":
        label, compiled = "json_object", cache.json_object()
    elif fmt is not None:
        label, compiled = "json_schema", cache.json_schema(fmt[1])
    else:
        return None
    return XGrammarConstraint(compiled, cache.vocab_size, cache.stop_token_ids, label, cache.codec)
