"""Accuracy of 8-bit (and 16-bit) KV pages against float32 pages, on the default model.

One agent-like session (a long system prompt with tool definitions, then turns of tool results and
replies) is run with float32 activations and float32 KV pages, and again with each other page dtype:

- **greedy agreement**: per turn, the reply each page dtype decodes greedily from the same history
  (the float32 replies are the history), and how many leading tokens it shares with float32's;
- **teacher-forced**: the whole session (~1-2k tokens) is fed through the engine's model in prefill
  chunks that read every key back from the pool (the chunk's own too), and at each position the
  next-token distribution is compared with float32's: top-1 agreement, mean and p99 of
  ``|log p(reference token)|`` differences;
- **scale granularity**: on the float32 pool's real K/V after that pass, the reconstruction error of
  int8 with one scale per (token, KV head), as stored, against one scale per (page, KV head).

    python benchmarks/kv_accuracy.py --json out/kv_accuracy.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrt.bench.text import system_prompt  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.workload import AgenticWorkload  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.attention import BatchLayout  # noqa: E402
from engine.tokenizer import encode_chat  # noqa: E402
from engine.kv_pool import KVCache, quantize_int8  # noqa: E402

CHUNK = 256   # teacher-forced prefill chunk (what max_batched_tokens cuts a long prompt into)


def make_engine(kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_tokens=8192,
                                  max_batched_tokens=CHUNK, speculative="off"))


def session(engines: dict[str, LLMEngine], wl: AgenticWorkload) -> tuple[list[int], dict[str, list[int]]]:
    """Turns of session 0 with float32's replies as the history -> (the whole session's token ids, per
    page dtype the greedy agreement length of each turn's reply with float32's)."""
    ref = engines["float32"]
    tok = ref.tokenizer
    params = SamplingParams(max_tokens=wl.reply_tokens, temperature=0, ignore_eos=True)
    history = [{"role": "system", "content": system_prompt(tok, wl.system_tokens)}]
    agree: dict[str, list[int]] = {d: [] for d in engines if d != "float32"}
    for t in range(wl.turns):
        history.extend(wl.turn_messages(tok, 0, t))
        prompt = encode_chat(tok, history)
        [want] = ref.generate([prompt], params)
        for d, agreed in agree.items():
            [got] = engines[d].generate([prompt], params)
            n = 0
            while n < len(want.token_ids) and n < len(got.token_ids) and got.token_ids[n] == want.token_ids[n]:
                n += 1
            agreed.append(n)
        history.append({"role": "assistant", "content": tok.decode(want.token_ids)})
    return encode_chat(tok, history), agree


def pool_attention(engine: LLMEngine, kv_cache_dtype: str):
    """An attention backend of ``engine``'s kind over a new pool of ``kv_cache_dtype`` pages with the
    engine's geometry and page count (the engine's page allocator hands out its pages too)."""
    mc, attn = engine.model_config, engine.runner.attn
    kv = KVCache(mc.num_layers, engine.pool.num_pages, engine.config.page_size, mc.num_kv_heads, mc.head_dim,
                 engine.kv.dtype, engine.device, layout=attn.kv_layout, kv_dtype=getattr(torch, kv_cache_dtype))
    return type(attn)(kv=kv, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)


@torch.inference_mode()
def teacher_forced(engine: LLMEngine, attn, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Log-probabilities (N, vocab) after each of ``ids``, computed by ``engine``'s model in CHUNK-token
    prefill steps over ``attn``'s paged pool (every key read back from it) -> (logprobs, the pages used:
    give them back with ``engine.pool.free``)."""
    P = engine.config.page_size
    engine.flush_cache()
    pages = engine.pool.alloc(-(-len(ids) // P))
    model, out = engine.model, []
    for s in range(0, len(ids), CHUNK):
        e = min(s + CHUNK, len(ids))
        slots = torch.tensor([pages[i // P] * P + i % P for i in range(s, e)])
        attn.plan(BatchLayout([e - s], [e], [pages], slots))
        hidden = model(torch.tensor(ids[s:e]), torch.arange(s, e), attn)          # (e - s, d)
        out.append(torch.log_softmax(model.compute_logits(hidden), -1))         # (e - s, vocab)
    return torch.cat(out), pages


def compare(ref: torch.Tensor, got: torch.Tensor, ids: list[int]) -> dict:
    """Next-token distributions (N, vocab) against float32's: top-1 agreement and |delta logprob| of the
    reference token (the one that follows in ``ids``)."""
    nxt = torch.tensor(ids[1:])
    ref, got = ref[:-1], got[:-1]
    delta = (got.gather(1, nxt[:, None]) - ref.gather(1, nxt[:, None])).abs().squeeze(1).double()
    return {"positions": len(nxt), "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).double().mean().item(),
            "mean_abs_dlogprob": delta.mean().item(), "p99_abs_dlogprob": torch.quantile(delta, 0.99).item(),
            "max_abs_dlogprob": delta.max().item()}


def scale_granularity(engine: LLMEngine, pages: list[int], n: int) -> dict:
    """Relative RMS error of int8 K/V with a scale per (token, KV head) vs per (page, KV head), over the
    first ``n`` tokens' real K/V in ``engine``'s float32 pool (pages as the teacher-forced pass left them)."""
    P = engine.config.page_size
    full = n // P
    slots = torch.tensor([pages[i // P] * P + i % P for i in range(full * P)])
    err = {"per_token": [0.0, 0.0], "per_page": [0.0, 0.0]}                       # K, V squared errors
    norm = [0.0, 0.0]
    for layer in range(len(engine.kv.k)):
        for i, x in enumerate(engine.kv.gather(layer, slots)):                     # (Hkv, N, D)
            q, s = quantize_int8(x)
            err["per_token"][i] += ((q.float() * s[..., None] - x) ** 2).sum().item()
            xp = x.reshape(x.shape[0], full, P * x.shape[2])                       # (Hkv, pages, P * D)
            qp, sp = quantize_int8(xp)
            err["per_page"][i] += ((qp.float() * sp[..., None] - xp) ** 2).sum().item()
            norm[i] += (x ** 2).sum().item()
    return {g: {"k_rel_rms": (e[0] / norm[0]) ** 0.5, "v_rel_rms": (e[1] / norm[1]) ** 0.5} for g, e in err.items()}


def measure(page_dtypes: tuple[str, ...], wl: AgenticWorkload) -> dict:
    """Greedy agreement with one engine per page dtype; teacher-forced with the float32 engine's model
    over a pool of each page dtype."""
    engines = {d: make_engine(d) for d in ("float32", *page_dtypes)}
    try:
        ids, agree = session(engines, wl)
        ref_engine = engines["float32"]
        ref, ref_pages = teacher_forced(ref_engine, ref_engine.runner.attn, ids)
        result = {"context_tokens": len(ids), "workload": wl.__dict__,
                  "scale_granularity": scale_granularity(ref_engine, ref_pages, len(ids)),
                  "float32": {"bytes_per_token": ref_engine.kv.bytes_per_token}}
        ref_engine.pool.free(ref_pages)
        for d in page_dtypes:
            attn = pool_attention(ref_engine, d)
            lp, pages = teacher_forced(ref_engine, attn, ids)
            ref_engine.pool.free(pages)
            result[d] = {"bytes_per_token": attn.kv.bytes_per_token, **compare(ref, lp, ids),
                         "greedy_agreement": agree[d],
                         "greedy_turns_identical": sum(a == wl.reply_tokens for a in agree[d])}
        return result
    finally:
        for e in engines.values():
            e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(ap, repeats=None)
    ap.add_argument("--quick", action="store_true", help="a shorter session (~1k tokens, 3 turns)")
    ap.add_argument("--page-dtypes", default="int8,bfloat16", help="page dtypes compared with float32")
    args = ap.parse_args()
    run = harness.Run(args, __file__)
    wl = (AgenticWorkload(sessions=1, turns=3, system_tokens=600, tool_result_tokens=120, reply_tokens=24)
          if args.quick else AgenticWorkload(sessions=1, turns=6, system_tokens=900, tool_result_tokens=150,
                                             reply_tokens=32))
    result = measure(tuple(args.page_dtypes.split(",")), wl)
    print(json.dumps(result, indent=2))
    run.write(result)


if __name__ == "__main__":
    main()
