"""Chat templates render what they were written for (``pytest -k templates``).

For every model family whose template llama.cpp ships (read from the cached llama-cpp-python sdist,
tests/llamacpp_templates.py), a conversation with a system prompt, tools, two turns of parallel
tool calls with their results and reasoning renders to the same text through engine.tokenizer as
through transformers' ``apply_chat_template`` on the same template. agentrt gets the messages as
an OpenAI client sends them (arguments as JSON strings, ``content: null`` beside calls,
``reasoning_content``); transformers gets them as its docs ask (arguments as objects).
"""

from __future__ import annotations

import copy
import json

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from engine.tokenizer import Tokenizer, encode_chat, render_chat_prompt, template_handles_tools
from engine.parsers import detect
from tests.llamacpp_templates import templates_dir

# family -> (template file in llama.cpp's models/templates, template switches to try, expected parsers)
FAMILIES = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", [{}], ("hermes", None)),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", [{}, {"enable_thinking": False}], ("hermes", "qwen3")),
    "qwen3-coder": ("Qwen3-Coder.jinja", [{}], ("qwen3_coder", None)),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", [{}], ("llama3_json", None)),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", [{}], ("llama3_json", None)),
    "llama3.3": ("meta-llama-Llama-3.3-70B-Instruct.jinja", [{}], ("llama3_json", None)),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", [{}], ("mistral", None)),
    "mistral-small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", [{}], ("mistral", None)),
    "devstral": ("unsloth-mistral-Devstral-Small-2507.jinja", [{}], ("mistral", None)),
    "gpt-oss": ("openai-gpt-oss-120b.jinja", [{}, {"reasoning_effort": "high"}], ("openai", "gpt_oss")),
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1.jinja", [{}, {"thinking": True}], ("deepseek_v31", "deepseek_r1")),
    "kimi-k2": ("moonshotai-Kimi-K2.jinja", [{}], ("kimi_k2", None)),
    "kimi-k2-instruct": ("Kimi-K2-Instruct.jinja", [{}], ("kimi_k2", None)),
    "glm-4.6": ("GLM-4.6.jinja", [{}, {"enable_thinking": False}], ("glm45", "qwen3")),
}

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}} for name in ("get_weather", "get_time")]


def _turn(n: int, parallel: bool) -> list[dict]:
    """One assistant turn of tool calls (two in parallel, or one) and their results, OpenAI-style."""
    calls = [("get_weather", {"city": "Oslo", "days": n}), ("get_time", {"city": "Lima \"Perú\""})]
    calls = calls if parallel else calls[:1]
    ids = [f"call{n}x{i}ab"[:9] for i in range(len(calls))]
    asst = {"role": "assistant", "content": None, "reasoning_content": f"Turn {n}: I need the tools.",
            "tool_calls": [{"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                           for i, (name, args) in zip(ids, calls)]}
    results = [{"role": "tool", "tool_call_id": i, "name": name, "content": json.dumps({"ok": n, "for": name})}
               for i, (name, _) in zip(ids, calls)]
    return [asst] + results


def conversation(parallel: bool) -> list[dict]:
    return [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "Weather and time in Oslo and Lima?"},
            *_turn(1, parallel), *_turn(2, parallel)]


def as_transformers_expects(messages: list[dict]) -> list[dict]:
    """transformers' documented form: arguments as objects, no None values."""
    out = []
    for m in copy.deepcopy(messages):
        if m["role"] == "assistant" and m.get("content") is None:
            m["content"] = ""  # what engine.tokenizer passes for an OpenAI client's null
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append({k: v for k, v in m.items() if v is not None})
    return out


@pytest.fixture(scope="module")
def base_tokenizer():
    from engine.loader import load_tokenizer
    return load_tokenizer(None)[0]


def _pair(base: Tokenizer, template: str) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    ours = Tokenizer(hf=base.hf, chat_template=template, bos_token_id=base.bos_token_id,
                     eos_token_ids=base.eos_token_ids)
    theirs = PreTrainedTokenizerFast(tokenizer_object=base.hf, bos_token=base.id_to_token(base.bos_token_id),
                                     eos_token=base.id_to_token(base.eos_token_ids[0]))
    return ours, theirs


def _reference(theirs, messages, template, kwargs, tokenize=False):
    return theirs.apply_chat_template(as_transformers_expects(messages), tools=TOOLS, chat_template=template,
                                      add_generation_prompt=True, tokenize=tokenize, return_dict=False, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_templates_render_tools_calls_results_and_reasoning_as_transformers_does(family, base_tokenizer):
    filename, switches, parsers = FAMILIES[family]
    template = (templates_dir() / filename).read_text()
    assert template_handles_tools(template)
    assert detect(template) == parsers
    ours, theirs = _pair(base_tokenizer, template)
    parallel = True
    try:
        _reference(theirs, conversation(True), template, {})
    except jinja2.exceptions.SecurityError as exc:  # Kimi-K2-Instruct's copy mutates a list: refused by both
        with pytest.raises(ValueError, match="unsafe"):
            render_chat_prompt(ours, conversation(True), TOOLS)
        pytest.skip(f"{filename}: transformers' sandbox refuses this template ({exc}); so does ours")
    except jinja2.TemplateError as exc:  # Llama 3.1/3.3: "This model only supports single tool-calls at once!"
        assert "single tool-call" in str(exc), exc
        parallel = False
        with pytest.raises(ValueError, match="single tool-call"):
            render_chat_prompt(ours, conversation(True), TOOLS)
    messages = conversation(parallel)
    for kwargs in switches:
        expected = _reference(theirs, messages, template, kwargs)
        got = render_chat_prompt(ours, messages, TOOLS, template_kwargs=kwargs)
        assert got == expected, f"{family} {kwargs} (parallel calls: {parallel})"
        assert "get_weather" in got and "Oslo" in got
        assert encode_chat(ours, messages, TOOLS, template_kwargs=kwargs) == \
            _reference(theirs, messages, template, kwargs, tokenize=True)
