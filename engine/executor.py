"""The executor: runs the scheduler's plans on the model.

``prepare`` turns a ``ScheduledBatch`` into a ``Step`` (engine/plan.py: its model inputs, the requests
that sample, their drafts and token budgets, whether the next step may be scheduled before this one's
tokens are known); ``forward`` runs the model and samples (speculative verification for drafts); with
overlap scheduling ``launch`` hands a step to the forward thread and ``result`` waits for it. The
executor changes no request and no scheduler state: ``Scheduler.launched`` and
``Scheduler.update_from_output`` do.
"""

from __future__ import annotations

import time

import torch

from engine.model_runner import ModelRunner
from engine.overlap import ForwardWorker
from engine.plan import ScheduledBatch, Step, StepResult
from engine.request import Request
from engine.sampler import SamplingBatch, sample
from engine.speculative import SpeculativeDecoder


class Executor:
    def __init__(self, runner: ModelRunner, spec: SpeculativeDecoder, worker: ForwardWorker | None,
                 max_model_len: int, close_constrained_outputs: bool) -> None:
        self.runner, self.spec, self.worker = runner, spec, worker
        self.max_model_len = max_model_len
        self.close_constrained_outputs = close_constrained_outputs

    def prepare(self, batch: ScheduledBatch, prev: Step | None = None) -> Step:
        """The step's inputs and sampling requests (engine thread). ``prev``: the launched step whose
        tokens this one reads (overlap scheduling)."""
        inputs = self.runner.prepare(batch, prev.source if prev is not None else None)
        reqs = [batch.requests[i] for i in inputs.samplers]
        drafts = [batch.drafts.get(i, []) for i in inputs.samplers]
        prefill = sum(n for req, n in zip(batch.requests, batch.num_new) if req.num_computed < len(req.prompt_ids))
        step = Step(batch, inputs, reqs, drafts, self._budgets(reqs), prefill)
        step.rows = {id(req): (n, req.num_preemptions) for req, n in zip(batch.requests, batch.num_new)}
        step.run_ahead = self.worker is not None and self._may_run_ahead(step)
        return step

    def _may_run_ahead(self, step: Step) -> bool:
        """Whether the next step may be scheduled before this one's tokens are known: none of its
        sampling requests has a constraint (its next mask needs this token accepted), verifies a draft
        (it commits a variable number of tokens) or may draft next step (a draft needs the last token)."""
        return all(req.constraint is None and not draft
                   and (self.spec.mode == "off" or req.params.logprobs is not None)
                   for req, draft in zip(step.reqs, step.drafts))

    def _budgets(self, reqs: list[Request]) -> list[int | None] | None:
        """Per request, the tokens it may still emit (this step's included) when its constraint is
        to close within them: ``max_tokens`` left and context left. None when no request closes."""
        if not self.close_constrained_outputs or all(r.constraint is None for r in reqs):
            return None
        return [None if r.constraint is None else
                min(r.params.max_tokens - len(r.output_ids), self.max_model_len - r.num_tokens) for r in reqs]

    def forward(self, step: Step, prev: Step | None = None) -> StepResult:
        """Run the step's model forward and sample its tokens (the forward thread, with overlap)."""
        started = time.monotonic()
        previous = prev.future.result().tokens if step.inputs.futures else None
        logits = self.runner.execute(step.inputs, previous)
        tokens: list[int] = []
        lps: list = []
        verified = None
        if step.reqs:
            with torch.inference_mode():  # constraints mask the (inference-mode) logits in place
                if any(step.drafts):
                    tokens, lps, verified = self.spec.sample(logits, step.reqs, step.drafts, step.budgets)
                else:
                    tokens, lps = sample(logits, SamplingBatch.of(step.reqs), step.budgets)
        return StepResult(tokens, lps, verified, time.monotonic() - started)

    def launch(self, step: Step, prev: Step | None) -> None:
        """Hand the step to the forward thread (after ``prev``, whose tokens it may read)."""
        step.future = self.worker.submit(self.forward, step, prev)

    def result(self, step: Step) -> StepResult:
        """Wait for a launched step's forward and sampling."""
        return step.future.result()
