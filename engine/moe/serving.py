"""Expert parallelism inside the engine: rank 0 is the engine process, ranks 1..R-1 are
worker processes that hold only their expert slots.

Design (docs/moe.md, "Serving"):
- Rank 0 runs everything that is not a routed expert: scheduler, KV cache, attention,
  dense MLPs, sampling. Workers load only the MoE layers' gate, shared expert and their
  own slots from the same checkpoint.
- Control goes over one ``multiprocessing`` pipe per worker: before every model forward
  rank 0 sends ``("step", T)``; ``("stop", 0)`` ends the worker. An idle worker waits on
  its pipe, not in a collective, so an idle server never hits a collective timeout, and a
  worker whose engine process dies gets EOF and exits.
- Data goes over ``torch.distributed`` (gloo on CPU, NCCL on CUDA). In every MoE layer the
  step's T tokens are split into R contiguous chunks; chunk r goes to rank r, its *source
  rank*, which routes it and dispatches it with ``ExpertParallelMoE`` (all_to_all_single,
  uneven splits); the outputs come back to rank 0 in order (``run_split``).
- The layout is fitted once at start on a *uniform prior* (``fit_startup_layout``): no
  routing statistics exist yet, so every layer gets the same layout.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from engine.moe.checkpoint import SafetensorsDict
from engine.moe.config import MoEConfig, Topology, moe_layer_indices
from engine.moe.ep import EPContext, ExpertParallelMoE, exchange
from engine.moe.placement import LayerPlacement, get_placement
from engine.moe.stats import ExpertStats

COLLECTIVE_TIMEOUT = timedelta(minutes=5)  # one collective inside a step, never an idle wait


def split_sizes(num_tokens: int, world_size: int) -> list[int]:
    """Rows of a step's ``num_tokens`` tokens that each rank sources (contiguous, near-equal)."""
    return [num_tokens * (r + 1) // world_size - num_tokens * r // world_size for r in range(world_size)]


def run_split(ep: ExpertParallelMoE, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One MoE layer for one step. Collective: every rank calls it with the same ``num_tokens``.

    x is the whole step [T, H] on rank 0 and an empty [0, H] elsewhere; returns [T, H] on
    rank 0 (row order kept) and [0, H] elsewhere."""
    r, me = ep.ctx.topology.world_size, ep.ctx.rank
    sizes = torch.tensor(split_sizes(num_tokens, r))  # (R,)
    nothing = torch.zeros(r, dtype=torch.long)
    just_me = torch.zeros(r, dtype=torch.long)
    just_me[0] = sizes[me]  # rows exchanged with rank 0 only
    local = exchange(x, sizes if me == 0 else nothing, just_me, ep.ctx.group)  # (T_me, H)
    y = ep(local)  # (T_me, H)
    return exchange(y, just_me, sizes if me == 0 else nothing, ep.ctx.group)


class SourceSplitMoE(nn.Module):
    """Rank 0's MoE layer while serving with expert parallelism (see ``run_split``)."""

    def __init__(self, ep: ExpertParallelMoE):
        super().__init__()
        self.ep = ep

    def load_hf(self, state_dict, layer_prefix: str) -> None:
        self.ep.load_hf(state_dict, layer_prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_split(self.ep, x, x.shape[0])  # (T, H)


def fit_startup_layout(placement: str, cfg: MoEConfig, topology: Topology, num_redundant: int,
                       tokens: int = 512, seed: int = 0) -> LayerPlacement:
    """Fit ``placement`` on a uniform prior: ``tokens`` synthetic tokens, each with top-k
    distinct experts drawn uniformly and a uniform source rank (seeded, so deterministic).
    Raises ValueError when the world size does not divide ``num_experts + num_redundant``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, cfg.num_experts, generator=gen).argsort(dim=-1)[:, :cfg.top_k]  # (N, k)
    src = torch.randint(topology.world_size, (tokens,), generator=gen)  # (N,)
    stats = ExpertStats.from_topk(ids, src, cfg.num_experts, topology.world_size)
    return get_placement(placement, num_redundant=num_redundant).fit_layer(stats, topology)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its slots and join the group (pickled to the process)."""

    model_dir: str
    dtype: torch.dtype
    topology: Topology
    phy2log: tuple[int, ...]  # the layout of every MoE layer
    replica_policy: str
    init_method: str
    backend: str
    device_index: int  # first CUDA device (rank 0's); rank r uses (device_index + r) % count
    threads: int


def load_rank_layers(spec: WorkerSpec, rank: int, device: str) -> list[ExpertParallelMoE]:
    """This rank's ExpertParallelMoE for every MoE layer, reading only its own slots."""
    hf = json.loads((Path(spec.model_dir) / "config.json").read_text())
    cfg = MoEConfig.from_hf_config(hf)
    layout = LayerPlacement(torch.tensor(spec.phy2log), cfg.num_experts, spec.topology, spec.replica_policy)
    ctx, sd = EPContext(rank, spec.topology), SafetensorsDict(spec.model_dir)
    return [ExpertParallelMoE.from_hf_state_dict(cfg, layout, ctx, sd, f"model.layers.{n}.", spec.dtype).to(device)
            for n in moe_layer_indices(hf)]


def worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    """A worker rank: load, report ready, join the group, then serve steps until told to stop."""
    torch.set_num_threads(spec.threads)
    try:
        device = "cpu"
        if spec.backend == "nccl":
            device = f"cuda:{(spec.device_index + rank) % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
        layers = load_rank_layers(spec, rank, device)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", ""))
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=rank,
                            world_size=spec.topology.world_size, timeout=COLLECTIVE_TIMEOUT)
    hidden, dtype = layers[0].cfg.hidden, spec.dtype
    try:
        with torch.inference_mode():
            while True:
                try:
                    kind, num_tokens = conn.recv()
                except EOFError:  # the engine process is gone
                    return
                if kind == "stop":
                    return
                for ep in layers:
                    run_split(ep, torch.empty(0, hidden, dtype=dtype, device=device), num_tokens)
    finally:
        dist.destroy_process_group()
