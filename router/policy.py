"""Routing policy interface and registry.

One policy object serves one router replica (live, phase 2) or one simulated run
(benchmarks/routing.py): the same classes, fed the same types. The caller builds a
``RouteRequest`` (contract-1 block hashes of the prompt), asks the prefix index for each
live worker's cached prefix length, builds one ``WorkerState`` per live worker, and calls
``select``. It then calls ``on_dispatch`` once the request is sent and ``on_complete``
when it finishes (or fails), so stateful policies can track what they routed.

A fleet of hundreds of workers makes that list the cost of a decision, so a caller may instead keep
a ``Fleet`` (``new_fleet``: each live worker's load state, updated when a load report, a dispatch or a
completion changes it) and call ``select_fleet`` with the index's answer: the same decision, and a
policy that knows how (``agentrt``) reads only a few workers (docs/routing.md, "Scale").

Implementations are registered by name and imported lazily (``make_policy``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Iterator, Mapping, NamedTuple, Sequence


class NoWorkerAvailable(RuntimeError):
    """``select`` was called with no live worker."""


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about one request.

    ``hashes`` are the contract-1 hashes of the prompt's full blocks, ``num_tokens`` the
    prompt length, ``block_size`` tokens per block. ``session_id`` and ``last_worker``
    come from the session record, or for a conversation its client names by an affinity key
    from that key (tenant-scoped) and its mapping in Redis (``None`` for other requests).
    ``est_output_tokens`` is the router's guess of the reply length (``max_tokens``).
    ``known_blocks``: the longest prefix of ``hashes`` some worker is *known* to hold (the index,
    from KV events), when the workers' ``cached_blocks`` also count tentative entries (blocks
    dispatched, not yet reported); ``None`` when they do not (every match is known).
    """

    request_id: str
    hashes: tuple[int, ...]
    num_tokens: int
    block_size: int
    session_id: str | None = None
    last_worker: str | None = None
    est_output_tokens: int = 0
    known_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_tokens < 0 or self.est_output_tokens < 0:
            raise ValueError("num_tokens and est_output_tokens must be >= 0")
        if self.known_blocks is not None and not 0 <= self.known_blocks <= len(self.hashes):
            raise ValueError(f"known_blocks must be in [0, {len(self.hashes)}], got {self.known_blocks}")


class WorkerState(NamedTuple):
    """One live worker as the policy sees it at decision time.

    ``cached_blocks``: the longest prefix of ``request.hashes`` the prefix index says the
    worker holds. ``running``/``waiting``/``pages_used``/``pages_free``: the worker's last
    load report (may be a few hundred ms stale). ``in_flight``: requests this router
    replica sent and has not seen finish; ``in_flight_tokens``: this router's estimate of
    the work they still represent, in prefill-token equivalents (see ``InFlightTracker``).
    ``host_blocks``/``disk_blocks``: of the ``cached_blocks``, those the worker holds only in a KV
    tier below its device pool (contract 2's ``medium``): a hit that costs a load, not a recompute.

    A ``NamedTuple`` rather than a frozen dataclass: the router builds one per live worker for every
    decision, and a tuple is built three times faster (immutable all the same; docs/routing.md "Scale").
    """

    worker_id: str
    cached_blocks: int = 0
    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_free: int = 0
    in_flight: int = 0
    in_flight_tokens: float = 0.0
    host_blocks: int = 0
    disk_blocks: int = 0

    def cached_tokens(self, request: RouteRequest) -> int:
        return min(self.cached_blocks * request.block_size, request.num_tokens)

    @property
    def queue(self) -> int:
        """Requests on the worker: the larger of its report and this router's own count."""
        return max(self.running + self.waiting, self.in_flight)


_make_state = WorkerState._make


@dataclass(frozen=True)
class RouteDecision:
    """The chosen worker, how many prompt blocks it is believed to hold, and why (for logs)."""

    worker_id: str
    cached_blocks: int
    reason: str


