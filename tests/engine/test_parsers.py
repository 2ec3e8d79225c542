"""engine/parsers: each family's tool calls and reasoning, streamed in random chunkings and whole.

The texts are written here in each family's format (as the templates render calls); every case is
parsed whole and in >= 50 random chunkings, and must give the expected reasoning, content and calls.
A reply cut by max_tokens anywhere inside a call never yields that call.
"""

from __future__ import annotations

import json
import random

import pytest

from engine.parsers import OutputParser, ParsedOutput, detect, parse_output

TRICKY = {"city": "Oslo", "note": "a </tool_call> <tool_call> [TOOL_CALLS] <|call|> <｜tool▁call▁end｜> "
          "<|tool_call_end|> </parameter> </arg_value> </think> ; {\"name\": 1}"}
PLAIN = {"city": "Lima", "days": 3}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "note": {"type": "string"}, "days": {"type": "integer"}}}}}]


def hermes(name, args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def qwen3_coder(name, args):
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def glm45(name, args):
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def deepseek(name, args):
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args)}<｜tool▁call▁end｜>"


def kimi(name, args, i):
    return f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{json.dumps(args)}<|tool_call_end|>"


def mistral(name, args):
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args)}"


def harmony(name, args):
    return f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{json.dumps(args)}<|call|>"


CALLS = [("get_weather", TRICKY), ("get_weather", PLAIN)]


def case(family: str) -> tuple[str, str, str | None, str, str, str]:
    """(text, tool parser, reasoning parser, prompt text, expected reasoning, expected content)."""
    if family == "hermes":
        return ("<think>\nplan</think>\n\nLet me check. " + "\n".join(hermes(*c) for c in CALLS) + "\nDone.",
                "hermes", "qwen3", "", "\nplan", "Let me check. \n\nDone.")
    if family == "qwen3_coder":
        return ("Checking. " + "\n".join(qwen3_coder(*c) for c in CALLS) + " after", "qwen3_coder", None, "", "",
                "Checking. \n after")
    if family == "glm45":
        return ("<think>why</think>Checking." + "".join("\n" + glm45(*c) for c in CALLS) + "\nok", "glm45", "qwen3",
                "", "why", "Checking.\n\n\nok")
    if family == "llama3_json":
        body = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)
        return ("<|python_tag|>" + body, "llama3_json", None, "", "", "")
    if family == "mistral":
        return ("Sure." + "".join(mistral(*c) for c in CALLS), "mistral", None, "", "", "Sure.")
    if family == "deepseek_v31":
        text = "thinking it over</think>Sure.<｜tool▁calls▁begin｜>" + "".join(deepseek(*c) for c in CALLS) + \
            "<｜tool▁calls▁end｜>"
        return (text, "deepseek_v31", "deepseek_r1", "<｜Assistant｜><think>", "thinking it over", "Sure.")
    if family == "kimi_k2":
        text = "Sure.<|tool_calls_section_begin|>" + "".join(kimi(n, a, i) for i, (n, a) in enumerate(CALLS)) + "<|tool_calls_section_end|>"
        return (text, "kimi_k2", None, "", "", "Sure.")
    assert family == "openai"
    text = ("<|channel|>analysis<|message|>think <|end|> twice<|end|><|start|>assistant<|channel|>commentary"
            "<|message|>Calling.<|end|>" + "".join(harmony(*c) for c in CALLS))
    return text, "openai", "gpt_oss", "", "think ", "Calling. twice"


FAMILIES = ["hermes", "qwen3_coder", "glm45", "llama3_json", "mistral", "deepseek_v31", "kimi_k2", "openai"]


def streamed(text, tool, reasoning, prompt, rng, truncated=False) -> ParsedOutput:
    parser, out, i = OutputParser(tool, reasoning, prompt_text=prompt, tools=TOOLS), ParsedOutput(), 0
    while i < len(text):
        n = rng.randint(1, 12)
        out.add(parser.push(text[i:i + n]))
        i += n
    return out.add(parser.finish(truncated))


