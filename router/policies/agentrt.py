"""agentrt's policy: cost = uncached prefill tokens + load, with soft affinity and spill.

For every live worker ``w`` (all quantities in prefill-token equivalents):

    cost(w) = (prompt_tokens - cached_tokens(w)) + host_load_weight * host_tokens(w)
              + disk_load_weight * disk_tokens(w) + load_weight * load(w)

``cached_tokens`` comes from the global prefix index (exact: built from the workers' KV
events, contract 2); it counts blocks in the worker's KV tiers too, and ``host_tokens`` /
``disk_tokens`` are the part of it that must be loaded back from a tier (docs/routing.md
explains the weights: a load costs more than a device hit, far less than a recompute). ``load(w)`` is the larger of the router's own in-flight work on
``w`` and the worker's reported queue times ``tokens_per_queued_request`` (which covers
requests other router replicas sent). ``load_weight`` (default 0.1) prices a queued
token at a tenth of a prefill token: a queue drains in seconds, while a session moved
off its prefix loses that prefix for every later turn and duplicates it in a second
cache. Balance comes mainly from the overload bound and from placing new prefixes on
the least-loaded worker (ties rotate, so idle workers share new sessions evenly).

Rules, in order:

1. **Overload bound.** ``w`` is overloaded when
   ``load(w) > max(overload_rel * mean_load, mean_load + overload_abs_tokens)``
   (default 131072 tokens: ~13 s of queued prefill on a 10k tok/s GPU).
   Overloaded workers are skipped unless every worker is overloaded.
2. **Soft session affinity.** The session's last worker wins if it still holds at least
   ``affinity_min_fraction`` of the best cached prefix any worker has, and is not
   overloaded. When no worker is known to hold any of the prompt (the index may lag the
   last turn's KV events by a few ms), the last worker is still the best guess.
3. **Short match fallback.** If no worker holds more than
   ``min(min_match_tokens, min_match_fraction * prompt_tokens)`` of the prompt beyond what
   every worker holds (e.g. only a system prompt everyone has), the
   request goes to the least-loaded worker (equal loads: rotating); its prefix is recorded there through the
   worker's KV events, so affinity builds up.
4. Otherwise the cheapest worker by ``cost``. When the best match is only *tentative* (a prompt
   dispatched moments ago and still queued or being computed there, no worker has reported it
   yet: a burst of new sessions sharing an agent prompt), the load is priced at
   ``tentative_load_weight`` (default 0.5) instead: the holder has not computed the prefix, a
   request sent there waits behind that prefill and the queue after it, and going elsewhere costs
   one extra computation of a shared prompt, not the session's history. Half weight, not full: the
   extra prefill also delays the requests queued behind it on the other worker. So a burst spreads
   once the holder's queue is well past the recompute, and once the prefix is reported (the index
   knows it) affinity is priced as before.

A hot shared prefix (one fleet's long tools prompt) thus stays on its holder while the
holder's load is within the bound and spills to the next-cheapest worker (which then
holds it too) as soon as it exceeds it, instead of piling up on one worker.

``select`` applies the rules to a ``WorkerState`` per worker; the router decides through
``select_fleet`` on an ``AgentrtFleet`` it keeps up to date, which reaches the same decision
reading a few workers (docs/routing.md, "Scale"); ``select`` is its reference in the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from bisect import bisect_left, bisect_right, insort
from operator import itemgetter
from typing import Mapping, Sequence

from router.policy import (Fleet, NoWorkerAvailable, RouteDecision, RouteRequest, RoutingPolicy, WorkerState,
                           require_workers)

_first = itemgetter(0)
# (cached tokens, k, host blocks, disk blocks, members or None for the unmatched, live members)
_Group = tuple[int, int, int, int, "list[str] | None", int]
_ONE = 1 << 1074  # every finite float is a whole number of 2**-1074


def _units(x: float) -> int:
    """``x`` exactly, in units of 2**-1074 (so sums of them are exact)."""
    num, den = float(x).as_integer_ratio()
    return num << (1075 - den.bit_length())  # den is a power of two, at most 2**1074


@dataclass(eq=False)
class AgentrtPolicy(RoutingPolicy):
    name = "agentrt"

    load_weight: float = 0.1
    overload_rel: float = 1.5
    overload_abs_tokens: float = 131072.0
    affinity_min_fraction: float = 0.9
    min_match_tokens: int = 1024
    tokens_per_queued_request: float = 4096.0
    min_match_fraction: float = 0.25
    recent_work_half_life: int = 2000
    decode_token_weight: float = 10.0
    host_load_weight: float = 0.01
    disk_load_weight: float = 0.05
    tentative_load_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.load_weight < 0 or self.overload_abs_tokens < 0 or self.min_match_tokens < 0 or \
                self.tentative_load_weight < 0:
            raise ValueError("load_weight, tentative_load_weight, overload_abs_tokens and min_match_tokens "
                             "must be >= 0")
        if self.overload_rel < 1.0:
            raise ValueError(f"overload_rel must be >= 1, got {self.overload_rel}")
        if not 0.0 <= self.affinity_min_fraction <= 1.0:
            raise ValueError(f"affinity_min_fraction must be in [0, 1], got {self.affinity_min_fraction}")
        if not 0.0 <= self.host_load_weight <= self.disk_load_weight <= 1.0:
            raise ValueError(f"need 0 <= host_load_weight <= disk_load_weight <= 1 (a load costs no more than a "
                             f"recompute), got {self.host_load_weight} and {self.disk_load_weight}")
        if self.tokens_per_queued_request < 0:
            raise ValueError("tokens_per_queued_request must be >= 0")
        if not 0.0 <= self.min_match_fraction <= 1.0:
            raise ValueError(f"min_match_fraction must be in [0, 1], got {self.min_match_fraction}")
        if self.recent_work_half_life < 0 or self.decode_token_weight < 0:
            raise ValueError("recent_work_half_life and decode_token_weight must be >= 0")
        # Work this policy dispatched to each worker, decayed per dispatch (half-life in dispatches),
        # kept in units of ``_scale``: a dispatch grows the scale instead of decaying every entry.
        self._work: dict[str, float] = {}
        self._scale = 1.0
        self._decay = 0.5 ** (1.0 / self.recent_work_half_life) if self.recent_work_half_life else 1.0
        self._turn = 0  # rotates ties among equally loaded workers
        self._fleet: AgentrtFleet | None = None  # told when ``_work`` changes (its orderings use it)

    def load(self, w: WorkerState) -> float:
        return max(w.in_flight_tokens, (w.running + w.waiting) * self.tokens_per_queued_request)

    def select(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        """The decision over every worker of ``workers``, O(workers): the reference ``select_fleet``
        (the router's path, on a kept ``AgentrtFleet``) must agree with."""
        require_workers(workers)
        # ``load`` and ``WorkerState.cached_tokens`` inlined: this runs once per live worker per decision.
        tpq = self.tokens_per_queued_request
        load = {w.worker_id: max(w.in_flight_tokens, (w.running + w.waiting) * tpq) for w in workers}
        # fsum: the exactly rounded sum, whatever the workers' order (``AgentrtFleet`` keeps it exactly)
        mean = math.fsum(load.values()) / len(load)
        bound = max(self.overload_rel * mean, mean + self.overload_abs_tokens)
        ok = [w for w in workers if load[w.worker_id] <= bound] or list(workers)
        bs, n = request.block_size, request.num_tokens
        cached = {w.worker_id: min(w.cached_blocks * bs, n) for w in workers}
        best = max(cached.values())

        last = next((w for w in ok if w.worker_id == request.last_worker), None)
        if last is not None and cached[last.worker_id] >= self.affinity_min_fraction * best:
            return RouteDecision(last.worker_id, last.cached_blocks, "affinity")

        common = min(cached.values())
        short = min(self.min_match_tokens, self.min_match_fraction * request.num_tokens)
        if max(cached[w.worker_id] for w in ok) - common <= short:
            return RouteDecision(*self._least_loaded(ok, load), "fallback")

        base, lw = self._base_cost, self._load_weight(request, max(w.cached_blocks for w in workers))
        w = min(ok, key=lambda w: (base(request, cached[w.worker_id], w.host_blocks, w.disk_blocks)
                                   + lw * load[w.worker_id], w.worker_id))
        # (by id: ``h not in ok`` compared dataclasses, O(workers^2) per decision)
        spilled = len(ok) < len(workers) and any(
            cached[h.worker_id] == best for h in workers if load[h.worker_id] > bound)
        reason = "spill" if spilled else ("prefix" if cached[w.worker_id] == best else "cost")
        return RouteDecision(w.worker_id, w.cached_blocks, reason)

    def _load_weight(self, request: RouteRequest, best_blocks: int) -> float:
        """Rule 4's price of a queued token: ``tentative_load_weight`` when the longest match
        (``best_blocks``, tentative entries counted) is longer than any worker is known to hold."""
        if request.known_blocks is not None and best_blocks > request.known_blocks:
            return self.tentative_load_weight
        return self.load_weight

    def _base_cost(self, request: RouteRequest, cached_tokens: int, host_blocks: int, disk_blocks: int) -> float:
        """Rule 4's cost less the load term: ``cost = base + load_weight * load``, evaluated in this order
        by both paths (equal inputs, bit-equal costs)."""
        tiered = (self.host_load_weight * host_blocks + self.disk_load_weight * disk_blocks) * request.block_size
        return request.num_tokens - cached_tokens + tiered

    def new_fleet(self) -> AgentrtFleet:
        """The fleet ``select_fleet`` decides on; one per policy (an earlier one is detached: deciding
        on it takes the default path)."""
        self._fleet = AgentrtFleet(self)
        return self._fleet

    def _within_bound(self, fleet: "AgentrtFleet") -> tuple[float, bool, int]:
        """The overload bound over the fleet's mean load, whether every worker is past it (then ``ok`` is
        all of them), and how many workers of the fleet's (load, id) order are ``ok``."""
        size, by_load = len(fleet._states), fleet._by_load
        if not size:
            raise NoWorkerAvailable("no live worker to route to")
        mean = fleet.load_sum() / size
        bound = max(self.overload_rel * mean, mean + self.overload_abs_tokens)
        none_ok = by_load[0][0] > bound
        return bound, none_ok, size if none_ok else bisect_right(by_load, bound, key=_first)

    @staticmethod
    def _weighed(fleet: "AgentrtFleet", matched: Mapping[str, int], tiered: Mapping[str, tuple[int, int]],
                 ids: Sequence[str | None]) -> list[WorkerState]:
        """The states of the live workers among ``ids`` (the chosen one first), each once."""
        seen: list[str] = []
        for w in ids:
            if w is not None and w not in seen and w in fleet._states:
                seen.append(w)
        return [fleet.state(w, matched.get(w, 0), tiered.get(w)) for w in seen]

    def select_fleet(self, request: RouteRequest, fleet: Fleet, matched: Mapping[str, int],
                     tiers: Mapping[str, tuple[int, int]] | None = None,
                     levels: Sequence[tuple[int, Sequence[str]]] | None = None
                     ) -> tuple[RouteDecision, list[WorkerState]]:
        """``select`` over every worker of ``fleet`` (see ``RoutingPolicy.select_fleet``), reading a few.

        Workers fall into groups that share one cost function: a match length (``levels``) less its
        tiered workers, each tiered worker alone, and the unmatched workers. Within a group the cost
        grows with the load alone, so its best member is its least-loaded one within the overload
        bound (the smallest id among equal costs): found by enumerating a small group, or by walking
        the fleet's (load, id) order until a member turns up, about W / members steps, for a large
        one (typically one group holds the fleet's shared system prompt). Rule 3 takes the
        least-loaded worker, least recent work, then the ``turn``-th by id: a position in the
        fleet's (load, work, id) order. The mean load is the fleet's exact sum, the count within the
        bound a bisection. So a decision costs O(levels x (small group or W / group)) plus one pass
        in C over the matched workers, instead of a ``WorkerState`` and a Python step per worker;
        ``tests/router/test_fleet_policy.py`` checks it against ``select``. Returns the decision and
        the states weighed (each group's best, the session's last worker, the chosen one)."""
        if fleet is not self._fleet:
            return super().select_fleet(request, fleet, matched, tiers, levels)
        assert isinstance(fleet, AgentrtFleet)
        states, loads, size = fleet._states, fleet._loads, len(fleet._states)
        bound, none_ok, n_ok = self._within_bound(fleet)
        tiered = {w: t for w, t in tiers.items() if (t[0] or t[1]) and w in states and matched.get(w, 0) > 0} \
            if tiers else {}
        last = request.last_worker

        def weighed(chosen: str, wins: list[tuple[float, str] | None]) -> list[WorkerState]:
            return self._weighed(fleet, matched, tiered, [chosen] + [w[1] for w in wins if w is not None] + [last])

        groups = self._groups(request, states, matched, tiered, levels)
        best = max([g[0] for g in groups])
        if last is not None and last in states and (none_ok or loads[last] <= bound):
            k = matched.get(last, 0)
            if min(k * request.block_size, request.num_tokens) >= self.affinity_min_fraction * best:
                return RouteDecision(last, k, "affinity"), weighed(last, [])

        common = min([g[0] for g in groups])
        lw = self._load_weight(request, max([g[1] for g in groups]))
        wins = [self._group_best(request, fleet, g, matched, tiered, bound, none_ok, n_ok, lw) for g in groups]
        win, top = None, -1
        for g, w in zip(groups, wins):
            if w is not None:
                top = max(top, g[0])
                if win is None or w < win[0]:
                    win = (w, g)
        assert win is not None  # ``ok`` is never empty
        if top - common <= min(self.min_match_tokens, self.min_match_fraction * request.num_tokens):
            wid = fleet._least_loaded_at(self._turn)
            return RouteDecision(wid, matched.get(wid, 0), "fallback"), weighed(wid, wins)

        wid, c = win[0][1], win[1][0]
        spilled = not none_ok and n_ok < size and any(
            g[0] == best and self._overloaded_in(fleet, g, matched, tiered, bound, n_ok) for g in groups)
        reason = "spill" if spilled else ("prefix" if c == best else "cost")
        return RouteDecision(wid, matched.get(wid, 0), reason), weighed(wid, wins)

    @staticmethod
    def _groups(request: RouteRequest, states: Mapping[str, WorkerState], matched: Mapping[str, int],
                tiered: Mapping[str, tuple[int, int]],
                levels: Sequence[tuple[int, Sequence[str]]] | None) -> list[_Group]:
        """The fleet's workers in groups of one cost function: ``(cached tokens, k, host, disk, members
        or None for the unmatched, how many are live)``; every live worker in exactly one."""
        if levels is None:
            by_k: dict[int, list[str]] = {}
            for wid, k in matched.items():
                by_k.setdefault(k, []).append(wid)
            levels = sorted(by_k.items())
        bs, n = request.block_size, request.num_tokens
        groups: list[_Group] = []
        placed = 0
        for k, wids in levels:
            if k <= 0:
                continue
            live = sum(map(states.__contains__, wids))  # (in C)
            if not live:
                continue
            placed += live
            c = min(k * bs, n)
            if tiered:
                alone = [w for w in wids if w in tiered]
                if alone:
                    wids = [w for w in wids if w not in tiered]
                    live -= len(alone)
                    groups.extend((c, k, *tiered[w], [w], 1) for w in alone)
            if live:
                groups.append((c, k, 0, 0, wids, live))
        if placed < len(states):
            groups.append((0, 0, 0, 0, None, len(states) - placed))
        return groups

    def _group_best(self, request: RouteRequest, fleet: AgentrtFleet, group: _Group, matched: Mapping[str, int],
                    tiered: Mapping[str, tuple[int, int]], bound: float, none_ok: bool,
                    n_ok: int, lw: float) -> tuple[float, str] | None:
        """The group's smallest ``(cost, id)`` among its members within the bound, or None if none is
        (``lw``: the decision's load weight)."""
        c, k, host, disk, members, live = group
        loads, by_load = fleet._loads, fleet._by_load
        base = self._base_cost(request, c, host, disk)
        win: tuple[float, str] | None = None
        if members is not None and (host or disk or _small(live, len(by_load))):  # small (or tiered): each
            for wid in members:
                load = loads.get(wid)
                if load is not None and (none_ok or load <= bound):
                    key = (base + lw * load, wid)
                    if win is None or key < win:
                        win = key
            return win
        # Large: the (load, id) order from the least loaded, until a member, then while costs tie.
        member = _member_test(group, matched, tiered)
        pos = 0
        while pos < n_ok:
            load, wid = by_load[pos]
            if not member(wid):
                pos += 1
                continue
            key = (base + lw * load, wid)
            if win is not None and key[0] > win[0]:
                break  # costs only grow with the load from here
            if win is None or key < win:
                win = key
            pos = bisect_right(by_load, load, lo=pos, key=_first)  # the rest of this load: larger ids
        return win

    @staticmethod
    def _overloaded_in(fleet: AgentrtFleet, group: _Group, matched: Mapping[str, int],
                       tiered: Mapping[str, tuple[int, int]], bound: float, n_ok: int) -> bool:
        """Whether a member of the group is past the bound (the overloaded: the tail of (load, id))."""
        members, live = group[4], group[5]
        tail = fleet._by_load[n_ok:]
        if not tail:
            return False
        if members is not None and (group[2] or group[3] or _small(live, len(fleet._by_load)) or live <= len(tail)):
            loads = fleet._loads
            return any(loads[wid] > bound for wid in members if wid in loads)
        member = _member_test(group, matched, tiered)
        return any(member(wid) for _, wid in tail)

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        if decision.reason == "fallback":
            self._turn += 1
        if not self.recent_work_half_life:
            return
        work = (max(0, request.num_tokens - decision.cached_blocks * request.block_size)
                + self.decode_token_weight * request.est_output_tokens)
        self._scale /= self._decay
        self._work[decision.worker_id] = self._work.get(decision.worker_id, 0.0) + work * self._scale
        if self._scale > 1e200:  # renormalise long before floats overflow
            self._work = {w: v / self._scale for w, v in self._work.items()}
            self._scale = 1.0
            if self._fleet is not None:
                self._fleet._reindex_work()
        elif self._fleet is not None:
            self._fleet._work_changed(decision.worker_id)

    def on_worker_removed(self, worker_id: str) -> None:
        self._work.pop(worker_id, None)
        if self._fleet is not None:
            self._fleet._work_changed(worker_id)

    def recent_work(self, worker_id: str) -> float:
        """Work dispatched to ``worker_id`` lately (prefill-token equivalents, decayed)."""
        return self._work.get(worker_id, 0.0) / self._scale

    def _least_loaded(self, ok: list[WorkerState], load: dict[str, float]) -> tuple[str, int]:
        """Least loaded; among equal loads (typically: idle) the one this policy sent the least
        work lately, then rotating. In a large, mostly idle fleet nearly every worker ties at load
        0, and rotation alone places new sessions as if at random: per-worker work then spreads
        like balls in bins (max/mean 1.26 at 64 workers on the trace, docs/routing.md "Scale")."""
        lowest = min(load[w.worker_id] for w in ok)
        tied = [w for w in ok if load[w.worker_id] == lowest]
        if len(tied) > 1 and self._work:
            work = self._work
            least = min(work.get(w.worker_id, 0.0) for w in tied)
            tied = [w for w in tied if work.get(w.worker_id, 0.0) == least]
        tied.sort(key=lambda w: w.worker_id)
        w = tied[self._turn % len(tied)]
        return w.worker_id, w.cached_blocks


def _small(live: int, size: int) -> bool:
    """Whether to read a group's members one by one rather than walk the fleet's load order for them
    (which takes about size / live steps)."""
    return live <= 16 or live * live <= size


def _member_test(group: _Group, matched: Mapping[str, int], tiered: Mapping[str, tuple[int, int]]):
    """Membership of a large group (a match level less its tiered workers, or the unmatched)."""
    k = group[1]
    if group[4] is None:
        return lambda wid: matched.get(wid, 0) <= 0
    return lambda wid: matched.get(wid) == k and wid not in tiered


class AgentrtFleet(Fleet):
    """The live workers for ``AgentrtPolicy.select_fleet``: each one's state and load, the loads' exact
    sum, and two orderings kept sorted as states change (bisect + list insert: O(log W) comparisons and
    a memmove): (load, id) for rule 4's cheapest unmatched worker and the overload bound's count,
    (load, recent work, id) for rule 3's least-loaded worker. The router calls ``update`` on a load
    report, a dispatch and a completion, ``remove`` when a worker leaves; the policy reorders the
    second when its recent work changes (``on_dispatch``). Loads must be numbers, not NaN."""

    def __init__(self, policy: AgentrtPolicy) -> None:
        super().__init__()
        self._policy = policy
        self._loads: dict[str, float] = {}
        self._work: dict[str, float] = {}   # worker -> the recent work in its (load, work, id) key
        self._by_load: list[tuple[float, str]] = []
        self._by_idle: list[tuple[float, float, str]] = []
        self._units = 0                      # the sum of the loads, exact (``_units``)
        self._sum: float | None = 0.0        # ``_units`` rounded to a float (None: to compute)

    def update(self, state: WorkerState) -> None:
        if state.cached_blocks or state.host_blocks or state.disk_blocks:
            state = state._replace(cached_blocks=0, host_blocks=0, disk_blocks=0)
        wid = state.worker_id
        old = self._states.get(wid)
        if old == state:
            return
        self._states[wid] = state
        load = self._policy.load(state)
        if old is not None:
            if self._loads[wid] == load:
                return
            self._unlink(wid)
        work = self._policy._work.get(wid, 0.0)
        self._loads[wid], self._work[wid] = load, work
        insort(self._by_load, (load, wid))
        insort(self._by_idle, (load, work, wid))
        self._units += _units(load)
        self._sum = None

    def remove(self, worker_id: str) -> None:
        if self._states.pop(worker_id, None) is not None:
            self._unlink(worker_id)
            del self._loads[worker_id], self._work[worker_id]

    def _unlink(self, wid: str) -> None:
        load, work = self._loads[wid], self._work[wid]
        del self._by_load[bisect_left(self._by_load, (load, wid))]
        del self._by_idle[bisect_left(self._by_idle, (load, work, wid))]
        self._units -= _units(load)
        self._sum = None

    def load_sum(self) -> float:
        """The exactly rounded sum of the loads (``math.fsum`` of them, in O(1))."""
        if self._sum is None:
            self._sum = self._units / _ONE
        return self._sum

    def _work_changed(self, wid: str) -> None:
        old = self._work.get(wid)
        if old is None:
            return
        work = self._policy._work.get(wid, 0.0)
        if work != old:
            load = self._loads[wid]
            del self._by_idle[bisect_left(self._by_idle, (load, old, wid))]
            insort(self._by_idle, (load, work, wid))
            self._work[wid] = work

    def _reindex_work(self) -> None:
        work = self._policy._work
        self._work = {wid: work.get(wid, 0.0) for wid in self._states}
        self._by_idle = sorted((self._loads[wid], w, wid) for wid, w in self._work.items())

    def _least_loaded_at(self, turn: int) -> str:
        """Rule 3's pick: of the workers with the lowest load and, among them, the least recent work
        (a run at the head of the (load, work, id) order), the ``turn``-th by id."""
        idle = self._by_idle
        load, work, _ = idle[0]
        tied = bisect_left(idle, (load, math.nextafter(work, math.inf)))
        return idle[turn % tied][2]
