"""Overlap scheduling: the engine thread prepares step n+1 while step n's forward runs, and commits
step n's tokens one step behind (SGLang's overlap scheduler; ``EngineConfig.overlap_schedule``).

One overlapped step (``EngineCore._step_overlapped``, engine/core.py):

    commit step n first if it may not be run ahead of (below)
    apply commands (add, abort, pins)
    schedule step n+1; prepare its inputs (Executor.prepare); count it in flight
    (Scheduler.launched); launch it on the forward thread (Executor.launch)
    commit step n: Scheduler.update_from_output (tokens written in, stop checks), emit

The forward thread (``ForwardWorker``, one thread, steps in launch order) loads the model (so one
thread runs the model's parallel torch operations: one OpenMP thread team, see AsyncEngine) and runs
each step's attention plan, model forward and sampling; before its forward, step n+1 reads the tokens step n sampled into
the rows that hold ``PLACEHOLDER`` (engine/model_runner.py). Only the forward thread touches the
model, the KV pool's tensors, and the sampling state of the requests in its step (generators,
constraints); the engine thread owns the scheduler, the radix cache and every request's bookkeeping.

Launching step n+1 before step n's tokens are known:
- each request that samples in step n has a placeholder appended to its output (``Request.pending``)
  and the step's rows counted in ``num_computed`` and ``num_inflight``; the radix cache takes only
  committed, known tokens (``Request.num_cacheable``), so a page whose K/V a launched step is writing
  is never shared, evicted to a tier or matched;
- a request whose pending token is certainly its last (``max_tokens``, the context window) is
  ``finishing``: the scheduler gives it no further step;
- one that ends at step n for a reason known only at commit (EOS, a stop token or string) is in step
  n+1 already: committing step n withdraws it from step n+1 (its row's K/V and sampled token are
  dropped, ``num_computed`` goes back), as if step n+1 had never had it;
- an abort while a step is in flight drops the request's placeholders; its sampled token is dropped
  at commit.
Pages a request gives back while a launched step still writes its row can go to another request at
once: every step's forward runs after the previous one's, so the new owner's writes come later. The
only copies into the pool outside the forward thread, KV-tier loads, wait for the forward thread first
(``ForwardWorker.wait_idle``).

A step is not run ahead of (the next step is scheduled after its commit) when one of its sampling
requests has a grammar constraint (the next token's mask needs this token accepted), verifies a
draft (it commits a variable number of tokens), or may draft next step (speculative decoding on and
no logprobs: a draft is proposed from the last token). Such steps still run their forward on the
forward thread, but nothing is prepared during it.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable

from engine.plan import Step, StepResult

__all__ = ["ForwardWorker", "Step", "StepResult"]


class ForwardWorker:
    """The forward thread: runs submitted steps one at a time, in order."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrt-forward")
        self._last: concurrent.futures.Future | None = None

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        self._last = self._pool.submit(fn, *args)
        return self._last

    def wait_idle(self) -> None:
        """Return once every submitted step has finished (whether it succeeded or not)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
