"""Expert-activation traces for ``benchmarks/moe_placement.py`` and the placement tests:
which experts each token activates, per layer, and which rank the token comes from.

Synthetic traces are seeded. ``structured`` traces have the two properties a
locality-aware placement can use: experts fire in co-activation groups, and tokens
that originate on one rank prefer a few groups (the router pins a session to a worker,
so one rank sees related text). ``control`` traces draw top-k uniformly with no
source preference.

Dump format for real traces (``load_topk_dump``):
- ``.npz`` with ``topk_ids`` int [L, N, k] (layer, token in time order, top-k expert ids),
  optional ``src_rank`` int [N] (the rank each token was served on; default: tokens
  dealt round-robin over ``world_size`` ranks) and optional scalar ``num_experts``;
- ``.jsonl`` with one object per token and layer:
  ``{"token": 17, "layer": 3, "src_rank": 1, "topk_ids": [5, 12]}``
  (``src_rank`` optional as above; tokens are ordered by ``token``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.moe.stats import ExpertStats


@dataclass(frozen=True)
class Trace:
    """topk_ids [L, N, k] logical expert ids; src_rank [N]; tokens in time order."""

    name: str
    topk_ids: torch.Tensor
    src_rank: torch.Tensor
    num_experts: int
    world_size: int
    structured: bool

    def __post_init__(self) -> None:
        if self.topk_ids.dim() != 3:
            raise ValueError(f"topk_ids must be [L, N, k], got shape {tuple(self.topk_ids.shape)}")
        n = self.topk_ids.shape[1]
        if tuple(self.src_rank.shape) != (n,):
            raise ValueError(f"src_rank must be [N] = [{n}], got {tuple(self.src_rank.shape)}")
        if n and (int(self.topk_ids.min()) < 0 or int(self.topk_ids.max()) >= self.num_experts):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts})")
        if n and (int(self.src_rank.min()) < 0 or int(self.src_rank.max()) >= self.world_size):
            raise ValueError(f"src_rank must lie in [0, {self.world_size})")

    @property
    def num_layers(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[2]

    def slice(self, start: int, stop: int) -> "Trace":
        return Trace(self.name, self.topk_ids[:, start:stop], self.src_rank[start:stop], self.num_experts,
                     self.world_size, self.structured)

    def halves(self) -> tuple["Trace", "Trace"]:
        """(fit half, measure half) in time order."""
        mid = self.num_tokens // 2
        return self.slice(0, mid), self.slice(mid, self.num_tokens)

    def stats(self) -> list[ExpertStats]:
        """Per-layer counts of the whole trace."""
        return [ExpertStats.from_topk(ids, self.src_rank, self.num_experts, self.world_size) for ids in self.topk_ids]


def structured_trace(name: str, num_layers: int, num_tokens: int, num_experts: int, top_k: int, world_size: int,
                     seed: int, group_size: int = 4, in_group: float = 0.85, affinity: float = 0.7,
                     zipf: float = 0.8) -> Trace:
    """Co-activation groups of ``group_size`` experts (a fresh random grouping per layer,
    unrelated to expert ids); each top-k pick stays in the token's group with probability
    ``in_group``. Group popularity is Zipf(``zipf``). A token from rank r picks its group
    from r's home groups with probability ``affinity``, else by popularity."""
    if num_experts % group_size:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of group_size ({group_size})")
    rng = np.random.default_rng(seed)
    groups = num_experts // group_size
    src = rng.integers(world_size, size=num_tokens)
    ids = np.empty((num_layers, num_tokens, top_k), dtype=np.int64)
    for layer in range(num_layers):
        members = rng.permutation(num_experts).reshape(groups, group_size)  # (G, g)
        pop = 1.0 / np.arange(1, groups + 1) ** zipf
        pop = rng.permutation(pop / pop.sum())  # (G,)
        home = rng.permutation(groups) % world_size  # home rank of each group
        expert_pop = np.repeat(pop / group_size, group_size)[np.argsort(members.reshape(-1))]  # (E,)
        for t in range(num_tokens):
            r = src[t]
            mine = np.flatnonzero(home == r)
            g = rng.choice(mine, p=pop[mine] / pop[mine].sum()) if rng.random() < affinity and len(mine) else rng.choice(groups, p=pop)
            ids[layer, t] = _pick(rng, members[g], expert_pop, top_k, in_group)
    return Trace(name, torch.from_numpy(ids), torch.from_numpy(src), num_experts, world_size, True)


