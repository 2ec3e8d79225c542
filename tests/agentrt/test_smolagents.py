"""smolagents' ``ToolCallingAgent``, unmodified, against the live server on the default model.

smolagents forces a tool call every step (``tool_choice="required"``, its tools plus
``final_answer``) and parses the reply's ``tool_calls``. A forced call that ran out of
``max_tokens`` mid-JSON used to come back as ``finish_reason="length"`` with the half-written call
in the text content, and the agent failed its step with a parse error. Every step's reply must now
hold a complete, valid call.
"""

from __future__ import annotations

import pytest
import smolagents
import smolagents.memory
import smolagents.utils
from agentrt_test_helpers import MODEL


@smolagents.tool
def get_weather(city: str) -> str:
    """The current weather of a city.

    Args:
        city: the city's name, e.g. "Paris".
    """
    return f"{city}: 18 C, light rain"


@pytest.mark.parametrize("max_tokens", [48, 200])
def test_tool_calling_agent_ends_with_an_answer_and_no_parse_error(agentrt_server, max_tokens):
    model = smolagents.OpenAIServerModel(model_id=MODEL, api_base=agentrt_server.url + "/v1", api_key="unused",
                                         temperature=0, max_tokens=max_tokens)
    agent = smolagents.ToolCallingAgent(tools=[get_weather], model=model, max_steps=3, verbosity_level=0)
    answer = agent.run("What is the weather in Paris right now? Use the tool, then give the final answer.")
    steps = [s for s in agent.memory.steps if isinstance(s, smolagents.memory.ActionStep)]
    errors = [(s.step_number, type(s.error).__name__, str(s.error)[:300]) for s in steps if s.error is not None]
    # No reply failed to parse or to generate. (The agent's own rules may still fail a step, e.g. a
    # final_answer called next to another tool, and reaching max_steps ends the run without tools.)
    assert not [e for e in errors if e[1] in ("AgentParsingError", "AgentGenerationError")], errors
    tool_steps = [s for s in steps if not isinstance(s.error, smolagents.utils.AgentMaxStepsError)]
    assert tool_steps, "the agent took no step"
    for s in tool_steps:  # each step's reply was one or more complete tool calls, none of it left as text
        assert s.tool_calls or s.error is not None, (s.step_number, s.model_output)
        assert "<tool_call>" not in (s.model_output or ""), (s.step_number, s.model_output)
    assert answer is not None and str(answer).strip()
