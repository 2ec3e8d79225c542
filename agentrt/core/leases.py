"""The KV lease: a finished sequence's pages held in the engine's prefix cache for a time-to-live, so
the turn that comes back to it computes only its new tokens; and the one policy that decides its TTL.

A lease is acquired by submitting a request with a TTL (``EngineClient.submit(lease_ttl_s=)``): when it
finishes, the engine holds its whole sequence (prompt and reply) under the request's id. It is then
changed through the engine client's lease calls, the same in process and behind a router (which sends
them to the worker holding the lease, ``POST /internal/lease/{op}``): ``extend_lease``,
``release_lease``, ``demote_lease`` (its pages to the KV tiers, released: a long pause ahead) and
``prefetch_lease`` (a demoted lease read back: the next turn is near). The engine may drop a lease
early under memory pressure; a lease is a hint, never a reason to fail.

Who holds one, and what ends it:

- a session turn (``/v1/sessions``, and each stored response of ``/v1/responses``, whose chains are
  sessions): the session's own ``pin_ttl_s``, else the server's; over the pause after the turn, the
  pause plan (below). Its id is kept in the turn record (``TurnRecord.pin_id``, on the record's last
  worker), so any router replica releases it: at the session's next turn, delete or idle expiry.
- an affinity-keyed conversation's latest request (``prompt_cache_key`` or a session header,
  ``agentrt/core/affinity.py``; ``--affinity-turns``, and the request asks for no lease of its own): the
  server's ``pin_ttl_s``, then the pause plan; released by the conversation's next request here.
- an Anthropic request with ``cache_control`` breakpoints: ``pin_ttl_s`` for ``ephemeral`` (``5m``), an
  hour within ``max_pin_ttl_s`` for ``1h``; it expires, nothing releases it early.
- an unstored response (``store: false``): no lease of its own; keyed, it is the conversation's latest
  request as above.

The pause plan after a turn (:meth:`LeasePolicy.after_turn`): a session's own ``pin_ttl_s`` is kept as
asked; the agent's announced pause (``expected_pause_s``) is pinned through or demoted and read back
before it ends; after a tool call, ``pin_ttl_tool_s`` (``--pin-ttl-policy fixed``) or the cost model below
(``cost``, :class:`ToolPinTTL`); else the lease stays as acquired.

:class:`LeasePolicy` decides every TTL and holds the pause history it learns from; :class:`KVLeases`
applies it through the engine client and remembers what this process holds. Calls come from one event
loop; nothing here blocks.

After a tool call, the cost model (:class:`ToolPinTTL`, called by :meth:`LeasePolicy.after_turn`) decides
how long the session's KV stays pinned. While the agent runs its tool, the session's KV either stays pinned (holding pool pages that other
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
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from engine.client import EngineClient, SessionHint

from agentrt.config import ServingSettings

CACHE_CONTROL_LONG_S = 3600.0   # Anthropic's ``ttl: "1h"``
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
        at the ``LIKELY_QUANTILE`` of the session's pauses. (``LeasePolicy.after_turn`` calls
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


class LeasePolicy:
    """Every KV lease TTL of the serving layer: at acquisition (:meth:`turn_ttl`, :meth:`affinity_ttl`,
    :meth:`cache_control_ttl`) and over the pause after a turn (:meth:`after_turn`, from the session's
    measured pauses: :meth:`turn_started`, :meth:`observe_prefill`). ``stats``: the engine's
    ``EngineStats``, read only when a plan weighs the pool's pressure."""

    def __init__(self, config: ServingSettings, stats: Callable[[], Any]) -> None:
        self.config = config
        self._stats = stats
        self.pauses = ToolPinTTL(config.pin_ttl_tool_s, config.max_pin_ttl_s, max_sessions=config.max_sessions,
                                 min_ttl_s=min(MIN_TTL_S, config.max_pin_ttl_s))

    # ------------------------------------------------------------ at acquisition

    def check_session_ttl(self, ttl_s: float | None) -> None:
        """``ValueError`` for a session's own TTL past ``max_pin_ttl_s``."""
        if ttl_s is not None and ttl_s > self.config.max_pin_ttl_s:
            raise ValueError(f"pin_ttl_s {ttl_s} exceeds the server's maximum of {self.config.max_pin_ttl_s}")

    def check_pause_hint(self, session_id: str, session_ttl_s: float | None, expected_pause_s: float | None) -> None:
        """``ValueError`` for a turn that announces its pause in a session with its own TTL, which every
        turn keeps (:meth:`after_turn` would ignore the hint)."""
        if session_ttl_s is not None and expected_pause_s is not None:
            raise ValueError(f"expected_pause_s: session '{session_id}' was created with its own pin_ttl_s "
                             f"({session_ttl_s}), which every turn keeps; drop one of the two")

    def turn_ttl(self, session_ttl_s: float | None) -> float:
        """A session turn's lease: the session's own TTL, else the server's ``pin_ttl_s``."""
        return session_ttl_s or self.config.pin_ttl_s

    def affinity_ttl(self, asked_ttl_s: float | None, session: SessionHint | None) -> float | None:
        """The lease of a request that is its conversation's latest turn (it names its conversation by an
        affinity key, asks for no lease of its own, and ``affinity_turns`` is on): ``pin_ttl_s``; None
        for any other request."""
        if asked_ttl_s is None and session is not None and session.remember and self.config.affinity_turns:
            return self.config.pin_ttl_s
        return None

    def cache_control_ttl(self, ttls: Iterable[str | None]) -> float | None:
        """An Anthropic request's lease from its ``cache_control`` breakpoints' ``ttl`` values (None:
        ephemeral, 5m): None without breakpoints; an hour within ``max_pin_ttl_s`` (never below
        ``pin_ttl_s``) when one asks ``1h``; else ``pin_ttl_s``."""
        ttls = list(ttls)
        if not ttls:
            return None
        if "1h" in ttls:
            return max(self.config.pin_ttl_s, min(CACHE_CONTROL_LONG_S, self.config.max_pin_ttl_s))
        return self.config.pin_ttl_s

    # ------------------------------------------------------------ over the pause after a turn

    def after_turn(self, session_id: str, *, tool_call: bool, expected_pause_s: float | None,
                   own_ttl: bool = False) -> PausePlan | None:
        """What a turn's lease does over the pause after it: None (it stays as acquired) for a session
        with its own TTL (``own_ttl``) and for a turn with neither a tool call nor an announced pause;
        else the plan of ``expected_pause_s`` where given, ``pin_ttl_tool_s`` after a tool call under
        policy fixed, or the cost model's plan (:meth:`ToolPinTTL.plan`)."""
        if own_ttl:
            return None
        if tool_call:
            self.pauses.tool_call_ended(session_id, time.monotonic())
        if expected_pause_s is not None:
            return self.pauses.plan(session_id, self._stats, expected_pause_s)
        if not tool_call:
            return None
        if self.config.pin_ttl_policy == "fixed":
            return PausePlan(self.config.pin_ttl_tool_s)
        return self.pauses.plan(session_id, self._stats)

    def turn_started(self, session_id: str) -> None:
        """``session_id``'s next turn arrived: the pause since its tool call, if one ended, is measured."""
        self.pauses.turn_started(session_id, time.monotonic())

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A request computed ``tokens`` prompt tokens before its first token, in ``seconds`` (the
        recompute cost a lease saves)."""
        self.pauses.observe_prefill(tokens, seconds)


class KVLeases:
    """The leases this process made, applied through the engine client by :class:`LeasePolicy`'s plans:
    each affinity-keyed conversation's latest lease (the most recent ``limit`` conversations; one dropped
    from here loses nothing but an early release), each session's current lease (for its view), and the
    demoted leases to read back."""

    def __init__(self, engine: EngineClient, policy: LeasePolicy, metrics: Any, limit: int) -> None:
        self.engine = engine
        self.policy = policy
        self.metrics = metrics
        self.limit = limit
        self._conversations: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._sessions: dict[str, tuple[str, float]] = {}   # session id -> (lease id, expires at)
        # session id -> (when, lease id, worker): read a demoted lease back then (its next turn is near)
        self._prefetch_at: dict[str, tuple[float, str, str | None]] = {}

    def hold_for_pause(self, lease_id: str, session_id: str, *, tool_call: bool, expected_pause_s: float | None,
                       ttl_s: float, own_ttl: bool = False) -> tuple[float, float | None]:
        """The one place a turn's lease follows the policy's pause plan (a session turn's and an
        affinity-keyed conversation's request alike): extended, demoted, or left as acquired. Returns its
        TTL from now (``ttl_s`` when left; 0 once demoted) and, for a demotion, when to read it back
        (seconds from now; None: not scheduled)."""
        plan = self.policy.after_turn(session_id, tool_call=tool_call, expected_pause_s=expected_pause_s,
                                      own_ttl=own_ttl)
        if plan is None:
            return ttl_s, None
        if plan.demote:
            self.engine.demote_lease(lease_id)
            self.metrics.kv_demotions.inc()
            return 0.0, plan.prefetch_after_s
        self.engine.extend_lease(lease_id, plan.ttl_s)
        return plan.ttl_s, None

    def release(self, lease_id: str, worker: str | None = None) -> None:
        """Let a lease go (``worker``: where it lives behind a router; None: where this process sent it)."""
        self.engine.release_lease(lease_id, worker=worker)

    # ------------------------------------------------------------ affinity-keyed conversations

    def follow(self, conversation: str, lease_id: str) -> None:
        """``lease_id``'s request is ``conversation``'s latest turn: it now holds the prefix, so the
        conversation's previous lease made here is released."""
        previous = self._conversations.pop(conversation, None)
        self._conversations[conversation] = lease_id
        while len(self._conversations) > self.limit:
            self._conversations.popitem(last=False)
        if previous is not None:
            self.release(previous)

    def continues(self, conversation: str) -> bool:
        """Whether ``conversation`` had a leased request here (it already ran a turn)."""
        return conversation in self._conversations

    def conversations(self) -> int:
        return len(self._conversations)

    # ------------------------------------------------------------ sessions

    def session_turn_began(self, session_id: str) -> None:
        """A new turn of the session holds its prefix: its last lease here and a pending read-back are done
        (the caller releases the last turn's lease from the session record, wherever it was made)."""
        self._sessions.pop(session_id, None)
        self._prefetch_at.pop(session_id, None)   # arrived first: its request reads its tier pages itself

    def session_recorded(self, session_id: str, lease_id: str, expires_at: float, worker: str | None,
                         prefetch_after_s: float | None, now: float) -> None:
        """A session turn was recorded with its lease (``prefetch_after_s``: it was demoted; read it back
        that long after ``now``)."""
        self._sessions[session_id] = (lease_id, expires_at)
        if prefetch_after_s is not None:
            self._prefetch_at[session_id] = (now + prefetch_after_s, lease_id, worker)

    def session_ended(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._prefetch_at.pop(session_id, None)

    def session_holds(self, session_id: str, lease_id: str, now: float) -> bool:
        """Whether ``lease_id`` is the session's lease made here and not yet expired."""
        held = self._sessions.get(session_id)
        return held is not None and held[0] == lease_id and held[1] > now

    def sweep(self, now: float) -> None:
        """Read back the demoted leases that are due, and forget expired session leases."""
        for sid, (when, lease_id, worker) in list(self._prefetch_at.items()):
            if when <= now:
                del self._prefetch_at[sid]
                self.engine.prefetch_lease(lease_id, worker=worker)
                self.metrics.kv_prefetches.inc()
        for sid, (_, expires) in list(self._sessions.items()):
            if expires <= now:
                del self._sessions[sid]
