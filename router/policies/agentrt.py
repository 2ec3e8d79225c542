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
4. Otherwise the cheapest worker by ``cost``.

A hot shared prefix (one fleet's long tools prompt) thus stays on its holder while the
holder's load is within the bound and spills to the next-cheapest worker (which then
holds it too) as soon as it exceeds it, instead of piling up on one worker.
"""

from __future__ import annotations

from router.policy import RouteDecision, RouteRequest, RoutingPolicy, WorkerState, require_workers


class AgentrtPolicy(RoutingPolicy):
    name = "agentrt"

    def __init__(self, load_weight: float = 0.1, overload_rel: float = 1.5,
                 overload_abs_tokens: float = 131072.0, affinity_min_fraction: float = 0.9,
                 min_match_tokens: int = 1024, tokens_per_queued_request: float = 4096.0,
                 min_match_fraction: float = 0.25, recent_work_half_life: int = 2000,
                 decode_token_weight: float = 10.0, host_load_weight: float = 0.01,
                 disk_load_weight: float = 0.05) -> None:
        if load_weight < 0 or overload_abs_tokens < 0 or min_match_tokens < 0:
            raise ValueError("load_weight, overload_abs_tokens and min_match_tokens must be >= 0")
        if overload_rel < 1.0:
            raise ValueError(f"overload_rel must be >= 1, got {overload_rel}")
        if not 0.0 <= affinity_min_fraction <= 1.0:
            raise ValueError(f"affinity_min_fraction must be in [0, 1], got {affinity_min_fraction}")
        if not 0.0 <= host_load_weight <= disk_load_weight <= 1.0:
            raise ValueError(f"need 0 <= host_load_weight <= disk_load_weight <= 1 (a load costs no more than a "
                             f"recompute), got {host_load_weight} and {disk_load_weight}")
        self.host_load_weight = host_load_weight
        self.disk_load_weight = disk_load_weight
        if tokens_per_queued_request < 0:
            raise ValueError("tokens_per_queued_request must be >= 0")
        if not 0.0 <= min_match_fraction <= 1.0:
            raise ValueError(f"min_match_fraction must be in [0, 1], got {min_match_fraction}")
        if recent_work_half_life < 0 or decode_token_weight < 0:
            raise ValueError("recent_work_half_life and decode_token_weight must be >= 0")
        self.min_match_fraction = min_match_fraction
        self.recent_work_half_life = recent_work_half_life
        self.decode_token_weight = decode_token_weight
        # Work this policy dispatched to each worker, decayed per dispatch (half-life in dispatches),
        # kept in units of ``_scale``: a dispatch grows the scale instead of decaying every entry.
        self._work: dict[str, float] = {}
        self._scale = 1.0
        self._decay = 0.5 ** (1.0 / recent_work_half_life) if recent_work_half_life else 1.0
        self.load_weight = load_weight
        self.overload_rel = overload_rel
        self.overload_abs_tokens = overload_abs_tokens
        self.affinity_min_fraction = affinity_min_fraction
        self.min_match_tokens = min_match_tokens
        self.tokens_per_queued_request = tokens_per_queued_request
        self._turn = 0  # rotates ties among equally loaded workers

    def load(self, w: WorkerState) -> float:
        return max(w.in_flight_tokens, (w.running + w.waiting) * self.tokens_per_queued_request)

    def select(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        require_workers(workers)
        # ``load`` and ``WorkerState.cached_tokens`` inlined: this runs once per live worker per decision.
        tpq = self.tokens_per_queued_request
        load = {w.worker_id: max(w.in_flight_tokens, (w.running + w.waiting) * tpq) for w in workers}
        mean = sum(load.values()) / len(load)
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

        def cost(w: WorkerState) -> tuple[float, str]:
            tiered = (self.host_load_weight * w.host_blocks + self.disk_load_weight * w.disk_blocks) \
                * request.block_size
            return (request.num_tokens - cached[w.worker_id] + tiered + self.load_weight * load[w.worker_id],
                    w.worker_id)

        w = min(ok, key=cost)
        # (by id: ``h not in ok`` compared dataclasses, O(workers^2) per decision)
        spilled = len(ok) < len(workers) and any(
            cached[h.worker_id] == best for h in workers if load[h.worker_id] > bound)
        reason = "spill" if spilled else ("prefix" if cached[w.worker_id] == best else "cost")
        return RouteDecision(w.worker_id, w.cached_blocks, reason)

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

    def on_worker_removed(self, worker_id: str) -> None:
        self._work.pop(worker_id, None)

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
