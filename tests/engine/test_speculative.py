"""Speculative decoding from the request's own context (engine/speculative.py): the drafter
and the verification rule."""

import random
from collections import Counter

import torch

from engine.speculative import DraftLength, NgramDrafter, verify
from engine.types import SamplingParams

# -- the drafter ------------------------------------------------------------------------------------


def reference_latest_match(tokens, max_ngram=4, min_ngram=2):
    """Brute force: (end of the latest earlier occurrence of the longest suffix n-gram, n)."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        for e in range(L - 1, n - 1, -1):
            if tokens[e - n:e] == tokens[L - n:]:
                return e, n
    return None


def test_drafter_proposes_what_followed_the_longest_latest_match():
    d = NgramDrafter([5, 1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3])
    assert d.propose(3) == [9, 8, 2]           # (1, 2, 3) beats the later (2, 3)
    d.extend([4, 4])                            # suffix (3, 4, 4) / (4, 4) never occurred before
    assert d.propose(3) == []
    d.extend([1, 2])
    assert d.propose(2) == [3, 4]               # (1, 2): its latest earlier occurrence is followed by 3, 4
    assert NgramDrafter([7, 7, 7]).propose(5) == [7, 7, 7, 7, 7]    # a repeating run continues itself
    assert NgramDrafter([1, 2]).propose(3) == []
    assert NgramDrafter([1, 2, 1, 2]).propose(0) == []


def test_drafter_keeps_following_the_place_it_copies():
    """A file whose 4-gram (1 2 3 4) occurs twice, copied from its start: at the second occurrence
    the latest earlier match is the reply's own copy of the first one (followed by 10), but the
    copy goes on from where it is in the file (20)."""
    source = [1, 2, 3, 4, 10, 11, 12, 13, 14, 1, 2, 3, 4, 20, 21, 22, 23]
    d = NgramDrafter(source + [0, 9, 1, 2, 3, 4, 10])   # the reply has copied "1 2 3 4 10"
    assert d.propose(3) == [11, 12, 13]
    d.extend([11, 12])
    assert d.propose(3) == [13, 14, 1]
    d.extend([13, 14, 1, 2, 3, 4])                      # copying on, through the repeated 4-gram
    assert d.latest_match() == (len(source) + 6, 4)     # the reply's own "1 2 3 4", followed by 10
    assert d.propose(2) == [20, 21]
    d.extend([99])                                      # the reply departs from the source
    assert d.propose(2) == []


def test_drafter_index_kept_incrementally_equals_brute_force():
    rng = random.Random(0)
    for trial in range(40):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        d = NgramDrafter(tokens)
        for _ in range(25):
            assert d.latest_match() == reference_latest_match(tokens), (trial, tokens)
            k = rng.randrange(1, 6)
            draft = d.propose(k)
            assert len(draft) == (k if reference_latest_match(tokens) else 0)
            new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            tokens += new
            d.extend(new)


def test_draft_length_adapts_to_acceptance_and_reprobes():
    ln = DraftLength(4)
    assert ln.limit() == 4
    for _ in range(3):                    # nothing accepted: 4 -> 2 -> 1 -> 0
        ln.update(ln.limit(), 0)
    assert ln.k == 0
    limits = [ln.limit() for _ in range(DraftLength.PROBE_AFTER * 2 * 2)]
    # a first probe after a back-off of twice PROBE_AFTER (doubled when the length reached 0)
    probes = [i for i, n in enumerate(limits) if n]
    assert probes == [2 * DraftLength.PROBE_AFTER - 1, 4 * DraftLength.PROBE_AFTER - 1]
    ln.update(1, 0)                       # a failed probe: the back-off doubles again
    assert ln.probe_after == 4 * DraftLength.PROBE_AFTER
    ln.update(1, 1)                       # a probe accepted: drafting resumes and grows
    assert ln.k == 2 and ln.probe_after == DraftLength.PROBE_AFTER
    ln.update(2, 2)
    ln.update(3, 3)
    ln.update(4, 4)
    assert ln.limit() == 4                # capped at the configured length
    ln.update(4, 1)                       # partly accepted: kept at least the accepted length + 1
    assert ln.k == 4


# -- verification -----------------------------------------------------------------------------------

def test_greedy_verify_takes_the_agreeing_prefix_and_the_models_next_token():
    logits = torch.tensor([[0., 5, 1], [9, 1, 1], [0, 0, 3]])
    g = SamplingParams(max_tokens=8, temperature=0)
    assert verify(logits, [1, 0], g, None) == ([1, 0, 2], 2)
    assert verify(logits, [2, 0], g, None) == ([1], 0)
    assert verify(logits, [1, 1], g, None) == ([1, 0], 1)


def chi2_pvalue(observed, expected):
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_verify_commits_tokens_distributed_as_the_model():
    """The first committed token is distributed as p0 whatever the draft; after an accepted first
    token, the second as p1: chi-square against the exact (temperature, top-k processed) probabilities."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6)
    probs = [torch.softmax(torch.where(row >= torch.topk(row, 6).values[-1], row / 0.8,
                                       torch.tensor(float("-inf"))), -1) for row in logits]
    g = torch.Generator().manual_seed(1)
    draft = [int(torch.argmax(probs[0])), int(torch.argsort(probs[1])[-2])]  # likely, then less likely
    firsts, seconds, accepted = Counter(), Counter(), Counter()
    N = 12000
    for _ in range(N):
        out, a = verify(logits, draft, params, g)
        assert len(out) == a + 1 and out[:a] == draft[:a]
        firsts[out[0]] += 1
        accepted[a] += 1
        if out[0] == draft[0]:
            seconds[out[1]] += 1
    for counts, p in ((firsts, probs[0]), (seconds, probs[1])):
        n = sum(counts.values())
        support = [t for t in range(8) if p[t] > 0]
        assert set(counts) <= set(support)         # never a token top-k removed
        assert chi2_pvalue([counts[t] for t in support], [n * float(p[t]) for t in support]) > 1e-3
    # acceptance as the standard rule has it: the first drafted token with probability p0(x)
    assert abs(accepted[0] / N - (1 - float(probs[0][draft[0]]))) < 0.02
