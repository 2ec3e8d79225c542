"""Start R expert-parallel processes on this machine (the tests and ``benchmarks/moe_placement.py``;
serving with ``--ep R`` starts its ranks itself, ``engine/moe/ep_group.py``).

``run_distributed(fn, topology, *args)`` spawns ``topology.world_size`` processes, each
with ``torch.distributed`` initialised (gloo by default) on a free local port, calls
``fn(ctx, *args)`` with its ``EPContext`` and returns every rank's return value, in rank
order. ``fn`` must be importable (a module-level function); return values go back
through ``torch.save`` files, so tensors, numbers, dicts and lists all work.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentrt.procs import free_port
from engine.moe.config import Topology
from engine.moe.ep import EPContext


def _worker(rank: int, fn: Callable, topology: Topology, port: int, backend: str, out_dir: str,
            threads: int, args: tuple, kwargs: dict) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=topology.world_size)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        result = fn(EPContext(rank, topology), *args, **kwargs)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_distributed(fn: Callable[..., Any], topology: Topology, *args: Any, backend: str = "gloo",
                    threads_per_rank: int = 1, fn_kwargs: dict | None = None) -> list[Any]:
    """Run ``fn(ctx, *args, **fn_kwargs)`` on every rank of ``topology`` in its own process; return the
    results in rank order. Raises if any rank fails."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    with tempfile.TemporaryDirectory(prefix="agentrt-ep-") as out:
        mp.spawn(_worker, args=(fn, topology, free_port(), backend, out, threads_per_rank, args, fn_kwargs or {}),
                 nprocs=topology.world_size, join=True)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(topology.world_size)]