class RoutingPolicy:
    """Base class. ``select`` must return one of ``workers``; hooks default to no-ops.

    Contract: ``select`` never mutates its arguments and raises ``NoWorkerAvailable`` on
    an empty list; policies that learn from their own decisions do so in ``on_dispatch``
    (called with the decision actually used), never in ``select``.
    """

    name = "base"

    def select(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        raise NotImplementedError

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        """The request was sent to ``decision.worker_id``."""

    def on_complete(self, request: RouteRequest, worker_id: str) -> None:
        """The request finished on (or failed at) ``worker_id``."""

    def on_worker_removed(self, worker_id: str) -> None:
        """The worker left or died; forget anything about it."""

    def new_fleet(self) -> Fleet | None:
        """A ``Fleet`` this policy can decide on without a ``WorkerState`` per worker per decision
        (``select_fleet``), or None: the caller then builds the list and calls ``select``."""
        return None

    def select_fleet(self, request: RouteRequest, fleet: Fleet, matched: Mapping[str, int],
                     tiers: Mapping[str, tuple[int, int]] | None = None,
                     levels: Sequence[tuple[int, Sequence[str]]] | None = None
                     ) -> tuple[RouteDecision, list[WorkerState]]:
        """The decision ``select`` would make on every worker of ``fleet`` with its state, its
        ``cached_blocks`` from ``matched`` (the prefix index's answer: workers absent hold 0) and,
        for a matched worker in ``tiers``, its ``(host_blocks, disk_blocks)``; with the states it
        weighed. ``levels`` is ``matched`` grouped by length (``PrefixIndex.match_levels``), if the
        caller has it. This default does exactly that; a policy with a faster path overrides it and
        must decide the same."""
        tiers = tiers or {}
        states = [fleet.state(wid, matched.get(wid, 0), tiers.get(wid)) for wid in fleet]
        return self.select(request, states), states


class Fleet:
    """The live workers' states as a policy sees them, less the per-request part (``cached_blocks``,
    tiers): kept up to date by the router as load reports, dispatches and completions arrive, so a
    decision reads it instead of building one ``WorkerState`` per worker (docs/routing.md "Scale").
    This base keeps a dict; a policy's subclass (``AgentrtFleet``) keeps its own orderings too."""

    def __init__(self) -> None:
        self._states: dict[str, WorkerState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._states

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def update(self, state: WorkerState) -> None:
        """Add ``state.worker_id`` or replace its state (its ``cached_blocks`` and tiers are ignored)."""
        if state.cached_blocks or state.host_blocks or state.disk_blocks:
            state = state._replace(cached_blocks=0, host_blocks=0, disk_blocks=0)
        self._states[state.worker_id] = state

    def remove(self, worker_id: str) -> None:
        self._states.pop(worker_id, None)

    def state(self, worker_id: str, cached_blocks: int = 0, tiers: tuple[int, int] | None = None) -> WorkerState:
        """The worker's state for one request: its load state with ``cached_blocks`` and, if it holds
        any, its ``(host_blocks, disk_blocks)``."""
        state = self._states[worker_id]
        if not cached_blocks:
            return state
        host, disk = tiers or (0, 0)
        return _make_state((worker_id, cached_blocks, *state[2:8], host, disk))  # (``_replace``: 4x slower)


def require_workers(workers: list[WorkerState]) -> None:
    if not workers:
        raise NoWorkerAvailable("no live worker to route to")


def least_loaded(workers: list[WorkerState]) -> WorkerState:
    """Fewest queued requests, then least in-flight work, then id (deterministic)."""
    return min(workers, key=lambda w: (w.queue, w.in_flight_tokens, w.worker_id))


_REGISTRY: dict[str, str] = {
    "round_robin": "router.policies.round_robin:RoundRobinPolicy",
    "least_load": "router.policies.least_load:LeastLoadPolicy",
    "session_hash": "router.policies.session_hash:SessionHashPolicy",
    "sglang_like": "router.policies.sglang_like:SGLangLikePolicy",
    "agentrt": "router.policies.agentrt:AgentrtPolicy",
}


def policy_names() -> list[str]:
    return list(_REGISTRY)


def register_policy(name: str, target: str) -> None:
    """Register ``"module:Class"`` under ``name`` (imported on first use)."""
    if ":" not in target:
        raise ValueError(f"policy target must be 'module:Class', got {target!r}")
    _REGISTRY[name] = target


def make_policy(name: str, **options) -> RoutingPolicy:
    """A new policy instance; ``options`` are the class's keyword arguments."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(_REGISTRY)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**options)
