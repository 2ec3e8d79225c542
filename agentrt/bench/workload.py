"""The ``agentic`` workload generator: agent types, Poisson session arrivals, lognormal turns.

A :class:`WorkloadSpec` names agent types (weight, shared template length, turns per
session, tokens appended per turn, reply length, tool/think time) and optional context
compaction; :func:`plan_sessions` turns it into concrete :class:`SessionPlan` objects:
every text is real English drawn from ``benchmarks.workload.WORDS`` (the tokenizer
round-trips it), every number is drawn from one seeded ``random.Random``, so the same
spec, seed and tokenizer always give the same requests. Sessions of one agent type share
its template (system prompt with tool definitions) byte for byte, so a prefix cache can
really share it.

The agent types describe the traffic as measured (an SWE agent: median 36 turns, ~90-token
replies); each preset's own ``max_turns``, ``max_reply_tokens`` and ``default_sessions`` size a
default run to a few minutes on a 2-core CPU against ``agentrt serve`` (docs/benchmarking.md
has the figures). ``--max-turns`` / ``--max-reply-tokens`` / ``--sessions`` replace them, so
a larger value runs more of the distributions.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from agentrt.bench.text import system_prompt, words


@dataclass(frozen=True)
class LogNormal:
    """``round(median * exp(sigma * N(0, 1)))`` clamped to ``[lo, hi]`` (an integer draw)."""

    median: float
    sigma: float = 0.0
    lo: int = 1
    hi: int = 1 << 30

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or not 0 <= self.lo <= self.hi:
            raise ValueError(f"bad LogNormal({self.median}, {self.sigma}, {self.lo}, {self.hi})")

    def draw(self, rng: random.Random) -> int:
        return int(min(self.hi, max(self.lo, round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))))


@dataclass(frozen=True)
class AgentType:
    """One kind of agent: its share of sessions and the shape of its conversations."""

    name: str
    weight: float
    template_tokens: int            # shared system prompt + tool definitions
    turns: LogNormal                # calls per session
    first_input: LogNormal          # tokens of the first user message
    append: LogNormal               # tokens appended per later turn (tool output or user message)
    reply: LogNormal                # max_tokens of each call
    think_s: float = 0.0            # mean tool/think time between calls (exponential)
    tools: bool = True              # template carries the tool definitions (else a plain system prompt)


@dataclass(frozen=True)
class WorkloadSpec:
    """Agent types plus session-level settings. ``session_rate`` is Poisson arrivals per second
    (``0`` = all sessions at once); ``compact_at_tokens`` replaces a session's history by a
    summary of ``compact_to_tokens`` once its prompt passes that length (``None`` = never)."""

    name: str
    agents: tuple[AgentType, ...]
    session_rate: float = 0.5
    max_turns: int | None = None
    max_reply_tokens: int | None = None
    think_scale: float = 1.0
    compact_at_tokens: int | None = None
    compact_to_tokens: int = 512
    default_sessions: int = 4       # sessions a run plans when the user names no --sessions

    def __post_init__(self) -> None:
        if not self.agents or sum(a.weight for a in self.agents) <= 0:
            raise ValueError(f"workload {self.name}: needs agent types with positive total weight")
        if self.session_rate < 0 or self.think_scale < 0:
            raise ValueError(f"workload {self.name}: session_rate and think_scale must be >= 0")
        for name in ("max_turns", "max_reply_tokens", "compact_at_tokens", "default_sessions"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"workload {self.name}: {name} must be >= 1, got {getattr(self, name)}")

    def with_overrides(self, **changes) -> "WorkloadSpec":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class TurnPlan:
    text: str            # the user / tool-output message this call appends
    max_tokens: int
    think_s: float       # pause after the reply, before the next call


@dataclass(frozen=True)
class SessionPlan:
    index: int
    agent: str
    system: str | None          # the shared template (None: no system message)
    arrival_s: float
    turns: tuple[TurnPlan, ...]
    seed: int = 0

    @property
    def n_calls(self) -> int:
        return len(self.turns)

    def summary(self, tokenizer, turn: int, n_tokens: int) -> str:
        """The (seeded) summary text that replaces the history at ``turn`` when compacting."""
        rng = random.Random(f"summary-{self.seed}-{self.index}-{turn}")
        return "Summary of the work so far: " + words(rng, tokenizer, n_tokens)


def _toolagent() -> WorkloadSpec:
    return WorkloadSpec("toolagent", (
        AgentType("tool-6k", 0.55, 6000, LogNormal(1, 0.3, 1, 3), LogNormal(200, 0.5, 16, 2000),
                  LogNormal(120, 0.8, 8, 2000), LogNormal(4, 0.4, 1, 16), think_s=1.0),
        AgentType("tool-2.5k", 0.14, 2500, LogNormal(1, 0.5, 1, 4), LogNormal(300, 0.5, 16, 2000),
                  LogNormal(150, 0.8, 8, 2000), LogNormal(24, 0.5, 2, 128), think_s=1.0),
        AgentType("chat", 0.31, 200, LogNormal(2, 0.5, 1, 6), LogNormal(2500, 0.6, 64, 7000),
                  LogNormal(80, 0.8, 8, 1000), LogNormal(150, 0.5, 8, 512), think_s=8.0, tools=False),
    ), session_rate=0.5, max_reply_tokens=32, default_sessions=6)


def _swe() -> WorkloadSpec:
    return WorkloadSpec("swe", (
        AgentType("swe", 1.0, 1500, LogNormal(36, 0.6, 2, 200), LogNormal(120, 0.4, 16, 1000),
                  LogNormal(90, 1.0, 8, 4000), LogNormal(90, 0.4, 8, 512), think_s=4.0),
    ), session_rate=0.1, compact_at_tokens=6144, compact_to_tokens=1024, max_turns=8, max_reply_tokens=32,
        default_sessions=4)


def _chat() -> WorkloadSpec:
    return WorkloadSpec("chat", (
        AgentType("chat", 1.0, 120, LogNormal(4, 0.6, 1, 30), LogNormal(60, 0.8, 4, 2000),
                  LogNormal(60, 0.8, 4, 2000), LogNormal(200, 0.5, 8, 1024), think_s=10.0, tools=False),
    ), session_rate=0.5, compact_at_tokens=6144, compact_to_tokens=512, max_turns=4, max_reply_tokens=64,
        default_sessions=4)


def _tiny() -> WorkloadSpec:
    """For tests: short prompts, two turns, a few tokens a reply, no pauses."""
    return WorkloadSpec("tiny", (
        AgentType("tiny", 1.0, 48, LogNormal(2, 0.0, 2, 2), LogNormal(12, 0.0, 4, 64),
                  LogNormal(12, 0.0, 4, 64), LogNormal(4, 0.0, 4, 4), think_s=0.0, tools=False),
    ), session_rate=0.0, default_sessions=2)


PRESETS = {"toolagent": _toolagent, "swe": _swe, "chat": _chat, "tiny": _tiny}


def preset(name: str) -> WorkloadSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()


def template(tokenizer, agent: AgentType, seed: int) -> str:
    """The agent type's shared system prompt: tool definitions padded with rules, or plain instructions."""
    if agent.tools:
        return system_prompt(tokenizer, agent.template_tokens, seed=seed, agent=agent.name)
    head = f"You are a helpful {agent.name} assistant. Answer briefly. Notes: "
    return head + words(random.Random(f"template-{seed}"), tokenizer,
                        max(4, agent.template_tokens - len(tokenizer.encode(head))))


