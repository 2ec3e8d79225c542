"""Grammar-constrained decoding with xgrammar: JSON schemas, JSON objects and tool calls.

- :func:`constraint_for_request` turns OpenAI request options (``response_format``,
  ``tools``, ``tool_choice``, ``parallel_tool_calls``) into a per-request
  :class:`XGrammarConstraint`, or None.
- :class:`GrammarCompilerCache` (one per tokenizer) holds xgrammar's tokenizer info,
  its compiler and the compiled grammars.
- :func:`apply_constraints` masks a whole batch of logits at once.

See docs/structured_outputs.md.
"""

from engine.grammar.compiler import GrammarCompilerCache, build_tokenizer_info, compiler_cache_for
from engine.grammar.constraint import XGrammarConstraint, apply_constraints, unpack_bitmask
from engine.grammar.openai_request import TOOL_CALL_SUFFIX, constraint_for_request, tool_call_prefix
from engine.grammar.schema_check import check_schema

__all__ = [
    "GrammarCompilerCache", "XGrammarConstraint", "apply_constraints", "build_tokenizer_info",
    "check_schema", "compiler_cache_for", "constraint_for_request", "tool_call_prefix",
    "TOOL_CALL_SUFFIX", "unpack_bitmask",
]
