"""One reply in a family's format through every surface: Chat Completions (whole and streamed),
Responses output items and events, Anthropic Messages (whole and streamed), session turn records.

The real default engine writes the reply: a grammar allows exactly the test's text, so the tokens
are SmolLM2's own and the text reaches the parsers the way any model's does (engine ->
Generation -> surface). The server is told the family's parsers (``--tool-call-parser``,
``--reasoning-parser``), as for a model of that family.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import xgrammar as xgr

from engine import AsyncEngine, EngineConfig
from tests.engine.served import SERVED
from engine.client import StructuredOutput
from engine.grammar.compiler import compiler_cache_for
from engine.grammar.constraint import XGrammarConstraint
from engine.parsers import OutputParser

from agentrt.api.messages import AnthropicService
from agentrt.config import ServerConfig
from agentrt.core.errors import APIError
from agentrt.core.generation import Generator
from agentrt.metrics import Metrics
from agentrt.protocol import ChatCompletionRequest
from agentrt.api.responses_output import OutputBuilder
from agentrt.api.openai import OpenAIService

CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London </tool_call> [TOOL_CALLS]"})]
TEXTS = {  # family: (tool parser, reasoning parser, reply text); each: reasoning "Need the weather.", content "Let me look."
    "qwen3": ("hermes", "qwen3", "<think>\nNeed the weather.</think>\n\nLet me look." + "".join(
        f'\n<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in CALLS)),
    "mistral": ("mistral", None, "Let me look." + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in CALLS)),
    "gpt-oss": ("openai", "gpt_oss", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                "<|channel|>commentary<|message|>Let me look.<|end|>" + "".join(
                    f"<|start|>assistant to=functions.{n}<|channel|>commentary json<|message|>{json.dumps(a)}<|call|>"
                    for n, a in CALLS)),
}
REASONING = {"qwen3": "\nNeed the weather.", "mistral": None, "gpt-oss": "Need the weather."}


@pytest.fixture(scope="module")
def engine():
    """One engine thread for the module (one AsyncEngine per engine: each steps it in its own thread); no
    closing within max_tokens, so that the cut reply ends inside its second call. Shut down at the end: a
    running engine thread keeps the engine (its weights and pool) alive for the rest of the session."""
    engine = AsyncEngine.from_config(EngineConfig(kv_cache_tokens=8192, max_batched_tokens=256,
                                                  close_constrained_outputs=False, **SERVED))
    yield engine
    asyncio.run(engine.shutdown())


async def _generation(engine: AsyncEngine, family: str, max_tokens: int = 400):
    tool, reasoning, text = TEXTS[family]
    gen = Generator(engine, engine.engine, ServerConfig(tool_call_parser=tool, reasoning_parser=reasoning),
                    Metrics())
    cache = compiler_cache_for(engine.tokenizer)
    compiled = cache.get("forced:" + text, lambda: cache.compiler.compile_grammar(
        xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))), "test")
    constraint = XGrammarConstraint(compiled, cache.vocab_size, cache.stop_token_ids, "forced", cache.codec)
    prompt = engine.tokenizer.encode("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    params = gen.sampling_params({"max_tokens": max_tokens, "temperature": 0}, len(prompt))
    params.skip_special_tokens = False
    generation = await gen.start(prompt, params, constraint=constraint,
                                 parser=OutputParser(tool, reasoning, tools=None))
    return gen, generation


async def _surfaces(engine, family: str) -> dict:
    """Every surface's view of the reply, the generations running at once (one engine batch)."""
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Weather?"}])

    async def chat(max_tokens=400):
        gen, g = await _generation(engine, family, max_tokens)
        return (await OpenAIService(gen).chat(req, g))["choices"][0]

    async def chat_stream():
        gen, g = await _generation(engine, family)
        return [c["choices"][0]["delta"] async for c in OpenAIService(gen).chat_chunks(req, g)]

    async def responses():
        _, g = await _generation(engine, family)
        out = OutputBuilder()
        async for delta in g.deltas():
            out.feed(delta)
        return out.finish("completed"), g.token_ids

    async def anthropic(stream: bool):
        gen, g = await _generation(engine, family)
        svc = AnthropicService(gen)
        return [e async for e in svc.events(g)] if stream else (await svc.message(g))["content"]

    names = ["chat", "chat_stream", "responses", "anthropic", "anthropic_stream"]
    seen = dict(zip(names, await asyncio.gather(chat(), chat_stream(), responses(), anthropic(False),
                                                anthropic(True))))
    seen["responses"], ids = seen["responses"]
    # the reply's own tokens up to inside the second call ("Lon" of London written)
    cut = next(n for n in range(len(ids)) if "Lon" in engine.tokenizer.decode(ids[:n], skip_special_tokens=False))
    seen["cut"] = await chat(max_tokens=cut)
    return seen


