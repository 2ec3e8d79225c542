"""What a KV pool holds when sliding layers keep only their window, against the same model with windows
ignored (``EngineConfig.sliding_window_cache``, engine/window_pool.py).

Two random models that transformers writes itself (``save_pretrained`` into a temp dir, the default
model's tokenizer): a Gemma-3-shaped one (5 local layers with a window of ``--gemma-window`` to 1 global
layer) and a gpt-oss-shaped one (sliding and full layers alternating, window ``--gpt-oss-window``), both
float32. Prompts are random token ids. Per model and side:

- ``pool``: ``--sessions`` sessions of ``--context`` prompt tokens and a short greedy reply run one
  after another, on a pool of a fixed byte budget (``kv_cache_memory_bytes``): what ``--held`` sessions'
  contexts take with windows ignored. Reported: ``sessions_held`` (sessions whose whole context, all but
  a partial last page, is still a usable hit at the end), ``bytes_per_cached_token`` (the bytes the
  pool's used pages take over the tokens the radix cache holds: every layer's bytes with windows
  ignored; the full layers' plus the sliding layers' windows honoured), ``tokens_held``. With windows
  honoured the same bytes buy a sliding pool of ``--pool-windows`` windows and a chunk first, then
  page ids for the full layers (``EngineConfig.sliding_window_pool_windows``).
- ``multi_turn``: ``--turn-sessions`` sessions take ``--turns`` turns round-robin, each turn appending
  its reply and ``--turn-tokens`` new tokens, on a pool that holds every session either way;
  ``cached_fraction`` (cached prompt tokens of turns 2+ over their prompt tokens) must be the same
  with windows honoured as ignored: the windows before the ends of cached turns are kept.

    python benchmarks/sliding_window.py --json out/sliding_window.json
    python benchmarks/sliding_window.py --json /tmp/sw.json --context 512 --sessions 4 --held 1 \
        --turn-tokens 64 --gemma-window 64 --gpt-oss-window 32        # a check that it runs, ~1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402
from benchmarks.moe_checkpoint import save_tokenizer  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.kv_pool import kv_bytes_per_token  # noqa: E402
from engine.loader import load_tokenizer  # noqa: E402

SIDES = ("honoured", "ignored")
PAGE = 16
CHUNK = 512
VOCAB = 49152   # the default model's tokenizer's ids
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=32768, tie_word_embeddings=True)


def write_model(family: str, window: int, path: str, tokenizer) -> tuple[int, int]:
    """A random checkpoint of ``family``; returns (full layers, sliding layers)."""
    import transformers

    torch.manual_seed(0)
    if family == "gemma3":
        cfg = transformers.Gemma3TextConfig(**SHAPE, intermediate_size=128, num_hidden_layers=6,
                                            sliding_window=window, sliding_window_pattern=6,
                                            query_pre_attn_scalar=16)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        cfg = transformers.GptOssConfig(**SHAPE, intermediate_size=32, num_hidden_layers=4, sliding_window=window,
                                        num_local_experts=4, num_experts_per_tok=2,
                                        rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
        model = transformers.GptOssForCausalLM(cfg)
    model.save_pretrained(path)
    save_tokenizer(tokenizer, path)
    sliding = sum(t == "sliding_attention" for t in cfg.layer_types)
    return cfg.num_hidden_layers - sliding, sliding


def layer_bytes(layers: int) -> int:
    """K and V bytes a token takes in ``layers`` layers of these models, float32."""
    return kv_bytes_per_token(layers, SHAPE["num_key_value_heads"], SHAPE["head_dim"], torch.float32)


def budget_for(held: int, context: int, layers: int, page_size: int = PAGE) -> int:
    """Bytes of a pool that holds ``held`` contexts of ``context`` tokens (page-rounded, plus a chunk's
    pages for the running request) with every layer keeping the whole context, float32."""
    return (held * -(-context // page_size) + CHUNK // page_size) * page_size * layer_bytes(layers)


def bytes_per_cached_token(ids_used: int, window_pages_used: int, cached_pages: int, full_bpt: int,
                           window_bpt: int) -> float:
    """Bytes the pool's used pages take per token the radix cache holds: each page id used carries the
    full layers' bytes, each sliding page the sliding layers' (with windows ignored: every layer's bytes
    on each page id, and no sliding pages)."""
    return round((ids_used * full_bpt + window_pages_used * window_bpt) / cached_pages, 1) if cached_pages else 0.0


def whole_context_held(cache, sequence: list[int], page_size: int) -> bool:
    """Whether the radix cache still gives a usable hit for all of ``sequence``'s computed tokens (its
    last token was sampled, never computed) but a partial last page."""
    n = (len(sequence) - 1) // page_size
    return len(cache.match_usable(sequence[:n * page_size])[0]) == n


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def engine_for(path: str, side: str, args, **extra) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, dtype="float32", page_size=PAGE, max_batched_tokens=CHUNK,
                                  max_num_seqs=4, speculative="off", sliding_window_cache=side == "honoured",
                                  sliding_window_pool_windows=args.pool_windows, **extra))


def run_pool(path: str, side: str, budget: int, layers: tuple[int, int], args) -> dict:
    """``--sessions`` contexts one after another on ``budget`` bytes; what the pool holds at the end."""
    engine = engine_for(path, side, args, kv_cache_memory_bytes=budget)
    try:
        params = SamplingParams(max_tokens=args.reply, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        sequences = []   # each session's prompt and reply: what its next turn would start with
        for seed in range(args.sessions):
            prompt = random_prompt(args.context, seed)
            sequences.append(prompt + engine.generate([prompt], params)[0].token_ids)
        wall = time.perf_counter() - start
        cache, pool, P = engine.cache, engine.pool, PAGE
        held = sum(whole_context_held(cache, seq, P) for seq in sequences)
        full, sliding = layers
        if side == "honoured":
            ids_used, window_used = pool.capacity - pool.num_free_ids, pool.window_pages_used
            full_bpt, window_bpt = layer_bytes(full), layer_bytes(sliding)
        else:
            ids_used, window_used = pool.capacity - pool.num_free, 0
            full_bpt, window_bpt = layer_bytes(full + sliding), 0
        return {"sessions_held": held, "tokens_held": (pool.capacity) * P,
                "sliding_pages": pool.window_pool.capacity if side == "honoured" else None,
                "cached_tokens": cache.cached_pages * P,
                "bytes_per_cached_token": bytes_per_cached_token(ids_used, window_used, cache.cached_pages,
                                                                 full_bpt, window_bpt),
                "pool_bytes": sum(t.numel() * t.element_size() for t in engine.kv.k + engine.kv.v),
                "prefill_tok_per_s": round(args.sessions * args.context / wall, 1), "wall_s": round(wall, 1)}
    finally:
        engine.close()


def run_multi_turn(path: str, side: str, args) -> dict:
    """Round-robin turns on a pool that holds every session: the cached fraction of turns 2+."""
    final = args.context + args.turns * (args.turn_tokens + args.reply)
    engine = engine_for(path, side, args, kv_cache_tokens=(args.turn_sessions * final // PAGE + 64) * PAGE)
    try:
        params = SamplingParams(max_tokens=args.reply, temperature=0, ignore_eos=True)
        history = {s: random_prompt(args.context, 1000 + s) for s in range(args.turn_sessions)}
        prompt_tokens = cached = 0
        for t in range(args.turns):
            for s in range(args.turn_sessions):
                if t:
                    history[s] = history[s] + random_prompt(args.turn_tokens, 10000 * t + s)
                [r] = engine.generate([history[s]], params)
                if t:
                    prompt_tokens += r.prompt_tokens
                    cached += r.cached_tokens
                history[s] = history[s] + r.token_ids
        return {"cached_fraction": round(cached / prompt_tokens, 4), "cached_tokens": cached,
                "prompt_tokens": prompt_tokens}
    finally:
        engine.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(ap, repeats=None)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens of each session")
    ap.add_argument("--sessions", type=int, default=12, help="sessions run one after another on the fixed pool")
    ap.add_argument("--held", type=int, default=2, help="the fixed pool holds this many contexts with windows ignored")
    ap.add_argument("--pool-windows", type=int, default=8,
                    help="windows the sliding layers' pool holds (EngineConfig.sliding_window_pool_windows)")
    ap.add_argument("--reply", type=int, default=4, help="greedy tokens each turn decodes")
    ap.add_argument("--gemma-window", type=int, default=256,
                    help="the Gemma-3-shaped model's local layers' window, in tokens")
    ap.add_argument("--gpt-oss-window", type=int, default=128,
                    help="the gpt-oss-shaped model's sliding layers' window, in tokens")
    ap.add_argument("--turn-sessions", type=int, default=3,
                    help="sessions of the multi-turn workload (its pool holds every one either way)")
    ap.add_argument("--turns", type=int, default=3, help="turns each multi-turn session takes")
    ap.add_argument("--turn-tokens", type=int, default=256, help="new tokens each later turn appends")
    ap.add_argument("--families", nargs="+", default=["gemma3", "gpt_oss"], choices=["gemma3", "gpt_oss"],
                    help="which random models to run")
    args = ap.parse_args(argv)
    run = harness.Run(args, __file__, argv)
    tokenizer = load_tokenizer(None)[0]
    result = {"page_size": PAGE, "dtype": "float32", "context": args.context, "sessions": args.sessions,
              "held_ignored": args.held, "pool_windows": args.pool_windows, "chunk": CHUNK, "families": {}}
    for family in args.families:
        window = args.gemma_window if family == "gemma3" else args.gpt_oss_window
        with tempfile.TemporaryDirectory() as path:
            layers = write_model(family, window, path, tokenizer)
            budget = budget_for(args.held, args.context, sum(layers))
            out = {"window": window, "full_layers": layers[0], "sliding_layers": layers[1], "pool_budget_bytes": budget}
            for side in SIDES:
                out[side] = {"pool": run_pool(path, side, budget, layers, args),
                             "multi_turn": run_multi_turn(path, side, args)}
                print(family, side, json.dumps(out[side]), flush=True)
            h, i = out["honoured"], out["ignored"]
            out["sessions_held_ratio"] = round(h["pool"]["sessions_held"] / max(1, i["pool"]["sessions_held"]), 2)
            out["bytes_per_cached_token_ratio"] = round(
                i["pool"]["bytes_per_cached_token"] / h["pool"]["bytes_per_cached_token"], 2)
            out["cached_fraction_unchanged"] = h["multi_turn"]["cached_fraction"] == i["multi_turn"]["cached_fraction"]
        result["families"][family] = out
    print(json.dumps(result, indent=2))
    return run.write(result)


if __name__ == "__main__":
    main()
