"""Sampling the next token of each request from its logits row.

Per row, in order: the request's constraint masks disallowed tokens; greedy rows
take the argmax; other rows apply temperature, top-k and top-p (``probabilities``),
then draw by inverse CDF with one uniform from the request's own generator (``draw``),
so a seed makes a request reproducible whatever it is batched with, and the n-th
token of a request is a function of its n-th uniform and its distribution alone
(speculative verification, engine/speculative.py, relies on that). A constrained row
closing within its token budget may then have its token replaced by the constraint's
closing (``fit_budget``). Log-probabilities are of the model's distribution, for the
token emitted. The sampler reads a ``SamplingBatch`` (each row's parameters, generator and
constraint), never a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from engine.constraints import TokenConstraint
from engine.types import SamplingParams, TokenLogprob


class Sampled(Protocol):
    """What a row's sampling state is read from (an engine ``Request`` is one)."""
    params: SamplingParams
    generator: torch.Generator | None
    constraint: TokenConstraint | None


@dataclass(frozen=True)
class SamplingBatch:
    """The sampling state of a step's logits rows, one entry per row: the sampling parameters, the
    generator a sampled row draws from (None for greedy rows), the constraint that masks it (or None)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    constraints: list[TokenConstraint | None]

    @classmethod
    def of(cls, rows: Sequence[Sampled]) -> SamplingBatch:
        return cls([r.params for r in rows], [r.generator for r in rows], [r.constraint for r in rows])

    def __len__(self) -> int:
        return len(self.params)


# top-p looks for the nucleus among this many of a row's best tokens first (then 16x as many, up to all):
# a sampled reply's nucleus is mostly a few tokens (median 8, max 649 at temperature 0.8, top-p 0.95,
# benchmarks/sampler_filter.py), and topk over 49k logits costs 0.09 ms for 64, 0.4 ms for 1024
NUCLEUS_CANDIDATES = 64


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask a (V,) row outside the top-k and the top-p nucleus with -inf.

    Top-k keeps every token at least as likely as the k-th (ties included). Top-p then keeps the
    smallest best-first set whose mass reaches ``top_p``: a token is dropped when the mass of the tokens
    ahead of it already does. Sorting the whole vocabulary for that costs ~3 ms a row at V = 49k on a
    CPU core, a third of a decode step, while the nucleus is nearly always a few hundred tokens: so it
    is looked for among the best ``NUCLEUS_CANDIDATES`` (``torch.topk``, sorted), then 16x as many, up to
    the whole row. The kept set is a best-first prefix, so a prefix that ends inside the candidates is
    the full sort's. The masses are summed in float64: in float32 a sum over thousands of tokens is off
    by ~1e-4, enough to move the boundary of a broad nucleus. ``tests/engine/test_sampler.py`` checks it
    against ``top_k_top_p_full_sort`` and a plain reference."""
    vocab = logits.shape[-1]
    if not 0 < top_k < vocab:
        top_k = 0
    if top_p >= 1.0:
        if top_k:
            kth = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return logits
    if top_k:
        values, order = torch.topk(logits, top_k)
        tied = int((logits >= values[-1]).sum())   # tokens equal to the k-th are kept too
        if tied > top_k:
            values, order = torch.topk(logits, tied)
        probs = torch.softmax(values, dim=-1, dtype=torch.float64)   # after top-k: the rest is -inf
        keep = torch.cumsum(probs, dim=-1) - probs < top_p
    else:
        all_probs = torch.softmax(logits, dim=-1, dtype=torch.float64)
        m = min(vocab, NUCLEUS_CANDIDATES)
        while True:
            order = torch.topk(logits, m).indices   # (the order of the probabilities: no subnormals)
            probs = all_probs[order]
            keep = torch.cumsum(probs, dim=-1) - probs < top_p
            if m == vocab or not keep[-1]:   # the nucleus ends inside the candidates
                break
            m = min(vocab, m * 16)
    kept = order[keep]
    return torch.full_like(logits, float("-inf")).index_copy_(0, kept, logits[kept])


def top_k_top_p_full_sort(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The plain reference of ``_top_k_top_p``: top-k as a mask at the k-th value, then the whole row
    sorted for the nucleus (masses in float64). Tests and ``benchmarks/sampler_filter.py`` compare with it."""
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float64)[order]
        drop = torch.cumsum(probs, dim=-1) - probs >= top_p
        kept = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, kept)
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


def sample(logits: torch.Tensor, batch: SamplingBatch, budgets: list[int | None] | None = None
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: (B, V) float32, one row per entry of ``batch`` -> (token ids, logprobs or None).

    ``budgets[i]``: the tokens row ``i`` may still emit, this one included, when its
    constraint is to close its output within them (``TokenConstraint.fit_budget`` may then
    replace the sampled token); None for the rows (or all of them) without closing."""
    params, constraints = batch.params, batch.constraints
    want_lp = [p.logprobs is not None for p in params]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    for i, c in enumerate(constraints):
        if c is not None:
            c.apply_to_logits(logits[i])
    tokens: list[int] = [0] * len(batch)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        ids = torch.argmax(logits[greedy], dim=-1).tolist()
        for i, t in zip(greedy, ids):
            tokens[i] = t
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = draw(probabilities(logits[i], p), batch.generators[i])
    if budgets is not None:
        for i, c in enumerate(constraints):
            if budgets[i] is not None:
                tokens[i] = c.fit_budget(tokens[i], budgets[i])
    lps: list[TokenLogprob | None] = [None] * len(batch)
    for i, p in enumerate(params):
        if want_lp[i]:
            row = raw_logprobs[i]
            top = torch.topk(row, p.logprobs) if p.logprobs else None
            lps[i] = TokenLogprob(tokens[i], float(row[tokens[i]]),
                                  list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])
    return tokens, lps
