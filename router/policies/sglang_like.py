"""A faithful re-implementation of SGLang's router ``cache_aware`` policy, as a baseline.

Algorithm (sgl-router, ``cache_aware``):

* The router keeps, per worker, an *approximate* prefix tree of the requests it sent
  there. It never hears from the worker's real cache: it assumes whatever it routed is
  cached, and forgets only by trimming each tree (LRU) to ``max_tree_size``.
* Load is the router's own in-flight request count per worker (incremented on
  dispatch, decremented on completion).
* The system is *imbalanced* when both ``max_load - min_load > balance_abs_threshold``
  and ``max_load > balance_rel_threshold * min_load``. Then the request goes to the
  least-loaded worker (shortest queue) and cache is ignored.
* Otherwise the worker whose tree matches the longest prefix wins if
  ``matched / prompt_length > cache_threshold``; if no worker matches that well, the
  request goes to the worker with the smallest tree (most apparent free cache).
* Either way, the request's prefix is inserted into the chosen worker's tree.

Settings (SGLang defaults): ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
``balance_rel_threshold`` 1.5, ``max_tree_size`` 2**26 (SGLang counts characters; we
count tokens). SGLang's tree is keyed on characters of the raw text; ours is keyed on
contract-1 block hashes (a token-level tree at block granularity: because block hashes
chain, a prefix path in the tree is exactly a run of hashes, so a per-worker LRU set of
hashes is that tree). SGLang trims trees every 60 s; we trim on insert, which only makes
the approximation a little fresher.
"""

from __future__ import annotations

from collections import OrderedDict

from router.policy import RouteDecision, RouteRequest, RoutingPolicy, WorkerState, require_workers


class _ApproxTree:
    """Block hashes a router believes one worker holds, in LRU order."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: tuple[int, ...]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: tuple[int, ...]) -> None:
        for h in reversed(hashes):  # the root ends most recent, so trimming drops leaves first
            self.blocks[h] = None
            self.blocks.move_to_end(h)

    def trim(self, max_blocks: int) -> None:
        while len(self.blocks) > max_blocks:
            self.blocks.popitem(last=False)


class SGLangLikePolicy(RoutingPolicy):
    name = "sglang_like"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 2 ** 26) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if max_tree_size <= 0:
            raise ValueError(f"max_tree_size must be positive, got {max_tree_size}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self._trees: dict[str, _ApproxTree] = {}
        self._load: dict[str, int] = {}

    def select(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        require_workers(workers)
        loads = {w.worker_id: self._load.get(w.worker_id, 0) for w in workers}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            wid = min(loads, key=lambda k: (loads[k], k))
            return RouteDecision(wid, self._match(wid, request), "balance")
        best, best_n = None, -1
        for w in sorted(workers, key=lambda w: w.worker_id):
            n = self._match(w.worker_id, request)
            if n > best_n:
                best, best_n = w.worker_id, n
        ratio = min(best_n * request.block_size, request.num_tokens) / max(request.num_tokens, 1)
        if ratio > self.cache_threshold:
            return RouteDecision(best, best_n, "cache")
        wid = min(loads, key=lambda k: (len(self._tree(k).blocks), k))
        return RouteDecision(wid, self._match(wid, request), "smallest_tree")

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        tree = self._tree(decision.worker_id)
        tree.insert(request.hashes)
        tree.trim(max(1, self.max_tree_size // request.block_size))
        self._load[decision.worker_id] = self._load.get(decision.worker_id, 0) + 1

    def on_complete(self, request: RouteRequest, worker_id: str) -> None:
        if self._load.get(worker_id, 0) > 0:
            self._load[worker_id] -= 1

    def on_worker_removed(self, worker_id: str) -> None:
        self._trees.pop(worker_id, None)
        self._load.pop(worker_id, None)

    def _tree(self, worker_id: str) -> _ApproxTree:
        return self._trees.setdefault(worker_id, _ApproxTree())

    def _match(self, worker_id: str, request: RouteRequest) -> int:
        tree = self._trees.get(worker_id)
        return tree.match(request.hashes) if tree else 0
