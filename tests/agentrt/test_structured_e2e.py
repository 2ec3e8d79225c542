"""Structured outputs and forced tool calls through the live server: the openai SDK and pydantic-ai."""

from __future__ import annotations

import json
from dataclasses import dataclass

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from agentrt_test_helpers import MODEL

CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "temp_c": {"type": "integer", "minimum": -50, "maximum": 60},
                       "sky": {"enum": ["sunny", "cloudy", "rain"]}},
        "required": ["city", "temp_c", "sky"], "additionalProperties": False}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city_weather", "schema": CITY, "strict": True}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}]
ASKS = ["Weather in Paris?", "How cold is Oslo today?", "Is it raining in Lima?", "Tokyo weather please."]


@pytest.fixture(scope="module")
def client(agentrt_server):
    return openai.OpenAI(base_url=agentrt_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _ask(ask):
    return [{"role": "user", "content": ask}]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_validate(client, stream):
    for i, ask in enumerate(ASKS):
        kwargs = dict(model=MODEL, messages=_ask(ask + " Answer as JSON."), response_format=CITY_FORMAT,
                      max_tokens=128, temperature=0.8, seed=i)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, finish = choice.message.content, [choice.finish_reason]
        assert finish == ["stop"]
        jsonschema.validate(json.loads(text), CITY)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_validate(client, stream):
    for i, ask in enumerate(ASKS):
        kwargs = dict(model=MODEL, messages=_ask(ask), tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=False, max_tokens=128, temperature=0.8, seed=i)
        if stream:
            deltas = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
            parts = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
            assert parts[0].id and parts[0].function.name == "get_weather" and parts[0].index == 0
            arguments = "".join(p.function.arguments or "" for p in parts)
            finish = deltas[-1].finish_reason
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            assert choice.message.content is None and len(choice.message.tool_calls) == 1
            call = choice.message.tool_calls[0]
            assert call.id and call.function.name == "get_weather"
            arguments, finish = call.function.arguments, choice.finish_reason
        assert finish == "tool_calls"
        jsonschema.validate(json.loads(arguments), TOOLS[0]["function"]["parameters"])


def test_named_tool_choice_and_unsupported_schema(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = client.chat.completions.create(model=MODEL, messages=_ask("Hello!"), tools=TOOLS, tool_choice=named,
                                            max_tokens=96, seed=3).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(openai.BadRequestError, match="'not' at #/properties/x/not"):
        client.chat.completions.create(model=MODEL, messages=_ask("x"), response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}})
    with pytest.raises(openai.BadRequestError, match="'launch'"):
        client.chat.completions.create(model=MODEL, messages=_ask("x"), tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "launch"}})


# -- pydantic-ai: a function tool, then a structured final result -------------------------------
class Report(BaseModel):
    city: str = Field(max_length=20)
    summary: str = Field(max_length=40)


def _weather_agent(agentrt_server, output_type, final_step_choice, responses_api=False):
    """An agent whose first step must call get_weather and whose second must give the result.

    SmolLM2 left to choose keeps calling the tool (every call valid, but the run never
    ends), so a capability sets ``tool_choice`` per step, as pydantic-ai documents.
    """
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    @dataclass
    class ToolThenAnswer(AbstractCapability):
        def get_model_settings(self):
            return lambda ctx: {"tool_choice": ["get_weather"] if ctx.run_step <= 1 else final_step_choice}

    model_cls = OpenAIResponsesModel if responses_api else OpenAIChatModel
    model = model_cls(MODEL, provider=OpenAIProvider(base_url=agentrt_server.url + "/v1", api_key="unused"))
    agent = Agent(model, output_type=output_type, capabilities=[ToolThenAnswer()],
                  model_settings={"temperature": 0.0, "max_tokens": 128, "parallel_tool_calls": False})
    calls: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return f"Sunny and 21 C in {city}."

    return agent, calls


@pytest.mark.parametrize("native", [False, True])
def test_pydantic_ai_agent_calls_a_function_tool_then_answers(agentrt_server, native):
    from pydantic_ai import ModelResponse, NativeOutput, TextPart, ToolCallPart, UsageLimits

    output_type, final = (NativeOutput(Report), "none") if native else (Report, ["final_result"])
    agent, calls = _weather_agent(agentrt_server, output_type, final)
    result = agent.run_sync("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=3))
    assert calls and all(isinstance(c, str) and 0 < len(c) <= 100 for c in calls)
    assert isinstance(result.output, Report)
    responses = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert len(responses) == 2  # the tool call, then the answer
    assert [p.tool_name for p in responses[0].parts if isinstance(p, ToolCallPart)] == ["get_weather"]
    if native:  # response_format json_schema: the answer is the text
        Report.model_validate_json("".join(p.content for p in responses[1].parts if isinstance(p, TextPart)))
    else:       # the answer is a forced call of the output tool
        assert [p.tool_name for p in responses[1].parts] == ["final_result"]


def test_pydantic_ai_responses_model_calls_a_function_tool_then_answers(agentrt_server):
    """The same agent on pydantic-ai's ``OpenAIResponsesModel``: the Responses API end to end."""
    from pydantic_ai import ModelResponse, ToolCallPart, UsageLimits

    agent, calls = _weather_agent(agentrt_server, Report, ["final_result"], responses_api=True)
    result = agent.run_sync("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=3))
    assert calls and all(isinstance(c, str) and 0 < len(c) <= 100 for c in calls)
    assert isinstance(result.output, Report)
    responses = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert len(responses) == 2
    assert [p.tool_name for p in responses[0].parts if isinstance(p, ToolCallPart)] == ["get_weather"]
    assert [p.tool_name for p in responses[1].parts if isinstance(p, ToolCallPart)] == ["final_result"]


def test_session_defaults_constrain_every_turn(agentrt_server):
    """response_format set once on the session applies to each turn; a turn may override it."""
    import agentrt

    client = agentrt.Client(agentrt_server.url)
    session = client.sessions.create(system="You report the weather.", sampling={
        "temperature": 0, "max_tokens": 96, "response_format": CITY_FORMAT})
    for ask in ASKS[:2]:
        reply = session.send(ask)
        jsonschema.validate(json.loads(reply.content), CITY)
    free = session.send("Say hello.", response_format={"type": "text"}, max_tokens=8)
    assert free.content is not None
    with pytest.raises(agentrt.BadRequestError) as err:   # a bad default is refused at creation
        client.sessions.create(sampling={"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {}}}}}}})
    assert err.value.status_code == 400 and "not" in err.value.message
