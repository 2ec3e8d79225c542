"""Constrained tool calls in the model family's own syntax (the tool-call parser's name picks it).

A forced call (``tool_choice`` required or named) or a strict tool schema is enforced by a structural
tag (engine/grammar/openai_request.py); this module says what one call looks like in each family whose
call syntax is plain text, so that the grammar makes the model write what its template taught it and
the family's own parser (engine/parsers/formats.py) reads it back:

* ``hermes`` (Hermes, Qwen2.5, Qwen3, SmolLM2 through our preamble):
  ``<tool_call>\\n{"name": "N", "arguments": ARGS}\\n</tool_call>``, calls separated by a newline
* ``llama3_json``: ``{"name": "N", "parameters": ARGS}``, calls separated by ``"; "``
* ``qwen3_coder``: ``<tool_call>\\n<function=N>\\n<parameter=K>V</parameter>...</function>\\n</tool_call>``
  (xgrammar's ``qwen_xml`` style for the parameters)
* ``glm45``: ``<tool_call>N\\n<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``
  (xgrammar's ``glm_xml`` style)

ARGS is compact JSON matching the tool's ``parameters``. The other families (``mistral``,
``deepseek_v31``, ``kimi_k2``, ``openai``) mark calls with control tokens, which a grammar over text
cannot emit (engine/grammar/compiler.py gives control tokens no text); their forced calls are written
in Hermes syntax and parsed as Hermes (:func:`in_format_syntax` says which applies), and the next turn's
template renders them in the family's own format from the structured ``tool_calls``. A family whose
markers are control tokens in the loaded tokenizer (a GLM tokenizer may make ``<tool_call>`` one) falls
back the same way (``engine.parsers.constrained_call_format`` decides, without loading xgrammar).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from xgrammar.structural_tag import GrammarFormat, JSONSchemaFormat, TagFormat

from engine.tokenizer import TOOL_CALL_END, TOOL_CALL_START

# (tool name, its parameters schema, json_ebnf(schema) -> EBNF of compact JSON) -> one call's tag
TagBuilder = Callable[[str, Any, Callable[[Any], str]], TagFormat]


@dataclass(frozen=True)
class CallSyntax:
    """One family's constrained call: ``tag`` builds a call of one tool, ``separator`` joins parallel
    calls, ``trigger`` is the text that opens a call (with ``tool_choice: auto``, the grammar takes over
    there)."""

    name: str
    tag: TagBuilder
    separator: str
    trigger: str


def _quoted(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)


def tool_call_prefix(name: str) -> str:
    """The text before a Hermes call's arguments (as ``format_tool_call`` writes it)."""
    return f'{TOOL_CALL_START}\n{{"name": {_quoted(name)}, "arguments": '


TOOL_CALL_SUFFIX = "}\n" + TOOL_CALL_END


def _hermes(name: str, schema: Any, json_ebnf: Callable[[Any], str]) -> TagFormat:
    return TagFormat(begin=tool_call_prefix(name), content=GrammarFormat(grammar=json_ebnf(schema)),
                     end=TOOL_CALL_SUFFIX)


def _llama3(name: str, schema: Any, json_ebnf: Callable[[Any], str]) -> TagFormat:
    return TagFormat(begin=f'{{"name": {_quoted(name)}, "parameters": ',
                     content=GrammarFormat(grammar=json_ebnf(schema)), end="}")


def _qwen3_coder(name: str, schema: Any, json_ebnf: Callable[[Any], str]) -> TagFormat:
    return TagFormat(begin=f"<tool_call>\n<function={name}>\n",
                     content=JSONSchemaFormat(json_schema=schema, style="qwen_xml"),
                     end="</function>\n</tool_call>")


def _glm45(name: str, schema: Any, json_ebnf: Callable[[Any], str]) -> TagFormat:
    return TagFormat(begin=f"<tool_call>{name}\n", content=JSONSchemaFormat(json_schema=schema, style="glm_xml"),
                     end="</tool_call>")


SYNTAXES: dict[str, CallSyntax] = {s.name: s for s in (
    CallSyntax("hermes", _hermes, "\n", TOOL_CALL_START),
    CallSyntax("llama3_json", _llama3, "; ", '{"name": '),
    CallSyntax("qwen3_coder", _qwen3_coder, "\n", "<tool_call>"),
    CallSyntax("glm45", _glm45, "\n", "<tool_call>"),
)}
CALL_FORMATS = tuple(SYNTAXES)


def syntax_for(call_format: str) -> CallSyntax:
    """The :class:`CallSyntax` named ``call_format`` (ValueError naming those there are)."""
    try:
        return SYNTAXES[call_format]
    except KeyError:
        raise ValueError(f"call_format must be one of {', '.join(CALL_FORMATS)}, got {call_format!r}") from None
