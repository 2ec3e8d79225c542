"""Drive planned sessions against a URL: open-loop arrivals, turns in order, a progress bar.

Every session starts at its planned arrival time (so load does not depend on how fast the
server answers) and runs its calls one after another with the planned tool/think pause in
between. In ``chat`` mode the client keeps the conversation and re-sends it whole; when the
last prompt plus reply passes ``compact_at_tokens`` the history is replaced by the system
prompt and a seeded summary, as agents do when their context fills. In ``sessions`` mode the
server keeps it; compaction there closes the session and opens a new one that starts from
the summary. A failed call ends its session (its later calls cannot be sent honestly) and
is recorded with the error.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field

import httpx

from agentrt.bench.driver import CallFailed, ChatDriver, SessionDriver, auth_headers, served_model
from agentrt.bench.workload import SessionPlan, WorkloadSpec


@dataclass(frozen=True)
class RunOptions:
    target: str
    api: str = "chat"                       # "chat" (/v1/chat/completions) or "sessions" (agentrt session API)
    model: str | None = None
    api_key: str | None = None
    temperature: float = 0.0
    session_pin_ttl_s: float | None = None  # sessions mode: pin TTL asked per session (None: server default)
    timeout_s: float = 900.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.api not in ("chat", "sessions"):
            raise ValueError(f"api must be 'chat' or 'sessions', got {self.api!r}")
        if not self.target.startswith(("http://", "https://")):
            raise ValueError(f"target must be an http(s) URL, got {self.target!r}")


@dataclass
class RunResult:
    calls: list[dict] = field(default_factory=list)
    sessions: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    model: str = ""


class Progress:
    """``[####......] 12/40 calls, 1 failed, 35 s`` on stderr (redrawn in place on a terminal)."""

    def __init__(self, total: int, enabled: bool, label: str = "bench") -> None:
        self.total, self.enabled, self.label = total, enabled, label
        self.done = self.failed = 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last_decile = -1

    def step(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if not self.enabled:
            return
        decile = 10 * self.done // max(self.total, 1)
        if self.tty or decile != self._last_decile or self.done == self.total:
            self._last_decile = decile
            bar = "#" * (20 * self.done // max(self.total, 1))
            line = (f"[{self.label}] [{bar:<20s}] {self.done}/{self.total} calls, {self.failed} failed, "
                    f"{time.monotonic() - self.start:.0f} s")
            sys.stderr.write(("\r" + line) if self.tty else line + "\n")
            if self.tty and self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def _run_session(plan: SessionPlan, spec: WorkloadSpec, opts: RunOptions, tokenizer, http, client,
                       model: str, t0: float, result: RunResult, progress: Progress) -> None:
    await asyncio.sleep(max(0.0, t0 + plan.arrival_s - time.perf_counter()))
    start = time.perf_counter() - t0
    system = [{"role": "system", "content": plan.system}] if plan.system is not None else []
    history: list[dict] = []
    chat = ChatDriver(http, opts.target, model, tokenizer, opts.temperature)
    sess = SessionDriver(client, plan.system, model, opts.temperature, opts.session_pin_ttl_s) if client else None
    context_tokens, ok, done = 0, True, 0
    try:
        for t, turn in enumerate(plan.turns):
            text = turn.text
            if spec.compact_at_tokens is not None and context_tokens > spec.compact_at_tokens:
                summary = plan.summary(tokenizer, t, spec.compact_to_tokens)
                history, text = [], summary + "\n" + text
                if sess is not None:
                    await sess.close()
            called = time.perf_counter() - t0
            try:
                if sess is not None:
                    r = await sess.call(text, turn.max_tokens)
                else:
                    history.append({"role": "user", "content": text})
                    r = await chat.call(system + history, turn.max_tokens)
            except CallFailed as exc:
                result.calls.append({"session": plan.index, "turn": t, "agent": plan.agent, "start_s": called,
                                     "end_s": time.perf_counter() - t0, "ok": False, "error": str(exc)})
                progress.step(False)
                ok = False
                break
            history.append({"role": "assistant", "content": r.reply})
            context_tokens = (r.prompt_tokens or 0) + r.completion_tokens
            result.calls.append({"session": plan.index, "turn": t, "agent": plan.agent, "start_s": called,
                                 "end_s": called + r.e2e_s, "ok": True, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                                 "tpot_s": r.tpot_s, "prompt_tokens": r.prompt_tokens,
                                 "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens,
                                 "max_tokens": turn.max_tokens})
            progress.step(True)
            done += 1
            if t + 1 < len(plan.turns) and turn.think_s > 0:
                await asyncio.sleep(turn.think_s)
    finally:
        if sess is not None:
            await sess.close()
    for _ in range(len(plan.turns) - done - (0 if ok else 1)):
        progress.step(False)  # calls never sent after a failure count as failed
    end = time.perf_counter() - t0
    result.sessions.append({"session": plan.index, "agent": plan.agent, "arrival_s": plan.arrival_s,
                            "start_s": start, "end_s": end, "jct_s": end - start, "calls": done,
                            "planned_calls": len(plan.turns), "ok": ok})


async def run_plans_async(plans: list[SessionPlan], spec: WorkloadSpec, opts: RunOptions, tokenizer,
                          label: str = "bench") -> RunResult:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(30.0, read=opts.timeout_s)
    async with httpx.AsyncClient(headers=auth_headers(opts.api_key), timeout=timeout, limits=limits) as http:
        model = opts.model or await served_model(http, opts.target)
        client = None
        if opts.api == "sessions":
            from agentrt.client import AsyncClient

            client = AsyncClient(opts.target, api_key=opts.api_key, timeout=opts.timeout_s)
        result = RunResult(model=model)
        progress = Progress(sum(p.n_calls for p in plans), opts.progress, label)
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(_run_session(p, spec, opts, tokenizer, http, client, model, t0, result, progress)
                                   for p in plans))
        finally:
            if client is not None:
                await client.close()
        result.wall_s = time.perf_counter() - t0
    result.calls.sort(key=lambda c: (c["start_s"], c["session"], c["turn"]))
    result.sessions.sort(key=lambda s: s["session"])
    return result


def run_plans(plans: list[SessionPlan], spec: WorkloadSpec, opts: RunOptions, tokenizer,
              label: str = "bench") -> RunResult:
    return asyncio.run(run_plans_async(plans, spec, opts, tokenizer, label))
