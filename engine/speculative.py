"""Speculative decoding from a request's own context (prompt lookup), no draft model.

An agent's next tokens often repeat its context: a file it read, a tool's output, an earlier
reply it edits. :class:`NgramDrafter` finds the longest n-gram (``max_ngram`` down to
``min_ngram`` tokens) ending the request's tokens that occurred before, at its latest earlier
occurrence (or keeps following the place its last draft came from, while that still matches),
and proposes the tokens that followed it. The engine verifies a draft in one
forward pass (the request's last token and its draft as a short extend chunk) and keeps the
longest prefix the model agrees with, plus the model's own next token (``verify``).

The index is a dict from n-gram to the end of its latest occurrence, brought up to date only
when a draft is asked for (O(new tokens x n-gram sizes), never a scan of the context).

Draft length adapts per request (:class:`DraftLength`): it grows while whole drafts are
accepted, halves when none of a draft is, and at 0 the request stops drafting, re-probing
with one token after a back-off that doubles while probes fail; so a request whose output
does not repeat its context soon pays nothing.

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

import torch

from engine.sampler import draw, probabilities
from engine.types import SamplingParams


class DraftLength:
    """A request's draft-length controller: ``limit()`` before drafting, ``update()`` after."""

    PROBE_AFTER = 4        # decode steps without a draft before the first re-probe
    MAX_PROBE_AFTER = 128  # the back-off doubles up to this while probes fail

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.k = max_len
        self.idle = 0
        self.probe_after = self.PROBE_AFTER

    def limit(self) -> int:
        """The longest draft to propose this step (0: do not draft)."""
        if self.k > 0:
            return self.k
        self.idle += 1
        if self.idle >= self.probe_after:
            self.idle = 0
            return 1
        return 0

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        if accepted == drafted:
            self.k = min(self.max_len, max(self.k, drafted) + 1)
            self.probe_after = self.PROBE_AFTER
        elif accepted == 0:
            self.k //= 2
            if self.k == 0:
                self.probe_after = min(self.MAX_PROBE_AFTER, self.probe_after * 2)
        else:
            self.k = max(self.k, accepted + 1)


class NgramDrafter:
    """Prompt-lookup drafts for one request: :meth:`extend` with new tokens, then :meth:`propose`.

    A draft comes from the source position the last draft came from, moved on by the tokens
    committed since, while the tokens before it still match the request's last ones (a reply
    copying a file keeps copying the same place, even past n-grams the file repeats elsewhere);
    otherwise, or when the index knows a longer match, from :meth:`latest_match`.
    """

    def __init__(self, tokens: list[int], max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.tokens = list(tokens)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.indexed = 0                            # n-grams ending at or before this position are in
        self._source: tuple[int, int] | None = None  # (source end, tokens then) of the last draft

    def extend(self, new_tokens) -> None:
        """Append tokens the request committed (indexed lazily, at the next ``propose``)."""
        self.tokens.extend(new_tokens)

    def _catch_up(self) -> None:
        # index every n-gram that ends before the last token: the suffix ending at the last token
        # must find an *earlier* occurrence, one with at least one token after it
        toks, end = self.tokens, len(self.tokens) - 1
        for e in range(self.indexed + 1, end + 1):
            for n in range(self.min_ngram, min(self.max_ngram, e) + 1):
                self.index[tuple(toks[e - n:e])] = e
        self.indexed = max(self.indexed, end)

    def latest_match(self) -> tuple[int, int] | None:
        """(end of the latest earlier occurrence of the longest suffix n-gram, n), or None."""
        toks = self.tokens
        L = len(toks)
        self._catch_up()
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            e = self.index.get(tuple(toks[L - n:]))
            if e is not None:
                return e, n
        return None

    def _followed_match(self) -> tuple[int, int] | None:
        """(where the last draft's source has got to, how many tokens before it still match)."""
        if self._source is None:
            return None
        toks = self.tokens
        L = len(toks)
        e = self._source[0] + L - self._source[1]   # <= L - 1: the source ended before its tokens did
        n = 0
        while n < self.max_ngram and n < e and toks[e - 1 - n] == toks[L - 1 - n]:
            n += 1
        return (e, n) if n >= self.min_ngram else None

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens to follow the request's tokens; [] when no suffix of ``min_ngram``
        tokens or more occurred before."""
        toks = self.tokens
        L = len(toks)
        if k <= 0 or L < self.min_ngram + 1:
            return []
        match = self._followed_match()
        if match is None or match[1] < self.max_ngram:
            latest = self.latest_match()
            if latest is not None and (match is None or latest[1] > match[1]):
                match = latest
        if match is None:
            self._source = None
            return []
        e = match[0]
        self._source = (e, L)
        # what followed; past the end it runs on into the draft itself (a repeating pattern)
        draft: list[int] = []
        for j in range(k):
            draft.append(toks[e + j] if e + j < L else draft[e + j - L])
        return draft


class SpeculativeState:
    """A request's drafting state: its n-gram index and its draft-length controller."""

    def __init__(self, prompt_ids: list[int], max_len: int, max_ngram: int = 4, min_ngram: int = 2) -> None:
        self.drafter = NgramDrafter(prompt_ids, max_ngram, min_ngram)
        self.length = DraftLength(max_len)
        self.prompt_len = len(prompt_ids)

    def propose(self, output_ids: list[int], limit: int) -> list[int]:
        """A draft of at most ``limit`` tokens to follow ``output_ids`` (the request's output so far)."""
        k = min(self.length.limit(), limit)
        if k <= 0:
            return []
        self.drafter.extend(output_ids[len(self.drafter.tokens) - self.prompt_len:])
        return self.drafter.propose(k)


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """Accept a draft against the model's logits at its ``len(draft) + 1`` positions.

    ``logits[j]`` is the distribution of the token after the request's last token plus
    ``draft[:j]``. Position by position, the model's token is chosen exactly as ``sample``
    chooses it (the argmax, or ``draw`` with one uniform of the request's generator); the
    draft is accepted while it agrees. Returns (the tokens to commit: the accepted prefix of the
    draft and then the model's own token, the number of drafted tokens accepted).
    """
    best = torch.argmax(logits, dim=-1).tolist() if params.greedy else None

    def model_token(j: int) -> int:
        return best[j] if best is not None else draw(probabilities(logits[j], params), generator)

    out: list[int] = []
    for j, x in enumerate(draft):
        out.append(model_token(j))
        if out[-1] != x:
            return out, j
    out.append(model_token(len(draft)))
    return out, len(draft)
