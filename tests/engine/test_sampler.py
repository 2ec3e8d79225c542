"""Sampler filters against a plain reference, and seeded draws."""

import math

import torch

from engine.sampler import _top_k_top_p


def reference_filter(logits, top_k, top_p):
    """Keep the top_k best tokens, then the smallest best-first set whose mass reaches top_p."""
    items = sorted(enumerate(logits.tolist()), key=lambda x: -x[1])
    if top_k > 0:
        items = items[:top_k]
    m = max(v for _, v in items)
    z = sum(math.exp(v - m) for _, v in items)
    kept, mass = set(), 0.0
    for i, v in items:
        if mass >= top_p:
            break
        kept.add(i)
        mass += math.exp(v - m) / z
    return kept


def test_top_k_top_p_matches_reference():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        logits = torch.randn(40, generator=g) * 3
        top_k = [0, 1, 5, 40][trial % 4]
        top_p = [1.0, 0.9, 0.5, 0.05][(trial // 4) % 4]
        out = _top_k_top_p(logits.clone(), top_k, top_p)
        kept = {i for i, v in enumerate(out.tolist()) if v != float("-inf")}
        assert kept == reference_filter(logits, top_k, top_p), (top_k, top_p)
        # kept logits are unchanged
        assert torch.equal(out[list(kept)], logits[list(kept)])


def test_tiny_temperature_is_greedy_not_nan():
    """A temperature like 5e-324 is valid input; dividing by it would give NaN probabilities."""
    from engine.request import Request
    from engine.sampler import SamplingBatch, sample
    from engine.types import SamplingParams

    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    for t in (5e-324, 1e-8):
        req = Request("r", [1], SamplingParams(temperature=t))
        req.generator = torch.Generator().manual_seed(0)
        tokens, _ = sample(logits.clone(), SamplingBatch.of([req]))
        assert tokens == [1]
