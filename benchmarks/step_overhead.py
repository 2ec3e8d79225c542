"""One decode step of the engine, measured at fixed shapes: where its time goes.

Every sequence of a shape decodes at once (the whole batch at the same context length,
each with its own pages: distinct contexts, no shared prefix), so each figure is a
full-batch decode step, never the staggered tail of a batch admitted in chunks. The
step is the model runner's: build the inputs, plan attention, the forward (all layers
and the LM head), measured on the default model with the default engine settings.

* ``decode_step_ms``: the whole step; ``forward_ms_per_step``: the model's forward and
  logits; ``host_ms_per_step``: the rest (building input tensors, planning attention).
  Sampling, detokenizing and emitting are not in these figures yet.
* The torch backend's decode plans (engine/attention/torch_backend.py) are compared in
  the same run: ``auto`` (what the engine does: the compiled CPU decode kernel where it
  builds, else the cheaper torch plan) against ``torch`` (the cheaper of the pure-torch
  union and cascade plans per step, what ran before the kernel) and, if asked, ``union``
  (every row scored over every decoding row's pages) or ``cascade``. ``attention_scaling``
  is the b64 step over 2,048-token contexts divided by the b64 step over 64-token
  contexts, for each.
* ``attention_floor``: what no decode attention can beat on this machine at b64_ctx2048:
  the KV bytes every step must read (each row's own 2,048 tokens, K and V, every layer)
  over the read bandwidth measured here (a sum over a tensor of that many bytes, with the
  engine's threads), added to the b64_ctx64 step: ``floor_ratio`` is the least
  ``attention_scaling`` reachable without shrinking the KV (a quantized KV cache).

* ``ab_kernels`` (``--ab-kernels``): the C kernels against the pure-torch paths on one batch in
  alternating blocks of steps, so that a noisy machine's slow minutes fall on both alike: medians
  and their ratio.

* ``ab_decode_step`` (``--ab-decode-step``): an engine on GGUF blocks (float32 or bfloat16) with its decode
  steps' layers in one C call (engine/models/decode_step.py) against the Python loop of the same calls, in
  alternating blocks of steps as above: medians and their ratio (one_call / loop).

* ``ab_quantization`` (``--ab-quantization MODE``): a second engine with ``quantization=MODE`` (e.g.
  ``gguf``) against this one, in alternating blocks of steps as above: medians and their ratio.

    python benchmarks/step_overhead.py --json out/step_overhead.json [--steps 5] [--profile b64_ctx2048] [--ab-kernels]
        [--ab-quantization gguf] [--ab-decode-step] [--kv-cache-dtype int8] [--overlap]

* ``overlap`` (``--overlap``): whole engine steps (schedule, inputs, forward, sampling, stop checks,
  detokenizing, emitting) of ``batch`` decoding requests, on an engine without and one with
  ``overlap_schedule`` (engine/overlap.py), in alternating blocks. Per side: ``step_ms`` (the period of
  one step), ``forward_ms`` (the model's forward and logits), ``host_total_ms`` (all host work of a
  step: with overlap the engine thread's time in ``step()`` not spent waiting for the forward thread,
  plus the forward thread's time outside the model) and ``host_critical_ms`` (the step period less the
  forward: the host work the forward does not hide). Without overlap the two host figures are equal.

* ``kv_pages`` (``--kv-cache-dtype int8``): the engine runs on 8-bit KV pages, and the same model is
  also timed over a second pool of ``--kv-baseline`` pages (default bfloat16, with the same
  activations) in alternating blocks: per page dtype each shape's step and ``attention_scaling``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.scheduler import ScheduledBatch  # noqa: E402

# name -> (batch, context tokens, tokens of it every sequence shares: an agent's system prompt)
SHAPES = {"b1_ctx64": (1, 64, 0), "b16_ctx64": (16, 64, 0), "b64_ctx64": (64, 64, 0),
          "b64_ctx2048": (64, 2048, 0), "b256_ctx64": (256, 64, 0),
          "b4_shared1536_ctx2048": (4, 2048, 1536), "b8_shared1536_ctx2048": (8, 2048, 1536),
          "b16_shared1536_ctx2048": (16, 2048, 1536)}


# What the contexts' pages hold when a step reads them (--kv-contents): "unwritten" (the default, and every
# run before the option: pages nothing wrote, zeros, so every key scores alike) or "random" (K ~ N(0, 4),
# V ~ N(0, 1) written through the pool's own write path, int8 pages quantized as the engine quantizes:
# scores spread as real keys make them, and a data-dependent cost in attention shows).
KV_CONTENTS = ("unwritten", "random")
_contents = "unwritten"


def write_contents(kv, batch: ScheduledBatch) -> None:
    """The batch's context pages in ``kv`` filled as ``_contents`` says (nothing for "unwritten"); the same
    values on every pool and every layer, so that the sides of an A/B read the same keys."""
    if _contents == "unwritten":
        return
    P = kv.page_size
    pages = sorted({p for req in batch.requests for p in req.pages})
    slots = (torch.tensor(pages).unsqueeze(1) * P + torch.arange(P)).flatten()
    gen = torch.Generator().manual_seed(len(slots))
    t = kv.k[0]
    heads, dim = (t.shape[0], t.shape[2]) if kv.layout == "HSD" else (t.shape[2], t.shape[3])
    k = torch.randn(len(slots), heads, dim, generator=gen) * 2
    v = torch.randn(len(slots), heads, dim, generator=gen)
    for layer in range(len(kv.k)):
        kv.write(layer, slots, k, v)


def decode_batch(engine: LLMEngine, batch: int, ctx: int, shared: int = 0) -> ScheduledBatch:
    """``batch`` sequences of ``ctx`` tokens, each at its last token (to decode): the first ``shared``
    tokens (whole pages) on pages all of them share, as a cached system prompt is, the rest on pages of
    its own; the pages' contents as ``--kv-contents`` says (``write_contents``)."""
    P = engine.config.page_size
    gen = torch.Generator().manual_seed(batch * 100_003 + ctx)
    vocab = engine.model_config.vocab_size
    common = torch.randint(0, vocab, (shared,), generator=gen).tolist()
    common_pages = engine.pool.alloc(shared // P)
    requests = []
    for i in range(batch):
        ids = common + torch.randint(0, vocab, (ctx - shared,), generator=gen).tolist()
        req = Request(f"bench-{i}", ids, SamplingParams(max_tokens=1))
        req.pages = common_pages + engine.pool.alloc(-(-(ctx - shared) // P))
        req.num_computed = ctx - 1
        requests.append(req)
    out = ScheduledBatch(requests, [1] * batch)
    write_contents(engine.kv, out)
    return out


def free_batch(engine: LLMEngine, batch: ScheduledBatch) -> None:
    engine.pool.free(sorted({p for req in batch.requests for p in req.pages}))


class ForwardTimer:
    """Wraps the model: the time of each forward + logits call (the rest of a step is host work)."""

    def __init__(self, model) -> None:
        self.model, self.seconds = model, 0.0

    def __call__(self, *args):
        t = time.perf_counter()
        out = self.model(*args)
        self.seconds += time.perf_counter() - t
        return out

    def compute_logits(self, hidden):
        t = time.perf_counter()
        out = self.model.compute_logits(hidden)
        self.seconds += time.perf_counter() - t
        return out


def measure(engine: LLMEngine, batch: ScheduledBatch, steps: int) -> dict:
    runner = engine.runner
    timer = ForwardTimer(runner.model)
    runner.model = timer
    try:
        runner.run(batch)  # warm-up
        walls, forwards = [], []
        for _ in range(steps):
            timer.seconds = 0.0
            t = time.perf_counter()
            runner.run(batch)
            walls.append(time.perf_counter() - t)
            forwards.append(timer.seconds)
    finally:
        runner.model = timer.model
    step = statistics.median(walls) * 1000
    forward = statistics.median(forwards) * 1000
    return {"step_ms": round(step, 2), "forward_ms": round(forward, 2), "host_ms": round(step - forward, 2)}


def read_bandwidth_gb_s(nbytes: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """Best of ``repeats`` streaming reads (a sum) over a fresh tensor of ``nbytes`` bytes."""
    x = torch.ones(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def attention_floor(engine: LLMEngine, auto: dict) -> dict | None:
    """The KV read of a b64_ctx2048 step at this machine's read bandwidth, and the scaling it bounds."""
    if "b64_ctx2048" not in auto or "b64_ctx64" not in auto or engine.device != "cpu":
        return None
    batch, ctx, _ = SHAPES["b64_ctx2048"]
    kv_bytes = batch * ctx * engine.kv.bytes_per_token      # int8 pages: values and scales
    gb_s = read_bandwidth_gb_s(min(kv_bytes, 1 << 30), torch.float32 if engine.kv.quantized else engine.kv.k[0].dtype)
    read_ms = kv_bytes / gb_s / 1e6
    base = auto["b64_ctx64"]["step_ms"]
    return {"kv_bytes_per_step": kv_bytes, "read_gb_s": round(gb_s, 1), "kv_read_ms": round(read_ms, 1),
            "floor_ratio": round((base + read_ms) / base, 2)}


def alternate(sides: dict, steps: int, blocks: int, order: str = "alternate") -> dict:
    """Each side's block medians (ms): ``blocks`` rounds in ``harness.ab_order`` (alternate: A, B, B, A, ...),
    each side in turn running a warm-up step and then ``steps`` timed ones (``sides``: name -> a callable
    that runs one step)."""
    medians: dict = {k: [] for k in sides}
    for _, side in harness.ab_order(list(sides), blocks, order):
        sides[side]()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            sides[side]()
            times.append(time.perf_counter() - t)
        medians[side].append(statistics.median(times) * 1000)
    return medians


def ab_kernels(engine: LLMEngine, shapes: list[str], steps: int, blocks: int = 3, order: str = "alternate") -> dict:
    """The CPU's C kernels (decode attention, RoPE + K/V write, add + RMSNorm, SiLU-multiply) against the
    pure-torch paths on the same batch, in blocks of ``steps`` steps (a warm-up step first), ``blocks``
    of each, in ``harness.ab_order``: each side's median of its block medians and their ratio. (Switching
    paths at every step was tried and is biased: with both sides the same it measured them alike, but
    a switched side ran up to 1.9x slower than in runs of its own, so blocks it is.)"""
    backend, model = engine.runner.attn, engine.runner.model

    def kernels(on: bool) -> None:
        backend.force_decode_plan = None if on else "torch"
        model.use_cpu_ops(on)

    out = {}
    for name in shapes:
        batch = decode_batch(engine, *SHAPES[name])
        m = alternate({"kernels": lambda: (kernels(True), engine.runner.run(batch)),
                       "torch": lambda: (kernels(False), engine.runner.run(batch))}, steps, blocks, order)
        free_batch(engine, batch)
        on, off = m["kernels"], m["torch"]
        c, t = statistics.median(on), statistics.median(off)
        out[name] = {"kernels_ms": round(c, 2), "torch_ms": round(t, 2), "ratio": round(c / t, 3),
                     "kernels_blocks_ms": [round(x, 2) for x in on],
                     "torch_blocks_ms": [round(x, 2) for x in off]}
        print(f"ab       {name:22s} C kernels {c:9.1f} ms  pure torch {t:9.1f} ms  ratio {c / t:.3f}", flush=True)
    kernels(True)
    return out


def ab_decode_step(engine: LLMEngine, shapes: list[str], steps: int, blocks: int = 3,
                   order: str = "alternate") -> dict:
    """The one-call decode step (engine/models/decode_step.py) against the Python layer loop it replaces (the
    same kernel calls, the same logits) on the same batch, in alternating blocks as ``ab_kernels``: each side's
    median of block medians and their ratio (one_call / loop). Raises ``SystemExit`` when this engine does
    not run the one-call step (dense weights, say)."""
    model = engine.runner.model
    step = getattr(model, "decode_step", None)
    if step is None:
        raise SystemExit("--ab-decode-step: this engine does not run the one-call decode step (it needs GGUF "
                         "blocks with float32 or bfloat16 activations: --dtype auto --quantization auto, or "
                         "--quantization gguf)")

    def side(on: bool, batch) -> None:
        model.decode_step = step if on else None
        engine.runner.run(batch)

    out = {}
    try:
        for name in shapes:
            batch = decode_batch(engine, *SHAPES[name])
            m = alternate({"one_call": lambda: side(True, batch), "loop": lambda: side(False, batch)},
                          steps, blocks, order)
            free_batch(engine, batch)
            c, t = statistics.median(m["one_call"]), statistics.median(m["loop"])
            out[name] = {"one_call_ms": round(c, 2), "loop_ms": round(t, 2), "ratio": round(c / t, 3),
                         "one_call_blocks_ms": [round(x, 2) for x in m["one_call"]],
                         "loop_blocks_ms": [round(x, 2) for x in m["loop"]]}
            print(f"ab       {name:22s} one C call {c:9.2f} ms  Python loop {t:9.2f} ms  ratio {c / t:.3f}",
                  flush=True)
    finally:
        model.decode_step = step
    return out


def ab_quantization(engine: LLMEngine, mode: str, shapes: list[str], steps: int, blocks: int = 3,
                    order: str = "alternate") -> dict:
    """This engine's weights against a second engine's with ``quantization=mode`` (same dtype), on the
    same shapes, in alternating blocks of steps (as ``ab_kernels``): medians and their ratio."""
    cfg = engine.config
    other = LLMEngine(EngineConfig(dtype=cfg.dtype, quantization=mode, kv_cache_tokens=cfg.kv_cache_tokens))
    out = {}
    for name in shapes:
        batches = {"base": decode_batch(engine, *SHAPES[name]), "alt": decode_batch(other, *SHAPES[name])}
        m = alternate({"base": lambda: engine.runner.run(batches["base"]),
                       "alt": lambda: other.runner.run(batches["alt"])}, steps, blocks, order)
        free_batch(engine, batches["base"])
        free_batch(other, batches["alt"])
        a, b = statistics.median(m["alt"]), statistics.median(m["base"])
        out[name] = {f"{mode}_ms": round(a, 2), f"{engine.quantization}_ms": round(b, 2), "ratio": round(a / b, 3),
                     f"{mode}_blocks_ms": [round(x, 2) for x in m["alt"]],
                     f"{engine.quantization}_blocks_ms": [round(x, 2) for x in m["base"]]}
        print(f"ab       {name:22s} {mode} {a:9.1f} ms  {engine.quantization} {b:9.1f} ms  ratio {a / b:.3f}",
              flush=True)
    return out


def ab_kv_pages(engine: LLMEngine, baseline: str, shapes: list[str], steps: int, blocks: int = 3,
                order: str = "alternate") -> dict:
    """The engine's KV pages (``--kv-cache-dtype``) against ``baseline`` pages of the same pool geometry,
    one model, in alternating blocks: per page dtype each shape's median step and attention_scaling
    (b64_ctx2048 / b64_ctx64)."""
    from engine.kv_pool import KVCache

    mine, mc, P = engine.runner.attn, engine.model_config, engine.config.page_size
    kv = KVCache(mc.num_layers, engine.pool.num_pages, P, mc.num_kv_heads, mc.head_dim, engine.kv.dtype,
                 engine.device, layout=type(mine).kv_layout, kv_dtype=getattr(torch, baseline))
    other = type(mine)(kv=kv, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)
    sides = {engine.config.kv_cache_dtype: mine, baseline: other}
    out = {side: {"bytes_per_token": attn.kv.bytes_per_token, "step_ms": {}, "blocks_ms": {}}
           for side, attn in sides.items()}
    for shape in shapes:
        batch = decode_batch(engine, *SHAPES[shape])
        write_contents(kv, batch)

        def on(attn):
            engine.runner.attn = attn
            engine.runner.run(batch)
        medians = alternate({side: (lambda a=attn: on(a)) for side, attn in sides.items()}, steps, blocks, order)
        engine.runner.attn = mine
        free_batch(engine, batch)
        for side, ms in medians.items():
            out[side]["step_ms"][shape] = round(statistics.median(ms), 2)
            out[side]["blocks_ms"][shape] = [round(x, 2) for x in ms]
        print(f"kv       {shape:22s} " + "  ".join(f"{side} {out[side]['step_ms'][shape]:9.1f} ms" for side in sides),
              flush=True)
    for side in sides:
        st = out[side]["step_ms"]
        if "b64_ctx2048" in st and "b64_ctx64" in st:
            out[side]["attention_scaling"] = round(st["b64_ctx2048"] / st["b64_ctx64"], 2)
    return out


class StepClock:
    """Where an engine's steps spend their time: the model (a ``ForwardTimer``), and with overlap the
    engine thread's waits for the forward thread and the forward thread's whole task time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.timer = ForwardTimer(engine.runner.model)
        engine.runner.model = self.timer
        self.wait = self.task = 0.0
        if engine.overlap:
            result, forward = engine.executor.result, engine.executor.forward

            def timed_result(step):
                t = time.perf_counter()
                try:
                    return result(step)
                finally:
                    self.wait += time.perf_counter() - t

            def timed_forward(step, prev=None):
                t = time.perf_counter()
                try:
                    return forward(step, prev)
                finally:
                    self.task += time.perf_counter() - t
            engine.executor.result, engine.executor.forward = timed_result, timed_forward

    def totals(self) -> tuple[float, float, float]:
        return self.timer.seconds, self.wait, self.task


def overlap_block(engine: LLMEngine, clock: StepClock, steps: int) -> dict:
    """``steps`` engine steps after a warm-up one: per-step period, forward, total and critical host ms."""
    engine.step()
    f0, w0, t0 = clock.totals()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    f1, w1, t1 = clock.totals()
    period, forward = wall / steps, (f1 - f0) / steps
    total = (wall - (w1 - w0) + (t1 - t0) - (f1 - f0)) / steps if engine.overlap else period - forward
    return {"step_ms": period * 1000, "forward_ms": forward * 1000, "host_total_ms": total * 1000,
            "host_critical_ms": (period - forward) * 1000}


def ab_overlap(cfg: EngineConfig, shapes: list[str], steps: int, blocks: int = 3, order: str = "alternate") -> dict:
    """Decoding engines without and with overlap scheduling, ``batch`` requests each, in alternating blocks
    of ``steps`` steps: each side's medians over its blocks."""
    out = {}
    for name in shapes:
        batch, ctx, _ = SHAPES[name]
        tokens = blocks * (steps + 1) + 8          # every block decodes; no request ends before the last
        kv = batch * (ctx + tokens + 2 * cfg.page_size)
        engines = {side: LLMEngine(dataclasses.replace(cfg, kv_cache_tokens=max(kv, 4096),
                                                       max_num_seqs=max(batch, cfg.max_num_seqs),
                                                       overlap_schedule=side == "overlap"))
                   for side in ("plain", "overlap")}
        gen = torch.Generator().manual_seed(batch * 7 + ctx)
        params = SamplingParams(max_tokens=tokens + 4, temperature=0, ignore_eos=True)
        clocks = {}
        for side, eng in engines.items():
            for _ in range(batch):
                eng.add_request(torch.randint(0, eng.model_config.vocab_size, (ctx,), generator=gen).tolist(), params)
            while len(eng.scheduler.running) < batch or any(r.remaining_prefill > 1 for r in eng.scheduler.running):
                eng.step()                          # prefill everything first: blocks time decode steps only
            clocks[side] = StepClock(eng)
        runs: dict = {side: [] for side in engines}
        for _, side in harness.ab_order(list(engines), blocks, order):
            runs[side].append(overlap_block(engines[side], clocks[side], steps))
        out[name] = {side: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]} | {"blocks": rs}
                     for side, rs in runs.items()}
        for side in engines:
            r = out[name][side]
            print(f"overlap  {name:22s} {side:8s} step {r['step_ms']:8.1f} ms  forward {r['forward_ms']:8.1f} ms  "
                  f"host total {r['host_total_ms']:6.2f} ms  on the critical path {r['host_critical_ms']:6.2f} ms",
                  flush=True)
            engines[side].close()
        # an engine sits in reference cycles (tests/conftest.py): collect the pair before the next shape's
        # pools are allocated, or the run holds every shape's KV at once
        del engines, clocks
        gc.collect()
    return out


# the A/B comparisons a switch adds to the run, each timed in alternating blocks beside the shapes' own figures
AB_SWITCHES = (
    ("--overlap", "whole engine steps without and with overlap_schedule (host ms on the critical path against "
                  "total host ms)"),
    ("--ab-kernels", "the CPU's C kernels against the pure-torch paths"),
    ("--ab-decode-step", "the one-call decode step (GGUF blocks, float32 or bfloat16) against the Python layer loop"),
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_args(ap, repeats=3)   # --repeats: blocks per side of --ab-kernels
    ap.add_argument("--steps", type=int, default=5, help="timed steps per shape (the median is reported)")
    ap.add_argument("--dtype", default=EngineConfig.dtype, help="engine dtype (auto: what agentrt serve picks here)")
    ap.add_argument("--quantization", default=EngineConfig.quantization,
                    help="weight quantization (engine.config.QUANTIZATIONS; auto: int4 for the default GGUF in bf16)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--plans", default="auto,torch", help="decode plans to compare (auto, torch, union, cascade)")
    ap.add_argument("--profile", metavar="SHAPE", help="print the torch profiler's table for one step of SHAPE")
    ap.add_argument("--kv-cache-dtype", default="auto", help="KV pages of the engine (engine.config.KV_CACHE_DTYPES); "
                    "other than auto, also timed against --kv-baseline pages in alternating blocks")
    ap.add_argument("--kv-baseline", default="bfloat16", help="the page dtype --kv-cache-dtype is timed against")
    ap.add_argument("--kv-contents", choices=KV_CONTENTS, default="unwritten",
                    help="what the contexts' pages hold: unwritten (zeros: every key scores alike; the default) or "
                         "random (K ~ N(0, 4), V ~ N(0, 1) written through the pool, as in every A/B side)")
    for flag, what in AB_SWITCHES:
        ap.add_argument(flag, action="store_true", help=f"also time {what}, in alternating blocks")
    ap.add_argument("--overlap-shapes", default="b1_ctx64,b16_ctx64,b64_ctx64,b256_ctx64",
                    help="shapes of the --overlap A/B (two engines with their own pools each; the default leaves "
                         "out b64_ctx2048, whose two float32 pools of 6 GB each beside this engine's overflow 24 GB)")
    ap.add_argument("--ab-quantization", metavar="MODE",
                    help="also time a second engine with this quantization (e.g. gguf) against this one's, "
                         "in alternating blocks")
    args = ap.parse_args(argv)
    run = harness.Run(args, __file__, argv)
    global _contents
    _contents = args.kv_contents
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes + ([args.profile] if args.profile else []):
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    P = EngineConfig.page_size
    need = max(b * -(-c // P) * P for b, c, _ in (SHAPES[s] for s in shapes + ([args.profile] if args.profile else [])))
    engine = LLMEngine(EngineConfig(dtype=args.dtype, quantization=args.quantization, kv_cache_tokens=need + P,
                                    kv_cache_dtype=args.kv_cache_dtype))
    backend = engine.runner.attn
    if args.ab_decode_step and getattr(engine.runner.model, "decode_step", None) is None:
        ap.error("--ab-decode-step: this engine does not run the one-call decode step (it needs GGUF blocks with "
                 "float32 or bfloat16 activations: --dtype auto --quantization auto, or --quantization gguf)")
    print(f"device {engine.device}, dtype {args.dtype}, KV pages {engine.config.resolved_kv_cache_dtype()}, "
          f"quantization {engine.quantization}, "
          f"backend {engine.backend_name}, torch threads "
          f"{torch.get_num_threads()}", flush=True)
    results: dict[str, dict[str, dict]] = {}
    for plan in args.plans.split(","):
        if plan != "auto" and not hasattr(backend, "force_decode_plan"):
            continue
        if hasattr(backend, "force_decode_plan"):
            backend.force_decode_plan = None if plan == "auto" else plan
        for name in shapes:
            batch = decode_batch(engine, *SHAPES[name])
            results.setdefault(plan, {})[name] = r = measure(engine, batch, args.steps)
            free_batch(engine, batch)
            print(f"{plan:8s} {name:22s} step {r['step_ms']:9.1f} ms  forward {r['forward_ms']:9.1f} ms  "
                  f"host {r['host_ms']:7.2f} ms", flush=True)
    if args.profile:   # with the last plan timed
        backend_plan = getattr(backend, "force_decode_plan", None)
        batch = decode_batch(engine, *SHAPES[args.profile])
        engine.runner.run(batch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.runner.run(batch)
        print(f"profile of one {args.profile} step (decode plan {backend_plan or 'auto'}):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        free_batch(engine, batch)   # its pages back: the A/Bs below allocate from the same pool
    if hasattr(backend, "force_decode_plan"):
        # back to the engine's own choice: the A/Bs below time the engine as it runs (a forced "torch" plan
        # left here had the --kv-cache-dtype A/B time int8 pages on the torch path against a fresh
        # bfloat16 backend on the C kernel)
        backend.force_decode_plan = None
    ab = ab_kernels(engine, shapes, args.steps, args.repeats, args.order) if args.ab_kernels and hasattr(backend, "force_decode_plan") \
        and hasattr(engine.model, "use_cpu_ops") and engine.device == "cpu" else None
    abd = ab_decode_step(engine, shapes, args.steps, args.repeats, args.order) if args.ab_decode_step else None
    abq = ab_quantization(engine, args.ab_quantization, shapes, args.steps, args.repeats, args.order) if args.ab_quantization else None
    kv_pages = ab_kv_pages(engine, args.kv_baseline, shapes, args.steps, args.repeats, args.order) \
        if args.kv_cache_dtype != "auto" else None
    overlap_shapes = [s for s in args.overlap_shapes.split(",") if s]
    unknown = sorted(set(overlap_shapes) - set(SHAPES))
    if unknown:
        raise SystemExit(f"--overlap-shapes: unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    overlap = ab_overlap(engine.config, overlap_shapes, args.steps, args.repeats, args.order) if args.overlap else None
    auto = results.get("auto", {})
    out = {
        "device": engine.device,
        "dtype": args.dtype,
        "quantization": engine.quantization,
        "decode_step_ms": {k: v["step_ms"] for k, v in auto.items()},
        "host_ms_per_step": {str(SHAPES[k][0]): v["host_ms"] for k, v in auto.items() if SHAPES[k][1] == 64},
        "forward_ms_per_step": {str(SHAPES[k][0]): v["forward_ms"] for k, v in auto.items() if SHAPES[k][1] == 64},
        "by_plan": results,
        "attention_scaling": {
            plan: round(r["b64_ctx2048"]["step_ms"] / r["b64_ctx64"]["step_ms"], 2)
            for plan, r in results.items() if "b64_ctx2048" in r and "b64_ctx64" in r},
        "attention_floor": attention_floor(engine, auto),
        "ab_kernels": ab,
        "ab_decode_step": abd,
        "ab_quantization": abq,
        "kv_cache_dtype": engine.config.resolved_kv_cache_dtype(),
        "kv_pages": kv_pages,
        "kv_contents": args.kv_contents,
        "overlap": overlap,
        "steps": args.steps,
    }
    print(json.dumps({k: out[k] for k in ("decode_step_ms", "attention_scaling", "attention_floor")}))
    if kv_pages:
        print(json.dumps({"kv_pages": {side: {"attention_scaling": r.get("attention_scaling"),
                                              "step_ms": r["step_ms"]} for side, r in kv_pages.items()}}))
    run.write(out, engine=engine)


if __name__ == "__main__":
    main()
