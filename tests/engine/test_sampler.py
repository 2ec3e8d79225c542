"""Sampler filters against a plain reference, and seeded draws."""

import math

import torch

from engine.sampler import _top_k_top_p, top_k_top_p_full_sort


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


def test_the_nucleus_found_among_candidates_is_the_full_sorts():
    """Vocabulary-sized rows whose nucleus is a few tokens, past NUCLEUS_CANDIDATES, past 16x that, and
    the whole row (uniform), with and without top-k, and ties at the k-th value: the same kept set and
    values as sorting the whole row."""
    from engine.sampler import NUCLEUS_CANDIDATES

    g = torch.Generator().manual_seed(1)
    vocab = 49152
    rows = {"peaked": torch.randn(vocab, generator=g) * 8, "broad": torch.randn(vocab, generator=g) * 2,
            "flat": torch.randn(vocab, generator=g) * 0.3, "uniform": torch.zeros(vocab)}
    tied = torch.randn(vocab, generator=g) * 4
    tied[torch.topk(tied, 60).indices[45:55]] = float(torch.topk(tied, 60).values[50])   # ties around the 50th
    rows["tied"] = tied
    sizes, exact = set(), 0
    for name, logits in rows.items():
        for top_k in (0, 1, 50, 5000):
            for top_p in (1.0, 0.999, 0.9, 0.5, 0.01):
                got = _top_k_top_p(logits.clone(), top_k, top_p)
                want = top_k_top_p_full_sort(logits.clone(), top_k, top_p)
                kept = got != float("-inf")
                # as many, best first, values unchanged; where the boundary falls among equal logits
                # ("uniform", "tied") either of them may be kept, elsewhere the very same tokens
                assert int(kept.sum()) == int((want != float("-inf")).sum()), (name, top_k, top_p)
                assert kept.all() or float(logits[kept].min()) >= float(logits[~kept].max()), (name, top_k, top_p)
                assert torch.equal(got[kept], logits[kept])
                if kept.all() or float(logits[kept].min()) > float(logits[~kept].max()):
                    assert torch.equal(kept, want != float("-inf")), (name, top_k, top_p)
                    exact += 1
                if top_k == 0 and top_p < 1.0:
                    sizes.add(int(kept.sum()))
    # the paths were all taken: a nucleus inside the first candidates, past them, past 16x them
    assert min(sizes) < NUCLEUS_CANDIDATES and max(sizes) > 16 * NUCLEUS_CANDIDATES, sorted(sizes)
    assert any(NUCLEUS_CANDIDATES < n <= 16 * NUCLEUS_CANDIDATES for n in sizes), sorted(sizes)
    assert exact >= 70, exact   # of 100 cases, those without a tie at the boundary
    # ties at the k-th value are all kept, as the mask keeps them
    assert int((_top_k_top_p(tied.clone(), 50, 0.9999) != float("-inf")).sum()) == 55


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