@pytest.fixture(scope="module")
def surfaces(engine) -> dict:
    """Every family's surfaces, the three families' generations running at once (one engine batch of up
    to 15 rows instead of three batches of 5 one after another: the decode steps of the shorter replies
    ride along with the longest's); each family's test below checks its own."""
    async def every_family():
        return dict(zip(sorted(TEXTS), await asyncio.gather(*(_surfaces(engine, f) for f in sorted(TEXTS)))))
    return asyncio.run(every_family())


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TEXTS))
def test_one_reply_through_every_surface(surfaces, family):
    seen = surfaces[family]
    choice = seen["chat"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == "Let me look."
    assert message.get("reasoning_content") == REASONING[family]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == CALLS

    deltas = seen["chat_stream"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (REASONING[family] or "")
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Let me look."
    calls: dict[int, dict] = {}
    for d in deltas:
        for part in d.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"id": part.get("id"), "name": "", "arguments": ""})
            assert part.get("id", call["id"]) == call["id"]  # one id per index
            call["name"] += part["function"].get("name", "")
            call["arguments"] += part["function"].get("arguments", "")
    assert sorted(calls) == [0, 1] and [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == CALLS

    kinds = ["message", "function_call", "function_call"]
    assert [i["type"] for i in seen["responses"]] == (["reasoning"] if REASONING[family] else []) + kinds

    blocks = seen["anthropic"]
    assert [b["type"] for b in blocks] == (["thinking"] if REASONING[family] else []) + ["text", "tool_use", "tool_use"]
    assert [b["input"] for b in blocks if b["type"] == "tool_use"] == [a for _, a in CALLS]
    events = seen["anthropic_stream"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == [b["type"] for b in blocks]
    thinking = "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "thinking_delta")
    assert thinking == (REASONING[family] or "")

    # cut by max_tokens inside the second call: only the first call comes back, and no trace of the second
    cut = seen["cut"]
    assert cut["finish_reason"] == "length"
    assert [json.loads(c["function"]["arguments"]) for c in cut["message"]["tool_calls"]] == [CALLS[0][1]]
    assert "London" not in (cut["message"]["content"] or "")


CITY_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "London"]}, "days": {"type": "integer", "minimum": 1,
                                                                                     "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
# what a forced call of each family looks like in the reply's text (engine/grammar/call_syntax.py)
IN_FORMAT = {"qwen3_coder": "<function=get_weather>", "glm45": "<tool_call>get_weather\n",
             "llama3_json": '{"name": "get_weather", "parameters": ', "hermes": '"name": "get_weather", "arguments": ',
             "mistral": '"name": "get_weather", "arguments": '}


@pytest.fixture(scope="module")
def forced_calls(engine) -> dict:
    """Each parser's forced call, through a generator told that parser; the five run at once (one engine
    batch instead of five one after another)."""
    options = StructuredOutput(tools=[CITY_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    req = ChatCompletionRequest(model="m", messages=messages)

    async def run(parser):
        gen = Generator(engine, engine.engine, ServerConfig(tool_call_parser=parser), Metrics())
        g = await gen.start_chat(messages, {"max_tokens": 120, "temperature": 0}, options)
        choice = (await OpenAIService(gen).chat(req, g))["choices"][0]
        return choice, engine.tokenizer.decode(g.token_ids)

    async def every_parser():
        return dict(zip(sorted(IN_FORMAT), await asyncio.gather(*(run(p) for p in sorted(IN_FORMAT)))))
    return asyncio.run(every_parser())


@pytest.mark.slow
@pytest.mark.parametrize("parser", sorted(IN_FORMAT))
def test_a_forced_call_is_written_in_the_familys_syntax(forced_calls, parser):
    """The generator constrains a forced call in the family's own syntax where its markers are text (Mistral's
    are control tokens: Hermes), and the family's parser returns it as a tool call."""
    choice, text = forced_calls[parser]
    assert IN_FORMAT[parser] in text, text
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"], text
    args = json.loads(calls[0]["function"]["arguments"])
    assert args["city"] in ("Paris", "London") and 1 <= args["days"] <= 7


def test_a_strict_tool_with_auto_is_refused_where_no_grammar_can_write_the_call(engine):
    gen = Generator(engine, engine.engine, ServerConfig(tool_call_parser="mistral"), Metrics())
    strict = {"type": "function", "function": dict(CITY_TOOL["function"], strict=True)}
    with pytest.raises(APIError, match="markers are control tokens"):
        asyncio.run(gen.start_chat([{"role": "user", "content": "Weather?"}], {"max_tokens": 8},
                                   StructuredOutput(tools=[strict], tool_choice="auto")))
    qwen = Generator(engine, engine.engine, ServerConfig(tool_call_parser="qwen3_coder"), Metrics())
    options, parser = qwen._tool_format(StructuredOutput(tools=[strict], tool_choice="auto"))
    assert (options.call_format, options.tool_choice, parser) == ("qwen3_coder", "auto", "qwen3_coder")
