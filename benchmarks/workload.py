"""The agentic session workload shared by the engine and API benchmarks.

S sessions share one long system prompt with tool definitions. Every turn appends a
tool result (real English words from a fixed list, so the tokenizer round-trips it)
and asks for a short reply. Everything is seeded: two runs build the same text.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Iterator

from agentrt.bench.text import words


@dataclass
class AgenticWorkload:
    sessions: int = 8
    turns: int = 8
    system_tokens: int = 1500
    tool_result_tokens: int = 200
    reply_tokens: int = 32
    seed: int = 0

    def first_user_message(self, s: int) -> str:
        return f"Session {s}: investigate the failing build and report what you find."

    def tool_result(self, tokenizer, s: int, t: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + s * 1009 + t)
        return words(rng, tokenizer, self.tool_result_tokens)

    def turn_messages(self, tokenizer, s: int, t: int) -> list[dict]:
        """Messages that turn ``t`` appends to session ``s``'s history."""
        text = "Tool result:\n" + self.tool_result(tokenizer, s, t)
        if t == 0:
            text = self.first_user_message(s) + "\n" + text
        return [{"role": "user", "content": text}]


def finished_turns(engine, live: dict, turn: dict, ttft: dict, replies: dict) -> Iterator[tuple[int, object, list]]:
    """One ``engine.step()`` of an in-process session benchmark: ``(session, output, reply ids)`` of each
    turn that finished in it. ``live`` maps a request id to ``(session, sent at, ..., reply ids)``,
    ``turn[s]`` is session s's current turn; the turn's TTFT and reply go into ``ttft`` and ``replies``
    (keyed ``(s, turn)``) and a finished request leaves ``live``. Every reply runs to ``max_tokens``
    (``ignore_eos``): any other ending is an error."""
    for out in engine.step():
        entry = live[out.request_id]
        s, sent, ids = entry[0], entry[1], entry[-1]
        if out.token_ids and (s, turn[s]) not in ttft:
            ttft[(s, turn[s])] = time.perf_counter() - sent
        ids.extend(out.token_ids)
        if not out.finished:
            continue
        if out.finish_reason != "length":
            raise RuntimeError(f"session {s} turn {turn[s]} ended with {out.finish_reason}: {out.error}")
        del live[out.request_id]
        replies[(s, turn[s])] = ids
        yield s, out, ids
