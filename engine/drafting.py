"""What a request drafts from, without a draft model (engine/speculative.py verifies the drafts).

:class:`NgramDrafter` finds the longest n-gram ending the request's tokens that occurred before and
proposes what followed it; :class:`OutputCorpus` (per tenant, :class:`TenantCorpora`) does the same
over the recent outputs of the tenant's other requests; :class:`DraftLength` adapts the draft length
to the acceptance a request sees; :class:`SpeculativeState` is one request's drafting state (its
``Request.speculative``). Nothing here reads a request or the sampler: the engine's
:class:`~engine.speculative.SpeculativeDecoder` does, so ``engine.request`` can name
:class:`SpeculativeState` without an import loop.
"""

from __future__ import annotations

from engine.step_cost import STEP_COST


class DraftLength:
    """A request's draft-length controller: ``limit()`` before drafting, ``update()`` after.

    It keeps an estimate ``alpha`` of the chance a drafted token is accepted (accepted tokens over
    tokens tried, a rejection counting as one try, with older verifications weighing ``DECAY``
    less each time; starting from a prior of 0.4) and drafts the ``k`` that makes the most tokens
    per unit of step cost: a verification of ``k`` drafts commits ``(1 - alpha**(k+1)) / (1 - alpha)``
    tokens on average (the j-th drafted token is kept only if all before it are, then the model's
    own) for a cost of ``1 + FIXED + ROW * k`` decode steps (``STEP_COST``), against one token for
    one step without a draft. When no ``k`` beats that the request stops drafting and re-probes
    with one token after a back-off that doubles while probes fail.
    """

    PROBE_AFTER = 4        # decode steps without a draft before the first re-probe
    MAX_PROBE_AFTER = 128  # the back-off doubles up to this while probes fail
    DECAY = 0.75           # weight of the past at each verification
    # (accepted, tried) pseudo-counts: alpha starts at 0.4, where no draft pays (1.4 tokens for
    # 1.43 steps), so a request first probes with one token; a few accepted probes and it drafts
    PRIOR = (0.8, 2.0)

    def __init__(self, max_len: int, step_cost: tuple[float, float] = STEP_COST) -> None:
        fixed, row = step_cost
        if fixed < 0 or row <= 0:
            raise ValueError(f"step_cost must be (fixed >= 0, row > 0), got {step_cost!r}")
        self.max_len = max_len
        self.fixed, self.row = fixed, row
        self.accepted, self.tried = self.PRIOR
        self.idle = 0
        self.probe_after = self.PROBE_AFTER

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried

    @staticmethod
    def expected_tokens(alpha: float, k: int) -> float:
        """Tokens a verification of ``k`` drafts commits on average (the model's own included)."""
        return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)

    @property
    def k(self) -> int:
        """The draft length the estimate pays for (0: not drafting)."""
        a = self.alpha
        best, best_rate = 0, 1.0
        for k in range(1, self.max_len + 1):
            rate = self.expected_tokens(a, k) / (1.0 + self.fixed + self.row * k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def limit(self) -> int:
        """The longest draft to propose this step (0: do not draft)."""
        k = self.k
        if k > 0:
            return k
        self.idle += 1
        if self.idle >= self.probe_after:
            self.idle = 0
            return 1
        return 0

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        tried = accepted + (1 if accepted < drafted else 0)
        self.accepted = self.DECAY * self.accepted + accepted
        self.tried = self.DECAY * self.tried + tried
        if self.k > 0:
            self.probe_after = self.PROBE_AFTER
        elif accepted == 0:
            self.probe_after = min(self.MAX_PROBE_AFTER, self.probe_after * 2)


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

    def match(self) -> tuple[int, int] | None:
        """(end of the source to draft from, how many tokens before it match the request's last
        ones): the followed source while it matches, or a longer latest match; None if neither."""
        if len(self.tokens) < self.min_ngram + 1:
            return None
        match = self._followed_match()
        if match is None or match[1] < self.max_ngram:
            latest = self.latest_match()
            if latest is not None and (match is None or latest[1] > match[1]):
                match = latest
        return match

    def draft_from(self, match: tuple[int, int] | None, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the source ``match`` names (remembered, to follow it
        next time); [] without a match."""
        toks = self.tokens
        L = len(toks)
        if match is None or k <= 0:
            self._source = None
            return []
        e = match[0]
        self._source = (e, L)
        # what followed; past the end it runs on into the draft itself (a repeating pattern)
        draft: list[int] = []
        for j in range(k):
            draft.append(toks[e + j] if e + j < L else draft[e + j - L])
        return draft

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens to follow the request's tokens; [] when no suffix of ``min_ngram``
        tokens or more occurred before."""
        if k <= 0:
            return []
        return self.draft_from(self.match(), k)


class OutputCorpus:
    """Recent outputs of one tenant's requests on this worker, to draft from (the same agent
    program writes the same tool calls and phrases in every session).

    A bounded token buffer (outputs one after another, each behind a separator no token equals)
    with an index from n-gram (``min_ngram`` to ``max_ngram`` tokens) to the end of its latest
    occurrence, in positions counted since the corpus began. When the buffer would pass
    ``max_tokens`` its oldest outputs are dropped, down to half, and the index is rebuilt from
    what is left (amortized O(1) per token). Like a request's own drafter, a match is followed
    while it keeps matching; a draft stops at the end of the output it comes from.
    """

    SEP = -1

    def __init__(self, max_tokens: int = 8192, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if max_tokens < 4 * max_ngram:
            raise ValueError(f"max_tokens must be at least {4 * max_ngram}, got {max_tokens}")
        self.max_tokens, self.max_ngram, self.min_ngram = max_tokens, max_ngram, min_ngram
        self.tokens: list[int] = []
        self.base = 0                                # position of tokens[0] since the corpus began
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive, absolute) of its latest occurrence

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, output_ids: list[int]) -> None:
        """Append one finished output (only its last ``max_tokens // 2`` tokens if longer)."""
        ids = list(output_ids[-(self.max_tokens // 2):])
        if len(ids) < self.min_ngram + 1:
            return
        if len(self.tokens) + 1 + len(ids) > self.max_tokens:
            self._drop_oldest(self.max_tokens // 2 - len(ids) - 1)
        lo = len(self.tokens) + 1
        self.tokens.append(self.SEP)
        self.tokens.extend(ids)
        self._index(lo, len(self.tokens))

    def _drop_oldest(self, keep: int) -> None:
        """Keep at most ``keep`` of the newest tokens, starting at an output's separator."""
        cut = max(0, len(self.tokens) - max(keep, 0))
        while cut < len(self.tokens) and self.tokens[cut] != self.SEP:
            cut += 1
        self.tokens = self.tokens[cut:]
        self.base += cut
        self.index = {}
        lo = 0
        for i, t in enumerate(self.tokens + [self.SEP]):
            if t == self.SEP:
                if i > lo:
                    self._index(lo, i)
                lo = i + 1

    def _index(self, lo: int, hi: int) -> None:
        """Index the n-grams of ``tokens[lo:hi]`` (one output) with at least one token after them."""
        toks, index, base = self.tokens, self.index, self.base
        for e in range(lo + self.min_ngram, hi):
            for n in range(self.min_ngram, min(self.max_ngram, e - lo) + 1):
                index[tuple(toks[e - n:e])] = base + e

    def match(self, tokens: list[int], follow: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """(absolute end of a source, matched length) for the end of ``tokens`` (a request's):
        ``follow`` = (a source's end, len(tokens) then) moved on while it still matches, or the
        latest occurrence of a longer suffix; None if neither matches ``min_ngram`` tokens."""
        L = len(tokens)
        best = None
        if follow is not None:
            e = follow[0] + L - follow[1]
            local = e - self.base
            if 0 < local < len(self.tokens):
                n = 0
                while n < self.max_ngram and n < local and n < L and self.tokens[local - 1 - n] == tokens[L - 1 - n]:
                    n += 1
                if n >= self.min_ngram:
                    best = (e, n)
        if best is not None and best[1] >= self.max_ngram:
            return best
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            e = self.index.get(tuple(tokens[L - n:]))
            if e is not None:   # every entry is live: the index is rebuilt when outputs are dropped
                if best is None or n > best[1]:
                    best = (e, n)
                break
        return best

    def draft_at(self, end: int, k: int) -> list[int]:
        """Up to ``k`` tokens from absolute position ``end``, stopping at the end of its output."""
        out: list[int] = []
        i = end - self.base
        while len(out) < k and 0 <= i < len(self.tokens) and self.tokens[i] != self.SEP:
            out.append(self.tokens[i])
            i += 1
        return out


class TenantCorpora:
    """An :class:`OutputCorpus` per tenant (per cache salt: tenants that may not share KV cache
    never draft from each other's outputs), the ``max_tenants`` most recently used kept."""

    def __init__(self, max_tenants: int = 16, max_tokens: int = 8192) -> None:
        self.max_tenants, self.max_tokens = max_tenants, max_tokens
        self._corpora: dict[str, OutputCorpus] = {}   # insertion order = least recently used first

    def get(self, salt: str) -> OutputCorpus | None:
        c = self._corpora.pop(salt, None)
        if c is not None:
            self._corpora[salt] = c
        return c

    def add(self, salt: str, output_ids: list[int]) -> None:
        c = self.get(salt)
        if c is None:
            c = self._corpora[salt] = OutputCorpus(self.max_tokens)
            while len(self._corpora) > self.max_tenants:
                del self._corpora[next(iter(self._corpora))]
        c.add(output_ids)


class SpeculativeState:
    """A request's drafting state: its n-gram index, its draft-length controller and the place in
    its tenant's corpus it last drafted from."""

    def __init__(self, prompt_ids: list[int], max_len: int, max_ngram: int = 4, min_ngram: int = 2,
                 step_cost: tuple[float, float] = STEP_COST) -> None:
        self.drafter = NgramDrafter(prompt_ids, max_ngram, min_ngram)
        self.length = DraftLength(max_len, step_cost)
        self.prompt_len = len(prompt_ids)
        self._corpus_source: tuple[int, int] | None = None

    def propose(self, output_ids: list[int], limit: int, corpus: OutputCorpus | None = None) -> list[int]:
        """A draft of at most ``limit`` tokens to follow ``output_ids`` (the request's output so
        far): from the request's own tokens, or from ``corpus`` where it matches a longer suffix."""
        k = min(self.length.limit(), limit)
        if k <= 0:
            return []
        d = self.drafter
        d.extend(output_ids[len(d.tokens) - self.prompt_len:])
        own = d.match()
        if corpus is not None and (own is None or own[1] < d.max_ngram):
            shared = corpus.match(d.tokens, self._corpus_source)
            draft = corpus.draft_at(shared[0], k) if shared is not None and (own is None or shared[1] > own[1]) else []
            if draft:
                d.draft_from(None, 0)
                self._corpus_source = (shared[0], len(d.tokens))
                return draft
        self._corpus_source = None
        return d.draft_from(own, k)
