"""How much a bench run will ask of the server, and about how long it will take: measured, not guessed.

:func:`plan_volume` counts the planned work from the session plans with the tokenizer: per turn
the prompt the client sends (``chat`` mode re-sends the whole history), the part of it that is
new to a prefix cache (the turn's own message, plus the template the first time a template is
seen, plus the summary after a compaction; earlier turns and replies are what the cache holds),
and the reply's ``max_tokens`` (an upper bound: a reply may end sooner). Counts are of the text;
the chat template adds a few tokens per message on top.

:func:`probe` sends the target one small streamed request of fresh text (so nothing of it is
cached) and reads its prefill rate (new prompt tokens / time to first token) and its decode
rate (tokens after the first / time after the first). :func:`estimate_s` turns volume and rates
into seconds: the larger of

* the server doing all the work one request at a time (new prompt tokens / prefill rate plus
  reply tokens / decode rate, summed over every turn), and
* the slowest session's own path: its arrival, then its turns one after another with their
  tool/think pauses.

Batching lets a real server decode several replies in the time of one, so on a workload with
overlapping sessions the first term leans high; it is an estimate to size a run by, printed
with the rates it came from.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass

import httpx

from agentrt.bench.driver import CallFailed, auth_headers, served_model, stream_chat_completion
from agentrt.bench.text import words
from agentrt.bench.workload import SessionPlan, WorkloadSpec


@dataclass(frozen=True)
class TurnVolume:
    new_prompt_tokens: int   # what a prefix cache does not already hold
    prompt_tokens: int       # what the client sends
    output_tokens: int       # the call's max_tokens
    think_s: float           # pause after this turn (0 after a session's last turn)


@dataclass(frozen=True)
class SessionVolume:
    arrival_s: float
    turns: tuple[TurnVolume, ...]


@dataclass(frozen=True)
class Volume:
    sessions: tuple[SessionVolume, ...]

    @property
    def n_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def new_prompt_tokens(self) -> int:
        return sum(t.new_prompt_tokens for s in self.sessions for t in s.turns)

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for s in self.sessions for t in s.turns)

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for s in self.sessions for t in s.turns)

    def to_dict(self) -> dict:
        return {"sessions": len(self.sessions), "turns": self.n_turns, "new_prompt_tokens": self.new_prompt_tokens,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}


def plan_volume(plans: list[SessionPlan], spec: WorkloadSpec, tokenizer) -> Volume:
    """The planned work of ``plans``, compacting where the runner would (see module docstring)."""
    seen_templates: set[str] = set()
    sessions = []
    for plan in plans:
        system = len(tokenizer.encode(plan.system)) if plan.system is not None else 0
        template_new = 0
        if plan.system is not None and plan.system not in seen_templates:
            seen_templates.add(plan.system)
            template_new = system
        history, context, turns = 0, 0, []
        for t, turn in enumerate(plan.turns):
            text = len(tokenizer.encode(turn.text))
            if spec.compact_at_tokens is not None and context > spec.compact_at_tokens:
                summary = plan.summary(tokenizer, t, spec.compact_to_tokens) + "\n"
                text = len(tokenizer.encode(summary + turn.text))  # the runner sends them as one message
                history = 0
            new = text + (template_new if t == 0 else 0)
            prompt = system + history + text
            turns.append(TurnVolume(new, prompt, turn.max_tokens, turn.think_s if t + 1 < len(plan.turns) else 0.0))
            history += text + turn.max_tokens
            context = prompt + turn.max_tokens
        sessions.append(SessionVolume(plan.arrival_s, tuple(turns)))
    return Volume(tuple(sessions))


@dataclass(frozen=True)
class ProbeResult:
    prefill_tok_s: float
    decode_tok_s: float
    prompt_tokens: int       # new (uncached) prompt tokens of the probe
    completion_tokens: int
    ttft_s: float
    e2e_s: float


def estimate_s(volume: Volume, rates: ProbeResult) -> float:
    """Seconds the planned work should take at the probed rates (see module docstring)."""
    def work(t: TurnVolume) -> float:
        return t.new_prompt_tokens / rates.prefill_tok_s + t.output_tokens / rates.decode_tok_s

    serial = sum(work(t) for s in volume.sessions for t in s.turns)
    longest = max((s.arrival_s + sum(work(t) + t.think_s for t in s.turns) for s in volume.sessions), default=0.0)
    return max(serial, longest)


async def probe_async(http: httpx.AsyncClient, target: str, model: str | None, tokenizer,
                      prompt_tokens: int = 128, max_tokens: int = 16) -> ProbeResult:
    """One streamed request of fresh text; ``CallFailed`` if the server's reply cannot give both rates.

    It asks for ``ignore_eos`` so the reply runs to ``max_tokens``; a server that refuses the field
    (a 4xx) gets the plain request. Kept small: its time is part of the run's setup."""
    model = model or await served_model(http, target)
    url = target + "/v1/chat/completions"
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": words(random.Random(time.time_ns()), tokenizer, prompt_tokens)}]}
    try:
        r = await stream_chat_completion(http, url, body | {"ignore_eos": True})
    except CallFailed as exc:
        if not str(exc).startswith("HTTP 4"):
            raise
        r = await stream_chat_completion(http, url, body)
    if r.first is None:
        raise CallFailed("the probe's reply had no text")
    if r.usage is not None:
        new = int(r.usage["prompt_tokens"]) - int((r.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        out = int(r.usage["completion_tokens"])
    else:
        new, out = prompt_tokens, len(tokenizer.encode(r.text))
    if out < 2 or r.end <= r.first:
        raise CallFailed(f"the probe's reply had {out} token(s); the decode rate needs at least 2")
    ttft, e2e = r.first - r.start, r.end - r.start
    return ProbeResult(max(new, 1) / ttft, (out - 1) / (r.end - r.first), new, out, ttft, e2e)


def probe(target: str, model: str | None, api_key: str | None, tokenizer) -> ProbeResult:
    import asyncio

    async def go() -> ProbeResult:
        async with httpx.AsyncClient(headers=auth_headers(api_key), timeout=httpx.Timeout(30.0, read=300.0)) as http:
            return await probe_async(http, target, model, tokenizer)

    return asyncio.run(go())


def describe(volume: Volume, rates: ProbeResult | None, est_s: float | None, probe_error: str | None = None,
             duration_s: float | None = None, grace_s: float | None = None) -> list[str]:
    """The lines printed at the start of a run (no estimate line when no probe was sent)."""
    v = volume
    lines = [f"planned: {len(v.sessions)} sessions, {v.n_turns} turns, prompt tokens {v.new_prompt_tokens:,} new / "
             f"{v.prompt_tokens:,} total, output tokens up to {v.output_tokens:,} (max_tokens)"]
    if est_s is not None and rates is not None:
        lines.append(f"estimated ~{_minutes(est_s)} (from probe: {rates.prefill_tok_s:,.0f} prefill tok/s, "
                     f"{rates.decode_tok_s:,.1f} decode tok/s)")
    elif probe_error is not None:
        lines.append(f"no estimate: the probe failed ({probe_error})")
    if duration_s is not None:
        lines.append(f"bounded: no session or turn starts after {duration_s:g} s; turns still running at "
                     f"{duration_s + (grace_s or 0.0):g} s are cut")
    return lines


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, math.ceil(seconds))} s"
    return f"{seconds / 60:.0f} min" if seconds >= 600 else f"{seconds / 60:.1f} min"


def plan_record(volume: Volume, rates: ProbeResult | None, est_s: float | None, probe_error: str | None) -> dict:
    """What the JSON keeps of the plan: the volume, the probe and the estimate."""
    return {"volume": volume.to_dict(), "probe": asdict(rates) if rates else None, "probe_error": probe_error,
            "estimate_s": est_s}
