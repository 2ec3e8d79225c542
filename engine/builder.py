"""Building an engine: from an ``EngineConfig`` to the typed parts the engine core runs.

``build_engine`` loads the model and its tokenizer (engine/loader/), sizes the KV pool (a windowed one
where layers slide in the cache, engine/window_pool.py), and builds the radix cache, the scheduler, the
KV tiers, the KV control operations and mover, the attention backend and model runner, and speculative
decoding, each wired to the others here and nowhere else. With overlap scheduling it runs on the forward
thread (``LLMEngine.__init__``), so the thread that loaded the model runs it.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.attention import backend_class
from engine.config import EngineConfig
from engine.cpu_info import cpu_model
from engine.kv_control import KVControl, Seeds
from engine.kv_move import KVLayout, KVMover, model_fingerprint
from engine.kv_pool import KVCache, PagePool, kv_bytes_per_token, pool_pages
from engine.kv_tier import DiskTier, HostTier, KVTiers
from engine.loader import gguf_model_config, gguf_weight_types, load_model_files
from engine.loader.gguf_file import gguf_headers_kept
from engine.model_runner import ModelRunner
from engine.models import build_model
from engine.models.quant import MAX_QUANT_ROWS
from engine.overlap import ForwardWorker
from engine.radix_cache import RadixCache
from engine.scheduler import Scheduler
from engine.session_priority import SESSION, ServiceLedger, SessionOrder
from engine.speculative import SpeculativeDecoder
from engine.step_cost import step_cost_for
from engine.stop_checks import StopRule
from engine.window_pool import WindowedPagePool, size_windowed_pools

_log = logging.getLogger("engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


@dataclass(frozen=True)
class Model:
    """A loaded model and what was resolved to load it."""
    model: Any
    tokenizer: Any
    model_config: Any
    model_id: str
    max_model_len: int
    device: str
    dtype: torch.dtype
    quantization: str
    ep: Any                     # the expert-parallel ranks (MoE, ep_size > 1), or None
    prefill_on_blocks: bool = False   # gguf prefill chunks run on the blocks (measured faster here)
    packed_linear: bool = False       # float32 projections through oneDNN's packed linear (measured faster here)


@dataclass(frozen=True)
class EngineParts:
    """What the engine core runs, built and wired together."""
    model: Model
    pool: PagePool
    kv: KVCache
    window_layers: tuple[int, ...]       # sliding layers whose pages keep only their window
    cache: RadixCache
    scheduler: Scheduler
    tiers: KVTiers | None
    ledger: ServiceLedger
    kv_control: KVControl
    mover: KVMover
    runner: ModelRunner
    spec: SpeculativeDecoder
    backend_name: str
    attention_desc: str
    active_kernels: dict[str, bool]      # the CPU kernels this engine runs (engine/cpu_build.py KERNELS)
    waiting_tokens_limit: int


def build_engine(config: EngineConfig, on_kv_event: Callable | None = None, kv_event_tokens: bool = False,
                 worker: ForwardWorker | None = None) -> EngineParts:
    """Load the model; build the KV pool, radix cache, scheduler, tiers, model runner and speculative
    decoding. ``on_kv_event``: the radix cache's and tiers' block events (contract 2)."""
    m = load_model(config)
    backend_name = config.resolved_backend()
    backend_cls = backend_class(backend_name)
    layer_attention = m.model.layer_attention()
    window_layers = _window_layers(config, layer_attention, backend_cls.kv_layout)
    pool, kv = _kv_pool(config, m, layer_attention, window_layers, backend_cls.kv_layout)
    seeds = Seeds(m.model_id)
    cache = RadixCache(pool, config.page_size, seeds, on_event=on_kv_event, event_tokens=kv_event_tokens)
    scheduler = Scheduler(pool, cache, config.page_size, config.max_num_seqs, config.max_batched_tokens,
                          config.enable_prefix_cache)
    tiers = _tiers(config, kv, m.device, on_kv_event)
    control = KVControl(kv, pool, cache, scheduler, tiers, seeds, config.page_size, window_layers, worker)
    if tiers is not None:
        cache.on_evict = control.offload
        scheduler.tiers, scheduler.write_page = tiers, control.write_page
    control.mover = KVMover(kv, pool, cache, config.page_size, kv_layout(config, m, kv), tiers,
                            write_page=control.write_page)
    ledger = ServiceLedger()   # tokens computed per session and tenant, and the order they give
    if config.scheduling_policy == SESSION:
        scheduler.order = SessionOrder(ledger, config.scheduling_aging_tokens_per_s)
    scheduler.ledger = ledger
    scheduler.stop = StopRule(frozenset(m.tokenizer.eos_token_ids), m.max_model_len)
    runner, kernels, desc = _runner(config, m, kv, pool, window_layers, backend_name, backend_cls, layer_attention)
    spec = _speculative(config, m, scheduler)
    # max_waiting_tokens, or twice the pool (sized by tokens, or by bytes at the KV precision)
    limit = config.max_waiting_tokens or 2 * (pool.num_pages - 1) * config.page_size
    _log.info("model %s, %s on %s, weights %s, attention %s, speculative %s, %d torch threads, C kernels "
              "active: %s", m.model_id, config.resolved_dtype(), m.device, m.quantization, desc, spec.mode,
              torch.get_num_threads(), ", ".join(k for k, on in kernels.items() if on) or "none")
    return EngineParts(m, pool, kv, window_layers, cache, scheduler, tiers, ledger, control, control.mover, runner,
                       spec, backend_name, desc, kernels, limit)


def load_model(config: EngineConfig) -> Model:
    """The model and its tokenizer, in the resolved dtype, device and weight format; a GGUF file's header
    parsed once for all of it (``gguf_headers_kept``)."""
    with gguf_headers_kept():
        return _load_model(config)


def _load_model(config: EngineConfig) -> Model:
    device = config.resolved_device()
    dtype = DTYPES[config.resolved_dtype()]
    quantization = config.resolved_quantization(gguf_weight_types(config.model))
    blocks_only = _blocks_only(config, device, dtype, quantization)
    mcfg, state, tok, model_id, int4_groups = load_model_files(config.model, dtype,
                                                               int4_groups=quantization in ("int4", "gguf"),
                                                               dense_blocks=not blocks_only)
    max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    ep = None
    if config.ep_size > 1:
        model, ep = _expert_parallel(config, mcfg, state, dtype, device)
    else:
        model = build_model(mcfg, state, dtype, device, quantization, int4_groups)
    on_blocks = False
    if quantization == "gguf" and device == "cpu":   # prefill chunks too, where measured faster
        from engine.models.cpu_pick import pick_prefill_path
        on_blocks = pick_prefill_path(model, dtype, dense_read=not blocks_only)
    if blocks_only and not on_blocks:   # its block layers' dense weights were never read: they cannot run
        raise RuntimeError("the model was loaded for prefill on its blocks and picked the dense weights")
    packed = ep is None and _pack_projections(config, model, device, dtype, quantization)
    model.rope.fit_context(max_model_len)   # longrope: its long table only past the original length
    return Model(model, tok, mcfg, config.served_model_name or model_id, max_model_len, device, dtype,
                 quantization, ep, on_blocks, packed)


def _blocks_only(config: EngineConfig, device: str, dtype: torch.dtype, quantization: str) -> bool:
    """Whether a GGUF model's layers served on their blocks need no dense weights at all: where every step,
    prefill chunks too, runs them on the blocks (``prefill_runs_on_blocks``: the pick ``pick_prefill_path``
    makes after the build) and the build then drops those weights (``RELEASE_DENSE``), the loader does not
    decode them: the default model's build on a 2-core Zen 3 EPYC 1.58 -> 0.97 s, its process's peak RSS
    1466 -> 793 MB (benchmarks/engine_start.py ``--compare dense-load``, docs/benchmarking.md)."""
    from engine.models import FAMILY_BUILDERS, qlinear

    if quantization != "gguf" or device != "cpu" or config.ep_size > 1 or not qlinear.RELEASE_DENSE:
        return False
    from engine.models.qmatmul import load
    if load() is None:   # no kernel to time or serve the blocks with: the build says so (quantize_model_blocks)
        return False
    mcfg = gguf_model_config(config.model)
    if mcfg is None or mcfg.moe or mcfg.architecture in FAMILY_BUILDERS:
        return False
    from engine.models.cpu_pick import prefill_runs_on_blocks
    return prefill_runs_on_blocks(mcfg, dtype)


def _pack_projections(config: EngineConfig, model, device: str, dtype: torch.dtype, quantization: str) -> bool:
    """Dense float32 projections on the CPU through oneDNN's packed linear, where it measured faster than
    ``F.linear`` on this machine (engine/models/packed_linear.py); returns whether they run so."""
    if device != "cpu" or dtype != torch.float32 or quantization != "off" or not config.cpu_kernels:
        return False
    from engine.models.cpu_pick import pick_packed_linear
    from engine.models.packed_linear import available, pack_dense_projections, step_shapes

    if not available() or not hasattr(model, "layers"):
        return False
    if not pick_packed_linear(tuple(sorted(step_shapes(model).items()))):
        return False
    return pack_dense_projections(model) > 0


def _expert_parallel(config: EngineConfig, mcfg, state, dtype, device: str):
    """The MoE model of rank 0 and its expert-parallel group: the other ranks start here and stop in
    ``LLMEngine.close``."""
    if not mcfg.moe:   # dense models, and gpt-oss whose MoE block is its own (engine/models/gpt_oss.py)
        raise ValueError(f"ep_size > 1: expert parallelism serves Mixtral / Qwen MoE models, "
                         f"not {mcfg.architecture!r}")
    from engine.models.moe_model import build_moe_model
    from engine.moe.ep_group import ExpertParallelGroup

    ep = ExpertParallelGroup.launch(config, mcfg, dtype, device)
    try:
        return build_moe_model(mcfg, state, dtype, device, ep=ep), ep
    except BaseException:
        ep.close()
        raise


def _window_layers(config: EngineConfig, layer_attention, kv_layout: str) -> tuple[int, ...]:
    """The sliding layers whose pages keep only their window (engine/window_pool.py): none without such
    layers, with ``sliding_window_cache`` off, or on a backend that refuses windows anyway."""
    layers = tuple(i for i, a in enumerate(layer_attention) if a.window is not None)
    if not layers or not config.sliding_window_cache or kv_layout != "HSD":
        return ()
    return layers


def _kv_pool(config: EngineConfig, m: Model, layer_attention, window_layers: tuple[int, ...],
             kv_layout: str) -> tuple[PagePool, KVCache]:
    """The page pool and the KV cache tensors: one pool, or page ids for the full layers and a
    window-bounded pool for the sliding ones, sized together."""
    mc, P = m.model_config, config.page_size
    kv_dtype = DTYPES[config.resolved_kv_cache_dtype()]
    if not window_layers:
        num_pages = pool_pages(config, kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype))
        return PagePool(num_pages), KVCache(mc.num_layers, num_pages, P, mc.num_kv_heads, mc.head_dim, m.dtype,
                                            m.device, layout=kv_layout, kv_dtype=kv_dtype)
    window = max(layer_attention[i].window for i in window_layers)
    n_window = len(window_layers)
    full_bpt = kv_bytes_per_token(mc.num_layers - n_window, mc.num_kv_heads, mc.head_dim, kv_dtype)
    window_bpt = kv_bytes_per_token(n_window, mc.num_kv_heads, mc.head_dim, kv_dtype)
    num_pages, window_pages = size_windowed_pools(config, window, full_bpt, window_bpt)
    kv = KVCache(mc.num_layers, num_pages, P, mc.num_kv_heads, mc.head_dim, m.dtype, m.device, layout="HSD",
                 kv_dtype=kv_dtype, window_layers=window_layers, window_pages=window_pages)
    _log.info("sliding window %d in the cache: layers %s hold %d pages (%d tokens), the others %d pages",
              window, list(window_layers), window_pages, (window_pages - 1) * P, num_pages)
    return WindowedPagePool(num_pages, window_pages, window), kv


def _tiers(config: EngineConfig, kv: KVCache, device: str, on_kv_event) -> KVTiers | None:
    """The KV tiers the config asks for. They hold blocks as the pool stores them (int8 pages with their
    scales, as bytes): whole, or, where the sliding layers keep only their window, partial (the full
    layers only; docs/kv_tiers.md)."""
    cfg = config
    if not (cfg.kv_host_tokens or cfg.kv_disk_tokens) or not cfg.enable_prefix_cache:
        return None

    def tier_event(kind: str, hashes: list[int], medium: str) -> None:
        if on_kv_event is not None:
            on_kv_event(kind, hashes, None, medium=medium)
    shape, dtype, partial = kv.page_shape, kv.page_dtype, kv.partial_page_shape
    host = disk = None
    if cfg.kv_host_tokens:
        host = HostTier(cfg.kv_host_tokens // cfg.page_size, shape, dtype, pin=device.startswith("cuda"),
                        partial_shape=partial)
    if cfg.kv_disk_tokens:
        disk = DiskTier(cfg.kv_disk_path, cfg.kv_disk_tokens // cfg.page_size, shape, dtype,
                        keep=cfg.kv_disk_keep, on_event=tier_event,
                        drop_page_cache=cfg.kv_disk_drop_page_cache, partial_shape=partial)
    tiers = KVTiers(host, disk, on_event=tier_event)
    if disk is not None:
        atexit.register(tiers.close)   # the directory is emptied even if close() is never called
    return tiers


def kv_layout(config: EngineConfig, m: Model, kv: KVCache) -> KVLayout:
    """What a page of this pool is, for transfers between engines (engine/kv_move.py)."""
    mc = m.model_config
    return KVLayout(model_fingerprint(m.model_id, mc, config.resolved_dtype(), m.quantization),
                    str(kv.page_dtype).removeprefix("torch."), tuple(kv.page_shape),
                    config.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, kv.layout)


def _runner(config: EngineConfig, m: Model, kv: KVCache, pool, window_layers, backend_name: str, backend_cls,
            layer_attention) -> tuple[ModelRunner, dict[str, bool], str]:
    """The attention backend and the model runner; which C kernels they run, and their description."""
    mc = m.model_config
    kernel = {"cpu_kernel": config.cpu_kernels} if backend_name == "torch" else {}
    attn = backend_cls(kv=kv, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, **kernel)
    attn.set_layer_attention(layer_attention)   # windows, sinks, ...: refused if unsupported
    runner = ModelRunner(m.model, attn, config.page_size, m.device,
                         window_page=pool.window_page if window_layers else None,
                         window=pool.window if window_layers else None)
    # bfloat16 steps, and float32 steps on quantized weights (already inexact: 8-bit activations);
    # float32 on dense weights keeps torch's elementwise ops (its projections: _pack_projections)
    fused = m.device == "cpu" and hasattr(m.model, "use_cpu_ops") and \
        (m.dtype == torch.bfloat16 or (m.dtype == torch.float32 and m.quantization != "off")) and \
        m.model.use_cpu_ops(config.cpu_kernels)
    # bfloat16 and float32 decode steps on 4-bit blocks: the layers in one C call (engine/models/decode_step.py)
    one_call = bool(fused) and m.quantization == "gguf" and m.model.use_decode_step(config.cpu_kernels, attn)
    decode_kernel, prefill_kernel = getattr(attn, "kernel", None), getattr(attn, "prefill_kernel", None)
    kernels = {"decode_attention": decode_kernel is not None, "prefill_attention": prefill_kernel is not None,
               "layer_ops": bool(fused), "qmatmul": m.quantization == "gguf", "decode_step": one_call,
               "packed_linear": m.packed_linear}
    desc = (backend_name + (" + CPU decode kernel, RoPE + KV write" if decode_kernel else "")
            + (" + CPU prefill kernel" if prefill_kernel else "")
            + (" + fused add/RMSNorm, SiLU-multiply" if fused else "")
            + (" + decode layers in one C call" if one_call else "")
            + (" + oneDNN packed float32 linear" if m.packed_linear else ""))
    return runner, kernels, desc


def step_cost_setup(config: EngineConfig, device: str, quantization: str, packed_linear: bool = False) -> dict:
    """What a step-cost measurement must match to apply here (engine/step_cost.py)."""
    return {"device": device, "cpu_model": cpu_model() if device == "cpu" else device,
            "dtype": config.resolved_dtype(), "quantization": quantization, "torch_threads": torch.get_num_threads(),
            "packed_linear": packed_linear}


def _speculative(config: EngineConfig, m: Model, scheduler: Scheduler) -> SpeculativeDecoder:
    """Speculative decoding (engine/speculative.py) as configured, and the scheduler hooks it needs."""
    mode = config.resolved_speculative()
    # a verification's cost in decode steps, for the draft-length rule (engine/step_cost.py)
    step_cost, why = step_cost_for(step_cost_setup(config, m.device, m.quantization, m.packed_linear))
    spec = SpeculativeDecoder(mode, config.num_speculative_tokens, step_cost, m.max_model_len)
    scheduler.spec = spec
    if mode != "off":
        _log.info("speculative step cost (fixed, per draft) %s: %s", step_cost, why)
        scheduler.propose = spec.propose
        # quantized layers run steps of more rows on their bf16 copies, at 2-3x a row's cost:
        # drafts never take a step past that (a step already past it drafts freely)
        scheduler.draft_rows_cap = MAX_QUANT_ROWS if m.quantization != "off" else None
    return spec
