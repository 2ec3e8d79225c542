"""Drive planned sessions against a URL: open-loop arrivals, turns in order, a progress bar, a bound.

Every session starts at its planned arrival time (so load does not depend on how fast the
server answers) and runs its calls one after another with the planned tool/think pause in
between. In ``chat`` mode the client keeps the conversation and re-sends it whole; when the
last prompt plus reply passes ``compact_at_tokens`` the history is replaced by the system
prompt and a seeded summary, as agents do when their context fills. In ``sessions`` mode the
server keeps it; compaction there closes the session and opens a new one that starts from
the summary. A failed call ends its session (its later calls cannot be sent honestly) and
is recorded with the error.

A run can be bounded (``duration_s``): no session starts, and no session starts another turn,
after ``duration_s``; turns already running finish, and those still running at ``duration_s +
grace_s`` are cancelled (their stream closes, so the server aborts them). Cut turns are not in
``calls``: the figures cover the completed turns only, and ``bounded`` says what ran against
the plan (sessions started and completed, turns completed, cut and never started). The
progress bar (tqdm, on stderr, only on a terminal) counts the planned calls.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from agentrt.bench.driver import CallFailed, CallResult, ChatDriver, SessionDriver, auth_headers, served_model
from agentrt.bench.progress import bar
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
    duration_s: float | None = None         # no session or turn starts after this many seconds
    grace_s: float = 15.0                   # turns still running at duration_s + grace_s are cancelled

    def __post_init__(self) -> None:
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if not self.grace_s >= 0:
            raise ValueError(f"--grace must be >= 0 seconds, got {self.grace_s}")
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
    calls_failed: int = 0
    turns_cut: int = 0                      # calls cancelled in flight at the hard limit (not in ``calls``)
    bounded: dict = field(default_factory=dict)


def _stop_check(stop_at: float | None) -> bool:
    return stop_at is not None and time.perf_counter() >= stop_at


def _call_record(plan: SessionPlan, t: int, called: float, r: CallResult, max_tokens: int) -> dict:
    """One completed call of a session, as the run's JSON keeps it."""
    return {"session": plan.index, "turn": t, "agent": plan.agent, "start_s": called, "end_s": called + r.e2e_s,
            "ok": True, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "tpot_s": r.tpot_s, "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens, "max_tokens": max_tokens}


def _record_failure(result: RunResult, plan: SessionPlan, t: int, called: float, ended: float, exc: Exception,
                    progress) -> None:
    """A call failed: recorded, and it and the session's calls never sent after it counted as done."""
    result.calls.append({"session": plan.index, "turn": t, "agent": plan.agent, "start_s": called,
                         "end_s": ended, "ok": False, "error": str(exc)})
    progress.update(len(plan.turns) - t)
    result.calls_failed += 1
    progress.set_postfix(failed=result.calls_failed, refresh=False)


async def _close_quietly(sess) -> None:
    """Delete the run's session, if any, within 10 s (the run's figures do not depend on it)."""
    if sess is None:
        return
    try:
        await asyncio.wait_for(sess.close(), timeout=10.0)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass


async def _run_session(plan: SessionPlan, spec: WorkloadSpec, opts: RunOptions, tokenizer, http, client,
                       model: str, t0: float, stop_at: float | None, result: RunResult, progress) -> None:
    due = t0 + plan.arrival_s
    if stop_at is not None and due >= stop_at:
        return  # it arrives after --duration: never started, no record
    await asyncio.sleep(max(0.0, due - time.perf_counter()))
    if _stop_check(stop_at):
        return
    start = time.perf_counter() - t0
    system = [{"role": "system", "content": plan.system}] if plan.system is not None else []
    history: list[dict] = []
    chat = ChatDriver(http, opts.target, model, tokenizer, opts.temperature)
    sess = SessionDriver(client, plan.system, model, opts.temperature, opts.session_pin_ttl_s) if client else None
    context_tokens, ok, done, stopped, cut, in_call = 0, True, 0, False, False, False
    try:
        for t, turn in enumerate(plan.turns):
            if _stop_check(stop_at):
                stopped = True  # no new turn after --duration
                break
            text = turn.text
            if spec.compact_at_tokens is not None and context_tokens > spec.compact_at_tokens:
                summary = plan.summary(tokenizer, t, spec.compact_to_tokens)
                history, text = [], summary + "\n" + text
                if sess is not None:
                    await sess.close()
            called = time.perf_counter() - t0
            in_call = True
            try:
                if sess is not None:
                    r = await sess.call(text, turn.max_tokens)
                else:
                    history.append({"role": "user", "content": text})
                    r = await chat.call(system + history, turn.max_tokens)
            except CallFailed as exc:
                _record_failure(result, plan, t, called, time.perf_counter() - t0, exc, progress)
                ok = False
                break
            in_call = False
            history.append({"role": "assistant", "content": r.reply})
            context_tokens = (r.prompt_tokens or 0) + r.completion_tokens
            result.calls.append(_call_record(plan, t, called, r, turn.max_tokens))
            progress.update(1)
            done += 1
            if t + 1 < len(plan.turns) and turn.think_s > 0:
                pause = turn.think_s if stop_at is None else min(turn.think_s, stop_at - time.perf_counter())
                await asyncio.sleep(max(0.0, pause))
    except asyncio.CancelledError:
        cut = True  # past the hard limit: a running turn is dropped, the session keeps what completed
        result.turns_cut += 1 if in_call else 0
        raise
    finally:
        await _close_quietly(sess)
        end = time.perf_counter() - t0
        result.sessions.append({"session": plan.index, "agent": plan.agent, "arrival_s": plan.arrival_s,
                                "start_s": start, "end_s": end, "jct_s": end - start, "calls": done,
                                "planned_calls": len(plan.turns), "ok": ok and done == len(plan.turns),
                                "stopped": stopped, "cut": cut})


def bounded_record(plans: list[SessionPlan], result: RunResult, opts: RunOptions) -> dict:
    """What a run covered against its plan; ``stopped_early`` when any planned turn did not run."""
    completed = sum(1 for c in result.calls if c["ok"])
    failed = sum(1 for c in result.calls if not c["ok"])
    planned = sum(p.n_calls for p in plans)
    return {"duration_s": opts.duration_s, "grace_s": opts.grace_s if opts.duration_s is not None else None,
            "stopped_early": opts.duration_s is not None and (
                len(result.sessions) < len(plans) or any(s["stopped"] or s["cut"] for s in result.sessions)),
            "sessions_planned": len(plans), "sessions_started": len(result.sessions),
            "sessions_completed": sum(1 for s in result.sessions if s["ok"]),
            "turns_planned": planned, "turns_completed": completed, "turns_failed": failed,
            "turns_cut": result.turns_cut, "turns_not_started": planned - completed - failed - result.turns_cut}


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
        t0 = time.perf_counter()
        stop_at = t0 + opts.duration_s if opts.duration_s is not None else None
        with bar(sum(p.n_calls for p in plans), label, unit="call", enabled=opts.progress) as progress:
            tasks = [asyncio.create_task(_run_session(p, spec, opts, tokenizer, http, client, model, t0, stop_at,
                                                      result, progress)) for p in plans]
            try:
                hard = None if stop_at is None else stop_at + opts.grace_s - time.perf_counter()
                _, pending = await asyncio.wait(tasks, timeout=None if hard is None else max(0.0, hard))
                for task in pending:
                    task.cancel()
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                for outcome in outcomes:
                    if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                        raise outcome
            finally:
                for task in tasks:
                    task.cancel()
                if client is not None:
                    await client.close()
        result.wall_s = time.perf_counter() - t0
    result.calls.sort(key=lambda c: (c["start_s"], c["session"], c["turn"]))
    result.sessions.sort(key=lambda s: s["session"])
    result.bounded = bounded_record(plans, result, opts)
    return result


def run_plans(plans: list[SessionPlan], spec: WorkloadSpec, opts: RunOptions, tokenizer,
              label: str = "bench") -> RunResult:
    return asyncio.run(run_plans_async(plans, spec, opts, tokenizer, label))
