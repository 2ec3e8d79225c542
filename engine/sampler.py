"""Sampling the next token of each request from its logits row.

Per row, in order: the request's constraint masks disallowed tokens; greedy rows
take the argmax; other rows apply temperature, top-k and top-p, then draw with
the request's own generator (so a seed makes a request reproducible whatever it
is batched with). Log-probabilities are of the model's distribution.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.types import TokenLogprob


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


def sample(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: (B, V) float32, one row per request -> (token ids, logprobs or None)."""
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
        p = r.params
        row = _top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=r.generator).item())
    lps: list[TokenLogprob | None] = [None] * len(requests)
    for i, r in enumerate(requests):
        if want_lp[i]:
            row = raw_logprobs[i]
            k = r.params.logprobs
            top = torch.topk(row, k) if k else None
            lps[i] = TokenLogprob(tokens[i], float(row[tokens[i]]),
                                  list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])
    return tokens, lps