def summary(out: ParsedOutput):
    return out.reasoning, out.content.strip(), [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


@pytest.mark.parametrize("family", FAMILIES)
def test_parsers_whole_and_in_50_random_chunkings_give_the_expected_structures(family):
    text, tool, reasoning, prompt, want_reasoning, want_content = case(family)
    expected = (want_reasoning, want_content.strip(), [(n, a) for n, a in CALLS])
    if family == "openai":  # harmony: the analysis message ends at its first <|end|>; the rest was content
        expected = ("think ", "twice" + "Calling.", expected[2])
    whole = parse_output(text, tool, reasoning, prompt_text=prompt, tools=TOOLS)
    assert summary(whole) == expected
    ids = [c.id for c in whole.tool_calls]
    if family == "kimi_k2":  # Kimi names its calls; the name is the id (vLLM's kimi_k2 parser does the same)
        assert ids == ["functions.get_weather:0", "functions.get_weather:1"]
    else:
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    rng = random.Random(family)
    for _ in range(60):
        assert summary(streamed(text, tool, reasoning, prompt, rng)) == expected


def call_ends(family: str, text: str) -> list[int]:
    """Where each call of the case's text ends (its end marker, or its JSON when it has none)."""
    if family == "llama3_json":
        pieces = [json.dumps({"name": n, "parameters": a}) for n, a in CALLS]
    else:
        writer = {"hermes": hermes, "qwen3_coder": qwen3_coder, "glm45": glm45, "mistral": mistral,
                  "deepseek_v31": deepseek, "openai": harmony, "kimi_k2": kimi}[family]
        pieces = [writer(n, a, i) if family == "kimi_k2" else writer(n, a) for i, (n, a) in enumerate(CALLS)]
    ends, pos = [], 0
    for piece in pieces:
        pos = text.index(piece, pos) + len(piece)
        ends.append(pos)
    return ends


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_cut_by_max_tokens_is_never_a_complete_call(family):
    """Cut anywhere, the reply's calls are exactly those that ended before the cut: a call whose end
    marker (or, without one, whose JSON) was cut off is never returned, not even with complete arguments."""
    text, tool, reasoning, prompt, _, _ = case(family)
    ends = call_ends(family, text)
    rng = random.Random(family)
    for cut in range(len(text) + 1):
        want = [(n, a) for (n, a), end in zip(CALLS, ends) if end <= cut]
        out = streamed(text[:cut], tool, reasoning, prompt, rng, truncated=True)
        assert summary(out)[2] == want, (cut, text[:cut])
        whole = parse_output(text[:cut], tool, reasoning, prompt_text=prompt, tools=TOOLS, truncated=True)
        assert summary(whole)[2] == want
        assert "Lima" not in whole.content  # the cut call's text is not content either


def test_mistral_call_ids_and_the_nemo_array_format():
    out = parse_output('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}', "mistral")
    assert [(c.id, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("a1b2c3d4e", "get_weather",
                                                                                 {"city": "Oslo"})]
    nemo = '[TOOL_CALLS][{"name": "a", "arguments": {"x": "]"}, "id": "abcdefghi"}, {"name": "b", "arguments": {}}]'
    out = parse_output(nemo, "mistral")
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("a", {"x": "]"}), ("b", {})]
    assert out.tool_calls[0].id == "abcdefghi" and out.content == ""


def test_xml_values_are_typed_by_the_tools_schema():
    text = qwen3_coder("get_weather", {"city": "123", "days": "4"})
    (call,) = parse_output(text, "qwen3_coder", tools=TOOLS).tool_calls
    assert json.loads(call.arguments) == {"city": "123", "days": 4}  # city is a string, days an integer
    (call,) = parse_output(glm45("get_weather", {"city": "123", "days": "4"}), "glm45", tools=TOOLS).tool_calls
    assert json.loads(call.arguments) == {"city": "123", "days": 4}


def test_the_thinking_switch_decides_where_the_reply_starts():
    # Qwen3 with enable_thinking=False renders an empty think block: the reply is content
    assert summary(parse_output("Hi.", "hermes", "qwen3", prompt_text="<think>\n\n</think>\n\n")) == ("", "Hi.", [])
    assert parse_output("<think>r</think>\n\nHi.", "hermes", "qwen3").content == "Hi."  # the newlines after it go
    # a prompt that opens the block (DeepSeek V3.1 thinking): the reply starts in reasoning
    assert summary(parse_output("a</think>b", "deepseek_v31", "deepseek_r1", prompt_text="<think>")) == ("a", "b", [])
    assert summary(parse_output("cut in reas", None, "qwen3", prompt_text="<think>", truncated=True)) == \
        ("cut in reas", "", [])


def test_detect_falls_back_to_hermes_for_templates_that_know_nothing_of_tools():
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") == ("hermes", None)
    assert detect(None) == ("hermes", None)


def test_unknown_parser_names_are_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="--tool-call-parser 'pythonic' is not one of hermes"):
        OutputParser("pythonic", None)
    with pytest.raises(ValueError, match="--reasoning-parser 'r1' is not one of qwen3"):
        OutputParser(None, "r1")