def _pick(rng: np.random.Generator, group: np.ndarray, expert_pop: np.ndarray, k: int, in_group: float) -> np.ndarray:
    """k distinct experts: each from the group with probability in_group, else by popularity."""
    chosen: list[int] = []
    while len(chosen) < k:
        left = [e for e in group if e not in chosen]
        if left and rng.random() < in_group:
            chosen.append(int(rng.choice(left)))
        else:
            p = expert_pop.copy()
            p[chosen] = 0.0
            chosen.append(int(rng.choice(len(p), p=p / p.sum())))
    return np.array(chosen)


def control_trace(name: str, num_layers: int, num_tokens: int, num_experts: int, top_k: int, world_size: int,
                  seed: int) -> Trace:
    """No structure: k distinct experts uniformly at random, sources uniform."""
    rng = np.random.default_rng(seed)
    src = rng.integers(world_size, size=num_tokens)
    keys = rng.random((num_layers, num_tokens, num_experts))
    ids = np.argsort(keys, axis=-1)[..., :top_k]  # (L, N, k) uniform k-subsets
    return Trace(name, torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(src), num_experts, world_size, False)


def load_topk_dump(path: str | Path, world_size: int, num_experts: int | None = None, structured: bool = True) -> Trace:
    """Read a per-token top-k expert id dump (.npz or .jsonl, format in the module docstring)."""
    path = Path(path)
    if path.suffix == ".npz":
        data = np.load(path)
        if "topk_ids" not in data:
            raise ValueError(f"{path}: an .npz dump needs a 'topk_ids' array [L, N, k]")
        ids = np.asarray(data["topk_ids"], dtype=np.int64)
        src = np.asarray(data["src_rank"], dtype=np.int64) if "src_rank" in data else None
        if num_experts is None and "num_experts" in data:
            num_experts = int(data["num_experts"])
    elif path.suffix == ".jsonl":
        ids, src = _read_jsonl(path)
    else:
        raise ValueError(f"{path}: unknown dump format (expected .npz or .jsonl)")
    if ids.ndim != 3:
        raise ValueError(f"{path}: topk_ids must be [L, N, k], got shape {ids.shape}")
    if src is None:
        src = np.arange(ids.shape[1]) % world_size
    num_experts = int(ids.max()) + 1 if num_experts is None else num_experts
    return Trace(path.stem, torch.from_numpy(ids), torch.from_numpy(src), num_experts, world_size, structured)


def _read_jsonl(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    rows: dict[tuple[int, int], list[int]] = {}
    src: dict[int, int] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            token, layer, topk = int(rec["token"]), int(rec["layer"]), [int(x) for x in rec["topk_ids"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: expected {{'token', 'layer', 'topk_ids'[, 'src_rank']}}: {exc}") from exc
        rows[(layer, token)] = topk
        if "src_rank" in rec:
            src[token] = int(rec["src_rank"])
    if not rows:
        raise ValueError(f"{path}: no records")
    layers = sorted({l for l, _ in rows})
    tokens = sorted({t for _, t in rows})
    k = len(next(iter(rows.values())))
    ids = np.empty((len(layers), len(tokens), k), dtype=np.int64)
    for li, l in enumerate(layers):
        for ti, t in enumerate(tokens):
            if (l, t) not in rows or len(rows[(l, t)]) != k:
                raise ValueError(f"{path}: token {t} layer {l} is missing or has a top-k other than {k}")
            ids[li, ti] = rows[(l, t)]
    src_arr = np.array([src[t] for t in tokens], dtype=np.int64) if len(src) == len(tokens) else None
    return ids, src_arr


def save_npz(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` in the .npz dump format."""
    np.savez(path, topk_ids=trace.topk_ids.numpy(), src_rank=trace.src_rank.numpy(), num_experts=trace.num_experts)
