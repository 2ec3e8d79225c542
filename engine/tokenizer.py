"""Where text meets tokens: the tokenizer, the chat template that renders a conversation (with its tools)
to a prompt, and the output processor that turns a request's token ids back into text. The engine
speaks tokens; everything about text is here, run by the thread that submits and consumes (the event
loop, or ``LLMEngine.generate``'s caller), never the engine thread.

The tokenizer is a `tokenizers.Tokenizer` built from GGUF metadata or read from a
Hugging Face ``tokenizer.json``; the chat template is rendered with jinja2 the way
transformers renders it (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``).

Chat prompts with tools, and parsing tool calls out of model text (:func:`render_chat_prompt`,
:func:`parse_tool_calls`). Tool calls use the Hermes / Qwen convention, which most open chat models were
trained on or follow when told::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

When the model's chat template renders tools itself (it reads ``tools`` or
``tool_calls``) the messages go to it as transformers passes them: tools, calls with
their arguments as objects, tool results with their ids, earlier reasoning; the model
then calls tools in its family's own format (parsed by engine/parsers). Otherwise
(SmolLM2's plain ChatML template) the tool signatures are added to the system message
with instructions, assistant tool calls are written back in the format above and tool
results are wrapped in ``<tool_response>`` tags.

The output processor (:class:`OutputProcessor`, vLLM v1's): the engine's token ids in, text out. Each
step the engine emits the token ids a request gained, and it ends a request only
on what tokens say: EOS or a stop token id, ``max_tokens``, the context window, a constraint that
completed. Everything about text happens here, on the thread that consumes the outputs (the event loop
reading an ``AsyncEngine`` stream, or ``LLMEngine.generate``'s caller), never on the engine thread:

- incremental detokenization (``IncrementalDetokenizer``: no UTF-8 character split across outputs);
- stop strings: the output whose text completes one is the request's last, cut after the token that
  completed it, with the text before the stop string; the owner then asks the engine to finish the
  request as stopped (``LLMEngine.stop_request``: its KV is cached, and a session turn's pinned, as for
  an EOS), and the tokens the engine computed meanwhile are never delivered;
- holding back text that may begin a stop string until it cannot.

The tool-call and reasoning parsers (engine/parsers) read this text next, once per request, in the
serving layer that answers the client (``agentrt.core.generation.Generation``): a router's, when the engine is
a worker behind it. That is the only place a model's output format is parsed; the speculative drafter
(engine/speculative.py) works on the same token ids and parses nothing.
"""

from __future__ import annotations

