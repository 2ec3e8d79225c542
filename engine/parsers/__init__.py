"""Tool-call and reasoning parsers per model family, chosen from the chat template.

Names follow vLLM's ``--tool-call-parser`` and ``--reasoning-parser``. :func:`detect` picks them
from the template's text at load time; :class:`OutputParser` runs the reasoning parser first and
the tool-call parser on its content, streaming (``push``) or whole (:func:`parse_output`), with
the same result for any chunking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.parsers import formats
from engine.parsers.base import CallFormat, CallScanner, Event, ToolCall, new_tool_call_id
from engine.parsers.harmony import HarmonyParser
from engine.parsers.reasoning import ThinkParser, prompt_opens_reasoning

__all__ = ["TOOL_PARSERS", "REASONING_PARSERS", "OutputParser", "ParsedOutput", "ToolCall", "detect",
           "new_tool_call_id", "parse_output", "check_names", "needs_special_tokens", "constrained_call_format",
           "control_token_texts"]

# name -> the CallFormat for a request's tools (XML formats type their values by the tools' schemas)
_FORMATS: dict[str, Callable[[list[dict] | None], CallFormat]] = {
    "hermes": lambda tools: formats.HERMES,
    "qwen3_coder": formats.qwen3_coder,
    "glm45": formats.glm45,
    "llama3_json": lambda tools: formats.LLAMA3_JSON,
    "mistral": lambda tools: formats.MISTRAL,
    "deepseek_v31": lambda tools: formats.DEEPSEEK_V31,
    "kimi_k2": lambda tools: formats.KIMI_K2,
}
TOOL_PARSERS = tuple(_FORMATS) + ("openai",)
REASONING_PARSERS = ("qwen3", "deepseek_r1", "gpt_oss")
HARMONY = ("openai", "gpt_oss")

# The formats a grammar can write a call in (engine/grammar/call_syntax.py builds them), with the
# markers that must be plain text in the tokenizer for that: the other formats mark calls with
# control tokens, which grammars over text never emit.
IN_FORMAT_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": (),
    "qwen3_coder": ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>"),
    "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
}

# Markers whose tokens are special in these families' vocabularies: the reply's text must keep them.
_SPECIAL_MARKERS = {"llama3_json", "mistral", "deepseek_v31", "kimi_k2", "openai", "gpt_oss"}

# (tool parser, reasoning parser, what in the template identifies the family), first match wins
_SIGNATURES: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("openai", "gpt_oss", ("<|channel|>",)),
    ("kimi_k2", None, ("<|tool_calls_section_begin|>",)),
    ("deepseek_v31", "deepseek_r1", ("<｜tool▁calls▁begin｜>",)),
    ("glm45", "qwen3", ("<arg_key>",)),
    ("qwen3_coder", "qwen3", ("<function=",)),
    ("mistral", None, ("[TOOL_CALLS]",)),
    ("llama3_json", None, ("<|start_header_id|>", '"parameters": ')),
    ("hermes", "qwen3", ("<tool_call>", "<think>")),
    ("hermes", None, ("<tool_call>",)),
)


def detect(template: str | None) -> tuple[str, str | None]:
    """(tool-call parser, reasoning parser) for a chat template; Hermes (our preamble) by default."""
    text = template or ""
    for tool, reasoning, marks in _SIGNATURES:
        if all(m in text for m in marks):
            if reasoning == "qwen3" and "<think>" not in text and "</think>" not in text:
                reasoning = None
            return tool, reasoning
    return "hermes", None


def control_token_texts(hf_tokenizer) -> set[str]:
    """The texts of a ``tokenizers`` tokenizer's special (control) added tokens."""
    return {t.content for t in hf_tokenizer.get_added_tokens_decoder().values() if t.special}


def constrained_call_format(tool_parser: str | None, control_tokens: set[str]) -> str:
    """The syntax constrained calls are written in for a model whose tool-call parser is ``tool_parser``:
    the family's own where its markers are plain text in this tokenizer (``control_tokens``: the texts
    of its control tokens), else ``hermes``."""
    markers = IN_FORMAT_MARKERS.get(tool_parser or "hermes")
    if markers is None or any(m in control_tokens for m in markers):
        return "hermes"
    return tool_parser or "hermes"


def check_names(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """ValueError naming the flag, the value and what is allowed, for an unknown parser name."""
    if tool_parser is not None and tool_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")


def needs_special_tokens(tool_parser: str | None, reasoning_parser: str | None) -> bool:
    return bool({tool_parser, reasoning_parser} & _SPECIAL_MARKERS)


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> "ParsedOutput":
        for kind, value in events:
            if kind == "call":
                self.tool_calls.append(value)
            elif kind == "reasoning":
                self.reasoning += value
            else:
                self.content += value
        return self


class OutputParser:
    """Reasoning, then tool calls in the content; ``tool_parser`` None: no tool calls are parsed,
    ``reasoning_parser`` None: no reasoning is split off. ``prompt_text`` decides whether the reply
    starts inside a ``<think>`` block; ``tools`` type XML-style argument values."""

    def __init__(self, tool_parser: str | None, reasoning_parser: str | None, *, prompt_text: str = "",
                 tools: list[dict] | None = None) -> None:
        check_names(tool_parser, reasoning_parser)
        self.harmony = HarmonyParser() if (tool_parser in HARMONY or reasoning_parser in HARMONY) else None
        self.keep_reasoning = reasoning_parser is not None
        self.calls = self.harmony is None and tool_parser is not None
        self.think = None
        if self.harmony is None and reasoning_parser is not None:
            self.think = ThinkParser(starts_inside=prompt_opens_reasoning(prompt_text))
        self.scanner = CallScanner(_FORMATS[tool_parser](tools)) if self.calls else None
        self.want_calls = tool_parser is not None

    def push(self, delta: str) -> list[Event]:
        if self.harmony is not None:
            return self._harmony(self.harmony.push(delta))
        events = self.think.push(delta) if self.think else [("content", delta)]
        return self._calls(events, finish=False, truncated=False)

    def finish(self, truncated: bool = False) -> list[Event]:
        if self.harmony is not None:
            return self._harmony(self.harmony.finish(truncated))
        events = self.think.finish(truncated) if self.think else []
        return self._calls(events, finish=True, truncated=truncated)

    def _calls(self, events: list[Event], finish: bool, truncated: bool) -> list[Event]:
        if self.scanner is None:
            return [e for e in events if e[1] != ""]
        out: list[Event] = []
        for kind, value in events:
            out += self.scanner.push(value) if kind == "content" else [(kind, value)]
        if finish:
            out += self.scanner.finish(truncated)
        return [e for e in out if e[1] != ""]

    def _harmony(self, events: list[Event]) -> list[Event]:
        """Without a reasoning parser reasoning is content; without a tool parser calls are dropped."""
        out: list[Event] = []
        for kind, value in events:
            if kind == "reasoning" and not self.keep_reasoning:
                kind = "content"
            if kind == "call" and not self.want_calls:
                continue
            out.append((kind, value))
        return out


def parse_output(text: str, tool_parser: str | None, reasoning_parser: str | None = None, *,
                 prompt_text: str = "", tools: list[dict] | None = None, truncated: bool = False) -> ParsedOutput:
    """The whole reply at once: one push and a finish of :class:`OutputParser`."""
    parser = OutputParser(tool_parser, reasoning_parser, prompt_text=prompt_text, tools=tools)
    return ParsedOutput().add(parser.push(text)).add(parser.finish(truncated))
