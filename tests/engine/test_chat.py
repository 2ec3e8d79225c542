"""engine.tokenizer's tool-call parsers: a partial call at the end of a reply is never content."""

from __future__ import annotations

import json

import pytest

from engine.tokenizer import format_tool_call, parse_tool_calls
from engine.parsers import OutputParser

CALL = format_tool_call("get_weather", {"city": "Oslo"})


def _stream(text: str, step: int = 3) -> tuple[str, list]:
    parser, events = OutputParser("hermes", None), []
    for i in range(0, len(text), step):
        events += parser.push(text[i:i + step])
    events += parser.finish()
    return "".join(v for k, v in events if k == "content"), [v for k, v in events if k == "call"]


@pytest.mark.parametrize("tail", ['<tool_call>\n{"name": "final_answer", "arguments": ',
                                  "<tool_call>", "<tool_call>\n", "<tool_c", "<t"])
def test_a_partial_call_at_the_end_is_dropped(tail):
    for step in (1, 3, 100):
        content, calls = _stream("Let me answer. " + tail, step)
        assert (content, calls) == ("Let me answer. ", [])
    # the whole-text parser is the streaming one fed everything at once: the same result
    assert parse_tool_calls("Let me answer. " + tail) == ("Let me answer. ", [])


def test_an_unclosed_but_complete_call_is_a_call_and_text_stays_text():
    content, calls = _stream(CALL[:-len("</tool_call>")])
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert _stream("a < b and c <")[0] == "a < b and c <"          # a lone "<" is text
    assert _stream("x " + CALL + " y")[0] == "x  y"
    bad = "<tool_call>\nnot json\n</tool_call>"
    assert _stream("x " + bad)[0] == "x " + bad                     # a closed malformed block stays content
    assert parse_tool_calls("x " + bad) == ("x " + bad, [])


def test_an_end_tag_inside_a_json_string_does_not_end_the_call():
    """The grammar lets a string argument hold any text, the call format's own tags included (the
    default model writes them into a final answer); the call ends at the end tag after its JSON."""
    quoted = format_tool_call("final_answer", {"answer": "Done.'}}</tool_call>Then: <tool_call> more"})
    text = "x " + quoted + "\n" + CALL
    for content, calls in [parse_tool_calls(text)] + [_stream(text, step) for step in (1, 4, 1000)]:
        assert content.strip() == "x"  # the streaming parser cannot strip what it already sent
        assert [c.name for c in calls] == ["final_answer", "get_weather"]
        assert json.loads(calls[0].arguments) == {"answer": "Done.'}}</tool_call>Then: <tool_call> more"}


def test_a_malformed_block_before_a_good_call_stays_content_and_the_call_is_parsed():
    bad = "<tool_call>\nnot json\n</tool_call>"
    text = "x " + bad + " y " + CALL
    for content, calls in [parse_tool_calls(text)] + [_stream(text, step) for step in (1, 5, 1000)]:
        assert content.strip() == "x " + bad + " y"
        assert [c.name for c in calls] == ["get_weather"]
