"""Speculative decoding from the agent's own context, no draft model.

An agent's next tokens often repeat its context: a file it read, a tool's output, an earlier
reply it edits. :class:`NgramDrafter` finds the longest n-gram (``max_ngram`` down to
``min_ngram`` tokens) ending the request's tokens that occurred before, at its latest earlier
occurrence (or keeps following the place its last draft came from, while that still matches),
and proposes the tokens that followed it. The engine verifies a draft in one
forward pass (the request's last token and its draft as a short extend chunk) and keeps the
longest prefix the model agrees with, plus the model's own next token (``verify``).

With ``speculative="suffix"`` a request also drafts from :class:`OutputCorpus`, the recent
outputs of its tenant's other requests on this worker (agents running the same program write
the same tool calls and phrases again), where that matches a longer suffix than its own tokens.

The index is a dict from n-gram to the end of its latest occurrence, brought up to date only
when a draft is asked for (O(new tokens x n-gram sizes), never a scan of the context).

Draft length adapts per request (:class:`DraftLength`) to the acceptance it sees: the length
that commits the most tokens per unit of step cost (engine/step_cost.py: measured on this setup by
benchmarks/step_cost.py, else the constant ``STEP_COST``), and at
0 the request stops drafting, re-probing with one token after a back-off that doubles while
probes fail; so a request whose output does not repeat its context soon pays nothing. The
engine also caps a step's rows where its weights are quantized (engine/models/quant.py): past
``MAX_QUANT_ROWS`` the step would run on the bf16 copies, at 2-3x the cost of a row.

Acceptance (``verify``), for a deterministic drafter: greedy requests take the argmax at each
position, so the output is the one decoding without a draft gives. Sampled requests accept a
drafted token ``x`` with probability ``p(x)`` under the request's processed distribution
(temperature, top-k, top-p) and otherwise draw from ``p`` with ``x`` removed, renormalised:
the standard rule for a deterministic draft, with its randomness coupled to the draw decoding
without a draft makes. At each position the sampler's own inverse-CDF draw (one uniform of
the request's seeded generator, engine/sampler.py) gives the model's token ``t``; ``x`` is
accepted iff ``t == x`` (probability ``p(x)``), and otherwise ``t`` is committed, distributed as
``p`` without ``x``. Each committed token consumes one uniform, as without speculation, so a
seeded request draws the same tokens with or without drafts (up to floating-point differences
in the logits of a multi-token verification pass).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from engine.constraints import TokenConstraint
from engine.drafting import SpeculativeState, TenantCorpora
from engine.sampler import SamplingBatch, draw, probabilities, sample
from engine.types import SamplingParams

if TYPE_CHECKING:
    from engine.request import Request




def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams,
           generator: torch.Generator | None, constraint: TokenConstraint | None = None,
           budget: int | None = None) -> tuple[list[int], int]:
    """Accept a draft against the model's logits at its ``len(draft) + 1`` positions.

    ``logits[j]`` is the distribution of the token after the request's last token plus
    ``draft[:j]``. Position by position, the model's token is chosen exactly as ``sample``
    chooses it (the argmax, or ``draw`` with one uniform of the request's generator); the
    draft is accepted while it agrees. With a ``constraint``, position ``j`` is masked by the
    grammar's state after ``draft[:j]`` (and, with a ``budget`` of tokens the request may still
    emit, its token goes through ``fit_budget`` with ``budget - j``), as decoding one token at a
    time would; each drafted token accepted is accepted by the constraint here, and a drafted
    token that completes the constrained output ends the verification (no token of the model's
    after it). Returns (the tokens to commit: the accepted prefix of the draft and then, unless
    the output completed, the model's own token, the number of drafted tokens accepted).
    """
    if constraint is not None:
        out: list[int] = []
        for j in range(len(draft) + 1):
            row = logits[j]
            constraint.apply_to_logits(row)
            t = int(torch.argmax(row)) if params.greedy else draw(probabilities(row, params), generator)
            if budget is not None:
                t = constraint.fit_budget(t, budget - j)
            out.append(t)
            if j == len(draft) or t != draft[j]:
                return out, j
            constraint.accept(t)
            if constraint.is_terminated():   # the output is complete: nothing follows it
                return out, j + 1
    best = torch.argmax(logits, dim=-1).tolist() if params.greedy else None

    def model_token(j: int) -> int:
        return best[j] if best is not None else draw(probabilities(logits[j], params), generator)

    out = []
    for j, x in enumerate(draft):
        out.append(model_token(j))
        if out[-1] != x:
            return out, j
    out.append(model_token(len(draft)))
    return out, len(draft)


class SpeculativeDecoder:
    """The engine's side of speculative decoding: a draft for a decoding request (``propose``, the
    scheduler's ``propose`` hook), a step's tokens with its drafts verified (``sample``), a verified
    draft committed (``commit``), the tenant corpora fed by finished requests (``finished``), and the
    counters ``EngineStats`` reports. ``mode`` is the resolved ``speculative`` setting; ``step_cost`` the
    setup's (FIXED, ROW) (engine/step_cost.py)."""

    def __init__(self, mode: str, num_tokens: int, step_cost: tuple[float, float], max_model_len: int) -> None:
        self.mode, self.num_tokens, self.step_cost, self.max_model_len = mode, num_tokens, step_cost, max_model_len
        # the recent outputs of each tenant's requests, drafted from with speculative="suffix"
        self.corpora = TenantCorpora() if mode == "suffix" else None
        self.draft_tokens_total = self.accepted_tokens_total = self.verifications_total = 0

    def propose(self, req: Request, room: int) -> list[int]:
        """A draft for a decoding request, at most ``room`` tokens and never past ``max_tokens`` or the
        context window. Requests with logprobs do not draft (their tokens are sampled one at a time, as
        without speculation); a constrained request's draft ends before the first token its grammar
        refuses, and none is made while a closing is forced."""
        p = req.params
        if p.logprobs is not None or (req.constraint is not None and req.constraint.closed_by_budget):
            return []
        limit = min(room, p.max_tokens - len(req.output_ids) - 1, self.max_model_len - req.num_tokens - 1)
        if limit <= 0:
            return []
        if req.pending:
            return []   # its last token is still being sampled (overlap scheduling)
        if req.speculative is None:
            req.speculative = SpeculativeState(req.prompt_ids, self.num_tokens, step_cost=self.step_cost)
        corpus = self.corpora.get(req.cache_salt) if self.corpora is not None else None
        draft = req.speculative.propose(req.output_ids, limit, corpus)
        if draft and req.constraint is not None:
            draft = draft[:req.constraint.valid_prefix(draft)]
        return draft

    @staticmethod
    def sample(logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]],
               budgets: list[int | None] | None) -> tuple[list[int], list, list]:
        """Sample the requests without a draft (one logits row each) as ``sample`` does and verify the
        drafts (``1 + len(draft)`` rows each); ``budgets`` as the engine's. Returns (tokens, logprobs,
        verified): for a request with a draft, ``verified[j]`` is (tokens to commit, drafted tokens
        accepted)."""
        firsts, row = [], 0
        for d in drafts:
            firsts.append(row)
            row += 1 + len(d)
        plain = [j for j, d in enumerate(drafts) if not d]
        tokens: list[int] = [0] * len(reqs)
        lps: list = [None] * len(reqs)
        if plain:
            toks, plps = sample(logits[[firsts[j] for j in plain]], SamplingBatch.of([reqs[j] for j in plain]),
                                [budgets[j] for j in plain] if budgets else None)
            for j, t, lp in zip(plain, toks, plps):
                tokens[j], lps[j] = t, lp
        verified: list = [None] * len(reqs)
        for j, d in enumerate(drafts):
            if d:
                verified[j] = verify(logits[firsts[j]:firsts[j] + 1 + len(d)], d, reqs[j].params,
                                     reqs[j].generator, reqs[j].constraint, budgets[j] if budgets else None)
        return tokens, lps, verified

    def commit(self, req: Request, draft: list[int], tokens: list[int], accepted: int,
               append: Callable[..., None]) -> None:
        """Append a verified draft's tokens one at a time through the engine's ``append`` (the stop
        conditions apply to each; tokens after a stop are dropped) and count the request's K/V as
        computed up to its newest token; the caller then gives back the pages of the rejected draft
        slots. A constraint has accepted the ``accepted`` drafted tokens during verification already."""
        self.draft_tokens_total += len(draft)
        self.accepted_tokens_total += accepted
        self.verifications_total += 1
        req.speculative.length.update(len(draft), accepted)
        for i, tok in enumerate(tokens):
            # the constraint's state is past every accepted draft token already: whether the output
            # is complete is asked at the last of them (verification stopped where it completed)
            append(req, tok, None, constraint_accepted=i < accepted, check_complete=i >= accepted - 1)
            if req.finished:
                break
        # K/V is computed for the last token and the accepted draft tokens: all but the newest token
        req.num_computed = req.num_tokens - 1

    def finished(self, req: Request) -> None:
        """A request ended: a complete output joins its tenant's corpus (``suffix``)."""
        if self.corpora is not None and req.finish_reason in ("stop", "length"):
            self.corpora.add(req.cache_salt, req.output_ids)
