"""How long a session's KV stays pinned after a reply that ended in a tool call: a cost model.

While the agent runs its tool, the session's KV either stays pinned (holding pool pages that other
requests could use) or is let go (its next turn recomputes whatever was evicted meanwhile). Per token of
the session's prefix, a pin of ``tau`` seconds is worth

    net(tau) = F(tau) * c  -  p * E[min(X, tau)] / N

- ``X``: the session's pause, from the end of its reply to the start of its next turn, and ``F`` its
  empirical distribution: the session's own last ``PAUSES_KEPT`` pauses, or every session's recent pauses
  while it has fewer than ``MIN_PAUSES`` of its own (and none while fewer than that were measured at all);
- ``c``: seconds to recompute one prompt token (measured: time to first token over the prompt tokens
  the cache did not serve, averaged);
- ``p``: pool pressure, 0..1: the pages running requests and pins hold plus the queued requests'
  demand, over the pool;
- ``N``: tokens the pool holds. Holding ``n`` of ``N`` tokens for ``t`` seconds under pressure ``p``
  takes ``p * n / N`` of the engine for ``t`` seconds; a return within ``tau`` saves ``n * c`` seconds
  of prefill. Both scale with ``n``, so the choice does not depend on the prefix's length.

``F`` steps up at each pause sample and ``E[min(X, tau)]`` only grows with ``tau``, so ``net`` is
greatest at a sample: the TTL is the best sample (the shortest among equals) times ``1 + slack``, within
``[min_ttl_s, max_ttl_s]``; when no sample has a positive net (pinning costs more than recomputing),
no pin: the KV is demoted to the tiers (:class:`PausePlan`); ``fallback_ttl_s`` (the fixed
``pin_ttl_tool_s``) until ``MIN_PAUSES`` pauses and a prefill were measured. A session that never
comes back leaves no pause (its pin simply expires).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Sequence

PAUSES_KEPT = 32        # per session, and for all sessions together
MIN_PAUSES = 3          # a history (a session's own, or everyone's) is used from this many pauses on
MIN_TTL_S = 1.0
SLACK = 0.25            # the chosen pause is stretched by this much (a pause a little longer still hits)
PREFETCH_LEAD_S = 2.0   # a demoted prefix is read back this long before the pause is expected to end
LIKELY_QUANTILE = 0.25  # without a hint, the next turn is "likely" from this quantile of the pauses on


@dataclass(frozen=True)
class PausePlan:
    """What happens to a session's KV over the pause after a turn: pinned for ``ttl_s``, or (``demote``)
    copied to the KV tiers and released at once, then read back ``prefetch_after_s`` after the reply
    ended (None: no read-back scheduled)."""

    ttl_s: float
    demote: bool = False
    prefetch_after_s: float | None = None


def prefetch_after(pause_s: float) -> float:
    """When to start reading a demoted prefix back, for a pause expected to last ``pause_s``: the
    lead is ``PREFETCH_LEAD_S``, or half the pause when that is shorter."""
    return max(0.0, pause_s - min(PREFETCH_LEAD_S, pause_s / 2))


def pin_net(tau: float, pauses: Sequence[float], recompute_s_per_token: float, pressure: float,
            pool_tokens: int) -> float:
    """``net(tau)`` of the module docstring, per token of prefix (seconds of engine time)."""
    n = len(pauses)
    hit = sum(1 for x in pauses if x <= tau) / n
    held = sum(min(x, tau) for x in pauses) / n
    return hit * recompute_s_per_token - pressure * held / pool_tokens


def best_pause(pauses: Sequence[float], recompute_s_per_token: float, pressure: float,
               pool_tokens: int) -> float | None:
    """The pause sample ``tau`` of greatest positive ``net(tau)`` (the shortest among equals); None when
    no sample's is positive. One pass over the sorted samples: at ``tau = xs[i]`` (the last of equal
    values) ``F = (i + 1) / n`` and ``E[min(X, tau)] = (xs[0] + ... + xs[i] + (n - i - 1) * xs[i]) / n``."""
    xs = sorted(pauses)
    n = len(xs)
    best, best_net, below = None, 0.0, 0.0
    for i, x in enumerate(xs):
        below += x
        if i + 1 < n and xs[i + 1] == x:
            continue
        net = (i + 1) / n * recompute_s_per_token - pressure * (below + (n - i - 1) * x) / n / pool_tokens
        if net > best_net:
            best, best_net = x, net
    return best


def pool_pressure(stats: Any) -> tuple[float, int]:
    """(pressure 0..1, pool tokens) from ``EngineStats``: pages no eviction can reclaim (running requests,
    pins) plus the queued requests' demand, over the pool's pages."""
    total = max(1, stats.pages_total)
    held = stats.pages_used - getattr(stats, "pages_evictable", 0)
    demand = held + stats.waiting_tokens / max(1, stats.page_size)
    return min(1.0, max(0.0, demand / total)), total * max(1, stats.page_size)


class ToolPinTTL:
    """Per-session pause history and the TTL the cost model gives (bounded: ``max_sessions`` sessions,
    ``PAUSES_KEPT`` pauses each). Calls come from one event loop; nothing here blocks."""

    def __init__(self, fallback_ttl_s: float, max_ttl_s: float, min_ttl_s: float = MIN_TTL_S,
                 slack: float = SLACK, max_sessions: int = 10_000) -> None:
        if not 0 < min_ttl_s <= max_ttl_s or slack < 0 or max_sessions < 1:
            raise ValueError("ToolPinTTL needs 0 < min_ttl_s <= max_ttl_s, slack >= 0 and max_sessions >= 1")
        self.fallback_ttl_s, self.min_ttl_s, self.max_ttl_s, self.slack = fallback_ttl_s, min_ttl_s, max_ttl_s, slack
        self.max_sessions = max_sessions
        self._pauses: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self._all: collections.deque = collections.deque(maxlen=PAUSES_KEPT)
        self._tool_ended: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.recompute_s_per_token = 0.0   # 0: not measured yet

    def tool_call_ended(self, session: str, now: float) -> None:
        """A reply of ``session`` ended in a tool call at ``now``: its pause starts."""
        self._tool_ended.pop(session, None)
        self._tool_ended[session] = now
        if len(self._tool_ended) > self.max_sessions:
            self._tool_ended.popitem(last=False)

    def turn_started(self, session: str, now: float) -> None:
        """``session``'s next turn arrived: the pause since its tool call (if one ended) is recorded."""
        ended = self._tool_ended.pop(session, None)
        if ended is None:
            return
        pauses = self._pauses.pop(session, None) or collections.deque(maxlen=PAUSES_KEPT)
        pauses.append(max(0.0, now - ended))
        self._pauses[session] = pauses
        self._all.append(pauses[-1])
        if len(self._pauses) > self.max_sessions:
            self._pauses.popitem(last=False)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A request computed ``tokens`` prompt tokens (not from cache) before its first token, in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = seconds / tokens
        c = self.recompute_s_per_token
        self.recompute_s_per_token = rate if c <= 0 else 0.9 * c + 0.1 * rate

    def pauses(self, session: str) -> list[float]:
        """The pauses the model reads for ``session``: its own, or every session's while it has few; none
        while fewer than ``MIN_PAUSES`` were measured (one pause says little about the next)."""
        own = self._pauses.get(session)
        if own is not None and len(own) >= MIN_PAUSES:
            return list(own)
        return list(self._all) if len(self._all) >= MIN_PAUSES else []

    def plan(self, session: str, stats: Callable[[], Any], expected_pause_s: float | None = None) -> PausePlan:
        """The pause plan after ``session``'s turn. With ``expected_pause_s`` (the agent's own hint),
        the pause is known: pin through it (``expected_pause_s * (1 + slack)``) when that fits
        ``max_ttl_s`` and pays (``pin_net`` of that one pause is positive; with no prefill measured yet
        it is taken to pay), else demote and read back shortly before it ends. Without a hint: the cost
        model's TTL (:meth:`ttl`), and where it finds no pin worth its cost, demote, with the read-back
        at the ``LIKELY_QUANTILE`` of the session's pauses. (agentrt/core/leases.py's ``LeasePolicy`` calls
        this; it is the one place the TTL after a pause is computed.)"""
        if expected_pause_s is not None:
            hold = expected_pause_s * (1 + self.slack)
            pays = self.recompute_s_per_token <= 0
            if not pays:
                pressure, pool_tokens = pool_pressure(stats())
                pays = pin_net(expected_pause_s, [expected_pause_s], self.recompute_s_per_token, pressure,
                               pool_tokens) > 0
            if pays and hold <= self.max_ttl_s:
                return PausePlan(max(self.min_ttl_s, hold))
            return PausePlan(0.0, demote=True, prefetch_after_s=prefetch_after(expected_pause_s))
        pauses = self.pauses(session)
        if not pauses or self.recompute_s_per_token <= 0:
            return PausePlan(self.fallback_ttl_s)
        pressure, pool_tokens = pool_pressure(stats())
        tau = best_pause(pauses, self.recompute_s_per_token, pressure, pool_tokens)
        if tau is not None:
            return PausePlan(min(self.max_ttl_s, max(self.min_ttl_s, tau * (1 + self.slack))))
        xs = sorted(pauses)
        likely = xs[min(len(xs) - 1, int(LIKELY_QUANTILE * len(xs)))]
        return PausePlan(0.0, demote=True, prefetch_after_s=prefetch_after(likely))
