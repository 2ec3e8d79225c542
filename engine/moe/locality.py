"""``locality``: put experts that fire together, and the tokens that use them, on one rank.

The dispatcher sends a token once per destination rank, so the bytes a layout costs
are the distinct remote ranks per token. We minimise the expected sends per token
(``cost.py``: off-rank + ``node_weight`` x off-node) under a rank-load cap, then serve
each token from the replica on its own rank, else its node (``locality`` policy).

1. Greedy co-activation clustering: experts in decreasing load; each goes to the rank
   with a free slot and room under the cap that gains most: pairs from that rank (and,
   weighted, from its node) that become local, plus co-activations with the experts
   already there that stop needing a second send.
2. Replicate hot experts within their node: each redundant slot gets the (expert, rank)
   among the hottest experts and the free slots of nodes already holding the expert
   that lowers the objective most (replicas also relieve load).
3. Iterated local search: descend over every slot swap between ranks and every replica
   re-target (seeded random order) to a local optimum, then kick it with a few random
   swaps and descend again, keeping improvements, until the evaluation budget ends;
   deterministic for given stats.
Steps 1-3 run from the greedy layout and from the EPLB layout; the better result wins,
so the plan is never worse than ``balanced`` by this objective.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.moe.config import Topology
from engine.moe.cost import load_from_fractions, replica_counts, routing_fractions, sends_per_token
from engine.moe.eplb import eplb_phy2log
from engine.moe.placement import Placement
from engine.moe.stats import ExpertStats


class _Objective:
    """Expected sends per token plus a steep penalty for rank load above the cap."""

    def __init__(self, stats: ExpertStats, topology: Topology, load_cap: float, node_weight: float,
                 max_sample: int = 2048):
        self.stats = _subsample(stats, max_sample)
        self.source = stats.source.numpy()
        self.topology, self.cap, self.node_weight = topology, load_cap, node_weight
        self.e, self.r = self.source.shape[1], topology.world_size

    def __call__(self, phy2log: np.ndarray) -> float:
        d = routing_fractions(replica_counts(phy2log, self.e, self.r), self.topology, "locality")
        load = load_from_fractions(d, self.source)
        ratio = load.max() / max(load.mean(), 1e-12)
        off_rank, off_node = sends_per_token(d, self.stats, self.topology)
        return off_rank + self.node_weight * off_node + 100.0 * max(0.0, ratio - self.cap)


def _subsample(stats: ExpertStats, n: int) -> ExpertStats:
    """``stats`` with at most ``n`` sampled tokens (evenly spaced, deterministic)."""
    if stats.sample_ids is None or len(stats.sample_ids) <= n:
        return stats
    keep = torch.linspace(0, len(stats.sample_ids) - 1, n).long()
    return ExpertStats(stats.source, stats.coact, stats.tokens, stats.sample_ids[keep], stats.sample_src[keep])


class LocalityPlacement(Placement):
    """Co-activation clustering under a load cap, source-rank affinity, hot replicas within
    nodes, same-rank-then-same-node replica choice."""

    name = "locality"
    replica_policy = "locality"

    def __init__(self, num_redundant: int = 0, load_cap: float = 1.15, node_weight: float = 1.0,
                 max_evals: int = 6000, kick_swaps: int = 4, seed: int = 0):
        super().__init__(num_redundant)
        if load_cap < 1.0:
            raise ValueError(f"load_cap is a max/mean ratio and must be >= 1, got {load_cap}")
        if node_weight < 0 or max_evals < 0:
            raise ValueError("node_weight and max_evals must be >= 0")
        self.load_cap, self.node_weight, self.max_evals, self.seed = load_cap, node_weight, max_evals, seed
        self.kick_swaps = kick_swaps

    def fit_phy2log(self, stats: ExpertStats, topology: Topology) -> torch.Tensor:
        s = self.slots_per_rank(stats.num_experts, topology)
        obj = _Objective(stats, topology, self.load_cap, self.node_weight)
        load = stats.load.numpy() + 1e-9
        starts = [self._replicate(self._cluster(stats, topology, s), obj, s),
                  eplb_phy2log(load, s * topology.world_size, topology)]
        results = [self._search(p, obj, s) for p in starts]
        return torch.from_numpy(min(results, key=obj))

    def score(self, layer, stats: ExpertStats) -> float:
        """Expected sends per token; load is only penalised above the cap + 0.1, so that
        sampling noise in the load does not decide a rebalance."""
        obj = _Objective(stats, layer.topology, self.load_cap + 0.1, self.node_weight)
        return obj(layer.phy2log.numpy())

    def _cluster(self, stats: ExpertStats, topology: Topology, s: int) -> list[list[int]]:
        """Step 1: one replica of every expert, greedily clustered. Returns experts per rank."""
        src, coact = stats.source.numpy(), stats.coact.numpy()
        load = src.sum(0)
        r, rpn = topology.world_size, topology.ranks_per_node
        share = src / np.maximum(load, 1e-30)  # (R, E)
        node_src = np.stack([src[(i // rpn) * rpn:(i // rpn + 1) * rpn].sum(0) for i in range(r)])  # (R, E)
        node_share = node_src / np.maximum(load, 1e-30)
        cap = self.load_cap * load.sum() / r
        ranks: list[list[int]] = [[] for _ in range(r)]
        rank_load = np.zeros(r)
        for e in np.argsort(-load, kind="stable"):
            free = [i for i in range(r) if len(ranks[i]) < s]
            fits = [i for i in free if rank_load[i] + load[e] <= cap] or [min(free, key=lambda i: rank_load[i])]

            def gain(i: int) -> float:
                together = 0.0
                for f in ranks[i]:
                    saved = (1 - 0.5 * (share[i, e] + share[i, f])) + self.node_weight * (1 - 0.5 * (node_share[i, e] + node_share[i, f]))
                    together += coact[e, f] * saved
                return src[i, e] + self.node_weight * node_src[i, e] + together - 1e-9 * rank_load[i]

            best = max(fits, key=gain)
            ranks[best].append(int(e))
            rank_load[best] += load[e]
        return ranks

    def _replicate(self, ranks: list[list[int]], obj: _Objective, s: int) -> np.ndarray:
        """Step 2: fill the free slots with replicas of hot experts, inside their nodes first."""
        rpn = obj.topology.ranks_per_node
        load = obj.source.sum(0)
        while any(len(x) < s for x in ranks):
            count = np.bincount(np.concatenate([np.array(x, dtype=np.int64) for x in ranks]), minlength=obj.e)
            hot = np.argsort(-(load / count), kind="stable")[: 2 * obj.r]
            best, best_f = None, np.inf
            for e in hot:
                nodes = {i // rpn for i in range(obj.r) if e in ranks[i]}
                free = [i for i in range(obj.r) if len(ranks[i]) < s and e not in ranks[i]]
                near = [i for i in free if i // rpn in nodes] or free
                for i in near:
                    trial = [x + [int(e)] if j == i else x for j, x in enumerate(ranks)]
                    f = obj(_flatten(trial, s))
                    if f < best_f:
                        best, best_f = (int(e), i), f
            if best is None:  # every hot expert is already on every free rank: take any absent expert
                i = next(i for i in range(obj.r) if len(ranks[i]) < s)
                best = (int(next(e for e in np.argsort(-load) if e not in ranks[i])), i)
            ranks[best[1]].append(best[0])
        return _flatten(ranks, s)

    def _search(self, phy2log: np.ndarray, obj: _Objective, s: int) -> np.ndarray:
        """Step 3: iterated local search within ``max_evals`` objective evaluations: descend
        to a local optimum, then repeatedly kick the best layout (a few random swaps) and
        descend again, keeping the result when it is better."""
        rng = np.random.default_rng(self.seed)
        best, f_best, evals = _descend(phy2log, obj, s, rng, self.max_evals)
        while evals < self.max_evals:
            kicked = best.copy()
            for _ in range(self.kick_swaps):
                a, b = rng.integers(len(kicked), size=2)
                new = _apply(kicked, (int(a), int(b)), obj.e, s) if a // s != b // s else None
                kicked = kicked if new is None else new
            cand, f_cand, used = _descend(kicked, obj, s, rng, self.max_evals - evals)
            evals += used + 1
            if f_cand < f_best - 1e-12:
                best, f_best = cand, f_cand
        return best


def _descend(cur: np.ndarray, obj: _Objective, s: int, rng: np.random.Generator, budget: int) -> tuple[np.ndarray, float, int]:
    """First-improvement descent: passes over every swap of two slots on different ranks and
    every re-target of a replica slot (seeded random order) until a pass finds nothing or
    ``budget`` evaluations are spent. Returns (layout, objective, evaluations)."""
    f_cur, n, evals, improved = obj(cur), len(cur), 0, True
    moves = [(a, b) for a in range(n) for b in range(a + 1, n) if a // s != b // s]
    moves += [(a, -1 - e) for a in range(n) for e in range(obj.e)]  # re-target slot a to expert e
    while improved and evals < budget:
        improved = False
        for i in rng.permutation(len(moves)):
            if evals >= budget:
                break
            new = _apply(cur, moves[i], obj.e, s)
            if new is None:
                continue
            evals += 1
            f_new = obj(new)
            if f_new < f_cur - 1e-12:
                cur, f_cur, improved = new, f_new, True
    return cur, f_cur, evals


def _apply(cur: np.ndarray, move: tuple[int, int], num_experts: int, s: int) -> np.ndarray | None:
    """The layout after ``move`` (a swap (a, b) or a re-target (a, -1 - e)), or None if the
    move is a no-op, leaves an expert without a replica or puts an expert twice on a rank."""
    a, b = move
    new = cur.copy()
    if b >= 0:
        if cur[a] == cur[b]:
            return None
        new[a], new[b] = cur[b], cur[a]
    else:
        e = -1 - b
        if cur[a] == e or np.count_nonzero(cur == cur[a]) < 2:
            return None
        new[a] = e
    if _duplicate(new, a, s) or (b >= 0 and _duplicate(new, b, s)):
        return None
    return new


def _duplicate(phy2log: np.ndarray, slot: int, s: int) -> bool:
    """Whether slot's expert appears twice on slot's rank."""
    r = slot // s
    return int((phy2log[r * s:(r + 1) * s] == phy2log[slot]).sum()) > 1


def _flatten(ranks: list[list[int]], s: int) -> np.ndarray:
    out = np.full(len(ranks) * s, -1, dtype=np.int64)  # -1: slot still empty
    for i, x in enumerate(ranks):
        out[i * s:i * s + len(x)] = sorted(x)
    return out