import json
from datetime import datetime
from dataclasses import dataclass
from typing import Any, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine.parsers import ParsedOutput, ToolCall
from engine.parsers.base import CallScanner
from engine.parsers.formats import HERMES
from engine.types import RequestOutput, SamplingParams

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def tokenizer_from_gguf_fields(tokens: list[str], merges: list[str], token_types: list[int],
                               pre: str) -> HFTokenizer:
    """A byte-level BPE tokenizer equivalent to llama.cpp's for ``gpt2``-model GGUFs."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "qwen2", "llama-bpe", "deepseek-llm", "starcoder"):
        # llama.cpp splits digits one by one before the GPT-2 regex for these.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(token_types) if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    return tok


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter: plain ``json.dumps`` (jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass
class Tokenizer:
    """Encode/decode plus the model's chat template and its special token ids."""

    hf: HFTokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool = False

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        self._template = env.from_string(self.chat_template) if self.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> str:
        """The prompt text for ``messages`` (each ``{"role", "content", ...}``); ``extra``: more template
        variables (``tools``, ``enable_thinking``...), as transformers' ``apply_chat_template`` passes them."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos, eos_token=eos, **extra)
        except jinja2.TemplateError as exc:  # raise_exception() in the template, or a field it needs
            raise ValueError(f"the chat template refused these messages: {exc}") from None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a UTF-8 character.

    Decodes a short window of recent tokens (as vLLM does) and emits only text that
    is complete: a trailing U+FFFD means a multi-byte character is still arriving.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0    # tokens before this have been emitted as text

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly completed text (may be empty)."""
        self.ids.extend(token_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """At the end of a request: whatever is left, replacement characters included."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


# ------------------------------------------------------------ the chat template with tools

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_TOOLS_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures "
    "within <tools></tools> XML tags. You may call one or more functions to assist with "
    "the user query. Don't make assumptions about what values to plug into functions. "
    "Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def content_text(content: Any) -> str:
    """OpenAI message content (a string, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError("message content parts must be {'type': 'text', 'text': str}; "
                                 "other part types are not supported by this model")
        return "".join(parts)
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def format_tool_call(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the string: the model sees what was sent
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def template_handles_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads ``tools`` or ``tool_calls``)."""
    return bool(template) and ("tools" in template or "tool_calls" in template)


_REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as the object templates expect (transformers' convention); a string that
    is not a JSON object is passed as it is."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def native_message(m: dict[str, Any]) -> dict[str, Any]:
    """One message as a tool-aware template reads it, the way transformers passes it: keys that are
    None dropped (an assistant's null content is ""), tool-call arguments as objects, earlier reasoning under ``reasoning_content`` and
    ``thinking`` (gpt-oss reads the latter)."""
    out = {k: v for k, v in m.items() if v is not None}
    if "content" in out or m.get("role") == "assistant":  # null beside calls: "" (Devstral's template reads it)
        out["content"] = content_text(out.get("content"))
    if out.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"],
                                                "arguments": _arguments_object(c["function"].get("arguments", {}))}}
                             for c in out["tool_calls"]]
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
        out.pop("reasoning", None)
    return out


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict] | None) -> list[dict[str, Any]]:
    """Messages as plain ``{"role", "content"}`` dicts for a template that knows nothing of tools:
    the tool signatures in the system message (the Hermes preamble), calls written back in Hermes
    format, results in ``<tool_response>`` tags, earlier reasoning dropped."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        text = content_text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = [format_tool_call(c["function"]["name"], c["function"].get("arguments", "{}"))
                     for c in m["tool_calls"]]
            text = "\n".join(([text] if text else []) + calls)
        elif role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    if tools:
        sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        preamble = _TOOLS_PREAMBLE.format(tools=sigs)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def render_chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                       add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text: through the template as it was written when it handles tools (the same text
    as transformers' ``apply_chat_template``), else with the Hermes preamble. ``template_kwargs``:
    the template's own switches (``enable_thinking``, ``reasoning_effort``...), vLLM's
    ``chat_template_kwargs``."""
    extra = dict(template_kwargs or {})
    if template_handles_tools(tokenizer.chat_template):
        msgs = [native_message(m) for m in messages]
        if tools:
            extra["tools"] = tools
    else:
        msgs = hermes_messages(messages, tools)
    return tokenizer.render_chat(msgs, add_generation_prompt=add_generation_prompt, **extra)


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    return tokenizer.encode(render_chat_prompt(tokenizer, messages, tools, add_generation_prompt, template_kwargs))


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split Hermes-format model text into (content, tool calls): the streaming parser fed the whole
    text at once (engine/parsers). Malformed closed blocks stay in the content; an unclosed block at
    the end is a call if it is complete JSON, else it is dropped (a partial call is never content)."""
    scanner = CallScanner(HERMES)
    out = ParsedOutput().add(scanner.push(text)).add(scanner.finish())
    return (out.content.strip() if out.tool_calls else out.content), out.tool_calls


# ------------------------------------------------------------ outputs back to text


class OutputProcessor:
    """One request's outputs, token ids to text; :meth:`process` each engine output in order.

    ``stopped`` is the stop string this processor ended the request on (None until then): the engine
    has not seen it, so the owner calls ``stop_request`` unless the engine's own output was finished too.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, eos_token_ids: Sequence[int] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._stops = list(params.stop)
        self._longest = max(map(len, self._stops), default=0)
        # the tokens that end a request in the engine and write no text (engine/stop_checks.py's rule)
        self._textless = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.text = ""     # all text so far (cut at a stop string)
        self._sent = 0     # how much of it was handed out
        self.finished = False
        self.stopped: str | None = None

    def process(self, out: RequestOutput) -> RequestOutput | None:
        """The engine's output with its text; None for an output after this request finished here (the
        engine's tokens past a stop string)."""
        if self.finished:
            return None
        ids = out.token_ids
        for i, tok in enumerate(ids):
            if tok in self._textless:
                continue
            before = len(self.text)
            self.text += self._detok.push((tok,))
            if self._stop_at(before):
                return self._cut(out, i + 1)
        if out.finished and out.finish_reason in ("stop", "length"):
            before = len(self.text)
            self.text += self._detok.flush()
            if self._stop_at(before):
                return self._cut(out, len(ids))
        end = len(self.text)
        if not out.finished and self._stops:  # text that may begin a stop string waits
            end = max(self._sent, end - (self._longest - 1))
        self.finished = out.finished
        return self._with_text(out, end)

    def _stop_at(self, before: int) -> bool:
        """Whether the text after ``before`` completes a stop string: the text is cut where the earliest
        one begins, and ``stopped`` names it."""
        if not self._stops:
            return False
        start = max(0, before - self._longest + 1)   # a new match ends in the new text
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self._stops) if i >= 0]
        if not hits:
            return False
        idx, stop = min(hits)
        self.text = self.text[:idx]
        self.stopped = stop
        return True

    def _cut(self, out: RequestOutput, keep: int) -> RequestOutput:
        """The request's last output: its first ``keep`` tokens, finished by ``self.stopped``."""
        self.finished = True
        dropped = len(out.token_ids) - keep
        cut = RequestOutput(
            request_id=out.request_id, text="", token_ids=list(out.token_ids[:keep]), finished=True,
            finish_reason="stop", stop_reason=self.stopped, prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens, completion_tokens=out.completion_tokens - dropped,
            logprobs=None if out.logprobs is None else list(out.logprobs[:keep]),
            cached_tokens_by_tier=out.cached_tokens_by_tier)
        return self._with_text(cut, len(self.text))

    def _with_text(self, out: RequestOutput, end: int) -> RequestOutput:
        out.text = self.text[self._sent:end]
        self._sent = end
        return out
