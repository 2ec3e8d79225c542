"""Runtime routing statistics: per-layer expert load, co-activation and source-rank counts.

``ExpertStats`` is what a placement is fitted on (one layer). ``SlidingWindowStats``
keeps the last ``window`` steps of every layer in a ring buffer, so the counts follow
the workload; expert-parallel ranks each record their own tokens and sum the window
with ``all_reduce`` before a refit (see ``ExpertParallelMoE`` / ``Rebalancer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertStats:
    """Routing counts of one layer over some set of tokens.

    - ``source [R, E]``: token->expert pairs whose token originated on rank r (float64).
    - ``coact [E, E]``: tokens that activated both e and f (symmetric, zero diagonal).
    - ``tokens``: number of tokens counted.
    - ``sample_ids [n, k]`` / ``sample_src [n]``: a sample of the counted tokens (or None);
      placements use it to estimate dispatch cost per token exactly in expectation.
    ``load [E] = source.sum(0)``.
    """

    source: torch.Tensor
    coact: torch.Tensor
    tokens: float
    sample_ids: torch.Tensor | None = None
    sample_src: torch.Tensor | None = None

    def __post_init__(self) -> None:
        r, e = self.source.shape
        if tuple(self.coact.shape) != (e, e):
            raise ValueError(f"coact must be [E, E] = [{e}, {e}], got {tuple(self.coact.shape)}")

    @property
    def load(self) -> torch.Tensor:
        return self.source.sum(0)  # (E,)

    @property
    def num_experts(self) -> int:
        return self.source.shape[1]

    @property
    def world_size(self) -> int:
        return self.source.shape[0]

    @classmethod
    def from_topk(cls, topk_ids: torch.Tensor, src_rank: torch.Tensor, num_experts: int, world_size: int) -> "ExpertStats":
        """Count one batch: topk_ids [T, k] logical experts, src_rank [T] originating rank.
        The whole batch is kept as the sample."""
        source, coact = _count(topk_ids, src_rank, num_experts, world_size)
        return cls(source, coact, float(topk_ids.shape[0]), topk_ids.long().clone(), src_rank.long().clone())

    @classmethod
    def empty(cls, num_experts: int, world_size: int) -> "ExpertStats":
        z = torch.zeros
        return cls(z(world_size, num_experts, dtype=torch.float64), z(num_experts, num_experts, dtype=torch.float64), 0.0)

    def __add__(self, other: "ExpertStats") -> "ExpertStats":
        ids, src = _cat(self.sample_ids, other.sample_ids), _cat(self.sample_src, other.sample_src)
        return ExpertStats(self.source + other.source, self.coact + other.coact, self.tokens + other.tokens, ids, src)


def _cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    return torch.cat([a, b])


def _count(topk_ids: torch.Tensor, src_rank: torch.Tensor, num_experts: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, _ = topk_ids.shape
    if t and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"expert ids must be in [0, {num_experts})")
    if t and (int(src_rank.min()) < 0 or int(src_rank.max()) >= world_size):
        raise ValueError(f"source ranks must be in [0, {world_size})")
    hit = torch.zeros(t, num_experts, dtype=torch.float64)  # (T, E) one row per token
    hit.scatter_(1, topk_ids.long(), 1.0)
    by_rank = torch.zeros(world_size, t, dtype=torch.float64)  # (R, T) one-hot source
    by_rank[src_rank.long(), torch.arange(t)] = 1.0
    source = by_rank @ hit  # (R, E)
    coact = hit.T @ hit  # (E, E)
    coact.fill_diagonal_(0.0)
    return source, coact


class SlidingWindowStats:
    """Per-layer counts over the last ``window`` steps, the open one included (a ring
    buffer of step buckets).

    Call ``record(layer, topk_ids, src_rank)`` for every MoE layer of a step, then
    ``advance()`` once per step; ``snapshot(layer)`` sums the buckets in the window.
    Each record also keeps up to ``sample_per_step`` of its tokens (a seeded random
    subset) as the window's token sample.
    """

    def __init__(self, num_layers: int, num_experts: int, world_size: int, window: int,
                 sample_per_step: int = 256, seed: int = 0):
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        if sample_per_step < 0:
            raise ValueError(f"sample_per_step must be >= 0, got {sample_per_step}")
        self.num_experts, self.world_size, self.window = num_experts, world_size, window
        self.sample_per_step = sample_per_step
        self._source = torch.zeros(window, num_layers, world_size, num_experts, dtype=torch.float64)
        self._coact = torch.zeros(window, num_layers, num_experts, num_experts, dtype=torch.float64)
        self._tokens = torch.zeros(window, num_layers, dtype=torch.float64)
        self._samples: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = [
            [[] for _ in range(num_layers)] for _ in range(window)
        ]
        self._gen = torch.Generator().manual_seed(seed)
        self._pos = 0

    @property
    def num_layers(self) -> int:
        return self._tokens.shape[1]

    def record(self, layer: int, topk_ids: torch.Tensor, src_rank: torch.Tensor | int) -> None:
        """Add one batch of layer ``layer``: topk_ids [T, k], src_rank [T] or one rank for all."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        if isinstance(src_rank, int):
            src_rank = torch.full((topk_ids.shape[0],), src_rank, dtype=torch.long)
        source, coact = _count(topk_ids, src_rank, self.num_experts, self.world_size)
        self._source[self._pos, layer] += source
        self._coact[self._pos, layer] += coact
        self._tokens[self._pos, layer] += topk_ids.shape[0]
        keep = torch.randperm(topk_ids.shape[0], generator=self._gen)[: self.sample_per_step]
        self._samples[self._pos][layer].append((topk_ids[keep].long(), src_rank[keep].long()))

    def advance(self) -> None:
        """Close the current step; the oldest bucket is cleared and reused."""
        self._pos = (self._pos + 1) % self.window
        self._source[self._pos].zero_()
        self._coact[self._pos].zero_()
        self._tokens[self._pos].zero_()
        self._samples[self._pos] = [[] for _ in range(self.num_layers)]

    def snapshot(self, layer: int) -> ExpertStats:
        parts = [p for bucket in self._samples for p in bucket[layer]]
        ids = torch.cat([p[0] for p in parts]) if parts else None
        src = torch.cat([p[1] for p in parts]) if parts else None
        return ExpertStats(self._source[:, layer].sum(0), self._coact[:, layer].sum(0),
                           float(self._tokens[:, layer].sum()), ids, src)

    def snapshots(self) -> list[ExpertStats]:
        return [self.snapshot(layer) for layer in range(self.num_layers)]

    def reduced(self, group=None) -> "SlidingWindowStats":
        """A copy summed over all ranks of ``group``, samples concatenated in rank order
        (collective: every rank must call it)."""
        import torch.distributed as dist

        out = SlidingWindowStats(self.num_layers, self.num_experts, self.world_size, self.window, self.sample_per_step)
        for dst, src in ((out._source, self._source), (out._coact, self._coact), (out._tokens, self._tokens)):
            dst.copy_(src)
            dist.all_reduce(dst, group=group)
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, self._samples, group=group)
        out._samples = [[sum((g[w][l] for g in gathered), []) for l in range(self.num_layers)] for w in range(self.window)]
        out._pos = self._pos
        return out
