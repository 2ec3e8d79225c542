"""``EngineClient``: what the serving layers need of an engine, and the one request check.

Two classes implement it: ``engine.AsyncEngine`` (the engine in this process) and the
router's ``router.remote.RemoteEngine`` (a fleet of workers over HTTP). ``agentrt``'s
``Generator`` holds one and never asks which: chat completions, session turns and a
worker's ``/internal/generate`` all submit through it.

A request is checked once per process, by :func:`check_request`: ``LLMEngine.add_request``
calls it for every request an engine takes, and the router calls it before routing (its
engine is remote; the worker's engine checks what arrives over the wire again, since that is
an HTTP boundary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, Sequence, runtime_checkable

from engine.types import EngineStats, InvalidRequest, RequestOutput, SamplingParams, SchedulingKey


@dataclass(frozen=True)
class SessionHint:
    """Which session a request belongs to and where its last turn ran: a routing hint (the
    in-process engine has one place to run it; a router routes the session's turns together).

    ``remember``: the caller keeps no record of where the session ran (a conversation named only by
    its client's affinity key, ``agentrt.core.affinity``), so a router remembers it: it looks the
    session's worker up before routing and records the worker it chose.

    ``continuing``: the session already ran a turn (the caller knows its history), so this request is a
    later turn of a started session (``SchedulingKey.continuing``: admitted before new sessions under
    overload with ``scheduling_policy`` session)."""

    session_id: str
    last_worker: str | None = None
    remember: bool = False
    continuing: bool = False


@dataclass(frozen=True)
class StructuredOutput:
    """The request options a grammar constraint is built from (OpenAI names)."""

    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # the syntax constrained tool calls are written in (engine/grammar/call_syntax.py); the serving
    # layer sets it from the model's tool-call parser
    call_format: str = "hermes"

    @property
    def given(self) -> bool:
        """Whether any option is set (with none, the output is free and no grammar is built)."""
        return any(v is not None for v in (self.response_format, self.tools, self.tool_choice,
                                          self.parallel_tool_calls))


@runtime_checkable
class OutputStream(Protocol):
    """One submitted request's outputs; ``aclose()`` aborts it (its pages are freed)."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def aclose(self) -> None: ...

    async def placed(self) -> str | None:
        """Wait until where the request runs is settled, and say where: behind a router, the id of
        the worker that produced its first output (from then on it no longer fails over; errors
        before that, such as no live worker or the worker refusing the request, are raised here);
        in one process, ``None`` at once. Iterating the stream afterwards still yields every output."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the serving layers use it (docs/engine_api.md, "EngineClient")."""

    max_model_len: int

    def constraint(self, options: StructuredOutput) -> Any:
        """What ``submit`` takes as ``constraint`` for these options (``None``: free output). The
        in-process engine compiles the grammar here, so bad options raise ``InvalidRequest`` now;
        a remote client passes the options on for the worker to compile."""
        ...

    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str, *,
               constraint: Any = None, cache_salt: str = "", lease_ttl_s: float | None = None,
               session: SessionHint | None = None, trace: Any = None,
               key: SchedulingKey | None = None) -> OutputStream:
        """Check (:func:`check_request`: ``InvalidRequest`` at once) and enqueue; the stream yields
        ``RequestOutput`` deltas, the last one finished. ``lease_ttl_s``: acquire a KV lease, held
        ``lease_ttl_s`` seconds from the request's end, on its finished sequence (prompt + reply) under
        ``request_id`` (see "KV lease" below). ``trace``: the caller's
        trace context (opaque here; agentrt/tracing.py), or None: the in-process engine hands it back
        with the finished request for its phase spans, a remote client forwards it to the worker.
        ``key``: the session and tenant the engine's scheduler orders the request by
        (engine/session_priority.py); a remote client sends it to the worker."""
        ...

    # KV lease: a finished sequence's pages held in the prefix cache for a TTL, so the next turn that
    # extends it computes only its new tokens. Acquired by ``submit(lease_ttl_s=)``, named by that
    # request's id; ``worker``: the worker holding it, for a remote client (None: the one it sent the
    # request to; in process, moot). The engine may drop a lease early under memory pressure, and every
    # call on a lease that no longer holds is a no-op: a lease is a hint, never a reason to fail.
    # Which TTL each case gets is agentrt/core/leases.py's ``LeasePolicy``.

    def extend_lease(self, lease_id: str, ttl_s: float, worker: str | None = None) -> None:
        """Make the lease expire ``ttl_s`` from now."""
        ...

    def release_lease(self, lease_id: str, worker: str | None = None) -> None:
        """Let the lease go (its pages stay cached, evictable)."""
        ...

    def demote_lease(self, lease_id: str, worker: str | None = None) -> None:
        """Copy the lease's pages into the KV tiers and release it: its session pauses for long
        (without tiers, a release)."""
        ...

    def prefetch_lease(self, lease_id: str, worker: str | None = None) -> None:
        """Start reading a demoted lease's prefix back from the tiers: its session's next turn is near."""
        ...

    def stats(self) -> EngineStats: ...

    async def cache_snapshot(self) -> list[int]:
        """Every block hash held in the prefix cache (a router: as its index knows the workers')."""
        ...

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None: ...


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams, *, max_model_len: int,
                  vocab_size: int | None = None) -> list[int]:
    """The prompt as a list of ints, if this request can run; else ``InvalidRequest`` saying what
    is wrong and what is allowed: the sampling parameters, the prompt's token ids (when the
    vocabulary is known), and whether prompt + ``max_tokens`` fit the context window."""
    params.validate()
    try:
        prompt = [int(t) for t in prompt_token_ids]
    except (TypeError, ValueError):
        raise InvalidRequest("the prompt must be a list of integer token ids") from None
    if not prompt:
        raise InvalidRequest("the prompt is empty; send at least one token")
    if vocab_size is not None and (min(prompt) < 0 or max(prompt) >= vocab_size):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids must be in [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise InvalidRequest(f"the prompt has {len(prompt)} tokens but this model's context "
                             f"window is {max_model_len} tokens (including the reply)")
    if len(prompt) + params.max_tokens > max_model_len:
        raise InvalidRequest(f"max_tokens ({params.max_tokens}) plus the prompt ({len(prompt)} "
                             f"tokens) exceeds the context window of {max_model_len} tokens; "
                             f"use max_tokens <= {max_model_len - len(prompt)}")
    return prompt


def check_closing(constraint: Any, max_tokens: int, context_left: int) -> None:
    """``InvalidRequest`` unless the constraint's output can be completed within ``max_tokens``
    (and ``context_left``): its closing plan from the current state (the shortest valid reply the
    closer finds, engine/grammar/closing.py) must fit. Free text has an empty plan."""
    plan = constraint.closing_plan()
    budget = min(max_tokens, context_left)
    if plan is not None and len(plan) <= budget:
        return
    what = getattr(constraint, "label", "the constraint")
    if plan is None:
        raise InvalidRequest(f"max_tokens is {max_tokens} but no valid reply to this request's {what} short "
                             f"enough to generate was found (a schema's minItems or minLength asks for thousands "
                             f"of characters); relax the schema so that a short reply is valid")
    if len(plan) > context_left:
        raise InvalidRequest(f"the shortest valid reply to this request's {what} is {len(plan)} tokens but only "
                             f"{context_left} tokens of the context window are left after the prompt",
                             param="messages")
    raise InvalidRequest(f"max_tokens is {max_tokens} but the shortest valid reply to this request's {what} is "
                         f"{len(plan)} tokens; use max_tokens >= {len(plan)}", param="max_tokens")
