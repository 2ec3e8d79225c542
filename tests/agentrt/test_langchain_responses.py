"""langchain-openai with ``use_responses_api=True``, unmodified, against the live server: a forced
function tool call through the Responses API, then the tool result sent back (history resent)."""

from __future__ import annotations

from agentrt_test_helpers import MODEL


def test_langchain_openai_responses_tool_round_trip(agentrt_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return f"Sunny and 21 C in {city}."

    llm = ChatOpenAI(model=MODEL, base_url=agentrt_server.url + "/v1", api_key="unused", use_responses_api=True,
                     temperature=0, max_tokens=48, max_retries=0, timeout=300)
    ask = HumanMessage("What is the weather in Paris?")
    call_msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([ask])
    assert call_msg.response_metadata["id"].startswith("resp_")
    assert [c["name"] for c in call_msg.tool_calls] == ["get_weather"]
    city = call_msg.tool_calls[0]["args"]["city"]
    assert isinstance(city, str) and 0 < len(city) <= 100
    result = get_weather.invoke(call_msg.tool_calls[0]["args"])
    final = llm.invoke([ask, call_msg, ToolMessage(result, tool_call_id=call_msg.tool_calls[0]["id"])])
    assert final.response_metadata["id"].startswith("resp_") and final.text.strip()
    usage = final.usage_metadata
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 48
