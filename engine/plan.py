"""The typed plan of one step, as it passes from the scheduler to the model runner and back.

``Scheduler.schedule`` returns a ``ScheduledBatch`` (which requests compute how many tokens, which
verify a draft); the engine core turns it into a ``Step`` (the batch, its model inputs from
``ModelRunner.prepare``, the requests that sample); the executor runs it and returns a ``StepResult``
(the sampled tokens); ``Scheduler.update_from_output(step, result)`` applies that result. With overlap
scheduling (engine/overlap.py) a ``Step`` is launched on the forward thread before the previous one is
committed, and carries what its commit needs to undo (``rows``, ``slots``).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field

import torch

from engine.attention import BatchLayout
from engine.request import Request
from engine.types import TokenLogprob


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new: list[int]      # tokens computed for each request this step
    # batch index -> draft tokens computed after that (decoding) request's last token, to verify
    drafts: dict[int, list[int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class StepInputs:
    """One step's model inputs, built without touching the model or the attention backend."""

    ids: torch.Tensor                # (T,) int64 token ids (placeholder rows hold -1 until ``execute``)
    positions: torch.Tensor          # (T,) int64
    layout: BatchLayout              # page tables are copies: the scheduler may change the requests' lists
    sample_rows: list[int]           # rows whose logits are sampled
    samplers: list[int]              # batch indices of the requests that sample, in logits-row order
    futures: list[tuple[int, int]]   # (row of ids, index into the previous step's sampled tokens)


@dataclass
class StepResult:
    """What a step's forward returns: per sampling request (``Step.reqs`` order) its token (its first
    one with a draft), logprob, and for a draft (committed tokens, drafted tokens accepted)."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    verified: list[tuple[list[int], int] | None] | None
    forward_s: float


@dataclass(eq=False)
class Step:
    """One launched (or, without overlap, running) step: its batch, inputs and sampling requests."""

    batch: ScheduledBatch
    inputs: StepInputs
    reqs: list[Request]                       # the requests that sample, in logits-row order
    drafts: list[list[int]]                   # their drafts ([] for none)
    budgets: list[int | None] | None          # tokens each constrained request may still emit
    prefill_tokens: int
    run_ahead: bool = False                   # the next step may be scheduled before this one commits
    overlapped: bool = False                  # launched ahead of its commit (num_inflight counted)
    # id(request) -> (rows computed for it, its num_preemptions at launch): a preempted request's rows
    # belong to pages it gave back
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)   # id(request) -> index of its token in the result
    future: concurrent.futures.Future | None = None
    launched_at: float = field(default_factory=time.monotonic)

    def live(self, req: Request) -> bool:
        """Whether ``req``'s rows in this step still count: it has not ended or been preempted since."""
        row = self.rows.get(id(req))
        return row is not None and not req.finished and req.num_preemptions == row[1]

    def source(self, req: Request) -> int:
        """Where ``req``'s token is among this step's sampled tokens (``ModelRunner.prepare``)."""
        slot = self.slots.get(id(req))
        if slot is None:
            raise RuntimeError(f"request {req.request_id} waits for a token its last step does not sample")
        return slot
