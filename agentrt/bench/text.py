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
    """Text of about ``n_tokens`` tokens drawn from WORDS: 32 words at a time until the text reaches
    ``n_tokens``, then trimmed a word at a time (on a word boundary, keeping one word at least) until it is
    within ``n_tokens``. The count of a prefix is found from each word's own count (a tokenizer that splits
    on spaces before its merges counts a text as the sum of its words) and checked by encoding the text at
    the prefixes that decide; where a check fails, every prefix is encoded instead (``_words_encoding_each``),
    which gives the same text from the same ``rng`` state."""
    state = rng.getstate()
    per_word: dict[str, int] = {}
    base = len(tokenizer.encode("the"))

    def count_of(word: str, first: bool) -> int:
        if first:
            return len(tokenizer.encode(word))
        if word not in per_word:
            per_word[word] = len(tokenizer.encode("the " + word)) - base
        return per_word[word]

    out: list[str] = []
    counts: list[int] = []   # counts[k - 1]: the estimated count of the first k words
    while not counts or counts[-1] < n_tokens:
        for w in (rng.choice(WORDS) for _ in range(32)):
            counts.append((counts[-1] if counts else 0) + count_of(w, not out))
            out.append(w)
    grown = len(out)
    keep = grown
    while keep > 1 and counts[keep - 1] > n_tokens:
        keep -= 1

    def exact(k: int) -> int:
        return len(tokenizer.encode(" ".join(out[:k])))

    decided = exact(grown) >= n_tokens and (grown == 32 or exact(grown - 32) < n_tokens)
    decided = decided and (keep == 1 or exact(keep) <= n_tokens) and (keep == grown or exact(keep + 1) > n_tokens)
    if decided:
        return " ".join(out[:keep])
    rng.setstate(state)
    return _words_encoding_each(rng, tokenizer, n_tokens)


def _words_encoding_each(rng: random.Random, tokenizer, n_tokens: int) -> str:
    """``words`` for any tokenizer: the whole text encoded after every 32 words drawn and every word trimmed."""
    out: list[str] = []
    while True:
        out.extend(rng.choice(WORDS) for _ in range(32))
        if len(tokenizer.encode(" ".join(out))) >= n_tokens:
            break
    while len(out) > 1 and len(tokenizer.encode(" ".join(out))) > n_tokens:
        out.pop()
    return " ".join(out)


def system_prompt(tokenizer, n_tokens: int, seed: int = 0, agent: str = "coding") -> str:
    """A system prompt with tool definitions, padded with instructions to ``n_tokens``."""
    head = (f"You are a {agent} agent. You work step by step, call tools when you need facts, "
            f"and keep replies short.\nTools:\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\nRules: ")
    used = len(tokenizer.encode(head))
    return head + words(random.Random(seed), tokenizer, max(16, n_tokens - used))
