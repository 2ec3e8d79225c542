"""GPU check: the flashinfer backend against the plain reference and the torch backend.

On a CUDA machine (with `pip install -e '.[cuda]'`):
  1. kernel level: flashinfer's paged attention against ``engine.attention.reference`` (fp64 on
     the CPU) on random paged batches with the model's head shape in bf16: a decode-only batch
     (rows sharing a prefix), and a mixed batch (decode rows, a cold prefill, a chunk over a
     cached prefix); the torch backend on the GPU against the same reference for comparison;
  2. engine level: the model in bf16 with each backend: greedy tokens on chat prompts (batched,
     different lengths) and the top-5 logprobs after a prefill and after a decode step;
  3. decode tokens/s at batch 1, 16 and 64 for both backends.
Each part records its error and the next one runs, so one run tells as much as it can.
Exits non-zero when a check fails. Meant to finish within a few minutes on one H200.

    python scripts/gpu_check.py [--model PATH] [--json OUT]

``--model`` takes any model directory; a directory made by scripts/shape_checkpoint.py has the
default model's shape with random weights (for machines the weights cannot reach): kernels and
speed are the real model's, but greedy tokens of random weights say little, so the engine-level
comparison rests on the logprobs there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.attention import BatchLayout, backend_class, create_backend  # noqa: E402
from engine.attention.reference import reference_attention  # noqa: E402
from engine.tokenizer import encode_chat  # noqa: E402
from engine.kv_pool import KVCache  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about GPUs.",
           "Explain paged attention in two sentences.", "hi", "List five prime numbers."]
KERNEL_ATOL = 0.03   # bf16 inputs and output against an fp64 reference


def random_layout(rng: random.Random, num_pages: int, page_size: int, specs: list[tuple[int, int]],
                  shared_prefix_pages: int) -> BatchLayout:
    """specs: (q_len, kv_len) per sequence; pages are shuffled, the first ones shared by all."""
    free = list(range(1, num_pages))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_prefix_pages)]
    tables, slots = [], []
    for ql, kl in specs:
        n = -(-kl // page_size)
        pages = (shared + [free.pop() for _ in range(max(0, n - len(shared)))])[:n]
        tables.append(pages)
        slots.extend(pages[i // page_size] * page_size + i % page_size for i in range(kl - ql, kl))
    return BatchLayout([q for q, _ in specs], [k for _, k in specs], tables, torch.tensor(slots))


def kernel_check(backend_name: str, hq: int, hkv: int, d: int, page_size: int) -> dict:
    """Max |backend - reference| on a decode-only and a mixed batch, bf16 on the GPU."""
    rng = random.Random(0)
    torch.manual_seed(0)
    num_pages = 2048
    batches = {
        "decode": [(1, 1000), (1, 37), (1, 530), (1, 16), (1, 2049)] * 4,
        "mixed": [(1, 700), (1, 65), (300, 300), (129, 1200), (1, 5), (57, 57)],
    }
    result = {}
    for name, specs in batches.items():
        kv_layout = backend_class(backend_name).kv_layout
        kv = KVCache(1, num_pages, page_size, hkv, d, torch.bfloat16, "cuda", layout=kv_layout)
        for t in kv.k + kv.v:
            t.normal_()
        backend = create_backend(backend_name, kv=kv, num_heads=hq, num_kv_heads=hkv, head_dim=d)
        layout = random_layout(rng, num_pages, page_size, specs, shared_prefix_pages=2)
        layout.slot_mapping = layout.slot_mapping.cuda()
        T = layout.num_tokens
        q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
        k_new = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16)
        v_new = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16)
        backend.plan(layout)
        out = backend.forward(0, q, k_new, v_new).float().cpu()
        mirror = KVCache(1, num_pages, page_size, hkv, d, torch.float32, "cpu", layout=kv_layout)
        mirror.k[0].copy_(kv.k[0].float().cpu())
        mirror.v[0].copy_(kv.v[0].float().cpu())
        cpu_layout = BatchLayout(layout.q_lens, layout.kv_lens, layout.page_tables, layout.slot_mapping.cpu())
        ref = reference_attention(mirror, 0, cpu_layout, q.float().cpu())
        result[name] = round(float((out - ref).abs().max()), 5)
    result["ok"] = all(v < KERNEL_ATOL for k, v in result.items())
    return result


def logits_of(engine: LLMEngine, prompt: list[int]):
    """Top-20 logprobs after a prefill and after one decode step."""
    res = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, logprobs=20,
                                                    ignore_eos=True))[0]
    return res.logprobs


def decode_tps(engine: LLMEngine, batch: int, new_tokens: int = 64) -> float:
    prompts = [encode_chat(engine.tokenizer, [{"role": "user", "content": f"Count to {i + 10}."}])
               for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0))  # warm-up, prefix cached
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = engine.generate(prompts, params)
    torch.cuda.synchronize()
    return sum(len(r.token_ids) for r in res) / (time.perf_counter() - t)


def run_part(out: dict, name: str, fn) -> None:
    t = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as exc:  # one part's failure must not hide the others' results
        out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    print(f"== {name} ({time.perf_counter() - t:.1f} s): {json.dumps(out[name])[:3000]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check runs on a GPU machine only")
        return 2
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import flashinfer
        out["flashinfer"] = flashinfer.__version__
    except ImportError as exc:
        out["flashinfer"] = f"not importable: {exc}"
    if args.model and os.path.exists(os.path.join(args.model, "config.json")):
        with open(os.path.join(args.model, "config.json")) as f:
            shape_of = json.load(f).get("shape_of")
        out["weights"] = f"random, shape of {shape_of}" if shape_of else args.model
    engines: dict[str, LLMEngine] = {}

    def build():
        for name in ("torch", "flashinfer"):
            engines[name] = LLMEngine(EngineConfig(model=args.model, device="cuda", dtype="bfloat16",
                                                   attention_backend=name, kv_cache_tokens=262144,
                                                   max_num_seqs=128, max_batched_tokens=4096))
        c = engines["torch"].model_config
        return {"heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "layers": c.num_layers, "page_size": engines["torch"].config.page_size}

    run_part(out, "engines", build)
    shape = out["engines"] if "error" not in out["engines"] else {"heads": 9, "kv_heads": 3, "head_dim": 64,
                                                                   "page_size": 16}
    for backend in ("flashinfer", "torch"):
        run_part(out, f"kernel_{backend}_vs_reference",
                 lambda b=backend: kernel_check(b, shape["heads"], shape["kv_heads"], shape["head_dim"],
                                                shape["page_size"]))
    if len(engines) == 2:
        def greedy():
            tok = engines["torch"].tokenizer
            prompts = [encode_chat(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
            params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
            toks = {n: [r.token_ids for r in e.generate(prompts, params)] for n, e in engines.items()}
            first8 = [a[:8] == b[:8] for a, b in zip(toks["torch"], toks["flashinfer"])]
            full = sum(a == b for a, b in zip(toks["torch"], toks["flashinfer"]))
            max_diff = 0.0
            for p in prompts:
                for la, lb in zip(logits_of(engines["torch"], p), logits_of(engines["flashinfer"], p)):
                    top_b = dict(lb.top)
                    for tid, val in la.top[:5]:
                        if tid in top_b:
                            max_diff = max(max_diff, abs(val - top_b[tid]))
            return {"greedy_first8_agree": all(first8), "greedy_full_identical": f"{full}/{len(prompts)}",
                    "max_top5_logprob_diff": round(max_diff, 4), "logits_ok": max_diff < 0.1}

        run_part(out, "engine_parity", greedy)
        run_part(out, "decode_tokens_per_s",
                 lambda: {n: {b: round(decode_tps(e, b), 1) for b in (1, 16, 64)} for n, e in engines.items()})
    print(json.dumps({k: v for k, v in out.items()}, indent=2, default=str)[:6000])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    ok = all(isinstance(out.get(k), dict) and out[k].get("ok", True) and "error" not in out[k]
             for k in ("kernel_flashinfer_vs_reference", "kernel_torch_vs_reference"))
    parity = out.get("engine_parity", {})
    ok = ok and isinstance(parity, dict) and parity.get("logits_ok") is True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
