"""Sampling the next token of each request from its logits row.

Per row, in order: the request's constraint masks disallowed tokens; greedy rows
take the argmax; other rows apply temperature, top-k and top-p (``probabilities``),
then draw by inverse CDF with one uniform from the request's own generator (``draw``),
so a seed makes a request reproducible whatever it is batched with, and the n-th
token of a request is a function of its n-th uniform and its distribution alone
(speculative verification, engine/speculative.py, relies on that). A constrained row
closing within its token budget may then have its token replaced by the constraint's
closing (``fit_budget``). Log-probabilities are of the model's distribution, for the
token emitted.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.types import SamplingParams, TokenLogprob


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask a (V,) row outside the top-k and the top-p nucleus with -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs >= top_p  # keep the smallest set whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: a (V,) logits row after temperature, top-k
    and top-p."""
    return torch.softmax(_top_k_top_p(logits / params.temperature, params.top_k, params.top_p), dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` (V,) by inverse CDF: exactly one uniform from ``generator``."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(cdf[-1])
    i = int(torch.searchsorted(cdf, torch.full((1,), u, dtype=torch.float64, device=cdf.device), right=True))
    if i >= probs.shape[0]:  # u rounded up to the total: the last token that has probability
        i = int(torch.nonzero(probs).max())
    return i


def sample(logits: torch.Tensor, requests: list[Request], budgets: list[int | None] | None = None
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: (B, V) float32, one row per request -> (token ids, logprobs or None).

    ``budgets[i]``: the tokens request ``i`` may still emit, this one included, when its
    constraint is to close its output within them (``TokenConstraint.fit_budget`` may then
    replace the sampled token); None for the rows (or all of them) without closing."""
    want_lp = [r.params.logprobs is not None for r in requests]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    for i, r in enumerate(requests):
        if r.constraint is not None:
            r.constraint.apply_to_logits(logits[i])
    tokens: list[int] = [0] * len(requests)
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    if greedy:
        ids = torch.argmax(logits[greedy], dim=-1).tolist()
        for i, t in zip(greedy, ids):
            tokens[i] = t
    for i, r in enumerate(requests):
        if r.params.greedy:
            continue
        tokens[i] = draw(probabilities(logits[i], r.params), r.generator)
    if budgets is not None:
        for i, r in enumerate(requests):
            if budgets[i] is not None:
                tokens[i] = r.constraint.fit_budget(tokens[i], budgets[i])
    lps: list[TokenLogprob | None] = [None] * len(requests)
    for i, r in enumerate(requests):
        if want_lp[i]:
            row = raw_logprobs[i]
            k = r.params.logprobs
            top = torch.topk(row, k) if k else None
            lps[i] = TokenLogprob(tokens[i], float(row[tokens[i]]),
                                  list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])
    return tokens, lps
