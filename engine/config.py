"""Engine configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# The values EngineConfig accepts (public: settings layered on the engine offer the same choices).
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "flashinfer")
EP_PLACEMENTS = ("contiguous", "balanced", "locality")  # engine.moe.placement registers these
SPECULATIVE = ("off", "ngram", "suffix", "auto")
QUANTIZATIONS = ("auto", "off", "int4", "int8", "gguf")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8")   # vLLM's --kv-cache-dtype names
MAX_SPECULATIVE_TOKENS = 16
SCHEDULING_POLICIES = ("fcfs", "session")   # engine/session_priority.py


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """An EngineConfig field with its one-line ``help`` (and the ``choices`` a text field accepts): the one
    declaration the server's flags, environment variables and ``--help`` are generated from
    (agentrt/config.py, ``EngineSettings``)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    """How to build and run one engine.

    ``model``: a ``.gguf`` file or a Hugging Face directory (config.json,
    safetensors, tokenizer.json); ``None`` is the embedded default model.
    ``kv_cache_tokens`` sizes the paged KV pool (``kv_cache_tokens // page_size``
    pages). ``max_batched_tokens`` is the per-step token budget that chunked
    prefill works within; decode tokens count against it too.

    Admission (``EngineOverloaded``, HTTP 429): ``max_waiting`` bounds the requests
    queued for admission; ``max_waiting_tokens`` bounds the KV they will need: the
    tokens of every queued request (prompt, plus output so far for a preempted one).
    ``None`` is twice the pool's token capacity. A request is always admitted when
    nothing is queued, whatever its size (a prompt the pool cannot hold is refused
    with ``InvalidRequest`` instead).

    Scheduling (engine/session_priority.py): ``scheduling_policy="fcfs"`` admits waiting requests in
    arrival order and preempts the youngest; ``"session"`` orders them by explicit priority, then the
    tenant's weighted share, then the least service attained by the request's session, aged by
    ``scheduling_aging_tokens_per_s`` for every second a request waits, and preempts in the reverse order.
    Under ``session`` a new session's first turn is also refused (``EngineOverloaded``) once the queue is
    ``1 - started_session_reserve`` full, so the rest stays for later turns of sessions already running.

    Turn coalescing (engine/coalesce.py; serving loops only, ``AsyncEngine``): after a session
    turn ends, the next step may wait up to ``turn_coalesce_fraction`` of the recent prefill
    step time, at most ``turn_coalesce_max_s``, for the agent's next turn to arrive and join it.
    ``turn_coalesce_max_s=0`` turns it off.

    Speculative decoding (engine/speculative.py): ``speculative="ngram"`` drafts up to
    ``num_speculative_tokens`` tokens per decoding request and step from the request's own
    context (prompt lookup, no draft model) and verifies them in the same forward pass;
    ``"suffix"`` also drafts from the recent outputs of the tenant's other requests on this
    engine. Greedy output is the output without it (token for token in float32; in reduced
    precision a verification's rows may round differently from a decode step's, as a different
    batch does), sampled output has the same distribution. Grammar-constrained requests draft
    (a drafted token the grammar refuses ends the draft); requests with logprobs do not. On every
    attention backend a verification is a short extend chunk (as a prefill chunk over a cached
    prefix is).

    Closing constrained outputs (docs/structured_outputs.md): with ``close_constrained_outputs``
    (the default) a request with a grammar constraint always ends with complete, valid output
    within ``max_tokens`` and the context window: when the budget left reaches what closing the
    structure takes, the shortest closing found is forced, and a ``max_tokens`` too small for any
    valid output is refused (``InvalidRequest``). Off, such output is cut at ``max_tokens``
    (``finish_reason="length"``), as before; it exists for comparisons (benchmarks/constrained_budget.py)
    and for benchmarks that decode grammars which cannot complete in their budget.

    KV tiers (engine/kv_tier.py, docs/kv_tiers.md): pages the radix cache evicts go to a host
    memory tier of ``kv_host_tokens`` tokens, then to a disk tier of ``kv_disk_tokens`` tokens (one
    file per page under ``kv_disk_path``, default a new directory under the system's temp directory,
    logged at start; emptied at shutdown unless ``kv_disk_keep``), and come back from there instead
    of being recomputed. 0 turns a tier off (the engine library's default: both off).
    ``kv_disk_drop_page_cache`` fsyncs each page file and drops it from the OS page cache after
    writing, so reads come from the device (benchmarks/kv_tiers.py's cold disk tier).

    Weight-only quantization (engine/models/quant.py, dense models on the CPU): ``int4`` keeps the
    attention and MLP weights as 4-bit groups of 32 (a GGUF file's Q4_0 / Q4_1 blocks as stored, other
    weights quantized round-to-nearest) and ``int8`` as 8 bits per output row; with either the LM head
    is 8-bit per row, and the matmuls run in bfloat16 activations (torch's CPU packed kernels).
    ``auto`` is ``int4`` for a GGUF file whose layer weights are Q4_0 / Q4_1, served on the CPU in
    bfloat16 (a decode step then reads a quarter of the bf16 bytes), and ``off`` otherwise: float32
    stays exact, and a checkpoint stored in full precision is not quantized unless asked.
    ``gguf`` (engine/models/qlinear.py) multiplies decode steps (at most ``MAX_QUANT_ROWS`` rows) on the
    file's own blocks (Q4_0 / Q4_1 / Q4_K layers as 4-bit blocks of 32; layers stored wider, Q5_K / Q6_K / Q8_0
    as in Q4_K_M files, as 8-bit blocks, a fused layer with such a part all in 8 bits; a Q8_0 LM head; other
    weights quantized to Q4_1 / Q8_0) with
    activations quantized to 8 bits per block of 32 and integer dot products (a C kernel), and longer
    steps on the dense weights in ``dtype``, or on the blocks too where that measured faster on this CPU
    (engine/models/cpu_pick.py ``pick_prefill_on_blocks``; the dense weights are then released). With
    ``dtype="auto"`` too, ``auto`` on the CPU is measured: the fastest of ``off``, ``int4`` (bfloat16 only, and
    only where every layer is 4-bit) and ``gguf`` at this model's shapes, once per CPU (engine/models/cpu_pick.py).

    C kernels on the CPU (engine/cpu_build.py): with ``cpu_kernels`` (the default) decode attention
    (torch backend) goes through a C kernel that reads each row's own pages in place
    (engine/attention/cpu_kernel.py), as do each layer's RoPE and K/V write (one call); bfloat16 steps, and
    float32 steps on quantized weights (float32 on dense weights keeps torch's elementwise ops), add each
    layer's output to the residual stream and take the next RMSNorm in one call, and
    SwiGLU's activation in another (engine/models/cpu_ops.py); both libraries are compiled on first use by the
    system C compiler. Where they cannot be built the engine logs why and runs the
    pure-torch paths, as it does with False. float32 on dense weights runs its projections and LM head through
    oneDNN's packed GEMM where that measured faster than ``F.linear`` on this machine (MKL's generic path on
    AMD CPUs: engine/models/packed_linear.py); float32 either way, equal to ``F.linear``'s within rounding.

    KV cache precision (docs/kv_cache.md): ``kv_cache_dtype`` ``auto`` stores K/V in the activation
    dtype; ``bfloat16`` / ``float32`` store that dtype whatever the activations; ``int8`` stores each
    token's K and V row per KV head as int8 values and one float32 scale (symmetric absmax), written
    quantized by the RoPE + store step and read by every attention path without a dequantized pool
    (torch backend only). ``fp8`` is refused (no kernel here reads it; FlashInfer's is not wired).
    ``kv_cache_memory_bytes``, when set, sizes the pool by bytes instead of ``kv_cache_tokens``: as many
    pages as fit at the chosen precision (int8 holds ~3.8x the tokens of float32, ~1.9x of bfloat16).

    Sliding windows (engine/window_pool.py): with ``sliding_window_cache`` (the default) a model's sliding
    layers keep KV pages only within their window, in a second pool of ``sliding_window_pool_windows``
    windows (default two per sequence of a full batch) plus a step's chunk; ``kv_cache_tokens`` (or what
    ``kv_cache_memory_bytes`` leaves after that pool) sizes the full layers' pages. Off, every layer keeps
    the whole context (what KV moves between workers need: they are refused with it on; KV tiers keep a
    block without its sliding part where the window dropped it, docs/kv_tiers.md). Models without
    sliding layers are unaffected.

    Overlap scheduling (engine/overlap.py): with ``overlap_schedule`` the model forward and sampling run on
    a forward thread, and the engine thread schedules and prepares step n+1 while step n runs, committing
    step n's tokens (stop checks, detokenizing, emitting) one step behind. A step whose sampling requests
    have a grammar constraint, verify a draft or may draft next step is committed before the next is
    scheduled. Greedy output is the output without it.

    Expert parallelism (MoE models only, docs/moe.md): ``ep_size`` ranks, this process
    being rank 0, laid out as ``ep_nodes`` x ``ep_size // ep_nodes``; ``ep_placement``
    (``contiguous`` | ``balanced`` | ``locality``) lays out ``num_experts + ep_redundant``
    expert slots, which ``ep_size`` must divide.
    """

    model: str | None = setting(None, "a .gguf file or a Hugging Face model directory (default: the embedded "
                                "SmolLM2-135M-Instruct)")
    served_model_name: str | None = setting(None, "the model name clients send and /v1/models lists (default: "
                                            "from the model files)")
    device: str = setting("auto", "where the engine runs: cpu, cuda, or auto (cuda when available)", DEVICES)
    dtype: str = setting("float32", "weights and KV cache precision: float32, bfloat16, float16, or auto "
                         "(bfloat16 on CUDA and on CPUs with AVX512-BF16/AMX, else float32)", DTYPES)
    attention_backend: str = setting("auto", "attention kernels: torch, flashinfer (CUDA), or auto (flashinfer "
                                     "on CUDA, else torch)", BACKENDS)
    page_size: int = setting(16, "tokens per KV page; a router's --block-size must equal it")
    kv_cache_tokens: int = setting(131072, "tokens the paged KV cache holds (sizes its memory)")
    max_num_seqs: int = setting(64, "most sequences in one engine step (the batch)")
    max_batched_tokens: int = setting(512, "tokens one step computes at most (chunked prefill works within it)")
    max_model_len: int | None = setting(None, "context window in tokens (default: the model's)")
    max_waiting: int = setting(1024, "requests queued for the engine before new ones get 429")
    max_waiting_tokens: int | None = setting(None, "prompt tokens queued for the engine before new requests get "
                                             "429 (default: twice the KV cache)")
    scheduling_policy: str = setting("fcfs", "order of admission and preemption: fcfs (arrival order) or session "
                                     "(explicit priority, then the tenant's weighted fair share, then the least "
                                     "service attained by the request's agent session, with aging)",
                                     SCHEDULING_POLICIES)
    scheduling_aging_tokens_per_s: float = setting(256.0, "with scheduling_policy session: tokens of attained "
                                                   "service forgiven per second a request waits, so a long "
                                                   "session still overtakes newcomers and never starves")
    started_session_reserve: float = setting(0.25, "with scheduling_policy session: the share of the waiting "
                                             "queue (max_waiting, max_waiting_tokens) kept for later turns of "
                                             "started sessions; a new session's first turn gets 429 past the rest")
    turn_coalesce_max_s: float = setting(0.2, "how long the engine may hold its next step after a session turn "
                                         "ends, for the agent's next turn to join (0: off)")
    turn_coalesce_fraction: float = setting(0.1, "that hold as a fraction of the recent prefill step time")
    enable_prefix_cache: bool = setting(True, "reuse cached KV of earlier prompts' prefixes (false computes every "
                                        "prompt in full, for ablations)")
    seed: int = setting(0, "seed of the sampler's random generator")
    ep_size: int = setting(1, "expert-parallel ranks for MoE models (this process is rank 0)")
    ep_nodes: int = setting(1, "nodes the expert-parallel ranks are laid out over")
    ep_placement: str = setting("contiguous", "how experts are placed on ranks: contiguous, balanced or locality",
                                EP_PLACEMENTS)
    ep_redundant: int = setting(0, "extra expert slots for replicas of hot experts")
    speculative: str = setting("off", "speculative decoding: off, ngram (drafts from the request's own context, "
                               "verified in the same step; greedy output unchanged), suffix (ngram, and the recent "
                               "outputs of the tenant's other requests on the engine) or auto (suffix on the CPU, "
                               "where docs/benchmarking.md measured it, off on a GPU)", SPECULATIVE)
    num_speculative_tokens: int = setting(4, "most draft tokens a request verifies per step with speculative "
                                          "ngram or suffix")
    quantization: str = setting("auto", "weight-only quantization on the CPU: int4, int8 (torch's bf16 packed "
                                "kernels), gguf (the GGUF's own Q4/Q8 blocks x 8-bit activations in a C kernel), "
                                "off, or auto (with dtype auto and a Q4_0/Q4_1/Q4_K GGUF, or a K-quant mix such as "
                                "Q4_K_M: the fastest of off, int4 and "
                                "gguf measured once per CPU; int4 for such a GGUF in bfloat16; off otherwise, "
                                "float32 included)", QUANTIZATIONS)
    cpu_kernels: bool = setting(True, "on the CPU, decode attention and the bf16 residual add + RMSNorm through C "
                                "kernels built on first use by the system C compiler (false, or no compiler: the "
                                "pure-torch paths)")
    close_constrained_outputs: bool = setting(True, "a grammar-constrained reply always ends complete and valid "
                                              "within max_tokens (false: cut at max_tokens, for comparisons)")
    kv_host_tokens: int = setting(0, "tokens of KV the host memory tier below the pool holds (pinned CPU memory; "
                                  "for a GPU pool; 0: off)")
    kv_disk_tokens: int = setting(0, "tokens of KV the disk tier below the pool holds: evicted pages are kept there "
                                  "and loaded back instead of recomputed (one file per page, at most half the "
                                  "disk's free space; 0: off, the default until a measurement shows it wins, "
                                  "docs/kv_tiers.md)")
    kv_disk_path: str | None = setting(None, "directory of the disk tier's files (default: a new one under the "
                                       "system temp directory, logged at start)")
    kv_disk_keep: bool = setting(False, "keep the disk tier's files at shutdown (the next start with the same "
                                 "--kv-disk-path serves them; default: deleted)")
    kv_disk_drop_page_cache: bool = setting(False, "fsync each disk-tier page and drop it from the OS page cache "
                                            "after writing, so reads come from the device (a cold disk tier, as "
                                            "benchmarks/kv_tiers.py measures it); off, the OS caches them")
    kv_cache_dtype: str = setting("auto", "KV cache precision: auto (the activations' dtype), bfloat16, float32, "
                                  "int8 (8-bit pages, a scale per token and KV head: ~1.9x the tokens of bfloat16 "
                                  "a byte, docs/kv_cache.md) or fp8 (refused: not implemented)", KV_CACHE_DTYPES)
    kv_cache_memory_bytes: int | None = setting(None, "size the KV cache by bytes instead of kv_cache_tokens (as "
                                                "many tokens as fit at kv_cache_dtype)")
    sliding_window_cache: bool = setting(True, "a model's sliding-window layers keep only their window's KV pages "
                                         "(Gemma 3, gpt-oss, Mistral; docs/models.md); false keeps every layer's "
                                         "whole context, as for a model without windows")
    sliding_window_pool_windows: int | None = setting(None, "with sliding_window_cache: how many windows the sliding "
                                                      "layers' page pool holds (default: 2 x max_num_seqs), plus one "
                                                      "step's chunk")
    overlap_schedule: bool = setting(False, "overlap scheduling: prepare the next step (schedule, build inputs) "
                                     "and commit the last one's tokens while the model runs on a forward thread; "
                                     "steps with constrained or speculative requests still wait for their tokens "
                                     "(engine/overlap.py; off by default until a measurement shows it wins)")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} or 'cuda:N', got {self.device!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.page_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"page_size must be a power of two from 1 to 128, got {self.page_size}")
        if self.kv_cache_tokens < 4 * self.page_size:
            raise ValueError(f"kv_cache_tokens must hold at least 4 pages, got {self.kv_cache_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_batched_tokens < self.page_size:
            raise ValueError(f"max_batched_tokens must be >= page_size, got {self.max_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.turn_coalesce_max_s < 0 or not 0 <= self.turn_coalesce_fraction <= 1:
            raise ValueError(f"turn_coalesce_max_s must be >= 0 and turn_coalesce_fraction in [0, 1], "
                             f"got {self.turn_coalesce_max_s} and {self.turn_coalesce_fraction}")
        if self.max_waiting_tokens is not None and self.max_waiting_tokens < 1:
            raise ValueError(f"max_waiting_tokens must be >= 1, got {self.max_waiting_tokens}")
        self._validate_scheduling()
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {SPECULATIVE}, got {self.speculative!r}")
        if not isinstance(self.num_speculative_tokens, int) or \
                not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization in ("int4", "int8", "gguf") and self.resolved_device() != "cpu":
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU only (torch's CPU packed "
                             f"kernels, the C kernel of 'gguf'); on {self.resolved_device()} use 'off'")
        if self.quantization in ("int4", "int8", "gguf") and self.ep_size > 1:
            raise ValueError("quantization applies to dense models; with ep_size > 1 use 'off'")
        for name in ("kv_host_tokens", "kv_disk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: no such tier), got {value!r}")
            if 0 < value < self.page_size:
                raise ValueError(f"{name} must be 0 or at least one page ({self.page_size} tokens), got {value}")
        if self.kv_disk_path is not None and os.path.exists(self.kv_disk_path) and not os.path.isdir(self.kv_disk_path):
            raise ValueError(f"kv_disk_path must be a directory (it is created if missing), got the file "
                             f"{self.kv_disk_path!r}")
        if not isinstance(self.overlap_schedule, bool):
            raise ValueError(f"overlap_schedule must be true or false, got {self.overlap_schedule!r}")
        self._validate_kv_cache()
        self._validate_expert_parallel()

    def _validate_scheduling(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        aging = self.scheduling_aging_tokens_per_s
        if isinstance(aging, bool) or not isinstance(aging, (int, float)) or not 0 <= aging < float("inf"):
            raise ValueError(f"scheduling_aging_tokens_per_s must be a finite number >= 0, got {aging!r}")
        reserve = self.started_session_reserve
        if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0 <= reserve < 1:
            raise ValueError(f"started_session_reserve must be in [0, 1), got {reserve!r}")

    def _validate_kv_cache(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8":
            raise ValueError("kv_cache_dtype='fp8' is not implemented: no CPU kernel reads fp8 pages and the "
                             "FlashInfer fp8 path is not wired; use 'int8' (8-bit pages, torch backend), "
                             "'bfloat16', 'float32' or 'auto'")
        if self.kv_cache_dtype == "int8" and self.resolved_backend() != "torch":
            raise ValueError(f"kv_cache_dtype='int8' needs the torch attention backend, got "
                             f"{self.resolved_backend()!r}")
        w = self.sliding_window_pool_windows
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"sliding_window_pool_windows must be a positive integer (or None), got {w!r}")
        m = self.kv_cache_memory_bytes
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer (or None: kv_cache_tokens "
                             f"sizes the pool), got {m!r}")

    def _validate_expert_parallel(self) -> None:
        for name in ("ep_size", "ep_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.ep_size % self.ep_nodes:
            raise ValueError(f"ep_size ({self.ep_size}) must be a multiple of ep_nodes ({self.ep_nodes})")
        if self.ep_placement not in EP_PLACEMENTS:
            raise ValueError(f"ep_placement must be one of {EP_PLACEMENTS}, got {self.ep_placement!r}")
        if not isinstance(self.ep_redundant, int) or self.ep_redundant < 0:
            raise ValueError(f"ep_redundant must be an integer >= 0, got {self.ep_redundant!r}")

    @property
    def num_pages(self) -> int:
        return self.kv_cache_tokens // self.page_size

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds (page 0 is reserved scratch space)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def waiting_tokens_limit(self) -> int:
        """``max_waiting_tokens``, or its default: twice the pool's token capacity."""
        return self.max_waiting_tokens if self.max_waiting_tokens is not None else 2 * self.pool_tokens

    def resolved_dtype(self) -> str:
        """``auto``: bfloat16 on CUDA and on CPUs with native bf16 dot products (AVX512-BF16 or AMX),
        where it runs the default model's decode 2-3x faster than float32 (benchmarks/step_overhead.py);
        float32 elsewhere, where bf16 matmuls are emulated and slower."""
        if self.dtype != "auto":
            return self.dtype
        if self.resolved_device().startswith("cuda") or cpu_has_native_bf16():
            return "bfloat16"
        return "float32"

    def resolved_kv_cache_dtype(self) -> str:
        """``auto``: the activation dtype (``resolved_dtype``)."""
        return self.resolved_dtype() if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def resolved_quantization(self, weight_types: set[str] | None = None) -> str:
        """``auto``: ``int4`` when the model is a GGUF file whose layer weights are all 4-bit (Q4_0, Q4_1,
        Q4_K; ``weight_types``, as ``engine.loader.gguf_weight_types`` reads them) and it runs on the CPU in
        bfloat16 with torch's packed kernels available; else ``off``. With ``dtype="auto"`` a file of 4-bit
        layers, or of the K-quant mixes of 4-bit and wider ones (Q4_K_M: some Q6_K), gets the fastest of the
        paths measured on this CPU (engine/models/cpu_pick.py)."""
        if self.quantization != "auto":
            return self.quantization
        from engine.loader import blocks_servable
        from engine.loader.gguf_file import Q4_TYPES
        from engine.models.quant import kernels_available

        if not (weight_types and blocks_servable(weight_types) and self.resolved_device() == "cpu"):
            return "off"
        four_bit = weight_types <= set(Q4_TYPES)
        if self.dtype == "auto":
            from engine.models.cpu_pick import pick_quantization
            return pick_quantization(self.model, self.resolved_dtype(), four_bit)
        return "int4" if four_bit and self.resolved_dtype() == "bfloat16" and kernels_available() else "off"

    def resolved_speculative(self) -> str:
        """``auto``: ``suffix`` on the CPU, where benchmarks/speculative.py chose it
        (docs/benchmarking.md), ``off`` elsewhere (not measured on a GPU yet)."""
        if self.speculative != "auto":
            return self.speculative
        return "suffix" if self.resolved_device() == "cpu" else "off"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "flashinfer" if self.resolved_device().startswith("cuda") else "torch"


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 dot products natively (x86 AVX512-BF16 or AMX-BF16 flags;
    ``cpuinfo`` is /proc/cpuinfo's text, read when not given). Unknown (no /proc/cpuinfo): False."""
    from engine.cpu_info import has_native_bf16
    return has_native_bf16(cpuinfo)
