"""The tool-call formats of the model families, as :class:`CallFormat` s (names as vLLM's parsers).

* ``hermes`` (Hermes, Qwen2.5, Qwen3, SmolLM2 through our preamble):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
* ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``
* ``glm45`` (GLM-4.5/4.6): ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``
* ``llama3_json``: ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` or bare), ``;`` between calls
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Nemo) or
  ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`` (Small 3.2, Devstral; ``[CALL_ID]`` optional)
* ``deepseek_v31``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...``
* ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
  {...}<|tool_call_end|>...``

XML-style values (qwen3_coder, glm45) are typed by the tool's JSON schema: a parameter the schema
calls a string stays text; others are read as JSON when they parse.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from engine.parsers.base import CallFormat, ParsedCall

_DECODER = json.JSONDecoder()


def _args_json(args: Any) -> str | None:
    if isinstance(args, str):
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    return None


def _json_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    text = _args_json(args)
    return None if text is None else (obj["name"], text, None)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _json_length(text: str, start: int = 0) -> int | None:
    """End offset of the JSON value starting at ``start`` (after whitespace); None while incomplete."""
    i = start + len(text[start:]) - len(text[start:].lstrip())
    if i >= len(text):
        return None
    try:
        _, end = _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None
    return end


# ---------------------------------------------------------------- hermes

def parse_hermes(body: str) -> list[ParsedCall] | None:
    call = _json_call(_loads(body.strip()))
    return None if call is None else [call]


HERMES = CallFormat(starts=("<tool_call>",), end="</tool_call>", parse=parse_hermes)


# ---------------------------------------------------------------- XML-style values

def schema_types(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """{tool name: {parameter: its JSON-schema type}} from OpenAI tool definitions."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


def _typed(value: str, kind: Any) -> Any:
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    parsed = _loads(value)
    return value if parsed is None and value.strip() != "null" else parsed


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?")


def _coder_params(text: str, types: dict[str, Any]) -> dict[str, Any] | None:
    """``<parameter=K>\\nV\\n</parameter>\\n`` repeated, then ``</function>``; a value ends at the first
    ``</parameter>`` followed by another parameter or the end of the function. Whitespace between the
    tags is skipped (a constrained call's grammar allows it there)."""
    args: dict[str, Any] = {}
    while True:
        text = text.lstrip()
        if text.rstrip() == "</function>":
            return args
        m = _PARAM.match(text)
        if m is None:
            return None
        rest, pos = text[m.end():], 0
        while True:
            close = rest.find("</parameter>", pos)
            if close < 0:
                return None
            after = rest[close + len("</parameter>"):].lstrip()
            if after.startswith("<parameter=") or after.rstrip() == "</function>":
                break
            pos = close + 1
        value = rest[:close]
        value = value[:-1] if value.endswith("\n") else value
        args[m.group(1)] = _typed(value, types.get(m.group(1)))
        text = rest[close + len("</parameter>"):]


def qwen3_coder(tools: list[dict] | None) -> CallFormat:
    types = schema_types(tools)

    def parse(body: str) -> list[ParsedCall] | None:
        m = _FUNCTION.match(body)
        if m is None:
            return None
        name = m.group(1)
        args = _coder_params(body[m.end():].rstrip(), types.get(name, {}))
        return None if args is None else [(name, json.dumps(args, ensure_ascii=False), None)]

    return CallFormat(starts=("<tool_call>",), end="</tool_call>", parse=parse)


_GLM_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)


def glm45(tools: list[dict] | None) -> CallFormat:
    types = schema_types(tools)

    def parse(body: str) -> list[ParsedCall] | None:
        name, _, rest = body.partition("<arg_key>")
        name = name.strip()
        if not _GLM_NAME.fullmatch(name):   # a function name, not some other text in <tool_call> tags
            return None
        rest = "<arg_key>" + rest if _ else ""
        args: dict[str, Any] = {}
        while rest.strip():
            m = _GLM_PAIR.match(rest)
            if m is None:
                return None
            close = _glm_value_end(rest, m.end())
            if close is None:
                return None
            args[m.group(1)] = _typed(rest[m.end():close], types.get(name, {}).get(m.group(1)))
            rest = rest[close + len("</arg_value>"):]
        return [(name, json.dumps(args, ensure_ascii=False), None)]

    return CallFormat(starts=("<tool_call>",), end="</tool_call>", parse=parse)


def _glm_value_end(text: str, start: int) -> int | None:
    """The ``</arg_value>`` that ends a value: the first one followed by another key or the end."""
    pos = start
    while (close := text.find("</arg_value>", pos)) >= 0:
        after = text[close + len("</arg_value>"):].lstrip()
        if not after or after.startswith("<arg_key>"):
            return close
        pos = close + 1
    return None


# ---------------------------------------------------------------- JSON bodies that close themselves

def parse_llama3(body: str) -> list[ParsedCall] | None:
    call = _json_call(_loads(body), ("parameters", "arguments"))
    return None if call is None else [call]


LLAMA3_JSON = CallFormat(starts=("<|python_tag|>", '{"name"'), keep=('{"name"',), end=None,
                         parse=parse_llama3, close=_json_length, separators=" \n;")

_MISTRAL_HEAD = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")


def _mistral_close(body: str) -> int | None:
    if body.lstrip().startswith("["):
        return _json_length(body)
    m = _MISTRAL_HEAD.match(body)
    if m is None:  # not (yet) a name followed by [ARGS]
        return None
    return _json_length(body, m.end())


def parse_mistral(body: str) -> list[ParsedCall] | None:
    if body.lstrip().startswith("["):
        items = _loads(body)
        if not isinstance(items, list) or not items:
            return None
        calls = [_json_call(item) for item in items]
        if any(c is None for c in calls):
            return None
        return [(n, a, item.get("id") if isinstance(item.get("id"), str) else None)
                for (n, a, _), item in zip(calls, items)]
    m = _MISTRAL_HEAD.match(body)
    args = _loads(body[m.end():]) if m else None
    if not isinstance(args, dict):
        return None
    return [(m.group(1), json.dumps(args, ensure_ascii=False), m.group(2))]


MISTRAL = CallFormat(starts=("[TOOL_CALLS]",), end=None, parse=parse_mistral, close=_mistral_close,
                     separators=" \n")


# ---------------------------------------------------------------- special-token sections

def _name_then_json(sep: str, name_of: Callable[[str], tuple[str, str | None] | None]):
    def parse(body: str) -> list[ParsedCall] | None:
        head, found, args = body.partition(sep)
        named = name_of(head.strip()) if found else None
        if named is None or not isinstance(_loads(args), dict):
            return None
        return [(named[0], args.strip(), named[1])]
    return parse


def _plain_name(head: str) -> tuple[str, str | None] | None:
    return (head, None) if head and "<" not in head else None


_KIMI_ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_.\-]+):\d+")


def _kimi_name(head: str) -> tuple[str, str | None] | None:
    m = _KIMI_ID.fullmatch(head)
    return None if m is None else (m.group(1), head)


DEEPSEEK_V31 = CallFormat(starts=("<｜tool▁call▁begin｜>",), end="<｜tool▁call▁end｜>",
                          parse=_name_then_json("<｜tool▁sep｜>", _plain_name),
                          noise=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"))

KIMI_K2 = CallFormat(starts=("<|tool_call_begin|>",), end="<|tool_call_end|>",
                     parse=_name_then_json("<|tool_call_argument_begin|>", _kimi_name),
                     noise=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"))
