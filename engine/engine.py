"""LLMEngine: the synchronous core. ``step()`` is schedule -> run -> sample -> postprocess.

Thread model: ``add_request``/``abort_request``/``pin``/``unpin`` (and the snapshot and KV-transfer
requests) may be called from any thread; they put typed messages (engine/commands.py) in the inbox,
which ``step()`` dispatches at its start, so the scheduler's state is only ever touched by the thread
running ``step()``. Speculative decoding's drafts, verification and commit are
``SpeculativeDecoder``'s (engine/speculative.py).
With ``overlap_schedule`` the model forward and sampling of each step run on a
forward thread while ``step()`` schedules the next one and commits the last one's
tokens one step behind (engine/overlap.py).

A request may carry an opaque ``trace`` (``add_request``): when it finishes, the engine thread
hands it to ``on_finished`` with its phase timestamps set (arrival, first admission, first
token, finish), and the serving layer's tracing emits its spans from those (agentrt/tracing.py);
no span is held open across threads, and a request without ``trace`` costs nothing.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import uuid
from typing import Callable, Sequence

import torch

from engine.attention import backend_class
from engine.coalesce import TurnCoalescer
from engine.client import check_closing, check_request
from engine.commands import (KV_OPS, Abort, AddRequest, CacheSnapshot, Demote, Dispatcher, ExtendPin, FlushCache,
                             KVTransfer, Pin, Prefetch, StopRequest, TierSnapshot, Unpin)
from engine.config import EngineConfig
from engine.constraints import TokenConstraint
from engine.cpu_info import cpu_model
from engine.hashing import block_hashes, make_seed
from engine.kv_pool import KVCache, PagePool, kv_bytes_per_token, pool_pages
from engine.kv_move import KVLayout, KVMover, model_fingerprint
from engine.kv_tier import DiskTier, HostTier, KVTiers
from engine.loader import gguf_weight_types, load_model_files
from engine.model_runner import ModelRunner
from engine.models import build_model
from engine.models.quant import MAX_QUANT_ROWS
from engine.output_processor import OutputProcessor
from engine.overlap import ForwardWorker, Step, StepResult
from engine.radix_cache import RadixCache
from engine.request import PLACEHOLDER, Request, Status
from engine.sampler import sample
from engine.scheduler import Scheduler
from engine.session_priority import SESSION, ServiceLedger, SessionOrder, charge, priority_class
from engine.speculative import SpeculativeDecoder
from engine.step_cost import step_cost_for
from engine.types import (CLOSED_BY_BUDGET, EngineOverloaded, EngineStats, GenerationResult, InvalidRequest,
                          RequestOutput, SamplingParams, SchedulingKey)
from engine.window_pool import WindowedPagePool, size_windowed_pools

_log = logging.getLogger("engine")
MAX_DEMOTED = 4096   # demoted pins whose prefix a prefetch may still ask for (oldest forgotten first)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, on_kv_event=None, kv_event_tokens: bool = False) -> None:
        config = config or EngineConfig()
        # overlap scheduling (engine/overlap.py): the forward thread, and the last launched step
        self.overlap = config.overlap_schedule
        self._worker = ForwardWorker() if self.overlap else None
        self._inflight: Step | None = None
        if self._worker is None:
            self._setup(config, on_kv_event, kv_event_tokens)
            return
        # Loaded in the forward thread, which runs every forward: one thread runs the model's parallel
        # torch operations, so the process holds one OpenMP thread team (AsyncEngine's docstring says why).
        try:
            self._worker.submit(self._setup, config, on_kv_event, kv_event_tokens).result()
        except BaseException:
            self._worker.close()
            raise

    def _setup(self, config: EngineConfig, on_kv_event, kv_event_tokens: bool) -> None:
        """Load the model; build the KV pool, radix cache, scheduler and model runner."""
        dtype = self._load(config)
        self.backend_name = config.resolved_backend()
        backend_cls = backend_class(self.backend_name)
        layer_attention = self.model.layer_attention()
        self._build_kv(config, dtype, backend_cls, layer_attention, on_kv_event, kv_event_tokens)
        self._build_runner(config, dtype, backend_cls, layer_attention)
        self._init_inbox()
        self._build_speculative(config)
        self._snapshot()
        _log.info("model %s, %s on %s, weights %s, attention %s, speculative %s, %d torch threads, C kernels "
                  "active: %s", self.model_id, config.resolved_dtype(), self.device, self.quantization,
                  self.attention_desc, self.speculative, torch.get_num_threads(),
                  ", ".join(k for k, on in self.active_kernels.items() if on) or "none")

    def _load(self, config: EngineConfig) -> torch.dtype:
        """The model and its tokenizer, in the resolved dtype, device and weight format."""
        self.config = config
        self.device = config.resolved_device()
        dtype = _DTYPES[config.resolved_dtype()]
        self.quantization = config.resolved_quantization(gguf_weight_types(config.model))
        mcfg, state, tok, model_id, int4_groups = load_model_files(config.model, dtype,
                                                                   int4_groups=self.quantization in ("int4", "gguf"))
        self.model_config, self.tokenizer = mcfg, tok
        self.model_id = config.served_model_name or model_id
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings,
                                 mcfg.max_position_embeddings)
        self.ep = None                         # expert-parallel ranks (MoE, ep_size > 1)
        if config.ep_size > 1:
            self.model = self._build_expert_parallel(mcfg, state, dtype)
        else:
            self.model = build_model(mcfg, state, dtype, self.device, self.quantization, int4_groups)
        self.prefill_on_blocks = False
        if self.quantization == "gguf" and self.device == "cpu":   # prefill chunks too, where measured faster
            from engine.models.cpu_pick import pick_prefill_path
            self.prefill_on_blocks = pick_prefill_path(self.model, dtype)
        self.model.rope.fit_context(self.max_model_len)   # longrope: its long table only past the original length
        del state, int4_groups
        return dtype

    def _build_kv(self, config: EngineConfig, dtype: torch.dtype, backend_cls, layer_attention, on_kv_event,
                  kv_event_tokens: bool) -> None:
        """The KV pool (a windowed one where layers slide), the radix cache, the scheduler, the tiers and
        the KV mover."""
        mcfg = self.model_config
        P = config.page_size
        kv_dtype = _DTYPES[config.resolved_kv_cache_dtype()]
        self.window_layers = self._window_layers(layer_attention, backend_cls.kv_layout)
        if self.window_layers:
            self.pool, self.kv = self._windowed_pool(layer_attention, dtype, kv_dtype)
            num_pages = self.pool.num_pages
        else:
            num_pages = pool_pages(config, kv_bytes_per_token(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim,
                                                              kv_dtype))
            self.pool = PagePool(num_pages)
            self.kv = KVCache(mcfg.num_layers, num_pages, P, mcfg.num_kv_heads, mcfg.head_dim,
                              dtype, self.device, layout=backend_cls.kv_layout, kv_dtype=kv_dtype)
        # max_waiting_tokens, or twice the pool (sized by tokens, or by bytes at the KV precision)
        self.waiting_tokens_limit = config.max_waiting_tokens or 2 * (num_pages - 1) * P
        self.on_kv_event = on_kv_event
        self.cache = RadixCache(self.pool, P, self._seed, on_event=on_kv_event, event_tokens=kv_event_tokens)
        self.scheduler = Scheduler(self.pool, self.cache, P, config.max_num_seqs,
                                   config.max_batched_tokens, config.enable_prefix_cache)
        self.tiers = self._build_tiers()
        # tokens computed per session and tenant (engine/session_priority.py), and the order they give
        self.ledger = ServiceLedger()
        if config.scheduling_policy == SESSION:
            self.scheduler.order = SessionOrder(self.ledger, config.scheduling_aging_tokens_per_s)
        self._tokens_per_s = 0.0   # recent tokens computed per second of step, for Retry-After
        self.mover = KVMover(self.kv, self.pool, self.cache, P, self._kv_layout(), self.tiers,
                             write_page=self._write_page)
        self.prefill_tokens_per_s = 0.0   # measured on prefill steps (EWMA): the router's cost of a recompute

    def _build_runner(self, config: EngineConfig, dtype: torch.dtype, backend_cls, layer_attention) -> None:
        """The attention backend and the model runner, and which C kernels they run."""
        mcfg = self.model_config
        kernel = {"cpu_kernel": config.cpu_kernels} if self.backend_name == "torch" else {}
        attn = backend_cls(kv=self.kv, num_heads=mcfg.num_heads, num_kv_heads=mcfg.num_kv_heads,
                           head_dim=mcfg.head_dim, **kernel)
        attn.set_layer_attention(layer_attention)   # windows, sinks, ...: refused if unsupported
        self.runner = ModelRunner(self.model, attn, config.page_size, self.device,
                                  window_page=self.pool.window_page if self.window_layers else None,
                                  window=self.pool.window if self.window_layers else None)
        # bfloat16 steps, and float32 steps on quantized weights (already inexact: 8-bit activations);
        # float32 on dense weights keeps torch's ops, transformers-exact
        fused = self.device == "cpu" and hasattr(self.model, "use_cpu_ops") and \
            (dtype == torch.bfloat16 or (dtype == torch.float32 and self.quantization != "off")) and \
            self.model.use_cpu_ops(config.cpu_kernels)
        decode_kernel = getattr(attn, "kernel", None)
        # the C kernels this engine runs (engine/cpu_build.py KERNELS), logged below and exported in /metrics
        self.active_kernels = {"decode_attention": decode_kernel is not None, "layer_ops": bool(fused),
                               "qmatmul": self.quantization == "gguf"}
        self.attention_desc = (self.backend_name + (" + CPU decode kernel, RoPE + KV write" if decode_kernel else "")
                               + (" + fused add/RMSNorm, SiLU-multiply" if fused else ""))

    def _init_inbox(self) -> None:
        """The control-message inbox, admission counters and per-request state."""
        config = self.config
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()   # control messages, engine/commands.py
        self._dispatch = self._handlers()
        self.on_command = None  # called after every message put in the inbox (AsyncEngine wakes its loop)
        # called in the engine thread with each finished request that carries a ``trace``; must not raise
        self.on_finished: Callable[[Request], None] | None = None
        self._pending = 0                      # requests in the inbox, for admission control
        self._pending_tokens = 0               # and their prompt tokens
        self._pending_lock = threading.Lock()  # held while a request moves from the inbox to the scheduler
        self._requests: dict[str, Request] = {}
        self._seeds: dict[str, bytes] = {}
        # demoted pins (``demote``): pin id -> (tokens, cache salt) of the prefix ``prefetch`` reads back
        self._demoted: collections.OrderedDict[str, tuple[list[int], str]] = collections.OrderedDict()
        self.demotions = self.prefetches = 0
        # how long a serving loop holds its next step for agents coming back (engine/coalesce.py)
        self.coalescer = TurnCoalescer(config.turn_coalesce_max_s, config.turn_coalesce_fraction)
        self.prompt_tokens_total = self.cached_tokens_total = self.generation_tokens_total = 0

    def _build_speculative(self, config: EngineConfig) -> None:
        """Speculative decoding (engine/speculative.py) as configured, and the scheduler hooks it needs."""
        self.speculative = config.resolved_speculative()
        # a verification's cost in decode steps, for the draft-length rule (engine/step_cost.py)
        step_cost, step_cost_why = step_cost_for(self.step_cost_setup())
        self.spec = SpeculativeDecoder(self.speculative, config.num_speculative_tokens, step_cost, self.max_model_len)
        if self.speculative != "off":
            _log.info("speculative step cost (fixed, per draft) %s: %s", step_cost, step_cost_why)
            self.scheduler.propose = self.spec.propose
            # quantized layers run steps of more rows on their bf16 copies, at 2-3x a row's cost:
            # drafts never take a step past that (a step already past it drafts freely)
            self.scheduler.draft_rows_cap = MAX_QUANT_ROWS if self.quantization != "off" else None

    def _window_layers(self, layer_attention, kv_layout: str) -> tuple[int, ...]:
        """The sliding layers whose pages keep only their window (engine/window_pool.py): none without such
        layers, with ``sliding_window_cache`` off, or on a backend that refuses windows anyway."""
        layers = tuple(i for i, a in enumerate(layer_attention) if a.window is not None)
        if not layers or not self.config.sliding_window_cache or kv_layout != "HSD":
            return ()
        return layers

    def _windowed_pool(self, layer_attention, dtype, kv_dtype) -> tuple[WindowedPagePool, KVCache]:
        """Page ids for the full layers and a window-bounded pool for the sliding ones, sized together."""
        cfg, m = self.config, self.model_config
        window = max(layer_attention[i].window for i in self.window_layers)
        n_window = len(self.window_layers)
        full_bpt = kv_bytes_per_token(m.num_layers - n_window, m.num_kv_heads, m.head_dim, kv_dtype)
        window_bpt = kv_bytes_per_token(n_window, m.num_kv_heads, m.head_dim, kv_dtype)
        num_pages, window_pages = size_windowed_pools(cfg, window, full_bpt, window_bpt)
        pool = WindowedPagePool(num_pages, window_pages, window)
        kv = KVCache(m.num_layers, num_pages, cfg.page_size, m.num_kv_heads, m.head_dim, dtype, self.device,
                     layout="HSD", kv_dtype=kv_dtype, window_layers=self.window_layers,
                     window_pages=window_pages)
        _log.info("sliding window %d in the cache: layers %s hold %d pages (%d tokens), the others %d pages",
                  window, list(self.window_layers), window_pages, (window_pages - 1) * cfg.page_size, num_pages)
        return pool, kv

    def step_cost_setup(self) -> dict:
        """What a step-cost measurement must match to apply here (engine/step_cost.py)."""
        return {"device": self.device, "cpu_model": cpu_model() if self.device == "cpu" else self.device,
                "dtype": self.config.resolved_dtype(), "quantization": self.quantization,
                "torch_threads": torch.get_num_threads()}

    def _build_tiers(self) -> KVTiers | None:
        """The KV tiers the config asks for, wired to the radix cache's evictions and the scheduler. They
        hold blocks as the pool stores them (int8 pages with their scales, as bytes): whole, or, where the
        sliding layers keep only their window, partial (the full layers only; docs/kv_tiers.md)."""
        cfg = self.config
        if not (cfg.kv_host_tokens or cfg.kv_disk_tokens) or not cfg.enable_prefix_cache:
            return None
        shape, dtype, partial = self.kv.page_shape, self.kv.page_dtype, self.kv.partial_page_shape
        host = disk = None
        if cfg.kv_host_tokens:
            host = HostTier(cfg.kv_host_tokens // cfg.page_size, shape, dtype,
                            pin=self.device.startswith("cuda"), partial_shape=partial)
        if cfg.kv_disk_tokens:
            disk = DiskTier(cfg.kv_disk_path, cfg.kv_disk_tokens // cfg.page_size, shape, dtype,
                            keep=cfg.kv_disk_keep, on_event=self._tier_event,
                            drop_page_cache=cfg.kv_disk_drop_page_cache, partial_shape=partial)
        tiers = KVTiers(host, disk, on_event=self._tier_event)
        self.cache.on_evict = self._offload
        self.scheduler.tiers, self.scheduler.write_page = tiers, self._write_page
        if disk is not None:
            atexit.register(tiers.close)   # the directory is emptied even if close() is never called
        return tiers

    def _kv_layout(self) -> KVLayout:
        """What a page of this pool is, for transfers between engines (engine/kv_move.py)."""
        m = self.model_config
        return KVLayout(model_fingerprint(self.model_id, m, self.config.resolved_dtype(), self.quantization),
                        str(self.kv.page_dtype).removeprefix("torch."), tuple(self.kv.page_shape),
                        self.config.page_size, m.num_layers, m.num_kv_heads, m.head_dim, self.kv.layout)

    def _window_page(self, page: int) -> int:
        """The sliding page paired with ``page`` (0: none, or the model has no sliding layers in the cache)."""
        return self.pool.window_page[page] if self.window_layers else 0

    def _write_page(self, page: int, data: torch.Tensor) -> None:
        """Copy a tier's block into the pool (its sliding part into the page's sliding page, if it has one);
        with overlap scheduling, once the forward thread is idle (a launched step may still write a row
        into this page, given back by a request it computes)."""
        if self._worker is not None:
            self._worker.wait_idle()
        self.kv.write_page(page, data, self._window_page(page))

    def _tier_event(self, kind: str, hashes: list[int], medium: str) -> None:
        if self.on_kv_event is not None:
            self.on_kv_event(kind, hashes, None, medium=medium)

    def _offload(self, hashes: list[int], pages: list[int]) -> None:
        """The radix cache is evicting these pages: copy each one into the tiers first (whole where the page
        still has its sliding page, else partial)."""
        for h, page in zip(hashes, pages):
            window_page = self._window_page(page)
            if self.tiers.needs(h, partial=bool(self.window_layers) and not window_page):
                self.tiers.offload(h, self.kv.read_page(page, window_page))
            else:
                self.tiers.offload(h, None)   # already there: only its LRU position changes

    def _build_expert_parallel(self, mcfg, state, dtype):
        """This process is rank 0; the other ranks start here and stop in ``close``."""
        if not mcfg.moe:   # dense models, and gpt-oss whose MoE block is its own (engine/models/gpt_oss.py)
            raise ValueError(f"ep_size > 1: expert parallelism serves Mixtral / Qwen MoE models, "
                             f"not {mcfg.architecture!r}")
        from engine.models.moe_model import build_moe_model
        from engine.moe.ep_group import ExpertParallelGroup

        self.ep = ExpertParallelGroup.launch(self.config, mcfg, dtype, self.device)
        try:
            return build_moe_model(mcfg, state, dtype, self.device, ep=self.ep)
        except BaseException:
            self.ep.close()
            raise

    def close(self) -> None:
        """Release what outlives the object: the expert-parallel worker processes, if any
        (they also stop at interpreter exit)."""
        if self._worker is not None:
            self._worker.close()   # after the step it runs, if any
        if self.ep is not None:
            self.ep.close()
        if self.tiers is not None:
            self.tiers.close()   # the disk tier's files go, unless kv_disk_keep

    def _seed(self, salt: str) -> bytes:
        seed = self._seeds.get(salt)
        if seed is None:
            seed = self._seeds[salt] = make_seed(self.model_id, salt)
        return seed

    # -- commands (any thread) -------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, constraint: TokenConstraint | None = None,
                    cache_salt: str = "", pin_ttl_s: float | None = None, trace: object | None = None,
                    key: SchedulingKey | None = None) -> str:
        """Check and enqueue a request; returns its id. ``trace``: an opaque context handed back with the
        finished request to ``on_finished`` (the serving layer's trace parent). ``key``: the session and
        tenant it serves (engine/session_priority.py; None: a session of its own, of no tenant)."""
        params = params or SamplingParams()
        key = key if key is not None else SchedulingKey()
        if not isinstance(key, SchedulingKey):
            raise InvalidRequest(f"key must be a SchedulingKey, got {type(key).__name__}")
        prompt = check_request(prompt_token_ids, params, max_model_len=self.max_model_len,
                               vocab_size=self.model_config.vocab_size)
        pool_tokens = self.pool.capacity * self.config.page_size
        if len(prompt) > pool_tokens:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens but the KV cache holds only "
                                 f"{pool_tokens} tokens; send a shorter prompt")
        if constraint is not None and constraint.closes_outputs and self.config.close_constrained_outputs:
            check_closing(constraint, params.max_tokens, self.max_model_len - len(prompt))
        started = key.continuing or self.ledger.started(key.session)
        self._admit(len(prompt), started)
        rid = request_id or uuid.uuid4().hex
        req = Request(rid, prompt, params, constraint, cache_salt, pin_ttl_s, trace=trace, key=key, started=started)
        if not params.greedy:
            req.generator = torch.Generator(device="cpu")
            req.generator.manual_seed(params.seed if params.seed is not None
                                      else int.from_bytes(uuid.uuid4().bytes[:8], "little"))
        self._send(AddRequest(req))
        return rid

    def _admit(self, tokens: int, started: bool = True) -> None:
        """Count a new request into the queue, or raise ``EngineOverloaded`` (429) if the queue is
        full: ``max_waiting`` requests, or ``max_waiting_tokens`` of KV demand. When nothing is
        queued any request is admitted (the prompt check above guarantees the pool can hold it).
        Under the session policy a new session's first turn (not ``started``) may fill only
        ``1 - started_session_reserve`` of either limit: the rest is for started sessions' later turns."""
        share, why = 1.0, ""
        if not started and self.scheduler.order is not None:
            share = 1.0 - self.config.started_session_reserve
            why = (f" for a new session ({self.config.started_session_reserve:.0%} of the queue is kept for "
                   f"later turns of started sessions)")
        with self._pending_lock:
            queued = self._pending + len(self.scheduler.waiting)
            queued_tokens = self._pending_tokens + self.scheduler.waiting_tokens
            max_waiting = max(1, int(self.config.max_waiting * share))
            if queued >= max_waiting:
                raise EngineOverloaded(f"{queued} requests are waiting (limit {max_waiting}{why})",
                                       self._retry_after(queued_tokens))
            limit = int(self.waiting_tokens_limit * share)
            if queued and queued_tokens + tokens > limit:
                raise EngineOverloaded(f"{queued_tokens} tokens of queued requests are waiting for KV cache "
                                       f"and this request's prompt adds {tokens}, over the limit of "
                                       f"{limit} waiting tokens{why}", self._retry_after(queued_tokens))
            self._pending += 1
            self._pending_tokens += tokens
        self.coalescer.on_arrival()

    def _retry_after(self, queued_tokens: int) -> float:
        """The Retry-After of an ``EngineOverloaded``: under the session policy, seconds until the queue has
        drained at the recent rate of computed tokens (1 to 60; 1 before any step was measured); 1 under
        FCFS, as before the session policy existed."""
        if self.scheduler.order is None or self._tokens_per_s <= 0:
            return 1.0
        return min(60.0, max(1.0, queued_tokens / self._tokens_per_s))

    def _send(self, message) -> None:
        """Put a control message (engine/commands.py) in the engine thread's inbox."""
        self._inbox.put(message)
        if self.on_command is not None:
            self.on_command()

    def abort_request(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def stop_request(self, request_id: str, stop: str) -> None:
        """The output processor found stop string ``stop`` in the request's text: finish it as stopped (its
        pages cached, a session turn's pinned, as for an EOS); the tokens it gained since are not emitted
        to anyone (its stream ended at the stop string)."""
        self._send(StopRequest(request_id, stop))

    def pin(self, pin_id: str, token_ids: Sequence[int], ttl_s: float, cache_salt: str = "") -> None:
        self._send(Pin(pin_id, list(token_ids), ttl_s, cache_salt))

    def extend_pin(self, pin_id: str, ttl_s: float) -> None:
        """Make an existing pin (a finished session turn's, under its request id) expire ``ttl_s`` from
        now; no-op if it already expired or was released."""
        self._send(ExtendPin(pin_id, ttl_s))

    def unpin(self, pin_id: str) -> None:
        self._send(Unpin(pin_id))

    def demote(self, pin_id: str) -> None:
        """A long pause is ahead of the pin's session: copy its pages into the KV tiers now (pages a
        tier already holds are not written again) and release the pin, so the pool can take the pages
        at no cost while the prefix survives in the tiers; :meth:`prefetch` starts reading it back.
        Without tiers it only releases the pin. No-op for a pin that no longer holds."""
        self._send(Demote(pin_id))

    def prefetch(self, pin_id: str) -> None:
        """Start reading a demoted pin's prefix back from the disk tier (on the loader thread, as for an
        arriving request), so its session's next turn finds it in memory. No-op for a pin never
        demoted, or already prefetched."""
        self._send(Prefetch(pin_id))

    def flush_cache(self) -> None:
        self._send(FlushCache())

    def request_cache_snapshot(self, extra=None) -> "concurrent.futures.Future":
        """Every cached block hash, read by the engine thread at its next step.

        The future resolves to ``(hashes, extra())`` when ``extra`` is given: a callable
        run in the same thread at the same moment (e.g. the KV-event publisher's last
        sequence number, so a snapshot and the event stream line up).
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(CacheSnapshot(fut, extra))
        return fut

    def request_tier_snapshot(self) -> "concurrent.futures.Future":
        """The block hashes each KV tier holds (``{"host": [...], "disk": [...]}``; empty without
        tiers), read by the engine thread at its next step."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(TierSnapshot(fut))
        return fut

    def request_kv(self, op: str, *args) -> "concurrent.futures.Future":
        """A page-transfer operation run by the engine thread between steps (engine/kv_move.py):
        ``held`` (tokens, salt), ``export`` (tokens, salt, start, count), ``import`` (tokens, salt, start,
        pages), ``pinned`` (): the session pins' sequences. Keep ``export`` and ``import`` chunks small: the
        step waits for them."""
        if op not in KV_OPS:
            raise ValueError(f"unknown KV transfer operation {op!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(KVTransfer(fut, op, args))
        return fut

    def _kv_op(self, msg: KVTransfer) -> None:
        fn = {"held": self.mover.held, "export": self.mover.export, "import": self.mover.import_pages,
              "pinned": lambda: self.mover.pinned(self.scheduler.pins)}[msg.op]
        try:
            msg.future.set_result(fn(*msg.args))
        except Exception as exc:   # a bad page fails its transfer, never the engine
            msg.future.set_exception(exc)

    def _handlers(self) -> Dispatcher:
        """The engine thread's handler of each control message (engine/commands.py). A handler returns the
        output of a request it ended (``Abort``) or None: ``_drain_inbox`` emits what is not None."""
        s = self.scheduler
        return Dispatcher({
            AddRequest: self._on_add, Abort: self._on_abort, StopRequest: self._on_stop,
            Pin: lambda m: void(s.pin(m.pin_id, m.token_ids, m.ttl_s, m.cache_salt)),
            ExtendPin: lambda m: void(s.extend_pin(m.pin_id, m.ttl_s)), Unpin: lambda m: s.unpin(m.pin_id),
            Demote: self._on_demote, Prefetch: self._on_prefetch,
            FlushCache: self._on_flush, KVTransfer: self._kv_op,
            TierSnapshot: lambda m: m.future.set_result(self.tiers.snapshot() if self.tiers is not None else {}),
            CacheSnapshot: lambda m: m.future.set_result((self.cache.all_hashes(), m.extra()) if m.extra
                                                         else self.cache.all_hashes()),
        })

    def _drain_inbox(self) -> list[RequestOutput]:
        """Handle every control message waiting; the outputs of the requests they finished (aborts)."""
        outputs = []
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            out = self._dispatch(message)
            if out is not None:
                outputs.append(out)

    def _on_add(self, msg: AddRequest) -> None:
        req = msg.req
        self._requests[req.request_id] = req
        with self._pending_lock:  # the move is atomic to _admit: its count stays exact
            self._pending -= 1
            self._pending_tokens -= len(req.prompt_ids)
            self.scheduler.enqueue(req)
        if self.tiers is not None:
            self._prefetch(req)

    def _on_abort(self, msg: Abort) -> RequestOutput | None:
        req = self._requests.get(msg.request_id)
        if req is None or req.finished:
            return None
        req.drop_placeholders()   # a launched step's token for it is dropped at its commit
        req.finish_reason = "abort"
        self.scheduler.finish(req)
        return self._emit(req)

    def _on_stop(self, msg: StopRequest) -> RequestOutput | None:
        req = self._requests.get(msg.request_id)
        if req is None or req.finished:
            return None
        req.finish_reason, req.stop_reason = "stop", msg.stop
        req.status = Status.FINISHED
        if self._finish(req):
            self.coalescer.on_finish(1)
        return self._emit(req)

    def _on_flush(self, _: FlushCache) -> None:
        self.cache.on_evict = None   # a flush drops the tiers' copies too
        self.cache.reset()
        if self.tiers is not None:
            self.cache.on_evict = self._offload
            self.tiers.clear()

    def _prefetch(self, req: Request) -> None:
        """A request arrived: start reading its disk-tier pages past the device match now, so they are
        in memory by the time the scheduler reaches it (it admits other requests meanwhile)."""
        limit = ((req.num_tokens - 1) // self.config.page_size) * self.config.page_size
        self._prefetch_tokens(req.all_ids[:limit], req.cache_salt)

    def _prefetch_tokens(self, tokens: Sequence[int], salt: str) -> int:
        """Queue the disk reads of the tier pages that continue the device match of ``tokens`` (whole
        pages); returns how many pages the tiers hold there."""
        pages, node = self.cache.match_prefix(tokens, salt)
        hashes = block_hashes(tokens[len(pages) * self.config.page_size:], self.config.page_size,
                              self._seed(salt), parent=node.last_hash)
        held = hashes[:len(self.tiers.match(hashes))]
        self.tiers.prefetch(held)
        return len(held)

    def _on_demote(self, msg: Demote) -> None:
        pin = self.scheduler.pins.get(msg.pin_id)
        if pin is None:
            return
        if self.tiers is not None:
            hashes, pages, node = [], [], pin.node
            while node is not None:   # the pin's path, leaf first: the copies go in root-first order
                hashes[:0], pages[:0] = node.hashes, node.pages
                node = node.parent
            self._offload(hashes, pages)
            self._demoted[msg.pin_id] = self.cache.sequence(pin.node)
            while len(self._demoted) > MAX_DEMOTED:
                self._demoted.popitem(last=False)
        self.scheduler.unpin(msg.pin_id)
        self.demotions += 1

    def _on_prefetch(self, msg: Prefetch) -> None:
        entry = self._demoted.pop(msg.pin_id, None)
        if entry is not None and self.tiers is not None:
            self._prefetch_tokens(*entry)
            self.prefetches += 1

    # -- the step (one thread) ------------------------------------------------
    def _snapshot(self) -> None:
        """Publish stats for other threads (they must not walk the scheduler's live state)."""
        s = self.scheduler
        self._stats = EngineStats(
            running=len(s.running), waiting=len(s.waiting),
            pages_total=self.pool.capacity, pages_used=self.pool.capacity - self.pool.num_free,
            pages_free=self.pool.num_free, pages_cached=self.cache.cached_pages,
            pages_evictable=self.cache.evictable_pages,
            pages_pinned=len({p for pin in s.pins.values() for p in _path_pages(pin.node)}),
            num_pins=len(s.pins), prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_preemptions=s.num_preemptions, page_size=self.config.page_size,
            waiting_tokens=s.waiting_tokens, waiting_tokens_limit=self.waiting_tokens_limit,
            spec_draft_tokens_total=self.spec.draft_tokens_total,
            spec_accepted_tokens_total=self.spec.accepted_tokens_total,
            spec_verifications_total=self.spec.verifications_total,
            kv_tiers=self.tiers.stats() if self.tiers is not None else {}, cpu_kernels=self.active_kernels,
            kv_cache_bytes_per_token=self.kv.bytes_per_token, waiting_by_priority=_by_priority(s.waiting),
            prefill_tokens_per_s=self.prefill_tokens_per_s, **self._window_stats())
        self._pin_ids = frozenset(s.pins)

    def _window_stats(self) -> dict:
        """The sliding layers' pool for EngineStats (empty where no layer slides in the cache)."""
        if not isinstance(self.pool, WindowedPagePool):
            return {}
        return {"window_pages_total": self.pool.window_pool.capacity, "window_pages_used": self.pool.window_pages_used}

    def has_pins(self) -> bool:
        """Whether a pin is held (it may expire: a serving loop steps now and then to expire it)."""
        return bool(self.scheduler.pins)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After a step raised: end every running and waiting request with ``message`` as its error, and
        their outputs (engine thread)."""
        outs = []
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            req.finish_reason, req.error = "error", message
            self.scheduler.finish(req)
            outs.append(self._emit(req))
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or not self._inbox.empty()
                    or self._inflight is not None)

    def step(self) -> list[RequestOutput]:
        if self.overlap:
            return self._step_overlapped()
        outputs = self._drain_inbox()
        self.scheduler.expire_pins()
        batch = self.scheduler.schedule()
        outputs.extend(self._take_failed())
        if batch:
            step = self._prepare(batch)
            outputs.extend(self._commit(step, self._forward(step)))
        elif self.tiers is not None and self.scheduler.waiting and self.tiers.loading():
            self.tiers.wait_for_load(0.01)   # nothing can run until a disk read lands
        self._snapshot()
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        """Schedule and launch step n+1 while step n's forward runs, then commit step n
        (engine/overlap.py); step n first when it may not be run ahead of."""
        outputs: list[RequestOutput] = []
        prev = self._inflight
        try:
            if prev is not None and not prev.run_ahead:
                outputs.extend(self._commit_launched(prev))
                prev = None
            outputs.extend(self._drain_inbox())
            self.scheduler.expire_pins()
            batch = self.scheduler.schedule()
            outputs.extend(self._take_failed())
            if batch:
                self._inflight = self._launch(batch, prev)
            elif prev is None and self.tiers is not None and self.scheduler.waiting and self.tiers.loading():
                self.tiers.wait_for_load(0.01)
            if prev is not None:
                outputs.extend(self._commit_launched(prev))
            nxt = self._inflight
            if nxt is not None and not any(nxt.live(req) for req in nxt.batch.requests):
                outputs.extend(self._commit_launched(nxt))   # every row was withdrawn: nothing to run ahead of
        except BaseException:
            self._abandon()
            raise
        self._snapshot()
        return outputs

    def _take_failed(self) -> list[RequestOutput]:
        """The outputs of the requests the scheduler ended (they do not fit in the KV cache)."""
        outputs = [self._emit(req) for req in self.scheduler.failed]
        self.scheduler.failed.clear()
        return outputs

    def _prepare(self, batch, prev: Step | None = None) -> Step:
        """The step's inputs and sampling requests (engine thread). ``prev``: the launched step whose
        tokens this one reads (overlap scheduling)."""
        inputs = self.runner.prepare(batch, prev.source if prev is not None else None)
        reqs = [batch.requests[i] for i in inputs.samplers]
        drafts = [batch.drafts.get(i, []) for i in inputs.samplers]
        prefill = sum(n for req, n in zip(batch.requests, batch.num_new) if req.num_computed < len(req.prompt_ids))
        step = Step(batch, inputs, reqs, drafts, self._budgets(reqs), prefill)
        step.rows = {id(req): (n, req.num_preemptions) for req, n in zip(batch.requests, batch.num_new)}
        step.run_ahead = self.overlap and self._may_run_ahead(step)
        return step

    def _may_run_ahead(self, step: Step) -> bool:
        """Whether the next step may be scheduled before this one's tokens are known: none of its
        sampling requests has a constraint (its next mask needs this token accepted), verifies a draft
        (it commits a variable number of tokens) or may draft next step (a draft needs the last token)."""
        return all(req.constraint is None and not draft
                   and (self.speculative == "off" or req.params.logprobs is not None)
                   for req, draft in zip(step.reqs, step.drafts))

    def _forward(self, step: Step, prev: Step | None = None) -> StepResult:
        """Run the step's model forward and sample its tokens (the forward thread, with overlap)."""
        started = time.monotonic()
        previous = prev.future.result().tokens if step.inputs.futures else None
        logits = self.runner.execute(step.inputs, previous)
        tokens: list[int] = []
        lps: list = []
        verified = None
        if step.reqs:
            with torch.inference_mode():  # constraints mask the (inference-mode) logits in place
                if any(step.drafts):
                    tokens, lps, verified = self.spec.sample(logits, step.reqs, step.drafts, step.budgets)
                else:
                    tokens, lps = sample(logits, step.reqs, step.budgets)
        return StepResult(tokens, lps, verified, time.monotonic() - started)

    def _launch(self, batch, prev: Step | None) -> Step:
        """Count the step's rows as computed but in flight, put placeholders for the tokens it samples
        when the next step may run ahead of it, and hand it to the forward thread."""
        step = self._prepare(batch, prev)
        step.overlapped = True
        for req, n in zip(batch.requests, batch.num_new):
            req.num_computed += n
            req.num_inflight += n
        if step.run_ahead:
            for j, req in enumerate(step.reqs):
                step.slots[id(req)] = j
                req.output_ids.append(PLACEHOLDER)
                req.pending += 1
                req.finishing = len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len
        step.future = self._worker.submit(self._forward, step, prev)
        return step

    def _commit_launched(self, step: Step) -> list[RequestOutput]:
        """Wait for a launched step's forward and commit it."""
        if self._inflight is step:
            self._inflight = None
        return self._commit(step, step.future.result())

    def _abandon(self) -> None:
        """A step failed: once the forward thread is idle, forget the launched steps; every request is
        back at its last committed step (placeholders dropped, in-flight rows uncounted)."""
        self._worker.wait_idle()
        self._inflight = None
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            req.num_computed -= req.num_inflight
            req.num_inflight = 0
            req.drop_placeholders()
            req.finishing = False

    def _settle(self, step: Step) -> None:
        """The step's forward is done: its rows count as computed, and prefill progress is shared with
        other requests, the chunk that completes the prompt included (a decode step, one token completing
        the sequence, waits for the request's end)."""
        samplers = {id(req) for req in step.reqs}
        now = time.monotonic()
        for req, n in zip(step.batch.requests, step.batch.num_new):
            if not step.live(req):
                continue   # ended, withdrawn or preempted since the step was launched
            if step.overlapped:
                req.num_inflight -= n
            else:
                req.num_computed += n
            charge(self.ledger, req, n, now)
            if (n > 1 or id(req) not in samplers) and req.num_cacheable // self.config.page_size > req.num_tree_pages:
                self.scheduler.cache_request(req)

    def _measure_rates(self, step: Step, elapsed: float) -> None:
        """The engine's recent tokens per second (~10 steps, for a 429's Retry-After) and prefill tokens per
        second on prefill steps of 64+ tokens (what a router weighs a KV transfer against)."""
        if elapsed <= 0:
            return
        rate = sum(step.batch.num_new) / elapsed
        self._tokens_per_s = rate if self._tokens_per_s <= 0 else 0.9 * self._tokens_per_s + 0.1 * rate
        if step.prefill_tokens >= 64:   # short chunks say more about step overhead than prefill
            rate = step.prefill_tokens / elapsed
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
                0.7 * self.prefill_tokens_per_s + 0.3 * rate

    def _commit(self, step: Step, result: StepResult) -> list[RequestOutput]:
        """Append the step's tokens (the token-level stop checks) and emit each sampling request's update."""
        self._settle(step)
        outputs: list[RequestOutput] = []
        returning = 0
        now = time.monotonic()
        for j, req in enumerate(step.reqs):
            if req.finished:
                continue   # aborted while its step was in flight: the token is dropped
            if req.first_token_time is None:
                req.first_token_time = now
                self.prompt_tokens_total += len(req.prompt_ids)
                self.cached_tokens_total += req.cached_tokens or 0
            if step.drafts[j]:
                self.spec.commit(req, step.drafts[j], *result.verified[j], append=self._append_token)
                self.scheduler.rollback(req)   # the pages of the rejected draft slots
            else:
                self._append_token(req, result.tokens[j], result.logprobs[j])
            if req.finished:
                returning += self._finish(req)
            outputs.append(self._emit(req))
        elapsed = result.forward_s if step.overlapped else time.monotonic() - step.launched_at
        self.coalescer.on_step(elapsed, step.prefill_tokens)
        self._measure_rates(step, elapsed)
        if returning:
            self.coalescer.on_finish(returning)
        return outputs

    def _finish(self, req: Request) -> int:
        """Free a request that ended at commit; 1 when it is a session turn whose agent is likely coming
        straight back (the coalescer counts those)."""
        self._withdraw(req)
        self.scheduler.finish(req)
        self.spec.finished(req)
        return int(bool(req.pin_ttl_s) and req.finish_reason in ("stop", "length"))

    def _withdraw(self, req: Request) -> None:
        """A request ended at a step launched ahead of: take it out of the step launched after (its row
        there is not counted, its token there is dropped)."""
        nxt = self._inflight
        row = nxt.rows.pop(id(req), None) if nxt is not None else None
        if row is not None and row[1] == req.num_preemptions:
            req.num_computed -= row[0]
            req.num_inflight -= row[0]
        req.drop_placeholders()

    def _budgets(self, reqs: list[Request]) -> list[int | None] | None:
        """Per request, the tokens it may still emit (this step's included) when its constraint is
        to close within them: ``max_tokens`` left and context left. None when no request closes."""
        if not self.config.close_constrained_outputs or all(r.constraint is None for r in reqs):
            return None
        return [None if r.constraint is None else
                min(r.params.max_tokens - len(r.output_ids), self.max_model_len - r.num_tokens) for r in reqs]

    def _append_token(self, req: Request, tok: int, lp, constraint_accepted: bool = False,
                      check_complete: bool = True) -> None:
        p = req.params
        req.place_token(tok)
        req.pending_ids.append(tok)   # stop tokens included (as vLLM does); their text is not
        if lp is not None:
            req.pending_logprobs.append(lp)
        self.generation_tokens_total += 1
        if req.constraint is not None and not constraint_accepted and not req.constraint.accept(tok):
            req.finish_reason, req.error = "error", "the constraint rejected a sampled token"
            req.status = Status.FINISHED
            return
        eos = tok in self.tokenizer.eos_token_ids and not p.ignore_eos
        if eos or tok in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", (None if eos else tok)
            req.status = Status.FINISHED
        elif check_complete and req.constraint is not None and req.constraint.is_terminated():
            req.finish_reason = "stop"
            req.status = Status.FINISHED
        if not req.finished and (len(req.output_ids) - req.pending >= p.max_tokens
                                 or req.num_known >= self.max_model_len):
            req.finish_reason = "length"
            req.status = Status.FINISHED
        if req.finish_reason == "stop" and req.stop_reason is None and req.constraint is not None \
                and req.constraint.closed_by_budget:
            req.stop_reason = CLOSED_BY_BUDGET

    def _emit(self, req: Request) -> RequestOutput:
        """The update since the last one, in tokens (its text is the output processor's)."""
        out = RequestOutput(
            request_id=req.request_id, text="", token_ids=req.pending_ids,
            finished=req.finished, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens or 0,
            cached_tokens_by_tier=_by_tier(req),
            completion_tokens=len(req.output_ids) - req.pending,
            logprobs=req.pending_logprobs if req.params.logprobs is not None else None, error=req.error)
        req.pending_ids, req.pending_logprobs = [], []
        if req.finished:
            self._requests.pop(req.request_id, None)
            req.finished_at = time.monotonic()
            if req.trace is not None and self.on_finished is not None:
                self.on_finished(req)
        return out

    # -- conveniences ---------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 constraints: list[TokenConstraint | None] | None = None) -> list[GenerationResult]:
        """Run ``prompts`` together to completion (tests, benchmarks, offline use), their text through an
        output processor each (engine/output_processor.py), as a server's streams have it. When the
        waiting queue is full (``EngineOverloaded``) it runs steps until the next prompt is admitted."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids, acc, text = [], {}, {}
        start = time.monotonic()
        done = 0

        def absorb(outputs: list[RequestOutput]) -> int:
            finished = 0
            for raw in outputs:
                r = acc.get(raw.request_id)
                out = text[raw.request_id].process(raw) if r is not None else None
                if out is None:
                    continue
                if out.finished and not raw.finished:   # a stop string: the engine finishes it next step
                    self.stop_request(out.request_id, text[out.request_id].stopped)
                if r.ttft_s is None and out.token_ids:
                    r.ttft_s = time.monotonic() - start
                r.token_ids.extend(out.token_ids)
                r.text += out.text
                if out.logprobs is not None and r.logprobs is not None:
                    r.logprobs.extend(out.logprobs)
                if out.finished:
                    r.finish_reason, r.cached_tokens, r.error = out.finish_reason, out.cached_tokens, out.error
                    r.cached_tokens_by_tier = out.cached_tokens_by_tier
                    r.stop_reason = out.stop_reason
                    finished += 1
            return finished

        for i, prompt in enumerate(prompts):
            while True:
                try:
                    rid = self.add_request(prompt, plist[i], constraint=constraints[i] if constraints else None)
                    break
                except EngineOverloaded:  # something is queued, so a step makes room
                    done += absorb(self.step())
            ids.append(rid)
            text[rid] = OutputProcessor(self.tokenizer, plist[i], self.tokenizer.eos_token_ids)
            acc[rid] = GenerationResult(rid, [], "", None, len(prompt), 0,
                                        [] if plist[i].logprobs is not None else None)
        while done < len(ids):
            done += absorb(self.step())
        while any(rid in self._requests for rid in ids):   # the engine's side of the stop strings found
            self.step()
        return [acc[i] for i in ids]

    def stats(self) -> EngineStats:
        """As of the end of the last step, waiting requests and tokens as of now (safe from any thread)."""
        st = self._stats
        # Waiting requests and tokens as of now: inbox plus the scheduler's queue, read under the lock a
        # request holds while it moves from one to the other (_admit counts the same way). The step's
        # snapshot of the queue would miss a request that left the inbox after it was taken.
        with self._pending_lock:
            waiting = self._pending + len(self.scheduler.waiting)
            tokens = self._pending_tokens + self.scheduler.waiting_tokens
        return dataclasses.replace(st, waiting=waiting, waiting_tokens=tokens)

    def pin_active(self, pin_id: str) -> bool:
        """Whether a pin still holds (it may have expired or given way to memory pressure)."""
        return pin_id in self._pin_ids


def void(_) -> None:
    """Drop a value: a control message's handler that calls a method with a result returns None."""
    return None


def _by_tier(req: Request) -> dict[str, int]:
    """The request's cached prompt tokens by where they were found: the device pool, or loaded back
    from the host or disk tier (they add up to ``cached_tokens``)."""
    cached = req.cached_tokens or 0
    host = min(req.tier_tokens.get("host", 0), cached)
    disk = min(req.tier_tokens.get("disk", 0), cached - host)
    return {"device": cached - host - disk, "host": host, "disk": disk}


def _by_priority(waiting) -> dict[str, int]:
    """Waiting requests by "<priority class>/<new|started>" (engine/session_priority.py, ``priority_class``)."""
    counts: dict[str, int] = {}
    for req in waiting:
        label = f"{priority_class(req.params.priority)}/{'started' if req.started else 'new'}"
        counts[label] = counts.get(label, 0) + 1
    return counts


def _path_pages(node) -> list[int]:
    pages = []
    while node is not None:
        pages.extend(node.pages)
        node = node.parent
    return pages
