"""Seeded text for benchmark workloads: real English words from a fixed list (so the tokenizer
round-trips them) and a coding agent's system prompt with tool definitions. Two runs with the
same seed build the same text.
"""

from __future__ import annotations

import json
import random

WORDS = (
    "the of and to in is was for on that with as by at from this be are it an or which "
    "file line error value result output input server client request response status code "
    "table column row index query cache memory page token model agent tool call function "
    "return list string number object array field name path folder config build test run "
    "deploy user session turn reply message system prompt window context budget limit time "
    "network latency throughput worker router queue batch stream event key hash block node "
    "tree branch commit merge review patch diff change issue bug fix feature release version "
    "package module class method argument parameter variable type check lint format compile "
    "debug trace log metric alert report summary detail note plan step task goal state data "
    "record entry item count total average median maximum minimum rate ratio score weight "
    "open close read write append delete update create insert select filter sort group join "
    "green blue red small large fast slow new old first last next previous current default "
    "weather city river mountain ocean forest market price order invoice customer product"
).split()

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": props, "required": list(props)}}}
    for name, desc, props in [
        ("read_file", "Read a text file from the workspace and return its contents.",
         {"path": {"type": "string", "description": "Path relative to the workspace root."}}),
        ("search_code", "Search the repository for a regular expression.",
         {"pattern": {"type": "string"}, "max_results": {"type": "integer"}}),
        ("run_tests", "Run the project's test suite, optionally filtered.",
         {"filter": {"type": "string"}, "timeout_s": {"type": "integer"}}),
        ("edit_file", "Replace a range of lines in a file.",
         {"path": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"},
          "text": {"type": "string"}}),
        ("http_get", "Fetch a URL from the internal documentation server.",
         {"url": {"type": "string"}}),
        ("calculator", "Evaluate an arithmetic expression.",
         {"expression": {"type": "string"}}),
    ]
]


def words(rng: random.Random, tokenizer, n_tokens: int) -> str:
    """Text of about ``n_tokens`` tokens drawn from WORDS."""
    out: list[str] = []
    text = ""
    while True:
        out.extend(rng.choice(WORDS) for _ in range(32))
        text = " ".join(out)
        if len(tokenizer.encode(text)) >= n_tokens:
            break
    # trim to the token budget on a word boundary
    while len(out) > 1 and len(tokenizer.encode(" ".join(out))) > n_tokens:
        out.pop()
    return " ".join(out)


def system_prompt(tokenizer, n_tokens: int, seed: int = 0, agent: str = "coding") -> str:
    """A system prompt with tool definitions, padded with instructions to ``n_tokens``."""
    head = (f"You are a {agent} agent. You work step by step, call tools when you need facts, "
            f"and keep replies short.\nTools:\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\nRules: ")
    used = len(tokenizer.encode(head))
    return head + words(random.Random(seed), tokenizer, max(16, n_tokens - used))
