"""``quantization="auto"`` with ``dtype="auto"`` on the CPU: the fastest path for this machine, by measurement.

The candidates for a GGUF file whose layer weights are Q4_0 / Q4_1, in the dtype already resolved
(bfloat16 where the CPU has native bf16 dot products, float32 elsewhere): ``off`` (dense matmuls in that
dtype), ``int4`` (torch's packed kernel; bfloat16 only, where torch has it) and ``gguf`` (the file's
blocks with 8-bit activations, engine/models/qlinear.py; where its C kernel builds). Each is timed on the
weight matmuls of a batch-1 decode step at this model's shapes (read from the file's header: the fused
q/k/v, o, gate/up and down projections of ``LAYERS`` layers with weights of their own, so they stream
from memory as a step's do, and the LM head; fewer layers, and no head, where they would pass
``MEASURED_BYTES``), rounds alternating between candidates, the best round of
each kept; the fastest wins. The times are cached as JSON in the kernel cache
(engine/cpu_build.cache_dir), keyed by the CPU's flags, the kernels' ``-march``, torch's, oneDNN's and MKL's
ISA caps (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``: engine/cpu_info.py
``AVX2_ONLY_ENV``), torch's version, the shapes, the dtype and the kernel's source, so a machine measures
once; the pick and the times are logged.

With ``gguf``, prefill chunks are measured apart (``pick_prefill_on_blocks``): one layer's projections at
``PREFILL_ROWS`` rows on the dense weights in the model's dtype against the blocks, cached the same way; the
faster runs every chunk of more than ``MAX_QUANT_ROWS`` rows (measured on the dev host class, AMD EPYC
with AVX-512: the blocks won in float32 AVX2-only, where the dense matmul is oneDNN's AVX2 sgemm, by
~1.2-1.6x a projection, and natively in bfloat16 too, 22.2 vs 26.8 ms; another CPU may pick the dense weights).

Dense float32 models measure one more choice (``pick_packed_linear``): their projections and LM head through
``F.linear`` (``off``, MKL's sgemm) or through oneDNN's GEMM on weights reordered once (``packed``,
engine/models/packed_linear.py), at one row and at ``BATCH_ROWS`` rows over ``LAYERS`` layers and the head, and at
``PREFILL_ROWS`` rows over one layer, cached the same way; packed where the geometric mean of the three time ratios
is below 1 (on the dev host class, AMD EPYC Zen 4, where MKL runs its generic path, the default model: packed 17.2
against 21.9 ms at one row, 17.0 against 19.6 ms a chunk). It asked for a win at one row and at a chunk until a
2-core Zen 3 EPYC (AVX2 only), measuring while another process ran, kept ``F.linear`` (one row 21.2 against 27.5 ms,
a chunk 28.8 against 29.0) that runs a batch of 8 rows 1.5x slower than packed
(benchmarks/results/packed_linear-zen3-avx2-cpu.json); a decode batch's rows are where the two differ most.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time

import torch
import torch.nn.functional as F

from engine.cpu_build import MARCH_ENV, cache_dir, kernel_march
from engine.cpu_info import AVX2_ONLY_ENV, flags_line

log = logging.getLogger("engine")

LAYERS = 8    # layers of weights timed per round: more than a CPU's last-level cache in float32
ROUNDS = 5
# rows of the prefill timing: a chunk holds up to max_batched_tokens (512 by default); one layer's weights,
# as a chunk reuses each weight for all of its rows
PREFILL_ROWS = 256
# rows of a small decode batch (sessions decoding together, or a speculative verification's draft rows)
BATCH_ROWS = 8


def model_shapes(path: str | None) -> dict[str, tuple[int, int]]:
    """(out, in) of one layer's fused projections and of the LM head, from a GGUF file's header."""
    from engine.loader import resolve_model
    from engine.loader.gguf_file import read_gguf

    shape = {t.name: tuple(reversed(t.shape)) for t in read_gguf(resolve_model(path)[0]).tensors}
    q, k, v = (shape[f"blk.0.attn_{x}.weight"] for x in "qkv")
    gate, up = shape["blk.0.ffn_gate.weight"], shape["blk.0.ffn_up.weight"]
    return {"qkv": (q[0] + k[0] + v[0], q[1]), "o": shape["blk.0.attn_output.weight"],
            "gate_up": (gate[0] + up[0], gate[1]), "down": shape["blk.0.ffn_down.weight"],
            "head": shape.get("output.weight", shape["token_embd.weight"])}


def _layers(mode: str, shapes: dict, dtype: torch.dtype, layers: int = LAYERS):
    """Callables x -> y for ``layers`` layers' projections and the head (where ``shapes`` has one), as
    ``mode`` would run them (``gguf``: on the blocks, whatever the rows; ``packed``: oneDNN's packed linear)."""
    from engine.models.packed_linear import PackedLinear
    from engine.models.qlinear import BlockLinear, Q4Blocks, Q8Blocks, load
    from engine.models.quant import Int4Groups, Int4Linear, Int8Linear

    def weights(n, k):
        return torch.randn(n, k).to(dtype) * 0.02

    def q4(n, k):
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        return Int4Groups(q, torch.full((n, k // 32), 0.01), torch.full((n, k // 32), -0.08))

    fns = []
    names = [n for n in ("qkv", "o", "gate_up", "down") if n in shapes] * layers + (["head"] if "head" in shapes else [])
    for name, (n, k) in [(s, shapes[s]) for s in names]:
        if mode == "off":
            w = weights(n, k)
            fns.append((k, functools.partial(F.linear, weight=w)))
        elif mode == "packed":
            fns.append((k, PackedLinear(weights(n, k))))
        elif mode == "int4":
            fns.append((k, Int8Linear(weights(n, k)) if name == "head" else Int4Linear(q4(n, k))))
        else:
            blocks = (Q8Blocks(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.full((n, k // 32), 2.0 ** -7))
                      if name == "head" else Q4Blocks.from_groups(q4(n, k)))
            dense = torch.zeros(()).expand(n, k)                  # never read: one row runs on the blocks
            fns.append((k, BlockLinear(load(), blocks, dense, max_rows=None)))
    return fns


def measure(candidates: list[str], shapes: dict, dtype: torch.dtype, rows: int = 1,
            layers: int = LAYERS) -> dict[str, float]:
    """Best-of-ROUNDS milliseconds of each candidate's step matmuls at ``rows`` rows (rounds alternate)."""
    paths = {c: _layers(c, shapes, dtype, layers) for c in candidates}
    xs = {k: torch.randn(rows, k).to(dtype) for _, (_, k) in shapes.items()}
    best = {c: float("inf") for c in candidates}
    with torch.inference_mode():
        for r in range(ROUNDS + 1):
            for c in candidates if r % 2 else reversed(candidates):
                t0 = time.perf_counter()
                for k, fn in paths[c]:
                    fn(xs[k])
                if r:                                                      # round 0 warms up
                    best[c] = min(best[c], (time.perf_counter() - t0) * 1000)
    return best


def _key(candidates: list[str], shapes: dict, dtype: torch.dtype, rows: int = 1) -> str:
    from engine.models.qmatmul import SOURCE

    # the kernels' -march, then each library's ISA cap (the variables an AVX2-only run sets, one list of them)
    caps = [kernel_march(), *(os.environ.get(name) for name in AVX2_ONLY_ENV if name != MARCH_ENV)]
    text = json.dumps([candidates, sorted(shapes.items()), str(dtype), torch.__version__, flags_line(), LAYERS, caps]
                      + ([rows] if rows != 1 else []))
    return hashlib.sha256(text.encode() + SOURCE.read_bytes()).hexdigest()[:16]


def _times(candidates: list[str], shapes: dict, dtype: torch.dtype, rows: int = 1,
           layers: int = LAYERS) -> tuple[dict[str, float], str]:
    """``measure``'s times, from the kernel cache when this machine measured them before; and where from."""
    file = cache_dir() / f"pick-{_key(candidates, shapes, dtype, rows)}.json"
    try:
        return json.loads(file.read_text()), f"cached in {file}"
    except (OSError, ValueError):
        times = measure(candidates, shapes, dtype, rows, layers)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(times))
        os.replace(tmp, file)
        return times, "measured now"


@functools.cache
def pick_quantization(path: str | None, dtype_name: str, four_bit: bool = True) -> str:
    """The fastest of the candidates for the model at ``path`` (None: the default) in ``dtype_name``;
    ``four_bit``: its layer weights are all 4-bit (else ``int4``, which would requantize a Q6_K weight to 4
    bits, is no candidate)."""
    from engine.models.qmatmul import load
    from engine.models.quant import kernels_available

    dtype = getattr(torch, dtype_name)
    candidates = ["off"] + (["int4"] if four_bit and dtype == torch.bfloat16 and kernels_available() else [])
    candidates += ["gguf"] if load() is not None else []
    if len(candidates) == 1:
        return "off"
    timed, layers = _step_timed(model_shapes(path), dtype.itemsize)
    times, how = _times(candidates, timed, dtype, layers=layers)
    choice = min(times, key=times.get)
    log.info("quantization auto picked %s in %s: batch-1 step matmuls of %d layers%s %s (%s)",
             choice, dtype_name, layers, " + the LM head" if "head" in timed else "",
             ", ".join(f"{c} {t:.1f} ms" for c, t in times.items()), how)
    return choice


@functools.cache
def pick_prefill_on_blocks(shapes: tuple[tuple[str, tuple[int, int]], ...], dtype_name: str) -> bool:
    """Whether a ``gguf`` model's prefill chunks (more than ``MAX_QUANT_ROWS`` rows) run faster on its blocks
    than on its dense weights in ``dtype_name``: one layer's projections of ``shapes`` ((name, (out, in))
    for qkv, o, gate_up, down) timed at ``PREFILL_ROWS`` rows."""
    times, how = _times(["off", "gguf"], dict(shapes), getattr(torch, dtype_name), PREFILL_ROWS, layers=1)
    blocks = times["gguf"] < times["off"]
    log.info("gguf prefill chunks on the %s in %s: %d rows of one layer's projections, dense %.1f ms, blocks "
             "%.1f ms (%s)", "blocks" if blocks else "dense weights", dtype_name, PREFILL_ROWS, times["off"],
             times["gguf"], how)
    return blocks


# bytes of dense weights one candidate is timed on (each candidate's weights are held while all are timed):
# the default model's 8 layers and head take 250 MB in float32; a 7B model's layer takes 800 MB, so such a
# model is timed on one layer and no head
MEASURED_BYTES = 512 << 20


def _step_timed(shape: dict[str, tuple[int, int]], itemsize: int = 4) -> tuple[dict[str, tuple[int, int]], int]:
    """The shapes and layer count a step is timed on within ``MEASURED_BYTES`` of ``itemsize``-byte values: up
    to ``LAYERS`` layers, and the head where it fits beside them."""
    layer = {k: v for k, v in shape.items() if k != "head"}
    layer_bytes = itemsize * sum(n * k for n, k in layer.values())
    layers = max(1, min(LAYERS, MEASURED_BYTES // layer_bytes))
    head = shape.get("head")
    fits = head is not None and itemsize * head[0] * head[1] <= MEASURED_BYTES - layers * layer_bytes
    return (shape if fits else layer), layers


@functools.cache
def pick_packed_linear(shapes: tuple[tuple[str, tuple[int, int]], ...]) -> bool:
    """Whether oneDNN's packed float32 linear beats ``F.linear`` here over the three kinds of step a server
    runs, once per machine: a batch-1 decode step (the projections of up to ``LAYERS`` layers of weights of
    their own, and the head, within ``MEASURED_BYTES``), the same at ``BATCH_ROWS`` rows (a batch of sessions
    decoding, or a speculative verification) and a prefill chunk (one layer at ``PREFILL_ROWS`` rows). Each
    kind counts the same: packed where the geometric mean of its three time ratios (packed / ``F.linear``)
    is below 1."""
    shape = dict(shapes)
    timed, layers = _step_timed(shape)
    step, how = _times(["off", "packed"], timed, torch.float32, layers=layers)
    batch, _ = _times(["off", "packed"], timed, torch.float32, BATCH_ROWS, layers=layers)
    layer = {k: v for k, v in shape.items() if k != "head"}
    chunk, _ = _times(["off", "packed"], layer, torch.float32, PREFILL_ROWS, layers=1)
    ratio = (step["packed"] / step["off"] * batch["packed"] / batch["off"]
             * chunk["packed"] / chunk["off"]) ** (1 / 3)
    packed = ratio < 1
    log.info("float32 projections through %s (packed / F.linear %.2f, geometric mean): a step's matmuls (%d layers%s) "
             "at 1 row F.linear %.1f ms, packed %.1f ms; at %d rows %.1f, %.1f ms; %d rows of one layer %.1f, %.1f ms "
             "(%s)", "oneDNN's packed linear" if packed else "F.linear", ratio, layers,
             " and the head" if "head" in timed else "", step["off"], step["packed"], BATCH_ROWS, batch["off"],
             batch["packed"], PREFILL_ROWS, chunk["off"], chunk["packed"], how)
    return packed


_PICK_NAMES = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
               "down": "mlp.down_proj"}


def pick_prefill_path(model: torch.nn.Module, dtype: torch.dtype, dense_read: bool = True) -> bool:
    """Prefill chunks on the blocks where they measured faster than on the dense weights in ``dtype`` at
    this model's shapes (``pick_prefill_on_blocks``, once per machine), the dense weights then released
    (engine/models/qlinear.py ``release_dense``, unless ``RELEASE_DENSE`` is off); returns whether they run so.
    ``dense_read=False``: the load never filled those weights (engine/builder.py ``_blocks_only``), which the
    log line says instead of counting their buffers as memory saved."""
    from engine.models import qlinear
    from engine.models.qlinear import BlockLinear, prefill_on_blocks

    shapes = _prefill_shapes(model, BlockLinear)
    enabled = bool(shapes) and pick_prefill_on_blocks(shapes, str(dtype).removeprefix("torch."))
    prefill_on_blocks(model, enabled)
    if enabled and qlinear.RELEASE_DENSE:
        mib = qlinear.release_dense(model) / 2**20
        if dense_read:
            log.info("gguf prefill on the blocks: %.0f MiB of dense weights released", mib)
        else:
            log.info("gguf prefill on the blocks: the block layers' dense weights were never read (%.0f MiB of "
                     "unfilled buffers dropped)", mib)
    return enabled


def prefill_runs_on_blocks(cfg, dtype: torch.dtype) -> bool:
    """What ``pick_prefill_path`` will pick for a Llama-skeleton model of ``cfg`` (the dense families: not an
    MoE, not engine/models ``FAMILY_BUILDERS``) served on its GGUF blocks, known before its weights are read:
    its shapes from the skeleton on the meta device, the same pick (measured here once, then cached)."""
    from engine.models.llama import LlamaModel

    with torch.device("meta"):
        skeleton = LlamaModel(cfg)
    shapes = _prefill_shapes(skeleton, torch.nn.Linear)
    return bool(shapes) and pick_prefill_on_blocks(shapes, str(dtype).removeprefix("torch."))


def _prefill_shapes(model: torch.nn.Module, kind: type) -> tuple[tuple[str, tuple[int, int]], ...]:
    """(name, (out, in)) of the first decoder layer's projections that are ``kind`` layers."""
    layers = getattr(model, "layers", None)
    shapes = []
    for name, path in _PICK_NAMES.items() if layers else ():
        m = _submodule(layers[0], path)
        if isinstance(m, kind):
            shapes.append((name, (m.out_features, m.in_features)))
    return tuple(shapes)


def _submodule(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None
