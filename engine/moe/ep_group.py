"""``ExpertParallelGroup``: rank 0's handle on expert-parallel serving, in the engine process.

Lifecycle (``LLMEngine`` drives it):

    group = ExpertParallelGroup.launch(engine_config, model_config, dtype, device)  # validate, fit, spawn
    layer = group.moe_layer()          # rank 0's MoE module, one per MoE layer (workers load meanwhile)
    group.connect()                    # wait for the workers, join the process group
    with group.step(num_tokens): ...   # one model forward (announces the step to the workers)
    group.close()                      # stop the workers; also runs at interpreter exit

Shutdown is clean in every case: ``close`` (or ``atexit``) sends ``stop`` and joins; workers
are daemonic, so ``multiprocessing`` terminates any left at exit; a worker whose engine
process was killed gets EOF on its pipe (or a gloo error mid-step) and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import socket
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.moe.config import MoEConfig, Topology, moe_layer_indices
from engine.moe.ep import EPContext, ExpertParallelMoE
from engine.moe.placement import LayerPlacement
from engine.moe.serving import COLLECTIVE_TIMEOUT, SourceSplitMoE, WorkerSpec, fit_startup_layout, worker_main


class ExpertParallelGroup:
    """Rank 0 plus R-1 worker processes serving one MoE checkpoint (see module docstring)."""

    def __init__(self, spec: WorkerSpec, cfg: MoEConfig, layout: LayerPlacement, placement: str) -> None:
        self.spec, self.cfg, self.layout, self.placement = spec, cfg, layout, placement
        self.ctx = EPContext(0, spec.topology)
        self._procs: list = []
        self._conns: list = []
        self._lock = threading.Lock()  # one step at a time; close waits for it
        self._connected = self._closed = False
        self._failure: str | None = None

    @classmethod
    def launch(cls, config, model_config, dtype: torch.dtype, device: str) -> "ExpertParallelGroup":
        """Validate, fit the start-up layout and spawn the workers (they start loading at once).

        ``config`` is an ``EngineConfig`` with ``ep_size > 1``; ``model_config`` the loaded
        ``ModelConfig``. Raises ValueError for a dense model, a world size that does not divide
        the slot count, or too few GPUs for NCCL."""
        r = config.ep_size
        cfg, backend, device_index = _check_settings(config, model_config, device)
        topology = Topology(config.ep_nodes, r // config.ep_nodes)
        layout = fit_startup_layout(config.ep_placement, cfg, topology, config.ep_redundant)
        spec = WorkerSpec(str(config.model), dtype, topology,
                          tuple(layout.phy2log.tolist()), layout.replica_policy,
                          f"tcp://127.0.0.1:{_free_port()}", backend, device_index,
                          threads=max(1, torch.get_num_threads() // r))
        group = cls(spec, cfg, layout, config.ep_placement)
        group._spawn()
        return group

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        atexit.register(self.close)
        for rank in range(1, self.spec.topology.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(rank, self.spec, child), daemon=True,
                            name=f"agentrt-ep-rank{rank}")
            p.start()
            child.close()  # the worker holds its end; EOF on ours means it died
            self._procs.append(p)
            self._conns.append(parent)

    @property
    def world_size(self) -> int:
        return self.spec.topology.world_size

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def moe_layer(self) -> SourceSplitMoE:
        """Rank 0's module for one MoE layer, unloaded (``load_hf`` fills it): the gate, the
        shared expert and rank 0's slots only."""
        return SourceSplitMoE(ExpertParallelMoE(self.cfg, self.layout, self.ctx, self.spec.dtype))

    def connect(self, timeout_s: float = 600.0) -> None:
        """Wait until every worker has loaded its slots, then join the process group."""
        deadline = time.monotonic() + timeout_s
        for rank, (p, conn) in enumerate(zip(self._procs, self._conns), start=1):
            while not conn.poll(0.1):
                if not p.is_alive():
                    raise RuntimeError(f"expert-parallel rank {rank} exited (code {p.exitcode}) while loading")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"expert-parallel rank {rank} did not load in {timeout_s:.0f} s")
            try:
                kind, detail = conn.recv()
            except EOFError:
                raise RuntimeError(f"expert-parallel rank {rank} exited while loading") from None
            if kind == "error":
                raise RuntimeError(f"expert-parallel rank {rank} failed to load its experts:\n{detail}")
        if self.spec.backend == "nccl":
            torch.cuda.set_device(self.spec.device_index)
        dist.init_process_group(self.spec.backend, init_method=self.spec.init_method, rank=0,
                                world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT)
        self._connected = True

    @contextlib.contextmanager
    def step(self, num_tokens: int):
        """Announce one forward of ``num_tokens`` tokens to the workers; the body runs the
        model, whose MoE layers are collective. A failure inside marks the group failed (the
        ranks may be mid-collective) and every later step raises."""
        with self._lock:
            if self._failure is not None or self._closed or not self._connected:
                raise RuntimeError(self._failure or "the expert-parallel group is not running")
            dead = [(i + 1, p.exitcode) for i, p in enumerate(self._procs) if not p.is_alive()]
            try:
                if dead:
                    raise RuntimeError(f"expert-parallel ranks exited: {dead} (rank, exit code)")
                for conn in self._conns:
                    conn.send(("step", num_tokens))
                yield
            except BaseException as exc:
                self._failure = f"expert-parallel serving failed: {exc!r}"
                self._stop_workers(graceful=False)
                raise

    def close(self) -> None:
        """Stop the workers and leave the process group. Idempotent; waits up to 10 s for a
        step in flight (then kills the workers, which ends that step with an error)."""
        if self._closed:
            return
        acquired = self._lock.acquire(timeout=10.0)
        try:
            self._closed = True
            self._stop_workers(graceful=acquired and self._failure is None)
            if acquired and self._connected and dist.is_initialized():
                dist.destroy_process_group()
            atexit.unregister(self.close)
        finally:
            if acquired:
                self._lock.release()

    def _stop_workers(self, graceful: bool) -> None:
        if graceful:
            for conn in self._conns:
                try:
                    conn.send(("stop", 0))
                except OSError:  # already gone
                    pass
            for p in self._procs:
                p.join(timeout=10.0)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._conns = []


def _check_settings(config, model_config, device: str) -> tuple[MoEConfig, str, int]:
    """(MoEConfig, process-group backend, rank 0's CUDA index), or ValueError naming the setting."""
    r = config.ep_size
    if not model_config.moe:
        raise ValueError(f"ep_size={r} needs a Mixture-of-Experts model, but {config.model!r} is a dense "
                         f"{model_config.architecture} model; use ep_size=1")
    hf = model_config.moe["hf_config"]
    cfg = MoEConfig.from_hf_config(hf)
    if not moe_layer_indices(hf):
        raise ValueError(f"ep_size={r}: {config.model!r} has no MoE layers (all are mlp_only_layers)")
    slots = cfg.num_experts + config.ep_redundant
    if slots % r:
        raise ValueError(f"ep_size={r} must divide the expert slot count: {cfg.num_experts} experts + "
                         f"{config.ep_redundant} redundant = {slots} slots")
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialised in this process; expert-parallel "
                         "serving needs to own the default process group")
    if not device.startswith("cuda"):
        return cfg, "gloo", 0
    if torch.cuda.device_count() < r:
        raise ValueError(f"ep_size={r} on CUDA needs one GPU per rank; {torch.cuda.device_count()} visible")
    return cfg, "nccl", torch.device(device).index or 0


def _free_port() -> int:
    """A free local TCP port for the group's rendezvous (``tcp://127.0.0.1:PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
