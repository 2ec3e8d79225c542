"""A request's state inside the engine: tokens, pages, progress (its text is the output processor's,
engine/tokenizer.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.constraints import TokenConstraint
from engine.drafting import SpeculativeState
from engine.types import SamplingParams, SchedulingKey, TokenLogprob


# An output token a launched step is still sampling (overlap scheduling, engine/overlap.py): never a
# vocabulary id, never hashed or cached; the model runner reads its value from that step's result.
PLACEHOLDER = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    constraint: TokenConstraint | None = None
    cache_salt: str = ""
    pin_ttl_s: float | None = None
    arrival: float = field(default_factory=time.monotonic)
    # whom it serves, for the scheduler's order (engine/session_priority.py); ``started``: its session
    # already ran a turn when it arrived (a later turn, admitted before new sessions under overload)
    key: SchedulingKey = field(default_factory=SchedulingKey)
    started: bool = False

    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # KV: pages[i] holds tokens [i*P, (i+1)*P). The first ``num_tree_pages`` pages are
    # owned by the radix cache (locked through ``tree_node``); the rest by the request.
    pages: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    tree_node: object | None = None
    num_computed: int = 0          # tokens whose K/V are in ``pages`` (or being written by a launched step)
    # Overlap scheduling (engine/overlap.py): of ``num_computed``, the tokens whose step is launched
    # but not yet committed; the radix cache takes only the tokens before them.
    num_inflight: int = 0
    # Overlap scheduling: the last ``pending`` entries of ``output_ids`` are ``PLACEHOLDER``s for tokens
    # a launched step is sampling; committing that step writes them in, oldest first.
    pending: int = 0
    # Overlap scheduling: the token being sampled is certainly its last (max_tokens, context window),
    # so the scheduler gives it no further step.
    finishing: bool = False
    cached_tokens: int | None = None  # prompt tokens served from cache at first admission
    tier_tokens: dict[str, int] = field(default_factory=dict)  # of which loaded from a KV tier, by medium
    num_preemptions: int = 0
    queued_tokens: int = 0         # what it adds to the scheduler's ``waiting_tokens`` while waiting
    queued_at: float = 0.0         # when it last entered the waiting queue (its aging counts from there)
    service: int = 0               # tokens computed for it so far, recomputation after preemption included
    generator: torch.Generator | None = None
    speculative: SpeculativeState | None = None  # its drafter, once it drafted (engine/speculative.py)

    # what the next output carries: the tokens (and their logprobs) committed since the last one
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    # Phase timestamps (time.monotonic()): ``arrival`` when submitted, ``admitted_at`` at its first
    # admission by the scheduler, ``first_token_time`` at its first sampled token, ``finished_at``
    # when it finished (however: done, aborted, failed). The serving layer's tracing turns them into
    # queue / prefill / decode spans once the request finished (agentrt/tracing.py).
    admitted_at: float | None = None
    first_token_time: float | None = None
    finished_at: float | None = None
    # An opaque trace context from the serving layer (the OpenTelemetry context of its HTTP span),
    # handed back with the request to ``LLMEngine.on_finished``; None when nothing traces it.
    trace: object | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids`` (a decode step reads one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:end] + self.output_ids[:max(0, end - n)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_known(self) -> int:
        """Tokens whose values are known: all but the pending placeholders."""
        return self.num_tokens - self.pending

    @property
    def num_cacheable(self) -> int:
        """Tokens the radix cache may take: computed by a committed step, and known."""
        return min(self.num_computed - self.num_inflight, self.num_known)

    def place_token(self, token: int) -> None:
        """Commit a sampled token: it replaces the oldest pending placeholder, or is appended."""
        if self.pending:
            self.output_ids[len(self.output_ids) - self.pending] = token
            self.pending -= 1
        else:
            self.output_ids.append(token)

    def drop_placeholders(self) -> None:
        """Forget the tokens launched steps are still sampling (the request ended before them)."""
        if self.pending:
            del self.output_ids[-self.pending:]
            self.pending = 0

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to compute before this request can sample (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