def plan_sessions(spec: WorkloadSpec, n_sessions: int, tokenizer, seed: int = 0) -> list[SessionPlan]:
    """``n_sessions`` concrete sessions of ``spec`` (deterministic in ``seed``)."""
    if n_sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {n_sessions}")
    rng = random.Random(f"agentic-{spec.name}-{seed}")
    templates = {a.name: template(tokenizer, a, seed * 101 + i) for i, a in enumerate(spec.agents)}
    weights = [a.weight for a in spec.agents]
    clock, plans = 0.0, []
    for s in range(n_sessions):
        agent = rng.choices(spec.agents, weights)[0]
        if s > 0 and spec.session_rate > 0:
            clock += rng.expovariate(spec.session_rate)
        n_turns = agent.turns.draw(rng)
        if spec.max_turns is not None:
            n_turns = min(n_turns, spec.max_turns)
        turns = []
        for t in range(n_turns):
            text_rng = random.Random(f"text-{seed}-{s}-{t}")
            size = (agent.first_input if t == 0 else agent.append).draw(rng)
            head = (f"Session {s}: here is the task; work on it step by step.\n" if t == 0
                    else f"Tool output (call {t}):\n")
            reply = agent.reply.draw(rng)
            if spec.max_reply_tokens is not None:
                reply = min(reply, spec.max_reply_tokens)
            think = rng.expovariate(1.0 / agent.think_s) * spec.think_scale if agent.think_s > 0 else 0.0
            turns.append(TurnPlan(head + words(text_rng, tokenizer, size), reply, think))
        plans.append(SessionPlan(s, agent.name, templates[agent.name], clock, tuple(turns), seed))
    return plans
