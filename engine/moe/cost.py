"""Expected dispatch cost and rank load of a layout, from aggregated routing statistics.

The dispatcher sends a token once per destination rank. With a token sample in
``ExpertStats`` the expected sends are exact per sampled token: rank r is used with
probability 1 - prod_j (1 - d[src, e_j, r]) (replica choices of a token's experts are
independent hashes). Without a sample we fall back to pairwise counts: every remote
token->expert pair costs one send and every co-activated pair served on the same remote
rank saves 2/k of one (exact for top-2, conservative for larger k: m experts of a token
on one rank save m - 1 sends, the m(m-1)/2 pairs credit (m - 1) m / k <= m - 1).
Co-activations are split over source ranks in proportion to the experts' source shares
(per-source co-activation would be R x E x E per layer).

Works on numpy arrays: a placement search calls these thousands of times.
"""

from __future__ import annotations

import numpy as np

from engine.moe.config import Topology
from engine.moe.stats import ExpertStats


def replica_counts(phy2log: np.ndarray, num_experts: int, world_size: int) -> np.ndarray:
    """M [E, R]: replicas of expert e on rank r (slots holding -1 are empty)."""
    s = len(phy2log) // world_size
    m = np.zeros((num_experts, world_size))
    used = phy2log >= 0
    np.add.at(m, (phy2log[used], (np.arange(len(phy2log)) // s)[used]), 1.0)
    return m


def routing_fractions(m: np.ndarray, topology: Topology, policy: str) -> np.ndarray:
    """d [R_src, E, R_dst]: expected share of (source rank, expert) pairs each rank serves.

    ``hash`` spreads pairs over replicas evenly; ``locality`` uses the replica on the
    source rank, else spreads over the source node's replicas, else over all.
    """
    e, r = m.shape
    spread = m / m.sum(1, keepdims=True)  # (E, R)
    if policy == "hash":
        return np.broadcast_to(spread, (r, e, r)).copy()
    node = np.arange(r) // topology.ranks_per_node
    same_node = (node[:, None] == node[None, :]).astype(float)  # (R_src, R_dst)
    in_node = m[None, :, :] * same_node[:, None, :]  # (R_src, E, R_dst)
    node_tot = in_node.sum(2, keepdims=True)  # (R_src, E, 1)
    d = np.where(node_tot > 0, in_node / np.maximum(node_tot, 1e-30), spread[None])  # (R_src, E, R_dst)
    local = m.T > 0  # (R_src, E): a replica on the source rank
    eye = np.eye(r)[:, None, :]  # (R_src, 1, R_dst)
    return np.where(local[:, :, None], eye, d)


def load_from_fractions(d: np.ndarray, source: np.ndarray) -> np.ndarray:
    """Expected token->expert pairs served per rank [R]."""
    return np.einsum("se,ser->r", source, d)


def sends_from_sample(d: np.ndarray, ids: np.ndarray, src: np.ndarray, topology: Topology) -> tuple[float, float]:
    """Expected (off-rank, off-node) sends per token over a token sample: ids [n, k], src [n]."""
    r = d.shape[0]
    node = np.arange(r) // topology.ranks_per_node
    p = d[src[:, None], ids]  # (n, k, R) where each of the token's experts is served
    used = 1.0 - np.prod(1.0 - p, axis=1)  # (n, R) P(rank r receives the token)
    off_rank = used * (np.arange(r)[None, :] != src[:, None])
    off_node = used * (node[None, :] != node[src][:, None])
    n = max(len(src), 1)
    return float(off_rank.sum() / n), float(off_node.sum() / n)


def sends_from_fractions(d: np.ndarray, source: np.ndarray, coact: np.ndarray, topology: Topology,
                         top_k: int = 2) -> tuple[float, float]:
    """Estimated (off-rank, off-node) token sends from pairwise counts, summed over the
    counted tokens (see the module docstring)."""
    r = source.shape[0]
    node = np.arange(r) // topology.ranks_per_node
    off_rank = 1.0 - np.eye(r)  # (R_src, R_dst)
    off_node = (node[:, None] != node[None, :]).astype(float)
    load = np.maximum(source.sum(0), 1e-30)  # (E,)
    share = source / load  # (R, E) share of expert e's pairs from rank s
    coact_s = 0.5 * coact[None] * (share[:, :, None] + share[:, None, :])  # (R, E, E)
    out = []
    for mask in (off_rank, off_node):
        dm = d * mask[:, None, :]  # (R_src, E, R_dst) remote part
        pairs = np.einsum("se,ser->", source, dm)
        together = np.einsum("ser,sfr->sef", dm, dm)  # (R, E, E) P(both on the same remote rank)
        out.append(float(pairs - 0.5 * (2.0 / max(top_k, 2)) * (coact_s * together).sum()))
    return out[0], out[1]


def sends_per_token(d: np.ndarray, stats: ExpertStats, topology: Topology) -> tuple[float, float]:
    """Expected sends per token: from the token sample when ``stats`` has one, else pairwise."""
    if stats.sample_ids is not None and len(stats.sample_ids):
        return sends_from_sample(d, stats.sample_ids.numpy(), stats.sample_src.numpy(), topology)
    k = int(round(float(stats.source.sum()) / max(stats.tokens, 1.0)))
    a, b = sends_from_fractions(d, stats.source.numpy(), stats.coact.numpy(), topology, k)
    t = max(stats.tokens, 1.0)
    return a / t, b / t
